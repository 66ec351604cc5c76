"""Decode-page quarantine (patch 0019, ``sglang.pdsafe.quarantine``): a timeout never frees.

Two layers:

* the state machine and the registry alone (transitions, evidence, limit, door, health text);
* upstream's real ``DecodeTransferQueue._defer_release`` / ``resolve_deferred_releases`` /
  ``release_memory_occupation`` and ``CommonKVManager.is_abort_release_safe`` /
  ``note_abort_ack`` / ``_handle_node_failure``, as patched, on objects built without their heavy
  constructors (the way upstream's own ``test_deferred_decode_kv_release.py`` builds them): the
  pages of an aborted transfer are freed on the drain ACK or when the heartbeat declared the
  prefill gone, and never because upstream's deadline passed.

What this does not show: that a real late write lands in quarantined pages and not in another
request's (``test/pd/test_late_write.py`` does, on content, with real servers).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from unittest.mock import MagicMock, patch

import pytest
from sglang.pdsafe import metrics, pair_settings, policy, quarantine
from sglang.pdsafe.quarantine import Evidence, Quarantine
from sglang.pdsafe.transfer import IllegalTransition, State

WRITER = "127.0.0.1:8998"


@pytest.fixture(autouse=True)
def _default_env(monkeypatch):
    for var in (quarantine.ENV_ENABLE, quarantine.ENV_LIMIT):
        monkeypatch.delenv(var, raising=False)


# --------------------------------------------------------------------------- state machine


def test_a_hold_is_its_records_held_state_and_ends_only_released():
    q = Quarantine()
    rec = q.hold("k", room=1, rid="r", tokens=8, writer=WRITER, now=0.0, deadline=5.0)
    assert rec.state is State.HELD and rec.history[-1] is State.REFUSED
    with pytest.raises(IllegalTransition):
        rec.advance(State.COMMITTED)  # a held transfer is never decoded
    q.evidence("k", drained=False, now=6.0)
    assert rec.state is State.HELD and rec.hold.overdue, "an alarm is no transition"
    q.release("k", Evidence.ACK, 7.0)
    assert rec.terminal and rec.state is State.RELEASED and "ack" in rec.evidence
    for to in State:
        with pytest.raises(IllegalTransition):
            rec.advance(to)  # terminal: nothing leaves a released state


def test_a_slot_is_held_once():
    q = Quarantine()
    q.hold(3, room=1, rid="a", tokens=4, writer=WRITER, now=0.0, deadline=1.0)
    with pytest.raises(IllegalTransition):
        q.hold(3, room=2, rid="b", tokens=4, writer=WRITER, now=0.0, deadline=1.0)


def test_timeout_never_frees_it_alarms_once():
    q = Quarantine()
    q.hold("k", room=9, rid="victim", tokens=16, writer=WRITER, now=0.0, deadline=30.0)
    before = metrics.value("quarantine_overdue_total")
    for now in (29.9, 30.0, 31.0, 3600.0, 10**9):
        assert q.evidence("k", drained=False, now=now) is None
    assert metrics.value("quarantine_overdue_total") == before + 1
    (entry,) = q.entries()
    assert entry.hold.overdue and entry.state is State.HELD and q.tokens_held() == 16


def test_ack_releases_and_counts():
    q = Quarantine()
    q.hold("k", room=9, rid="v", tokens=16, writer=WRITER, now=0.0, deadline=30.0)
    acks = metrics.value("quarantine_released_ack_total")
    assert q.evidence("k", drained=True, now=1.0) is Evidence.ACK
    q.release("k", Evidence.ACK, 1.0)
    assert metrics.value("quarantine_released_ack_total") == acks + 1
    assert q.tokens_held() == 0 and not q.entries()
    assert metrics.value("quarantined_tokens") == 0


def test_missed_heartbeats_are_no_evidence():
    """A partitioned prefill that is alive can still post a write after its heartbeat
    stopped: the heartbeat's verdict only alarms."""
    q = Quarantine()
    q.hold("k", room=9, rid="v", tokens=16, writer=WRITER, now=10.0, deadline=40.0,
           writer_since=8.0)
    q.peer_gone(WRITER, 9.0)
    q.peer_gone(WRITER, 50.0)
    for now in (11.0, 100.0, 10**6):
        assert q.evidence("k", drained=False, now=now) is None
    assert q.needs_probe() == [WRITER]
    assert q.evidence("k", drained=True, now=10**6) is Evidence.ACK


