"""The quarantine's incarnation probe (``sglang.pdsafe.quarantine_probe``): a decode asks a held
writer's bootstrap server which process is registered there, off the scheduler thread.

Against a real loopback HTTP server answering ``GET /route?...&pdsafe_pair=1`` as a prefill's
bootstrap server does, driven through ``quarantine.ready`` (the hook upstream's patched
``resolve_deferred_releases`` calls every pass) and through upstream's real
``resolve_deferred_releases`` itself:

* a hold is released only after the writer answers with another incarnation than the one its
  destinations went to; the same incarnation keeps holding (logged once), so does a writer
  that does not answer (counted), a writer that publishes no incarnation, and a writer whose
  holds know no incarnation (never probed);
* one probe in flight per writer, at most one pass per ``PASS_EVERY_S``, the state bounded;
* an older observation never overrides a newer one (a stale incarnation is no evidence);
* the interval setting is validated (a malformed one refuses the decode's start).

What this does not show: a real prefill restarting on its ports (``test/pd/test_late_write.py``
does, with real servers).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from sglang.pdsafe import metrics, pair_settings, quarantine, quarantine_probe
from sglang.pdsafe.pair_settings import PairSettings
from sglang.pdsafe.quarantine import Evidence, Quarantine

from ._fake_http import FakeServers, JsonHandler
from .test_quarantine import _decode_req, _defer, _manager, _queue, _run


class Bootstrap:
    """What the fake bootstrap server answers, and the probes it got."""

    def __init__(self) -> None:
        self.incarnation: str | None = "inc-1"
        self.status = 200
        self.pdsafe = True
        self.delay_s = 0.0
        self.requests: list[str] = []


def _handler(state: Bootstrap) -> type[JsonHandler]:
    class Route(JsonHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            state.requests.append(self.path)
            time.sleep(state.delay_s)
            if state.status != 200:
                self._json(state.status, {"error": "not registered yet"})
                return
            body: dict[str, Any] = {"attn_tp_size": 1, "page_size": 1}
            if state.pdsafe and "pdsafe_pair=1" in self.path:
                body["pdsafe_pair"] = {"wire_version": pair_settings.WIRE_VERSION,
                                       "incarnation": state.incarnation}
            self._json(200, body)

    return Route


@pytest.fixture
def boot() -> Iterator[tuple[Bootstrap, str]]:
    state = Bootstrap()
    servers = FakeServers({"b": _handler(state)})
    try:
        yield state, servers.url("b").removeprefix("http://")
    finally:
        servers.close()


@pytest.fixture(autouse=True)
def _fast_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(quarantine_probe.ENV_PROBE_S, "0.2")
    monkeypatch.setattr(quarantine_probe, "PASS_EVERY_S", 0.0)
    monkeypatch.delenv(quarantine.ENV_ENABLE, raising=False)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _held(writer: str, incarnation: str | None = "inc-1", *, gone: bool = True,
          key: int = 1) -> tuple[Any, Quarantine]:
    """A decode KV manager whose pairing saw ``incarnation`` at ``writer`` and which holds
    slot ``key`` of a transfer to it (its writer declared gone by the heartbeat)."""
    kv_mgr = SimpleNamespace()
    if incarnation is not None:
        pair_settings.remember(kv_mgr, writer, PairSettings(
            pair_settings.WIRE_VERSION, 1, None, None, None, None, incarnation=incarnation))
    q = quarantine.of(kv_mgr)
    q.hold(key, room=7, rid="victim", tokens=64, writer=writer, now=0.0, deadline=1e9)
    if gone:
        q.peer_gone(writer, time.time())
    return kv_mgr, q


def _ready(kv_mgr: Any, key: int = 1) -> bool:
    return quarantine.ready(kv_mgr, key, drained=False, now=1.0, deadline=1e9)


def _poll(pred: Callable[[], bool], seconds: float) -> bool:
    """True as soon as ``pred()`` is; False if it never was within ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def test_released_only_after_the_writer_registers_another_incarnation(boot, caplog):
    state, writer = boot
    kv_mgr, q = _held(writer)
    with caplog.at_level(logging.WARNING, logger="sglang.pdsafe.quarantine"):
        assert not _poll(lambda: _ready(kv_mgr), 1.5), "released while the same process lives"
        assert len(state.requests) >= 2, f"probed {len(state.requests)} times in 1.5 s"
        assert all("pdsafe_pair=1" in p and "prefill_dp_rank=-1" in p for p in state.requests)
        alive = [r for r in caplog.records if "same process incarnation inc-1" in r.message]
        assert len(alive) == 1, "the live writer is logged once"
        state.incarnation = "inc-2"  # the prefill restarted on the same address
        incs = metrics.value("quarantine_released_incarnation_total")
        assert _poll(lambda: _ready(kv_mgr), 6.0), "the new incarnation released nothing"
    quarantine.released(kv_mgr, 1, drained=False, now=2.0)
    assert metrics.value("quarantine_released_incarnation_total") == incs + 1
    assert q.tokens_held() == 0
    assert any("new process incarnation inc-2" in r.message for r in caplog.records)


