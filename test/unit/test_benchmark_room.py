"""The benchmark's parallel-sampling scenario (``room-n-greater-1``) without sglang: how a list
answer (``n>1``) is parsed and judged, and the scenario driven against a fake PD pair.

A 200 answer to ``n>1`` is a list of ``n`` samples; every sample must be judged against the
reference's single greedy answer (temperature 0). These tests pin that a list answer is never
taken for one answer (a differing sample hidden behind an identical first one would hide a
leak), that a missing sample is not silently dropped, that an error or a refusal stays one
answer for the request, and that the scenario, against a pair that refuses ``n>1`` (the fork),
answers every sample (upstream when it works), or decodes a sample over another request's KV,
reports explicit errors, identical samples, or a leak naming that request.
"""

from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from benchmark import client
from benchmark.canary import CanaryBook
from benchmark.outcomes import Answer, Outcome, classify, count, per_sample
from benchmark.scenarios import (
    N_SAMPLES,
    SCENARIOS,
    SMOKE_SCENARIOS,
    Ctx,
    Knobs,
    Reference,
    applicable,
    room_n_greater_1,
)
from benchmark.targets import PDTarget

from ._fake_http import FakeServers, JsonHandler, answer_of

REF = [10, 11, 12, 13]


def _ok(ids: list[int]) -> dict[str, Any]:
    return {"output_ids": ids, "meta_info": {"finish_reason": {"type": "length"}}}


# ----------------------------------------------------------------------------- client + outcomes


def test_payload_asks_n_inside_sampling_params() -> None:
    body = client.greedy_payload([1, 2], 4, n=3)
    assert body["sampling_params"]["n"] == 3 and "n" not in body
    assert "n" not in client.greedy_payload([1, 2], 4)["sampling_params"]
    with pytest.raises(ValueError, match="parallel sampling"):
        client.send("http://127.0.0.1:9", client.greedy_payload([1], 1, n=2, stream=True),
                    bound_s=1)


def test_a_200_list_is_parsed_sample_by_sample() -> None:
    a = client.parse_answer(200, [_ok(REF), _ok([1, 2]),
                                  {"meta_info": {"finish_reason": {"type": "abort",
                                                                   "message": "gone"}}}])
    assert a.status == 200 and a.output_ids == [] and a.samples is not None
    assert [s.output_ids for s in a.samples[:2]] == [REF, [1, 2]]
    assert a.samples[2].in_band_abort and a.samples[2].message == "gone"
    assert client.parse_answer(200, _ok(REF)).samples is None
    refused = client.parse_answer(400, {"error": {"message": "n=2 (parallel sampling) ..."}})
    assert refused.samples is None and refused.status == 400


def test_per_sample_splits_pads_and_keeps_errors_whole() -> None:
    lst = Answer(status=200, samples=[Answer(status=200, output_ids=list(REF))] * 2, e2e_s=1.0)
    assert [classify(s, REF)[0] for s in per_sample(lst, 2)] == [Outcome.IDENTICAL] * 2
    padded = per_sample(lst, 4)
    assert len(padded) == 4
    assert [classify(s, REF)[0] for s in padded[2:]] == [Outcome.BROKEN] * 2
    assert "sample 3 of the 4" in classify(padded[2], REF)[1]
    # A single 200 where n samples were asked: the others missing.
    single = Answer(status=200, output_ids=list(REF))
    assert [classify(s, REF)[0] for s in per_sample(single, 3)] == [
        Outcome.IDENTICAL, Outcome.BROKEN, Outcome.BROKEN]
    assert per_sample(single) == [single]
    for whole in (Answer(status=400, message="n>1 refused"), Answer(status=None, timed_out=True),
                  Answer(status=200, in_band_abort=True, message="aborted")):
        assert per_sample(whole, 3) == [whole]


