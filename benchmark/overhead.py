"""What the protections cost: fork/base ratios of throughput, TTFT p50/p99 and ITL p50.

Measured in steady state on the two variants' ``default`` stacks, both alive, in interleaved
bursts within one invocation: for every repetition, for every workload, a base burst and then
a fork burst (base, fork, base, fork, ...), so slow drifts of a shared machine hit both alike.
Workloads: ``steady`` (mixed prompt lengths, like the steady-state scenario) and a sweep of
fixed prompt lengths (how the cost grows with the work). Every request streams (TTFT = first
token-carrying chunk, ITL = gaps between chunks per token, ``client``) and every answer is judged
by the content oracle like any scenario request, so the overhead runs double as more steady-state
evidence.

Ratios are fork / base: throughput above 1 means the fork is faster, latency above 1 slower.
Per repetition the ratio of that repetition's two bursts; over repetitions their mean, min,
max and stdev (the spread); ``pooled`` is the ratio of the statistics over all repetitions'
samples together.

Invariant: a burst's timing covers only sending and receiving; reference lookups and counter
reads happen after its clock stopped (``scenarios.Ctx.run_phase``).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmark.outcomes import FAILING, count
from benchmark.scenarios import Ctx, Knobs, Reference
from benchmark.targets import PDTarget

METRICS = ("throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s")


@dataclass
class OverheadPlan:
    """How much to measure (``--quick``: one repetition, short sweep)."""

    reps: int = 3
    requests: int = 48
    concurrency: int = 4
    max_new: int = 32
    sweep: tuple[int, ...] = (32, 64, 128, 256, 448)
    sweep_requests: int = 24
    warmup: int = 8

    @classmethod
    def for_mode(cls, quick: bool) -> OverheadPlan:
        if quick:
            return cls(reps=1, requests=24, concurrency=4, max_new=32, sweep=(32, 256),
                       sweep_requests=12, warmup=4)
        return cls()


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by linear interpolation; None for no samples."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class Burst:
    """One measured burst of one variant."""

    variant: str
    rep: int
    workload: str
    n: int
    ok: int
    wall_s: float
    output_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)

    @property
    def stats(self) -> dict[str, float | None]:
        return {
            "throughput_tok_s": self.output_tokens / self.wall_s if self.wall_s > 0 else None,
            "ttft_p50_s": percentile(self.ttft_s, 0.5),
            "ttft_p99_s": percentile(self.ttft_s, 0.99),
            "itl_p50_s": percentile(self.itl_s, 0.5),
        }

    def to_json(self) -> dict[str, Any]:
        return {"variant": self.variant, "rep": self.rep, "workload": self.workload, "n": self.n,
                "ok": self.ok, "wall_s": round(self.wall_s, 4),
                "output_tokens": self.output_tokens, **self.stats}


def _prompts(rng: random.Random, workload: str, n: int, limit: int) -> list[int]:
    if workload == "steady":
        return [rng.randint(24, max(32, min(256, limit // 2))) for _ in range(n)]
    length = int(workload.removeprefix("len-"))
    return [min(length, limit - 1)] * n


def run_burst(ctx: Ctx, variant: str, rep: int, workload: str, n: int, concurrency: int,
              max_new: int, limit: int) -> Burst:
    """``n`` streaming canary requests through the router, ``concurrency`` in flight."""
    jobs = []
    for i, length in enumerate(_prompts(ctx.rng, workload, n, limit)):
        label = f"oh-{workload}-r{rep}-{i}"
        owner, p = ctx.canary(label, length)
        jobs.append(ctx.via_router(label, p, max_new, canary=owner, stream=True))
    recs = ctx.run_phase(f"overhead-{workload}-r{rep}", jobs, concurrency=concurrency)
    wall = ctx.phases[-1]["wall_s"]
    b = Burst(variant, rep, workload, n, 0, wall, 0)
    for j, r in zip(jobs, recs, strict=True):
        a = j.answer if r.outcome.value in ("identical", "unproven") else None
        if a is None or not a.ok:
            continue
        b.ok += 1
        b.output_tokens += len(a.output_ids)
        if a.ttft_s is not None:
            b.ttft_s.append(a.ttft_s)
        b.itl_s.extend(a.itl_s)
    return b


def _ratio(f: float | None, b: float | None) -> float | None:
    if f is None or b is None or b == 0:
        return None
    return f / b


def _spread(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"mean": None, "min": None, "max": None, "stdev": None, "n": 0}
    return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs),
            "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


def summarize(bursts: Sequence[Burst], workloads: Sequence[str], *, num: str = "fork",
              den: str = "base") -> dict[str, Any]:
    """Ratios ``num``/``den`` (variant labels of the bursts; fork/base by default) per
    workload: per repetition, their spread, and pooled (pure). A repetition missing either
    variant's burst contributes no ratio; ``absolute`` is keyed by ``den`` and ``num``."""
    out: dict[str, Any] = {}
    for w in workloads:
        by = {(b.variant, b.rep): b for b in bursts if b.workload == w}
        reps = sorted({rep for (_, rep) in by})
        per_rep: dict[str, list[float]] = {m: [] for m in METRICS}
        for rep in reps:
            fb, bb = by.get((num, rep)), by.get((den, rep))
            if fb is None or bb is None:
                continue
            fs, bs = fb.stats, bb.stats
            for m in METRICS:
                r = _ratio(fs[m], bs[m])
                if r is not None:
                    per_rep[m].append(r)
        pooled: dict[str, float | None] = {}
        absolute: dict[str, dict[str, float | None]] = {}
        for v in (den, num):
            bs_v = [b for b in bursts if b.workload == w and b.variant == v]
            wall = sum(b.wall_s for b in bs_v)
            absolute[v] = {
                "throughput_tok_s": (sum(b.output_tokens for b in bs_v) / wall) if wall else None,
                "ttft_p50_s": percentile([x for b in bs_v for x in b.ttft_s], 0.5),
                "ttft_p99_s": percentile([x for b in bs_v for x in b.ttft_s], 0.99),
                "itl_p50_s": percentile([x for b in bs_v for x in b.itl_s], 0.5),
            }
        for m in METRICS:
            pooled[m] = _ratio(absolute[num][m], absolute[den][m])
        out[w] = {"ratios": {m: _spread(per_rep[m]) for m in METRICS}, "pooled": pooled,
                  "absolute": absolute, "reps": len(reps)}
    return out


