"""ABORT and ABORT_ACK carry the transfer generation (``sglang.pdsafe.transfer_generation``,
patch 0026; issue 9 item 2: "ABORT, ABORT_ACK ... carry the transfer generation").

No servers. The same real pieces as ``test_transfer_generation`` (its decode rank: upstream's
``_send_kv_metadata``, the backend's real receiver and decode control loop; its prefill rank:
the backend's real bootstrap-thread loop, status path and drain-ACK path), with upstream's
deferred decode release switched on (its default since 0.5.21): the receiver's real ``abort``
/ ``failure_exception`` / ``ensure_abort_notified`` build the ABORT, the prefill's real
``_handle_abort_notification`` fails the room and sends the drain ACK, the decode's real
``handle_abort_ack_message`` / ``note_abort_ack`` / ``is_abort_release_safe`` consume it.

What this does not show: real servers and transports (ZMQ), a drain that waits for chunks in
flight (nothing is queued here, so the prefill ACKs at once), TP > 1 in separate processes.
The late-write server test (``test/pd/test_late_write.py``) runs the whole deferred release
with the ACK on real servers.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from sglang.pdsafe import metrics, peer_release
from sglang.pdsafe import transfer_generation as tg
from sglang.srt.disaggregation.base.conn import KVPoll

from . import test_transfer_generation as tgt
from .test_transfer_generation import (  # noqa: F401 - the same autouse environment
    _env,
    _mori_engine_desc,
)

BACKENDS = tgt.BACKENDS
WATCHED = (tg.STALE_ABORT, tg.STALE_ABORT_ACK, tg.STALE_STATUS, tg.FAILED,
           "hook_api_mismatch_total")


def _counts() -> dict[str, float]:
    return {n: metrics.value(n) for n in WATCHED}


def _delta(before: dict[str, float]) -> dict[str, float]:
    return {n: metrics.value(n) - v for n, v in before.items() if metrics.value(n) != v}


def _deferred(rank: tgt._Rank) -> tgt._Rank:
    """Upstream's deferred decode release on (the manager was built without its constructor,
    so its tracker state is set as the constructor sets it)."""
    kv = rank.kv
    kv.enable_deferred_decode_kv_release = True
    kv._deferred_abort_generation = 0
    kv._deferred_abort_ack_tracker = {}
    return rank


def _served(monkeypatch, backend: str, room: int, **kw: Any) -> tuple[tgt._Rank, Any,
                                                                       tgt._Prefill]:
    """A decode rank (deferred release on) that reserved ``room`` and a prefill rank (deferred
    ACKs on) whose bootstrap loop took its metadata; the prefill's sender of the room is live
    (status WaitingForInput, as upstream sets it once every decode rank's metadata is in)."""
    rank = _deferred(tgt._Rank(monkeypatch, backend, **kw))
    dreq = rank.reserve("r", room)
    prefill = tgt._Prefill(backend)
    prefill.m.enable_deferred_decode_kv_release = True
    prefill.m.update_status(room, KVPoll.Bootstrapping)
    prefill.receive(monkeypatch, rank)
    prefill.m.update_status(room, KVPoll.WaitingForInput)
    return rank, dreq, prefill


def _aborts(rank: tgt._Rank) -> list[list[bytes]]:
    """The upstream ABORT messages (room, host, port, generation) the rank sent to prefill
    rank ``PREFILL_PORT`` since the last call (removed from the record)."""
    mine = [p for port, p in rank.metadata if port == tgt.PREFILL_PORT and p[0] == b"ABORT"
            and len(p) >= 5]
    rank.metadata[:] = [(port, p) for port, p in rank.metadata if p not in mine]
    return mine


def _acks(prefill: tgt._Prefill, rank: tgt._Rank) -> list[list[bytes]]:
    return [p for p in prefill.take(rank) if p[0] == b"ABORT_ACK"]


def _armed(rank: tgt._Rank, room: int) -> int | None:
    state = rank.kv._deferred_abort_ack_tracker.get(room)
    return None if state is None else state.generation


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_armed_abort_names_the_transfer_generation_and_the_drain_ack_echoes_it(
        monkeypatch, backend):
    """Decode aborts a transfer whose metadata carried g: upstream arms its deferred release
    with g (not its counter), the ABORT names g, the prefill fails the room and ACKs g, and
    that ACK makes the release safe on the decode."""
    room = tgt._room()
    rank, dreq, prefill = _served(monkeypatch, backend, room)
    g = dreq.kv_receiver.pdsafe_transfer_generation()
    assert g > 0
    before = _counts()
    dreq.kv_receiver.abort()
    assert _armed(rank, room) == g
    (abort,) = _aborts(rank)
    assert abort[1:5] == [str(room).encode(), tgt.HOST.encode(),
                          str(rank.kv.rank_port).encode(), str(g).encode()]

    tgt.cap._run_bootstrap_loop(monkeypatch, prefill.m, [abort])
    assert prefill.m.request_status[room] == KVPoll.Failed
    (ack,) = _acks(prefill, rank)
    assert ack[1] == str(room).encode() and ack[3] == str(g).encode()

    assert not rank.kv.is_abort_release_safe(room, 1)
    tgt._deliver(monkeypatch, rank.kv, [ack])
    assert rank.kv.is_abort_release_safe(room, 1)
    assert _delta(before) == {}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_transfer_aborted_after_its_receiver_was_cleared_still_names_its_generation(
        monkeypatch, backend):
    """Upstream's failed-transfer path clears the receiver (``failure_exception``) and only then
    arms the release (``ensure_abort_notified(force_arm=True)``, decode.py): the ABORT must still
    name the reservation's generation, or the prefill could not tell it from a stale one."""
    room = tgt._room()
    rank, dreq, prefill = _served(monkeypatch, backend, room)
    g = dreq.kv_receiver.pdsafe_transfer_generation()
    rank.kv.record_failure(room, "transport error")
    rank.kv.update_status(room, KVPoll.Failed)
    with pytest.raises(Exception, match="transport error"):
        dreq.kv_receiver.failure_exception()
    assert tg.live_reservation(rank.kv, room) is None  # released with the receiver
    dreq.kv_receiver.ensure_abort_notified(force_arm=True)
    assert _armed(rank, room) == g
    (abort,) = _aborts(rank)
    assert abort[4] == str(g).encode()
    tgt.cap._run_bootstrap_loop(monkeypatch, prefill.m, [abort])
    (ack,) = _acks(prefill, rank)
    tgt._deliver(monkeypatch, rank.kv, [ack])
    assert rank.kv.is_abort_release_safe(room, 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_replayed_abort_of_an_earlier_reservation_does_not_fail_the_live_transfer(
        monkeypatch, backend):
    """Room R: reservation g1 aborted (ABORT g1 recorded), both sides release it. R reserved
    again (g2), the prefill's new sender is live. ABORT g1 replayed: dropped and counted, the
    live transfer is not failed, no drain ACK is sent, peer release records nothing. The real
    ABORT of g2 still fails it."""
    room = tgt._room()
    rank, first, prefill = _served(monkeypatch, backend, room, slots=1)
    g1 = first.kv_receiver.pdsafe_transfer_generation()
    first.kv_receiver.abort()
    (abort_g1,) = _aborts(rank)
    tgt.cap._run_bootstrap_loop(monkeypatch, prefill.m, [abort_g1])
    (ack_g1,) = _acks(prefill, rank)
    tgt._deliver(monkeypatch, rank.kv, [ack_g1])
    rank.kv.clear_deferred_abort_state(room)  # upstream's release of the held pages
    rank.release(first)
    tgt._sender(prefill, room).clear()
    prefill.m.request_status.pop(room, None)
    prefill.m.failure_records.pop(room, None)
    prefill.m._deferred_ack_targets.pop(room, None)
    peer_release._registry(prefill.m).rooms.pop(room, None)  # its TTL passed

    second = rank.reserve("r2", room)
    g2 = second.kv_receiver.pdsafe_transfer_generation()
    assert g2 != g1
    prefill.m.update_status(room, KVPoll.Bootstrapping)
    prefill.receive(monkeypatch, rank)
    prefill.m.update_status(room, KVPoll.WaitingForInput)
    before = _counts()
    tgt.cap._run_bootstrap_loop(monkeypatch, prefill.m, [abort_g1])
    assert prefill.m.request_status[room] == KVPoll.WaitingForInput, "the live room failed"
    assert room not in prefill.m.failure_records
    assert peer_release._registry(prefill.m).get(room) is None
    assert _acks(prefill, rank) == []
    assert _delta(before) == {tg.STALE_ABORT: 1}

    second.kv_receiver.abort()
    (abort_g2,) = _aborts(rank)
    assert abort_g2[4] == str(g2).encode()
    tgt.cap._run_bootstrap_loop(monkeypatch, prefill.m, [abort_g2])
    assert prefill.m.request_status[room] == KVPoll.Failed
    (ack_g2,) = _acks(prefill, rank)
    assert ack_g2[3] == str(g2).encode()
    assert _delta(before) == {tg.STALE_ABORT: 1}


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_abort_naming_a_generation_the_prefill_never_saw_is_served(monkeypatch, backend):
    """A partial publish: the decode sent g to another prefill rank but not this one, whose
    record for the room is an earlier reservation's. The ABORT is not stale (it may be newer):
    the room fails and the drain ACK goes out, so the decode's pages are not held forever."""
    from sglang.srt.disaggregation.common.conn import AbortNotification

    room = tgt._room()
    rank, dreq, prefill = _served(monkeypatch, backend, room)
    unseen = random.randrange(1, 1 << 62)
    abort = AbortNotification(room=room, decode_ip=tgt.HOST, decode_port=rank.kv.rank_port,
                              generation=unseen).to_zmq()
    before = _counts()
    tgt.cap._run_bootstrap_loop(monkeypatch, prefill.m, [abort])
    assert prefill.m.request_status[room] == KVPoll.Failed
    (ack,) = _acks(prefill, rank)
    assert ack[3] == str(unseen).encode()
    assert _delta(before) == {}


@pytest.mark.parametrize("backend", BACKENDS)
def test_late_and_foreign_abort_acks_release_nothing_and_are_counted(monkeypatch, backend):
    """Decode armed g2 for room R. An ACK of the earlier reservation's g1, an ACK for a room
    with nothing armed, a generation-less ACK (an older peer's format) and (after the release)
    a duplicate of g2's ACK: none is recorded, each is counted. Only g2's own ACK makes the
    release safe."""
    from sglang.srt.disaggregation.common.conn import AbortAck

    room = tgt._room()
    rank, dreq, prefill = _served(monkeypatch, backend, room)
    g2 = dreq.kv_receiver.pdsafe_transfer_generation()
    dreq.kv_receiver.abort()
    other_room = tgt._room()
    g1 = random.randrange(1, 1 << 62)
    before = _counts()
    tgt._deliver(monkeypatch, rank.kv, [AbortAck(room, tgt.PREFILL_RANK, g1).to_zmq(),
                                        AbortAck(other_room, tgt.PREFILL_RANK, g2).to_zmq(),
                                        AbortAck(room, tgt.PREFILL_RANK).to_zmq()])
    assert not rank.kv.is_abort_release_safe(room, 1)
    assert _delta(before) == {tg.STALE_ABORT_ACK: 3}
    own = AbortAck(room, tgt.PREFILL_RANK, g2).to_zmq()
    tgt._deliver(monkeypatch, rank.kv, [own])
    assert rank.kv.is_abort_release_safe(room, 1)
    rank.kv.clear_deferred_abort_state(room)
    tgt._deliver(monkeypatch, rank.kv, [own])  # late duplicate after the release
    assert _delta(before) == {tg.STALE_ABORT_ACK: 4}


def test_pure_stale_abort_rule():
    """The rule alone: stale only when the generation is one an earlier metadata of the same
    endpoint carried for the room and a later one replaced."""
    from types import SimpleNamespace

    m = SimpleNamespace()
    room, ep = 7, ("10.0.0.1", 4000)

    def meta(g: int | None) -> list[bytes]:
        return [str(room).encode(), ep[0].encode(), str(ep[1]).encode()] + (
            [] if g is None else [tg.encode_frame(g)])

    def abort(g: int, host: str = ep[0]) -> list[bytes]:
        return [b"ABORT", str(room).encode(), host.encode(), str(ep[1]).encode(),
                str(g).encode()]

    tg.note_metadata(m, room, meta(11))
    assert not tg.abort_message_is_stale(m, abort(11))
    assert not tg.abort_message_is_stale(m, abort(12))  # never seen: maybe newer
    tg.note_metadata(m, room, meta(12))
    assert tg.abort_message_is_stale(m, abort(11))
    assert not tg.abort_message_is_stale(m, abort(12))
    assert not tg.abort_message_is_stale(m, abort(11, host="10.0.0.2"))  # another endpoint
    assert not tg.abort_message_is_stale(m, abort(11)[:4])  # no generation: upstream's
    tg.note_metadata(m, room, meta(None))  # a stock decode's metadata now
    assert tg.abort_message_is_stale(m, abort(12))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_abort_goes_out_from_a_receiver_built_without_its_constructor(monkeypatch, backend):
    """Upstream's own unit tests build receivers with ``__new__`` (no ``bootstrap_addr``) and
    check that ``_send_abort_notification`` sends the ABORT after arming the ACK tracker. Patch
    0030 once sealed the ABORT inside upstream's best-effort per-rank ``try``: the missing
    attribute was swallowed there like a socket error and no ABORT went out (nine upstream tests
    of ``test_deferred_decode_kv_release.py`` passed on stock and failed on the fork,
    ``docs/upstream-unit-tests.md``). The ABORT is sealed once, before the sends: it goes out,
    with the reservation's generation, after the tracker was armed."""
    import threading
    from types import SimpleNamespace

    rank = _deferred(tgt._Rank(monkeypatch, backend))
    recv = tgt._receiver_cls(backend).__new__(tgt._receiver_cls(backend))
    recv.kv_mgr = rank.kv
    recv.bootstrap_room = room = tgt._room()
    recv.init_time = 123.0  # metadata went out: the tracker is armed before the ABORT
    recv.abort_notified = False
    recv._abort_generation = None
    recv.bootstrap_infos = [{"rank_ip": tgt.HOST, "rank_port": tgt.PREFILL_PORT}]
    sent: list[tuple[bool, list[bytes]]] = []
    sock = SimpleNamespace(send_multipart=lambda parts: sent.append(
        (room in rank.kv._deferred_abort_ack_tracker, list(parts))))
    recv._connect_to_bootstrap_server = lambda info: (sock, threading.Lock())
    recv._send_abort_notification()
    assert len(sent) == 1, "no ABORT went out"
    armed, parts = sent[0]
    assert armed and parts[0] == b"ABORT" and parts[1] == str(room).encode()
