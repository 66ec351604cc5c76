"""Regression benchmark: content-checked leak matrix and protection overhead, stock vs fork.

  python -m benchmark.regression [--quick] [--out DIR] [--backends mooncake,nixl]
      [--page-sizes 1,16,64] [--variants base,fork] [--scenarios NAMES]
      [--target-prefill URL --target-decode URL --target-router URL --target-reference URL
       [--base-target-prefill URL --base-target-decode URL --base-target-router URL]]

Harness mode (default): starts the CPU harness (pdsafe_testkit) for each variant: ``fork`` is
the installed package, ``base`` the pinned upstream with only patches 0001-0003 (built with
``scripts/pdsafe-patches materialize``, see ``benchmark.base_tree``). Deployment mode (the
``--target-*`` group): runs the scenarios marked ``deployment_ok`` against an existing
deployment; nothing is started, restarted or reconfigured.

Writes DIR/report.json, DIR/report.md and PNG plots (``benchmark.report``). Exit status 1 when
the fork (or the deployment under test) shows any leak or hang, 2 when the run itself could not
be carried out, 0 otherwise. ``--quick`` (CI smoke test): one backend, page size 1, few requests
per scenario, one overhead repetition; within 10 minutes on 2 CPU cores. ``--smoke`` (what
CI runs, test/test_benchmark_smoke.py): ``--quick`` on the default stack's scenarios only
(``scenarios.SMOKE_SCENARIOS``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import os
import random
import sys
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmark import client, preflight, transport
from benchmark import report as rpt
from benchmark.base_tree import DEFAULT_TREE, prepare_base_tree
from benchmark.evidence import reservations_after
from benchmark.overhead import OverheadPlan, measure
from benchmark.scenarios import (
    OWN_SERVERS,
    SCENARIOS,
    SMOKE_SCENARIOS,
    Ctx,
    Knobs,
    OwnCtx,
    Reference,
    Scenario,
    applicable,
    select,
)
from benchmark.targets import PDTarget, deployment_target, server_info

if TYPE_CHECKING:
    from benchmark.harness import Harness

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("base", "fork")


def _startup_error() -> type[BaseException]:
    """The harness's "a server did not start" (harness mode only: imports the testkit)."""
    from benchmark.harness import StartupError

    return StartupError


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmark.regression", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="CI smoke size: one backend, page size 1, few requests, 1 overhead rep")
    ap.add_argument("--smoke", action="store_true",
                    help="CI smoke: --quick restricted to the default stack's scenarios "
                         f"({', '.join(SMOKE_SCENARIOS)}) and the overhead bursts")
    ap.add_argument("--out", type=Path, default=None,
                    help="output directory (default build/bench-smoke, build/bench-quick or "
                         "build/bench-full)")
    ap.add_argument("--backends", type=_csv, default=None, help="mooncake,nixl")
    ap.add_argument("--page-sizes", type=lambda s: [int(x) for x in _csv(s)], default=None)
    ap.add_argument("--variants", type=_csv, default=None, help="base,fork")
    ap.add_argument("--scenarios", type=_csv, default=None,
                    help=f"comma-separated names (default all): {', '.join(SCENARIOS)}")
    ap.add_argument("--no-overhead", action="store_true", help="skip the overhead bursts")
    ap.add_argument("--reps", type=int, default=None, help="overhead repetitions")
    ap.add_argument("--bound", type=float, default=None, help="hang bound per request (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base-tree", type=Path, default=DEFAULT_TREE)
    ap.add_argument("--reference-variant", choices=VARIANTS, default=None,
                    help="build of the co-located reference (default: base when it runs)")
    ap.add_argument("--no-progress", action="store_true")
    g = ap.add_argument_group("deployment mode (an existing deployment; nothing is started)")
    g.add_argument("--target-prefill", action="append", type=_csv, metavar="URL[,URL...]",
                   help="prefill instance(s) behind the router (repeat or comma-separate); "
                        "requests sent to the legs directly go to the first")
    g.add_argument("--target-decode", action="append", type=_csv, metavar="URL[,URL...]",
                   help="decode instance(s), as --target-prefill")
    g.add_argument("--target-router")
    g.add_argument("--target-reference", help="a co-located (non-PD) server of the same model")
    g.add_argument("--target-bootstrap-host", help="default: the prefill URL's host")
    g.add_argument("--target-label", help="variant label (default: from /server_info version)")
    g.add_argument("--target-vocab-size", type=int,
                   help="vocabulary size for canary prompts (default: the model's config.json "
                        "if readable here, else 32000)")
    g.add_argument("--base-target-prefill", action="append", type=_csv,
                   help="a stock deployment next to it (its scenarios, and the overhead)")
    g.add_argument("--base-target-decode", action="append", type=_csv)
    g.add_argument("--base-target-router")
    g.add_argument("--api-key", default=os.environ.get("PDSAFE_BENCH_API_KEY"),
                   help="the servers' --api-key, sent as a bearer token (default: "
                        "$PDSAFE_BENCH_API_KEY; prefer the variable: arguments are visible "
                        "to other users of the machine)")
    g.add_argument("--admin-api-key", default=os.environ.get("PDSAFE_BENCH_ADMIN_API_KEY"),
                   help="the servers' --admin-api-key, for /abort_request (the abort "
                        "scenarios) (default: $PDSAFE_BENCH_ADMIN_API_KEY)")
    g.add_argument("--header", action="append", default=[], metavar="'NAME: VALUE'",
                   help="an extra header on every request (a gateway's tenant or routing "
                        "header); repeatable")
    g.add_argument("--require-determinism", action="store_true",
                   help="stop when a GPU server runs without --enable-deterministic-inference "
                        "(default: a warning; its differences would count as leaks)")
    g.add_argument("--ignore-preflight", action="store_true",
                   help="run even when the preflight finds that the reference cannot judge "
                        "the deployment (findings stay in the report)")
    g.add_argument("--max-probe-tokens", type=int, default=0,
                   help="longest long-prompt probe over-capacity-deployed sends (0: probe at "
                        "the deployment's own limits, whatever they are; the cost is printed "
                        "before the probes run)")
    a = ap.parse_args(argv)
    for k in ("target_prefill", "target_decode", "base_target_prefill", "base_target_decode"):
        setattr(a, k, [u for group in (getattr(a, k) or []) for u in group])
    try:
        a.headers = dict(transport.parse_header(h) for h in a.header)
    except ValueError as e:
        ap.error(str(e))
    a.deployment = any(getattr(a, f"target_{k}") for k in ("prefill", "decode", "router",
                                                          "reference"))
    if a.deployment:
        missing = [k for k in ("prefill", "decode", "reference") if not getattr(a, f"target_{k}")]
        if missing:
            ap.error("deployment mode needs --target-prefill, --target-decode and "
                     f"--target-reference (missing: {missing})")
    a.scenarios_named = bool(a.scenarios) and not a.smoke
    if a.smoke:
        if a.deployment:
            ap.error("--smoke is a harness run (it starts the CPU harness)")
        if a.scenarios:
            ap.error("--smoke selects its own scenarios; use --quick --scenarios NAMES instead")
        a.quick = True
        a.scenarios = list(SMOKE_SCENARIOS)
    a.backends = a.backends or (["mooncake"] if a.quick else ["mooncake", "nixl"])
    a.page_sizes = a.page_sizes or ([1] if a.quick else [1, 16, 64])
    a.variants = a.variants or list(VARIANTS)
    bad = [v for v in a.variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {bad}")
    if a.out is None:
        a.out = (Path("build") / "bench-deployment" if a.deployment else
                 REPO / "build" / ("bench-smoke" if a.smoke else
                                   "bench-quick" if a.quick else "bench-full"))
    return a


#: Options whose value must not reach report.json (keys; a header may carry a token).
SECRET_OPTIONS = ("--api-key", "--admin-api-key", "--header")


def redacted(argv: Sequence[str]) -> list[str]:
    """``argv`` with the values of ``SECRET_OPTIONS`` replaced by ``***`` (report.json)."""
    out: list[str] = []
    hide = False
    for arg in argv:
        if hide:
            out.append("***")
            hide = False
        elif arg in SECRET_OPTIONS:
            out.append(arg)
            hide = True
        elif arg.split("=", 1)[0] in SECRET_OPTIONS and "=" in arg:
            out.append(arg.split("=", 1)[0] + "=***")
        else:
            out.append(arg)
    return out


def _seed(*parts: Any) -> int:
    return int(hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:12], 16)


