"""A prefill keeps decode metadata only for rooms a request of its own claims
(``sglang.pdsafe.unclaimed_rooms``; issue 21, item 4), on upstream's real Mooncake and NIXL
prefill KV managers, without servers: the frames go through the real status path
(``parse_kv_status_message`` reads what the decode would read). With real servers:
test/pd/test_unclaimed_rooms.py.
"""

from __future__ import annotations

import random
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_peer_release_backends import _backend_managers, _prefill_manager  # noqa: E402

BACKENDS = ["mooncake", "nixl"]


def _metadata(m: Any, room: int, port: int = 4321, generation: int | None = None) -> None:
    """What the backend's bootstrap thread does with one decode metadata message: store the
    decode's page addresses, then note the message (the hook under test runs there)."""
    from sglang.pdsafe import transfer_generation

    m.transfer_infos.setdefault(room, {})[f"decode-{port}"] = SimpleNamespace(
        endpoint="127.0.0.1", dst_port=port, is_dummy=False, dst_kv_indices=list(range(64)))
    msg = [str(room).encode(), b"127.0.0.1", str(port).encode(), b"sess", b"", b"0", b"1"]
    if generation is not None:
        msg.append(transfer_generation.encode_frame(generation))
    transfer_generation.note_metadata(m, room, msg)


def _table(m: Any):
    from sglang.pdsafe import transfer, unclaimed_rooms

    return transfer.leg(m).table(unclaimed_rooms.TABLE, unclaimed_rooms.Unclaimed)


@pytest.mark.parametrize("backend", BACKENDS)
def test_metadata_no_request_claims_is_dropped_and_its_decode_told(backend, monkeypatch):
    """Room A: nobody claims it. At its deadline its page addresses are forgotten, the decode
    is answered Failed (HTTP 400, naming the variable), and a sender opened for the room later
    fails at once. Room B: its request arrives (the record opens): it is never dropped."""
    from sglang.pdsafe import metrics, peer_release, transfer, unclaimed_rooms
    from sglang.srt.disaggregation.base.conn import KVPoll

    monkeypatch.setenv(unclaimed_rooms.ENV_TIMEOUT, "5")
    m, sent = _prefill_manager(_backend_managers()[backend])
    room_a, room_b = random.randrange(1 << 62), random.randrange(1 << 62)
    dropped0 = metrics.value(unclaimed_rooms.DROPPED)
    _metadata(m, room_a, generation=7)
    _metadata(m, room_b, generation=8)
    transfer.leg(m).open(room_b, "rid-b")  # room B's request reached this prefill
    table = _table(m)
    assert set(table.rooms) == {room_a}

    # Not before the deadline...
    unclaimed_rooms.expire(m, table, time.monotonic() + 1.0)
    assert room_a in m.transfer_infos and not sent
    # ...then dropped and told.
    unclaimed_rooms.expire(m, table, time.monotonic() + 6.0)
    assert room_a not in m.transfer_infos, "the page addresses must be forgotten"
    assert room_b in m.transfer_infos, "a claimed room must be left alone"
    assert len(sent) == 1, sent
    parsed = m.parse_kv_status_message(sent[0][1])
    assert parsed[0] == room_a and parsed[1] == int(KVPoll.Failed)
    assert "HTTP 400" in parsed[3] and unclaimed_rooms.ENV_TIMEOUT in parsed[3], parsed[3]
    assert metrics.value(unclaimed_rooms.DROPPED) == dropped0 + 1

    # The room's request arriving late: its sender fails at once, nothing is written.
    sender = SimpleNamespace(kv_mgr=m, bootstrap_room=room_a)
    m.update_status(room_a, KVPoll.Bootstrapping)  # what the sender's constructor does first
    peer_release.on_sender_created(sender)
    assert m.request_status.get(room_a) == KVPoll.Failed


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dropped_room_is_refused_for_one_timeout_then_serves_a_new_request(backend,
                                                                              monkeypatch):
    """The refusal a drop leaves behind fails the dropped room's own late request for one more
    timeout, not for peer release's 600 s default: a client that reuses the room number later
    for a new request (new metadata, new generation) is served. CI of 28a7bdc: the room-reuse
    check got 400 for 30 s after a duplicate's unclaimed reservation was dropped."""
    from sglang.pdsafe import peer_release, unclaimed_rooms
    from sglang.srt.disaggregation.base.conn import KVPoll

    monkeypatch.setenv(unclaimed_rooms.ENV_TIMEOUT, "0.5")
    m, sent = _prefill_manager(_backend_managers()[backend])
    room = random.randrange(1 << 62)
    _metadata(m, room, generation=7)
    unclaimed_rooms.expire(m, _table(m), time.monotonic() + 1.0)
    assert len(sent) == 1 and room not in m.transfer_infos
    rec = peer_release._registry(m).get(room)
    assert rec is not None, "the dropped room must be remembered as refused"
    assert rec.expires - rec.t0 == pytest.approx(0.5), (
        "the refusal of a dropped room must last one unclaimed-room timeout")
    # Within it, the late request fails at once.
    late = SimpleNamespace(kv_mgr=m, bootstrap_room=room)
    m.update_status(room, KVPoll.Bootstrapping)
    peer_release.on_sender_created(late)
    assert m.request_status.get(room) == KVPoll.Failed
    peer_release.on_sender_cleared(late)
    m.request_status.pop(room, None)
    # After it, a new request of the room: its metadata is kept and its sender is not failed.
    time.sleep(0.6)
    assert peer_release._registry(m).get(room) is None
    _metadata(m, room, generation=8)
    assert room in m.transfer_infos
    m.update_status(room, KVPoll.Bootstrapping)
    peer_release.on_sender_created(SimpleNamespace(kv_mgr=m, bootstrap_room=room))
    assert m.request_status.get(room) == KVPoll.Bootstrapping
    assert len(sent) == 1, "the new reservation must not be answered Failed"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_room_whose_request_came_and_went_is_not_dropped(backend, monkeypatch):
    """A request that claimed its room and finished before the deadline: nothing is sent to
    its decode and the room is not remembered as refused (its next request is served)."""
    from sglang.pdsafe import peer_release, transfer, unclaimed_rooms

    monkeypatch.setenv(unclaimed_rooms.ENV_TIMEOUT, "5")
    m, sent = _prefill_manager(_backend_managers()[backend])
    room = random.randrange(1 << 62)
    _metadata(m, room)
    lg = transfer.leg(m)
    rec = lg.open(room, "rid")
    lg.close(rec)
    unclaimed_rooms.expire(m, _table(m), time.monotonic() + 6.0)
    assert not sent
    assert peer_release._registry(m).get(room) is None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("protected", [True, False], ids=["protected", "stock"])
