"""Late writes and prefill crashes (issue 9): the scenario mechanics, shared by the CI test and
the regression benchmark.

``test/pd/test_late_write.py`` (the CI proof) asserts on what these functions observe;
``benchmark/scenarios.py`` (``late-write-past-release-timeout``, ``late-write-past-abort``,
``crash-prefill-mid-transfer``) judges the same requests against the co-located reference. The
mechanics live here once: the stack (two prefills armed with the test-only ``late_write`` fault,
one decode with upstream's release timeout shortened), the victim whose KV write is held and
which is aborted on the decode, the canary request that gets the victim's pages next, and the
SIGKILL of a prefill while it holds a write.

Upstream's deferred decode KV release (``decode.py`` ``DecodeTransferQueue._defer_release`` /
``resolve_deferred_releases``) holds an aborted request's decode pages until every prefill rank
sent ABORT_ACK (the prefill transfer worker sends it only once the room's in-flight write
drained), but frees them anyway after ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``
(30 s; ``RELEASE_TIMEOUT_S`` here). A write still in flight then lands in freed pages: a
distributed use-after-free.

The stack (``late_write_stack``; a fresh one per variant, no other traffic): one decode server
(release timeout 2 s, KV pool = context = ``POOL`` tokens, the heartbeat env, page size 1 unless
asked, ``--skip-server-warmup`` so that the first request gets the first pages), prefill
``held`` whose transfer worker holds every KV write of the late room range ``Trio.held_s``
seconds (test-only fault ``late_write``, ``pdsafe_testkit.faults``; the hold sits after the
worker's "room failed/aborted" check, so it is a write already under way), and a second prefill
``other`` (same fault, hold ``Trio.other_s``, ``held_s`` unless asked; for the rooms of a canary
the fault only logs where the writes go). Prefills run one chunk per prompt.

``run_late_write``:

1. Victim V (``V_LEN``-token prompt, a late room) goes to its prefill (``held`` unless asked) and
   the decode directly. Once that prefill logs that it holds V's write, V is aborted on the
   decode (``POST /abort_request``: the scheduler's ``abort_request`` finds V in
   ``disagg_decode_transfer_queue`` and calls ``kv_receiver.abort()``, which marks the room
   Failed and sends ABORT to the prefill; the next ``pop_transferred`` turns the Failed poll into
   a deferred release).
2. ``LEAD_S`` before the held write lands (with a 6 s hold: well after the 2 s timeout), canary B
   (``B_LEN``-token prompt, greedy, ``B_NEW`` tokens, ``ignore_eos``; a traced room) goes to the
   other prefill and the decode. In PD mode the decode allocator puts freed pages aside and
   merges them back (sorted) only once its never-used free list cannot serve an allocation; the
   sizes make that happen for B (``POOL - V_LEN < B_LEN``), so B gets the lowest pages, V's, and
   V's pages cover every position B will ever hold (``B_LEN + B_NEW + 16 <= V_LEN``): wherever B
   is when the late write lands, the 16 positions the tiny model copies from are V's. A decode
   that refuses B with an explicit error (the fork while V's pages are quarantined) is retried,
   as a client told to retry would, for up to ``B_RETRY_S`` after the held write was due.
3. The held write lands (with stock and a hold past the timeout: while B decodes). The
   ``Observation`` records every answer, the log events (where V's and B's destination pages are,
   when the write went out and V's room status on the prefill then), the decode's release
   evidence and /health.

``run_crash``: victim V2 held in its prefill's transfer worker, that prefill SIGKILLed (its whole
process group, no cleanup); V2's decode client answered; a hold window in which the decode's
counters are watched (on the fork the heartbeat only alarms and the incarnation probe finds
nobody, so nothing may release V2's pages); then the evidence (``restart_prefill``: the prefill
started again on its ports, a new process incarnation the decode's probe sees;
``operator_release``: ``POST /pdsafe/quarantine/release`` naming it); then B2 through the
surviving prefill once the decode released V2's pages (a given decode counter moved) or the
bound passed.

Why two prefills: Mooncake and NIXL prefills shard chunks to worker queues by the decode's
session ports, so every request from one prefill to one decode shares one worker thread; B's
chunk would wait behind V's held write and then overwrite V's late KV itself. A second prefill
(an ordinary N-prefill deployment) sends B's KV while V's write is still held.

What this does not cover: prefill-side source pages freed early, the aux/metadata slot the late
write's ``send_aux`` also hits, the staging ring, a prefill alive but unreachable (the heartbeat
takes it for gone), or a quarantine below the fork's admission limit (V holds 85% of the pool,
so the fork refuses B until V's pages are released instead of serving B from other pages).
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from pdsafe_testkit.faults import ENV as FAULT_ENV
from pdsafe_testkit.faults import (
    ROOM_RANGE_WIDTH,
    LateWriteEvent,
    late_room,
    parse_late_write_log,
    traced_room,
)
from pdsafe_testkit.metrics import metric_total, scrape, sum_samples
from pdsafe_testkit.servers import (
    GenResult,
    PDStack,
    ServerConfig,
    SGLangServer,
    generate,
    launch_server,
    restart_server,
    stop_together,
    wait_server,
)

#: How long the prefill holds each KV write of a late room (default of both prefills).
SECONDS_LATE = 6.0
#: Upstream's deferred-release timeout, shortened (default 30 s).
RELEASE_TIMEOUT_S = 2.0
RELEASE_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"
#: Decode KV pool = context length = the tiny model's max positions; page size 1.
POOL = 4096
PREFILL_POOL = 8192
V_LEN, V_NEW = 3500, 8
B_LEN, B_NEW = 700, 1500
#: B is sent this long before the held write lands: time for B's prefill, transfer and commit.
LEAD_S = 1.5
#: How long after the held write was due B is retried while the decode refuses it explicitly.
B_RETRY_S = 30.0
#: The decode's upstream warning when it frees a held request's pages without the drain ack.
RELEASE_LOG = "Deferred KV release for room {room} timed out"
COPY_PERIOD = 16  # the tiny model copies the token 16 positions back

assert POOL - V_LEN < B_LEN, "B's prompt must not fit in pages the decode never used"
assert B_LEN + B_NEW + COPY_PERIOD <= V_LEN, "V's pages must cover every position of B"
assert V_LEN + 512 <= POOL and B_LEN + B_NEW + 512 <= POOL  # decode's reserved decode tokens

#: The decode probes each prefill's bootstrap server every second and declares it gone after
#: two misses (upstream's defaults: 5 s, 2), so the crash scenario's bound stays short.
HEARTBEAT_ENV = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "1",
                 "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2"}
#: Longest the crash scenario may take from the SIGKILL to each of its outcomes.
CRASH_BOUND_S = 60.0

#: sglang-pdsafe's quarantine counters (decode; without the ``sglang:pdsafe_`` prefix).
QUARANTINE_METRICS = ("quarantine_overdue_total", "quarantine_released_ack_total",
                      "quarantine_limit_refused_total")
#: The fork's quarantine counters the crash scenario reads (decode; without the prefix; absent,
#: so 0, on stock): the heartbeat's alarm (no evidence), the probe's misses, and the releases by
#: evidence.
CRASH_METRICS = ("quarantine_peer_gone_alarm_total", "quarantine_probe_failed_total",
                 "quarantine_released_ack_total", "quarantine_released_incarnation_total",
                 "quarantine_released_operator_total", "quarantine_operator_release_total")
#: The fork's releases of quarantined pages by evidence (a crashed prefill's pages: a new
#: incarnation registered at its address, or an operator's release).
INCARNATION_METRIC = "sglang:pdsafe_quarantine_released_incarnation_total"
OPERATOR_METRIC = "sglang:pdsafe_quarantine_released_operator_total"
#: How long the crash scenario watches V2's pages held before it gives the evidence: two of
#: the decode's incarnation probes at their default interval (5 s) and then some.
HOLD_WINDOW_S = 12.0
#: Upstream's counter of resolved deferred releases, by ``outcome`` (``drained``: every prefill
#: rank acknowledged the drain; ``timeout``: released without it; the fork counts its releases on
#: a new incarnation or an operator's word as ``timeout`` too, upstream's collector accepting no
#: other label). Both variants.
DEFERRED_RELEASE_METRIC = "sglang:decode_deferred_kv_release_total"
RELEASE_OUTCOMES = ("drained", "timeout", "error")


@dataclass
class Trio:
    """The decode server, the prefill that holds late writes, and a second prefill.

    ``held_s`` / ``other_s``: how long each prefill holds a late room's writes (its fault arg).
    """

    backend: str
    held: SGLangServer
    other: SGLangServer
    decode: SGLangServer
    held_s: float = SECONDS_LATE
    other_s: float = SECONDS_LATE

    def pair(self, prefill: SGLangServer) -> PDStack:
        return PDStack(self.backend, prefill, self.decode, None)

    def hold_of(self, prefill: SGLangServer) -> float:
        """Seconds ``prefill`` (``held`` or ``other``) holds each write of a late room."""
        if prefill is self.held:
            return self.held_s
        if prefill is self.other:
            return self.other_s
        raise ValueError(f"{prefill.url} is not a prefill of this stack")

    def servers(self) -> dict[str, SGLangServer]:
        """Role -> server: ``prefill-held``, ``prefill-other``, ``decode``."""
        return {"prefill-held": self.held, "prefill-other": self.other, "decode": self.decode}


def fault_spec(seconds: float) -> str:
    """The ``SGLANG_PDSAFE_TEST_FAULTS`` value that holds late rooms' writes ``seconds``."""
    return f"late_write:{seconds:g}"