def test_a_new_incarnation_of_the_writer_is_evidence_for_that_writer_only():
    q = Quarantine()
    q.note_incarnation(WRITER, "inc-1")  # what the decode paired with
    q.note_incarnation("127.0.0.1:9000", "other-1")
    q.hold("k", room=9, rid="v", tokens=16, writer=WRITER, now=10.0, deadline=40.0)
    q.hold("o", room=10, rid="w", tokens=16, writer="127.0.0.1:9000", now=10.0, deadline=40.0)
    assert q.entries()[0].hold.incarnation == "inc-1"
    assert q.note_incarnation(WRITER, "inc-1") == 0  # the same process re-registered
    assert q.evidence("k", drained=False, now=11.0) is None
    assert q.note_incarnation(WRITER, "inc-2") == 1  # the process restarted
    assert q.evidence("k", drained=False, now=12.0) is Evidence.INCARNATION
    assert q.evidence("o", drained=False, now=12.0) is None  # another writer, still live
    incs = metrics.value("quarantine_released_incarnation_total")
    q.release("k", Evidence.INCARNATION, 12.0)
    assert metrics.value("quarantine_released_incarnation_total") == incs + 1


def test_a_writer_of_unknown_incarnation_needs_an_ack_or_an_operator():
    """A stock prefill publishes no incarnation: only its drain ACK (or an operator) ends a
    hold of its pages."""
    q = Quarantine()
    q.hold("k", room=9, rid="v", tokens=16, writer=WRITER, now=10.0, deadline=40.0)
    q.note_incarnation(WRITER, "inc-9")
    assert q.evidence("k", drained=False, now=100.0) is None


def test_an_operator_release_covers_holds_of_that_writer_taken_before_it():
    q = Quarantine()
    q.hold("k", room=9, rid="v", tokens=16, writer=WRITER, now=10.0, deadline=40.0,
           writer_since=100.0)
    q.hold("o", room=10, rid="w", tokens=16, writer="127.0.0.1:9000", now=10.0,
           deadline=40.0, writer_since=100.0)
    assert q.operator_release(WRITER, now=99.0) == 1
    assert q.evidence("k", drained=False, now=11.0) is None  # released before the writer had it
    q.operator_release(WRITER, now=101.0)
    assert q.evidence("k", drained=False, now=11.0) is Evidence.OPERATOR
    assert q.evidence("o", drained=False, now=11.0) is None
    q.operator_release(None, now=102.0)  # every writer
    assert q.evidence("o", drained=False, now=11.0) is Evidence.OPERATOR


def test_unknown_writer_needs_an_ack():
    q = Quarantine()
    q.hold("k", room=9, rid="v", tokens=16, writer="", now=10.0, deadline=40.0)
    q.peer_gone("", 12.0)
    q.note_incarnation("", "x")
    assert q.evidence("k", drained=False, now=100.0) is None


