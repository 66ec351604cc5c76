"""The incident's deployment walked end to end (issue 22, item 2): the ``incident-walk`` and
``incident-walk-auto-truncate`` scenarios (registered in ``benchmark.scenarios``; they start,
restart and stop their own servers: harness only, ``stack == OWN_SERVERS``).

The shape, the configurations of each step and the checks of what the operator sees are
``pdsafe_testkit.incident``'s (shared with the CI test, test/pd/test_incident_walk.py); here
every request is also judged against the co-located reference (``Ctx.run_phase``), and the
stock base runs the same requests on the incident's configuration.

Fork (``walk_fork``), in the guide's order:

1. The incident's configuration (prefill pool 65 % of the model's context, a larger decode
   pool, the model's context on both legs): the prefill refuses to start, the decode starts.
2. The prefill again with the clamp flag, the decode of step 1 kept: both legs up, and
   ``PAIR_PROBES`` canary requests, sent to both legs directly (the harness router's start waits
   for a served request, and this pair serves none), each refused at pairing on both legs.
3. Both legs restarted with the same ``--context-length``, the pool step 1 named, the router in
   front. With ``--allow-auto-truncate`` and legs whose advertised limits differ (page sizes
   above 5), restarted once more with the context lowered by the difference, as the guide says.
   Then the requests below.

Base (``walk_base``): the incident's configuration with the router (stock starts it: checked),
then the requests below.

The requests (both variants, lengths from the shape and the pair's limit ``L``: the fork's
advertised one, stock's by upstream's formula): a victim V (canary prompt of ``L - 1`` tokens,
generating until its KV covers every position a probe reads) fills decode's pages; then the
probes, one at a time, to both legs directly and judged on decode's answer (each gets the lowest
free pages of decode, V's: see ``pdsafe_testkit.late_write`` on the PD allocator), 4 new tokens
each: ``L - 1`` and ``L`` (within the limit), ``L + 1``, ``L + page``, just over the prefill's
pool, midway to the context, the context - 8 (over it); then normal canary requests up to
``L / 2`` (``scenarios._after``).

Expected of the fork: within the limit reference-identical; over it a 4xx naming the limit
(``incident.check_over_long``), or with auto-truncate the reference answer for the prompt's
first ``L`` tokens (what it is judged against). Stock: a prompt between its prefill's pool and the
context passes the HTTP layer (upstream checks the context only) and reaches the KV handoff as a
placeholder (without auto-truncate) or cut on the prefill only (with): decode answers HTTP 200
over V's KV, a leak whose canary attribution names V (a check of the base cell).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from pdsafe_testkit import incident as inc
from pdsafe_testkit.servers import SGLangServer, launch_server

from benchmark.canary import CanaryBook
from benchmark.evidence import reservations_after
from benchmark.outcomes import Outcome, RequestRecord
from benchmark.scenarios import Ctx, Job, OwnCtx, ScenarioNotAsDesigned, _after
from benchmark.targets import PDTarget, StackKind, side_limits, verify_variant

#: Requests sent to the pair refused at pairing (step 2).
PAIR_PROBES = 2
#: New tokens of every probe: prompt + answer fit the context at the limit.
PROBE_NEW = 4


@contextlib.contextmanager
def _recording(own: OwnCtx) -> Iterator[inc.Checks]:
    """The walk's checks, kept in ``own.checks`` (as JSON) when the walk ends or raises."""
    checks = inc.Checks()
    try:
        yield checks
    finally:
        own.checks.extend(c.to_json() for c in checks.items)


def _shape(own: OwnCtx) -> inc.Shape:
    return inc.Shape.scaled(own.harness.model, own.page_size)


def _kind(name: str, shape: inc.Shape, context: int, truncate: bool) -> StackKind:
    """A harness stack of the shape's pools, ``context`` on both legs, the router in front."""
    return StackKind(name, shape.prefill_pool, shape.decode_pool, truncate,
                     contexts=(context, context),
                     doc=f"{shape.describe()}; --context-length {context} on both legs"
                         + ("; --allow-auto-truncate" if truncate else ""))