def test_a_room_flood_holds_bounded_state(backend, protected, monkeypatch):
    """Metadata messages naming rooms nobody sends, in two waves of 6,000. With the protection
    at most the limit (here 500) wait in upstream's table, each evicted room's decode is told,
    and once pdsafe's own per-room tables reach their bounds (here 1,000 rooms) the second
    wave adds no memory; without it (``SGLANG_PDSAFE_UNCLAIMED_ROOMS=0``, upstream's
    behaviour) every room is kept and the memory grows with each wave: the test sees the bug.
    The production bounds and the measured bytes per room: docs/operator-guide.md."""
    from sglang.pdsafe import metrics, peer_release, transfer_generation, unclaimed_rooms

    monkeypatch.setenv(unclaimed_rooms.ENV_LIMIT, "500")
    monkeypatch.setattr(peer_release, "MAX_ROOMS", 1000)
    monkeypatch.setattr(transfer_generation, "MAX_ROOMS", 1000)
    if not protected:
        monkeypatch.setenv(unclaimed_rooms.ENV_ENABLE, "0")
    m, _ = _prefill_manager(_backend_managers()[backend])
    told = [0]  # a count, not the frames: the recorder must not hold memory per room

    def count(ep: str, parts: list[bytes], is_ipv6: bool = False) -> None:
        told[0] += 1

    m._send_multipart_locked = count
    evicted0 = metrics.value(unclaimed_rooms.EVICTED)
    wave = 6_000
    rng = random.Random(5)
    tracemalloc.start()
    held = []
    for _ in range(2):
        for _ in range(wave):
            _metadata(m, rng.randrange(1 << 62))
        held.append(tracemalloc.get_traced_memory()[0])
    tracemalloc.stop()
    growth = held[1] - held[0]
    print(f"{backend} {'protected' if protected else 'stock'}: {len(m.transfer_infos)} rooms "
          f"kept of {2 * wave}; the second wave of {wave} added {growth / 1e3:.0f} kB "
          f"({growth / wave:.0f} B per room)")
    if not protected:
        assert len(m.transfer_infos) == 2 * wave, "stock keeps every room (the bug guarded)"
        assert growth > 500 * wave, "stock memory must grow with the flood"
        return
    assert len(m.transfer_infos) <= 500 and len(_table(m)) <= 500
    assert metrics.value(unclaimed_rooms.EVICTED) == evicted0 + 2 * wave - 500
    assert told[0] == 2 * wave - 500, "every evicted room's decode must be told"
    assert growth < 20 * wave, f"memory still grows with the flood: {growth} B"