def test_limit_door_and_health_text():
    kv_mgr = SimpleNamespace()
    queue = SimpleNamespace(kv_manager=kv_mgr, token_to_kv_pool_allocator=SimpleNamespace(size=100))
    assert quarantine.door(queue) is None  # nothing ever held: not even the pool is read
    q = quarantine.of(kv_mgr)
    assert quarantine.door(queue) is None
    q.hold(1, room=1, rid="a", tokens=25, writer=WRITER, now=0.0, deadline=1.0)
    q.hold(2, room=2, rid="b", tokens=1, writer=WRITER, now=0.0, deadline=1.0)
    # Inside upstream's deadline a hold is an abort's normal drain: it never stops admission.
    assert quarantine.door(queue) is None
    q.evidence(1, drained=False, now=2.0)  # past the deadline: overdue
    assert quarantine.door(queue) is None  # 25 % is not over 25 %
    q.evidence(2, drained=False, now=2.0)
    refused = metrics.value("quarantine_limit_refused_total")
    r = quarantine.door(queue)
    assert r is not None and r.status == 503
    assert "26 of 100 KV tokens" in r.message and WRITER in r.message
    assert metrics.value("quarantine_limit_refused_total") == refused + 1
    assert quarantine.door(queue, reentry=True) is None  # a retraction owns its place
    report = q.status(100)
    assert report["over_limit"] and quarantine.limit_message(report) == r.message
    assert quarantine.health_refusal([ValueError("x"), SimpleNamespace(detail=r.message)]) \
        == r.message
    assert quarantine.health_refusal([ValueError("another 503")]) is None
    q.release(2, Evidence.ACK, 3.0)  # evidence arrives: admission recovers by itself
    assert quarantine.door(queue) is None


def test_limit_env_is_validated(monkeypatch):
    monkeypatch.setenv(quarantine.ENV_LIMIT, "0.5")
    assert quarantine.limit_fraction() == 0.5
    for bad in ("0", "1.5", "half"):
        monkeypatch.setenv(quarantine.ENV_LIMIT, bad)
        with pytest.raises(ValueError, match=quarantine.ENV_LIMIT):
            quarantine.limit_fraction()


def test_deferred_release_is_required(monkeypatch):
    assert quarantine.require_deferred_release(True) is True
    with pytest.raises(RuntimeError, match=quarantine.UPSTREAM_DEFERRED_ENV):
        quarantine.require_deferred_release(False)
    monkeypatch.setenv(quarantine.ENV_ENABLE, "0")
    assert quarantine.require_deferred_release(False) is False


def test_a_failing_check_keeps_the_pages(monkeypatch):
    kv_mgr = SimpleNamespace()
    quarantine.of(kv_mgr).hold(1, room=1, rid="a", tokens=4, writer=WRITER, now=0.0,
                               deadline=1.0)
    monkeypatch.setattr(Quarantine, "evidence", MagicMock(side_effect=RuntimeError("boom")))
    failed = metrics.value("quarantine_failed_total")
    for now in (99.0, 100.0, 101.0):  # the scheduler loop asks every pass
        assert quarantine.ready(kv_mgr, 1, drained=False, now=now, deadline=1.0) is False
    assert metrics.value("quarantine_failed_total") == failed + 1, "counted once per hold"


# --------------------------------------------------------------------------- real upstream code


class _IdxAllocator:
    def __init__(self) -> None:
        self.freed: list[int] = []

    def free(self, idx: int) -> None:
        self.freed.append(idx)


def _manager():
    """A decode ``CommonKVManager`` carrying the state its deferred-ack and node-failure
    methods use (its constructor starts threads and a transfer engine)."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    mgr = CommonKVManager.__new__(CommonKVManager)
    mgr._deferred_abort_ack_tracker = {}
    mgr._deferred_abort_generation = 0
    mgr.enable_deferred_decode_kv_release = True
    mgr.connection_lock = threading.Lock()
    mgr.connection_pool = {}
    mgr.prefill_info_table = {WRITER: object()}
    mgr.heartbeat_failures = {WRITER: 3}
    mgr.addr_to_rooms_tracker = {}
    mgr.request_status = {}
    return mgr


def _queue(timeout: float):
    from sglang.srt.disaggregation.decode import DecodeTransferQueue

    q = DecodeTransferQueue.__new__(DecodeTransferQueue)
    q._deferred_releases = []
    q.deferred_kv_release_timeout = timeout
    q.enable_host_receive = False
    q.enable_staging = False
    q.staging_handler = None
    q.tree_cache = object()
    q.metadata_buffers = SimpleNamespace(clear_slot=lambda idx: None)
    q.req_to_metadata_buffer_idx_allocator = _IdxAllocator()
    q.gloo_group = None
    q.scheduler = SimpleNamespace(
        enable_hisparse=False,
        metrics_reporter=SimpleNamespace(enable_metrics=True),
        metrics_collector=SimpleNamespace(observe_decode_deferred_kv_release=MagicMock(
            side_effect=_upstream_observe)))
    return q


def _upstream_observe(**kw) -> None:
    """Upstream's real collector method (its label check raises on an unknown outcome, which
    stops the decode scheduler), on a stand-in for the collector's histogram."""
    from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector

    SchedulerMetricsCollector.observe_decode_deferred_kv_release(MagicMock(), **kw)