@pytest.mark.parametrize(("samples", "outcome", "where"), [
    ([REF, REF, REF], Outcome.IDENTICAL, ""),
    ([REF, [10, 11, 99, 13], REF], Outcome.LEAK, "sample 2 of 3"),
    ([REF, []], Outcome.LEAK, "sample 2 of 2"),
    ([[], REF], Outcome.LEAK, "sample 1 of 2"),
    ([], Outcome.LEAK, "empty list"),
])
def test_classify_judges_every_sample_of_an_unsplit_list(samples: list[list[int]],
                                                          outcome: Outcome, where: str) -> None:
    a = Answer(status=200, samples=[Answer(status=200, output_ids=list(s)) for s in samples])
    got, detail = classify(a, REF)
    assert got is outcome and where in detail, (got, detail)


def test_classify_list_worst_sample_wins_and_never_identical_when_one_differs() -> None:
    rng = random.Random(2)
    for _ in range(100):
        outs = [list(REF) if rng.random() < 0.7 else [rng.randrange(4, 20) for _ in REF]
                for _ in range(rng.randint(1, 4))]
        a = Answer(status=200, samples=[Answer(status=200, output_ids=o) for o in outs])
        got, _ = classify(a, REF)
        assert got is (Outcome.IDENTICAL if all(o == REF for o in outs) else Outcome.LEAK)
    aborted = Answer(status=200, samples=[Answer(status=200, output_ids=list(REF)),
                                          Answer(status=200, in_band_abort=True, message="x")])
    assert classify(aborted, REF)[0] is Outcome.EXPLICIT_ERROR


# ----------------------------------------------------------------------------- the fake PD pair


@dataclass
class World:
    """How the fake decode (and router) answers ``n>1``: ``refuse`` (400, the fork), ``serve``
    (a list of ``n`` greedy samples), ``collide`` (the last sample decoded over the previous
    single request's prompt: a shared room's pages), ``short`` (one sample missing)."""

    mode: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_prompt: list[int] | None = None
    commits: int = 0
    sends: int = 0
    asked: list[int] = field(default_factory=list)


def _handler(world: World, role: str) -> type[BaseHTTPRequestHandler]:
    class H(JsonHandler):
        def do_GET(self) -> None:
            if self.path.startswith("/server_info"):
                self._server_info(1024)
            elif self.path.startswith("/metrics"):
                self._text(200, 'sglang:per_stage_req_latency_seconds_count'
                                f'{{stage="decode_transferred"}} {world.commits}\n'
                                f"sglang:kv_transfer_total_mb_count {world.sends}\n")
            else:
                self._json(200, {})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = list(body["input_ids"])
            sp = body["sampling_params"]
            n, k = int(sp["max_new_tokens"]), int(sp.get("n", 1))
            if k > 1 and world.mode == "refuse":
                self._json(400, {"error": {"message": f"n={k} (parallel sampling) is not "
                                                      f"supported by this PD server"}})
                return
            with world.lock:
                world.commits += k * (role in ("decode", "router"))
                world.sends += k * (role in ("prefill", "router"))
                other = world.last_prompt
                if k == 1 and role != "prefill":
                    world.last_prompt = prompt
                if k > 1 and role != "prefill":
                    world.asked.append(k)
            out = answer_of(prompt, n) if role != "prefill" else answer_of(prompt, 1)
            if k == 1:
                self._json(200, _ok(out))
                return
            samples = [list(out) for _ in range(k)]
            if world.mode == "collide" and other is not None:
                samples[-1] = answer_of(other, n)
            elif world.mode == "short":
                samples.pop()
            self._json(200, [_ok(s) for s in samples])

    return H


class FakePair:
    def __init__(self, mode: str) -> None:
        self.world = World(mode)
        self.http = FakeServers({r: _handler(self.world, r)
                                 for r in ("prefill", "decode", "router")})

    def url(self, role: str) -> str:
        return self.http.url(role)

    def ctx(self) -> Ctx:
        t = PDTarget("fork", "mooncake", 1, "default", self.url("prefill"), self.url("decode"),
                     self.url("router"), "127.0.0.1", 1, {}, CanaryBook(512))
        ref = Reference("http://unused")
        ref.expected = lambda prompt, n: answer_of(list(prompt), n)  # type: ignore[method-assign]
        return Ctx(t, ref, Knobs.for_mode(False, bound_s=5.0, evidence_wait_s=0.0),
                   random.Random(0))

    def close(self) -> None:
        self.http.close()