def measure(targets: dict[str, PDTarget], ref: Reference, knobs: Knobs, plan: OverheadPlan,
            *, on_burst: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Interleaved bursts on ``targets["base"]`` and ``targets["fork"]``; the overhead section."""
    if set(targets) != {"base", "fork"}:
        return {"status": "not_measured",
                "reason": "overhead ratios need both variants (base and fork) in one run"}
    ctxs = {v: Ctx(t, ref, knobs, random.Random(knobs.seed + 7)) for v, t in targets.items()}
    limits = {}
    for v, c in ctxs.items():
        lim = [x.effective for x in c.target.limits().values() if x.effective]
        limits[v] = min(lim) if lim else 256
    limit = min(limits.values())
    workloads = ["steady"] + [f"len-{n}" for n in plan.sweep if n < limit]
    for v in ("base", "fork"):  # warm both stacks before any clock runs
        run_burst(ctxs[v], v, -1, "steady", plan.warmup, plan.concurrency, plan.max_new, limit)
    bursts: list[Burst] = []
    for rep in range(plan.reps):
        for w in workloads:
            n = plan.requests if w == "steady" else plan.sweep_requests
            for v in ("base", "fork"):
                bursts.append(run_burst(ctxs[v], v, rep, w, n, plan.concurrency,
                                        plan.max_new, limit))
                on_burst(f"{v} {w} rep {rep}")
    summary = summarize(bursts, workloads)
    # Every answer counts for content, warm-up bursts included.
    content = {v: count(c.records) for v, c in ctxs.items()}
    failures = {v: [r.to_json() for r in c.records if r.outcome in FAILING]
                for v, c in ctxs.items()}
    return {
        "status": "measured",
        "method": "interleaved bursts (base, fork) per workload per repetition, both stacks "
                  "alive, streaming /generate through the router; ratios fork/base",
        "plan": vars(plan) | {"sweep": list(plan.sweep)},
        "workloads": workloads,
        "steady": summary.get("steady"),
        "sweep": {w: summary[w] for w in workloads if w != "steady"},
        "bursts": [b.to_json() for b in bursts],
        "samples": {v: {"ttft_s": [x for b in bursts if b.variant == v for x in b.ttft_s],
                        "itl_s": [x for b in bursts if b.variant == v for x in b.itl_s]}
                    for v in ("base", "fork")},
        "content": content,
        "content_failures": failures,
    }
