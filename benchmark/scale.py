"""Bookkeeping at the incident's scale: what the protections' own bookkeeping costs per token.

  python -m benchmark.scale [--sizes 65536,262144,681280,1048576] [--page-sizes 1,16,64]
      [--backends mooncake,nixl] [--layouts contiguous,fragmented] [--reps 3] [--no-memory]
      [--regression] [--smoke] [--out build/bench-scale]

The incident's numbers: a 1,048,576-token context, a prefill KV pool of 681,280 tokens, about
54 KB of KV per token per attention rank. This benchmark drives single requests of those
lengths through the model-free KV harness (``pdsafe_testkit.kv``: the real Mooncake / NIXL KV
managers, senders and receivers in two processes, upstream's real allocators and pools) with
a per-token KV that fits a 2-core, 24 GiB machine (1 layer, one 32-byte K row and one V row
per token), started with ``bookkeeping=True``: every protection hook a patched scheduler runs
around a transfer runs where the patches call it (``pdsafe_testkit.kv.bookkeeping``).

What it measures, per transfer and leg, directly (end-to-end ratios on this machine spread too
much to resolve 1 %): the time inside every pdsafe hook (``policy.measure_cost``; upstream code
a hook runs, such as the release it guards, excluded), partitioned by the hook upstream called
(``policy.hook_cost_outermost``) into stages:

==================  ========================================================================
stage               hooks
==================  ========================================================================
attestation         ``coverage.*`` (reservation, prefill's attestation), ``commit_gate.*``
minting             ``transfer_generation.*`` (mint, frames, checks of every message)
page generations    ``page_generation.*`` (snapshots, checks at commit and Success, stamps)
lease, quarantine   ``source_lease.*``, ``quarantine.*`` (a failed transfer's records, run
                    for the same pages after the transfer: every transfer here succeeds)
digest planning     ``kv_digest.plan_request`` on the request's row, timed apart (the fastest
                    of 3 runs; it runs inside the digest hooks; subtracted from them)
digest              ``kv_integrity.*`` less the planning: the hashing (excluded from the 1 %)
other hooks         the rest (room guard, peer release, peer capability, ...)
==================  ========================================================================

next to the transfer time of the same request (prefill's first ``send`` until decode polls
Success) and the harness's stand-in for the forward (writing the request's pattern into the
prefill pool). Memory per leg: the transfer record's retained size while the request is in
flight (coverage, page-generation snapshots, digest row, holds: tensors counted by storage),
the standing page-generation table (8 bytes per pool page), and, in one extra transfer per
cell with ``tracemalloc`` on, the peak Python/numpy memory inside any hook (transient).

The targets (issue 22): per-token cost linear in the context (the per-token cost at the
largest size within 1.2x of the smallest's); the bookkeeping, digest excluded, at most 1 % of
the transfer time at 1,048,576 tokens; at most 16 bytes per token added, the KV excluded. The
transfer here moves 64 bytes per token over loopback TCP, not the incident's 54 KB over RDMA,
so the report gives the share against the harness's own transfer and against the incident's
KV at the harness's measured bandwidth and at a 400 Gb/s link (50 GB/s).

``--regression``: the second data point, the regression benchmark's default workload (the
``default`` stack, fork, Mooncake, page size 1; the overhead's ``steady`` burst of 48
streaming requests, concurrency 4, 32 new tokens) on servers started with
``SGLANG_PDSAFE_HOOK_COST=1``: both legs' ``sglang:pdsafe_hook_seconds_total`` and
``hook_calls_total`` read from ``/metrics`` around the burst and divided by its requests,
next to the same requests' forward and transfer times (upstream's per-stage latency
histograms) and the client's latencies.

Outputs in ``--out``: report.json (every transfer's raw measurement), report.md (the tables
docs/benchmark.md quotes), scale.png. Exit status 1 when a transfer failed or a target was
missed, 2 when the run could not be carried out, else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

INCIDENT_SIZES = (65_536, 262_144, 681_280, 1_048_576)
PAGE_SIZES = (1, 16, 64)
BACKENDS = ("mooncake", "nixl")
LAYOUTS = ("contiguous", "fragmented")
#: The incident's KV per token per attention rank (GLM-5.3, issue 22: ~56 GB at 1M tokens).
INCIDENT_KV_BYTES_PER_TOKEN = 54_000
#: A 400 Gb/s NIC per rank, the nominal link the projection also uses.
NOMINAL_LINK_BYTES_S = 50e9
TARGET_SLOPE_RATIO = 1.2
TARGET_SHARE = 0.01
TARGET_BYTES_PER_TOKEN = 16.0
#: A fragmented layout moves one descriptor per page: past this many pages a loopback-TCP
#: transfer takes minutes (1M pages of 32 bytes: about 4 min on Mooncake), so such cells are
#: reported skipped.
FRAGMENTED_MAX_PAGES = 70_000
#: Stages: (name, hook-name prefixes), first match wins (see the module doc).
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attestation", ("coverage.", "commit_gate.")),
    ("minting", ("transfer_generation.",)),
    ("page generations", ("page_generation.",)),
    ("lease, quarantine", ("source_lease.", "quarantine.")),
    ("digest", ("kv_integrity.",)),
    ("other hooks", ("",)),
)
STAGE_NAMES = ("attestation", "minting", "page generations", "lease, quarantine",
               "digest planning", "digest", "other hooks")
SIDES = ("prefill", "decode")


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _ints(s: str) -> list[int]:
    return [int(x) for x in _csv(s)]


@dataclass
class Plan:
    """What to run."""

    sizes: list[int] = field(default_factory=lambda: list(INCIDENT_SIZES))
    page_sizes: list[int] = field(default_factory=lambda: list(PAGE_SIZES))
    backends: list[str] = field(default_factory=lambda: list(BACKENDS))
    layouts: list[str] = field(default_factory=lambda: ["contiguous"])
    reps: int = 3
    memory: bool = True
    token_words: int = 4
    layers: int = 1
    timeout_s: float = 900.0
    fragmented_max_pages: int = FRAGMENTED_MAX_PAGES

    @property
    def bytes_per_token(self) -> int:
        """KV bytes the harness moves per token (K and V rows of every layer)."""
        return 2 * self.layers * self.token_words * 8


# =========================================================================== running


def stage_of(hook: str) -> str:
    """The stage a hook's time counts in (:data:`STAGES`)."""
    for name, prefixes in STAGES:
        if any(hook.startswith(p) for p in prefixes):
            return name
    return "other hooks"


