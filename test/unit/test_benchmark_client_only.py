"""The regression benchmark's client-only install and deployment-mode options (issue 22, item 3),
without servers.

* Deployment mode imports neither sglang, torch nor the test harness: a subprocess that makes
  those imports fail still imports ``benchmark.regression`` and parses deployment arguments
  (what ``pip install ./benchmark`` gives an operator: ``benchmark/pyproject.toml`` declares
  ``requests`` only).
* Keys and headers: the API key on ordinary requests, the admin key on upstream's admin
  endpoints, extra headers everywhere; report.json never gets their values.
* Several prefill and decode instances: roles, evidence and limits cover all of them.
* The preflight's findings for the reference's settings (determinism on GPUs), and the repeat
  probe.
* The long-prompt probes: their cost is stated, a cap leaves the longest out.

The deployment run itself against the CPU harness's fork and stock stacks:
test/test_benchmark_deployment.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib

from benchmark import preflight, transport
from benchmark.canary import CanaryBook
from benchmark.outcomes import Outcome, RequestRecord
from benchmark.regression import parse_args, redacted
from benchmark.scenarios import _probe_plan, probe_cost
from benchmark.targets import PDTarget

REPO = Path(__file__).resolve().parents[2]
BLOCKED = ("sglang", "torch", "pdsafe_testkit", "numpy", "matplotlib")


def test_deployment_mode_needs_no_server_package():
    code = textwrap.dedent(f"""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {BLOCKED!r}:
                    raise ImportError("blocked for the client-only check: " + name)
        sys.meta_path.insert(0, Block())
        from benchmark import regression
        a = regression.parse_args(["--target-prefill", "http://p1:1,http://p2:1",
                                   "--target-decode", "http://d1:1", "--target-decode",
                                   "http://d2:1", "--target-reference", "http://r:1",
                                   "--admin-api-key", "adm", "--header", "X-Tenant: t1"])
        assert a.deployment and a.target_prefill == ["http://p1:1", "http://p2:1"], a
        assert a.target_decode == ["http://d1:1", "http://d2:1"], a
        assert a.headers == {{"X-Tenant": "t1"}}, a.headers
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in {BLOCKED!r})
        assert not loaded, loaded
        print("CLIENT-ONLY OK")
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "CLIENT-ONLY OK" in proc.stdout, proc.stderr[-3000:]


def test_the_client_package_declares_only_requests():
    bench = tomllib.loads((REPO / "benchmark" / "pyproject.toml").read_text())
    root = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pdsafe"]
    assert bench["project"]["dependencies"] == ["requests>=2.28"]
    assert bench["tool"]["setuptools"]["package-dir"] == {"benchmark": "."}
    assert bench["project"]["version"] == (
        f"{root['upstream-version']}+pdsafe.{root['pdsafe-release']}")


def test_keys_go_to_their_endpoints_and_never_into_the_report(monkeypatch):
    auth = transport.configure("api-k", "admin-k", {"X-Tenant": "t1"})
    try:
        assert auth.for_path("/generate") == {"X-Tenant": "t1", "Authorization": "Bearer api-k"}
        assert auth.for_path("/abort_request")["Authorization"] == "Bearer admin-k"
        assert auth.for_path("/metrics")["X-Tenant"] == "t1"
        assert auth.describe() == {"api_key": True, "admin_key": True, "headers": ["X-Tenant"]}
        only_api = transport.configure("api-k")
        assert only_api.for_path("/abort_request")["Authorization"] == "Bearer api-k"
    finally:
        transport.configure()
    argv = ["--api-key", "api-k", "--admin-api-key=admin-k", "--header", "Authz: tok",
            "--target-decode", "http://d:1"]
    assert redacted(argv) == ["--api-key", "***", "--admin-api-key=***", "--header", "***",
                              "--target-decode", "http://d:1"]
    monkeypatch.setenv("PDSAFE_BENCH_API_KEY", "from-env")
    a = parse_args(["--target-prefill", "http://p:1", "--target-decode", "http://d:1",
                    "--target-reference", "http://r:1"])
    assert a.api_key == "from-env"
    with pytest.raises(SystemExit):
        parse_args(["--target-prefill", "http://p:1", "--target-decode", "http://d:1",
                    "--target-reference", "http://r:1", "--header", "no colon"])