def stack_configs(backend: str, model_path: Path, extra_env: dict[str, str], *,
                  held_s: float = SECONDS_LATE, other_s: float | None = None,
                  page_size: int = 1) -> tuple[ServerConfig, ServerConfig, ServerConfig]:
    """The three servers' configurations (held prefill, other prefill, decode); pure.

    Only the prefills are armed (``late_write``); the decode gets the shortened release timeout
    and the heartbeat env. ``extra_env`` goes to all three (e.g. the stock tree's PYTHONPATH).
    """

    def cfg(role: str, env: dict[str, str]) -> ServerConfig:
        pool = PREFILL_POOL if role == "prefill" else POOL
        # One chunk per prompt on the prefills (one held write covers all of V); no warmup
        # request on the decode, so V's pages start at the decode's first page, as B's do.
        extra = (["--chunked-prefill-size", str(PREFILL_POOL)] if role == "prefill"
                 else ["--skip-server-warmup"])
        return ServerConfig(role=role, model_path=model_path, backend=backend,
                            max_total_tokens=pool, page_size=page_size, context_length=POOL,
                            extra_args=extra, env={**extra_env, **env})

    other = held_s if other_s is None else other_s
    return (cfg("prefill", {FAULT_ENV: fault_spec(held_s)}),
            cfg("prefill", {FAULT_ENV: fault_spec(other)}),
            cfg("decode", {RELEASE_ENV: f"{RELEASE_TIMEOUT_S:g}", **HEARTBEAT_ENV}))


