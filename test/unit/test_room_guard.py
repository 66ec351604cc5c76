"""Client-chosen bootstrap rooms and n>1 made harmless (issue #9, item 1; patch 0018).

Without servers: the real patched ``PrefillBootstrapQueue.add`` / ``create_sender``,
``DecodePreallocQueue.add`` / ``_create_receiver_and_enqueue`` and the real
``CommonKVSender.clear``/``abort`` and ``CommonKVReceiver.clear`` of the installed fork, on real
``Req`` objects and a stand-in KV manager holding the per-room state upstream keys by room.

* A request whose room is live on the server is refused at the door with 409 and counted;
  nothing is created for it and the peer is NOT told (a peer-release ABORT carries only the
  room and would fail the live request); the live request keeps its room.
* A room is released wherever its sender/receiver drops the room's state (clear) and when a
  prefill sender is aborted (upstream retires aborted prefill senders without clear), so a
  later request of the same room is admitted again.
* A cross-pairing (prefill kept A, decode kept B) is refused by the coverage attestation.
* n>1 on a PD server: 400 at the HTTP layer, counted; colocated servers are unaffected.
With real servers: test/pd/test_room_guard.py.
"""

from __future__ import annotations

import threading
from array import array
from collections import defaultdict
from collections.abc import Iterator
from http import HTTPStatus
from types import SimpleNamespace
from unittest.mock import MagicMock, patch

import pytest
from pdsafe_testkit.pd_context import published_pd_context
from sglang.pdsafe import admission, coverage, metrics, protections, room_guard, startup
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import (
    CommonKVReceiver,
    CommonKVSender,
    KVTransferError,
)
from sglang.srt.disaggregation.decode import DecodePreallocQueue
from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
from sglang.srt.disaggregation.utils import (
    FAKE_BOOTSTRAP_HOST,
    DisaggregationMode,
    TransferBackend,
)
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req
from sglang.srt.sampling.sampling_params import SamplingParams

ROOM = 0x5EED_0000_0042