def _pair_target(own: OwnCtx, prefill: SGLangServer, decode: SGLangServer) -> PDTarget:
    """A target for two servers the walk started itself (no router)."""
    urls = {"prefill": prefill.url, "decode": decode.url}
    versions = verify_variant(urls, own.variant)
    assert prefill.bootstrap_port is not None
    return PDTarget(own.variant, own.backend, own.page_size, "incident-clamped", prefill.url,
                    decode.url, None, inc.HOST, prefill.bootstrap_port, versions,
                    CanaryBook(own.harness.vocab))


# --------------------------------------------------------------------------- the fork's walk


def walk_fork(own: OwnCtx, *, truncate: bool) -> None:
    """Steps 1-3 on the fork (see the module docstring)."""
    shape = _shape(own)
    env = own.harness.env(own.variant)
    own.notes.append(f"shape: {shape.describe()}")
    with _recording(own) as checks:
        started = {role: launch_server(inc.incident_config(shape, role, own.backend,
                                                           model=own.harness.model,
                                                           truncate=truncate, env=env),
                                       own.harness.log_dir, wait=False)
                   for role in ("prefill", "decode")}
        try:
            inc.settle(list(started.values()))
            inc.check_first_start(checks, shape, started["prefill"], started["decode"])
            if not inc.is_healthy(started["decode"].url):
                raise ScenarioNotAsDesigned("step 1: the decode did not start:\n"
                                            + started["decode"].process.log_tail(20))
            _step_clamp(own, checks, shape, started["decode"], truncate, env)
        finally:
            for s in started.values():
                s.stop()
        _step_working(own, checks, shape, truncate)


def _step_clamp(own: OwnCtx, checks: inc.Checks, shape: inc.Shape, decode: SGLangServer,
                truncate: bool, env: dict[str, str]) -> None:
    """Step 2: the clamped prefill next to step 1's decode; every request refused at pairing."""
    prefill = launch_server(inc.clamp_config(shape, own.backend, model=own.harness.model,
                                             truncate=truncate, env=env), own.harness.log_dir)
    try:
        inc.check_clamped(checks, shape, prefill, decode)
        ctx = own.ctx_on(_pair_target(own, prefill, decode))
        jobs = []
        for i in range(PAIR_PROBES):
            owner, p = ctx.canary(f"clamped-{i}", 64)
            jobs.append(ctx.direct(f"clamped-{i}", p, canary=owner))
        ctx.run_phase("clamped-pair", jobs, concurrency=1)
        answers = []
        for j in jobs:
            d = j.answer
            p = j.side.get("prefill_answer")
            answers.append((p.status if p else None, p.message if p else "",
                            d.status if d else None, d.message if d else ""))
        inc.check_pair_refusals(checks, shape, prefill, decode, answers)
    finally:
        prefill.stop()


def _step_working(own: OwnCtx, checks: inc.Checks, shape: inc.Shape, truncate: bool) -> None:
    """Step 3: the same ``--context-length`` on both legs (realigned once for auto-truncate
    when the legs' limits differ); then the requests."""
    context = shape.working_context
    with own.harness.stack(own.variant, own.backend, own.page_size,
                           _kind("incident-working", shape, context, truncate)) as target:
        assert target.stack is not None
        limits = inc.check_working(checks, context, target.stack.prefill, target.stack.decode)
        if limits is None:
            raise ScenarioNotAsDesigned("step 3: the working configuration did not start")
        lp, ld = limits["prefill"].max_prompt_tokens, limits["decode"].max_prompt_tokens
        own.notes.append(f"step 3: --context-length {context} on both legs; advertised prompt "
                         f"limits prefill {lp}, decode {ld}")
        if not (truncate and lp != ld):
            _serve(own, checks, target, limits, truncate, context)
            return
        _misaligned(own, checks, target, shape, min(lp, ld))
    aligned = inc.aligned_context(context, lp, ld)
    own.notes.append(f"step 3: with --allow-auto-truncate each leg cuts at its own limit; they "
                     f"differ by {abs(lp - ld)}, so --context-length {aligned} on both")
    with own.harness.stack(own.variant, own.backend, own.page_size,
                           _kind("incident-aligned", shape, aligned, truncate)) as target:
        assert target.stack is not None
        limits = inc.check_working(checks, aligned, target.stack.prefill, target.stack.decode)
        if limits is None:
            raise ScenarioNotAsDesigned("step 3: the realigned configuration did not start")
        got = {r: v.max_prompt_tokens for r, v in limits.items()}
        checks.add(inc.STEP_WORKING, "with auto-truncate the legs advertise one limit",
                   len(set(got.values())) == 1, "equal max_prompt_tokens", got)
        _serve(own, checks, target, limits, truncate, aligned)