@contextmanager
def late_write_stack(backend: str, log_dir: Path, model_path: Path,
                     extra_env: dict[str, str], *, held_s: float = SECONDS_LATE,
                     other_s: float | None = None, page_size: int = 1) -> Iterator[Trio]:
    """Start the two prefills and the decode in parallel; stop all three on exit."""
    started: list[SGLangServer] = []
    try:
        for c in stack_configs(backend, model_path, extra_env, held_s=held_s, other_s=other_s,
                               page_size=page_size):
            started.append(launch_server(c, log_dir, wait=False))
        for s in started:
            wait_server(s)
        yield Trio(backend, *started, held_s=held_s,
                   other_s=held_s if other_s is None else other_s)
    finally:
        stop_together(*reversed(started))


# ----------------------------------------------------------------------------- helpers


def wait_for(what: str, pred: Callable[[], Any], timeout: float, step: float = 0.1) -> Any:
    """``pred()``'s first truthy value; ``AssertionError`` naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(step)


def event(server: SGLangServer, room: int, kind: str) -> LateWriteEvent | None:
    """The first ``late_write`` log event ``kind`` of ``room`` in ``server``'s log."""
    return next((e for e in parse_late_write_log(server.process.log_text())
                 if e.room == room and e.event == kind), None)


def first_divergence(got: list[int], want: list[int]) -> int | None:
    """Index of the first token where ``got`` differs from ``want`` (None: equal)."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def longest_run_from(tokens: list[int], source: list[int]) -> int:
    """Length of the longest run of consecutive ``tokens`` that also occurs in ``source``."""
    best = 0
    n = len(source)
    for start in range(len(tokens)):
        for j in range(n):
            k = 0
            while start + k < len(tokens) and j + k < n and tokens[start + k] == source[j + k]:
                k += 1
            best = max(best, k)
    return best


def span(pages: list[int]) -> str:
    return f"{min(pages)}..{max(pages)} ({len(pages)})" if pages else "none"


def health(server: SGLangServer) -> str:
    """``/health`` of ``server`` as "status: body" (the fork's 503 names its reason)."""
    try:
        r = requests.get(server.url + "/health", timeout=60)
        return f"{r.status_code}: {r.text[:300]}"
    except requests.RequestException as e:
        return f"0: {e}"


def release_outcomes(decode_url: str) -> dict[str, float]:
    """Upstream's deferred-release counter on the decode, per outcome label (both variants)."""
    samples = scrape(decode_url)
    return {o: sum_samples(samples, DEFERRED_RELEASE_METRIC, outcome=o) for o in RELEASE_OUTCOMES}


def bounded_generate(url: str, ids: Sequence[int], max_new: int, *, timeout: float,
                     **extra: Any) -> GenResult:
    """``servers.generate`` that never raises for what the server does: no answer within
    ``timeout`` is ``GenResult(timed_out=True)``, a failed connection a status-0 result whose
    message says so."""
    try:
        return generate(url, ids, max_new, timeout=timeout, **extra)
    except requests.Timeout:
        return GenResult(0, [], {"error": {"message": f"no answer within {timeout:g}s"}},
                         timed_out=True)
    except requests.RequestException as e:
        return GenResult(0, [], {"error": {"message": f"client gave up: {e}"}})


def pd_generate(prefill: SGLangServer, decode: SGLangServer, ids: Sequence[int], max_new: int,
                *, room: int, timeout: float, **extra: Any) -> tuple[GenResult, GenResult]:
    """One request to ``prefill`` and ``decode`` directly, in parallel (what the router does);
    (prefill's answer, decode's answer), each bounded by ``timeout``."""
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": room}
    with ThreadPoolExecutor(2) as ex:
        fp = ex.submit(bounded_generate, prefill.url, ids, max_new, timeout=timeout, **boot,
                       **extra)
        fd = ex.submit(bounded_generate, decode.url, ids, max_new, timeout=timeout, **boot,
                       **extra)
        return fp.result(), fd.result()


def next_traced_room(room: int) -> int:
    """The traced room after ``room`` (a retry's fresh room; wraps inside the range)."""
    return traced_room((room - traced_room(0) + 1) % ROOM_RANGE_WIDTH)


@dataclass
class Attempt:
    """One try of a canary request: both legs' answers (decode's is the one judged)."""

    room: int
    sent_at: float  # time.time()
    e2e_s: float
    decode: GenResult
    prefill: GenResult


def _try(prefill: SGLangServer, decode: SGLangServer, ids: list[int], room: int,
         timeout: float) -> Attempt:
    sent, t0 = time.time(), time.monotonic()
    rp, rd = pd_generate(prefill, decode, ids, B_NEW, room=room, timeout=timeout)
    return Attempt(room, sent, time.monotonic() - t0, rd, rp)


# ----------------------------------------------------------------------------- late write


@dataclass
class Observation:
    """What happened in one run of the late-write scenario (times: wall clock, ``time.time()``).

    ``hold_s``: how long the victim's prefill held V's write; ``v_result`` / ``v_prefill_result``:
    V's two legs; ``attempts``: every try of B, the last one is B's answer."""

    variant: str
    v_room: int
    b_room: int
    hold_s: float = SECONDS_LATE
    v_abort_http: int = 0
    v_decode_status: int = 0
    v_decode_error: str = ""
    t_held: float = 0.0
    t_abort: float = 0.0
    #: Seconds from the abort to V's decode answer.
    v_answer_s: float | None = None
    t_release_seen: float | None = None
    t_b_sent: float = 0.0
    b_refusals: list[str] = field(default_factory=list)
    t_b_transfer: float | None = None
    t_late_write: float | None = None
    t_b_done: float = 0.0
    v_status_at_write: str | None = None
    v_pages: list[int] = field(default_factory=list)
    b_prompt_pages: list[int] = field(default_factory=list)
    b_status: int = 0
    b_error: str = ""
    b_len: int = 0
    first_divergence: int | None = None
    v_run_in_b: int = 0
    reference_s: float = 0.0
    got_excerpt: list[int] = field(default_factory=list)
    want_excerpt: list[int] = field(default_factory=list)
    #: The decode's /health while it refused B, and after B was served ("status: body").
    health_during: str = ""
    health_after: str = ""
    #: Decode metric deltas over the scenario (sglang:pdsafe_* names without the prefix).
    metric_deltas: dict[str, float] = field(default_factory=dict)
    #: Upstream's deferred-release counter deltas by outcome (``release_outcomes``).
    release_deltas: dict[str, float] = field(default_factory=dict)
    v_result: GenResult | None = None
    v_prefill_result: GenResult | None = None
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def overlap(self) -> int:
        return len(set(self.v_pages) & set(self.b_prompt_pages))

    @property
    def b_identical(self) -> bool:
        return self.b_status == 200 and self.first_divergence is None

    def timeline(self) -> str:
        def rel(t: float | None) -> str:
            return "never" if t is None else f"{t - self.t_held:+.2f}s"

        pages = (f"V's decode pages {span(self.v_pages)}, B's prompt pages "
                 f"{span(self.b_prompt_pages)}, overlap {self.overlap}")
        return (f"[{self.variant}] V held {self.hold_s:g}s {rel(self.t_held)}, V aborted "
                f"{rel(self.t_abort)} "
                f"(HTTP {self.v_abort_http}; V's decode leg answered {self.v_decode_status}: "
                f"{self.v_decode_error[:120]!r}), decode released V by timeout "
                f"{rel(self.t_release_seen)}, B sent {rel(self.t_b_sent)} (refused "
                f"{len(self.b_refusals)} times: {self.b_refusals[:1]}), B's KV written "
                f"{rel(self.t_b_transfer)}, V's late write done {rel(self.t_late_write)} "
                f"(V's room {self.v_status_at_write} on the prefill), B answered "
                f"{rel(self.t_b_done)} (HTTP {self.b_status}, {self.b_len} tokens, first "
                f"divergence from the reference at {self.first_divergence}, longest run of V's "
                f"prompt in B's answer {self.v_run_in_b}); {pages}; reference took "
                f"{self.reference_s:.1f}s for {B_NEW} tokens")

    def to_json(self) -> dict[str, Any]:
        """The observation without the raw answers, pages as spans (the test's record)."""
        skip = {"v_result", "v_prefill_result", "attempts", "v_pages", "b_prompt_pages"}
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in skip}
        return {**out, "v_pages": span(self.v_pages), "b_prompt_pages": span(self.b_prompt_pages),
                "overlap": self.overlap,
                "b_attempts": [(a.room, a.decode.status, a.decode.timed_out)
                               for a in self.attempts]}