@pytest.fixture(params=["prefill", "decode"])
def side(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.delenv(room_guard.ENV_ENABLE, raising=False)
    with published_pd_context(request.param) as mode:
        yield mode


def _req(rid: str, room: int = ROOM, host: str = "127.0.0.1") -> Req:
    req = Req(rid=rid, origin_input_text="", origin_input_ids=array("q", list(range(40))),
              sampling_params=SamplingParams(max_new_tokens=4),
              bootstrap_host=host, bootstrap_port=1, bootstrap_room=room)
    req.time_stats.trace_ctx = MagicMock()
    return req


def _kv_mgr(side: str) -> SimpleNamespace:
    """The per-room state upstream's CommonKVManager keeps, and the calls clear/abort make."""
    m = SimpleNamespace(
        disaggregation_mode=DisaggregationMode(side),
        request_status={}, transfer_infos={}, req_to_decode_prefix_len={},
        required_prefill_response_num_table={}, prefill_response_tracker={},
        addr_to_rooms_tracker=defaultdict(set), failure_records={},
        failure_lock=threading.Lock(), deferred_bootstrap=None, defer_decode_allocation=False,
        _staging_ctx=None)
    m._maybe_ack_drained_abort = lambda room: None
    m.record_failure = lambda room, reason: m.failure_records.__setitem__(room, reason)
    m.update_status = lambda room, status: m.request_status.__setitem__(room, status)
    return m


def _queue(side: str, kv_mgr: SimpleNamespace) -> PrefillBootstrapQueue | DecodePreallocQueue:
    """A real queue of ``side`` (its doors and creation paths run for real). The endpoints
    are the fake backend's (no transport), so the KV manager stand-in holds only state."""
    cls = PrefillBootstrapQueue if side == "prefill" else DecodePreallocQueue
    q = cls.__new__(cls)
    q.queue, q.pending_reqs = [], []
    q.transfer_backend = TransferBackend.FAKE
    q.kv_manager = kv_mgr
    q.bootstrap_port = 1
    q.scheduler = SimpleNamespace(retire_unadmitted_request=MagicMock())
    q._check_if_req_exceed_kv_capacity = lambda req: False
    q._process_req = lambda req: None
    q._resolve_prefill_dp_rank = lambda req: None
    return q


def _admit(q, req: Req) -> None:
    if isinstance(q, PrefillBootstrapQueue):
        q.add(req, 8)
    else:
        q.add(req)


def _entered(q, req: Req) -> bool:
    if isinstance(q, PrefillBootstrapQueue):
        return req in q.queue
    return any(d.req is req for d in q.queue + q.pending_reqs)


def _sender(kv_mgr: SimpleNamespace, room: int = ROOM) -> CommonKVSender:
    s = object.__new__(CommonKVSender)
    s.kv_mgr, s.bootstrap_room, s.conclude_state = kv_mgr, room, None
    s.trace_ctx = MagicMock()
    return s


def _receiver(kv_mgr: SimpleNamespace, room: int = ROOM) -> CommonKVReceiver:
    r = object.__new__(CommonKVReceiver)
    r.kv_mgr, r.bootstrap_room, r.bootstrap_addr, r.conclude_state = kv_mgr, room, "p:1", None
    r.abort_notified = False
    return r


class _Endpoint:
    """A KV sender/receiver stand-in for ``room_guard.released`` (weakly referenceable, as
    upstream's endpoints are)."""

    def __init__(self, room: int, kv_mgr: object) -> None:
        self.bootstrap_room, self.kv_mgr = room, kv_mgr


# --------------------------------------------------------------------------- the registry


def test_live_rooms_transitions() -> None:
    reg = room_guard.live_rooms(SimpleNamespace(disaggregation_mode="prefill"))
    assert reg.holder(ROOM) is None
    assert reg.claim(ROOM, "a") is None and reg.holder(ROOM).rid == "a"
    assert reg.claim(ROOM, "a") is None, "a re-entry of the holder is no conflict"
    assert reg.claim(ROOM, "b").rid == "a", "a second holder is reported"
    assert reg.release(ROOM)[0] and reg.holder(ROOM) is None and not reg.release(ROOM)[0]
    assert len(reg) == 0


def test_protection_registered_default_on_with_off_switch(monkeypatch) -> None:
    assert "sglang.pdsafe.room_guard" in startup.HOOK_MODULES
    p = {x.name: x for x in protections.registered()}["bootstrap-room-guard"]
    pd = SimpleNamespace(disaggregation_mode="decode")
    assert protections.status(pd)[p.name] and p.switched_off(pd) is None
    assert p.name not in protections.status(SimpleNamespace(disaggregation_mode="null"))
    monkeypatch.setenv(room_guard.ENV_ENABLE, "0")
    assert p.switched_off(pd) == f"{room_guard.ENV_ENABLE}=0"
    assert not protections.status(pd)[p.name]


# --------------------------------------------------------------------------- the doors


def test_duplicate_room_refused_409_nothing_created_peer_not_told(side: str) -> None:
    kv = _kv_mgr(side)
    q = _queue(side, kv)
    first, dup = _req("live-a"), _req("dup-b")
    with patch("sglang.pdsafe.peer_release.prefill_door_rejected") as p_told, \
            patch("sglang.pdsafe.peer_release.decode_rejected") as d_told:
        _admit(q, first)
        assert _entered(q, first)
        assert room_guard.live_rooms(kv).holder(ROOM).rid == "live-a"
        before = metrics.value(room_guard.REFUSED_DUPLICATE)
        _admit(q, dup)
        p_told.assert_not_called()
        d_told.assert_not_called()
    assert not _entered(q, dup), "a second endpoint was created for a live room"
    assert getattr(dup, "disagg_kv_sender", None) is None
    q.scheduler.retire_unadmitted_request.assert_called_once_with(dup)
    assert isinstance(dup.finished_reason, FINISH_ABORT)
    assert dup.finished_reason.status_code == HTTPStatus.CONFLICT
    assert f"bootstrap_room {ROOM} is already in use" in dup.finished_reason.message
    assert "live-a" not in dup.finished_reason.message, "another tenant's rid must not leak"
    assert metrics.value(room_guard.REFUSED_DUPLICATE) == before + 1
    assert room_guard.live_rooms(kv).holder(ROOM).rid == "live-a", "the live request lost it"


def test_other_rooms_fake_host_and_reentries_are_not_refused(side: str) -> None:
    kv = _kv_mgr(side)
    q = _queue(side, kv)
    _admit(q, _req("a"))
    other = _req("b", room=ROOM + 1)
    _admit(q, other)
    assert _entered(q, other)
    warm = _req("warm", host=FAKE_BOOTSTRAP_HOST)  # the server's own warmup: no real endpoint
    _admit(q, warm)
    assert _entered(q, warm) and room_guard.live_rooms(kv).rooms() == {ROOM, ROOM + 1}
    if side == "decode":  # a re-bootstrap re-enters with its room: never refused
        assert room_guard.door(q, _req("a"), reentry=True) is None


def test_intake_rejected_duplicate_keeps_its_verdict_without_telling_the_peer(
        side: str) -> None:
    kv = _kv_mgr(side)
    q = _queue(side, kv)
    _admit(q, _req("live"))
    bad = _req("bad")
    bad.set_finish_with_abort("The prompt is too long.", 400, "BadRequest")
    with patch("sglang.pdsafe.peer_release.prefill_door_rejected") as p_told, \
            patch("sglang.pdsafe.peer_release.decode_rejected") as d_told:
        _admit(q, bad)
    p_told.assert_not_called()
    d_told.assert_not_called()
    assert bad.finished_reason.message == "The prompt is too long."
    assert bad.finished_reason.status_code == 400


def test_off_switch_lets_duplicates_through(side: str, monkeypatch) -> None:
    monkeypatch.setenv(room_guard.ENV_ENABLE, "0")
    kv = _kv_mgr(side)
    q = _queue(side, kv)
    _admit(q, _req("a"))
    dup = _req("b")
    _admit(q, dup)
    # The transfer records stay (every other protection reads them); only the door is off,
    # so the newest request holds the room's live record.
    assert _entered(q, dup) and room_guard.live_rooms(kv).holder(ROOM).rid == "b"


def test_door_that_cannot_check_refuses_503_fail_closed(side: str) -> None:
    """The door's own failure refuses the request (503) and counts it; nothing is created."""
    kv = _kv_mgr(side)
    q = _queue(side, kv)
    before = metrics.value(room_guard.FAILED)
    req = _req("unchecked")
    with patch.object(room_guard, "live_rooms", side_effect=RuntimeError("registry broken")):
        _admit(q, req)
    assert not _entered(q, req), "a request whose room could not be checked was admitted"
    assert isinstance(req.finished_reason, FINISH_ABORT)
    assert req.finished_reason.status_code == 503
    assert "could not run" in req.finished_reason.message
    assert metrics.value(room_guard.FAILED) == before + 1


def test_bare_queue_and_fake_backend_manager_are_not_guarded(side: str) -> None:
    for kv in (None, SimpleNamespace(disaggregation_mode=DisaggregationMode(side))):
        q = _queue(side, kv)
        assert room_guard.door(q, _req("x")) is None
        room_guard.claim(q, _req("x"))  # nothing to record, nothing raised


# --------------------------------------------------------------------------- release


@pytest.mark.parametrize("side", ["prefill"], indirect=True)
@pytest.mark.parametrize("how", ["clear", "abort", "failure"])
def test_prefill_room_released_on_every_sender_exit(how: str, side: str) -> None:
    kv = _kv_mgr(side)
    q = _queue(side, kv)
    _admit(q, _req("a"))
    sender = _sender(kv)
    kv.request_status[ROOM] = KVPoll.Transferring
    with patch("sglang.pdsafe.peer_release.on_sender_aborted"):
        if how == "clear":
            sender.clear()
        elif how == "abort":  # upstream retires an aborted prefill sender without clear()
            sender.abort()
        else:
            kv.request_status[ROOM] = KVPoll.Failed
            with pytest.raises(KVTransferError):
                sender.failure_exception()
    assert room_guard.live_rooms(kv).holder(ROOM) is None, f"room still live after {how}"
    later = _req("later")
    _admit(q, later)
    assert _entered(q, later), "a later request of a released room was refused"


@pytest.mark.parametrize("side", ["decode"], indirect=True)
@pytest.mark.parametrize("how", ["clear", "failure"])
def test_decode_room_released_when_the_receiver_drops_it(how: str, side: str) -> None:
    kv = _kv_mgr(side)
    q = _queue(side, kv)
    _admit(q, _req("a"))
    receiver = _receiver(kv)
    kv.request_status[ROOM] = KVPoll.Failed if how == "failure" else KVPoll.Success
    if how == "clear":
        receiver.clear()
    else:
        with pytest.raises(KVTransferError):
            receiver.failure_exception()
    assert room_guard.live_rooms(kv).holder(ROOM) is None
    later = _req("later")
    _admit(q, later)
    assert _entered(q, later)


@pytest.mark.parametrize("side", ["decode"], indirect=True)
def test_decode_abort_keeps_the_room_until_the_receiver_is_cleared(side: str) -> None:
    """Decode clears an aborted receiver later (after the prefill's drain ACK); until then its
    per-room state is the aborted request's, and a newcomer of that room is refused."""
    kv = _kv_mgr(side)
    q = _queue(side, kv)
    _admit(q, _req("a"))
    receiver = _receiver(kv)
    kv.request_status[ROOM] = KVPoll.WaitingForInput
    receiver.ensure_abort_notified = lambda **kw: None
    with patch("sglang.pdsafe.peer_release.on_receiver_aborted"):
        receiver.abort()
    assert room_guard.door(q, _req("b")) is not None
    receiver.clear()
    assert room_guard.door(q, _req("c")) is None


@pytest.mark.parametrize("side", ["prefill", "decode"], indirect=True)
def test_a_second_clear_leaves_the_rooms_next_request_alone(side: str) -> None:
    """Upstream clears an endpoint again after ``failure_exception`` cleared it (the queue
    retires the request). By then the guard may have admitted the room's next request: the
    second clear must neither drop that request's status (the decode scheduler died in
    ``check_status`` with a KeyError, hook-failure suite, CI of 2026-12-02) nor free its
    claim. A room nobody holds is still cleaned up by a late clear."""
    kv = _kv_mgr(side)
    q = _queue(side, kv)
    _admit(q, _req("a"))
    first = _sender(kv) if side == "prefill" else _receiver(kv)
    kv.request_status[ROOM] = KVPoll.Failed
    with pytest.raises(KVTransferError):
        first.failure_exception()
    assert ROOM not in kv.request_status
    nxt = _req("next")
    _admit(q, nxt)
    assert _entered(q, nxt), "the room's next request was refused after the first clear"
    kv.request_status[ROOM] = KVPoll.Bootstrapping  # the next request's endpoint opened it
    kv.transfer_infos[ROOM] = "next's metadata"
    first.clear()
    assert kv.request_status.get(ROOM) == KVPoll.Bootstrapping, (
        "a second clear of the first endpoint dropped the next request's status")
    assert kv.transfer_infos.get(ROOM) == "next's metadata"
    holder = room_guard.live_rooms(kv).holder(ROOM)
    assert holder is not None and holder.rid == "next", "the second clear freed the next claim"
    assert room_guard.door(q, _req("third")) is not None, "the live room stopped refusing"
    # The next request's own endpoint releases normally; a late clear of the first one then
    # finds the room free and drops what is left of it.
    second = _sender(kv) if side == "prefill" else _receiver(kv)
    second.clear()
    assert room_guard.live_rooms(kv).holder(ROOM) is None
    kv.request_status[ROOM] = KVPoll.Failed  # a stale status nobody owns
    first.clear()
    assert ROOM not in kv.request_status


# --------------------------------------------------------------------------- cross-pairing


def test_cross_paired_legs_are_refused_by_the_coverage_attestation() -> None:
    """Prefill kept A of room R, decode kept B of room R: prefill's transfer for A lands in
    B's reservation. Decode's commit gate must refuse it (explicit error), not decode B over
    A's KV."""
    a, b = list(range(100, 148)), list(range(200, 248))  # same length, different prompts
    attested_by_prefill = coverage.encode(coverage.build_coverage(ROOM, a, 0, len(a), 16))
    reserved_by_decode = coverage.build_coverage(ROOM, b, 0, len(b), 16)
    v = coverage.verify(attested_by_prefill, reserved_by_decode, rid="B")
    assert not v.ok and v.outcome is coverage.Outcome.MISMATCH
    assert v.differs == ("token_digest",) and v.counter == "coverage_mismatch_total"
    same = coverage.verify(coverage.encode(coverage.build_coverage(ROOM, b, 0, len(b), 16)),
                           reserved_by_decode)
    assert same.ok, "the digest is a binding, not a refusal of everything"


# --------------------------------------------------------------------------- HTTP: n > 1


def _normalized(n: int) -> GenerateReqInput:
    obj = GenerateReqInput(text="hello", sampling_params={"n": n, "max_new_tokens": 4},
                           bootstrap_host="127.0.0.1", bootstrap_port=1, bootstrap_room=ROOM)
    obj.normalize_batch_and_arguments()
    return obj


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_parallel_sampling_refused_400_on_pd(mode: str, monkeypatch) -> None:
    monkeypatch.delenv(room_guard.ENV_ENABLE, raising=False)
    tm = SimpleNamespace(server_args=SimpleNamespace(disaggregation_mode=mode))
    obj = _normalized(3)
    # upstream's _handle_batch_request copies obj[i] (one per prompt) for the prefix request
    # and every sample, so all n+1 scheduler requests carry the prompt's one room
    assert obj.batch_size == 1 and obj.parallel_sample_num == 3
    assert obj[0].bootstrap_room == ROOM
    before = metrics.value(room_guard.REFUSED_PARALLEL)
    with pytest.raises(room_guard.ParallelSamplingRefusedError) as e:
        room_guard.check_http_request(tm, obj)
    assert isinstance(e.value, ValueError) and e.value.status_code == 400
    assert f"this PD-disaggregated {mode} server" in str(e.value) and "n=1" in str(e.value)
    body = admission.error_content(e.value)
    assert body["error"]["param"] == "n"
    assert metrics.value(room_guard.REFUSED_PARALLEL) == before + 1
    room_guard.check_http_request(tm, _normalized(1))  # n=1 passes


def test_parallel_sampling_untouched_on_colocated_and_when_off(monkeypatch) -> None:
    room_guard.check_http_request(
        SimpleNamespace(server_args=SimpleNamespace(disaggregation_mode="null")), _normalized(4))
    monkeypatch.setenv(room_guard.ENV_ENABLE, "0")
    room_guard.check_http_request(
        SimpleNamespace(server_args=SimpleNamespace(disaggregation_mode="decode")),
        _normalized(4))


def test_parallel_sampling_unknown_mode_fails_closed(monkeypatch) -> None:
    monkeypatch.delenv(room_guard.ENV_ENABLE, raising=False)
    with pytest.raises(room_guard.ParallelSamplingRefusedError):
        room_guard.check_http_request(SimpleNamespace(server_args=None), _normalized(2))


# --------------------------------------------------------------------------- the duplicate's peer


def test_prefill_release_fails_the_refused_duplicates_decode_leg() -> None:
    """Prefill kept A and refused duplicate B; decode admitted B (A's decode leg was done). When
    A's sender is cleared, B's decode metadata, present now or arriving later, is answered with
    Failed carrying 409, so B's decode client gets an explicit 409 instead of waiting for its
    timeout. Real Mooncake prefill manager, real KV_STATUS encoding."""
    from sglang.pdsafe import peer_release
    from sglang.pdsafe.peer_release_wire import peer_refusal_status
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    from .test_peer_release_backends import _prefill_manager

    m, sent = _prefill_manager(MooncakeKVManager)
    info = SimpleNamespace(endpoint="127.0.0.1", dst_port=4321, is_dummy=False)
    reg = room_guard.live_rooms(m)
    reg.claim(ROOM, "a")
    reg.note_refused(ROOM)  # what door() records when it refuses B
    m.transfer_infos[ROOM] = {"decode-0": info}  # B's metadata arrived after A's transfer
    m.request_status[ROOM] = KVPoll.Success
    room_guard.released(_Endpoint(ROOM, m))
    assert reg.holder(ROOM) is None
    assert len(sent) == 1, sent
    parsed = m.parse_kv_status_message(sent[0][1])
    assert parsed[0] == ROOM and parsed[1] == int(KVPoll.Failed), parsed
    assert "duplicate" in parsed[3] and peer_refusal_status(parsed[3], 500) == 409, parsed[3]
    # B's metadata arriving after the clear is answered at once, never recorded as bootstrapped.
    m.transfer_infos[ROOM] = {"decode-0": info}
    m.request_status.pop(ROOM, None)
    m.update_status(ROOM, KVPoll.WaitingForInput)
    assert len(sent) == 2 and m.parse_kv_status_message(sent[1][1])[1] == int(KVPoll.Failed)
    assert ROOM not in m.request_status
    # A client's retry of the room within the TTL: its decode metadata is answered too (its
    # prefill sender fails at once), never left waiting.
    m.transfer_infos[ROOM] = {"decode-0": info}
    m.update_status(ROOM, KVPoll.WaitingForInput)
    assert len(sent) == 3 and m.parse_kv_status_message(sent[2][1])[1] == int(KVPoll.Failed)
    # The tombstone is short: the room is usable again after DUPLICATE_TTL_S.
    rec = peer_release._registry(m).get(ROOM)
    assert rec is not None and rec.expires - rec.t0 <= peer_release.DUPLICATE_TTL_S + 1e-6


def test_release_without_refused_duplicates_tells_nobody() -> None:
    """The normal path: a room released with no duplicate refused sends nothing."""
    from sglang.pdsafe import peer_release
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    from .test_peer_release_backends import _prefill_manager

    m, sent = _prefill_manager(MooncakeKVManager)
    room_guard.live_rooms(m).claim(ROOM, "a")
    m.transfer_infos[ROOM] = {"decode-0": SimpleNamespace(endpoint="127.0.0.1", dst_port=4321,
                                                          is_dummy=False)}
    m.request_status[ROOM] = KVPoll.Success
    room_guard.released(_Endpoint(ROOM, m))
    assert sent == [] and peer_release._registry(m).get(ROOM) is None