def _decode_req(mgr, room: int, idx: int, tokens: int = 32):
    receiver = SimpleNamespace(kv_mgr=mgr, bootstrap_addr=WRITER, bootstrap_infos=[{"rank": 0}],
                               abort_notified=True, clear=lambda: None,
                               init_time=time.time() - 1.0)
    req = SimpleNamespace(bootstrap_room=room, rid=f"rid-{room}",
                          kv=SimpleNamespace(kv_allocated_len=tokens))
    return SimpleNamespace(req=req, kv_receiver=receiver, metadata_buffer_index=idx)


def _run(q, clock: list[float]):
    """One scheduler-loop pass of the patched resolve_deferred_releases at time clock[0]."""
    import sglang.srt.disaggregation.decode as decode_mod

    with patch.object(decode_mod.time, "monotonic", side_effect=lambda: clock[0]), \
            patch.object(decode_mod, "release_kv_cache") as rel, \
            patch.object(decode_mod, "all_reduce_flags", side_effect=lambda flags, **_: flags):
        q.resolve_deferred_releases()
    return rel


def _defer(q, dreq, clock):
    import sglang.srt.disaggregation.decode as decode_mod

    with patch.object(decode_mod.time, "monotonic", side_effect=lambda: clock[0]):
        q._defer_release(dreq)


def test_upstream_deadline_no_longer_frees_then_the_ack_does():
    mgr, q, clock = _manager(), _queue(timeout=2.0), [100.0]
    dreq = _decode_req(mgr, room=300, idx=3)
    gen = mgr.register_deferred_abort_room(300)
    _defer(q, dreq, clock)
    assert quarantine.of(mgr).tokens_held() == 32
    overdue = metrics.value("quarantine_overdue_total")
    for t in (101.0, 102.5, 1000.0):  # well past upstream's 2 s: upstream frees here
        clock[0] = t
        assert not _run(q, clock).called, f"pages freed at t={t} without an ACK"
    assert metrics.value("quarantine_overdue_total") == overdue + 1
    assert q.num_pending_deferred_releases() == 1
    mgr.note_abort_ack(300, 0, gen + 1)  # an ACK for another generation is no evidence
    assert not _run(q, clock).called
    mgr.note_abort_ack(300, 0, gen)
    acks = metrics.value("quarantine_released_ack_total")
    rel = _run(q, clock)
    rel.assert_called_once_with(dreq.req, q.tree_cache, checkpoint=False)
    assert q.req_to_metadata_buffer_idx_allocator.freed == [3]
    assert metrics.value("quarantine_released_ack_total") == acks + 1
    assert quarantine.of(mgr).tokens_held() == 0
    q.scheduler.metrics_collector.observe_decode_deferred_kv_release.assert_called_once_with(
        duration_seconds=900.0, outcome="drained")