def _send_b(trio: Trio, via: SGLangServer, b_ids: list[int], obs: Observation,
            timeout: float) -> GenResult:
    """Send B through ``via``; while the decode refuses it with an explicit error (e.g. the
    fork's quarantine over its limit), retry like a client told to retry, each time on a fresh
    traced room, for at most ``B_RETRY_S`` after the held write was due. ``obs.b_room`` is the
    last attempt's room. A try without an answer within ``timeout`` ends the retries."""
    deadline = obs.t_held + obs.hold_s + B_RETRY_S
    while True:
        att = _try(via, trio.decode, b_ids, obs.b_room, timeout)
        obs.attempts.append(att)
        rb = att.decode
        if rb.ok or rb.timed_out or not rb.error_message or time.time() > deadline:
            return rb
        obs.b_refusals.append(f"+{time.time() - obs.t_held:.2f}s HTTP {rb.status}: "
                              f"{rb.error_message[:160]}")
        if not obs.health_during:
            obs.health_during = health(trio.decode)
        obs.b_room = next_traced_room(obs.b_room)
        time.sleep(0.5)


def run_late_write(trio: Trio, v_ids: list[int], b_ids: list[int], *,
                   expected: Callable[[list[int], int], list[int] | None], variant: str,
                   v_room: int, b_room: int, victim_via: SGLangServer | None = None,
                   canary_via: SGLangServer | None = None, v_timeout_s: float = 120.0,
                   v_answer_bound_s: float = 60.0, b_timeout_s: float = 300.0) -> Observation:
    """Victim V aborted while its write is held, canary B on V's pages, the write lands.

    ``v_room`` must be a late room (``faults.late_room``), ``b_room`` a traced one; V goes
    through ``victim_via`` (default ``trio.held``), B through ``canary_via`` (default the
    other prefill). ``expected(b_ids, B_NEW)``, B's reference answer, is asked for before any
    PD traffic. Each leg of V gives up after ``v_timeout_s``; V's decode leg must have answered
    ``v_answer_bound_s`` after the abort; each try of B gives up after ``b_timeout_s`` (then
    recorded as ``timed_out``). Raises ``AssertionError`` (or ``TimeoutError``) only when a step
    of the choreography never happened (V's write never held, V's decode leg not answering
    after the abort, the late write never landing); everything else is observed.
    """
    vp = victim_via or trio.held
    bp = canary_via or (trio.other if vp is trio.held else trio.held)
    obs = Observation(variant, v_room, b_room, hold_s=trio.hold_of(vp))
    t0 = time.monotonic()
    want = expected(b_ids, B_NEW)  # before any PD traffic
    obs.reference_s = time.monotonic() - t0

    before = {m: metric_total(trio.decode.url, "sglang:pdsafe_" + m) for m in QUARANTINE_METRICS}
    released_before = release_outcomes(trio.decode.url)
    v_rid = f"late-victim-{uuid.uuid4().hex}"
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": vp.bootstrap_port,
            "bootstrap_room": obs.v_room}

    answered: dict[str, float] = {}

    def v_leg(url: str) -> GenResult:
        r = bounded_generate(url, v_ids, V_NEW, timeout=v_timeout_s, rid=v_rid, **boot)
        answered[url] = time.time()
        return r

    release_line = RELEASE_LOG.format(room=obs.v_room)
    with ThreadPoolExecutor(2) as ex:
        fp: Future[GenResult] = ex.submit(v_leg, vp.url)
        fd: Future[GenResult] = ex.submit(v_leg, trio.decode.url)
        held = wait_for("the prefill to hold V's write", lambda: event(vp, obs.v_room, "held"),
                        90)
        obs.t_held = held.at
        obs.v_pages = sorted(held.pages)
        obs.t_abort = time.time()
        obs.v_abort_http = requests.post(trio.decode.url + "/abort_request",
                                         json={"rid": v_rid}, timeout=30).status_code
        rd = fd.result(timeout=v_answer_bound_s)
        obs.v_answer_s = answered[trio.decode.url] - obs.t_abort
        obs.v_result = rd
        obs.v_decode_status = rd.status
        obs.v_decode_error = "" if rd.ok else rd.error_message
        # Watch for the decode's timeout release until B is due.
        t_send = held.at + obs.hold_s - LEAD_S
        while time.time() < t_send:
            if obs.t_release_seen is None and release_line in trio.decode.process.log_text():
                obs.t_release_seen = time.time()
            time.sleep(0.05)
        if obs.t_release_seen is None and release_line in trio.decode.process.log_text():
            obs.t_release_seen = time.time()
        obs.t_b_sent = time.time()
        rb = _send_b(trio, bp, b_ids, obs, b_timeout_s)
        obs.t_b_done = time.time()
        done = wait_for("V's late write to land", lambda: event(vp, obs.v_room, "done"),
                        max(5.0, held.at + obs.hold_s + 30 - time.time()))
        obs.v_prefill_result = fp.result(timeout=v_timeout_s + 10)
    writing = event(vp, obs.v_room, "writing")
    obs.v_status_at_write = writing.status if writing else None
    obs.t_late_write = done.at
    traced = event(bp, obs.b_room, "traced")
    if traced is not None:
        obs.t_b_transfer, obs.b_prompt_pages = traced.at, sorted(traced.pages)
    if obs.t_release_seen is None and release_line in trio.decode.process.log_text():
        obs.t_release_seen = time.time()  # released only after B was sent
    obs.health_after = health(trio.decode)
    obs.metric_deltas = {m: metric_total(trio.decode.url, "sglang:pdsafe_" + m) - v
                         for m, v in before.items()}
    after = release_outcomes(trio.decode.url)
    obs.release_deltas = {o: after[o] - released_before[o] for o in RELEASE_OUTCOMES}
    obs.b_status, obs.b_len = rb.status, len(rb.output_ids)
    obs.b_error = "" if rb.ok else rb.error_message
    if rb.status == 200 and want is not None:
        obs.first_divergence = first_divergence(rb.output_ids, want)
        if obs.first_divergence is not None:
            d = obs.first_divergence
            obs.got_excerpt = rb.output_ids[d:d + 24]
            obs.want_excerpt = want[d:d + 24]
            obs.v_run_in_b = longest_run_from(rb.output_ids[d:d + 64], v_ids)
    return obs


