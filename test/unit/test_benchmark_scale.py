"""The scale benchmark's analysis (``benchmark.scale``) on synthetic measurements (no processes).

What the report claims rests on these: every outermost hook's time lands in exactly one stage
(their sum is the legs' hook total), the digest's planning is split off the digest and only the
hashing is excluded from the bookkeeping, the per-token slope ratio, the share of the transfer
and the bytes per token are computed as docs/benchmark.md defines them, and a failed transfer
or a missed target is never reported as met. The end-to-end path (real KV pair, every hook) is
test/test_benchmark_scale_smoke.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmark import scale


def _cost(n: int, per_token_ns: float, *, plan_ns: int = 0, fixed_ns: int = 0,
          retained_per_token: float = 4.0) -> dict[str, Any]:
    """One leg's measurement: every stage's hooks cost ``per_token_ns`` per token."""
    hooks = {"coverage.attest_prefill_hook": n * per_token_ns + fixed_ns,
             "transfer_generation.mint": n * per_token_ns,
             "page_generation.note_source_chunk": n * per_token_ns,
             "quarantine.hold": 1000,
             "kv_integrity.prefill_write_row": n * per_token_ns + plan_ns,
             "room_guard.released": 500}
    total = sum(hooks.values())
    return {"outermost": {h: [1, ns] for h, ns in hooks.items()},
            "hooks": {**{h: [1, ns] for h, ns in hooks.items()}, "*": [len(hooks), total]},
            "retained_bytes": int(n * retained_per_token), "table_bytes": 8 * (n + 17),
            "table_pages": n + 17, "digest_plan_ns": plan_ns, "first_send_at": 0.0,
            "forward_ns": 10, "transient_peak_bytes": {"coverage.attest_prefill_hook": 8 * n}}


def _records(per_token_ns: dict[int, float], *, transfer_s: float = 10.0, ok: bool = True,
             retained_per_token: float = 4.0) -> list[dict[str, Any]]:
    out = []
    for n, pt in per_token_ns.items():
        for rep, kind in enumerate(("time", "time", "memory")):
            cost = {s: _cost(n, pt, plan_ns=n, retained_per_token=retained_per_token)
                    for s in scale.SIDES}
            out.append({"backend": "mooncake", "page_size": 1, "layout": "contiguous",
                        "tokens": n, "rep": rep, "kind": kind, "ok": ok, "wall_s": 1.0,
                        "transfer_s": transfer_s * n / max(per_token_ns), "forward_s": 0.1,
                        "cost": cost})
    return out


def test_stages_partition_the_hook_total_and_split_the_digest_planning() -> None:
    st = scale.side_stages(_cost(1000, 2.0, plan_ns=700, fixed_ns=300))
    assert st["attestation"] == 2300 and st["minting"] == 2000
    assert st["page generations"] == 2000 and st["lease, quarantine"] == 1000
    assert st["digest planning"] == 700 and st["digest"] == 2000
    assert st["other hooks"] == 500
    assert sum(st[s] for s in scale.STAGE_NAMES) == st["total"]
    assert st["bookkeeping"] == st["total"] - st["digest"]  # only the hashing is excluded
    assert scale.stage_of("commit_gate.admit_commit") == "attestation"
    assert scale.stage_of("source_lease.release_drained") == "lease, quarantine"
    assert scale.stage_of("peer_release.on_sender_created") == "other hooks"


def test_targets_linear_share_and_memory() -> None:
    plan = scale.Plan(sizes=[65_536, 1_048_576], page_sizes=[1], backends=["mooncake"])
    sizes = {65_536: 100.0, 1_048_576: 100.0}
    summary = scale.analyze(_records(sizes, transfer_s=1000.0), plan)
    (series,) = summary["series"]
    assert series["slope_ratio"] == pytest.approx(1.0, rel=0.02)
    assert series["linear"] and series["memory_met"]
    # 4 retained + 8 table bytes per token (the table: 8 bytes per pool page of one token)
    assert series["added_bytes_per_token_max"] == pytest.approx(12.0, abs=0.1)
    cell = next(c for c in summary["cells"] if c["tokens"] == 1_048_576)
    both = sum(cell["sides"][s]["stages_ns"]["bookkeeping"] for s in scale.SIDES) / 1e9
    assert cell["share_of_transfer"] == pytest.approx(both / 1000.0)
    assert series["share_met"] and summary["targets_met"]
    assert cell["transfer_bytes"] == 1_048_576 * plan.bytes_per_token

    quadratic = scale.analyze(_records({65_536: 100.0, 1_048_576: 1600.0}), plan)
    assert not quadratic["series"][0]["linear"] and not quadratic["targets_met"]
    fat = scale.analyze(_records(sizes, transfer_s=1000.0, retained_per_token=9.0), plan)
    assert not fat["series"][0]["memory_met"] and not fat["targets_met"]
    failed = scale.analyze(_records(sizes, transfer_s=1000.0, ok=False), plan)
    assert failed["failed_transfers"] and not failed["targets_met"]


def test_report_renders_every_table_and_the_plot(tmp_path: Path) -> None:
    plan = scale.Plan(sizes=[65_536, 1_048_576], page_sizes=[1], backends=["mooncake"])
    records = _records({65_536: 120.0, 1_048_576: 100.0}) + [
        {"backend": "mooncake", "page_size": 1, "layout": "fragmented", "tokens": 1_048_576,
         "kind": "skipped", "ok": True, "reason": "too many pages"}]
    summary = scale._dump(tmp_path, records, plan, "now", 0.0, None, command="test")
    md = (tmp_path / "report.md").read_text()
    for heading in ("## Time per stage", "## Memory per leg", "## Targets"):
        assert heading in md
    assert "skipped: too many pages" in md and "1,048,576" in md
    assert summary["meta"]["tree"]["commit"]
    assert (tmp_path / "report.json").stat().st_size > 0
    if summary["plot"]:
        assert (tmp_path / "scale.png").stat().st_size > 1000


def test_pairs_share_a_process_only_for_small_pools() -> None:
    smoke = scale.Plan(sizes=[2048, 8192], page_sizes=[1, 64], backends=["mooncake"])
    assert scale._pair_groups(smoke, "contiguous") == [(1, 64)]
    full = scale.Plan()
    assert scale._pair_groups(full, "contiguous") == [(1,), (16,), (64,)]