def side_stages(cost: dict[str, Any]) -> dict[str, float]:
    """One leg's measurement -> ns per stage (:data:`STAGE_NAMES`) and ``total``: the
    outermost hook times partitioned by stage, the digest planning split off the digest."""
    out = {s: 0.0 for s in STAGE_NAMES}
    for hook, (_calls, ns) in cost.get("outermost", {}).items():
        out[stage_of(hook)] += ns
    plan = float(cost.get("digest_plan_ns", 0))
    out["digest planning"] = min(plan, out["digest"])
    out["digest"] -= out["digest planning"]
    out["total"] = float(cost.get("hooks", {}).get("*", [0, 0])[1])
    out["bookkeeping"] = out["total"] - out["digest"]  # the digest's hashing excluded
    return out


def _pool_pages(plan: Plan, ps: int, layout: str) -> int:
    pages = -(-max(plan.sizes) // ps)
    return (2 * pages if layout == "fragmented" else pages) + 16


def _pair_groups(plan: Plan, layout: str) -> list[tuple[int, ...]]:
    """Page sizes that share one process pair (small pools: the smoke), else one pair each
    (a lane's pool is ``num_pages * page_size`` rows, and the pair's ``num_pages`` is one)."""
    rows = max(_pool_pages(plan, ps, layout) * ps for ps in plan.page_sizes)
    if rows * plan.bytes_per_token <= 64 * 2**20:
        pages = max(_pool_pages(plan, ps, layout) for ps in plan.page_sizes)
        if pages * max(plan.page_sizes) * plan.bytes_per_token <= 256 * 2**20:
            return [tuple(plan.page_sizes)]
    return [(ps,) for ps in plan.page_sizes]


def _record(r: Any, *, backend: str, ps: int, layout: str, size: int, rep: int,
            kind: str) -> dict[str, Any]:
    cost = r.cost or {}
    sent = (cost.get("prefill") or {}).get("first_send_at")
    done = r.decode.terminal_at
    ok = bool(r.decode_state == "Success" and r.gate == "ok" and r.digest == "ok"
              and r.all_own and r.source_refusal is None)
    return {
        "backend": backend, "page_size": ps, "layout": layout, "tokens": size, "rep": rep,
        "kind": kind, "ok": ok, "decode_state": r.decode_state, "gate": r.gate,
        "digest": r.digest, "own_rows": r.own_rows, "rows_expected": r.rows_expected,
        "source_refusal": r.source_refusal, "wall_s": r.wall_s,
        "transfer_s": (done - sent) if done is not None and sent is not None else None,
        "forward_s": (cost.get("prefill") or {}).get("forward_ns", 0) / 1e9,
        "cost": cost,
        "problem": None if ok else r.describe()[:2000],
    }


def run_pair(plan: Plan, backend: str, page_sizes: tuple[int, ...], layout: str,
             log_dir: Path, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every size of every page size in ``page_sizes`` on one process pair."""
    from pdsafe_testkit.kv import KVPair

    num_pages = max(_pool_pages(plan, ps, layout) for ps in page_sizes)
    records: list[dict[str, Any]] = []
    t0 = time.monotonic()
    pair = KVPair(backend, page_size=page_sizes, num_pages=num_pages, num_layers=plan.layers,
                  token_words=plan.token_words, aux_slots=8, bookkeeping=True,
                  log_dir=log_dir / f"{backend}-{'-'.join(map(str, page_sizes))}-{layout}",
                  seed=22, startup_timeout=600.0)
    with pair:
        progress(f"{backend} pages {page_sizes} {layout}: pair ready in "
                 f"{time.monotonic() - t0:.0f} s")
        for ps in page_sizes:
            lane = pair.lane(ps)
            # One unmeasured transfer through the same path first (caches, connections).
            d, p = lane.alloc_pages(-(-min(plan.sizes) // ps), layout)
            lane.transfer(min(plan.sizes), decode_page_indices=d, prefill_page_indices=p,
                          classify=False, timeout=plan.timeout_s)
            for size in plan.sizes:
                pages = -(-size // ps)
                if layout == "fragmented" and pages > plan.fragmented_max_pages:
                    records.append({"backend": backend, "page_size": ps, "layout": layout,
                                    "tokens": size, "kind": "skipped", "ok": True,
                                    "reason": f"{pages} pages of one run each: one transfer "
                                              f"descriptor per page (limit "
                                              f"{plan.fragmented_max_pages})"})
                    continue
                kinds = ["time"] * plan.reps + (["memory"] if plan.memory else [])
                for rep, kind in enumerate(kinds):
                    d, p = lane.alloc_pages(pages, layout)
                    r = lane.transfer(size, decode_page_indices=d, prefill_page_indices=p,
                                      classify=False, measure=True,
                                      trace_memory=kind == "memory", timeout=plan.timeout_s)
                    rec = _record(r, backend=backend, ps=ps, layout=layout, size=size,
                                  rep=rep, kind=kind)
                    records.append(rec)
                    total = sum(side_stages(rec["cost"].get(s, {}))["total"] for s in SIDES)
                    progress(f"{backend} ps={ps} {layout} {size} {kind}#{rep}: "
                             f"{'ok' if rec['ok'] else 'FAILED'}, hooks "
                             f"{total / 1e6:.1f} ms (both legs), transfer "
                             f"{(rec['transfer_s'] or 0) * 1e3:.0f} ms, wall "
                             f"{rec['wall_s']:.1f} s")
    return records


# =========================================================================== analysis


def _median(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def analyze(records: list[dict[str, Any]], plan: Plan) -> dict[str, Any]:
    """Per cell (backend, page size, layout, tokens): medians over the timed transfers; per
    series (backend, page size, layout): the targets."""
    cells: list[dict[str, Any]] = []
    keys = sorted({(r["backend"], r["page_size"], r["layout"], r["tokens"]) for r in records},
                  key=lambda k: (k[0], k[1], k[2], k[3]))
    for key in keys:
        recs = [r for r in records if (r["backend"], r["page_size"], r["layout"], r["tokens"])
                == key]
        if any(r["kind"] == "skipped" for r in recs):
            cells.append({"backend": key[0], "page_size": key[1], "layout": key[2],
                          "tokens": key[3], "skipped": recs[0]["reason"]})
            continue
        cells.append(_cell(key, recs, plan))
    series = _series(cells)
    failed = [r for r in records if not r.get("ok", True)]
    return {"cells": cells, "series": series, "failed_transfers": len(failed),
            "targets_met": all(s["met"] for s in series) and not failed}


def _cell(key: tuple[str, int, str, int], recs: list[dict[str, Any]],
          plan: Plan) -> dict[str, Any]:
    backend, ps, layout, n = key
    timed = [r for r in recs if r["kind"] == "time" and r["ok"]]
    mem = [r for r in recs if r["kind"] == "memory"]
    sides: dict[str, Any] = {}
    for side in SIDES:
        st = [side_stages(r["cost"].get(side, {})) for r in timed]
        med = {k: _median([s[k] for s in st]) or 0.0 for k in (*STAGE_NAMES, "total",
                                                                "bookkeeping")}
        costs = [r["cost"].get(side, {}) for r in recs if r.get("cost")]
        retained = max((c.get("retained_bytes", 0) for c in costs), default=0)
        table_bytes = max((c.get("table_bytes", 0) for c in costs), default=0)
        table_pages = max((c.get("table_pages", 0) for c in costs), default=0)
        peaks = [max(r["cost"].get(side, {}).get("transient_peak_bytes", {}).values(),
                     default=0) for r in mem]
        pool_tokens = max(table_pages - 1, 1) * ps
        sides[side] = {
            "stages_ns": med,
            "bookkeeping_ns_per_token": med["bookkeeping"] / n,
            "total_ns_per_token": med["total"] / n,
            "retained_bytes": retained,
            "retained_bytes_per_token": retained / n,
            "table_bytes_per_pool_token": table_bytes / pool_tokens,
            "added_bytes_per_token": retained / n + table_bytes / pool_tokens,
            "transient_peak_bytes_per_token": (max(peaks) / n) if peaks else None,
            "hooks": _hook_table(timed, side),
        }
    transfer_s = _median([r["transfer_s"] for r in timed])
    moved = n * plan.bytes_per_token
    bw = moved / transfer_s if transfer_s else None
    both = sum(sides[s]["stages_ns"]["bookkeeping"] for s in SIDES) / 1e9
    incident_at_bw = (n * INCIDENT_KV_BYTES_PER_TOKEN / bw) if bw else None
    incident_at_link = n * INCIDENT_KV_BYTES_PER_TOKEN / NOMINAL_LINK_BYTES_S
    return {
        "backend": backend, "page_size": ps, "layout": layout, "tokens": n,
        "transfers": len(timed), "failed": len([r for r in recs if not r["ok"]]),
        "transfer_s": transfer_s, "transfer_bytes": moved, "bandwidth_bytes_s": bw,
        "forward_s": _median([r["forward_s"] for r in timed]),
        "wall_s": _median([r["wall_s"] for r in timed]),
        "bookkeeping_s_both_legs": both,
        "share_of_transfer": both / transfer_s if transfer_s else None,
        "share_incident_kv_at_measured_bw": both / incident_at_bw if incident_at_bw else None,
        "share_incident_kv_at_50GBps": both / incident_at_link,
        # the link speed (incident KV bytes per second) up to which the bookkeeping stays
        # within 1 % of the transfer: faster links make the same bookkeeping a larger share
        "link_bytes_s_for_1pct": (n * INCIDENT_KV_BYTES_PER_TOKEN * TARGET_SHARE / both
                                  if both else None),
        "sides": sides,
    }


def _hook_table(timed: list[dict[str, Any]], side: str) -> dict[str, list[float]]:
    """Per hook (every call, nested included): median calls and ns over the transfers."""
    names = sorted({h for r in timed for h in r["cost"].get(side, {}).get("hooks", {})})
    out = {}
    for h in names:
        vals = [r["cost"][side]["hooks"].get(h, [0, 0]) for r in timed]
        out[h] = [_median([v[0] for v in vals]) or 0, _median([v[1] for v in vals]) or 0]
    return out


def _series(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets per (backend, page size, layout) over its sizes."""
    out = []
    groups = sorted({(c["backend"], c["page_size"], c["layout"]) for c in cells})
    for g in groups:
        cs = sorted((c for c in cells if (c["backend"], c["page_size"], c["layout"]) == g
                     and "skipped" not in c), key=lambda c: c["tokens"])
        if not cs:
            continue
        small, large = cs[0], cs[-1]

        def per_token(c: dict[str, Any], side: str | None = None) -> float:
            sides = SIDES if side is None else (side,)
            return sum(c["sides"][s]["stages_ns"]["bookkeeping"] for s in sides) / c["tokens"]

        ratio = per_token(large) / per_token(small) if per_token(small) else None
        side_ratio = {s: (per_token(large, s) / per_token(small, s)) if per_token(small, s)
                      else None for s in SIDES}
        at_1m = next((c for c in cs if c["tokens"] == INCIDENT_SIZES[-1]), None)
        share = at_1m["share_of_transfer"] if at_1m else None
        mem = max(c["sides"][s]["added_bytes_per_token"] for c in cs for s in SIDES)
        linear = ratio is not None and len(cs) > 1 and ratio <= TARGET_SLOPE_RATIO
        out.append({
            "backend": g[0], "page_size": g[1], "layout": g[2],
            "sizes": [c["tokens"] for c in cs],
            "slope_ratio": ratio, "slope_ratio_by_side": side_ratio,
            "linear": linear,
            "share_at_1m": share,
            "share_at_1m_incident_kv_measured_bw": (at_1m or {}).get(
                "share_incident_kv_at_measured_bw"),
            "share_at_1m_incident_kv_50GBps": (at_1m or {}).get("share_incident_kv_at_50GBps"),
            "link_bytes_s_for_1pct_at_1m": (at_1m or {}).get("link_bytes_s_for_1pct"),
            "share_met": share is not None and share <= TARGET_SHARE,
            "added_bytes_per_token_max": mem,
            "memory_met": mem <= TARGET_BYTES_PER_TOKEN,
            "met": linear and mem <= TARGET_BYTES_PER_TOKEN
            and (share is None or share <= TARGET_SHARE),
        })
    return out


# =========================================================================== second point


def regression_point(out: Path, *, requests: int = 48, concurrency: int = 4,
                     max_new: int = 32, backend: str = "mooncake", page_size: int = 1,
                     progress: Callable[[str], None] = print) -> dict[str, Any]:
    """The regression benchmark's default workload on a fork ``default`` stack whose legs
    time every hook (``SGLANG_PDSAFE_HOOK_COST=1``); see the module doc."""
    from pdsafe_testkit.metrics import scrape, sum_samples

    from benchmark.harness import Harness
    from benchmark.overhead import run_burst
    from benchmark.scenarios import Ctx, Knobs, Reference

    def read(url: str) -> dict[str, float]:
        s = scrape(url)
        vals = {"hook_s": sum_samples(s, "sglang:pdsafe_hook_seconds_total"),
                "hook_calls": sum_samples(s, "sglang:pdsafe_hook_calls_total")}
        for stage in ("prefill_forward", "prefill_transfer_kv_cache", "prefill_bootstrap",
                      "decode_transferred", "decode_waiting", "decode_bootstrap",
                      "decode_prepare"):
            vals[f"{stage}_s"] = sum_samples(s, "sglang:per_stage_req_latency_seconds_sum",
                                             stage=stage)
            vals[f"{stage}_n"] = sum_samples(s, "sglang:per_stage_req_latency_seconds_count",
                                             stage=stage)
        return vals

    log_dir = out / "regression-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    harness = Harness(log_dir, base=None, reference_variant="fork")
    t0 = time.monotonic()
    try:
        ref = Reference(harness.start_reference())
        with harness.stack("fork", backend, page_size, "default",
                           env={"SGLANG_PDSAFE_HOOK_COST": "1"}) as target:
            progress(f"regression point: stacks up in {time.monotonic() - t0:.0f} s")
            knobs = Knobs.for_mode(False)
            ctx = Ctx(target, ref, knobs, random.Random(knobs.seed + 7))
            limits = [x.effective for x in target.limits().values() if x.effective]
            limit = min(limits) if limits else 256
            urls = {"prefill": target.prefill_url, "decode": target.decode_url}

            def settle() -> dict[str, dict[str, float]]:
                # The legs export their hook totals at most once a second, on a hook call:
                # wait past it, then one request flushes what came before.
                time.sleep(1.2)
                run_burst(ctx, "fork", -2, "steady", 1, 1, 4, limit)
                time.sleep(0.5)
                return {role: read(u) for role, u in urls.items()}

            run_burst(ctx, "fork", -1, "steady", 8, concurrency, max_new, limit)  # warm-up
            before = settle()
            burst = run_burst(ctx, "fork", 0, "steady", requests, concurrency, max_new, limit)
            after = settle()
    finally:
        harness.stop_reference()
    delta = {role: {k: after[role][k] - before[role][k] for k in after[role]} for role in after}
    n = burst.n
    judged = [r for r in ctx.records if r.label.startswith("oh-steady-r0-")]
    prompt_tokens = sum(r.prompt_len for r in judged)
    e2e = [r.e2e_s for r in judged if r.e2e_s is not None]
    out_rec: dict[str, Any] = {
        "workload": f"overhead 'steady' burst: {requests} streaming requests through the "
                    f"router, concurrency {concurrency}, {max_new} new tokens, prompts "
                    f"24..{max(32, min(256, limit // 2))} tokens",
        "stack": f"fork default stack, {backend}, page size {page_size}",
        "requests": n, "ok": burst.ok, "outcomes": _outcomes(judged),
        "prompt_tokens": prompt_tokens or None,
        "legs": {}, "client": {"wall_s": burst.wall_s,
                               "ttft_p50_s": burst.stats["ttft_p50_s"],
                               "itl_p50_s": burst.stats["itl_p50_s"]},
        "note": "counter deltas over the burst, read around a flush request on each side: "
                "within one request of the burst's own (48 requests: about 2 %)",
    }
    out_rec["client"]["e2e_mean_s"] = statistics.fmean(e2e) if e2e else None
    for role, d in delta.items():
        leg: dict[str, Any] = {"hook_s_per_request": d["hook_s"] / n,
                               "hook_calls_per_request": d["hook_calls"] / n}
        for stage in ("prefill_forward", "prefill_transfer_kv_cache", "prefill_bootstrap",
                      "decode_transferred", "decode_waiting", "decode_bootstrap",
                      "decode_prepare"):
            if d[f"{stage}_n"] > 0:
                leg[f"{stage}_s_per_request"] = d[f"{stage}_s"] / d[f"{stage}_n"]
        out_rec["legs"][role] = leg
    return out_rec


def _outcomes(records: list[Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        out[r.outcome.value] = out.get(r.outcome.value, 0) + 1
    return out


# =========================================================================== report


def tree_info() -> dict[str, Any]:
    """The tree measured: commit, dirty files, installed sglang version."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                  timeout=30).stdout.rstrip()
        except (OSError, subprocess.SubprocessError):
            return ""

    try:
        from importlib.metadata import version

        sglang_version = version("sglang")
    except Exception:  # noqa: BLE001 - informational
        sglang_version = "?"
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "subject": git("log", "-1", "--format=%s")[:120],
            "dirty": [ln[3:] for ln in git("status", "--porcelain").splitlines()],
            "sglang": sglang_version, "python": platform.python_version(),
            "cpus": os.cpu_count(), "machine": platform.machine()}


def _ms(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e6:.1f}"


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def markdown(summary: dict[str, Any]) -> str:
    """report.md: the tables docs/benchmark.md quotes."""
    meta = summary["meta"]
    lines = [f"# Bookkeeping at the incident's scale ({meta['started']})", "",
             f"Tree: `{meta['tree']['commit']}` ({meta['tree']['subject']}), "
             f"{'dirty: ' + ', '.join(meta['tree']['dirty']) if meta['tree']['dirty'] else 'clean'}"
             f"; sglang {meta['tree']['sglang']}; {meta['tree']['cpus']} CPUs. Command: "
             f"`{meta['command']}`. Wall time {meta['wall_s']:.0f} s.", "",
             f"KV per token in the harness: {meta['plan']['bytes_per_token']} bytes "
             f"({meta['plan']['layers']} layer, K and V rows of "
             f"{meta['plan']['token_words'] * 8} bytes). Times: medians of "
             f"{meta['plan']['reps']} transfers per cell, both legs summed unless split.", "",
             "## Time per stage (ms, both legs)", "",
             "| backend | page | layout | tokens | transfer ms | forward* ms | "
             + " | ".join(STAGE_NAMES) + " | bookkeeping ns/token P+D | share of transfer |",
             "|---|---|---|---|---|---|" + "---|" * len(STAGE_NAMES) + "---|---|"]
    for c in summary["cells"]:
        head = f"| {c['backend']} | {c['page_size']} | {c['layout']} | {c['tokens']:,} |"
        if "skipped" in c:
            lines.append(head + f" skipped: {c['skipped']} |")
            continue
        st = {s: sum(c["sides"][side]["stages_ns"][s] for side in SIDES) for s in STAGE_NAMES}
        per_tok = " + ".join(f"{c['sides'][s]['bookkeeping_ns_per_token']:.0f}" for s in SIDES)
        lines.append(
            head + f" {_f(c['transfer_s'] and c['transfer_s'] * 1e3, '.0f')} | "
            f"{_f(c['forward_s'] and c['forward_s'] * 1e3, '.0f')} | "
            + " | ".join(_ms(st[s]) for s in STAGE_NAMES)
            + f" | {per_tok} | {_f(c['share_of_transfer'], '.1%')} |")
    lines += ["", "\\* forward: the harness's stand-in (writing the request's pattern into the "
              "prefill pool), not a model forward.", "",
              "## Memory per leg (bytes per token)", "",
              "| backend | page | layout | tokens | retained P / D | generation table P / D "
              "(per pool token) | added P / D | transient peak in hooks P / D |",
              "|---|---|---|---|---|---|---|---|"]
    for c in summary["cells"]:
        if "skipped" in c:
            continue
        s = c["sides"]

        def pair(key: str, fmt: str = ".1f", s: dict[str, Any] = s) -> str:
            return " / ".join(_f(s[x][key], fmt) for x in SIDES)

        lines.append(f"| {c['backend']} | {c['page_size']} | {c['layout']} | "
                     f"{c['tokens']:,} | {pair('retained_bytes_per_token')} | "
                     f"{pair('table_bytes_per_pool_token')} | {pair('added_bytes_per_token')} "
                     f"| {pair('transient_peak_bytes_per_token')} |")
    lines += ["", "## Targets", "",
              "| backend | page | layout | slope ratio (P+D; P, D) | share at 1M: of the "
              "harness transfer / of the incident's KV at 50 GB/s | 1 % holds up to (GB/s of "
              "the incident's KV) | max added B/token | met |",
              "|---|---|---|---|---|---|---|---|"]
    for s in summary["series"]:
        by = s["slope_ratio_by_side"]
        link = s.get("link_bytes_s_for_1pct_at_1m")
        lines.append(
            f"| {s['backend']} | {s['page_size']} | {s['layout']} | "
            f"{_f(s['slope_ratio'], '.2f')} ({_f(by['prefill'], '.2f')}, "
            f"{_f(by['decode'], '.2f')}) | {_f(s['share_at_1m'], '.1%')} / "
            f"{_f(s['share_at_1m_incident_kv_50GBps'], '.1%')} | "
            f"{_f(link and link / 1e9, '.1f')} | "
            f"{s['added_bytes_per_token_max']:.1f} | "
            f"{'yes' if s['met'] else 'no'} (linear {'yes' if s['linear'] else 'no'}, "
            f"1 % {'yes' if s['share_met'] else 'no'}, 16 B "
            f"{'yes' if s['memory_met'] else 'no'}) |")
    reg = summary.get("regression")
    if reg:
        lines += ["", "## Second data point: the regression benchmark's default workload", "",
                  f"{reg.get('stack', '')}; {reg.get('workload', '')}; "
                  f"{reg.get('requests')} requests, outcomes {reg.get('outcomes')}. "
                  f"{reg.get('note', '')}.", "",
                  "| leg | hook µs / request | hook calls / request | forward ms / request | "
                  "transfer ms / request |", "|---|---|---|---|---|"]
        for role, leg in reg.get("legs", {}).items():
            fwd = leg.get("prefill_forward_s_per_request")
            xfer = (leg.get("prefill_transfer_kv_cache_s_per_request")
                    or leg.get("decode_transferred_s_per_request"))
            lines.append(f"| {role} | {leg['hook_s_per_request'] * 1e6:.0f} | "
                         f"{leg['hook_calls_per_request']:.1f} | "
                         f"{_f(fwd and fwd * 1e3, '.2f')} | {_f(xfer and xfer * 1e3, '.2f')} |")
        if reg.get("error"):
            lines.append(f"\nError: {reg['error']}")
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: Path) -> bool:
    """scale.png: per-token bookkeeping vs context length (one line per backend and page
    size and layout), and the stages at the largest size. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cells = [c for c in summary["cells"] if "skipped" not in c]
    if not cells:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for s in summary["series"]:
        cs = sorted((c for c in cells if (c["backend"], c["page_size"], c["layout"])
                     == (s["backend"], s["page_size"], s["layout"])), key=lambda c: c["tokens"])
        xs = [c["tokens"] for c in cs]
        ys = [sum(c["sides"][x]["bookkeeping_ns_per_token"] for x in SIDES) for c in cs]
        ax1.plot(xs, ys, marker="o",
                 label=f"{s['backend']} ps={s['page_size']} {s['layout']}")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("tokens per request")
    ax1.set_ylabel("bookkeeping, digest excluded (ns/token, both legs)")
    ax1.set_ylim(bottom=0)
    ax1.set_title("per-token cost (flat = linear)")
    ax1.legend(fontsize=7)
    top = max(c["tokens"] for c in cells)
    big = [c for c in cells if c["tokens"] == top]
    labels = [f"{c['backend'][:4]} {c['page_size']} {c['layout'][:4]}" for c in big]
    bottom = [0.0] * len(big)
    for stage in STAGE_NAMES:
        vals = [sum(c["sides"][x]["stages_ns"][stage] for x in SIDES) / c["tokens"]
                for c in big]
        ax2.bar(labels, vals, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax2.set_ylabel(f"ns/token at {top:,} tokens (both legs)")
    ax2.set_title("stages at the largest size")
    ax2.tick_params(axis="x", labelrotation=45, labelsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# =========================================================================== main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmark.scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=_ints, default=None,
                    help=f"tokens per request (default {','.join(map(str, INCIDENT_SIZES))})")
    ap.add_argument("--page-sizes", type=_ints, default=None, help="default 1,16,64")
    ap.add_argument("--backends", type=_csv, default=None, help="default mooncake,nixl")
    ap.add_argument("--layouts", type=_csv, default=None,
                    help="contiguous (default) and/or fragmented (every other page: each page "
                         f"a run of its own; cells over {FRAGMENTED_MAX_PAGES} pages skipped)")
    ap.add_argument("--reps", type=int, default=None, help="timed transfers per cell (3)")
    ap.add_argument("--no-memory", action="store_true",
                    help="skip the extra transfer per cell that traces memory in the hooks")
    ap.add_argument("--regression", action="store_true",
                    help="also the regression benchmark's default workload with "
                         "SGLANG_PDSAFE_HOOK_COST=1 (starts a reference and a PD stack)")
    ap.add_argument("--regression-only", action="store_true",
                    help="only the regression data point")
    ap.add_argument("--smoke", action="store_true",
                    help="CI smoke: mooncake, 2,048 and 8,192 tokens, page sizes 1 and 64, one "
                         "timed transfer and one traced per cell (about a minute)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output directory (default build/bench-scale, build/bench-scale-smoke)")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def make_plan(a: argparse.Namespace) -> Plan:
    plan = Plan()
    if a.smoke:
        plan = Plan(sizes=[2048, 8192], page_sizes=[1, 64], backends=["mooncake"], reps=1,
                    timeout_s=120.0)
    for key in ("sizes", "page_sizes", "backends", "layouts", "reps"):
        v = getattr(a, key)
        if v is not None:
            setattr(plan, key, v)
    if a.no_memory:
        plan.memory = False
    bad = [x for x in plan.layouts if x not in LAYOUTS]
    if bad or not plan.sizes or min(plan.sizes) < 1 or plan.reps < 1:
        raise SystemExit(f"bad plan: layouts {bad}, sizes {plan.sizes}, reps {plan.reps}")
    return plan


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    plan = make_plan(a)
    out = a.out or REPO / ("build/bench-scale-smoke" if a.smoke else "build/bench-scale")
    out.mkdir(parents=True, exist_ok=True)
    progress = (lambda s: None) if a.no_progress else (
        lambda s: print(f"[scale {time.strftime('%H:%M:%S')}] {s}", flush=True))
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    t0 = time.monotonic()
    records: list[dict[str, Any]] = []
    status = 0
    error = None
    try:
        if not a.regression_only:
            for backend in plan.backends:
                for layout in plan.layouts:
                    for group in _pair_groups(plan, layout):
                        records += run_pair(plan, backend, group, layout, out / "logs",
                                            progress)
                        _dump(out, records, plan, started, t0, None)  # partial results
    except Exception as e:  # noqa: BLE001 - reported, exit 2
        error = f"{type(e).__name__}: {e}".splitlines()[0]
        traceback.print_exc()
        status = 2
    regression = None
    if (a.regression or a.regression_only) and status == 0:
        try:
            regression = regression_point(out, progress=progress)
        except Exception as e:  # noqa: BLE001 - reported, exit 2
            traceback.print_exc()
            regression = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
            status = 2
    summary = _dump(out, records, plan, started, t0, regression, error=error,
                    command=" ".join(["python -m benchmark.scale", *(argv or sys.argv[1:])]))
    progress(f"done in {summary['meta']['wall_s']:.0f} s: {out / 'report.md'}")
    if status == 0 and (summary["failed_transfers"] or not summary["targets_met"]):
        status = 1
    return status


def _dump(out: Path, records: list[dict[str, Any]], plan: Plan, started: str, t0: float,
          regression: dict[str, Any] | None, *, error: str | None = None,
          command: str = "") -> dict[str, Any]:
    summary = analyze(records, plan) if records else {"cells": [], "series": [],
                                                       "failed_transfers": 0,
                                                       "targets_met": True}
    summary["meta"] = {"started": started, "wall_s": time.monotonic() - t0,
                       "plan": {**asdict(plan), "bytes_per_token": plan.bytes_per_token},
                       "tree": tree_info(), "command": command or "python -m benchmark.scale",
                       "error": error,
                       "constants": {"incident_kv_bytes_per_token": INCIDENT_KV_BYTES_PER_TOKEN,
                                     "nominal_link_bytes_s": NOMINAL_LINK_BYTES_S,
                                     "target_slope_ratio": TARGET_SLOPE_RATIO,
                                     "target_share": TARGET_SHARE,
                                     "target_bytes_per_token": TARGET_BYTES_PER_TOKEN}}
    summary["regression"] = regression
    (out / "report.json").write_text(json.dumps({**summary, "records": records}, indent=1,
                                                default=str))
    (out / "report.md").write_text(markdown(summary))
    summary["plot"] = plot(summary, out / "scale.png")
    return summary


if __name__ == "__main__":
    sys.exit(main())