@pytest.fixture
def pair():
    made: list[FakePair] = []

    def make(mode: str) -> FakePair:
        made.append(FakePair(mode))
        return made[-1]

    yield make
    for p in made:
        p.close()


def _attacks(ctx: Ctx) -> list:
    return [r for r in ctx.records if r.phase == "parallel-sampling"
            and not r.label.startswith("during-")]


def _rest_identical(ctx: Ctx) -> None:
    rest = [r for r in ctx.records if r not in _attacks(ctx)]
    assert rest and all(r.outcome is Outcome.IDENTICAL for r in rest), \
        [(r.label, r.outcome, r.detail) for r in rest if r.outcome is not Outcome.IDENTICAL]


def test_registered_as_designed() -> None:
    s = SCENARIOS["room-n-greater-1"]
    assert s.implemented and s.family == "room" and s.stack == "default"
    assert applicable(s, deployment=True)[0]  # only what a client can send
    assert "leak" in s.doc.lower() and "upstream-gaps" in s.doc
    assert s.name not in SMOKE_SCENARIOS
    # may take a stock decode down: last on its stack
    assert [n for n, x in SCENARIOS.items() if x.stack == s.stack][-1] == s.name


def test_fork_refusal_is_one_explicit_error_per_request(pair) -> None:
    p = pair("refuse")
    ctx = p.ctx()
    room_n_greater_1(ctx)
    att = _attacks(ctx)
    assert len(att) == ctx.knobs.attacks
    assert all(r.outcome is Outcome.EXPLICIT_ERROR and "parallel sampling" in r.detail
               for r in att), [(r.label, r.detail) for r in att]
    assert {r.path for r in att} == {"router", "pd-direct"}
    _rest_identical(ctx)


def test_every_sample_of_a_served_request_is_judged(pair) -> None:
    p = pair("serve")
    ctx = p.ctx()
    room_n_greater_1(ctx)
    att = _attacks(ctx)
    asked = [N_SAMPLES[i % len(N_SAMPLES)] for i in range(ctx.knobs.attacks)]
    assert len(att) == sum(asked)  # one record per sample
    assert all(r.outcome is Outcome.IDENTICAL for r in att), [(r.label, r.detail) for r in att]
    assert {r.label for r in att} >= {f"n{asked[0]}-0#{i}" for i in range(asked[0])}
    _rest_identical(ctx)
    assert count(ctx.records)["sent"] == len(ctx.records)


def test_a_sample_over_another_requests_kv_is_a_leak_naming_it(pair) -> None:
    p = pair("collide")
    ctx = p.ctx()
    room_n_greater_1(ctx)
    leaks = [r for r in ctx.records if r.outcome is Outcome.LEAK]
    assert leaks and all("#" in r.label for r in leaks)
    assert all(r.leaked_from and not any(r.label.startswith(src) for src in r.leaked_from)
               for r in leaks), [(r.label, r.leaked_from) for r in leaks]
    assert any(src.startswith(("victim-", "during-")) for r in leaks for src in r.leaked_from)
    # Only the last sample of each request collided; the others are judged identical.
    assert all(r.outcome is Outcome.IDENTICAL for r in _attacks(ctx) if r not in leaks)


def test_a_missing_sample_is_broken_not_dropped(pair) -> None:
    p = pair("short")
    ctx = p.ctx()
    room_n_greater_1(ctx)
    att = _attacks(ctx)
    broken = [r for r in att if r.outcome is Outcome.BROKEN]
    assert len(broken) == ctx.knobs.attacks and all("missing" in r.detail for r in broken)