class Progress:
    """A tqdm bar over the planned work units (cells and overhead bursts), on stderr."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="step", file=sys.stderr, dynamic_ncols=True,
                                mininterval=1.0)
            except ImportError:
                self.bar = None
        self.requests = 0

    def step(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"{what} ({self.requests} req)", refresh=False)
            self.bar.update(1)
        else:
            print(f"[bench] done: {what}", file=sys.stderr, flush=True)

    def doing(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(what[:60])
        else:
            print(f"[bench] {what}", file=sys.stderr, flush=True)

    def request(self, n: int) -> None:
        self.requests += n

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _announce(message: str) -> None:
    print(f"note: {message}", file=sys.stderr, flush=True)


def run_scenario(s: Scenario, target: PDTarget, ref: Reference, knobs: Knobs,
                 progress: Progress) -> rpt.Cell:
    """Run one scenario on one target; the cell (status ``error`` if it raised)."""
    cell = rpt.Cell(s.name, s.family, target.backend, target.page_size, target.variant,
                    target=target.describe())
    ctx = Ctx(target, ref, knobs, random.Random(_seed(knobs.seed, s.name, target.backend,
                                                      target.page_size)),
              on_request=progress.request, announce=_announce)
    t0 = time.monotonic()
    try:
        assert s.fn is not None
        s.fn(ctx)
    except Exception as e:  # noqa: BLE001 - one scenario's failure must not end the run
        cell.status = "error"
        cell.reason = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
    cell.records, cell.phases, cell.notes = ctx.records, ctx.phases, ctx.notes
    cell.notes += ref.failures
    ref.failures.clear()
    down = target.down()
    cell.servers_down = [r for r in down if r not in target.killed]
    if cell.servers_down:
        cell.notes.append(f"server(s) down after the scenario: {cell.servers_down} "
                          f"(logs: {target.logs()})")
    if target.killed:
        cell.notes.append(f"killed by the scenario on purpose (not a crash; the stack is "
                          f"restarted before any later scenario): {sorted(target.killed)}")
    try:
        cell.reservations = reservations_after(target.live_prefill_urls(),
                                               target.live_decode_urls(),
                                               target.page_size,
                                               settle_s=knobs.settle_s).to_json()
    except Exception as e:  # noqa: BLE001
        cell.notes.append(f"reservations unreadable: {e}")
    cell.duration_s = time.monotonic() - t0
    return cell


def run_own(s: Scenario, harness: Harness, variant: str, backend: str, page: int,
            ref: Reference, knobs: Knobs, progress: Progress) -> rpt.Cell:
    """Run one scenario that starts its own servers (``OWN_SERVERS``) for one variant; the cell
    (status ``error`` if it raised, with what it judged and checked so far). Every server it
    started is stopped when it returns (its own context managers)."""
    progress.doing(f"{s.name} {variant}")
    cell = rpt.Cell(s.name, s.family, backend, page, variant,
                    target={"variant": variant, "backend": backend, "page_size": page,
                            "kind": OWN_SERVERS})
    own = OwnCtx(harness, variant, backend, page, ref, knobs,
                 random.Random(_seed(knobs.seed, s.name, backend, page)),
                 on_request=progress.request)
    t0 = time.monotonic()
    try:
        assert s.fn is not None
        s.fn(own)
    except Exception as e:  # noqa: BLE001 - one scenario's failure must not end the run
        cell.status = "error"
        cell.reason = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
    cell.records, cell.phases, cell.notes = own.records, own.phases, own.notes
    cell.checks, cell.reservations = own.checks, own.reservations
    cell.notes += ref.failures
    ref.failures.clear()
    if own.targets:
        cell.target["stacks"] = [t.describe() for t in own.targets]
    cell.duration_s = time.monotonic() - t0
    progress.step(f"{s.name} {variant}")
    return cell


class Slot:
    """One harness stack that is restarted when a scenario left a server dead."""

    def __init__(self, harness: Harness, variant: str, backend: str, page: int, kind: str):
        self.args = (variant, backend, page, kind)
        self.harness = harness
        self._cm: Any = None
        self.target: PDTarget | None = None
        self.restarts = 0

    def open(self) -> PDTarget:
        self._cm = self.harness.stack(*self.args)
        self.target = self._cm.__enter__()
        return self.target

    def ensure(self) -> tuple[PDTarget, str]:
        assert self.target is not None
        if self.target.healthy():
            return self.target, ""
        self.close()
        self.restarts += 1
        return self.open(), "stack restarted before this scenario (a server was down)"

    def close(self) -> None:
        if self._cm is not None:
            cm, self._cm, self.target = self._cm, None, None
            with contextlib.suppress(Exception):
                cm.__exit__(None, None, None)


def _open_slots(harness: Harness, variants: Sequence[str], backend: str, page: int,
                kind: str) -> dict[str, Slot | str]:
    """Start the variants' stacks of one kind in parallel (server startup is mostly waiting
    and single-threaded imports, so two stacks start in much less than twice the time of one).
    Per variant: the open ``Slot``, or the startup error's text. A ``VariantMismatch`` or any
    other failure propagates (after every started stack is stopped)."""
    slots = {v: Slot(harness, v, backend, page, kind) for v in variants}
    out: dict[str, Slot | str] = {}
    with ThreadPoolExecutor(max_workers=len(slots)) as ex:
        futs = {v: ex.submit(sl.open) for v, sl in slots.items()}
        failure: BaseException | None = None
        for v, f in futs.items():
            try:
                f.result()
                out[v] = slots[v]
            except _startup_error() as e:
                out[v] = str(e)
            except BaseException as e:  # noqa: BLE001 - re-raised below, after cleanup
                failure = failure or e
    if failure is not None:
        for sl in slots.values():
            sl.close()
        raise failure
    return out


def _placeholder(s: Scenario, backend: str, page: int, variant: str, status: str,
                 reason: str) -> rpt.Cell:
    return rpt.Cell(s.name, s.family, backend, page, variant, status=status, reason=reason)


class StackPipeline:
    """Starts the stacks of the next step while the current step runs, and stops finished
    stacks in the background (server startup and shutdown dominate a quick run on 2 cores).

    Invariant: every stack it started is stopped by ``close_all`` (also after an error), and a
    step's stacks are started before its scenarios run and stopped after them."""

    def __init__(self, harness: Harness, variants: Sequence[str]) -> None:
        self.harness, self.variants = harness, list(variants)
        self.ex = ThreadPoolExecutor(max_workers=4)
        self.pending: dict[tuple[str, int, str], Future] = {}
        self.closing: list[Future] = []
        self.started_at: dict[tuple[str, int, str], float] = {}

    def prefetch(self, step: tuple[str, int, str]) -> None:
        if step not in self.pending:
            self.started_at[step] = time.monotonic()
            self.pending[step] = self.ex.submit(_open_slots, self.harness, self.variants, *step)

    def get(self, step: tuple[str, int, str]) -> tuple[dict[str, Slot | str], float]:
        """The step's slots (started now if not prefetched) and seconds spent waiting."""
        self.prefetch(step)
        t0 = time.monotonic()
        got = self.pending.pop(step).result()
        return got, time.monotonic() - t0

    def release(self, slots: dict[str, Slot]) -> None:
        for sl in slots.values():
            self.closing.append(self.ex.submit(sl.close))

    def close_all(self) -> None:
        for fut in self.pending.values():
            with contextlib.suppress(BaseException):
                for got in fut.result().values():
                    if isinstance(got, Slot):
                        got.close()
        self.pending.clear()
        for fut in self.closing:
            with contextlib.suppress(BaseException):
                fut.result()
        self.closing.clear()
        self.ex.shutdown(wait=True)