def test_heartbeat_declaring_the_prefill_gone_only_alarms():
    """Upstream's heartbeat verdict (missed heartbeats) is no proof that a partitioned writer
    stopped: the pages stay held, the alarm is counted."""
    mgr, q, clock = _manager(), _queue(timeout=2.0), [100.0]
    dreq = _decode_req(mgr, room=301, idx=4)
    mgr.register_deferred_abort_room(301)
    _defer(q, dreq, clock)
    alarms = metrics.value("quarantine_peer_gone_alarm_total")
    with patch("sglang.srt.disaggregation.common.conn.CommonKVReceiver.disconnect_endpoint"):
        mgr._handle_node_failure(WRITER)  # upstream's heartbeat verdict, as patched
    assert metrics.value("quarantine_peer_gone_alarm_total") == alarms + 1
    for t in (200.0, 10_000.0):
        clock[0] = t
        assert not _run(q, clock).called, "missed heartbeats released the pages"
    assert q.num_pending_deferred_releases() == 1


def test_a_new_incarnation_registered_at_the_writers_address_releases():
    """The prefill restarted: the decode's pairing step sees its address published another
    incarnation. The process the destinations went to has exited; the pages are released,
    counted by that evidence, with upstream's "timeout" label (its collector's only label for
    a release without a full drain ACK)."""
    mgr, q, clock = _manager(), _queue(timeout=2.0), [100.0]
    pair_settings.remember(mgr, WRITER, pair_settings.PairSettings(
        pair_settings.WIRE_VERSION, 1, None, None, None, None, incarnation="inc-old"))
    dreq = _decode_req(mgr, room=306, idx=10)
    mgr.register_deferred_abort_room(306)
    _defer(q, dreq, clock)
    clock[0] = 200.0
    assert not _run(q, clock).called
    pair_settings.remember(mgr, WRITER, pair_settings.PairSettings(
        pair_settings.WIRE_VERSION, 1, None, None, None, None, incarnation="inc-new"))
    incs = metrics.value("quarantine_released_incarnation_total")
    rel = _run(q, clock)
    rel.assert_called_once()
    assert metrics.value("quarantine_released_incarnation_total") == incs + 1
    q.scheduler.metrics_collector.observe_decode_deferred_kv_release.assert_called_once_with(
        duration_seconds=100.0, outcome="timeout")


def test_an_operator_release_through_the_state_dir_releases(tmp_path, monkeypatch):
    """POST /pdsafe/quarantine/release on the decode's HTTP process writes the release into
    the server's state directory; the scheduler applies it at its next pass."""
    monkeypatch.setenv(policy.ENV_STATE_DIR, str(tmp_path))
    mgr, q, clock = _manager(), _queue(timeout=2.0), [100.0]
    dreq = _decode_req(mgr, room=307, idx=11)
    mgr.register_deferred_abort_room(307)
    _defer(q, dreq, clock)
    clock[0] = 200.0
    assert not _run(q, clock).called
    ops = metrics.value("quarantine_operator_release_total")
    quarantine.request_operator_release(WRITER, who="test")
    assert metrics.value("quarantine_operator_release_total") == ops + 1
    released = metrics.value("quarantine_released_operator_total")
    assert _run(q, clock).called
    assert metrics.value("quarantine_released_operator_total") == released + 1


def test_off_switch_restores_upstream_timeout(monkeypatch):
    monkeypatch.setenv(quarantine.ENV_ENABLE, "0")
    mgr, q, clock = _manager(), _queue(timeout=2.0), [100.0]
    dreq = _decode_req(mgr, room=302, idx=5)
    mgr.register_deferred_abort_room(302)
    _defer(q, dreq, clock)
    clock[0] = 103.0
    assert _run(q, clock).called  # upstream's fail-open release, explicitly chosen


def test_pool_teardown_drops_the_holds():
    mgr, q, clock = _manager(), _queue(timeout=2.0), [100.0]
    mgr.register_deferred_abort_room(303)
    _defer(q, _decode_req(mgr, room=303, idx=6), clock)
    q.queue = []
    q.release_memory_occupation()
    assert quarantine.of(mgr).tokens_held() == 0 and q.num_pending_deferred_releases() == 0
