"""Peer release on every backend, without servers: each backend's real prefill ABORT handler and
status path, driven with the frames peer release sends (``sglang.pdsafe.peer_release``).
MORI and Ascend cannot run here (ROCm/Ascend hardware), so this is their check that the same
common-layer logic runs for them. With real servers: test/pd/test_peer_release.py.
"""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest


def _backend_managers() -> dict[str, type]:
    from pdsafe_testkit.backends import import_mori_manager
    from sglang.srt.disaggregation.ascend.conn import AscendKVManager
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager

    MoriKVManager = import_mori_manager()
    return {"mooncake": MooncakeKVManager, "nixl": NixlKVManager, "mori": MoriKVManager,
            "ascend": AscendKVManager}


def _prefill_manager(cls: type) -> tuple[Any, list[tuple[str, list[bytes]]]]:
    """A prefill-side manager of ``cls`` with just the state its control thread touches; the
    control socket is replaced by a recorder."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    m = object.__new__(cls)
    m.disaggregation_mode = DisaggregationMode.PREFILL
    m.request_status, m.transfer_infos, m.req_to_decode_prefix_len = {}, {}, {}
    m.failure_lock, m.failure_records = threading.Lock(), {}
    m.enable_deferred_decode_kv_release = False
    m.attn_tp_rank = m.pp_rank = m.attn_cp_rank = 0
    m.pp_size = m.attn_cp_size = 1
    m.transfer_lock, m._abort_ack_lock = threading.Lock(), threading.Lock()
    m._deferred_ack_targets, m._deferred_ack_poisoned_rooms = {}, set()
    m._staging_outstanding = {}
    sent: list[tuple[str, list[bytes]]] = []
    m._send_multipart_locked = lambda ep, parts, is_ipv6=False: sent.append((ep, list(parts)))
    return m, sent


def _abort_handler(m: Any):
    return getattr(m, "_handle_abort_message", None) or m._handle_abort_notification


@pytest.mark.parametrize("backend", ["mooncake", "nixl", "mori", "ascend"])
def test_every_backend_answers_refused_rooms_through_the_common_layer(backend):
    """No servers: each backend's real prefill ABORT handler and status path, driven with the
    frames peer release sends. MORI and Ascend cannot run here (ROCm/Ascend hardware), so this
    is their check that the same common-layer logic runs for them.

    Room A: decode's metadata is there (no sender); a refusal notice from the prefill's own HTTP
    layer must answer decode Failed with the reason, drop the metadata and the status entry.
    Room B: the refusal arrives first; decode's metadata arriving later must be answered at once
    and never recorded as bootstrapped.
    """
    from types import SimpleNamespace

    from sglang.pdsafe import metrics, peer_release
    from sglang.srt.disaggregation.base.conn import KVPoll

    m, sent = _prefill_manager(_backend_managers()[backend])
    handler = _abort_handler(m)
    info = SimpleNamespace(endpoint="127.0.0.1", dst_port=4321, is_dummy=False)
    before = metrics.value("peer_notified_release_total")

    room_a = random.randrange(1 << 62)
    m.transfer_infos[room_a] = {"decode-0": info}
    m.request_status[room_a] = KVPoll.WaitingForInput  # what the metadata alone leaves behind
    reason = "ValueError: The input (400 tokens) is longer than the context length (320)"
    handler([b"ABORT", str(room_a).encode(), peer_release._wire(peer_release.ORIGIN_HTTP, reason)])
    assert len(sent) == 1, f"{backend}: decode was not answered: {sent}"
    endpoint, parts = sent[0]
    assert endpoint == "tcp://127.0.0.1:4321"
    parsed = m.parse_kv_status_message(parts)  # what decode's control thread will read
    assert parsed is not None and parsed[0] == room_a and parsed[1] == int(KVPoll.Failed)
    assert parsed[3] and "400 tokens" in parsed[3], parsed
    assert room_a not in m.transfer_infos and room_a not in m.request_status

    room_b = random.randrange(1 << 62)
    handler([b"ABORT", str(room_b).encode(), peer_release._wire(peer_release.ORIGIN_HTTP, reason)])
    assert len(sent) == 1, "nothing to answer before decode's metadata arrives"
    m.transfer_infos[room_b] = {"decode-0": info}
    m.update_status(room_b, KVPoll.WaitingForInput)  # the backend's "metadata complete" call
    assert len(sent) == 2 and m.parse_kv_status_message(sent[1][1])[1] == int(KVPoll.Failed)
    assert room_b not in m.request_status, "a refused room must never look bootstrapped"
    assert metrics.value("peer_notified_release_total") >= before + 2


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_a_room_a_prefill_check_fails_tells_its_decode_at_once(backend):
    """A prefill check that fails a room whose transfer has not started (``transfer.fail_room``:
    the coverage attestation, the source snapshot, the digest) answers the room's decode with
    ``Failed`` and the reason at once. Upstream tells a decode only when a write fails, so
    without this the decode's client waited for its bootstrap timeout (the hook-failure
    suite's finding of 2026-12-02)."""
    from types import SimpleNamespace

    from sglang.pdsafe import transfer
    from sglang.pdsafe.policy import Refusal
    from sglang.srt.disaggregation.base.conn import KVPoll

    m, sent = _prefill_manager(_backend_managers()[backend])
    room = random.randrange(1 << 62)
    m.transfer_infos[room] = {"decode-0": SimpleNamespace(endpoint="127.0.0.1", dst_port=4321,
                                                         is_dummy=False)}
    m.request_status[room] = KVPoll.WaitingForInput  # metadata in, the sender not yet sending
    reason = "pdsafe coverage: prefill could not attest what it wrote (RuntimeError: boom)"
    assert transfer.fail_room(m, room, Refusal(500, reason, "coverage_check_failed_total"))
    assert len(sent) == 1, f"{backend}: the decode was not told: {sent}"
    endpoint, parts = sent[0]
    assert endpoint == "tcp://127.0.0.1:4321"
    parsed = m.parse_kv_status_message(parts)
    assert parsed is not None and parsed[0] == room and parsed[1] == int(KVPoll.Failed)
    assert parsed[3] and "could not attest" in parsed[3], parsed


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_a_room_failed_before_its_sender_opens_fails_the_sender_at_once(backend):
    """A prefill check that fails a room it has no state for yet (its decode's metadata came
    first and was dropped, e.g. ``control_mac.verified`` could not run; the request has not
    reached this prefill) remembers the room as refused: the sender opened for it later fails
    at once with the reason. Before, ``fail_room`` returned with nothing recorded and that
    sender waited for metadata that never came, so its client waited for the bootstrap
    timeout (the fresh-clone CI of 0c3fb6f: the hook-failure suite's ``direct`` item, prefill
    leg, no answer within 20 s)."""
    from types import SimpleNamespace

    from sglang.pdsafe import peer_release, transfer
    from sglang.pdsafe.policy import Refusal
    from sglang.srt.disaggregation.base.conn import KVPoll

    m, sent = _prefill_manager(_backend_managers()[backend])
    room = random.randrange(1 << 62)
    reason = "the KV transfer (a control message for it could not be authenticated)"
    assert not transfer.fail_room(m, room, Refusal(500, reason, "control_mac_failed_total"))
    assert room not in m.request_status, "no state may be made up for the room"
    assert not sent, "no decode endpoint is known yet: nothing to tell"

    m.update_status(room, KVPoll.Bootstrapping)  # what upstream's sender does when it opens
    peer_release.on_sender_created(SimpleNamespace(kv_mgr=m, bootstrap_room=room))
    assert m.request_status[room] == KVPoll.Failed, "the late sender would wait for metadata"
    assert reason in str(m.failure_records.get(room)), m.failure_records


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_a_new_reservation_of_a_refused_room_is_told_too(backend):
    """A room refused here is remembered, and every *reservation* a decode publishes for it is
    answered Failed: a client's later request of the room from the same decode endpoint (a new
    transfer generation) is told again, while a repeated metadata message of one reservation is
    told once. Before, each endpoint was told once per refused room, so the second request's
    decode leg waited for its 20 s bootstrap timeout (the hook-failure suite's abort items with
    the prefill's coverage or source-chunk hook failing, 2026-12-06)."""
    from types import SimpleNamespace

    from sglang.pdsafe import peer_release, transfer_generation
    from sglang.srt.disaggregation.base.conn import KVPoll

    m, sent = _prefill_manager(_backend_managers()[backend])
    handler = _abort_handler(m)
    room = random.randrange(1 << 62)
    info = SimpleNamespace(endpoint="127.0.0.1", dst_port=4321, is_dummy=False)

    def metadata(generation: int) -> None:
        transfer_generation.note_metadata(m, room, [
            str(room).encode(), b"127.0.0.1", b"4321", b"sess", b"1,2", b"0", b"1",
            transfer_generation.encode_frame(generation)])
        m.transfer_infos[room] = {"decode-0": info}
        m.update_status(room, KVPoll.WaitingForInput)  # the backend's "metadata complete"

    handler([b"ABORT", str(room).encode(),
             peer_release._wire(peer_release.ORIGIN_HTTP, "refused: the prompt is too long")])
    metadata(11)
    assert len(sent) == 1, f"{backend}: the first reservation was not told: {sent}"
    metadata(11)  # the same reservation's metadata again: already told
    assert len(sent) == 1, f"{backend}: one reservation told twice: {sent}"
    metadata(12)  # a later request of the room from the same endpoint
    assert len(sent) == 2, f"{backend}: the room's next reservation was not told: {sent}"
    parsed = m.parse_kv_status_message(sent[1][1])
    assert parsed is not None and parsed[0] == room and parsed[1] == int(KVPoll.Failed)
    assert transfer_generation.frame_generation(sent[1][1]) == 12, \
        "the answer must carry the new reservation's generation (the decode drops others)"


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_fail_room_is_not_reentered_for_the_room_it_is_failing(backend):
    """Failing a room on a prefill tells its decode, and telling the decode runs hooks of its
    own (the generation frames of the Failed); a failing one of them has ``fail_room`` as its
    failure outcome, for the same room. In the hook-failure suite
    (``transfer_generation.generation_frames``, the abort items) that recursed until the stack
    overflowed and the prefill poisoned itself (RecursionError in the failure outcome); with
    the guard the case shows only the hook's declared outcome. Here the re-entry is made
    directly, from inside the first call: the inner call returns at once (the outer one is
    failing the room), the room is failed once, nothing is poisoned."""
    from types import SimpleNamespace

    from sglang.pdsafe import policy, transfer
    from sglang.pdsafe.policy import Refusal
    from sglang.srt.disaggregation.base.conn import KVPoll

    m, sent = _prefill_manager(_backend_managers()[backend])
    room = random.randrange(1 << 62)
    m.transfer_infos[room] = {"decode-0": SimpleNamespace(endpoint="127.0.0.1", dst_port=4321,
                                                         is_dummy=False)}
    m.request_status[room] = KVPoll.WaitingForInput
    refusal = Refusal(500, "a check failed", "coverage_check_failed_total")
    recorded: list[int] = []
    record_failure = m.record_failure

    def reentering(r: int, reason: str) -> None:
        recorded.append(r)
        record_failure(r, reason)
        assert transfer.fail_room(m, r, refusal), "the re-entered call must report the room failed"

    m.record_failure = reentering
    assert transfer.fail_room(m, room, refusal)
    assert recorded == [room], f"the room was failed {len(recorded)} times"
    assert len(sent) == 1, f"{backend}: the decode was told {len(sent)} times"
    assert policy.poisoned() is None


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_a_failing_metadata_check_fails_prefill_rooms_only(backend, tmp_path):
    """``peer_release.on_metadata_complete`` failing at its entry (hook-failure suite,
    2026-12-07). ``update_status(room, WaitingForInput)`` runs on both legs and the check is
    prefill-only: a decode's room goes on as upstream's (failing it there left its prefill leg
    waiting for its timeout); a prefill's room fails at once, never bootstrapped."""
    from pdsafe_testkit.hook_fail import Control, HookFail
    from sglang.pdsafe import policy
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    hook = "peer_release.on_metadata_complete"
    hf = HookFail(tmp_path / "control.json", "unit")
    try:
        hf.install([hook], poller=False)
        Control(seq=1, armed={hook: "entry"}).write(hf.control_path)
        hf.poll()
        decode, _ = _prefill_manager(_backend_managers()[backend])
        decode.disaggregation_mode = DisaggregationMode.DECODE
        prefill, _ = _prefill_manager(_backend_managers()[backend])
        room = random.randrange(1 << 62)
        for m in (decode, prefill):
            m.update_status(room, KVPoll.Bootstrapping)
            m.update_status(room, KVPoll.WaitingForInput)
        assert hf.injected == {hook: 2}
    finally:
        hf.uninstall()
        policy.reset_for_tests()
    assert decode.request_status[room] == KVPoll.WaitingForInput
    assert room not in decode.failure_records
    assert prefill.request_status[room] == KVPoll.Failed
    assert "could not check whether it refused the room" in prefill.failure_records[room]
