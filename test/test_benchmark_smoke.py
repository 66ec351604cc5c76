"""CI smoke test of the regression benchmark: ``python -m benchmark.regression --smoke``.

What runs (docs/benchmark.md, "CI smoke"): by default ``--smoke``, i.e. ``--quick`` (mooncake,
page size 1, few requests, one overhead repetition) restricted to the scenarios of the
``default`` stack (``benchmark.scenarios.SMOKE_SCENARIOS``), so it fits CI's time budget; with
``PDSAFE_BENCH=1`` the whole ``--quick`` matrix (every stack kind) instead. Both variants run
(stock 0.5.23 with only the CPU patches, and the installed fork; real servers on the CPU
harness), and the test checks what the benchmark promises:

* exit status 0 and a complete report.json (schema keys, every selected scenario reported per
  variant, not-implemented ones included in ``--quick``, overhead ratios with their spread);
* the fork: zero leaks and zero hangs in every scenario and in the overhead bursts;
* the base variant LEAKS or HANGS in at least one scenario where upstream is known unsafe (the
  benchmark proves it can see the bug; a benchmark that cannot would pass any fork);
* the servers really ran the variants they were labelled with (versions from /server_info).

No timing assertion: the run's wall time is in report.json ``timing`` and printed with ``-s``;
the subprocess timeout below only stops a run that hangs as a whole.

The report writer, the outcome classifier and the stack kinds are tested without servers in
test/unit/test_benchmark_report.py, test_benchmark_outcomes.py and test_benchmark_stacks.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark.report import CELL_KEYS, TOP_KEYS
from benchmark.scenarios import FULL_ONLY, SCENARIOS, SMOKE_SCENARIOS

pytestmark = [pytest.mark.server, pytest.mark.benchmark]

REPO = Path(__file__).resolve().parent.parent
#: PDSAFE_BENCH=1: the whole --quick matrix instead of the CI smoke.
FULL_QUICK = os.environ.get("PDSAFE_BENCH", "0") == "1"
#: Hang guard for the whole run (not a performance bound: the benchmark bounds each request).
RUN_TIMEOUT_S = 3600


def _expected_scenarios() -> list[str]:
    return list(SCENARIOS) if FULL_QUICK else list(SMOKE_SCENARIOS)


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("bench-quick" if FULL_QUICK else "bench-smoke")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmark.regression", "--quick" if FULL_QUICK else "--smoke",
         "--out", str(out), "--no-progress"],
        cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )
    log = f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, log
    report = json.loads((out / "report.json").read_text())
    for png in report["plots"]:
        assert (out / png).stat().st_size > 1000, png
    assert (out / "report.md").is_file()
    print(f"benchmark {'--quick' if FULL_QUICK else '--smoke'}: "
          f"{report['timing']['total_s']} s\n{proc.stdout[-2000:]}")
    return report, log


def test_quick_report_schema(quick_report):
    rep, log = quick_report
    assert set(TOP_KEYS) <= set(rep), set(TOP_KEYS) - set(rep)
    assert rep["quick"] is True and rep["mode"] == "harness"
    assert rep["config"]["scenarios"] == _expected_scenarios(), rep["config"]["scenarios"]
    base, fork = rep["versions"]["base"], rep["versions"]["fork"]
    assert base and "+pdsafe" not in base, base
    assert fork and "+pdsafe" in fork, fork
    assert {"leak_matrix.png", "overhead_ratios.png", "latency_distribution.png"} <= set(
        rep["plots"])
    cells = rep["results"]
    for c in cells:
        assert set(CELL_KEYS) <= set(c), set(CELL_KEYS) - set(c)
    seen = {(c["scenario"], c["variant"]) for c in cells}
    missing = {(s, v) for s in _expected_scenarios() for v in ("base", "fork")} - seen
    assert not missing, f"scenarios silently absent from the report: {sorted(missing)}"
    for c in cells:
        s = SCENARIOS[c["scenario"]]
        if not s.implemented:
            assert c["status"] == "not_implemented" and c["reason"], c["scenario"]
        elif s.harness_ok and not s.in_quick:  # full matrix only (docs/benchmark.md)
            assert c["status"] == "not_applicable" and c["reason"] == FULL_ONLY, c["scenario"]
        elif s.harness_ok:
            assert c["status"] == "ran", (c["scenario"], c["variant"], c["status"], c["reason"])
            assert c["sent"] > 0, c["scenario"]
            # Read from both servers after every scenario, unless one died in it (reported).
            assert c["pages_reserved_after"] is not None or c["servers_down"], c["scenario"]
    assert rep["summary"]["cell_errors"] == [], rep["summary"]["cell_errors"]
    oh = rep["overhead"]
    assert oh["status"] == "measured", oh
    for m in ("throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s"):
        r = oh["steady"]["ratios"][m]
        assert r["mean"] is not None and r["mean"] > 0 and r["min"] <= r["mean"] <= r["max"], m
    assert oh["sweep"], "no prompt-length sweep in the overhead section"


def test_fork_has_no_leak_and_no_hang(quick_report):
    rep, _ = quick_report
    bad = [(c["scenario"], c["leaks"], c["hangs"], c["leak_details"], c["hang_details"])
           for c in rep["results"] if c["variant"] == "fork" and (c["leaks"] or c["hangs"])]
    assert not bad, bad
    content = rep["overhead"]["content"]["fork"]
    assert content["leak"] == 0 and content["hang"] == 0, content
    steady = [c for c in rep["results"] if c["scenario"] == "steady-state"]
    assert steady and all(c["identical"] == c["sent"] for c in steady), [
        (c["variant"], c["identical"], c["sent"], c["requests"][:2]) for c in steady]
    assert rep["summary"]["fork_failures"] == []


def test_base_shows_the_upstream_bug(quick_report):
    rep, _ = quick_report
    unsafe = {n for n, s in SCENARIOS.items() if s.known_unsafe_upstream}
    seen = [c for c in rep["results"] if c["variant"] == "base" and c["scenario"] in unsafe
            and (c["leaks"] or c["hangs"])]
    base = [(c["scenario"], c["identical"], c["explicit_errors"]) for c in rep["results"]
            if c["variant"] == "base"]
    assert seen, ("stock 0.5.23 showed no leak and no hang in any scenario where upstream is "
                  f"known unsafe: the benchmark cannot see the bug {base}")
    leaks = [d for c in seen for d in c["leak_details"]]
    for d in leaks:
        assert d["detail"] and d["output_head"] != d["expected_head"], d
