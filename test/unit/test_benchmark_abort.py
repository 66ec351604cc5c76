"""The benchmark's abort family without sglang: registry, judging rules, and each choreography
driven end to end against a fake PD pair.

The real proof is a benchmark run on the CPU harness (docs/benchmark.md). These tests pin what
can go wrong in the benchmark itself: the five scenarios are registered as designed (deployment
mode only for the ones without a server-side fault, the late_write stack's crash scenario still
last, the abort scenarios before the one that kills a stock decode), the default stack arms the
``park_commit`` fault the after-transfer scenario needs, a leg left without an answer makes the
request a hang, a client cut really closes the connection, and each scenario reaches its phase
(the fake servers hold an attack request's legs until ``/abort_request`` names its rid, as a PD
queue would) and judges every request: against a pair that tells the peer, every aborted
request is an explicit error and every other one identical; against a pair that leaves the
late leg waiting, the scenario reports a hang; against a pair that hands an aborted request's
KV to the next request, a leak naming the aborted request.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from types import SimpleNamespace
from typing import Any

import pytest
from pdsafe_testkit.faults import PARK_LOG, PARK_PREFIX, parse_park_commit, parse_spec

from benchmark.canary import CanaryBook
from benchmark.outcomes import Answer, Outcome, classify
from benchmark.scenarios import (
    SCENARIOS,
    Ctx,
    Job,
    Knobs,
    Reference,
    ScenarioNotAsDesigned,
    _cut_stream,
    _legs_answer,
    abort_after_transfer_before_commit,
    abort_bootstrap,
    abort_during_decode,
    abort_prealloc,
    applicable,
    pd_load,
)
from benchmark.targets import PARK_COMMIT_S, STACK_KINDS, PDTarget

from ._fake_http import FakeServers, JsonHandler, answer_of

NAMES = ("abort-bootstrap", "abort-prealloc", "abort-mid-transfer",
         "abort-after-transfer-before-commit", "abort-during-decode")


def test_registered_as_designed() -> None:
    for name in NAMES:
        s = SCENARIOS[name]
        assert s.implemented and s.family == "abort" and s.harness_ok, name
        assert applicable(s, deployment=False) == (True, ""), name
    # Deployment mode: only what any client can do (no server-side fault, no special stack).
    deploy = {n for n in NAMES if applicable(SCENARIOS[n], deployment=True)[0]}
    assert deploy == {"abort-bootstrap", "abort-prealloc", "abort-during-decode"}
    assert SCENARIOS["abort-mid-transfer"].stack == "late_write"
    assert not SCENARIOS["abort-mid-transfer"].in_quick  # its stack is full-matrix only
    assert {SCENARIOS[n].stack for n in NAMES} - {"late_write"} == {"default"}
    quick = [n for n in NAMES if SCENARIOS[n].in_quick]
    assert 1 <= len(quick) <= 2, quick  # --quick's 10-minute budget (docs/benchmark.md)
    order = list(SCENARIOS)
    on_default = [n for n in order if SCENARIOS[n].stack == "default"]
    for name in NAMES:
        if SCENARIOS[name].stack == "default":  # before the scenario that kills a stock decode
            assert on_default.index(name) < on_default.index("room-duplicate-concurrent"), name
    on_late = [n for n in order if SCENARIOS[n].stack == "late_write"]
    assert on_late[-1] == "crash-prefill-mid-transfer"


@pytest.mark.parametrize("name", NAMES)
def test_docstrings_say_phase_leak_and_gap(name: str) -> None:
    doc = SCENARIOS[name].doc
    assert "leak" in doc.lower() and "upstream-gaps" in doc, name
    assert "abort" in doc.lower() or "disconnect" in doc.lower(), name


def test_default_stack_arms_park_commit_beside_kv_corrupt() -> None:
    spec = STACK_KINDS["default"].decode_faults
    assert set(parse_spec(spec)) == {"kv_corrupt", "park_commit"}
    assert parse_park_commit(spec) == PARK_COMMIT_S
    # The control request waits the park out: well inside the quick hang bound.
    assert 0 < PARK_COMMIT_S < Knobs.for_mode(True).bound_s / 2


def test_a_leg_left_waiting_is_a_hang() -> None:
    job = Job("j", "pd-direct", [1], 1, lambda: Answer(status=None))
    told = Answer(status=500, message="Aborted by AbortReq.")
    waiting = Answer(status=None, timed_out=True, e2e_s=20.0)
    ans = _legs_answer(job, told, waiting)
    assert classify(ans, [1])[0] is Outcome.HANG and "prefill leg" in job.side["note"]
    assert job.side["prefill"] == (None, "", True)
    job2 = Job("j", "pd-direct", [1], 1, lambda: Answer(status=None))
    ok = Answer(status=200, output_ids=[1])
    assert _legs_answer(job2, ok, Answer(status=500, message="aborted")) is ok
    assert _legs_answer(job2, told, None) is told
    assert classify(_legs_answer(job2, waiting, told), [1])[0] is Outcome.HANG


# ----------------------------------------------------------------------------- the fake PD pair


@dataclass
class World:
    """State shared by the fake prefill, decode and router.

    ``tell_peer``: an abort on one leg fails the other leg too (else a late leg waits until the
    client gives up); ``leak``: the first normal request after an abort answers with the
    aborted request's tokens."""

    tell_peer: bool = True
    leak: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: (role, rid) of every aborted leg (both roles when the peer is told).
    aborted: set[tuple[str, str]] = field(default_factory=set)
    events: dict[tuple[str, str], threading.Event] = field(default_factory=dict)
    #: canary prompt by rid prefix (label), for the leak mode
    prompts: dict[str, list[int]] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    running: int = 0
    commits: int = 0
    sends: int = 0
    cut: int = 0
    log: list[str] = field(default_factory=list)
    leak_from: list[int] | None = None
    abort_calls: list[tuple[str, str]] = field(default_factory=list)

    def park_log(self, event: str, rid: str, poll: str, after: float) -> None:
        self.log.append(f"{PARK_LOG} {event}: rid {rid}, poll {poll}, after {after:.3f} s, "
                        f"at {time.time():.3f}; fake")

    def event(self, role: str, rid: str) -> threading.Event:
        with self.lock:
            return self.events.setdefault((role, rid), threading.Event())

    def abort(self, role: str, rid: str | None) -> None:
        with self.lock:
            rids = [r for (ro, r) in self.events if ro == role] if rid is None else [rid]
            self.abort_calls.append((role, rid or "ALL"))
        for r in rids:
            for ro in (("prefill", "decode") if self.tell_peer else (role,)):
                self.aborted.add((ro, r))
                self.event(ro, r).set()

    def is_aborted(self, role: str, rid: str) -> bool:
        return (role, rid) in self.aborted