def run_harness(a: argparse.Namespace, knobs: Knobs, plan: OverheadPlan,
                scenarios: list[Scenario]) -> tuple[dict[str, Any], list[rpt.Cell], dict | None]:
    timing: dict[str, Any] = {}
    t0 = time.monotonic()
    base = None
    if "base" in a.variants:
        base = prepare_base_tree(a.base_tree, log=lambda m: print(m, file=sys.stderr))
    timing["base_tree_s"] = round(time.monotonic() - t0, 1)
    log_dir = a.out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    ref_variant = a.reference_variant or ("base" if "base" in a.variants else "fork")
    from benchmark.harness import Harness

    harness = Harness(log_dir, base=base, reference_variant=ref_variant)
    quick_cut = a.quick and not a.scenarios_named  # --quick leaves full-only scenarios out
    runnable = [s for s in scenarios if applicable(s, deployment=False, quick=quick_cut)[0]]
    own = [s for s in runnable if s.stack == OWN_SERVERS]
    kinds: list[str] = []
    for s in runnable:
        if s.stack not in kinds and s.stack != OWN_SERVERS:
            kinds.append(s.stack)
    if "default" in kinds:
        kinds.remove("default")
        kinds.insert(0, "default")
    steps = [(b, p, k) for b in a.backends for p in a.page_sizes for k in kinds]
    do_overhead = (not a.no_overhead and set(a.variants) == set(VARIANTS))
    n_bursts = 0
    if do_overhead:
        n_work = 1 + len([n for n in plan.sweep if n < 512])
        n_bursts = len(a.backends) * plan.reps * n_work * 2
    total = len(runnable) * len(a.variants) * len(a.backends) * len(a.page_sizes) + n_bursts
    progress = Progress(total, not a.no_progress)
    cells: list[rpt.Cell] = []
    for backend in a.backends:
        for page in a.page_sizes:
            for s in scenarios:
                ok, why = applicable(s, deployment=False, quick=quick_cut)
                if not ok:
                    for v in a.variants:
                        cells.append(_placeholder(
                            s, backend, page, v,
                            "not_implemented" if not s.implemented else "not_applicable", why))
    overhead: dict[str, Any] | None = None
    versions: dict[str, str] = {}
    stack_waits: list[dict[str, Any]] = []
    pipe = StackPipeline(harness, a.variants)
    try:
        progress.doing(f"reference server ({ref_variant}) + first stacks")
        if steps:
            pipe.prefetch(steps[0])  # starts while the reference starts
        t1 = time.monotonic()
        ref = Reference(harness.start_reference(), knobs.bound_s)
        timing["reference_start_s"] = round(time.monotonic() - t1, 1)
        for i, (backend, page, kind) in enumerate(steps):
            nxt = steps[i + 1] if i + 1 < len(steps) else None
            group = [s for s in runnable if s.stack == kind]
            progress.doing(f"start {'+'.join(a.variants)} {backend} p{page} {kind}")
            opened, waited = pipe.get((backend, page, kind))
            stack_waits.append({"backend": backend, "page": page, "kind": kind,
                                "waited_s": round(waited, 1)})
            slots: dict[str, Slot] = {}
            for v, got in opened.items():
                if isinstance(got, Slot):
                    assert got.target is not None
                    versions[v] = got.target.versions["decode"]
                    slots[v] = got
                    continue
                for s in group:
                    cells.append(_placeholder(s, backend, page, v, "refused_to_start",
                                              got[-2000:]))
                    progress.step(f"{s.name} {v} (no stack)")
            try:
                oh_here = (kind == "default" and do_overhead and page == a.page_sizes[0]
                           and set(slots) == set(VARIANTS))
                first = [s for s in group if s.name == "steady-state"]
                rest = [s for s in group if s.name != "steady-state"]
                if not oh_here and nxt:
                    pipe.prefetch(nxt)
                for s in first:
                    for slot in slots.values():
                        cells.append(_run_in_slot(s, slot, ref, knobs, progress))
                if oh_here:
                    progress.doing(f"overhead {backend}")
                    t3 = time.monotonic()
                    oh = measure({v: sl.target for v, sl in slots.items()
                                  if sl.target is not None}, ref, knobs, plan,
                                 on_burst=lambda w: progress.step(f"overhead {w}"))
                    oh["backend"], oh["page_size"] = backend, page
                    if overhead is None:
                        overhead = oh
                    else:  # further backends: kept whole, counted for content
                        overhead.setdefault("additional", []).append(oh)
                    timing[f"overhead_{backend}_s"] = round(time.monotonic() - t3, 1)
                    if nxt:  # the next stacks start only once the clocks stopped
                        pipe.prefetch(nxt)
                for s in rest:
                    for slot in slots.values():
                        cells.append(_run_in_slot(s, slot, ref, knobs, progress))
            finally:
                pipe.release(slots)
        pipe.close_all()  # no stack of the pipeline runs beside the scenarios' own servers
        for backend in a.backends:
            for page in a.page_sizes:
                for s in own:
                    for v in a.variants:
                        t4 = time.monotonic()
                        cells.append(run_own(s, harness, v, backend, page, ref, knobs,
                                             progress))
                        timing[f"{s.name}_{backend}_p{page}_{v}_s"] = round(
                            time.monotonic() - t4, 1)
    finally:
        progress.close()
        pipe.close_all()
        harness.stop_reference()
    timing["stack_waits"] = stack_waits
    if overhead is None:
        overhead = {"status": "not_measured", "reason": (
            "--no-overhead" if a.no_overhead else
            "needs both variants' default stacks in one run (--variants base,fork and a "
            "scenario on the default stack)")}
    meta = {"versions": {"base": versions.get("base") or (base.version if base else None),
                         "fork": versions.get("fork")},
            "variants": {"base": base.describe() if base else None,
                         "fork": {"source": "installed package (the venv's sglang)",
                                  "python": sys.executable}},
            "reference": {"variant": ref_variant, "version": harness.reference_version,
                          "kind": "co-located server, same model, greedy"},
            "logs": str(log_dir), "timing": timing}
    return meta, cells, overhead