def test_an_unreachable_writer_keeps_its_pages_held_and_is_counted(caplog):
    writer = f"127.0.0.1:{_closed_port()}"
    kv_mgr, q = _held(writer)
    failed = metrics.value(quarantine_probe.FAILED)
    with caplog.at_level(logging.WARNING, logger="sglang.pdsafe.quarantine"):
        assert not _poll(lambda: _ready(kv_mgr), 1.5)
    assert metrics.value(quarantine_probe.FAILED) >= failed + 2
    assert q.tokens_held() == 64
    misses = [r for r in caplog.records if "does not answer the incarnation probe" in r.message]
    assert len(misses) == 1, "a streak of misses is logged once"


def test_a_writer_not_registered_yet_or_without_an_incarnation_is_no_evidence(boot):
    state, writer = boot
    kv_mgr, q = _held(writer)
    state.status = 503  # a restarted prefill whose schedulers have not registered yet
    failed = metrics.value(quarantine_probe.FAILED)
    assert not _poll(lambda: _ready(kv_mgr), 0.8)
    assert metrics.value(quarantine_probe.FAILED) > failed
    state.status, state.pdsafe = 200, False  # a stock prefill took the address
    seen = len(state.requests)
    assert not _poll(lambda: _ready(kv_mgr), 0.8)
    assert len(state.requests) > seen and q.tokens_held() == 64


def test_holds_of_unknown_incarnation_are_never_probed(boot):
    """A stock prefill publishes no incarnation: no answer could release its holds (only its
    drain ACK or an operator), so it is not asked."""
    state, writer = boot
    kv_mgr, _ = _held(writer, incarnation=None)
    assert not _poll(lambda: _ready(kv_mgr), 0.5)
    assert state.requests == []


def test_no_probe_before_the_hold_is_overdue_or_its_writer_declared_gone(boot):
    state, writer = boot
    kv_mgr, q = _held(writer, gone=False)
    assert not _poll(lambda: _ready(kv_mgr), 0.4)
    assert state.requests == []
    q.evidence(1, drained=False, now=2e9)  # past upstream's deadline: overdue
    assert _poll(lambda: not _ready(kv_mgr) and bool(state.requests), 4.0)


def test_one_probe_in_flight_per_writer_and_one_pass_per_period(boot, monkeypatch):
    state, writer = boot
    state.delay_s = 0.6
    _, q = _held(writer)
    prober = quarantine_probe.of(q.leg)
    assert prober.tick(q) == [writer]
    for _ in range(20):
        assert prober.tick(q) == [], "a second probe while one is in flight"
    assert _poll(lambda: not prober.writers[writer].in_flight, 3.0)
    monkeypatch.setattr(quarantine_probe, "PASS_EVERY_S", 60.0)
    prober.last_pass = time.monotonic()
    assert prober.tick(q) == [], "a pass within PASS_EVERY_S"
    assert prober.started == 1


def test_the_probe_state_is_bounded(monkeypatch):
    monkeypatch.setattr(quarantine_probe, "MAX_WRITERS", 2)
    kv_mgr = SimpleNamespace()
    q = quarantine.of(kv_mgr)
    writers = [f"127.0.0.1:{_closed_port()}" for _ in range(3)]
    for i, w in enumerate(writers):
        pair_settings.remember(kv_mgr, w, PairSettings(pair_settings.WIRE_VERSION, 1, None,
                                                       None, None, None, incarnation="i"))
        q.hold(i, room=i, rid=f"r{i}", tokens=1, writer=w, now=0.0, deadline=1e9)
        q.peer_gone(w, time.time())
    prober = quarantine_probe.of(q.leg)
    assert len(prober.tick(q, now=100.0)) == 2 and len(prober.writers) == 2
    assert _poll(lambda: not any(s.in_flight for s in prober.writers.values()), 5.0)
    for i in range(3):
        q.release(i, Evidence.ACK, 1.0)
    prober.tick(q, now=200.0)
    assert prober.writers == {}, "writers that need no probe are forgotten"