def _misaligned(own: OwnCtx, checks: inc.Checks, target: PDTarget, shape: inc.Shape,
                limit: int) -> None:
    """Auto-truncate on legs whose limits differ: a prompt over both is cut at a different
    length by each leg, and the fork refuses it (the guide: HTTP 500 from the coverage check)
    instead of answering; judged against the reference for the pair's limit (a leak if it
    answered other content)."""
    ctx = own.ctx_on(target)
    n = shape.kv("prefill") + 1
    owner, p = ctx.canary("misaligned-over", n)
    job = ctx.direct("misaligned-over", p, PROBE_NEW, canary=owner)
    job.prompt = p[:limit]
    rec = ctx.run_phase("misaligned", [job], concurrency=1)[0]
    checks.add(inc.STEP_WORKING, "with limits that differ, a cut prompt is refused (500, "
                                 "coverage)",
               rec.outcome is Outcome.EXPLICIT_ERROR and rec.status == 500
               and "coverage" in rec.detail, "HTTP 500 pdsafe coverage: ...",
               f"{rec.outcome.value} {rec.detail[:300]}")


def _serve(own: OwnCtx, checks: inc.Checks, target: PDTarget, limits: dict[str, Any],
           truncate: bool, context: int) -> None:
    """The working pair's requests and their checks; reads its reservations at the end."""
    assert target.stack is not None
    ctx = own.ctx_on(target)
    limit = inc.pair_limit(limits)
    probes = _requests(ctx, _shape(own), limit, context, truncate=truncate)
    inc.check_paired(checks, target.stack.prefill, target.stack.decode, limits)
    s = inc.STEP_WORKING
    within = [r for r in own.records if r.label.startswith(("victim", "within", "after"))
              and r.phase != "clamped-pair"]
    bad = [(r.label, r.outcome.value, r.detail[:160]) for r in within
           if r.outcome is not Outcome.IDENTICAL]
    checks.add(s, f"every prompt within the pair's limit ({limit}) is reference-identical",
               within and not bad, f"{len(within)} identical", bad or f"{len(within)} identical")
    for job, rec in probes:
        if truncate:
            checks.add(s, f"{job.side['sent']}-token prompt: the reference answer of its first "
                          f"{limit} tokens", rec.outcome is Outcome.IDENTICAL,
                       "identical", f"{rec.outcome.value} {rec.detail[:300]}")
        else:
            legs = (("decode", job.answer), ("prefill", job.side.get("prefill_answer")))
            for leg, ans in legs:
                inc.check_over_long(checks, job.side["sent"], ans.status if ans else None,
                                    ans.message if ans else "", limits,
                                    label=f"{job.side['sent']}-token prompt, {leg}'s client")
    own.reservations = _reservations(own, target)


def _reservations(own: OwnCtx, target: PDTarget) -> dict[str, Any] | None:
    try:
        return reservations_after(target.live_prefill_urls(), target.decode_url,
                                  target.page_size, settle_s=own.knobs.settle_s).to_json()
    except Exception as e:  # noqa: BLE001 - reported in the notes
        own.notes.append(f"reservations unreadable: {e}")
        return None


# --------------------------------------------------------------------------- the requests