def _run_in_slot(s: Scenario, slot: Slot, ref: Reference, knobs: Knobs,
                 progress: Progress) -> rpt.Cell:
    variant = slot.args[0]
    progress.doing(f"{s.name} {variant}")
    try:
        target, note = slot.ensure()
    except _startup_error() as e:
        return _placeholder(s, slot.args[1], slot.args[2], variant, "error",
                            f"stack could not be restarted: {str(e)[-1500:]}")
    cell = run_scenario(s, target, ref, knobs, progress)
    if note:
        cell.notes.insert(0, note)
    progress.step(f"{s.name} {variant}")
    return cell


def run_deployment(a: argparse.Namespace, knobs: Knobs, plan: OverheadPlan,
                   scenarios: list[Scenario]) -> tuple[dict[str, Any], list[rpt.Cell],
                                                      dict | None]:
    main = deployment_target(a.target_prefill, a.target_decode, a.target_router,
                             bootstrap_host=a.target_bootstrap_host, label=a.target_label,
                             vocab=a.target_vocab_size)
    targets = {main.variant: main}
    if a.base_target_prefill and a.base_target_decode:
        b = deployment_target(a.base_target_prefill, a.base_target_decode, a.base_target_router,
                              bootstrap_host=a.target_bootstrap_host, label="base",
                              vocab=a.target_vocab_size)
        targets["base"] = b
    ref = Reference(a.target_reference.rstrip("/"), knobs.bound_s)
    checks = run_preflight(targets, ref, knobs, a)
    blocking = [f"{v}: {f['what']}" for v, fs in checks.items() for f in fs
                if f["level"] == "error"]
    meta_base = {"versions": {v: t.versions.get("decode") for v, t in targets.items()},
                 "variants": {v: t.describe() for v, t in targets.items()},
                 "reference": {"url": ref.url, "kind": "co-located server given by the operator"},
                 "preflight": checks, "auth": transport.auth().describe(), "timing": {}}
    if blocking and not a.ignore_preflight:
        raise PreflightFailed("the reference cannot judge this deployment token for token "
                              "(--ignore-preflight runs anyway):\n  " + "\n  ".join(blocking))
    runnable = [s for s in scenarios if applicable(s, deployment=True)[0]]
    progress = Progress(len(runnable) * len(targets), not a.no_progress)
    cells: list[rpt.Cell] = []
    try:
        for s in scenarios:
            ok, why = applicable(s, deployment=True)
            for t in targets.values():
                if not ok:
                    cells.append(_placeholder(
                        s, t.backend, t.page_size, t.variant,
                        "not_implemented" if not s.implemented else "not_applicable", why))
                    continue
                progress.doing(f"{s.name} {t.variant}")
                cells.append(run_scenario(s, t, ref, knobs, progress))
                progress.step(f"{s.name} {t.variant}")
        overhead = None
        if not a.no_overhead:
            if set(targets) == set(VARIANTS) and all(t.router_url for t in targets.values()):
                overhead = measure(targets, ref, knobs, plan)
            else:
                overhead = {"status": "not_measured",
                            "reason": "deployment mode measures fork/base ratios only with a "
                                      "stock deployment next to it (--base-target-prefill/"
                                      "--base-target-decode/--base-target-router)"}
    finally:
        progress.close()
    return meta_base, cells, overhead


