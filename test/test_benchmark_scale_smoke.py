"""CI smoke of the scale benchmark: ``python -m benchmark.scale --smoke`` (about a minute).

The benchmark's whole code path at a tiny size, so that it cannot rot: a real Mooncake KV pair
of the model-free harness started with ``bookkeeping=True`` (upstream's allocators with page
generations, every protection hook where the patches call it), 2,048 and 8,192 tokens at page
sizes 1 and 64, one timed and one memory-traced transfer per cell, the report and the plot.

Checks that every transfer committed with its coverage gate and KV digest passing and every
decode row its own, that every stage the report names was measured on the leg that runs it
(a stage that silently stopped being called would read 0), that the hook time partition adds
up, and the memory columns. No timing assertion (the targets are for the incident's sizes,
docs/benchmark.md); exit status 1 (a target missed) is accepted, 2 (the run failed) is not.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.benchmark]

REPO = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 900

#: The stages each leg must show (the hooks a patched scheduler runs there).
STAGES_BY_SIDE = {
    "prefill": ("attestation", "minting", "page generations", "lease, quarantine",
                "digest planning", "digest"),
    "decode": ("attestation", "minting", "page generations", "lease, quarantine",
               "digest planning", "digest"),
}


def test_scale_benchmark_smoke(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmark.scale", "--smoke", "--out", str(tmp_path),
         "--no-progress"],
        cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    log = f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
    assert proc.returncode in (0, 1), log
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["failed_transfers"] == 0, log
    records = report["records"]
    assert {(r["page_size"], r["tokens"], r["kind"]) for r in records} == {
        (ps, n, k) for ps in (1, 64) for n in (2048, 8192) for k in ("time", "memory")}
    for r in records:
        assert r["ok"] and r["gate"] == "ok" and r["digest"] == "ok", r
        assert r["own_rows"] == r["rows_expected"] == 2 * r["tokens"]
        assert r["transfer_s"] is not None and r["transfer_s"] > 0
    for cell in report["cells"]:
        for side, stages in STAGES_BY_SIDE.items():
            s = cell["sides"][side]
            ns = s["stages_ns"]
            missing = [st for st in stages if not ns[st] > 0]
            assert not missing, f"{side} measured nothing for {missing}: {cell}"
            total = sum(ns[st] for st in ("attestation", "minting", "page generations",
                                          "lease, quarantine", "digest planning", "digest",
                                          "other hooks"))
            assert total == pytest.approx(ns["total"], rel=1e-6)
            assert s["retained_bytes"] > 0 and s["table_bytes_per_pool_token"] > 0
            assert s["transient_peak_bytes_per_token"] is not None
    md = (tmp_path / "report.md").read_text()
    assert "## Time per stage" in md and "## Targets" in md
    assert (tmp_path / "scale.png").exists()