def _handler(world: World, role: str) -> type[BaseHTTPRequestHandler]:
    class H(JsonHandler):
        def do_GET(self) -> None:
            if self.path.startswith("/v1/loads"):
                n = world.waiting.get(role, 0)
                self._json(200, {"loads": [{
                    "num_running_reqs": world.running if role == "decode" else 0,
                    "num_used_tokens": 0,
                    "disaggregation": {"prefill_bootstrap_queue_reqs": n if role == "prefill"
                                       else 0,
                                       "decode_prealloc_queue_reqs": n if role == "decode"
                                       else 0,
                                       "decode_transfer_queue_reqs": n if role == "decode"
                                       else 0}}]})
            elif self.path.startswith("/server_info"):
                self._server_info(1024)
            elif self.path.startswith("/model_info"):
                self._json(200, {})
            elif self.path.startswith("/metrics"):
                text = (f'sglang:per_stage_req_latency_seconds_count{{stage="decode_transferred"}}'
                        f" {world.commits}\nsglang:kv_transfer_total_mb_count {world.sends}\n")
                self._text(200, text)
            else:
                self._json(404, {})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/abort_request":
                world.abort(role, None if body.get("abort_all") else body["rid"])
                self._json(200, {})
                return
            rid = str(body.get("rid") or "")
            prompt = list(body["input_ids"])
            n = int(body["sampling_params"]["max_new_tokens"])
            if world.is_aborted(role, rid):
                self._json(500, {"error": {"message": "Aborted by AbortReq."}})
                return
            if body.get("stream"):
                self._stream(prompt, n)
                return
            if rid.startswith(PARK_PREFIX) and role == "decode":
                if self._park(rid):
                    return
            elif rid.startswith("abort-") and not rid.startswith("abort-cut"):
                if self._hold(rid):
                    return
            if n >= 500 and role != "prefill":
                with world.lock:
                    world.running += 1
                time.sleep(1.0)
                with world.lock:
                    world.running -= 1
            with world.lock:
                world.commits += role in ("decode", "router")
                world.sends += role in ("prefill", "router")
                leak, world.leak_from = world.leak_from, None
            out = answer_of(prompt, n)
            if leak is not None and role != "prefill":
                out = answer_of(leak, n)
            self._json(200, {"output_ids": out if role != "prefill" else out[:1],
                             "meta_info": {"finish_reason": {"type": "length"}}})

        def _hold(self, rid: str) -> bool:
            """An attack leg waits in its PD queue until aborted (10 s at most)."""
            ev = world.event(role, rid)
            with world.lock:
                world.waiting[role] += 1
            try:
                aborted = ev.wait(10.0)
            finally:
                with world.lock:
                    world.waiting[role] -= 1
            if aborted:
                if world.leak:
                    world.leak_from = self._prompt_of(rid)
                self._json(500, {"error": {"message": "Aborted by AbortReq."}})
                return True
            return False

        def _park(self, rid: str) -> bool:
            t0 = time.monotonic()
            world.park_log("parked", rid, "Success", 0.0)
            if "control" in rid:
                time.sleep(0.3)
                world.park_log("released", rid, "Success", time.monotonic() - t0)
                return False
            world.event("decode", rid).wait(10.0)
            world.park_log("left", rid, "Failed", time.monotonic() - t0)
            self._json(500, {"error": {"message": "Aborted by AbortReq."}})
            return True

        def _prompt_of(self, rid: str) -> list[int] | None:
            return world.prompts.get(rid.rsplit("-", 1)[0])

        def _stream(self, prompt: list[int], n: int) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            with world.lock:
                world.commits += role in ("decode", "router")
                world.sends += role in ("prefill", "router")
                world.running += role != "prefill"
            out = answer_of(prompt, n if role != "prefill" else 1)
            try:
                for k in range(1, len(out) + 1):
                    chunk = {"output_ids": out[:k], "meta_info": {}}
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    self.wfile.flush()
                    time.sleep(0.01)
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                with world.lock:
                    world.cut += 1
            finally:
                with world.lock:
                    world.running -= role != "prefill"
            self.close_connection = True

    return H