class PreflightFailed(RuntimeError):
    """The preflight found that the reference cannot judge the deployment."""


def run_preflight(targets: dict[str, PDTarget], ref: Reference, knobs: Knobs,
                  a: argparse.Namespace) -> dict[str, list[dict[str, str]]]:
    """``benchmark.preflight`` for every target against the reference (printed, returned)."""
    ref_info = server_info(ref.url)
    out: dict[str, list[dict[str, str]]] = {}
    for v, t in targets.items():
        infos = {"reference": ref_info}
        infos.update({role: server_info(u) for role, u in t.urls().items() if role != "router"})
        found = preflight.check(infos, require_determinism=a.require_determinism)
        out[v] = preflight.to_json(found)
    probe = preflight.repeat_probe(
        lambda p, n: ref.expected(p, n), vocab=next(iter(targets.values())).book.vocab_size,
        seed=knobs.seed,
        concurrent=lambda jobs: [a_.output_ids if a_.ok else None for a_ in client.send_many(
            [(ref.url, client.greedy_payload(p, n)) for p, n in jobs],
            bound_s=knobs.bound_s, concurrency=len(jobs))])
    out["reference"] = preflight.to_json(probe)
    for v, fs in out.items():
        for f in fs:
            print(f"preflight {v}: {f['level']}: {f['what']}", file=sys.stderr, flush=True)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    knobs = Knobs.for_mode(a.quick, bound_s=a.bound, seed=a.seed,
                           max_probe_tokens=a.max_probe_tokens)
    transport.configure(a.api_key, a.admin_api_key, a.headers)
    plan = OverheadPlan.for_mode(a.quick)
    if a.reps:
        plan.reps = a.reps
    try:
        scenarios = select(a.scenarios)
    except KeyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    a.out.mkdir(parents=True, exist_ok=True)
    try:
        if a.deployment:
            meta, cells, overhead = run_deployment(a, knobs, plan, scenarios)
        else:
            meta, cells, overhead = run_harness(a, knobs, plan, scenarios)
    except PreflightFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - reported, exit status 2
        traceback.print_exc()
        print(f"error: the benchmark could not run: {e}", file=sys.stderr)
        return 2
    meta["timing"]["total_s"] = round(time.monotonic() - t0, 1)
    meta.update({
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "mode": "deployment" if a.deployment else "harness",
        "quick": a.quick,
        "smoke": a.smoke,
        "config": {"backends": a.backends, "page_sizes": a.page_sizes, "variants": a.variants,
                   "scenarios": [s.name for s in scenarios], "knobs": vars(knobs),
                   "overhead_plan": vars(plan) | {"sweep": list(plan.sweep)},
                   "cpu_count": os.cpu_count(),
                   "argv": redacted(list(argv or sys.argv[1:]))},
    })
    rep = rpt.write_all(meta, {s.name: s.describe() for s in scenarios}, cells, overhead, a.out)
    summ = rep["summary"]
    print(f"report: {a.out / 'report.json'} ({meta['timing']['total_s']} s)")
    for v, t in summ["totals"].items():
        print(f"  {v}: sent {t['sent']}, identical {t['identical']}, explicit errors "
              f"{t['explicit_errors']}, leaks {t['leaks']}, hangs {t['hangs']}, unproven "
              f"{t['unproven']}, broken {t['broken']}")
    print(f"  base shows the bug in: {summ['base_shows_bug_in'] or 'none'}")
    if summ["fork_failures"]:
        print(f"  FORK FAILURES: {summ['fork_failures']}")
    if summ["server_crashes"]:
        print(f"  WARNING servers died during: {summ['server_crashes']}")
    if summ["cell_errors"]:
        print(f"  cell errors: {summ['cell_errors']}")
    return summ["exit_status"]


if __name__ == "__main__":
    sys.exit(main())
