"""The scenario registry: named, documented fault scenarios, each judged request by request.

A scenario is a ``Scenario`` entry: its docstring (the function's) says what it does, what a
leak would look like and which upstream gap it probes (``docs/upstream-gaps.md``); its
``stack`` names the PD configuration it needs (``targets.STACK_KINDS``); ``deployment_ok`` says
whether it can run against an operator's deployment (no server-side fault injection, restart or
special configuration). Scenarios the benchmark cannot run yet are registered with status
``not_implemented`` and the reason, and reported as such, never silently left out.

Every implemented scenario follows one pattern: phases of requests, each phase sent
concurrently, judged against the reference (``outcomes.classify``), its identical answers
checked against the transfer counters (``evidence``). Victim requests carry canary prompts
(``canary``) so a leak names whose content showed up where.

Invariant: a scenario function only sends requests and reads state; it never changes the
servers' configuration, so a deployment target sees exactly what clients could do. The
exceptions are harness only (never ``deployment_ok``): the scenarios of the ``late_write`` stack
run against servers armed with the testkit's test-only ``late_write`` fault,
``crash-prefill-mid-transfer`` SIGKILLs one of that stack's prefills (``PDTarget.killed``)
and starts it again on its ports,
the corruption family asks the default stack's decode, armed with the test-only ``kv_corrupt``
fault, to change a request's transferred KV (by its rid), and
``abort-after-transfer-before-commit`` asks that decode's ``park_commit`` fault to hold a
finished transfer before its commit (by its rid), and the incident family
(``incident-walk*``, ``stack == OWN_SERVERS``) starts, restarts and reconfigures its own servers
the way an operator does (``benchmark.incident``), never a target the runner opened. The abort
family's ``/abort_request`` calls are what any client of upstream's HTTP API can send.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import requests

from benchmark import client, transport
from benchmark.evidence import Counters, read_counters
from benchmark.outcomes import (
    Answer,
    Outcome,
    RequestRecord,
    apply_evidence,
    classify,
    per_sample,
)
from benchmark.targets import (
    CHAT_SUFFIX,
    CTX_DIV_PREFILL_CONTEXT,
    PARK_COMMIT_S,
    PDTarget,
    server_info,
)

if TYPE_CHECKING:
    from pdsafe_testkit.late_write import Trio
    from pdsafe_testkit.servers import GenResult

    from benchmark.harness import Harness

#: The fake-transfer bootstrap host of upstream (``disaggregation/utils.py``
#: ``FAKE_BOOTSTRAP_HOST``); hard-coded so the benchmark does not import the server package.
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
HEALTH_CHECK_PREFIX = "HEALTH_CHECK"


@dataclass
class Knobs:
    """Sizes and bounds of a run (``--quick`` shrinks them)."""

    quick: bool = False
    steady_requests: int = 48
    victims: int = 4
    attacks: int = 4
    concurrency: int = 8
    max_new: int = 16
    bound_s: float = 60.0
    settle_s: float = 20.0
    evidence_wait_s: float = 5.0
    divergence_rounds: int = 3
    seed: int = 0
    #: Longest probe prompt ``over-capacity-deployed`` sends (0: no cap); longer probes are
    #: listed as skipped in the cell's notes (a deployment's own limit may be 1M tokens).
    max_probe_tokens: int = 0
    #: Requests of ``concurrent-trace`` and the window their start times are drawn from.
    trace_requests: int = 40
    trace_window_s: float = 10.0

    @classmethod
    def for_mode(cls, quick: bool, **over: Any) -> Knobs:
        k = (cls(quick=True, steady_requests=12, victims=2, attacks=2, concurrency=4,
                 bound_s=20.0, settle_s=5.0, divergence_rounds=2, trace_requests=24,
                 trace_window_s=6.0)
             if quick else cls())
        for key, v in over.items():
            if v is not None:
                setattr(k, key, v)
        return k


class Reference:
    """Greedy answers of the co-located reference server, memoized (thread-safe enough: a
    duplicate lookup only costs a request)."""

    def __init__(self, url: str, bound_s: float = 120.0) -> None:
        self.url, self.bound_s = url, bound_s
        self._cache: dict[tuple[tuple[int, ...], int], list[int] | None] = {}
        self.failures: list[str] = []

    def expected(self, prompt: Sequence[int], max_new: int) -> list[int] | None:
        key = (tuple(prompt), max_new)
        if key not in self._cache:
            a = client.send(self.url, client.greedy_payload(prompt, max_new),
                            bound_s=self.bound_s)
            if a.status == 200 and not a.in_band_abort and not a.samples:
                self._cache[key] = list(a.output_ids)
            else:
                self._cache[key] = None
                what = ("no answer in time" if a.timed_out
                        else a.transport_error or a.message)
                self.failures.append(f"reference HTTP {a.status} for a {len(prompt)}-token "
                                     f"prompt: {what[:200]}")
        return self._cache[key]


@dataclass
class Job:
    """One client request of a phase: how to send it and what to judge it against."""

    label: str
    path: str
    prompt: list[int]
    max_new: int
    call: Callable[[], Answer]
    canary: int | None = None
    side: dict[str, Any] = field(default_factory=dict)
    answer: Answer | None = None


@dataclass
class Ctx:
    """What a scenario function gets: the target, the oracle, the knobs, and the record."""

    target: PDTarget
    ref: Reference
    knobs: Knobs
    rng: random.Random
    records: list[RequestRecord] = field(default_factory=list)
    phases: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    on_request: Callable[[int], None] = lambda n: None
    #: Where the cost of an expensive phase is announced before it runs (the operator's
    #: terminal, in the benchmark: stderr).
    announce: Callable[[str], None] = lambda msg: None

    # ---------------------------------------------------------------- request builders

    def canary(self, label: str, length: int) -> tuple[int, list[int]]:
        return self.target.book.prompt(self.rng, label, length)

    def via_router(self, label: str, prompt: list[int], max_new: int | None = None, *,
                   canary: int | None = None, stream: bool = False, **extra: Any) -> Job:
        url = self.target.router_url
        if url is None:
            raise RuntimeError("this scenario needs the router (--target-router)")
        mn = max_new or self.knobs.max_new
        body = client.greedy_payload(prompt, mn, stream=stream, **extra)
        return Job(label, "router" + ("-stream" if stream else ""), prompt, mn,
                   lambda: client.send(url, body, bound_s=self.knobs.bound_s), canary)

    def normal(self, label: str, prompt: list[int], max_new: int | None = None, *,
               canary: int | None = None, stream: bool = False, **extra: Any) -> Job:
        """A client request the way clients send it: through the router when there is one,
        else directly to both legs (deployment mode without ``--target-router``)."""
        if self.target.router_url:
            return self.via_router(label, prompt, max_new, canary=canary, stream=stream,
                                   **extra)
        return self.direct(label, prompt, max_new, canary=canary, **extra)

    def direct(self, label: str, prompt: list[int], max_new: int | None = None, *,
               canary: int | None = None, room: int | None = None, **extra: Any) -> Job:
        """Both legs directly (what the router does); judged on decode's answer."""
        mn = max_new or self.knobs.max_new
        body = client.greedy_payload(prompt, mn, **extra)
        job = Job(label, "pd-direct", prompt, mn, lambda: Answer(status=None), canary)

        def call() -> Answer:
            p, d = client.direct_pd(self.target.prefill_url, self.target.decode_url, body,
                                    bootstrap_host=self.target.bootstrap_host,
                                    bootstrap_port=self.target.bootstrap_port, room=room,
                                    bound_s=self.knobs.bound_s)
            job.side["prefill"] = (p.status, p.message[:200], p.timed_out)
            job.side["prefill_answer"] = p
            return d

        job.call = call
        return job

    def direct_chat(self, label: str, content: list[int], rendered: list[int],
                    max_new: int | None = None, *, canary: int | None = None) -> Job:
        """A /v1/chat/completions request (one user message whose text spells ``content``
        with the word-level vocabulary) to both legs directly; judged on decode's answer
        against the reference answer for ``rendered``: the token ids decode's chat template
        makes of the message (what the client asked the deployment to answer)."""
        mn = max_new or self.knobs.max_new
        words = self.target.words()
        body = client.chat_payload(" ".join(words[t] for t in content), mn,
                                   model=self.target.served_model())
        job = Job(label, "pd-direct-chat", list(rendered), mn, lambda: Answer(status=None),
                  canary)

        def call() -> Answer:
            p, d = client.direct_pd(self.target.prefill_url, self.target.decode_url, body,
                                    bootstrap_host=self.target.bootstrap_host,
                                    bootstrap_port=self.target.bootstrap_port,
                                    bound_s=self.knobs.bound_s, path=client.CHAT_PATH)
            job.side["prefill"] = (p.status, p.message[:200], p.timed_out)
            if d.prompt_ids is not None and d.prompt_ids != job.prompt:
                job.side["note"] = (f"[decode tokenized the chat as {d.prompt_ids[-8:]} (tail), "
                                    f"expected {job.prompt[-8:]}: judged against the expected]")
            return d

        job.call = call
        return job

    def decode_only(self, label: str, prompt: list[int], max_new: int | None = None, *,
                    canary: int | None = None, **extra: Any) -> Job:
        mn = max_new or self.knobs.max_new
        body = client.greedy_payload(prompt, mn, **extra)
        url = self.target.decode_url
        return Job(label, "decode-direct", prompt, mn,
                   lambda: client.send(url, body, bound_s=self.knobs.bound_s), canary)

    # ---------------------------------------------------------------- phases

    def run_phase(self, name: str, jobs: Sequence[Job], *, concurrency: int | None = None,
                  judge: bool = True) -> list[RequestRecord]:
        """Send ``jobs`` concurrently, judge every answer, charge unproven transfers."""
        before = read_counters(*self.target.counter_urls())
        t0 = time.monotonic()
        width = max(1, min(concurrency or self.knobs.concurrency, len(jobs) or 1))

        def run(job: Job) -> Answer:
            job.answer = job.call()
            self.on_request(1)
            return job.answer

        with ThreadPoolExecutor(max_workers=width) as ex:
            list(ex.map(run, jobs))
        return self.judge_phase(name, jobs, before=before, wall_s=time.monotonic() - t0,
                                judge=judge)

    def judge_phase(self, name: str, jobs: Sequence[Job], *, before: Counters,
                    wall_s: float, prefill_urls: Sequence[str] | None = None,
                    judge: bool = True) -> list[RequestRecord]:
        """Judge jobs whose ``answer`` is already set (sent by the caller, e.g. a scenario's
        own choreography), record the phase, charge unproven transfers against the counters
        moved since ``before`` (read on ``prefill_urls``, default the target's prefill)."""
        recs = [r for j in jobs
                for r in self._judge(name, j, j.answer or Answer(status=None,
                                                                 transport_error="not sent"))]
        n_ident = sum(r.outcome is Outcome.IDENTICAL for r in recs)
        delta = self._await_evidence(before, n_ident, prefill_urls)
        short = apply_evidence(recs, delta.proven) if judge else 0
        self.phases.append({"phase": name, "sent": len(jobs), "wall_s": round(wall_s, 3),
                            "transfers": delta.to_json(), "unproven": short})
        self.records.extend(recs)
        return recs

    def _await_evidence(self, before: Counters, n_ident: int,
                        prefill_urls: Sequence[str] | None = None) -> Counters:
        prefills, decodes = self.target.counter_urls()
        if prefill_urls is not None:
            prefills = list(prefill_urls)
        deadline = time.monotonic() + self.knobs.evidence_wait_s
        while True:
            delta = read_counters(prefills, decodes).minus(before)
            if delta.proven >= n_ident or time.monotonic() >= deadline:
                return delta
            time.sleep(0.25)

    def _judge(self, phase: str, job: Job, ans: Answer) -> list[RequestRecord]:
        """One record per answer to judge: the answer, or each of the ``job.side["n"]``
        samples a parallel-sampling request asked for (``outcomes.per_sample``; labelled
        ``LABEL#i``), each against the same reference answer."""
        answers = per_sample(ans, int(job.side.get("n", 1)))
        if ans.samples is None and len(answers) == 1:  # one answer for the whole request
            return [self._judge_one(phase, job, ans, job.label)]
        return [self._judge_one(phase, job, a, f"{job.label}#{i}")
                for i, a in enumerate(answers)]

    def _judge_one(self, phase: str, job: Job, ans: Answer, label: str) -> RequestRecord:
        expected = self.ref.expected(job.prompt, job.max_new)
        outcome, detail = classify(ans, expected)
        rec = RequestRecord(label, job.path, len(job.prompt), job.max_new, outcome, detail,
                            ans.status, job.canary, phase=phase, e2e_s=ans.e2e_s,
                            output_head=list(ans.output_ids[:24]),
                            expected_head=list((expected or [])[:24]))
        if job.side.get("prefill"):
            ps, pm, pto = job.side["prefill"]
            rec.detail = (rec.detail + f" [prefill leg: {'hang' if pto else ps} {pm}]").strip()
        if job.side.get("note"):
            rec.detail = (rec.detail + " " + job.side["note"]).strip()
        if outcome is Outcome.EXPLICIT_ERROR and "differ:" in ans.message:
            # A pair refusal names the differing settings past the detail's length: keep the
            # reason once per cell, so the report says which setting the fork refused.
            why = ans.message[ans.message.index("differ:"):][:240].split(". Fix")[0]
            note = f"pair refusal: {why}"
            if note not in self.notes:
                self.notes.append(note)
        if outcome is Outcome.LEAK:
            att = self.target.book.attribute(ans.output_ids, job.canary)
            rec.leaked_from = att.sources
            rec.attribution = att.describe()
        return rec