def design_problems(obs: Observation) -> list[str]:
    """The preconditions every variant shares, as problems (empty: V's write really was held
    past its abort and B's KV really went out): what ``run_late_write`` must have set up before
    B's answer says anything about late writes."""
    t = obs.timeline()
    out = []
    if obs.v_abort_http != 200:
        out.append(f"the decode refused /abort_request: {t}")
    if obs.v_decode_status == 200:
        out.append(f"V's decode leg was served, not aborted: {t}")
    if obs.t_late_write is None or obs.t_late_write <= obs.t_abort:
        out.append(f"the late write did not land after the abort: {t}")
    if obs.v_status_at_write not in ("Failed", "cleared"):
        out.append(f"the prefill had not seen V's abort when the late write went out: {t}")
    if not obs.b_prompt_pages:
        out.append(f"the second prefill logged no write for B: {t}")
    return out


# ----------------------------------------------------------------------------- prefill crash


@dataclass
class CrashObservation:
    """The prefill SIGKILLed while its write into V2's decode pages is held, then the evidence.

    Times are seconds from the kill: ``v2_answer_s`` (V2's decode answer), ``evidence_s``
    (the evidence was given: the prefill answered /health again on its ports, or the
    operator's release was accepted), ``release_s`` (the decode counter ``release_metric``
    moved: V2's pages released; None: not within the bound). ``hold_deltas``: the decode's
    pdsafe quarantine counters (``CRASH_METRICS``) over the hold window, from the kill until
    the evidence; ``release_deltas``: upstream's deferred releases by outcome over the run;
    ``evidence_deltas``: the pdsafe counters from the evidence to the end."""

    v2_room: int
    evidence: str = ""
    evidence_detail: str = ""
    v2_decode_status: int = 0
    v2_decode_error: str = ""
    v2_answer_s: float | None = None
    release_metric: str = INCARNATION_METRIC
    hold_s: float = 0.0
    evidence_s: float | None = None
    release_s: float | None = None
    hold_deltas: dict[str, float] = field(default_factory=dict)
    #: The decode's quarantined transfers (gauge) just before the evidence.
    quarantined_before_evidence: float = 0.0
    evidence_deltas: dict[str, float] = field(default_factory=dict)
    release_deltas: dict[str, float] = field(default_factory=dict)
    b2_status: int = 0
    b2_identical: bool = False
    b2_refusals: list[str] = field(default_factory=list)
    decode_alive: bool = False
    other_prefill_alive: bool = False
    killed: str = ""
    v2_result: GenResult | None = None
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def released_before_evidence(self) -> bool:
        """The pages were released before the evidence was given (a fail-open release)."""
        return self.release_s is not None and (self.evidence_s is None
                                               or self.release_s < self.evidence_s)

    def to_json(self) -> dict[str, Any]:
        """The observation without the raw answers."""
        skip = {"v2_result", "attempts"}
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in skip}
        out["released_before_evidence"] = self.released_before_evidence
        out["b2_attempts"] = [(a.room, a.decode.status, a.decode.timed_out)
                              for a in self.attempts]
        return out


