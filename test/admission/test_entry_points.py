"""Every entry point runs the startup checks and the client-input checks (issue 19, item 7).

The offline ``sglang.Engine`` in PD mode, started for real on the CPU in a child process (as a
user's program would): the launcher's startup hook runs (report, self-check), the fake
transfer backend refuses to start, and a request built in-process (no HTTP request object)
is checked like any client's: the fake bootstrap host and the ``HEALTH_CHECK`` rid prefix are
refused. The HTTP server's checks are ``test_client_guard.py``'s, ``--smg-grpc-mode``'s are
``test_grpc_entry_point.py``'s; docs/operator-guide.md ("Entry points") says which checks run at
each entry point, ``--use-ray`` included, and why that one is not started by the tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pdsafe_testkit.loopback import reserve_port
from pdsafe_testkit.servers import DEFAULT_MODEL, server_env

ENGINE = textwrap.dedent(r"""
    import json, logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    import sglang
    from sglang.pdsafe.client_guard import SpoofedInternalFieldError

    mode, backend, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    out = {}
    try:
        engine = sglang.Engine(
            model_path=sys.argv[4], device="cpu", dtype="float32", max_total_tokens=1024,
            context_length=1024, disaggregation_mode=mode,
            disaggregation_transfer_backend=backend, disaggregation_bootstrap_port=port,
            random_seed=0, log_level="info")
    except Exception as e:  # the start refused
        out["start_error"] = f"{type(e).__name__}: {e}"
        print("RESULT " + json.dumps(out), flush=True)
        sys.exit(0)
    for name, kwargs in (
            ("fake_host", {"bootstrap_host": "2.2.2.2", "bootstrap_port": port,
                           "bootstrap_room": 7}),
            ("health_rid", {"rid": "HEALTH_CHECK_spoof", "bootstrap_host": "127.0.0.1",
                            "bootstrap_port": port, "bootstrap_room": 8})):
        try:
            engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1},
                            **kwargs)
            out[name] = "served"
        except SpoofedInternalFieldError as e:
            out[name] = f"refused: {e}"
        except Exception as e:
            out[name] = f"other: {type(e).__name__}: {e}"
    engine.shutdown()
    print("RESULT " + json.dumps(out), flush=True)
""")


def _run(mode: str, backend: str, tmp_path: Path) -> tuple[dict, str]:
    port = reserve_port()
    log = tmp_path / f"engine-{mode}-{backend}.log"
    with log.open("w") as f:
        proc = subprocess.run(
            [sys.executable, "-c", ENGINE, mode, backend, str(port), str(DEFAULT_MODEL)],
            stdout=subprocess.PIPE, stderr=f, text=True, timeout=300,
            # Without the check, the spoofed request would wait for a decode that never comes:
            # a short bootstrap timeout makes that an answer ("other: ..."), not a hang.
            env=server_env({"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "15"}))
    text = log.read_text()
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, f"the engine script printed no result (rc {proc.returncode}):\n" \
        f"{proc.stdout[-2000:]}\n{text[-4000:]}"
    return json.loads(line.removeprefix("RESULT ")), text


def test_the_offline_engine_runs_the_startup_checks_and_checks_its_callers(tmp_path):
    out, log = _run("prefill", "mooncake", tmp_path)
    assert "start_error" not in out, out
    assert "pdsafe hook API self-check:" in log, log[-3000:]
    assert "prefill protections active:" in log and "client-bypass-guard" in log
    # A caller that passes no HTTP request is a client like any other.
    assert out["fake_host"].startswith("refused:") and "2.2.2.2" in out["fake_host"], out
    assert out["health_rid"].startswith("refused:") and "HEALTH_CHECK" in out["health_rid"], out


@pytest.mark.parametrize("mode", ["decode"])
def test_the_offline_engine_refuses_the_fake_transfer_backend(mode, tmp_path):
    out, log = _run(mode, "fake", tmp_path)
    assert "FakeTransferRefusedError" in out.get("start_error", ""), (out, log[-3000:])
    assert "SGLANG_PDSAFE_WAIVE_FAKE_TRANSFER" in out["start_error"]