#: ``Scenario.stack`` of a scenario that starts, restarts and stops its own servers (harness
#: only, never ``deployment_ok``): the runner opens no stack for it and calls its function with
#: an ``OwnCtx`` instead of a ``Ctx`` on a target.
OWN_SERVERS = "own servers"


@dataclass
class OwnCtx:
    """What a scenario with its own servers gets: the harness to start them with (its
    ``env(variant)`` selects the build), the cell's coordinates, the oracle and the record.
    ``ctx_on(target)`` gives a ``Ctx`` on one of the scenario's stacks that appends to the same
    records, phases and notes, so requests on every stack it starts are judged like any other.
    ``checks``: what the operator sees at each step, compared with the guide
    (``pdsafe_testkit.incident.Check.to_json``); a failed check of the fork fails the run.
    ``reservations``: what the last stack still held before the scenario stopped it."""

    harness: Harness
    variant: str
    backend: str
    page_size: int
    ref: Reference
    knobs: Knobs
    rng: random.Random
    on_request: Callable[[int], None] = lambda n: None
    records: list[RequestRecord] = field(default_factory=list)
    phases: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)
    reservations: dict[str, Any] | None = None
    targets: list[PDTarget] = field(default_factory=list)

    def ctx_on(self, target: PDTarget) -> Ctx:
        self.targets.append(target)
        return Ctx(target, self.ref, self.knobs, self.rng, self.records, self.phases,
                   self.notes, self.on_request)


# ----------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Scenario:
    """One registry entry (see the module docstring). ``fn`` takes a ``Ctx`` on the target the
    runner opened for ``stack``, or, for ``stack == OWN_SERVERS``, an ``OwnCtx``."""

    name: str
    family: str
    stack: str
    fn: Callable[[Any], None] | None
    deployment_ok: bool = False
    harness_ok: bool = True
    known_unsafe_upstream: bool = False
    reason: str = ""
    doc_override: str = ""
    in_quick: bool = True

    @property
    def implemented(self) -> bool:
        return self.fn is not None

    @property
    def status(self) -> str:
        return "implemented" if self.implemented else "not_implemented"

    @property
    def doc(self) -> str:
        text = self.doc_override or (self.fn.__doc__ if self.fn else "") or ""
        return " ".join(text.split())

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "family": self.family, "stack": self.stack,
                "status": self.status, "deployment_ok": self.deployment_ok,
                "harness_ok": self.harness_ok,
                "known_unsafe_upstream": self.known_unsafe_upstream,
                "doc": self.doc, "reason": self.reason}