def test_an_older_observation_never_overrides_a_newer_one():
    w = "127.0.0.1:9"
    kv_mgr = SimpleNamespace()
    q = quarantine.of(kv_mgr)
    q.note_incarnation(w, "A")  # a probe saw A ...
    pair_settings.remember(kv_mgr, w, PairSettings(pair_settings.WIRE_VERSION, 1, None, None,
                                                   None, None, incarnation="B"))  # ... then B
    q.hold(1, room=1, rid="r", tokens=1, writer=w, now=0.0, deadline=1e9)
    assert q.entries()[0].hold.incarnation == "B"
    assert q.evidence(1, drained=False, now=1.0) is None, "the stale A released B's pages"
    q.note_incarnation(w, "C")  # a later probe: B's process is gone
    assert q.evidence(1, drained=False, now=1.0) is Evidence.INCARNATION


def test_upstreams_resolve_loop_releases_on_the_probes_answer(boot):
    """The patched ``resolve_deferred_releases`` (upstream's real loop) frees the pages at the
    first pass after the probe saw the new incarnation, and not before."""
    state, writer = boot
    mgr, q, clock = _manager(), _queue(timeout=2.0), [100.0]
    pair_settings.remember(mgr, writer, PairSettings(pair_settings.WIRE_VERSION, 1, None,
                                                     None, None, None, incarnation="inc-1"))
    dreq = _decode_req(mgr, room=311, idx=12)
    dreq.kv_receiver.bootstrap_addr = writer
    mgr.register_deferred_abort_room(311)
    _defer(q, dreq, clock)
    clock[0] = 200.0  # overdue: the probe starts

    def scheduler_pass() -> bool:
        clock[0] += 0.05  # the test's clock (upstream's loop and the probe read it)
        return _run(q, clock).called

    assert not _poll(scheduler_pass, 1.0)
    assert state.requests
    state.incarnation = "inc-2"
    assert _poll(scheduler_pass, 6.0)
    assert q.num_pending_deferred_releases() == 0


def test_the_interval_is_validated(monkeypatch):
    for good, want in (("", 5.0), ("2.5", 2.5), ("0.1", 0.1)):
        monkeypatch.setenv(quarantine_probe.ENV_PROBE_S, good)
        assert quarantine_probe.interval() == want
    for bad in ("0", "-1", "nan", "inf", "5s", "7200"):
        monkeypatch.setenv(quarantine_probe.ENV_PROBE_S, bad)
        with pytest.raises(ValueError, match=quarantine_probe.ENV_PROBE_S):
            quarantine_probe.interval()
        with pytest.raises(ValueError, match=quarantine_probe.ENV_PROBE_S):
            quarantine.require_deferred_release(True)  # the decode refuses to start


def test_a_failing_probe_pass_does_not_block_the_ack(boot, monkeypatch):
    _, writer = boot
    kv_mgr, _ = _held(writer)
    monkeypatch.setattr(quarantine_probe.Prober, "tick",
                        lambda self, q, now=None: (_ for _ in ()).throw(RuntimeError("boom")))
    failed = metrics.value("quarantine_failed_total")
    assert not _ready(kv_mgr)
    assert not _ready(kv_mgr)
    assert metrics.value("quarantine_failed_total") == failed + 1, "counted once per manager"
    assert quarantine.ready(kv_mgr, 1, drained=True, now=1.0, deadline=1e9)


def test_the_probe_runs_off_the_calling_thread(boot):
    state, writer = boot
    state.delay_s = 1.0
    kv_mgr, _ = _held(writer)
    seen: list[str] = []
    orig = quarantine_probe.fetch

    def spy(w: str, timeout: Any = quarantine_probe.TIMEOUT_S) -> quarantine_probe.Answer:
        seen.append(threading.current_thread().name)
        return orig(w, timeout)

    quarantine_probe.fetch = spy  # type: ignore[assignment]
    try:
        t0 = time.monotonic()
        _ready(kv_mgr)
        assert time.monotonic() - t0 < 0.5, "the scheduler thread waited for the probe"
        assert _poll(lambda: bool(seen), 2.0)
    finally:
        quarantine_probe.fetch = orig  # type: ignore[assignment]
    assert seen == ["pdsafe-quarantine-probe"]