def test_the_sweeper_drops_on_its_own(monkeypatch):
    """No caller drives ``expire``: the manager's daemon sweeper drops the room at its
    deadline (a short timeout here)."""
    from sglang.pdsafe import unclaimed_rooms

    monkeypatch.setenv(unclaimed_rooms.ENV_TIMEOUT, "0.3")
    m, sent = _prefill_manager(_backend_managers()["mooncake"])
    room = random.randrange(1 << 62)
    _metadata(m, room)
    deadline = time.monotonic() + 5.0
    while not sent and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sent and room not in m.transfer_infos
    assert any(t.name == "pdsafe-unclaimed-rooms" for t in threading.enumerate())


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_a_malformed_timeout_refuses_the_start(value, monkeypatch):
    from sglang.pdsafe import unclaimed_rooms

    monkeypatch.setenv(unclaimed_rooms.ENV_TIMEOUT, value)
    with pytest.raises(unclaimed_rooms.UnclaimedRoomSettingError,
                       match=unclaimed_rooms.ENV_TIMEOUT):
        unclaimed_rooms.check_settings()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hook", ["transfer_generation.note_metadata",
                                  "unclaimed_rooms.note_metadata"])
def test_a_note_that_fails_refuses_the_room_and_upstream_skips_it(backend, hook, tmp_path):
    """A metadata note that cannot run fails the room at once: the prefill manager's named
    call (``pdsafe_note_transfer_generation``, patch 0025) returns False, so upstream's
    bootstrap thread skips the room instead of reading its dropped metadata (the KeyError
    that killed NIXL's bootstrap thread, hook-failure suite of 2026-12-07); the decode is told
    Failed with the generation it sent (an untagged notice is dropped there); the room's
    request, arriving later, fails at once."""
    from pdsafe_testkit.hook_fail import Control, HookFail
    from sglang.pdsafe import peer_release, policy, transfer_generation
    from sglang.srt.disaggregation.base.conn import KVPoll

    m, sent = _prefill_manager(_backend_managers()[backend])
    room = random.randrange(1 << 62)
    hf = HookFail(tmp_path / "control.json", "unit")
    try:
        hf.install([hook], poller=False)
        Control(seq=1, armed={hook: "entry"}).write(hf.control_path)
        hf.poll()
        m.transfer_infos.setdefault(room, {})["decode-4321"] = SimpleNamespace(
            endpoint="127.0.0.1", dst_port=4321, is_dummy=False, dst_kv_indices=list(range(8)))
        msg = [str(room).encode(), b"127.0.0.1", b"4321", b"sess", b"", b"0", b"1",
               transfer_generation.encode_frame(31)]
        assert m.pdsafe_note_transfer_generation(room, msg) is False
        assert hf.injected == {hook: 1}
    finally:
        hf.uninstall()
        policy.reset_for_tests()
    assert room not in m.transfer_infos, "the refused room's page addresses must be dropped"
    assert len(sent) == 1, sent
    parsed = m.parse_kv_status_message(sent[0][1])
    assert parsed[0] == room and parsed[1] == int(KVPoll.Failed)
    assert transfer_generation.frame_generation(sent[0][1]) == 31, \
        "the refusal must carry the decode's generation (the decode drops an untagged one)"
    m.update_status(room, KVPoll.Bootstrapping)
    peer_release.on_sender_created(SimpleNamespace(kv_mgr=m, bootstrap_room=room))
    assert m.request_status.get(room) == KVPoll.Failed
