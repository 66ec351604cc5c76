"""The regression benchmark's deployment mode against the CPU harness's fork and stock stacks,
so that the mode an operator points at a GPU cluster cannot rot (issue 22, item 3).

What starts (real servers, real router, real Mooncake over loopback): a fork deployment of two
prefill and two decode instances behind one ``smg`` router and a stock 0.5.23 pair (patches
0001-0003, ``benchmark.base_tree``) behind another; the co-located reference is the suite's
shared one. Every deployment server runs with ``--api-key`` and ``--admin-api-key``, every
router with ``--api-key``: a request without the right key gets 401, so a run that judges
answers at all carried the keys.

The benchmark then runs as an operator runs it: ``python -m benchmark.regression --target-*
--base-target-* --target-reference ...`` with the keys in ``PDSAFE_BENCH_API_KEY`` /
``PDSAFE_BENCH_ADMIN_API_KEY`` and an extra ``--header``, in a process where importing sglang,
torch or the test harness fails (what ``pip install ./benchmark`` gives a client machine).
Scenarios: ``steady-state`` (through the router: every identical answer must be covered by
transfer counters summed over all four fork instances), ``spoof-health-check-rid``,
``over-capacity-deployed`` (the long-prompt probes at the deployment's own limits, their cost
announced first); a second, fork-only run of ``abort-bootstrap`` uses the admin key
(``/abort_request``).

Checked: exit 0; the preflight ran (no error; the CPU note; the reference's repeat probe); no
answer was refused for want of a key; the fork shows no leak, no hang and no unproven answer;
the probes covered every instance's limit; keys never reach report.json.

About 2 minutes on 2 cores when run alone (most of it is starting eight server processes).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import requests
from pdsafe_testkit.loopback import reserve_port
from pdsafe_testkit.servers import (
    ManagedProcess,
    ServerConfig,
    SGLangServer,
    StartupError,
    launch_server,
    server_env,
    stop_together,
    wait_healthy,
    wait_server,
)

pytestmark = [pytest.mark.server, pytest.mark.benchmark]

REPO = Path(__file__).resolve().parent.parent
API_KEY = "bench-api-" + secrets.token_hex(8)
ADMIN_KEY = "bench-admin-" + secrets.token_hex(8)
HEADER = ("X-Pdsafe-Bench", "deployment-test")
POOL = 1024
KEY_ARGS = ["--api-key", API_KEY, "--admin-api-key", ADMIN_KEY]
BLOCKED = ("sglang", "torch", "pdsafe_testkit")
RUN_TIMEOUT_S = 900


def _bearer(key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _cfg(role: str, env: dict[str, str]) -> ServerConfig:
    return ServerConfig(role=role, max_total_tokens=POOL, context_length=POOL,
                        extra_args=list(KEY_ARGS), env=dict(env))


def _router(prefills: list[SGLangServer], decodes: list[SGLangServer], log_dir: Path,
            stack: ExitStack) -> str:
    """``smg`` in front of the instances, with the workers' API key; ready once a keyed
    generation goes through."""
    port, metrics_port = reserve_port(), reserve_port()
    smg = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")
    if smg is None:
        pytest.fail("the smg router is not installed")
    argv = [smg, "launch", "--pd-disaggregation", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--policy", "round_robin", "--api-key", API_KEY, "--disable-retries",
            "--disable-circuit-breaker", "--health-check-timeout-secs", "30",
            "--health-failure-threshold", "20", "--worker-startup-timeout-secs", "600"]
    for p in prefills:
        argv += ["--prefill", p.url, str(p.bootstrap_port)]
    for d in decodes:
        argv += ["--decode", d.url]
    proc = ManagedProcess(f"router-{port}", argv, server_env(), log_dir / f"router-{port}.log")
    proc.start()
    stack.callback(proc.stop)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, "/health", ports={port, metrics_port})
    deadline = time.monotonic() + 300
    while True:
        r = requests.post(url + "/generate", headers=_bearer(), timeout=60, json={
            "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        if r.status_code == 200:
            return url
        if time.monotonic() > deadline:
            raise StartupError(f"router never served a request: {r.status_code} {r.text}")
        time.sleep(1.0)


@pytest.fixture(scope="module")
def deployments(tmp_path_factory: pytest.TempPathFactory,
                reference: SGLangServer) -> Iterator[dict[str, object]]:
    from benchmark.base_tree import DEFAULT_TREE, prepare_base_tree

    log_dir = Path(os.environ.get("PDSAFE_LOG_DIR", REPO / "build" / "test-logs")) / \
        "bench-deployment"
    base_env = prepare_base_tree(DEFAULT_TREE).env()
    t0 = time.monotonic()
    with ExitStack() as stack:
        # The suite's shared co-located reference judges the answers (it has no key: a
        # keyless server takes the benchmark's keyed requests like any other).
        plan = [("fork-p1", "prefill", {}),
                ("fork-p2", "prefill", {}), ("fork-d1", "decode", {}),
                ("fork-d2", "decode", {}), ("base-p", "prefill", base_env),
                ("base-d", "decode", base_env)]
        servers: dict[str, SGLangServer] = {"reference": reference}
        # Stopped together at the end (after the routers), never the shared reference.
        stack.callback(lambda: stop_together(*(s for n, s in servers.items()
                                               if n != "reference")))
        for name, role, env in plan:  # all start at once; waited for below
            servers[name] = launch_server(_cfg(role, env), log_dir, wait=False)
        for name, s in servers.items():
            if name != "reference":
                wait_server(s)
        fork_router = _router([servers["fork-p1"], servers["fork-p2"]],
                              [servers["fork-d1"], servers["fork-d2"]], log_dir, stack)
        base_router = _router([servers["base-p"]], [servers["base-d"]], log_dir, stack)
        print(f"deployments ready after {time.monotonic() - t0:.1f} s")
        yield {"servers": servers, "fork_router": fork_router, "base_router": base_router,
               "log_dir": log_dir}


def _run_benchmark(args: list[str], out: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """``python -m benchmark.regression ARGS`` in a process where sglang, torch and the test
    harness cannot be imported (a client-only machine); the keys come from the environment."""
    code = textwrap.dedent(f"""
        import importlib.abc, runpy, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {BLOCKED!r}:
                    raise ImportError("client-only run: " + name + " is not installed")
        sys.meta_path.insert(0, Block())
        sys.argv = ["benchmark.regression", *sys.argv[1:]]
        runpy.run_module("benchmark.regression", run_name="__main__")
    """)
    env = dict(os.environ, PDSAFE_BENCH_API_KEY=API_KEY, PDSAFE_BENCH_ADMIN_API_KEY=ADMIN_KEY)
    proc = subprocess.run([sys.executable, "-c", code, *args, "--out", str(out),
                           "--no-progress", "--header", f"{HEADER[0]}: {HEADER[1]}"],
                          cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() \
        else {}
    return proc, report


def _log(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"


def test_the_servers_require_the_keys(deployments):
    s = deployments["servers"]
    r = requests.post(s["fork-d1"].url + "/generate", timeout=30,
                      json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 401, (r.status_code, r.text[:200])
    r = requests.post(s["base-p"].url + "/abort_request", headers=_bearer(), timeout=30,
                      json={"rid": "none"})
    assert r.status_code == 401, "the admin endpoint accepted the API key"


def test_deployment_mode_against_fork_and_stock(deployments, tmp_path):
    s = deployments["servers"]
    args = ["--quick", "--no-overhead",
            "--scenarios", "steady-state,spoof-health-check-rid,over-capacity-deployed",
            "--target-prefill", f"{s['fork-p1'].url},{s['fork-p2'].url}",
            "--target-decode", s["fork-d1"].url, "--target-decode", s["fork-d2"].url,
            "--target-router", deployments["fork_router"],
            "--target-reference", s["reference"].url,
            "--base-target-prefill", s["base-p"].url, "--base-target-decode", s["base-d"].url,
            "--base-target-router", deployments["base_router"]]
    proc, rep = _run_benchmark(args, tmp_path / "deploy")
    log = _log(proc)
    assert proc.returncode == 0, log
    assert rep["mode"] == "deployment", log
    assert API_KEY not in json.dumps(rep) and ADMIN_KEY not in json.dumps(rep)
    assert rep["auth"] == {"api_key": True, "admin_key": True, "headers": [HEADER[0]]}
    pre = rep["preflight"]
    assert not [f for fs in pre.values() for f in fs if f["level"] == "error"], pre
    assert any("thread count" in f["what"] for f in pre["fork"]), pre
    assert any("repeat probe" in f["what"] for f in pre["reference"]), pre
    assert "## Preflight" in (tmp_path / "deploy" / "report.md").read_text()
    assert "note: fork: long-prompt probes at the deployment's limits" in proc.stderr, log
    cells = rep["results"]
    assert {(c["scenario"], c["variant"]) for c in cells} == {
        (n, v) for n in ("steady-state", "spoof-health-check-rid", "over-capacity-deployed")
        for v in ("fork", "base")}, log
    for c in cells:
        assert c["status"] == "ran", (c["scenario"], c["variant"], c["reason"])
        refused = [r for r in c["requests"] if r["status"] in (401, 403)]
        assert not refused, (c["scenario"], c["variant"], refused[:2])
        assert c["identical"] > 0, (c["scenario"], c["variant"], c["requests"][:2])
    fork = [c for c in cells if c["variant"] == "fork"]
    assert all(c["leaks"] == 0 and c["hangs"] == 0 and c["unproven"] == 0 for c in fork), [
        (c["scenario"], c["leaks"], c["hangs"], c["unproven"]) for c in fork]
    probes = next(c for c in fork if c["scenario"] == "over-capacity-deployed")
    limits_note = next(n for n in probes["notes"] if n.startswith("limits "))
    for role in ("'prefill'", "'prefill-2'", "'decode'", "'decode-2'"):
        assert role in limits_note, limits_note
    assert any(n.startswith("long-prompt probes at the deployment's limits") for n in
               probes["notes"]), probes["notes"]
    print(f"deployment mode, fork 2+2 instances and stock: {rep['timing']['total_s']} s")


def test_the_admin_key_reaches_abort_request(deployments, tmp_path):
    s = deployments["servers"]
    args = ["--quick", "--no-overhead", "--scenarios", "abort-bootstrap",
            "--target-prefill", s["fork-p1"].url, "--target-decode", s["fork-d1"].url,
            "--target-router", deployments["fork_router"],
            "--target-reference", s["reference"].url]
    proc, rep = _run_benchmark(args, tmp_path / "abort")
    log = _log(proc)
    assert proc.returncode == 0, log
    (cell,) = rep["results"]
    assert cell["status"] == "ran", (cell["reason"], log)
    assert cell["leaks"] == 0 and cell["hangs"] == 0, cell
    assert cell["explicit_errors"] > 0, cell  # the aborted requests: explicit errors