#: The evidence a crash run gives once the hold window passed: restart the killed prefill on
#: its ports (a new process incarnation), or an operator's release of its pages. Each takes
#: the stack and the killed prefill and returns what it did (the observation's detail).
Evidence = Callable[[Trio, SGLangServer], str]


def restart_prefill(trio: Trio, killed: SGLangServer) -> str:
    """Evidence: start the killed prefill again on the same HTTP and bootstrap ports (its new
    process registers with a new incarnation); returns once it answers /health."""
    restart_server(killed)
    return f"restarted on ports {sorted(killed.ports)} (log {killed.process.log_path.name})"


def writer_address(prefill: SGLangServer) -> str:
    """The writer address a decode knows ``prefill`` by (its bootstrap address)."""
    return f"127.0.0.1:{prefill.bootstrap_port}"


def operator_release(trio: Trio, killed: SGLangServer) -> str:
    """Evidence: the operator's ``POST /pdsafe/quarantine/release`` on the decode, naming the
    killed prefill. Raises ``AssertionError`` unless the decode accepted it (HTTP 200)."""
    r = requests.post(trio.decode.url + "/pdsafe/quarantine/release",
                      json={"writer": writer_address(killed)}, timeout=30)
    assert r.status_code == 200, f"the decode refused the operator's release: {r.status_code} " \
                                 f"{r.text[:300]}"
    return f"POST /pdsafe/quarantine/release -> {r.status_code} {r.text[:200]}"