def _target() -> PDTarget:
    return PDTarget("fork", "mooncake", 1, "deployed", "http://p1", "http://d1", "http://r",
                    "p1", 8998, {}, CanaryBook(1000), extra_prefills=["http://p2"],
                    extra_decodes=["http://d2", "http://d3"])


def test_several_instances_are_all_covered():
    t = _target()
    assert t.urls() == {"prefill": "http://p1", "prefill-2": "http://p2", "decode": "http://d1",
                        "decode-2": "http://d2", "decode-3": "http://d3", "router": "http://r"}
    assert t.counter_urls() == (["http://p1", "http://p2"],
                                ["http://d1", "http://d2", "http://d3"])
    assert t.live_decode_urls() == ["http://d1", "http://d2", "http://d3"]


def _info(mode: str, **kw) -> dict:
    base = {"disaggregation_mode": mode, "served_model_name": "m", "dtype": "bfloat16",
            "kv_cache_dtype": "auto", "quantization": None, "attention_backend": "fa3",
            "tp_size": 1, "device": "cuda", "enable_deterministic_inference": True,
            "disaggregation_transfer_backend": "mooncake" if mode != "null" else "",
            "page_size": 64, "context_length": 4096}
    base.update(kw)
    return base


def _levels(found: list[preflight.Finding]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in found:
        out.setdefault(f.level, []).append(f.what)
    return out


def test_preflight_accepts_a_deterministic_gpu_deployment():
    infos = {"reference": _info("null"), "prefill": _info("prefill"),
             "prefill-2": _info("prefill"), "decode": _info("decode")}
    assert preflight.check(infos) == []


def test_preflight_says_when_determinism_is_not_guaranteed():
    infos = {"reference": _info("null", enable_deterministic_inference=False),
             "prefill": _info("prefill"), "decode": _info("decode")}
    found = _levels(preflight.check(infos))
    assert list(found) == ["warning"], found
    assert "--enable-deterministic-inference" in found["warning"][0]
    assert "false leaks" in found["warning"][0] and "reference" in found["warning"][0]
    strict = _levels(preflight.check(infos, require_determinism=True))
    assert "error" in strict, strict


def test_preflight_refuses_a_reference_that_cannot_judge():
    infos = {"reference": _info("null", dtype="float16", served_model_name="other"),
             "prefill": _info("prefill"), "decode": _info("prefill"),
             "decode-2": _info("decode", page_size=16)}
    errors = _levels(preflight.check(infos))["error"]
    assert any("different models" in e for e in errors), errors
    assert any(e.startswith("dtype differs") for e in errors), errors
    assert any("decode runs disaggregation_mode='prefill'" in e for e in errors), errors
    assert any("decode instances disagree on page_size" in e for e in errors), errors


def test_preflight_notes_what_it_cannot_see_on_the_cpu():
    infos = {r: _info(m, device="cpu", enable_deterministic_inference=False)
             for r, m in (("reference", "null"), ("prefill", "prefill"), ("decode", "decode"))}
    found = _levels(preflight.check(infos))
    assert list(found) == ["note"] and "thread count" in found["note"][0], found


def test_the_repeat_probe_catches_a_batch_dependent_reference():
    def stable(p, n):
        return [t + 1 for t in p[:n]]

    ok = preflight.repeat_probe(stable, vocab=1000,
                                concurrent=lambda jobs: [stable(p, n) for p, n in jobs])
    assert [f.level for f in ok] == ["note"]
    bad = preflight.repeat_probe(stable, vocab=1000,
                                 concurrent=lambda jobs: [[0] * n for _p, n in jobs])
    assert [f.level for f in bad] == ["error"] and "not deterministic" in bad[0].what


def test_long_prompt_probes_state_their_cost_and_respect_the_cap():
    lengths = [1048574, 1048575, 1048576, 1048639]
    assert _probe_plan(lengths, 0) == (lengths, [])
    run, skipped = _probe_plan(lengths, 1048575)
    assert run == [1048574, 1048575] and skipped == [1048576, 1048639]
    timed = [RequestRecord("victim-0", "router", 2000, 16, Outcome.IDENTICAL, e2e_s=0.5)]
    text = probe_cost(run, skipped, timed, 1048575)
    assert "2 request(s)" in text and f"{sum(run)} prompt tokens in all" in text
    assert "4000 prompt tokens/s" in text and f"about {sum(run) / 4000:.0f} s" in text
    assert "not sent (over --max-probe-tokens 1048575): 1048576, 1048639" in text