def _lengths(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    return [rng.randint(lo, max(lo, hi)) for _ in range(n)]


def _pair_limit(ctx: Ctx) -> tuple[int, dict[str, Any]]:
    """The longest prompt the pair claims to accept: the smallest effective limit of every
    prefill and decode instance (a router may send a request to any of them)."""
    lim = ctx.target.limits()
    eff = [v.effective for v in lim.values() if v.effective]
    info = {side: vars(v) for side, v in lim.items()}
    return (min(eff) if eff else 256), info


def _victims(ctx: Ctx, n: int, length: int, max_new: int = 16) -> None:
    """Fill decode's pages with canary KV: ``n`` normal requests through the router (or
    directly when there is no router), run one by one so their pages are freed in order."""
    for i in range(n):
        label = f"victim-{i}"
        owner, p = ctx.canary(label, length)
        ctx.run_phase(f"victims-{i}", [ctx.normal(label, p, max_new, canary=owner)],
                      concurrency=1)


def _after(ctx: Ctx, n: int, limit: int) -> None:
    """Normal requests after the attack: they reuse the pages the attack touched."""
    jobs = []
    for i, length in enumerate(_lengths(ctx.rng, n, 24, max(32, limit // 2))):
        label = f"after-{i}"
        owner, p = ctx.canary(label, length)
        jobs.append(ctx.normal(label, p, canary=owner))
    ctx.run_phase("after", jobs)


def steady_state(ctx: Ctx) -> None:
    """Many concurrent normal requests through the router, no fault: the false-alarm check.

    Canary prompts of random lengths (24 tokens to half the pair's limit), half of them
    streamed, ``concurrency`` in flight. No variant may show anything but ``identical`` here;
    a leak would be an answer carrying another concurrent request's tokens (pages handed out
    twice), a hang a request stuck in a PD queue. Probes no specific upstream gap: it is what
    every protection must not break, and what the overhead section measures.
    """
    limit, info = _pair_limit(ctx)
    ctx.notes.append(f"pair limit {limit}")
    jobs = []
    for i, length in enumerate(_lengths(ctx.rng, ctx.knobs.steady_requests, 24,
                                        max(32, limit // 2))):
        label = f"steady-{i}"
        owner, p = ctx.canary(label, length)
        jobs.append(ctx.normal(label, p, canary=owner, stream=bool(i % 2)))
    ctx.run_phase("steady", jobs)


def over_capacity(ctx: Ctx) -> None:
    """Prompts at the pair's limit - 1, limit, limit + 1 and limit + page through the router.

    ``limit`` is the longest prompt the smaller side claims to accept: sglang-pdsafe
    advertises it (``/model_info`` ``max_prompt_tokens``); stock servers do not, so upstream's
    own ``max_req_input_len - 1`` (its formula on ``/server_info``'s context length and KV
    capacity) is used; both variants are probed at upstream's limit, the fork also at its own.
    Victims fill decode's pages first; normal requests follow. Expected: answers at or below
    the limit identical, above it an explicit 4xx on every leg. A leak would be a 200 answer
    decoded over pages prefill never wrote (the incident's placeholder handoff); a hang, a leg
    left waiting for a peer that already refused the request. Probes upstream-gaps 1 (limit
    checked only in the scheduler, peer not told: the refused request's reservation on the
    other side is counted in ``pages_reserved_after``). Probes use 4 new tokens so that
    prompt + answer fit the context length at the limit.
    """
    limit, info = _pair_limit(ctx)
    page = ctx.target.page_size
    bases = {limit}
    ups = [v["upstream_max_prompt"] for v in info.values() if v["upstream_max_prompt"]]
    if ups:
        bases.add(min(ups))
    lengths = sorted({n for b in bases for n in (b - 1, b, b + 1, b + page) if n > 16})
    ctx.notes.append(f"limits {info}; probe lengths {lengths}")
    _victims(ctx, ctx.knobs.victims, min(limit - 1, 256))
    run, skipped = _probe_plan(lengths, ctx.knobs.max_probe_tokens)
    cost = probe_cost(run, skipped, ctx.records, ctx.knobs.max_probe_tokens)
    ctx.notes.append(cost)
    ctx.announce(f"{ctx.target.variant}: {cost}")
    jobs = []
    for n in run:
        label = f"probe-{n}"
        owner, p = ctx.canary(label, n)
        jobs.append(ctx.normal(label, p, 4, canary=owner))
    if jobs:
        ctx.run_phase("probes", jobs, concurrency=len(jobs))
    _after(ctx, ctx.knobs.victims, limit)


def _probe_plan(lengths: Sequence[int], cap: int) -> tuple[list[int], list[int]]:
    """(probe lengths to send, lengths over ``cap`` left out; ``cap`` 0: none left out)."""
    if cap <= 0:
        return list(lengths), []
    return [n for n in lengths if n <= cap], [n for n in lengths if n > cap]


def probe_cost(run: Sequence[int], skipped: Sequence[int], measured: Sequence[RequestRecord],
               cap: int) -> str:
    """What the long-prompt probes cost, said before they are sent: prompt tokens in all,
    and the time at the prefill rate the requests judged so far achieved (prompt tokens per
    second of their end-to-end time: a rough upper bound on the time, it includes decoding)."""
    total = sum(run)
    timed = [r for r in measured if r.e2e_s and r.outcome.value == "identical"]
    rate = (sum(r.prompt_len for r in timed) / sum(r.e2e_s or 0 for r in timed)
            if timed else 0.0)
    text = (f"long-prompt probes at the deployment's limits: {len(run)} request(s) of "
            f"{', '.join(map(str, run)) or '-'} prompt tokens, {total} prompt tokens in all "
            "(each prefilled once and its KV moved to decode; 4 new tokens each)")
    if rate > 0:
        text += (f"; at the {rate:.0f} prompt tokens/s the victims achieved, about "
                 f"{total / rate:.0f} s")
    if skipped:
        text += (f"; not sent (over --max-probe-tokens {cap}): "
                 f"{', '.join(map(str, skipped))} tokens")
    return text


def spoof_fake_bootstrap_host(ctx: Ctx) -> None:
    """A client sends ``bootstrap_host: "2.2.2.2"`` (upstream's fake-transfer marker) directly to
    decode.

    Victims first fill decode's pages with canary KV through the router. Stock 0.5.23 copies
    the client's bootstrap host into the request, skips the KV transfer (``fake/conn.py``) and
    decodes over pages nobody wrote for this request: HTTP 200 whose tokens are the victims'
    (a leak naming the victim). Expected: an explicit 400 (the host is server-internal).
    Probes upstream-gaps 1, "fake transfer reachable by clients".
    """
    limit, _ = _pair_limit(ctx)
    _victims(ctx, ctx.knobs.victims, min(limit - 1, 200))
    jobs = []
    for i in range(ctx.knobs.attacks):
        label = f"spoof-host-{i}"
        owner, p = ctx.canary(label, min(limit - 1, 200))
        jobs.append(ctx.decode_only(label, p, canary=owner, bootstrap_host=FAKE_BOOTSTRAP_HOST,
                                    bootstrap_port=ctx.target.bootstrap_port,
                                    bootstrap_room=ctx.rng.randrange(1 << 62)))
    ctx.run_phase("spoof", jobs)
    _after(ctx, ctx.knobs.victims, limit)


def spoof_health_check_rid(ctx: Ctx) -> None:
    """Client requests whose rid looks like the server's own health check (``HEALTH_CHECK...``),
    through the router and directly to both legs.

    Upstream exempts such rids from the KV checksum and from metrics. The content of the answer
    is not at risk on this harness (the checksum is off by default and CUDA-only), so stock
    0.5.23 is expected to answer identical or ``unproven`` (its transfer metrics skip the rid);
    sglang-pdsafe refuses the rid with an explicit 400. A leak would only appear together with a
    corruption fault (not implemented yet). Probes upstream-gaps 1 (client-reachable
    ``HEALTH_CHECK`` prefix) and 3 (checksum fails open for that prefix).
    """
    limit, _ = _pair_limit(ctx)
    _victims(ctx, ctx.knobs.victims, min(limit - 1, 128))
    jobs = []
    for i in range(ctx.knobs.attacks):
        label = f"spoof-rid-{i}"
        owner, p = ctx.canary(label, min(limit - 1, 128))
        rid = f"{HEALTH_CHECK_PREFIX}_{uuid.uuid4().hex}"
        jobs.append(ctx.via_router(label, p, canary=owner, rid=rid) if i % 2 == 0
                    and ctx.target.router_url else ctx.direct(label, p, canary=owner, rid=rid))
    ctx.run_phase("spoof", jobs)
    _after(ctx, ctx.knobs.victims, limit)


def room_duplicate_concurrent(ctx: Ctx) -> None:
    """Pairs of requests with different canary prompts and the SAME client-chosen
    ``bootstrap_room``, each sent directly to prefill and decode, all at once.

    Upstream keys prefill's transfer bookkeeping and decode's commit check by the room alone
    (no generation, no owner), so two requests sharing a room can receive each other's KV or
    strand one another. A leak: request A's answer carries B's canary tokens (the report names
    B). A hang: one of the pair never gets its KV. Expected: both answers identical, or an
    explicit error for the one that cannot be told apart. Probes upstream-gaps 2 (room ids are
    client supplied, no generation on KV_STATUS / aux data).
    """
    limit, _ = _pair_limit(ctx)
    _victims(ctx, ctx.knobs.victims, min(limit - 1, 160))
    jobs = []
    for i in range(ctx.knobs.attacks):
        room = ctx.rng.randrange(1 << 62)
        for who in ("a", "b"):
            label = f"room-{i}{who}"
            owner, p = ctx.canary(label, ctx.rng.randint(48, max(64, min(limit - 1, 200))))
            jobs.append(ctx.direct(label, p, canary=owner, room=room))
    ctx.run_phase("duplicates", jobs, concurrency=len(jobs))
    _after(ctx, ctx.knobs.victims, limit)


def room_replay(ctx: Ctx) -> None:
    """A request A completes with client-chosen room R; then request B (other canary prompt)
    is sent with the same room R, directly to both legs (a replayed room).

    Upstream forgets nothing about a finished room on purpose (re-bootstrap reuses rooms), so a
    replay may meet state the first request left (stale transfer info, stale aux row): a leak
    is B answered with A's tokens, a hang B's decode leg waiting for a transfer that prefill
    thinks it already did. Expected: B identical or an explicit error. Probes upstream-gaps 2.
    """
    limit, _ = _pair_limit(ctx)
    for i in range(ctx.knobs.attacks):
        room = ctx.rng.randrange(1 << 62)
        owner_a, a = ctx.canary(f"replay-{i}a", ctx.rng.randint(48, max(64, min(limit - 1, 200))))
        ctx.run_phase(f"first-{i}", [ctx.direct(f"replay-{i}a", a, canary=owner_a, room=room)])
        owner_b, b = ctx.canary(f"replay-{i}b", ctx.rng.randint(48, max(64, min(limit - 1, 200))))
        ctx.run_phase(f"replay-{i}", [ctx.direct(f"replay-{i}b", b, canary=owner_b, room=room)])
    _after(ctx, ctx.knobs.victims, limit)


#: Samples asked for per parallel-sampling request of ``room-n-greater-1`` (cycled).
N_SAMPLES = (2, 3, 4)


def room_n_greater_1(ctx: Ctx) -> None:
    """Parallel sampling on PD: ``/generate`` with ``sampling_params.n`` 2, 3, 4 (cycled,
    greedy), alternately through the router and directly to both legs with one bootstrap room
    per request, after victims, with as many normal canary requests at the same time, then
    normal requests.

    Upstream's tokenizer manager turns an ``n>1`` request into a prefix-cache request
    (``max_new_tokens`` 0) and then ``n`` samples, each sent with the request's one
    ``bootstrap_room`` on both legs (sgl-project/sglang #26486, #40297): ``n+1`` transfers
    share one room's state by construction (a crash, a hang, or a sample decoded over pages
    another sample's transfer wrote). A 200 answer is a list of ``n`` samples, each judged
    against the co-located reference's single greedy answer for the prompt (temperature 0:
    every sample must equal it token for token; ``outcomes.per_sample``, one record per
    sample, a sample missing from the list is broken). A leak: a sample that differs from the
    reference (the canary names whose KV it was decoded over); a hang: no answer within the
    bound. Expected of the fork: an explicit 400 (``n>1`` refused in PD mode, room guard) and
    the normal requests identical. Probes upstream-gaps 2 (room ids client or router
    supplied, no generation on KV_STATUS / aux data).
    """
    limit, _ = _pair_limit(ctx)
    _victims(ctx, ctx.knobs.victims, min(limit - 1, 160))
    t = ctx.target
    jobs = []
    for i in range(ctx.knobs.attacks):
        n = N_SAMPLES[i % len(N_SAMPLES)]
        label = f"n{n}-{i}"
        owner, p = ctx.canary(label, ctx.rng.randint(48, max(64, min(limit - 1, 160))))
        via_router = bool(t.router_url) and i % 2 == 0
        job = (ctx.via_router(label, p, canary=owner, n=n) if via_router
               else ctx.direct(label, p, canary=owner, n=n))
        job.side["n"] = n
        jobs.append(job)
    normals = _normals(ctx, "during", ctx.knobs.attacks, limit)
    ctx.run_phase("parallel-sampling", jobs + normals, concurrency=len(jobs) + len(normals))
    ctx.notes.append("asked n = " + ", ".join(f"{j.label} {j.path}" for j in jobs))
    _after(ctx, ctx.knobs.victims, limit)


def divergence_auto_truncate(ctx: Ctx) -> None:
    """The incident: prefill pool 320 < decode pool 1024, each leg's ``--context-length`` its
    own pool, ``--allow-auto-truncate`` on both; a 400-token prompt A after a 300-token victim B,
    sent to both legs directly (what the router does).

    Prefill truncates A to its own limit and writes only those positions; decode reserved all
    400 and, in stock 0.5.23, commits the transfer checking only the room: positions prefill did
    not write still hold B's KV, and A's answer is HTTP 200 with B's canary tokens (the leak
    names B). Expected: an explicit error (the fork refuses to pair legs whose context lengths
    differ, and its coverage attestation refuses the commit) or A's own reference answer. Each
    round streams A once and not once when there is a router. Probes upstream-gaps 1, "no
    coverage handshake".
    """
    limit, info = _pair_limit(ctx)
    a_len = 400 if limit < 400 else limit + 80
    ctx.notes.append(f"limits {info}; A has {a_len} tokens")
    for i in range(ctx.knobs.divergence_rounds):
        owner_b, b = ctx.canary(f"victim-B{i}", min(300, limit - 1))
        ctx.run_phase(f"B{i}", [ctx.normal(f"victim-B{i}", b, 100, canary=owner_b)])
        owner_a, a = ctx.canary(f"A{i}", a_len)
        ctx.run_phase(f"A{i}", [ctx.normal(f"A{i}", a, canary=owner_a, stream=bool(i % 2))])
    _after(ctx, ctx.knobs.victims, limit)


def divergence_context_length(ctx: Ctx) -> None:
    """Prefill and decode with different ``--context-length``: prefill 106, decode 1024, equal
    1024-token pools, ``--allow-auto-truncate`` on both, the run's page size. Each round a
    victim B (96 tokens + 100 generated) fills decode's pages, then a prompt A of 105 tokens
    (at page 16 and 64 the divergence falls inside the last partial page: the same number of
    pages either way) or 200 tokens is sent to both legs directly (what the router does).

    Stock 0.5.23: prefill truncates A to its own limit (100 tokens) and writes only those
    positions; decode reserved all of A's positions and commits the transfer checking only the
    room, so the positions prefill did not write still hold B's (or older) KV, and A's answer
    is HTTP 200 with other content (a leak naming B, or tokens of the request's own alphabet at
    the wrong positions). Expected: an explicit error (the fork refuses to pair legs whose
    context lengths differ; with that check skipped, its coverage attestation refuses the
    commit) or A's own reference answer; normal requests follow on the same stack. Probes
    upstream-gaps 1, "no coverage handshake", and the context length the legs never compare.
    """
    limit, info = _pair_limit(ctx)
    lengths = (CTX_DIV_PREFILL_CONTEXT - 1, 200)
    ctx.notes.append(f"limits {info}; A lengths {lengths}")
    for i in range(ctx.knobs.divergence_rounds):
        owner_b, b = ctx.canary(f"victim-B{i}", min(96, limit - 1))
        ctx.run_phase(f"B{i}", [ctx.normal(f"victim-B{i}", b, 100, canary=owner_b)])
        n = lengths[i % len(lengths)]
        owner_a, a = ctx.canary(f"A{i}-{n}", n)
        ctx.run_phase(f"A{i}", [ctx.normal(f"A{i}-{n}", a, canary=owner_a)])
    _after(ctx, ctx.knobs.victims, limit)


def divergence_chat_template(ctx: Ctx) -> None:
    """Prefill and decode with different ``--chat-template`` (equal pools and context lengths,
    the run's page size): both render the messages' contents, then a fixed suffix, decode's
    3 tokens longer (``targets.CHAT_SUFFIX``). Each round a victim B (80 tokens + 100 generated,
    ``/generate``) fills decode's pages, then a ``/v1/chat/completions`` request A whose message
    spells 60 canary tokens is sent to both legs directly (what the router does), judged against
    the reference answer for decode's rendering of it.

    Stock 0.5.23: each leg tokenizes its own rendering; prefill writes the KV of its shorter
    prompt and computes the first token from it, decode reserved 3 positions more and commits
    the transfer checking only the room, so those positions hold B's (or older) KV and A's
    answer is HTTP 200 with other content (a leak). Expected: an explicit error (the fork
    compares the chat-template digests when decode pairs and refuses the pair; its coverage
    attestation would refuse the commit) or A's reference answer; normal requests follow.
    Probes upstream-gaps 1, "no coverage handshake", and the chat template the legs never
    compare.
    """
    limit, info = _pair_limit(ctx)
    ctx.notes.append(f"limits {info}; chat suffixes {CHAT_SUFFIX}")
    for i in range(ctx.knobs.divergence_rounds):
        owner_b, b = ctx.canary(f"victim-B{i}", min(80, limit - 1))
        ctx.run_phase(f"B{i}", [ctx.normal(f"victim-B{i}", b, 100, canary=owner_b)])
        owner_a, content = ctx.canary(f"chat-A{i}", 60)
        rendered = content + list(CHAT_SUFFIX["decode"])
        ctx.run_phase(f"A{i}", [ctx.direct_chat(f"chat-A{i}", content, rendered,
                                                canary=owner_a)])
    _after(ctx, ctx.knobs.victims, limit)


# ----------------------------------------------------------------------------- late writes
#
# The three scenarios below run on the ``late_write`` stack (``targets.LATE_HOLDS_S``) and reuse
# ``pdsafe_testkit.late_write`` (the CI test's mechanics: test/pd/test_late_write.py), imported
# inside the functions: only the harness has the testkit's fault plugin armed, and these
# scenarios are never ``deployment_ok``. The choreography sends its own requests (timed against
# log events of the fault); its answers are judged here like every other request.


class ScenarioNotAsDesigned(RuntimeError):
    """The choreography did not happen as designed (e.g. the abort reached the prefill after the
    write): the cell becomes ``error`` with this reason; the requests judged so far stay in it."""


def answer_of(r: GenResult, e2e_s: float | None = None) -> Answer:
    """A testkit ``GenResult`` as the ``Answer`` the client saw: no answer within the client's
    bound is a hang, status 0 a failed connection, anything else parsed like ``client.send``
    parses a body (in-band aborts included)."""
    if r.timed_out:
        return Answer(status=None, timed_out=True, e2e_s=e2e_s)
    if r.status == 0:
        return Answer(status=None, transport_error=r.error_message, e2e_s=e2e_s)
    a = client.parse_answer(r.status, r.body)
    a.e2e_s = e2e_s
    return a


def _answered_job(label: str, path: str, prompt: list[int], max_new: int, canary: int | None,
                  ans: Answer, prefill: GenResult | None = None) -> Job:
    """A ``Job`` for a request the scenario already sent (``answer`` set, nothing to call)."""
    job = Job(label, path, prompt, max_new, lambda: ans, canary, answer=ans)
    if prefill is not None:
        job.side["prefill"] = (prefill.status, "" if prefill.ok else prefill.error_message[:200],
                               prefill.timed_out)
    return job


def _late_answer(r: GenResult | None, answer_s: float | None, bound_s: float,
                 what: str) -> Answer:
    """A victim's decode answer, judged against the bound counted from the moment the fault
    acted (the abort or the kill), not from the send (the victim's prefill takes seconds)."""
    if r is None:
        return Answer(status=None, transport_error=f"{what}: no answer recorded")
    if answer_s is not None and answer_s > bound_s:
        return Answer(status=None, timed_out=True, e2e_s=answer_s)
    return answer_of(r, answer_s)


def _trio(ctx: Ctx) -> Trio:
    trio = ctx.target.trio
    if trio is None:
        raise RuntimeError("this scenario needs the late_write stack (harness only)")
    return trio


def _late_write(ctx: Ctx, via: str, *, past_timeout: bool, abort_prefill: bool = False) -> None:
    """``late-write-*``: the victim through prefill ``via`` (``held`` or ``other`` of the
    stack), the canary through the other one; see the two scenarios' docstrings.
    ``abort_prefill`` (abort-mid-transfer): the victim is also aborted on its own prefill
    (``/abort_request`` ``abort_all``: the canary goes through the other prefill, so the victim
    is that prefill's only request) as soon as the prefill logs its held write."""
    from pdsafe_testkit import late_write as lw

    trio = _trio(ctx)
    vp, bp = (trio.held, trio.other) if via == "held" else (trio.other, trio.held)
    hold = trio.hold_of(vp)
    if (hold > lw.RELEASE_TIMEOUT_S) != past_timeout:
        raise ScenarioNotAsDesigned(
            f"the victim's prefill holds {hold:g}s, upstream's release timeout is "
            f"{lw.RELEASE_TIMEOUT_S:g}s: this scenario needs the hold "
            f"{'past' if past_timeout else 'within'} it (targets.LATE_HOLDS_S)")
    v_owner, v_ids = ctx.canary("late-victim", lw.V_LEN)
    b_owner, b_ids = ctx.canary("canary-B", lw.B_LEN)
    ctx.ref.expected(v_ids, lw.V_NEW)  # memoized before any PD traffic (B's: by the testkit)
    v_room, b_room = lw.random_rooms(ctx.rng)
    prefills = [trio.held.url, trio.other.url]
    before = read_counters(prefills, trio.decode.url)
    t0 = time.monotonic()
    prefill_abort: dict[str, Any] = {}
    stop = threading.Event()

    def abort_on_prefill() -> None:
        while not stop.is_set():
            if lw.event(vp, v_room, "held") is not None:
                prefill_abort["t"] = time.time()
                prefill_abort["http"] = abort_request(vp.url, abort_all=True)
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=abort_on_prefill, name="abort-on-prefill", daemon=True)
    if abort_prefill:
        watcher.start()
    try:
        obs = lw.run_late_write(
            trio, v_ids, b_ids, expected=ctx.ref.expected, variant=ctx.target.variant,
            v_room=v_room, b_room=b_room, victim_via=vp, canary_via=bp,
            v_answer_bound_s=max(ctx.knobs.bound_s, 60.0) + 30, b_timeout_s=ctx.knobs.bound_s)
    finally:
        stop.set()
        if abort_prefill:
            watcher.join(timeout=10)
    wall = time.monotonic() - t0
    where = "decode and its prefill" if abort_prefill else "decode"
    jobs = [_answered_job("late-victim", f"pd-direct (aborted on {where})", v_ids, lw.V_NEW,
                          v_owner, _late_answer(obs.v_result, obs.v_answer_s,
                                                ctx.knobs.bound_s, "late-victim"),
                          obs.v_prefill_result)]
    for k, att in enumerate(obs.attempts):
        jobs.append(_answered_job(f"canary-B-try{k}", "pd-direct", b_ids, lw.B_NEW, b_owner,
                                  answer_of(att.decode, att.e2e_s), att.prefill))
    ctx.on_request(len(jobs))
    ctx.judge_phase("late-write", jobs, before=before, wall_s=wall, prefill_urls=prefills)
    roles = {id(s): r for r, s in trio.servers().items()}
    ctx.notes.append(f"victim via {roles[id(vp)]} (holds late writes {hold:g}s), canary via "
                     f"{roles[id(bp)]}; upstream's release timeout {lw.RELEASE_TIMEOUT_S:g}s")
    ctx.notes.append("timeline: " + obs.timeline())
    late_after_abort = (None if obs.t_late_write is None
                        else round(obs.t_late_write - obs.t_abort, 2))
    ctx.notes.append(
        f"V's late write landed {late_after_abort}s after the abort; decode deferred releases "
        f"(upstream counter, by outcome) {obs.release_deltas}; sglang:pdsafe_* quarantine "
        f"deltas {obs.metric_deltas}; B refused {len(obs.b_refusals)} times "
        f"{obs.b_refusals[:1]}; B's prompt pages overlap V's: {obs.overlap} of "
        f"{len(obs.b_prompt_pages)}; /health while refused {obs.health_during[:120]!r}, "
        f"after {obs.health_after[:60]!r}")
    problems = lw.design_problems(obs)
    if abort_prefill:
        writing = lw.event(vp, v_room, "writing")
        t_pa = prefill_abort.get("t")
        ctx.notes.append(
            f"V aborted on its prefill too (/abort_request abort_all, HTTP "
            f"{prefill_abort.get('http')}) "
            + ("never" if t_pa is None else f"{t_pa - obs.t_held:+.2f}s")
            + f" from the hold (on decode {obs.t_abort - obs.t_held:+.2f}s); V's prefill leg "
              f"answered {obs.v_prefill_result.status if obs.v_prefill_result else None}")
        if prefill_abort.get("http") != 200:
            problems.append(f"the victim's prefill did not take /abort_request (HTTP "
                            f"{prefill_abort.get('http')})")
        elif writing is not None and t_pa is not None and t_pa >= writing.at:
            problems.append("the prefill abort came after the held write went out")
    if late_after_abort is not None and (late_after_abort > lw.RELEASE_TIMEOUT_S) != past_timeout:
        problems.append(f"the late write landed {late_after_abort}s after the abort, "
                        f"{'within' if past_timeout else 'past'} upstream's "
                        f"{lw.RELEASE_TIMEOUT_S:g}s release timeout")
    if obs.b_prompt_pages and not obs.overlap:
        problems.append("B got none of V's pages (the page-reuse assumption broke)")
    if problems:
        raise ScenarioNotAsDesigned("; ".join(problems))


def late_write_past_release_timeout(ctx: Ctx) -> None:
    """A KV write held past decode's abort AND past upstream's deferred-release timeout
    (shortened to 2 s; the write lands 6 s after it began), the CI test's scenario
    (test/pd/test_late_write.py, ``pdsafe_testkit.late_write.run_late_write``).

    Victim V (3500 canary tokens) goes to the prefill that holds its write and to the decode;
    once the prefill logs the held write, V is aborted on the decode (``/abort_request``). 1.5 s
    before the write lands, canary B (700 tokens, 1500 generated) goes through the second
    prefill; the pool sizes force B onto V's pages. Stock 0.5.23 frees V's pages on its timeout
    without the prefill's drain ACK, serves B at once, and the late write lands in B's pages
    while B decodes: a leak is B's HTTP 200 answer carrying V's tokens (the report names
    ``late-victim``). Expected: B reference-identical, explicit refusals before that allowed
    (the fork quarantines V's pages until the drain ACK and refuses new requests with 503 while
    the quarantine is over its limit; the retries are counted as explicit errors). V's own
    answer is an explicit error (it was aborted). Probes upstream-gaps "fail-open drain
    timeout" (distributed use-after-free). The cell is an ``error`` (not a pass) when the
    choreography did not happen: the write not past the abort and the timeout, B not on V's
    pages. Does not prove every late write is fenced: not the aux/metadata slot, the staging
    ring, prefill source pages, a quarantine below the admission limit, other holds.
    """
    _late_write(ctx, "held", past_timeout=True)


def late_write_past_abort(ctx: Ctx) -> None:
    """A KV write held past decode's abort but landing WITHIN upstream's deferred-release
    timeout (held 1 s, timeout 2 s): the same choreography as
    ``late-write-past-release-timeout`` with the victim through the stack's other prefill,
    whose fault holds late writes 1 s.

    Upstream keeps an aborted request's pages until every prefill rank's drain ACK, which
    follows the held write, so stock 0.5.23 is expected safe here: canary B waits for the pages
    (stock: in its pre-allocation queue; the fork: refused with 503 while V's quarantine is
    over its limit) and gets them after the write drained. A leak would be B's HTTP 200 answer
    with V's tokens: a late write landing in pages released before the drain. The control of
    the late-write family: it shows that the leak of the other scenario comes from the
    fail-open timeout, not from the abort itself, and that the fork's quarantine releases on
    the ACK without the overdue alarm. The cell is an ``error`` when the write did not land
    after the abort and before the timeout, or B did not get V's pages. Does not prove that
    upstream's ACK accounting is right for several prefill ranks or chunked transfers (one
    rank, one chunk here), nor anything about writes that outlive the timeout (the other
    scenario).
    """
    _late_write(ctx, "other", past_timeout=False)


def crash_prefill_mid_transfer(ctx: Ctx) -> None:
    """The prefill SIGKILLed (its whole process group) while its write of victim V2's KV is
    held in its transfer worker (past the worker's abort check, before the write posts), the
    CI test's crash scenario (``pdsafe_testkit.late_write.run_crash``): a hold window
    (``HOLD_WINDOW_S``), then the prefill started again on its ports (a new process
    incarnation), then canary B2 through the surviving prefill, on V2's pages.

    Judged: V2's decode answer (expected: an explicit error once the decode's heartbeat,
    1 s x 2 misses here, declares the prefill gone; a hang if none within the bound from the
    kill) and B2 (expected reference-identical; retried while refused). A leak would be B2's
    HTTP 200 answer with V2's tokens (a partial transfer committed, or pages handed over while
    a writer still writes). Notes: when V2's pages were released (upstream's deferred-release
    counter; the fork counts its incarnation release there as ``timeout``) relative to the
    restart (stock: on its timeout, before any evidence; the fork: only after the restarted
    prefill's new incarnation was seen), the fork's quarantine counters over the hold window
    (the heartbeat's alarm, the probe's misses, releases: none expected), the seconds from the
    kill. The killed prefill is not reported as a crash; the decode or the surviving prefill
    dying is. Upstream is not known unsafe here: a SIGKILLed writer writes nothing late, so
    stock is expected reference-identical too. Does not cover a prefill alive but unreachable
    (the unsafe case for a timeout release), a kill during the byte transfer itself, or an
    operator's release (the CI test does). Runs last on its stack.
    """
    from pdsafe_testkit import late_write as lw

    trio = _trio(ctx)
    v_owner, v_ids = ctx.canary("crash-victim", lw.V_LEN)
    b_owner, b_ids = ctx.canary("canary-B2", lw.B_LEN)
    ctx.ref.expected(v_ids, lw.V_NEW)
    v_room, b_room = lw.random_rooms(ctx.rng)
    survivor = [trio.other.url]
    before = read_counters(survivor, trio.decode.url)
    ctx.target.killed.add("prefill-held")  # before the kill: a failure after it is no crash
    t0 = time.monotonic()
    obs = lw.run_crash(trio, v_ids, b_ids, expected=ctx.ref.expected, v2_room=v_room,
                       b2_room=b_room, evidence=lw.restart_prefill,
                       release_metric=lw.DEFERRED_RELEASE_METRIC,
                       release_bound_s=ctx.knobs.bound_s,
                       v_timeout_s=max(ctx.knobs.bound_s, 60.0) + 60,
                       b_timeout_s=ctx.knobs.bound_s)
    wall = time.monotonic() - t0
    jobs = [_answered_job("crash-victim", "pd-direct (prefill killed)", v_ids, lw.V_NEW,
                          v_owner, _late_answer(obs.v2_result, obs.v2_answer_s,
                                                ctx.knobs.bound_s, "crash-victim"))]
    for k, att in enumerate(obs.attempts):
        jobs.append(_answered_job(f"canary-B2-try{k}", "pd-direct (surviving prefill)", b_ids,
                                  lw.B_NEW, b_owner, answer_of(att.decode, att.e2e_s),
                                  att.prefill))
    ctx.on_request(len(jobs))
    ctx.judge_phase("crash", jobs, before=before, wall_s=wall, prefill_urls=survivor)

    def secs(x: float | None) -> str:
        return "never within the bound" if x is None else f"{x:.2f}s"

    ctx.notes.append(
        f"prefill-held SIGKILLed while holding V2's write; V2's decode answered "
        f"{secs(obs.v2_answer_s)} after the kill (HTTP {obs.v2_decode_status}: "
        f"{obs.v2_decode_error[:160]!r}); prefill-held restarted on its ports "
        f"{secs(obs.evidence_s)} after the kill ({obs.evidence_detail}); V2's pages released "
        f"(upstream deferred-release counter moved) {secs(obs.release_s)} after the kill"
        f"{' (before the restart)' if obs.released_before_evidence else ''}, by outcome "
        f"{obs.release_deltas}; fork quarantine counters over the hold window "
        f"{ {k: v for k, v in obs.hold_deltas.items() if v} }, after the restart "
        f"{ {k: v for k, v in obs.evidence_deltas.items() if v} }; B2 refused "
        f"{len(obs.b2_refusals)} times {obs.b2_refusals[:1]}; decode alive "
        f"{obs.decode_alive}, surviving prefill alive {obs.other_prefill_alive}")


# ----------------------------------------------------------------------------- aborts
#
# The abort family: a client abort in each phase of a PD request, interleaved with normal canary
# requests that run at the same time and afterwards on the pages the aborted requests held (or
# would have held). The abort is upstream's ``POST /abort_request`` with the request's rid
# (0.5.23's TokenizerManager forwards it only for a rid live on that server; the scheduler then
# looks for it in every PD queue), or the client closing its connection (abort-during-decode).
# Every aborted request carries a canary prompt and is judged like any other request: an
# explicit error expected (the reference's answer also passes: the abort came too late to
# matter); a leg of it that gets no answer within the bound is a hang (a leg left waiting for a
# peer that dropped the request, holding its queue slot and pages); the normal requests are
# judged against the reference, and a leak names the aborted request whose KV shows up.

ABORT_PATH = "/abort_request"
#: Tokens abort-during-decode reads from a stream before the client cuts it.
CUT_AFTER_TOKENS = 4
#: At most this many long requests hold a decode's pool for abort-prealloc (beyond that the
#: deployment's pool is too large to fill from one client: the cell says so).
MAX_HOLDERS = 8


def abort_request(url: str, rid: str | None = None, *, abort_all: bool = False) -> int:
    """POST upstream's ``/abort_request`` on ``url`` for ``rid`` (every request of the server
    with ``abort_all``); the HTTP status, 0 when the server did not answer."""
    body: dict[str, Any] = {"abort_all": True} if abort_all else {"rid": rid}
    try:
        return transport.post(url + ABORT_PATH, json=body, timeout=30).status_code
    except requests.RequestException:
        return 0


def pd_load(url: str) -> dict[str, int]:
    """One server's load from ``/v1/loads`` (summed over its schedulers; republished every
    50 ms while a PD queue holds a request): ``num_running_reqs``, ``num_used_tokens``, the PD
    queue lengths (``prefill_bootstrap_queue_reqs``, ``decode_prealloc_queue_reqs``,
    ``decode_transfer_queue_reqs``, ...); ``{}`` when unreadable."""
    try:
        body = transport.get(url + "/v1/loads", timeout=10).json()
    except (requests.RequestException, ValueError):
        return {}
    out: dict[str, int] = {}
    for ld in (body.get("loads") or []) if isinstance(body, dict) else []:
        flat = dict(ld)
        flat.update(ld.get("disaggregation") or {})
        for k, v in flat.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + int(v)
    return out


def _decode_idle_after(ctx: Ctx, keys: Sequence[str]) -> float | None:
    """Seconds until every one of the decode's ``keys`` (``pd_load``) reads zero, polled for
    at most ``max(10 s, settle_s)``; None when they did not (or the load stayed unreadable)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < max(10.0, ctx.knobs.settle_s):
        ld = pd_load(ctx.target.decode_url)
        if ld and not any(ld.get(k, 0) for k in keys):
            return time.monotonic() - t0
        time.sleep(0.1)
    return None


def _queued(url: str, key: str, base: int, done: Callable[[], bool],
            timeout_s: float = 10.0) -> bool:
    """Whether ``url``'s queue ``key`` grew past ``base`` before ``done()`` (the request already
    answered) or ``timeout_s``: the request sits in that phase."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not done():
        if pd_load(url).get(key, 0) > base:
            return True
        time.sleep(0.05)
    return False


def _pd_body(ctx: Ctx, prompt: list[int], max_new: int, rid: str, *,
             stream: bool = False) -> dict[str, Any]:
    """A greedy body for both legs of one PD request (what the router sends each leg)."""
    t = ctx.target
    return client.greedy_payload(prompt, max_new, stream=stream, rid=rid,
                                 bootstrap_host=t.bootstrap_host,
                                 bootstrap_port=t.bootstrap_port,
                                 bootstrap_room=ctx.rng.randrange(1 << 62))


def _add_note(job: Job, note: str) -> None:
    job.side["note"] = (job.side.get("note", "") + " " + note).strip()


def _legs_answer(job: Job, decode: Answer, prefill: Answer | None) -> Answer:
    """What a request is judged on: decode's answer (what the router returns), unless its
    prefill leg got no answer within the bound: then a hang (a leg left waiting for a peer
    that dropped the request). The prefill leg's status goes into the detail."""
    if prefill is not None:
        job.side["prefill"] = (prefill.status, prefill.message[:200], prefill.timed_out)
        if prefill.timed_out and not decode.timed_out:
            _add_note(job, f"[hang: the prefill leg got no answer within the bound; decode "
                           f"answered {decode.status} {decode.message[:120]!r}]")
            return Answer(status=None, timed_out=True, e2e_s=prefill.e2e_s)
    return decode


def _normals(ctx: Ctx, tag: str, n: int, limit: int) -> list[Job]:
    """``n`` normal canary requests (48 tokens up to 240 or the limit), sent the way clients
    send them; they reuse the pages the aborted requests held or would have held."""
    jobs = []
    for i, length in enumerate(_lengths(ctx.rng, n, 48, max(64, min(limit - 1, 240)))):
        label = f"{tag}-{i}"
        owner, p = ctx.canary(label, length)
        jobs.append(ctx.normal(label, p, canary=owner))
    return jobs


def abort_bootstrap(ctx: Ctx) -> None:
    """A client abort while one leg of a PD request waits in bootstrap for the other leg,
    which arrives after the abort; normal requests run at the same time and afterwards.

    Per attack (alternating): the prefill leg alone (the prefill's bootstrap queue holds it:
    no decode has claimed its room), aborted there with ``/abort_request``; or the decode leg
    alone, once decode pre-allocated its pages and sent their indices to the prefill (the
    decode's transfer queue holds it), aborted there. The phase is reached when that queue
    grew by the request (``/v1/loads``); the abort is sent then. The other leg is then sent
    with the same room (a router leg that arrives late), concurrently with normal canary
    requests, then more normal requests follow. Judged: the aborted request (decode's answer;
    a leg without an answer within the bound is a hang) and every normal request.

    Expected: an explicit error for the aborted request, both legs answered, the normal
    requests identical. A hang: the late decode leg waits for KV from a prefill that dropped
    the request and never said so (stock: until its 300 s waiting timeout, its pages held);
    or the late prefill leg waits for a decode that aborted; or normal requests sent meanwhile
    never get through bootstrap (measured with stock: docs/benchmark.md). A leak: a normal
    request's answer carries the aborted request's canary tokens (the late prefill leg wrote
    into pages the aborted decode leg had reserved, after decode released them: the prefill
    still holds the room's stale page indices). Probes upstream-gaps 1 "peer not told" (a
    request dropped at one leg leaves the other waiting for its timeout) and 2 (room ids are
    client supplied, no generation: the late leg meets the aborted leg's room state).
    """
    limit, _ = _pair_limit(ctx)
    _victims(ctx, ctx.knobs.victims, min(limit - 1, 160))
    t, bound = ctx.target, ctx.knobs.bound_s
    late: list[Job] = []
    reached = 0
    for i in range(ctx.knobs.attacks):
        first, other = ("prefill", "decode") if i % 2 == 0 else ("decode", "prefill")
        label = f"abort-boot-{first}-first-{i}"
        owner, p = ctx.canary(label, ctx.rng.randint(64, max(80, min(limit - 1, 200))))
        rid = f"{label}-{uuid.uuid4().hex}"
        body = _pd_body(ctx, p, ctx.knobs.max_new, rid)
        url = t.prefill_url if first == "prefill" else t.decode_url
        late_url = t.decode_url if first == "prefill" else t.prefill_url
        key = "prefill_bootstrap_queue_reqs" if first == "prefill" else "decode_transfer_queue_reqs"
        base = pd_load(url).get(key, 0)
        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(client.send, url, body, bound_s=bound)
            inside = _queued(url, key, base, fut.done)
            t_abort = time.monotonic()
            http = abort_request(url, rid)
            first_ans = fut.result()
            answered_s = time.monotonic() - t_abort
        reached += inside
        ctx.notes.append(
            f"{label}: the {first} leg {'sat in' if inside else 'was NOT seen in'} {key} when "
            f"aborted (/abort_request HTTP {http}) and answered {answered_s:.2f}s later: HTTP "
            f"{first_ans.status} {first_ans.message[:100]!r}"
            f"{' (no answer within the bound)' if first_ans.timed_out else ''}; the {other} leg "
            f"was sent after that")
        job = Job(label, f"pd-direct ({first} leg aborted in bootstrap, {other} leg late)", p,
                  ctx.knobs.max_new, lambda: Answer(status=None), owner)

        def call(job: Job = job, first: str = first, first_ans: Answer = first_ans,
                 body: dict[str, Any] = body, late_url: str = late_url) -> Answer:
            second = client.send(late_url, body, bound_s=bound)
            if first == "prefill":
                return _legs_answer(job, second, first_ans)
            return _legs_answer(job, first_ans, second)

        job.call = call
        late.append(job)
    ctx.run_phase("late-legs", late + _normals(ctx, "during", ctx.knobs.attacks, limit),
                  concurrency=2 * len(late) or 1)
    _after(ctx, ctx.knobs.victims, limit)
    if late and not reached:
        raise ScenarioNotAsDesigned("no aborted leg was seen waiting in its bootstrap queue "
                                    "when the abort was sent (notes)")


def abort_prealloc(ctx: Ctx) -> None:
    """A client abort while decode holds the request in its pre-allocation queue (no pages
    yet: the pool is held by long-running requests); normal requests queue behind it and get
    the pages afterwards.

    How the phase is reached: one (harness: 1024-token pool) or more "holder" requests (32
    tokens, up to 900 new tokens as the context allows, streamed) run on decode; decode admits
    a request only with its prompt plus ``num_reserved_decode_tokens`` (512) per running
    request free, so every request sent meanwhile waits in its pre-allocation queue. The
    attack requests (canary prompts, both legs) are sent, seen in that queue (``/v1/loads``),
    and aborted on decode with ``/abort_request`` (every other one also on the prefill, as a
    client disconnect through the router would). Normal canary requests are sent right after
    the aborts (they wait behind the holders); once every aborted request answered, the
    holders' client disconnects (the pool is held as long as needed, however fast the box
    decodes), then more normal requests follow. Judged: holders (on the first tokens they
    streamed), aborted requests (decode's answer; a leg without an answer within the bound is
    a hang) and normal requests.

    Expected: an explicit error for each aborted request on both legs, the holders and normal
    requests identical. A hang: the prefill leg of a request aborted on decode only, never told
    (it waits for its 300 s bootstrap timeout). A leak: a normal request's answer carries an
    aborted request's canary tokens (the aborted request got pages after all and its KV was
    written into them after they were handed on). Probes upstream-gaps 1 "peer not told" and 2
    (deferred release only covers requests whose pages were announced to the prefill: a
    pre-allocation abort is released at once). A deployment whose decode pool would need more
    than ``MAX_HOLDERS`` holders makes the cell an ``error`` saying so.
    """
    limit, _ = _pair_limit(ctx)
    _victims(ctx, ctx.knobs.victims, min(limit - 1, 160))
    t, bound = ctx.target, ctx.knobs.bound_s
    si = server_info(t.decode_url)
    pool = int(si.get("max_total_num_tokens") or 0)
    context = int(si.get("context_length") or 0)
    reserved = int(si.get("num_reserved_decode_tokens") or 512)
    h_len, v_len = 32, min(limit - 1, 120)
    hold_new = min(max(64, context - h_len - 8), 900)
    n_hold = max(1, (pool - v_len - reserved) // (h_len + reserved) + 1)
    if not pool or n_hold > MAX_HOLDERS:
        raise ScenarioNotAsDesigned(
            f"decode's pool ({pool} tokens, {reserved} reserved per running request) would need "
            f"{n_hold} holder requests (at most {MAX_HOLDERS}) to keep a request in its "
            "pre-allocation queue")
    release = threading.Event()
    holders = []
    for k in range(n_hold):
        owner, p = ctx.canary(f"prealloc-holder-{k}", h_len)
        holders.append(_stream_job(ctx, f"prealloc-holder-{k}", p, hold_new, owner,
                                   via_router=False, release=release,
                                   total_s=ctx.knobs.bound_s + 60.0,
                                   what="holder, cut by the client after the aborts"))
    attacks: list[tuple[Job, str, dict[str, Any]]] = []
    for i in range(ctx.knobs.attacks):
        label = f"abort-prealloc-{i}"
        owner, p = ctx.canary(label, v_len)
        rid = f"{label}-{uuid.uuid4().hex}"
        job = Job(label, "pd-direct (aborted in decode's pre-allocation queue"
                  + (", and on the prefill)" if i % 2 else ")"), p, ctx.knobs.max_new,
                  lambda: Answer(status=None), owner)
        attacks.append((job, rid, _pd_body(ctx, p, ctx.knobs.max_new, rid)))
    normals = _normals(ctx, "during", ctx.knobs.attacks, limit)
    before = read_counters(*t.counter_urls())
    t0 = time.monotonic()
    width = n_hold + 2 * len(attacks) + len(normals)
    with ThreadPoolExecutor(max_workers=width) as ex:
        hold_futs = [ex.submit(job.call) for job in holders]
        running = _queued(t.decode_url, "num_running_reqs", n_hold - 1,
                          lambda: any(f.done() for f in hold_futs), 60.0)
        time.sleep(0.2)  # the holders' first decode steps
        base = pd_load(t.decode_url).get("decode_prealloc_queue_reqs", 0)
        legs = [(ex.submit(client.send, t.prefill_url, body, bound_s=bound),
                 ex.submit(client.send, t.decode_url, body, bound_s=bound))
                for _, _, body in attacks]
        seen = 0
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and seen < len(attacks):
            seen = max(seen, pd_load(t.decode_url).get("decode_prealloc_queue_reqs", 0) - base)
            if all(fd.done() for _, fd in legs):
                break
            time.sleep(0.05)
        still = pd_load(t.decode_url).get("num_running_reqs", 0)
        https = []
        for i, (_, rid, _) in enumerate(attacks):
            codes = [abort_request(t.decode_url, rid)]
            if i % 2:
                codes.append(abort_request(t.prefill_url, rid))
            https.append(codes)
        norm_futs = [ex.submit(job.call) for job in normals]
        for (job, _, _), (fp, fd) in zip(attacks, legs, strict=True):
            job.answer = _legs_answer(job, fd.result(), fp.result())
        held_open = not any(f.done() for f in hold_futs)
        release.set()  # the holders' clients go away: decode frees the pool for the normals
        for job, f in zip(holders + normals, hold_futs + norm_futs, strict=True):
            job.answer = f.result()
    jobs = [*holders, *(j for j, _, _ in attacks), *normals]
    ctx.on_request(len(jobs))
    ctx.judge_phase("prealloc", jobs, before=before, wall_s=time.monotonic() - t0)
    ctx.notes.append(
        f"decode pool {pool}, {reserved} reserved per running request: {n_hold} holder(s) of "
        f"{h_len} tokens + up to {hold_new} new, streamed (running: {running}; still streaming "
        f"when every aborted request had answered: {held_open}, then cut by the client); "
        f"{seen} of {len(attacks)} attack requests seen in decode's pre-allocation queue, "
        f"{still} request(s) running when they were aborted (/abort_request HTTP, decode then "
        f"prefill: {https})")
    _after(ctx, ctx.knobs.victims, limit)
    if attacks and not seen:
        raise ScenarioNotAsDesigned("no attack request was seen in decode's pre-allocation "
                                    "queue before the abort (notes)")


def abort_mid_transfer(ctx: Ctx) -> None:
    """A client abort on both legs while the victim's KV transfer is in flight: the
    ``late-write-past-abort`` choreography (``pdsafe_testkit.late_write.run_late_write``, the
    ``late_write`` stack) with the abort reaching the prefill too.

    Victim V (3500 canary tokens, a late room) goes through the prefill whose test-only
    ``late_write`` fault holds each of its KV writes 1 s (inside upstream's shortened 2 s
    release timeout). The phase is reached when that prefill logs the held write (the write is
    past the transfer worker's abort check, in flight): V is then aborted on the prefill
    (``/abort_request`` ``abort_all``: V is that prefill's only request) and on the decode
    (``/abort_request`` with V's rid), while canary B (700 tokens, 1500 generated) goes
    through the other prefill onto V's pages (the pool sizes force it). Judged: V's decode
    answer (an explicit error expected; a hang beyond the bound) and every try of B (refusals
    count as explicit errors, the last try is judged against the reference).

    The prefill's own abort makes it fail the room and free V's source pages while its worker
    still holds the write; decode's ABORT then finds the room failed or already cleared on the
    prefill. A leak: B's HTTP 200 answer carries V's tokens (the report names ``late-victim``):
    the prefill acknowledged the abort (or decode released V's pages) before the held write
    drained, so it landed in B's pages. Stock is expected safe (its drain accounting survives
    the sender's clear, and the write lands within the timeout). Probes upstream-gaps 2 (abort
    during transfer: prefill source pages freed immediately on failure, the deferred release's
    ACK). The cell is an ``error`` when the choreography did not happen (the prefill abort not
    before the late write, the write not after decode's abort, B not on V's pages). Harness
    only (a server-side fault).
    """
    _late_write(ctx, "other", past_timeout=False, abort_prefill=True)


def abort_after_transfer_before_commit(ctx: Ctx) -> None:
    """A client abort after the KV transfer completed and before decode committed it; normal
    requests run at the same time and afterwards on the freed pages.

    The window is microseconds in a normal run (decode commits a finished transfer in the
    scheduler step that sees it; upstream's metadata gate holds it longer only while the aux
    row has not landed), so the default stack's decode is armed with the test-only fault
    ``park_commit`` (``targets.PARK_COMMIT_S`` = 3 s): a request whose rid starts with
    ``pdsafe-fault-park-`` is reported still transferring for 3 s after its transfer
    succeeded, without blocking the scheduler. The attack requests (canary prompts, both
    legs) are aborted on decode with ``/abort_request`` as soon as the fault logs them parked
    (prefill has written and reported every page); one more parked request is not aborted (the
    control: committed after the park, expected identical). Normal canary requests are sent at
    the moment of the aborts and after the phase.

    Expected: an explicit error for each aborted request, the control and the normal requests
    identical. A leak: a normal request's answer carries an aborted request's canary tokens:
    decode committed and decoded the aborted request anyway (it already counted as
    transferred) while its pages were released and handed on, or released the pages while the
    request still ran. A hang: the aborted request never answered (its Failed poll never
    handled). Probes the decode release of a finished-but-uncommitted transfer (upstream-gaps 2:
    deferred release and its ACK for a room the prefill already concluded; 4: the allocator
    keeps no owner, so a double release is silent). The cell is an ``error`` when no aborted
    request left the park without a commit (the abort came too late). Harness only.
    """
    from pdsafe_testkit.faults import PARK_PREFIX, parse_park_log

    stack = ctx.target.stack
    if stack is None:
        raise RuntimeError("harness only: needs the default stack's decode armed with the "
                           "test-only fault park_commit")
    limit, _ = _pair_limit(ctx)
    _victims(ctx, ctx.knobs.victims, min(limit - 1, 160))
    t, log = ctx.target, stack.decode.process
    attacks: dict[str, Job] = {}
    for i in range(ctx.knobs.attacks):
        label = f"abort-parked-{i}"
        owner, p = ctx.canary(label, ctx.rng.randint(64, max(80, min(limit - 1, 200))))
        rid = f"{PARK_PREFIX}{label}-{uuid.uuid4().hex}"
        attacks[rid] = ctx.direct(label, p, canary=owner, rid=rid)
        attacks[rid].path = "pd-direct (aborted on decode after the transfer, before the commit)"
    owner, p = ctx.canary("parked-control", ctx.rng.randint(64, max(80, min(limit - 1, 200))))
    control_rid = f"{PARK_PREFIX}control-{uuid.uuid4().hex}"
    control = ctx.direct("parked-control", p, canary=owner, rid=control_rid)
    control.path = f"pd-direct (parked {PARK_COMMIT_S:g}s, not aborted)"
    normals = _normals(ctx, "during", ctx.knobs.attacks, limit)
    before = read_counters(*t.counter_urls())
    t0 = time.monotonic()
    aborted: dict[str, tuple[int, float]] = {}
    sent = [*attacks.values(), control]
    with ThreadPoolExecutor(max_workers=len(sent) + len(normals)) as ex:
        futs = [ex.submit(job.call) for job in sent]
        deadline = time.monotonic() + max(30.0, ctx.knobs.bound_s)
        while len(aborted) < len(attacks) and time.monotonic() < deadline \
                and not all(f.done() for f in futs):
            for e in parse_park_log(log.log_text()):
                if e.event == "parked" and e.rid in attacks and e.rid not in aborted:
                    aborted[e.rid] = (abort_request(t.decode_url, e.rid), time.time() - e.at)
            time.sleep(0.05)
        norm_futs = [ex.submit(job.call) for job in normals]
        for job, f in zip(sent + normals, futs + norm_futs, strict=True):
            job.answer = f.result()
    jobs = [*sent, *normals]
    ctx.on_request(len(jobs))
    ctx.judge_phase("parked", jobs, before=before, wall_s=time.monotonic() - t0)
    events = {e.rid: e for e in parse_park_log(log.log_text())
              if e.event != "parked" and (e.rid in attacks or e.rid == control_rid)}
    left = [rid for rid in attacks if rid in events and events[rid].event == "left"]

    def park_end(rid: str) -> str:
        e = events.get(rid)
        return ("park end not logged" if e is None
                else f"{e.event} with poll {e.status} {e.after:.2f}s into the park")

    ctx.notes.append(
        f"parked requests (test-only fault park_commit, {PARK_COMMIT_S:g}s): " + "; ".join(
            [f"{attacks[rid].label}: "
             + (f"aborted {aborted[rid][1]:.2f}s into the park (HTTP {aborted[rid][0]})"
                if rid in aborted else "never seen parked, not aborted")
             + f", {park_end(rid)}" for rid in attacks]
            + [f"parked-control: {park_end(control_rid)}"]))
    _after(ctx, ctx.knobs.victims, limit)
    if attacks and not left:
        raise ScenarioNotAsDesigned("no aborted request left the park without a commit (the "
                                    "abort did not land between the transfer and the commit)")


def _cut_stream(url: str, body: dict[str, Any], bound_s: float, *,
                after_tokens: int | None = None, stop: threading.Event | None = None,
                total_s: float | None = None) -> tuple[Answer, bool]:
    """Stream ``body`` from ``url + /generate`` and close the connection (the client's
    disconnect) once ``after_tokens`` arrived or ``stop`` is set (checked at every chunk):
    (what the client saw, whether it cut). SGLang streams cumulative ``output_ids``; a cut
    answer holds the tokens received so far. ``bound_s`` bounds each read; ``total_s``
    (default ``bound_s``) the whole stream, beyond which it is a hang."""
    t0 = time.monotonic()
    total = bound_s if total_s is None else total_s

    def took() -> float:
        return time.monotonic() - t0

    try:
        with requests.Session() as s, s.post(url + "/generate", json=body, stream=True,
                                             headers=transport.auth().for_path("/generate"),
                                             timeout=(client.CONNECT_TIMEOUT_S, bound_s)) as r:
            if r.status_code != 200:
                try:
                    err: Any = r.json()
                except ValueError:
                    err = r.text
                a = client.parse_answer(r.status_code, err)
                a.stream, a.e2e_s = True, took()
                return a, False
            last: Any = None
            for line in r.iter_lines():
                if took() > total:
                    return Answer(status=None, timed_out=True, stream=True, e2e_s=took()), False
                if not line or not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk or chunk.get("object") == "error":
                    return Answer(status=200, in_band_abort=True,
                                  message=transport.error_message(chunk), stream=True,
                                  e2e_s=took()), False
                last = chunk
                ids = list(chunk.get("output_ids") or [])
                if (after_tokens is not None and len(ids) >= after_tokens) or \
                        (stop is not None and stop.is_set() and ids):
                    r.close()  # the client goes away mid-stream
                    return Answer(status=200, output_ids=ids, stream=True, e2e_s=took()), True
            a = client.parse_answer(200, last) if last is not None else Answer(status=200)
            a.stream, a.e2e_s = True, took()
            return a, False
    except requests.Timeout:
        return Answer(status=None, timed_out=True, stream=True, e2e_s=took()), False
    except requests.RequestException as e:
        return Answer(status=None, transport_error=f"{type(e).__name__}: {str(e)[:200]}",
                      stream=True, e2e_s=took()), False


#: A streamed request of the abort family is judged on at most its first this many tokens
#: (the reference's greedy answer for them): the content check of what the client received,
#: without asking the reference for hundreds of tokens (slow on a loaded CPU box).
STREAM_JUDGED_TOKENS = 32


def _stream_job(ctx: Ctx, label: str, prompt: list[int], max_new: int, canary: int, *,
                via_router: bool, cut_after: int | None = None,
                release: threading.Event | None = None, total_s: float | None = None,
                what: str = "client cut") -> Job:
    """A streamed request that the client cuts (closes the connection) after ``cut_after``
    tokens or once ``release`` is set, through the router or to both legs directly; judged on
    the first tokens it received (at most ``STREAM_JUDGED_TOKENS``) against the reference's."""
    t, bound = ctx.target, ctx.knobs.bound_s
    job = Job(label, ("router" if via_router else "pd-direct") + f"-stream ({what})", prompt,
              max_new, lambda: Answer(status=None), canary)

    def call() -> Answer:
        rid = f"{label}-{uuid.uuid4().hex}"
        job.side["asked"] = max_new
        kw: dict[str, Any] = {"after_tokens": cut_after, "stop": release, "total_s": total_s}
        if via_router:
            assert t.router_url is not None
            body = client.greedy_payload(prompt, max_new, stream=True, rid=rid)
            ans, cut = _cut_stream(t.router_url, body, bound, **kw)
        else:
            body = _pd_body(ctx, prompt, max_new, rid, stream=True)
            with ThreadPoolExecutor(1) as ex:
                fp = ex.submit(client.send, t.prefill_url, body, bound_s=bound)
                ans, cut = _cut_stream(t.decode_url, body, bound, **kw)
                ans = _legs_answer(job, ans, fp.result())
        job.side["cut"] = cut
        got = len(ans.output_ids)
        if ans.ok and got:
            ans.output_ids = ans.output_ids[:STREAM_JUDGED_TOKENS]
            job.max_new = len(ans.output_ids)
            _add_note(job, f"[{'the client cut the stream' if cut else 'the stream ended'} "
                           f"after {got} of {max_new} tokens: judged on the first "
                           f"{job.max_new} against the reference's]")
        return ans

    job.call = call
    return job


def abort_during_decode(ctx: Ctx) -> None:
    """A client that disconnects from a streamed request after a few tokens (decode is
    decoding it), while normal requests run at the same time and afterwards on its pages.

    The attack requests (canary prompts, as many new tokens as fit up to 768) are streamed,
    alternately through the router and to both legs directly; the client reads the stream
    until it carries ``CUT_AFTER_TOKENS`` tokens and closes the connection (the phase is
    reached: the tokens came from decode's running batch). Upstream's HTTP layer turns the
    disconnect into an abort (``create_abort_task``, or the disconnect check while waiting);
    the aborted request leaves the running batch and its pages are freed. Normal canary
    requests run concurrently and after. Judged: each cut request on the tokens it received
    (equal to the reference's first tokens, else a leak), and every normal request. The notes
    say how long decode kept running requests after the cut.

    A leak: the cut request's first tokens differ from the reference (its KV was not its own),
    or a normal request's answer carries a cut request's canary tokens (pages freed while a
    decode step of the cut request still wrote them, handed to the normal request). A hang: a
    leg of a cut request that never answered. Probes the decode-side release of an aborted
    running request (upstream-gaps 4: the allocator keeps no owner or generation; freed pages
    are merged and reused soon in PD mode).
    """
    limit, info = _pair_limit(ctx)
    _victims(ctx, ctx.knobs.victims, min(limit - 1, 160))
    t = ctx.target
    context = min((v["context_length"] or 0) for v in info.values()) or 1024
    jobs = []
    for i in range(ctx.knobs.attacks):
        label = f"abort-cut-{i}"
        owner, p = ctx.canary(label, ctx.rng.randint(64, max(80, min(limit - 1, 160))))
        max_new = max(32, min(768, context - len(p) - 16))
        jobs.append(_stream_job(ctx, label, p, max_new, owner, cut_after=CUT_AFTER_TOKENS,
                                via_router=bool(t.router_url) and i % 2 == 0))
    ctx.run_phase("cut", jobs + _normals(ctx, "during", ctx.knobs.attacks, limit),
                  concurrency=2 * len(jobs) or 1)
    running = pd_load(t.decode_url).get("num_running_reqs")
    drained_s = _decode_idle_after(ctx, ("num_running_reqs",))
    cut = [j for j in jobs if j.side.get("cut")]
    ctx.notes.append(
        f"{len(cut)} of {len(jobs)} streams cut by the client (asking up to "
        f"{max((j.side.get('asked', 0) for j in jobs), default=0)} tokens each); decode ran "
        f"{running} request(s) when the phase ended, "
        + (f"none {drained_s:.2f}s later" if drained_s is not None
           else "some still after the settle bound"))
    _after(ctx, ctx.knobs.victims, limit)


#: The mix of ``concurrent-trace``: (kind, weight). ``MUST_SERVE`` kinds must be answered
#: reference-identical by a safe pair (nothing about them is wrong); the others may also get an
#: explicit error, never other content and never a hang.
TRACE_MIX: tuple[tuple[str, int], ...] = (
    ("plain", 6), ("stream", 3), ("shared-prefix", 5), ("parallel", 3), ("over-limit", 2),
    ("client-cut", 3), ("decode-only", 1), ("room-reuse", 2))
TRACE_MUST_SERVE = ("plain", "stream", "shared-prefix", "parallel")
#: New tokens of a trace request: few, so that 40 requests fit a 2-core box's minute.
TRACE_MAX_NEW = (4, 24)


def trace_kind(label: str) -> str:
    """The kind of a ``concurrent-trace`` record's label (``trace-7-parallel#1`` ->
    ``parallel``, ``trace-3-room-reuse-b`` -> ``room-reuse``; ``""`` for another phase's)."""
    if not label.startswith("trace-") or label.count("-") < 2:
        return ""
    rest = label.split("#")[0].split("-", 2)[2]
    return next((k for k, _ in TRACE_MIX if rest == k or rest == f"{k}-a" or rest == f"{k}-b"),
                "")


def _delayed(job: Job, offset_s: float) -> Job:
    """``job`` whose request leaves ``offset_s`` after its phase starts."""
    call = job.call

    def later() -> Answer:
        time.sleep(offset_s)
        return call()

    job.call = later
    job.side["offset_s"] = round(offset_s, 3)
    return job


def _trace_jobs(ctx: Ctx, limit: int) -> list[Job]:
    """The seeded trace (see :func:`concurrent_trace`): one job per request, each with its
    start offset; a ``room-reuse`` entry is two requests (``-a``, ``-b``) of one room."""
    rng, t = ctx.rng, ctx.target
    kinds = [k for k, w in TRACE_MIX for _ in range(w)]
    prefixes = [ctx.canary(f"trace-prefix-{i}", rng.randint(32, max(40, min(limit // 4, 160))))[1]
                for i in range(3)]
    window = ctx.knobs.trace_window_s
    first = rng.sample([k for k, _ in TRACE_MIX], len(TRACE_MIX))
    jobs: list[Job] = []
    for i in range(ctx.knobs.trace_requests):
        # Every kind once first (in a random order), then drawn by weight.
        kind = first[i] if i < len(first) else rng.choice(kinds)
        label = f"trace-{i}-{kind}"
        max_new = rng.randint(*TRACE_MAX_NEW)
        if kind == "shared-prefix":
            # Another tenant's prompt begins the same way: the prefill's prefix cache serves
            # the shared part from pages an earlier request wrote.
            owner, tail = ctx.canary(label, rng.randint(8, 64))
            p = (rng.choice(prefixes) + tail)[:limit - 1]
        elif kind == "over-limit":
            owner, p = ctx.canary(label, limit + rng.randint(1, 48))
            max_new = 4
        else:
            owner, p = ctx.canary(label, rng.randint(16, max(32, min(limit - 1, limit // 2))))
        batch: list[Job]
        if kind in ("plain", "stream", "shared-prefix", "over-limit"):
            batch = [ctx.normal(label, p, max_new, canary=owner, stream=kind == "stream")]
        elif kind == "parallel":
            n = rng.choice((2, 3))
            job = ctx.normal(label, p, max_new, canary=owner, n=n)
            job.side["n"] = n
            batch = [job]
        elif kind == "client-cut":
            batch = [_stream_job(ctx, label, p, max(max_new, 16), owner,
                                 via_router=bool(t.router_url), cut_after=rng.randint(1, 4))]
        elif kind == "decode-only":
            # Bootstrap fields naming a room no prefill request will ever claim.
            batch = [ctx.decode_only(label, p, max_new, canary=owner,
                                     bootstrap_host=t.bootstrap_host,
                                     bootstrap_port=t.bootstrap_port,
                                     bootstrap_room=rng.randrange(1 << 62))]
        else:  # room-reuse: two clients choose the same room, at nearby times
            room = rng.randrange(1 << 62)
            owner_b, p_b = ctx.canary(label + "-b", rng.randint(16, max(32, limit // 2)))
            batch = [ctx.direct(label + "-a", p, max_new, canary=owner, room=room),
                     ctx.direct(label + "-b", p_b, max_new, canary=owner_b, room=room)]
        start = rng.uniform(0.0, window)
        for k, job in enumerate(batch):
            job.side["kind"] = kind
            jobs.append(_delayed(job, start + 0.05 * k * rng.random()))
    return jobs


def concurrent_trace(ctx: Ctx) -> list[Job]:
    """A seeded concurrent trace of mixed client traffic on one pair (the method of
    concurrent-trace fuzzers such as GRIEF, arXiv 2605.11202, which found cross-request
    contamination in vLLM and SGLang): ``trace_requests`` requests, each leaving at a random
    time within ``trace_window_s``, of these kinds (``TRACE_MIX``):

    ``plain`` and ``stream`` (canary prompts up to half the pair's limit, through the router),
    ``shared-prefix`` (one of three shared prefixes plus the request's own canary tail: the
    prefill's prefix cache hands out pages another request wrote), ``parallel`` (``n`` 2 or 3,
    greedy: every sample must equal the reference), ``over-limit`` (up to 48 tokens past the
    pair's limit), ``client-cut`` (a stream the client closes after 1 to 4 tokens),
    ``decode-only`` (bootstrap fields sent to the decode alone, naming a room no prefill
    request claims) and ``room-reuse`` (two requests sent to both legs directly with the same
    client-chosen room, at nearby times). Normal requests follow on the pages the trace used.

    Every answer is judged on content (a cut stream on the tokens it got). A leak: any 200
    whose content is not the reference's (a sample, a cut stream's first tokens, a prompt
    sharing a prefix with another tenant's). A hang: any request, whatever its kind, without
    an answer within the bound (a reservation nobody releases stalls the pair: one
    decode-only request holds its pages plus the decode's reserved tokens). The notes give,
    per kind, the outcomes and the slowest answer, and whether the decode emptied its queues
    afterwards. Probes every gap at once under concurrency (upstream-gaps 1 to 4: rejected
    prompts, client-chosen rooms, ``n>1`` sharing a room, releases without a generation).
    Returns the trace's jobs, each with its answer (for a caller that reads full messages)."""
    limit, _ = _pair_limit(ctx)
    jobs = _trace_jobs(ctx, limit)
    ctx.announce(f"concurrent-trace: {len(jobs)} requests within {ctx.knobs.trace_window_s:g} "
                 f"s (bound {ctx.knobs.bound_s:g} s each)")
    ctx.run_phase("trace", jobs, concurrency=len(jobs))
    by_kind: dict[str, list[Job]] = {}
    for j in jobs:
        by_kind.setdefault(str(j.side["kind"]), []).append(j)
    seen: dict[str, dict[str, int]] = {}
    for r in ctx.records:
        if r.phase == "trace":
            counts = seen.setdefault(trace_kind(r.label), {})
            counts[r.outcome.value] = counts.get(r.outcome.value, 0) + 1
    for kind, js in sorted(by_kind.items()):
        slowest = max((j.answer.e2e_s or 0.0 for j in js if j.answer), default=0.0)
        ctx.notes.append(f"trace {kind}: {len(js)} requests, "
                         + ", ".join(f"{o} {c}" for o, c in sorted(seen.get(kind, {}).items()))
                         + f"; slowest answer {slowest:.1f} s")
    idle_s = _decode_idle_after(ctx, ("decode_prealloc_queue_reqs",
                                      "decode_transfer_queue_reqs", "num_running_reqs"))
    ctx.notes.append("after the trace the decode's queues were "
                     + (f"empty {idle_s:.1f} s later" if idle_s is not None
                        else "still busy at the settle bound"))
    _after(ctx, ctx.knobs.victims, limit)
    return jobs


_FAULT_HOOKS = ("needs a test-only fault hook of the {stage} stage (pdsafe_testkit.faults plugin) "
                "that is not there yet; the scenario is registered so the report shows the gap")


#: The ``kv_corrupt`` fault's rid prefix and modes (``pdsafe_testkit.faults``; repeated here so
#: the benchmark does not import the fault plugin).
CORRUPT_PREFIX = "pdsafe-fault-corrupt-"
CORRUPTIONS: dict[str, tuple[str, str]] = {
    "one-bit": ("bit", "one bit of one byte of K or V at one owned position of one layer"),
    "partial-last-page": ("lastpage", "one bit in the last owned position (the partial last "
                                      "page's slot)"),
    "one-page": ("page", "every byte of one page of owned positions of one layer's K"),
    "one-layer": ("layer", "one exponent bit in every owned position of one layer's V"),
}


def _corruption(ctx: Ctx, what: str) -> None:
    """Victims, then requests whose transferred KV the decode's test-only ``kv_corrupt`` fault
    changes after the transfer and before the batch's first decode step, then normal requests.

    What changes (by name): see ``CORRUPTIONS``. Stock 0.5.23 (its checksum is off by default
    and CUDA-only) decodes the changed KV: HTTP 200, either with the reference's tokens (the
    change did not move the greedy answer: undetected, but harmless here) or with other
    tokens (a leak: a corrupted answer the client cannot tell from a good one). Expected of
    the fork: an explicit 500 "KV integrity check failed" for every corrupted request, and the
    normal requests after it identical (no false alarm, pages reused cleanly). Probes
    upstream-gaps 3 (checksum off by default, CUDA-only, fails open). Harness only (a
    server-side fault).
    """
    mode, _ = CORRUPTIONS[what]
    limit, _ = _pair_limit(ctx)
    _victims(ctx, ctx.knobs.victims, min(limit - 1, 160))
    jobs = []
    for i in range(ctx.knobs.attacks):
        label = f"corrupt-{what}-{i}"
        owner, p = ctx.canary(label, ctx.rng.randint(64, max(80, min(limit - 1, 200))))
        jobs.append(ctx.direct(label, p, canary=owner,
                               rid=f"{CORRUPT_PREFIX}{mode}-{uuid.uuid4().hex}"))
    ctx.run_phase("corrupted", jobs)
    _after(ctx, ctx.knobs.victims, limit)


def _corruption_scenario(what: str) -> Scenario:
    def fn(ctx: Ctx) -> None:
        _corruption(ctx, what)

    fn.__doc__ = (f"Corruption: {CORRUPTIONS[what][1]}. " + (_corruption.__doc__ or ""))
    return Scenario(f"corruption-{what}", "corruption", "default", fn,
                    known_unsafe_upstream=True, in_quick=what == "one-layer")


def incident_walk(own: OwnCtx) -> None:
    """The incident's deployment, scaled (prefill KV pool 65 % of the model's context, a larger
    decode pool), walked the way an operator walks it, each step checked on the message the
    operator sees (``benchmark.incident``, ``pdsafe_testkit.incident``; docs/operator-guide.md,
    "A KV pool smaller than the context length"). Fork: (1) the incident's configuration: the
    prefill refuses to start naming its pool and context; (2) the clamp flag on that leg: both
    servers healthy, every request refused at pairing on both legs (the context lengths
    differ; the remedy: the same --context-length on both); (3) the same --context-length on
    both legs, the pool step 1 named: after a victim, every prompt within the pair's advertised
    limit reference-identical, every longer one (up to the model's context) a 4xx naming the
    limit. Stock 0.5.23 starts the incident's configuration and answers prompts between its
    prefill's pool and the context over pages prefill never wrote (the placeholder handoff): a
    leak, HTTP 200 whose canary attribution names the victim. Own servers (restarts), harness
    only. Probes UPSTREAM-GAPS 1 (placeholder handoff, limit checked only in the scheduler).
    """
    from benchmark import incident

    incident.walk(own, truncate=False)


def incident_walk_auto_truncate(own: OwnCtx) -> None:
    """``incident-walk`` with ``--allow-auto-truncate`` on every server of the walk. Step 3
    expects every over-long prompt answered with the reference answer of its first L tokens
    (L: the pair's advertised limit); each leg cuts at its own limit, so when the legs' limits
    differ (page sizes above 5: prefill's page rounding) the walk lowers --context-length on
    both by the difference first, as the guide says, and checks that they then agree. Stock
    0.5.23 cuts the prompt on the prefill only (its decode's limit is the context's) and
    decodes the rest of decode's reservation over the victim's KV: a leak naming the victim
    (the incident's divergence). Own servers, harness only. Probes UPSTREAM-GAPS 1 (no coverage
    handshake).
    """
    from benchmark import incident

    incident.walk(own, truncate=True)


def _planned(name: str, family: str, doc: str, stage: str, *, unsafe: bool = True,
             reason: str | None = None) -> Scenario:
    return Scenario(name, family, "default", None, known_unsafe_upstream=unsafe,
                    reason=reason or _FAULT_HOOKS.format(stage=stage), doc_override=doc)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("steady-state", "steady", "default", steady_state, deployment_ok=True),
    Scenario("over-capacity-p-lt-d", "over-capacity", "p_lt_d", over_capacity,
             known_unsafe_upstream=True),
    Scenario("over-capacity-d-lt-p", "over-capacity", "d_lt_p", over_capacity,
             known_unsafe_upstream=True),
    Scenario("over-capacity-deployed", "over-capacity", "deployed", over_capacity,
             deployment_ok=True, harness_ok=False,
             reason="deployment mode only: the harness runs both capacity orders instead"),
    Scenario("spoof-fake-bootstrap-host", "spoof", "default", spoof_fake_bootstrap_host,
             deployment_ok=True, known_unsafe_upstream=True),
    Scenario("spoof-health-check-rid", "spoof", "default", spoof_health_check_rid,
             deployment_ok=True),
    # The abort family runs before the room family: room-duplicate-concurrent kills a stock
    # decode (the stack is then restarted for the scenarios after it). abort-mid-transfer is
    # on the late_write stack (first there; the crash scenario stays last). In --quick only
    # abort-during-decode (about 15 s for both variants, measured): --quick was already close
    # to its 10-minute budget (docs/benchmark.md); abort-bootstrap costs about 46 s there
    # (stock's hang waits out the bound) and runs by name or in the full matrix.
    Scenario("abort-bootstrap", "abort", "default", abort_bootstrap, deployment_ok=True,
             known_unsafe_upstream=True, in_quick=False),
    Scenario("abort-prealloc", "abort", "default", abort_prealloc, deployment_ok=True,
             in_quick=False),
    Scenario("abort-mid-transfer", "abort", "late_write", abort_mid_transfer, in_quick=False),
    Scenario("abort-after-transfer-before-commit", "abort", "default",
             abort_after_transfer_before_commit, in_quick=False),
    Scenario("abort-during-decode", "abort", "default", abort_during_decode,
             deployment_ok=True, in_quick=True),
    Scenario("room-replay", "room", "default", room_replay, deployment_ok=True,
             known_unsafe_upstream=True),
    # Last on the default stack: duplicate rooms crash a stock decode scheduler (and the fork's
    # before patch 0018; measured), and the stack is then restarted only if another scenario
    # needs it.
    Scenario("room-duplicate-concurrent", "room", "default", room_duplicate_concurrent,
             deployment_ok=True, known_unsafe_upstream=True),
    Scenario("divergence-auto-truncate", "divergence", "p_lt_d_truncate",
             divergence_auto_truncate, known_unsafe_upstream=True),
    Scenario("divergence-context-length", "divergence", "ctx_div",
             divergence_context_length, known_unsafe_upstream=True),
    Scenario("divergence-chat-template", "divergence", "tpl_div",
             divergence_chat_template, known_unsafe_upstream=True),
    # The late_write stack (two prefills armed with the test-only late_write fault, harness
    # only). Full matrix only (in_quick=False): the stack and the three scenarios would push
    # --quick past its 10-minute budget (docs/benchmark.md, measured). The crash scenario
    # runs last on the stack: it kills one of its prefills.
    Scenario("late-write-past-release-timeout", "late-write", "late_write",
             late_write_past_release_timeout, known_unsafe_upstream=True, in_quick=False),
    Scenario("late-write-past-abort", "late-write", "late_write", late_write_past_abort,
             in_quick=False),
    Scenario("crash-prefill-mid-transfer", "crash", "late_write", crash_prefill_mid_transfer,
             in_quick=False),
    *(_corruption_scenario(what) for what in CORRUPTIONS),
    # It takes a stock decode down too (a shared room, "Unexpected poll case"): the stack is
    # restarted for room-n-greater-1. Full matrix, deployment mode and by name: about 1.5 min
    # for both variants.
    Scenario("concurrent-trace", "trace", "default", concurrent_trace, deployment_ok=True,
             known_unsafe_upstream=True, in_quick=False),
    # Last in the registry (after the default stack's other scenarios): it takes a stock decode
    # down (measured, docs/benchmark.md), and the stack is then restarted only if another
    # scenario needs it. Full matrix only: --quick's margin, and room-duplicate-concurrent shows
    # the same stock crash there.
    Scenario("room-n-greater-1", "room", "default", room_n_greater_1, deployment_ok=True,
             known_unsafe_upstream=True, in_quick=False),
    # Own servers (five to seven starts per cell, both variants about N s per backend and
    # page size, docs/benchmark.md): full matrix only; the runner runs them after the stacks.
    Scenario("incident-walk", "incident", OWN_SERVERS, incident_walk,
             known_unsafe_upstream=True, in_quick=False),
    Scenario("incident-walk-auto-truncate", "incident", OWN_SERVERS,
             incident_walk_auto_truncate, known_unsafe_upstream=True, in_quick=False),
)}


#: The CI smoke (``--smoke``): ``--quick`` restricted to the scenarios of the ``default``
#: stack, so one pair of stacks (base and fork) plus the reference run, with the overhead
#: bursts. It keeps what the smoke test must prove: the false-alarm check (steady-state), a
#: scenario in which stock 0.5.23 leaks (spoof-fake-bootstrap-host), and the fork at zero leaks
#: and hangs; the other stacks' scenarios run in ``--quick`` and the full matrix.
#: Not ``room-duplicate-concurrent``: the fork refuses duplicates (409, patch 0018) and no longer
#: crashes. A refused duplicate's decode leg is now failed when the prefill clears the room's
#: live request (it hung once in three --quick runs before that), but a duplicate refused on the
#: decode side can still leave its prefill leg waiting for its bootstrap timeout; telling the two
#: transfers apart needs the generation of issue 9. It stays in --quick, where a hang is
#: reported, not in the CI smoke, where it could make CI flaky.
SMOKE_SCENARIOS: tuple[str, ...] = ("steady-state", "spoof-fake-bootstrap-host",
                                    "spoof-health-check-rid", "room-replay")


def select(names: Sequence[str] | None) -> list[Scenario]:
    """The scenarios a run covers (all registered ones when ``names`` is empty), in registry
    order; unknown names raise ``KeyError``. Whether each one runs in this mode is
    ``applicable``'s answer; the report lists the others with the reason."""
    if names:
        unknown = [n for n in names if n not in SCENARIOS]
        if unknown:
            raise KeyError(f"unknown scenario(s) {unknown}; known: {list(SCENARIOS)}")
        wanted = set(names)
        return [s for s in SCENARIOS.values() if s.name in wanted]
    return list(SCENARIOS.values())


#: Why a scenario with ``in_quick=False`` is reported ``not_applicable`` in ``--quick``.
FULL_ONLY = ("full matrix only: its own stacks would push --quick past its 10-minute budget on "
             "2 cores (docs/benchmark.md); run it with --scenarios NAME or without --quick")


def applicable(s: Scenario, *, deployment: bool, quick: bool = False) -> tuple[bool, str]:
    """(runs here, why not) for a scenario in this mode; ``quick``: a ``--quick`` run that
    did not name its scenarios (those outside ``in_quick`` are left to the full matrix)."""
    if not s.implemented:
        return False, s.reason
    if quick and not s.in_quick and not deployment:
        return False, FULL_ONLY
    if deployment and not s.deployment_ok:
        return False, ("harness only: needs servers in a specific configuration "
                       f"(stack {s.stack!r}) or server-side faults/restarts")
    if not deployment and not s.harness_ok:
        return False, s.reason
    return True, ""