def _counters(url: str) -> dict[str, float]:
    samples = scrape(url)
    return {m: sum_samples(samples, "sglang:pdsafe_" + m) for m in CRASH_METRICS}


def run_crash(trio: Trio, v2_ids: list[int], b2_ids: list[int], *,
              expected: Callable[[list[int], int], list[int] | None], v2_room: int,
              b2_room: int, evidence: Evidence, victim_via: SGLangServer | None = None,
              release_metric: str = INCARNATION_METRIC, hold_s: float = HOLD_WINDOW_S,
              release_bound_s: float = CRASH_BOUND_S, v_timeout_s: float = CRASH_BOUND_S + 60,
              b_timeout_s: float = 300.0, b_retry_s: float = 30.0) -> CrashObservation:
    """V2 held in its prefill's transfer worker, that prefill SIGKILLed, the evidence, B2.

    ``v2_room`` must be a late room, ``b2_room`` a traced one. After V2's decode answer, the
    hold window: ``hold_s`` seconds in which the decode counters are watched (nothing may
    release V2's pages on the fork: the heartbeat only alarms, the incarnation probe finds
    nobody); then ``evidence(trio, killed)`` (:func:`restart_prefill`, :func:`operator_release`),
    then up to ``release_bound_s`` for the decode counter ``release_metric`` to move (V2's pages
    released; watched from the kill on), then B2 through the surviving prefill (retried on a
    fresh traced room while it fails, for up to ``b_retry_s``). The killed prefill
    (``victim_via``, default ``trio.held``) is dead afterwards unless the evidence restarted it.
    """
    vp = victim_via or trio.held
    bp = trio.other if vp is trio.held else trio.held
    name = getattr(evidence, "__name__", str(evidence))
    obs = CrashObservation(v2_room, evidence=name, release_metric=release_metric)
    obs.killed = next(r for r, s in trio.servers().items() if s is vp)
    want = expected(b2_ids, B_NEW)
    rel0 = metric_total(trio.decode.url, release_metric)
    c0 = _counters(trio.decode.url)
    out0 = release_outcomes(trio.decode.url)
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": vp.bootstrap_port,
            "bootstrap_room": obs.v2_room}
    rid = f"crash-victim-{uuid.uuid4().hex}"

    def v2_leg(url: str) -> GenResult:
        return bounded_generate(url, v2_ids, V_NEW, timeout=v_timeout_s, rid=rid, **boot)

    def watch_release(t_kill: float) -> bool:
        if obs.release_s is None and metric_total(trio.decode.url, release_metric) > rel0:
            obs.release_s = time.monotonic() - t_kill
        return obs.release_s is not None

    with ThreadPoolExecutor(2) as ex:
        ex.submit(v2_leg, vp.url)
        fd: Future[GenResult] = ex.submit(v2_leg, trio.decode.url)
        wait_for("the prefill to hold V2's write", lambda: event(vp, obs.v2_room, "held"), 90)
        t_kill = time.monotonic()
        vp.process.kill()
        rd = fd.result(timeout=v_timeout_s + 30)
    obs.v2_result = rd
    obs.v2_answer_s = time.monotonic() - t_kill
    obs.v2_decode_status = rd.status
    obs.v2_decode_error = "" if rd.ok else rd.error_message
    # The hold window: nothing may release V2's pages before the evidence.
    window_end = time.monotonic() + hold_s
    while time.monotonic() < window_end:
        watch_release(t_kill)
        time.sleep(0.5)
    watch_release(t_kill)
    c1 = _counters(trio.decode.url)
    obs.hold_s = time.monotonic() - t_kill
    obs.hold_deltas = {m: c1[m] - c0[m] for m in CRASH_METRICS}
    obs.quarantined_before_evidence = metric_total(trio.decode.url,
                                                   "sglang:pdsafe_quarantined_transfers")
    obs.evidence_detail = evidence(trio, vp)
    obs.evidence_s = time.monotonic() - t_kill
    try:
        wait_for("the decode to release V2's pages", lambda: watch_release(t_kill),
                 release_bound_s, step=0.5)
    except AssertionError:
        pass
    room = b2_room
    deadline = time.monotonic() + b_retry_s
    while True:
        att = _try(bp, trio.decode, b2_ids, room, b_timeout_s)
        obs.attempts.append(att)
        rb = att.decode
        if rb.ok or rb.timed_out or time.monotonic() > deadline:
            break
        obs.b2_refusals.append(f"HTTP {rb.status}: {rb.error_message[:160]}")
        room = next_traced_room(room)
        time.sleep(0.5)
    obs.b2_status = rb.status
    obs.b2_identical = rb.ok and want is not None and rb.output_ids == want
    c2 = _counters(trio.decode.url)
    obs.evidence_deltas = {m: c2[m] - c1[m] for m in CRASH_METRICS}
    out1 = release_outcomes(trio.decode.url)
    obs.release_deltas = {o: out1[o] - out0[o] for o in RELEASE_OUTCOMES}
    obs.decode_alive = trio.decode.process.alive()
    obs.other_prefill_alive = bp.process.alive()
    return obs


def random_rooms(rng: random.Random) -> tuple[int, int]:
    """(a late room, a traced room) drawn from ``rng``, in that order."""
    return late_room(rng.randrange(ROOM_RANGE_WIDTH)), traced_room(rng.randrange(ROOM_RANGE_WIDTH))