def probe_lengths(shape: inc.Shape, limit: int) -> tuple[list[int], list[int]]:
    """(within the limit, over it): the same rule for both variants."""
    over = {limit + 1, limit + shape.page_size, shape.kv("prefill") + 1,
            (shape.kv("prefill") + shape.context) // 2, shape.context - 2 * PROBE_NEW}
    top = shape.context - 2 * PROBE_NEW
    return [limit - 1, limit], sorted(n for n in over if limit < n <= top)


def _requests(ctx: Ctx, shape: inc.Shape, limit: int, context: int, *,
              truncate: bool) -> list[tuple[Job, RequestRecord]]:
    """Victim, probes, normal requests (module docstring); returns the over-limit probes with
    their records. With ``truncate`` each over-limit probe is judged against the reference for
    its first ``limit`` tokens."""
    within, over = probe_lengths(shape, limit)
    v_len = limit - 1
    top = max(over, default=limit) + 16
    v_new = max(PROBE_NEW, min(context - v_len - 1, top - v_len))
    owner, v = ctx.canary("victim-V", v_len)
    ctx.run_phase("victim", [ctx.normal("victim-V", v, v_new, canary=owner)], concurrency=1)
    ctx.notes.append(f"victim V: {v_len} tokens + {v_new} generated; probes within the limit "
                     f"{within}, over it {over}")
    jobs: list[Job] = []
    for n in within:
        owner, p = ctx.canary(f"within-{n}", n)
        jobs.append(ctx.direct(f"within-{n}", p, PROBE_NEW, canary=owner))
    over_jobs: list[Job] = []
    for n in over:
        owner, p = ctx.canary(f"over-{n}", n)
        job = ctx.direct(f"over-{n}", p, PROBE_NEW, canary=owner)
        job.side["sent"] = n
        if truncate:
            job.prompt = p[:limit]
            job.side["note"] = (f"[sent {n} tokens; judged against the reference for its first "
                                f"{limit} (--allow-auto-truncate at the pair's limit)]")
        over_jobs.append(job)
    recs = ctx.run_phase("probes", jobs + over_jobs, concurrency=1)
    by_label = {r.label: r for r in recs}
    _after(ctx, ctx.knobs.victims, limit)
    return [(j, by_label[j.label]) for j in over_jobs]


# --------------------------------------------------------------------------- stock


def walk_base(own: OwnCtx, *, truncate: bool) -> None:
    """Stock on the incident's configuration: it starts, and its over-long prompts leak."""
    shape = _shape(own)
    own.notes.append(f"shape: {shape.describe()}")
    with _recording(own) as checks, own.harness.stack(
            own.variant, own.backend, own.page_size,
            _kind("incident", shape, shape.context, truncate)) as target:
        checks.add(inc.STEP_FIRST_START, "stock starts the incident's configuration",
                   target.healthy(), "every server up", target.down())
        lim = [side_limits(u).effective for u in (target.prefill_url, target.decode_url)]
        limit = min(x for x in lim if x)
        own.notes.append(f"stock's prompt limits by upstream's formula: prefill {lim[0]}, "
                         f"decode {lim[1]}")
        ctx = own.ctx_on(target)
        probes = _requests(ctx, shape, limit, shape.context, truncate=truncate)
        leaks = [r for _, r in probes if r.outcome is Outcome.LEAK]
        named = [r for r in leaks if any(src.startswith("victim-V") for src in r.leaked_from)]
        checks.add(inc.STEP_FIRST_START, "stock answers an over-long prompt with the victim's "
                                         "content (HTTP 200; the attribution names victim-V)",
                   bool(named), "a leak from victim-V",
                   [(r.label, r.outcome.value, r.attribution) for _, r in probes])
        own.reservations = _reservations(own, target)


def walk(own: OwnCtx, *, truncate: bool) -> None:
    """The scenario for either variant."""
    if own.variant == "fork":
        walk_fork(own, truncate=truncate)
    else:
        walk_base(own, truncate=truncate)


__all__ = ["PAIR_PROBES", "PROBE_NEW", "probe_lengths", "walk", "walk_base", "walk_fork"]
