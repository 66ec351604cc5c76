"""The ``concurrent-trace`` scenario's trace, without servers: what it sends and how its records
are named. The trace itself runs against the shared PD pair in
test/pd/test_concurrent_trace.py and against stock and fork in the benchmark."""

from __future__ import annotations

import random
from typing import Any

from benchmark import scenarios
from benchmark.canary import CanaryBook
from benchmark.outcomes import Answer
from benchmark.scenarios import (
    SCENARIOS,
    TRACE_MIX,
    TRACE_MUST_SERVE,
    Ctx,
    Knobs,
    Reference,
    _trace_jobs,
    trace_kind,
)
from benchmark.targets import PDTarget

LIMIT = 200


def _ctx(seed: int = 7, requests: int = 40) -> Ctx:
    t = PDTarget("fork", "mooncake", 1, "default", "http://p", "http://d", "http://r",
                 "127.0.0.1", 8998, {}, CanaryBook(512))
    knobs = Knobs.for_mode(False, trace_requests=requests, trace_window_s=10.0)
    return Ctx(t, Reference("http://unused"), knobs, random.Random(seed))


def test_registered_for_every_mode_but_quick() -> None:
    s = SCENARIOS["concurrent-trace"]
    assert s.implemented and s.deployment_ok and s.known_unsafe_upstream and not s.in_quick
    assert s.stack == "default"
    assert set(TRACE_MUST_SERVE) < {k for k, _ in TRACE_MIX}


def test_every_kind_is_sent_and_labelled() -> None:
    jobs = _trace_jobs(_ctx(), LIMIT)
    kinds = [j.side["kind"] for j in jobs]
    assert set(kinds) == {k for k, _ in TRACE_MIX}
    for j in jobs:
        assert trace_kind(j.label) == j.side["kind"], j.label
        assert 0.0 <= j.side["offset_s"] <= 10.0 + 0.05, j.side
        if j.side["kind"] == "over-limit":
            assert len(j.prompt) > LIMIT, len(j.prompt)
        else:
            assert len(j.prompt) <= LIMIT - 1, (j.label, len(j.prompt))
    reuse = [j for j in jobs if j.side["kind"] == "room-reuse"]
    assert reuse and len(reuse) % 2 == 0
    assert all(j.path == "pd-direct" for j in reuse)
    parallel = [j for j in jobs if j.side["kind"] == "parallel"]
    assert parallel and all(j.side["n"] in (2, 3) for j in parallel)


def test_the_trace_is_seeded() -> None:
    a = [(j.label, j.prompt, j.side["offset_s"]) for j in _trace_jobs(_ctx(3), LIMIT)]
    b = [(j.label, j.prompt, j.side["offset_s"]) for j in _trace_jobs(_ctx(3), LIMIT)]
    c = [(j.label, j.prompt, j.side["offset_s"]) for j in _trace_jobs(_ctx(4), LIMIT)]
    assert a == b and a != c


def test_shared_prefix_requests_share_a_prefix_with_another() -> None:
    jobs = [j for j in _trace_jobs(_ctx(requests=80), LIMIT) if j.side["kind"] == "shared-prefix"]
    heads = [tuple(j.prompt[:32]) for j in jobs]
    assert len(set(heads)) < len(heads), "no two shared-prefix prompts share a prefix"


def test_decode_only_and_room_reuse_bodies(monkeypatch) -> None:
    sent: list[tuple[str, dict[str, Any]]] = []

    def send(url: str, body: dict[str, Any], **_: Any) -> Answer:
        sent.append((url, body))
        return Answer(status=400, message="refused")

    monkeypatch.setattr(scenarios.client, "send", send)
    monkeypatch.setattr(scenarios.time, "sleep", lambda s: None)
    jobs = _trace_jobs(_ctx(), LIMIT)
    only = next(j for j in jobs if j.side["kind"] == "decode-only")
    only.call()
    url, body = sent[-1]
    assert url == "http://d" and body["bootstrap_port"] == 8998
    assert body["bootstrap_host"] == "127.0.0.1" and isinstance(body["bootstrap_room"], int)

    rooms = []

    def direct_pd(p: str, d: str, body: dict[str, Any], **kw: Any) -> tuple[Answer, Answer]:
        rooms.append(kw["room"])
        return Answer(status=409, message="x"), Answer(status=409, message="x")

    monkeypatch.setattr(scenarios.client, "direct_pd", direct_pd)
    a, b = [j for j in jobs if j.side["kind"] == "room-reuse"][:2]
    a.call()
    b.call()
    assert rooms[0] == rooms[1] and isinstance(rooms[0], int)


def test_trace_kind() -> None:
    assert trace_kind("trace-7-parallel#1") == "parallel"
    assert trace_kind("trace-3-room-reuse-b") == "room-reuse"
    assert trace_kind("trace-12-shared-prefix") == "shared-prefix"
    assert trace_kind("trace-prefix-0") == ""
    assert trace_kind("after-3") == ""