class FakePair:
    """A fake prefill, decode and router on loopback ports, and a target/context on them."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.http = FakeServers({r: _handler(world, r) for r in ("prefill", "decode", "router")})

    def url(self, role: str) -> str:
        return self.http.url(role)

    def ctx(self, bound_s: float = 5.0) -> Ctx:
        log = SimpleNamespace(log_text=lambda: "\n".join(self.world.log))
        stack = SimpleNamespace(decode=SimpleNamespace(process=log))
        t = PDTarget("fork", "mooncake", 1, "default", self.url("prefill"), self.url("decode"),
                     self.url("router"), "127.0.0.1", 1, {}, CanaryBook(512),
                     stack)  # type: ignore[arg-type]
        ref = Reference("http://unused")
        ref.expected = lambda prompt, n: answer_of(list(prompt), n)  # type: ignore[method-assign]
        knobs = Knobs.for_mode(True, bound_s=bound_s, evidence_wait_s=0.0)
        ctx = Ctx(t, ref, knobs, random.Random(0))
        # The fake's "leak" mode needs each attack's prompt by rid: record the canary book's.
        real_canary = ctx.canary

        def canary(label: str, length: int) -> tuple[int, list[int]]:
            owner, p = real_canary(label, length)
            for rid_prefix in (label, f"{PARK_PREFIX}{label}"):
                self.world.prompts[rid_prefix] = p
            return owner, p

        ctx.canary = canary  # type: ignore[method-assign]
        return ctx

    def close(self) -> None:
        self.http.close()


@pytest.fixture
def pair():
    made: list[FakePair] = []

    def make(**kw: Any) -> FakePair:
        p = FakePair(World(**kw))
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def _outcomes(ctx: Ctx, prefix: str) -> list[Outcome]:
    return [r.outcome for r in ctx.records if r.label.startswith(prefix)]


def _rest_identical(ctx: Ctx, *attack_prefixes: str) -> None:
    rest = [r for r in ctx.records if not r.label.startswith(attack_prefixes)]
    assert rest and all(r.outcome is Outcome.IDENTICAL for r in rest), \
        [(r.label, r.outcome, r.detail) for r in rest if r.outcome is not Outcome.IDENTICAL]


def test_pd_load_reads_the_queues(pair) -> None:
    p = pair()
    load = pd_load(p.url("decode"))
    assert load["decode_transfer_queue_reqs"] == 0 and load["num_running_reqs"] == 0
    assert pd_load("http://127.0.0.1:9") == {}


def test_cut_stream_closes_the_connection(pair) -> None:
    p = pair()
    body = {"input_ids": list(range(1, 20)), "stream": True,
            "sampling_params": {"max_new_tokens": 200}}
    ans, cut = _cut_stream(p.url("decode"), body, 5.0, after_tokens=4)
    assert cut and ans.status == 200 and ans.output_ids == answer_of(list(range(1, 20)), 4)
    deadline = time.monotonic() + 5
    while p.world.cut == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.world.cut == 1, "the server never saw the client go away"
    short = dict(body, sampling_params={"max_new_tokens": 2})
    ans, cut = _cut_stream(p.url("decode"), short, 5.0, after_tokens=4)
    assert not cut and ans.output_ids == answer_of(list(range(1, 20)), 2)
    # Cut when the caller says so (abort-prealloc's holders), however many tokens came.
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    ans, cut = _cut_stream(p.url("decode"), body, 5.0, stop=stop)
    assert cut and 5 <= len(ans.output_ids) < 200
    # A stream longer than its total bound is a hang, even while tokens keep coming.
    ans, cut = _cut_stream(p.url("decode"), body, 5.0, total_s=0.3)
    assert ans.timed_out and not cut


def test_abort_bootstrap_reaches_both_orders_and_judges_every_request(pair) -> None:
    p = pair()
    ctx = p.ctx()
    abort_bootstrap(ctx)
    assert _outcomes(ctx, "abort-boot-") == [Outcome.EXPLICIT_ERROR] * 2
    _rest_identical(ctx, "abort-boot-")
    assert [r for r, _ in p.world.abort_calls] == ["prefill", "decode"]
    assert sum("sat in" in n for n in ctx.notes) == 2, ctx.notes


def test_abort_bootstrap_sees_a_late_leg_left_waiting(pair) -> None:
    p = pair(tell_peer=False)
    ctx = p.ctx(bound_s=1.5)
    abort_bootstrap(ctx)
    assert _outcomes(ctx, "abort-boot-") == [Outcome.HANG] * 2


def test_abort_bootstrap_names_the_aborted_request_in_a_leak(pair) -> None:
    p = pair(leak=True)
    ctx = p.ctx()
    abort_bootstrap(ctx)
    leaks = [r for r in ctx.records if r.outcome is Outcome.LEAK]
    assert leaks and all(r.leaked_from and r.leaked_from[0].startswith("abort-boot-")
                         for r in leaks), [(r.label, r.attribution) for r in leaks]


def test_abort_prealloc_holds_the_pool_and_aborts_in_the_queue(pair) -> None:
    p = pair()
    ctx = p.ctx()
    abort_prealloc(ctx)
    assert _outcomes(ctx, "abort-prealloc-") == [Outcome.EXPLICIT_ERROR] * 2
    assert _outcomes(ctx, "prealloc-holder-") == [Outcome.IDENTICAL]
    holder = next(r for r in ctx.records if r.label.startswith("prealloc-holder-"))
    # How many tokens arrived before the cut depends on timing (a loaded box sends fewer).
    assert "the client cut the stream" in holder.detail and 0 < holder.max_new_tokens <= 32
    _rest_identical(ctx, "abort-prealloc-")
    # decode for both, the prefill too for every other one
    assert [r for r, _ in p.world.abort_calls] == ["decode", "decode", "prefill"]
    assert any("2 of 2 attack requests seen" in n and "still streaming when every aborted "
               "request had answered: True" in n for n in ctx.notes), ctx.notes


def test_abort_after_transfer_before_commit_aborts_parked_requests(pair) -> None:
    p = pair()
    ctx = p.ctx()
    abort_after_transfer_before_commit(ctx)
    assert _outcomes(ctx, "abort-parked-") == [Outcome.EXPLICIT_ERROR] * 2
    assert _outcomes(ctx, "parked-control") == [Outcome.IDENTICAL]
    _rest_identical(ctx, "abort-parked-")
    assert any("left with poll Failed" in n and "parked-control: released" in n
               for n in ctx.notes), ctx.notes


def test_abort_after_transfer_needs_the_park_to_be_reached(pair, monkeypatch) -> None:
    p = pair()
    ctx = p.ctx(bound_s=1.5)
    monkeypatch.setattr(p.world, "park_log", lambda *a: None)  # the fault never logs a park
    with pytest.raises(ScenarioNotAsDesigned):
        abort_after_transfer_before_commit(ctx)


def test_abort_during_decode_cuts_streams_and_judges_the_prefix(pair) -> None:
    p = pair()
    ctx = p.ctx()
    abort_during_decode(ctx)
    cut = [r for r in ctx.records if r.label.startswith("abort-cut-")]
    assert [r.outcome for r in cut] == [Outcome.IDENTICAL] * 2
    assert all(r.max_new_tokens == 4 and "cut the stream after 4" in r.detail for r in cut)
    assert {r.path for r in cut} == {"router-stream (client cut)", "pd-direct-stream (client cut)"}
    _rest_identical(ctx, "abort-cut-")
    deadline = time.monotonic() + 5
    while p.world.cut < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.world.cut == 2
