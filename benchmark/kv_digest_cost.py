"""End-to-end cost of the KV digest (issue 10): the fork with the digest on vs off, one run.

  python -m benchmark.kv_digest_cost --out DIR [--quick] [--backend mooncake|nixl] [--reps N]
      [--page-size 1] [--bound S] [--seed N] [--no-progress]

Starts, on the CPU harness (``benchmark.harness.Harness``, ``pdsafe_testkit.servers``), one
co-located reference server and two fork PD stacks (prefill, decode, router) that differ only
in ``SGLANG_PDSAFE_KV_DIGEST`` on both legs: ``on`` = 1 (the default, set explicitly so that an
inherited ``=0`` cannot turn it off), ``off`` = 0 (the setting is compared at pairing, so both
legs of a stack carry the same value). Both stacks are the same ``STACK`` (pools and context
4096 on both legs, no test-only fault armed) so longer prompts, whose KV is larger, are in the
sweep.

Then, both stacks alive, interleaved bursts (``benchmark.overhead``'s ``run_burst`` / ``Burst``
/ ``summarize``): for every repetition, for every workload, one burst per variant, the order
alternating per repetition (``burst_order``: on, off in even repetitions, off, on in odd ones)
so neither variant always runs second. Workloads: ``steady`` (mixed prompt lengths) and a
sweep of fixed prompt lengths; every request streams through the router (throughput, TTFT
p50/p99, ITL p50). Both variants get the same prompts (each context's canary RNG has the same
seed and draws in the same order), so the reference answers each prompt once.

Every answer, warm-up included, is judged by the content oracle against the reference: it must
be token-identical (the digest-off stack too), anything else is a failure. The digest is proven
to have run on ``on`` and not on ``off`` by decode's ``sglang:pdsafe_kv_digest_verified_total``
(moves by at least one per identical ``on`` answer; stays flat on ``off``), the digest failure
counters (flat on both) and the startup warning ``pdsafe protection 'kv-digest' is OFF`` (in
both ``off`` legs' logs, in neither ``on`` leg's log).

Ratios are on / off: throughput below 1 means the digest costs throughput, latencies above 1
mean it costs latency; per repetition, then mean, min, max, stdev over repetitions, and pooled
over all samples. No threshold is applied to them (a shared 2-core machine is noisy): they are
reported, never asserted.

Writes DIR/report.json and DIR/report.md (server logs under DIR/logs). Exit status 0 when every
answer was identical and the counters prove the digest on/off as configured, 1 otherwise, 2
when the run itself could not be carried out.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import random
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pdsafe_testkit.metrics import scrape, sum_samples

from benchmark.evidence import DECODE_COMMITS, PREFILL_SENDS
from benchmark.harness import Harness
from benchmark.outcomes import Outcome, count
from benchmark.overhead import METRICS, Burst, OverheadPlan, run_burst, summarize
from benchmark.scenarios import Ctx, Knobs, Reference
from benchmark.targets import PDTarget, StackKind

REPO = Path(__file__).resolve().parent.parent
ENV = "SGLANG_PDSAFE_KV_DIGEST"
#: Variant label -> the environment both legs of its stack get.
DIGEST_ENV: dict[str, dict[str, str]] = {"on": {ENV: "1"}, "off": {ENV: "0"}}
VARIANTS = ("on", "off")
BACKENDS = ("mooncake", "nixl")
VERIFIED = "sglang:pdsafe_kv_digest_verified_total"
#: The digest's failure counters (``sglang.pdsafe.kv_integrity``): none may move in this run.
DIGEST_FAILURES = tuple(f"sglang:pdsafe_kv_digest_{c}_total"
                        for c in ("mismatch", "missing", "invalid", "failed"))
#: The startup report's warning when the digest is off (``protections.log_startup``).
OFF_WARNING = "pdsafe protection 'kv-digest' is OFF"
#: Outcomes that count as a correct answer (equal to the reference token for token).
CORRECT = (Outcome.IDENTICAL.value, Outcome.UNPROVEN.value)

STACK = StackKind("kv_digest_cost", 4096, 4096,
                  doc="equal 4096-token pools and context on both legs, router, no test-only "
                      "fault; both variants identical but for SGLANG_PDSAFE_KV_DIGEST")


def plan_for(quick: bool, reps: int | None = None) -> OverheadPlan:
    """The burst sizes: ``--quick`` 3 repetitions of 24 mixed + 3 x 12 fixed-length requests
    per variant (prompts 32, 256, 1024), full 5 repetitions of 48 + 5 x 24 (32-2048);
    ``reps`` (>= 1) overrides the repetitions. Guarantees ``reps >= 1``."""
    if quick:
        plan = OverheadPlan(reps=3, requests=24, concurrency=4, max_new=32,
                            sweep=(32, 256, 1024), sweep_requests=12, warmup=4)
    else:
        plan = OverheadPlan(reps=5, requests=48, concurrency=4, max_new=32,
                            sweep=(32, 128, 512, 1024, 2048), sweep_requests=24, warmup=8)
    if reps is not None:
        if reps < 1:
            raise ValueError(f"--reps must be at least 1, got {reps}")
        plan.reps = reps
    return plan


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; ``out`` defaults to build/bench-kv-digest-cost[-quick], ``plan`` is the
    ``OverheadPlan`` the run uses (``--reps`` applied). Exits (status 2) on a bad value."""
    ap = argparse.ArgumentParser(prog="python -m benchmark.kv_digest_cost",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None,
                    help="output directory (default build/bench-kv-digest-cost-quick or "
                         "build/bench-kv-digest-cost)")
    ap.add_argument("--quick", action="store_true",
                    help="3 repetitions of short bursts, prompts up to 1024 (~5 min on 2 cores)")
    ap.add_argument("--backend", choices=BACKENDS, default="mooncake")
    ap.add_argument("--reps", type=int, default=None,
                    help="repetitions (default 3 with --quick, else 5)")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--bound", type=float, default=None, help="hang bound per request (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    a = ap.parse_args(argv)
    if a.reps is not None and a.reps < 1:
        ap.error(f"--reps must be at least 1, got {a.reps}")
    if a.page_size < 1:
        ap.error(f"--page-size must be at least 1, got {a.page_size}")
    a.plan = plan_for(a.quick, a.reps)
    a.out = a.out or REPO / "build" / ("bench-kv-digest-cost-quick" if a.quick
                                         else "bench-kv-digest-cost")
    return a


def burst_order(rep: int) -> tuple[str, str]:
    """The variants' order in repetition ``rep``: on first in even repetitions, off first in
    odd ones (warm-up: ``rep`` -1, off first), so slow drift does not favour one side."""
    return ("on", "off") if rep % 2 == 0 else ("off", "on")


def workloads_for(plan: OverheadPlan, limit: int) -> list[str]:
    """``steady`` plus ``len-N`` for every sweep length below ``limit`` (the smallest prompt
    limit of the four legs), in sweep order."""
    return ["steady"] + [f"len-{n}" for n in plan.sweep if n < limit]


# ----------------------------------------------------------------------------- digest evidence


def digest_counters(decode_url: str, prefill_url: str | None = None) -> dict[str, float]:
    """Decode's digest counters (``verified`` and each failure class, by short name) and
    its committed transfers (``decode_commits``); with ``prefill_url`` also prefill's sent
    transfers (``prefill_sends``) and its digest failure counters (``prefill_failed`` etc.).
    Absent metrics read 0.0; an unreachable server raises ``requests.RequestException``."""
    d = scrape(decode_url, timeout=10)
    out = {"verified": sum_samples(d, VERIFIED),
           "decode_commits": sum_samples(d, DECODE_COMMITS, stage="decode_transferred")}
    for name in DIGEST_FAILURES:
        out[_short(name)] = sum_samples(d, name)
    if prefill_url is not None:
        p = scrape(prefill_url, timeout=10)
        out["prefill_sends"] = sum_samples(p, PREFILL_SENDS)
        for name in DIGEST_FAILURES:
            out["prefill_" + _short(name)] = sum_samples(p, name)
    return out


def _short(metric: str) -> str:
    return metric.removeprefix("sglang:pdsafe_kv_digest_").removesuffix("_total")


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """``after - before`` per key of ``after`` (a key missing from ``before`` counts from 0)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def judge_digest(variant: str, moved: dict[str, float], correct: int,
                 off_warning_in: Sequence[str] | None = None) -> dict[str, Any]:
    """Whether the counters (and, when given, the legs whose log carries ``OFF_WARNING``) show
    the digest as configured for ``variant``. ``on``: ``verified`` moved by at least
    ``correct`` (one check per correct answer; more is fine: health checks, warm-up) and by at
    least 1, and no leg logged the warning. ``off``: ``verified`` did not move, decode
    committed at least one transfer (traffic did flow), and both legs logged the warning.
    Both: no digest failure counter moved. Returns ``{"ok": bool, "why": [reasons]}``."""
    why: list[str] = []
    verified = moved.get("verified", 0.0)
    if variant == "on":
        if verified < max(1, correct):
            why.append(f"verified_total moved by {verified:g}, expected at least "
                       f"{max(1, correct)} (one per correct answer)")
        if off_warning_in:
            why.append(f"the kv-digest OFF warning is in the log of {list(off_warning_in)}")
    elif variant == "off":
        if verified != 0:
            why.append(f"verified_total moved by {verified:g} with the digest off")
        if moved.get("decode_commits", 0.0) < 1:
            why.append("decode committed no transfer: nothing shows traffic flowed")
        if off_warning_in is not None and set(off_warning_in) != {"prefill", "decode"}:
            why.append(f"the kv-digest OFF warning is in the log of {list(off_warning_in)} "
                       "only, expected both legs")
    else:
        raise ValueError(f"unknown variant {variant!r}")
    for k, v in moved.items():
        if k.removeprefix("prefill_") in ("mismatch", "missing", "invalid", "failed") and v:
            why.append(f"digest failure counter {k} moved by {v:g}")
    return {"ok": not why, "why": why}


def off_warning_legs(logs: dict[str, str]) -> list[str]:
    """The roles (of ``prefill``/``decode`` in ``logs``: role -> log path) whose log holds
    ``OFF_WARNING``; an unreadable log counts as not holding it."""
    out = []
    for role in ("prefill", "decode"):
        path = logs.get(role)
        if path is None:
            continue
        try:
            if OFF_WARNING in Path(path).read_text(errors="replace"):
                out.append(role)
        except OSError:
            continue
    return out


# ----------------------------------------------------------------------------- measurement


def measure(targets: dict[str, PDTarget], ref: Reference, knobs: Knobs, plan: OverheadPlan,
            *, on_burst: Callable[[str], None] = lambda s: None,
            read_logs: bool = True) -> dict[str, Any]:
    """Interleaved bursts on ``targets["on"]`` and ``targets["off"]`` (both alive); returns
    the section report.json keeps: ratios on/off per workload (``summary``), every burst,
    content counts and failures per variant, the digest counters' movement and verdict per
    variant (``digest``), and ``ok`` (every answer correct and both verdicts hold).
    ``read_logs``: also check the startup warning in the legs' logs (harness stacks)."""
    if set(targets) != set(VARIANTS):
        raise ValueError(f"need targets {VARIANTS}, got {sorted(targets)}")
    ctxs = {v: Ctx(t, ref, knobs, random.Random(knobs.seed + 7)) for v, t in targets.items()}
    lims = [x.effective for t in targets.values() for x in t.limits().values() if x.effective]
    limit = min(lims) if lims else 256
    workloads = workloads_for(plan, limit)
    before = {v: digest_counters(t.decode_url, t.prefill_url) for v, t in targets.items()}
    for v in burst_order(-1):  # warm both stacks before any clock runs
        run_burst(ctxs[v], v, -1, "steady", plan.warmup, plan.concurrency, plan.max_new, limit)
    bursts: list[Burst] = []
    for rep in range(plan.reps):
        for w in workloads:
            n = plan.requests if w == "steady" else plan.sweep_requests
            for v in burst_order(rep):
                bursts.append(run_burst(ctxs[v], v, rep, w, n, plan.concurrency,
                                        plan.max_new, limit))
                on_burst(f"{v} {w} rep {rep}")
    after: dict[str, dict[str, float]] = {}
    for v, t in targets.items():  # counters settle after the last answer
        after[v] = digest_counters(t.decode_url, t.prefill_url)
        deadline = time.monotonic() + knobs.evidence_wait_s
        while (v == "on" and after[v]["verified"] - before[v]["verified"]
               < _correct(ctxs[v]) and time.monotonic() < deadline):
            time.sleep(0.25)
            after[v] = digest_counters(t.decode_url, t.prefill_url)
    content = {v: count(c.records) for v, c in ctxs.items()}
    failures = {v: [r.to_json() for r in c.records if r.outcome.value not in CORRECT]
                for v, c in ctxs.items()}
    digest: dict[str, Any] = {}
    for v, t in targets.items():
        moved = delta(after[v], before[v])
        legs = off_warning_legs(t.logs()) if read_logs else None
        digest[v] = {"env": DIGEST_ENV[v], "before": before[v], "after": after[v],
                     "moved": moved, "off_warning_in": legs,
                     **judge_digest(v, moved, _correct(ctxs[v]), legs)}
    summary = summarize(bursts, workloads, num="on", den="off")
    ok = all(not f for f in failures.values()) and all(d["ok"] for d in digest.values())
    return {
        "method": "interleaved bursts per workload per repetition (order alternating: on,off "
                  "then off,on), both stacks alive, streaming /generate through the router; "
                  "ratios on/off",
        "plan": vars(plan) | {"sweep": list(plan.sweep)},
        "limit": limit,
        "workloads": workloads,
        "summary": summary,
        "bursts": [b.to_json() for b in bursts],
        "content": content,
        "content_failures": failures,
        "digest": digest,
        "ok": ok,
    }


def _correct(ctx: Ctx) -> int:
    return sum(r.outcome.value in CORRECT for r in ctx.records)


# ----------------------------------------------------------------------------- report


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def ratio_text(spread: dict[str, Any], pooled: float | None) -> str:
    """One table cell: ``mean [min, max]; pooled P`` (``-`` for what is missing)."""
    return (f"{_fmt(spread.get('mean'))} [{_fmt(spread.get('min'))}, "
            f"{_fmt(spread.get('max'))}]; pooled {_fmt(pooled)}")


METRIC_TITLES = {"throughput_tok_s": "throughput", "ttft_p50_s": "TTFT p50",
                 "ttft_p99_s": "TTFT p99", "itl_p50_s": "ITL p50"}


def markdown(report: dict[str, Any]) -> str:
    """report.md: conditions, the on/off ratio table (mean [min, max] over repetitions and
    pooled), absolute figures, content per variant, the digest counters and the verdict."""
    m = report.get("measurement") or {}
    cond = report.get("conditions") or {}
    lines = [
        "# KV digest on vs off (issue 10)", "",
        f"- created {report.get('created')}; command `{report.get('command')}`",
        f"- fork {report.get('version') or '-'}; backend {report.get('backend')}, "
        f"page size {report.get('page_size')}; stacks: {report.get('stack')}",
        f"- machine: {cond.get('cpu_count')} CPUs, load average at start "
        f"{cond.get('loadavg_start')}, before the bursts {cond.get('loadavg_bursts')}, "
        f"at the end {cond.get('loadavg_end')}",
        f"- total {(report.get('timing') or {}).get('total_s')} s "
        f"(timing: {json.dumps(report.get('timing') or {})})",
        f"- result: **{'ok' if report.get('ok') else 'FAILED'}**"
        + (f" ({report['error']})" if report.get("error") else ""),
    ]
    if not m:
        return "\n".join(lines) + "\n"
    lines += [
        "", "## Ratios on / off", "",
        "Throughput < 1: the digest costs throughput; latencies > 1: it costs latency. "
        "mean [min, max] of the per-repetition ratios, and pooled over all samples; "
        "no threshold is applied.", "",
        f"| workload | reps | {' | '.join(METRIC_TITLES[x] for x in METRICS)} |",
        "|---|---|" + "---|" * len(METRICS),
    ]
    for w in m["workloads"]:
        s = m["summary"][w]
        lines.append(f"| {w} | {s['reps']} | "
                     + " | ".join(ratio_text(s["ratios"][x], s["pooled"][x]) for x in METRICS)
                     + " |")
    lines += ["", "Absolute, pooled over repetitions:", "",
              "| workload | digest | throughput tok/s | TTFT p50 s | TTFT p99 s | ITL p50 s |",
              "|---|---|---|---|---|---|"]
    for w in m["workloads"]:
        for v in VARIANTS:
            a = m["summary"][w]["absolute"][v]
            lines.append(f"| {w} | {v} | {_fmt(a['throughput_tok_s'], 1)} | "
                         f"{_fmt(a['ttft_p50_s'], 4)} | {_fmt(a['ttft_p99_s'], 4)} | "
                         f"{_fmt(a['itl_p50_s'], 4)} |")
    lines += ["", "## Content and digest evidence", "",
              "| digest | answers | identical | other outcomes | verified_total moved | "
              "decode commits | OFF warning in | verdict |",
              "|---|---|---|---|---|---|---|---|"]
    for v in VARIANTS:
        c = m["content"][v]
        d = m["digest"][v]
        other = {k: n for k, n in c.items() if k not in ("sent", *CORRECT) and n}
        legs = d.get("off_warning_in")
        lines.append(f"| {v} | {c['sent']} | {c.get('identical', 0) + c.get('unproven', 0)} | "
                     f"{other or 'none'} | {d['moved'].get('verified', 0):g} | "
                     f"{d['moved'].get('decode_commits', 0):g} | "
                     f"{'-' if legs is None else (', '.join(legs) or 'none')} | "
                     f"{'ok' if d['ok'] else 'FAILED: ' + '; '.join(d['why'])} |")
    for v in VARIANTS:
        for f in m["content_failures"][v][:10]:
            lines.append(f"- {v}: `{f['label']}` {f['outcome']}: {f.get('detail', '')[:200]}")
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """Write ``out``/report.json (the whole report) and ``out``/report.md (``markdown``);
    creates ``out``. Returns both paths."""
    out.mkdir(parents=True, exist_ok=True)
    pj, pm = out / "report.json", out / "report.md"
    pj.write_text(json.dumps(report, indent=1, default=str) + "\n")
    pm.write_text(markdown(report))
    return pj, pm


def exit_status(report: dict[str, Any]) -> int:
    """2 when the run could not be carried out (``error`` set or no measurement), 0 when it
    was and ``ok`` holds (every answer correct, both digest verdicts), else 1."""
    if report.get("error") or not report.get("measurement"):
        return 2
    return 0 if report.get("ok") else 1


# ----------------------------------------------------------------------------- harness run


@contextlib.contextmanager
def _stacks(harness: Harness, backend: str, page_size: int) -> Iterator[dict[str, PDTarget]]:
    """Both variants' stacks, started in parallel; every started stack is stopped on exit,
    also when the other failed to start."""
    cms = {v: harness.stack("fork", backend, page_size, STACK, env=DIGEST_ENV[v])
           for v in VARIANTS}
    opened: dict[str, Any] = {}
    try:
        with ThreadPoolExecutor(max_workers=len(cms)) as ex:
            futs = {v: ex.submit(cm.__enter__) for v, cm in cms.items()}
            err: BaseException | None = None
            for v, f in futs.items():
                try:
                    opened[v] = f.result()
                except BaseException as e:  # noqa: BLE001 - re-raised after the loop
                    err = err or e
        if err is not None:
            raise err
        yield dict(opened)
    finally:  # both stacks stop at once (stopping is mostly waiting for processes to exit)
        with ThreadPoolExecutor(max_workers=len(cms)) as ex:
            for v in opened:
                ex.submit(_close, cms[v])


def _close(cm: Any) -> None:
    with contextlib.suppress(Exception):
        cm.__exit__(None, None, None)


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run(a: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """Start the reference and both stacks, measure, stop everything; the whole report
    (``error`` set and no ``measurement`` when the run failed)."""
    t0 = time.monotonic()
    knobs = Knobs.for_mode(a.quick, bound_s=a.bound, seed=a.seed)
    report: dict[str, Any] = {
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmark.kv_digest_cost " + " ".join(argv),
        "quick": a.quick, "backend": a.backend, "page_size": a.page_size,
        "stack": STACK.doc + f" (pools {STACK.prefill_pool}/{STACK.decode_pool})",
        "knobs": vars(knobs),
        "conditions": {"cpu_count": os.cpu_count(), "loadavg_start": _loadavg(),
                       "machine": platform.machine(), "python": platform.python_version()},
        "timing": {}, "ok": False,
    }
    log_dir = a.out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    report["logs"] = str(log_dir)
    harness = Harness(log_dir, base=None, reference_variant="fork")
    say = (lambda s: None) if a.no_progress else (
        lambda s: print(f"[kv-digest-cost] {s}", file=sys.stderr, flush=True))
    stopping: Future[None] | None = None
    t2 = t0
    try:
        say("starting the reference and both stacks")
        with ThreadPoolExecutor(max_workers=2) as ex:
            ref_fut = ex.submit(harness.start_reference)
            with _stacks(harness, a.backend, a.page_size) as targets:
                ref_url = ref_fut.result()
                report["timing"]["startup_s"] = round(time.monotonic() - t0, 1)
                report["version"] = targets["on"].versions.get("decode")
                report["reference"] = {"url": ref_url, "version": harness.reference_version}
                report["targets"] = {v: t.describe() for v, t in targets.items()}
                report["conditions"]["loadavg_bursts"] = _loadavg()
                say(f"stacks up after {report['timing']['startup_s']} s; bursts")
                t1 = time.monotonic()
                ref = Reference(ref_url, knobs.bound_s)
                m = measure(targets, ref, knobs, a.plan, on_burst=lambda s: say(f"done {s}"))
                m["reference_failures"] = ref.failures
                report["timing"]["bursts_s"] = round(time.monotonic() - t1, 1)
                report["measurement"] = m
                report["ok"] = m["ok"]
                t2 = time.monotonic()
                say("stopping the servers")
                stopping = ex.submit(harness.stop_reference)  # beside the stacks' stop
        report["timing"]["shutdown_s"] = round(time.monotonic() - t2, 1)
    except Exception as e:  # noqa: BLE001 - reported, exit status 2
        traceback.print_exc()
        report["error"] = f"{type(e).__name__}: {str(e)[-1500:]}"
    finally:
        if stopping is None:
            harness.stop_reference()
    report["conditions"]["loadavg_end"] = _loadavg()
    report["timing"]["total_s"] = round(time.monotonic() - t0, 1)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print where the report is and the ratios; the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(args)
    a.out.mkdir(parents=True, exist_ok=True)
    report = run(a, args)
    pj, _ = write_report(report, a.out)
    print(f"report: {pj} ({report['timing']['total_s']} s)")
    m = report.get("measurement")
    if m:
        for w in m["workloads"]:
            s = m["summary"][w]
            print(f"  {w:<9} on/off " + ", ".join(
                f"{METRIC_TITLES[x]} {_fmt(s['ratios'][x]['mean'])} "
                f"[{_fmt(s['ratios'][x]['min'])}, {_fmt(s['ratios'][x]['max'])}]"
                for x in METRICS))
        for v in VARIANTS:
            d = m["digest"][v]
            print(f"  digest {v}: content {m['content'][v]}, verified_total moved "
                  f"{d['moved'].get('verified', 0):g}: {'ok' if d['ok'] else d['why']}")
    if report.get("error"):
        print(f"error: {report['error']}", file=sys.stderr)
    return exit_status(report)


if __name__ == "__main__":
    sys.exit(main())
