"""Signed control messages (``sglang.pdsafe.control_mac``; issue 21, item 2): a keyless process
on the cluster network cannot register as a decode, name a live room, re-point a decode's page
addresses, replay an earlier reservation's metadata, or forge a transfer's status, on
upstream's real Mooncake and NIXL control loops.

No servers. test_transfer_generation's harness: the decode side is upstream's real
``_register_kv_args`` / ``send_metadata`` (through the real ``_send_bootstrap_message``, where
the patch signs) after the real pairing step; the prefill side is each backend's real bootstrap
loop (where the patch checks first) and its real ``_send_multipart_locked`` (where the patch
signs; only the socket under it is a recorder); the decode's real control loop reads the
prefill's messages. The attacker is a second decode manager built the same way that holds no
key: every frame it sends is what upstream's own builders make, unsigned or signed with a key
of its own. Each attack runs twice: keyed (it fails, counted by type) and without a cluster
key (the unsigned mode, which is upstream's behaviour: the attack works, so the test sees it).

With real servers (every e2e test of the shared stacks runs keyed): test/pd/test_control_mac.py.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from sglang.pdsafe import bootstrap_auth, control_mac, metrics, pair_agreement, peer_capability
from sglang.pdsafe import transfer_generation as tg
from sglang.srt.disaggregation.base.conn import KVPoll

from . import test_peer_capability as cap
from . import test_transfer_generation as tgt
from .test_peer_capability import _mori_engine_desc  # noqa: F401 - autouse: MORI's real parsers

#: MORI: test/unit/test_mori_control_messages.py runs these tests on it (patch 0034).
BACKENDS = ["mooncake", "nixl"]
KEY = "cluster-key-0123456789abcdef0123456789abcdef"
OTHER_KEY = "another-key-fedcba9876543210fedcba9876543210"
WATCHED = tuple(control_mac.unauthenticated_counter(k)
                for k in control_mac.DECODE_KINDS + control_mac.PREFILL_KINDS) + (
    control_mac.REPLAYED, control_mac.FAILED, tg.STALE_STATUS)


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    from pdsafe_testkit.pd_context import published_pd_context

    for var in (bootstrap_auth.ENV_TOKEN, control_mac.ENV_ENABLE, control_mac.ENV_REQUIRE):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(control_mac, "_process_server_args", [])
    with published_pd_context("decode"):  # the decode queues build real Reqs
        yield


def _keyed(monkeypatch, key: str | None = KEY) -> None:
    """This process's scheduler starts with ``key`` as the cluster key (None: no key)."""
    if key is None:
        monkeypatch.delenv(bootstrap_auth.ENV_TOKEN, raising=False)
    else:
        monkeypatch.setenv(bootstrap_auth.ENV_TOKEN, key)
    control_mac.rank_starting(SimpleNamespace(api_key=None))


def _counts() -> dict[str, float]:
    return {n: metrics.value(n) for n in WATCHED}


def _delta(before: dict[str, float]) -> dict[str, float]:
    return {n: metrics.value(n) - v for n, v in before.items() if metrics.value(n) != v}


def _real_sends(prefill: tgt._Prefill) -> None:
    """The prefill's real ``_send_multipart_locked`` (where the patch signs), over a recording
    socket in place of the ZMQ one."""
    m = prefill.m
    del m._send_multipart_locked  # the harness's recorder: upstream's method again
    m._socket_send_locks = defaultdict(threading.Lock)
    m._connect = lambda endpoint, is_ipv6=False: SimpleNamespace(
        send_multipart=lambda parts: prefill.sent.append((endpoint, list(parts))))


def _mac(frame: bytes) -> bool:
    return frame.startswith(control_mac.FRAME_PREFIX)


# =========================================================================== pure


def test_a_mac_binds_every_frame_the_direction_and_the_key() -> None:
    (k,) = control_mac._mac_keys((KEY,))
    (other,) = control_mac._mac_keys((OTHER_KEY,))
    msg = [b"123", b"127.0.0.1", b"5555", b"\x00\x01" * 50]
    signed = control_mac.seal(k, control_mac.P2D, msg)
    body, tag = control_mac.split(signed)
    assert body == msg and len(tag) == control_mac.MAC_BYTES
    assert control_mac.valid([k], control_mac.P2D, body, tag)
    assert control_mac.valid([other, k], control_mac.P2D, body, tag), "any accepted key"
    assert not control_mac.valid([other], control_mac.P2D, body, tag)
    assert not control_mac.valid([k], control_mac.D2P, body, tag), "the other direction"
    for i in range(len(msg)):
        changed = list(msg)
        changed[i] = changed[i] + b"x"
        assert not control_mac.valid([k], control_mac.P2D, changed, tag), i
    # Frame boundaries are bound too: the same bytes split differently do not verify.
    assert not control_mac.valid([k], control_mac.P2D, [b"12", b"3" + msg[1]] + msg[2:], tag)
    assert control_mac.split(msg) == (msg, None)
    assert control_mac.split(msg + [control_mac.FRAME_PREFIX + b"zz"]) == (msg, b"")
    assert control_mac.split(msg + [control_mac.FRAME_PREFIX + b"00" * 8]) == (msg, b"")


def test_the_mac_key_is_derived_and_its_public_id_differs_per_key() -> None:
    (k,) = control_mac._mac_keys((KEY,))
    assert KEY.encode() not in k and len(k) == 32
    ids = {control_mac.key_id(x) for x in control_mac._mac_keys((KEY, OTHER_KEY))}
    assert len(ids) == 2 and all(len(i) == 12 for i in ids)


@pytest.mark.parametrize("prefill,decode,ok", [
    ("a", "a", True),
    ("a", "b", False),
    ("a,b", "b,a", True),   # mid-rotation: each signs with a key the other accepts
    ("a,b", "a", True),     # the new key b added second on the prefill only
    ("b,a", "a", False),    # the prefill already signs with b, the decode does not accept it
    ("none", "a", False),
    ("none", "none", True),
    ("off", "a", False),
])
def test_two_legs_agree_when_each_accepts_the_others_signing_key(prefill, decode, ok) -> None:
    def value(ids: str) -> str:
        return ids if ids in ("none", "off") else control_mac.SCHEME + ids

    assert control_mac.compatible(value(prefill), value(decode)) is ok


def test_upstreams_first_frames_are_the_ones_the_module_classifies_by() -> None:
    from sglang.srt.disaggregation.common import conn as common
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.disaggregation.nixl import conn as nixl

    assert control_mac._AUX == MooncakeKVManager.AUX_DATA_HEADER
    assert control_mac._NIXL_GUARD == nixl.GUARD
    from pdsafe_testkit.backends import import_mori_manager

    mori = sys.modules[import_mori_manager().__module__]  # with the mori package's stand-ins
    assert control_mac._MORI_GUARD == mori.MORI_GUARD
    assert mori.MoriKVManager.AUX_DATA_HEADER == control_mac._AUX
    assert control_mac.prefill_kind([mori.MORI_GUARD, b"None", b"x"]) == "registration"
    assert control_mac.prefill_kind([mori.MORI_GUARD, b"17", b"x"]) == "transfer_info"
    assert control_mac._ANNOUNCE == peer_capability.ANNOUNCE_TAG
    assert control_mac._ABORT == common.ABORT_TAG
    assert control_mac._ABORT_ACK == common.ABORT_ACK_TAG
    assert control_mac.prefill_kind([nixl.GUARD, b"None", b"x"]) == "registration"
    assert control_mac.prefill_kind([nixl.GUARD, b"17", b"x"]) == "transfer_info"
    assert control_mac.prefill_kind([b"None", b"x"]) == "registration"
    assert control_mac.prefill_kind([common.ABORT_TAG, b"17"]) == "abort"
    assert control_mac.prefill_kind([b"BOOTSTRAP", b"17", b"h", b"1"]) == "bootstrap"
    assert control_mac.decode_kind(common.AbortAck(17, 0, 5).to_zmq()) == "abort_ack"
    # The staging messages, by the literals upstream's staging handler sends.
    import inspect

    from sglang.srt.disaggregation.common import staging_handler

    source = inspect.getsource(staging_handler)
    for tag in control_mac._STAGING:
        assert b'b"' + tag + b'"' in source.encode(), tag
        assert "staging" in (control_mac.prefill_kind([tag, b"1"]),
                             control_mac.decode_kind([tag, b"1"]))


def test_without_a_key_the_scheduler_warns_and_exports_it_and_can_be_made_to_refuse(
        monkeypatch, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="sglang.pdsafe.control_mac"):
        assert control_mac.rank_starting(SimpleNamespace(api_key=None)) is False
    assert "UNSIGNED" in caplog.text and bootstrap_auth.ENV_TOKEN in caplog.text
    assert metrics.value(control_mac.GAUGE) == 1
    assert control_mac.rank_starting(SimpleNamespace(api_key="from-api-key")) is True
    assert metrics.value(control_mac.GAUGE) == 0
    monkeypatch.setenv(control_mac.ENV_REQUIRE, "1")
    with pytest.raises(control_mac.ClusterKeyError, match=bootstrap_auth.ENV_TOKEN):
        control_mac.rank_starting(SimpleNamespace(api_key=None))
    monkeypatch.setenv(bootstrap_auth.ENV_TOKEN, KEY)
    monkeypatch.setenv(control_mac.ENV_ENABLE, "0")
    with pytest.raises(control_mac.ClusterKeyError, match=control_mac.ENV_ENABLE):
        control_mac.rank_starting(SimpleNamespace(api_key=None))


def test_a_keyed_server_refuses_to_start_with_unsigned_staging_on(monkeypatch) -> None:
    """Staging's messages carry staging-buffer offsets and are not signed: a keyed server with
    upstream's staging switch on refuses to start, naming both remedies; unsigned it starts."""
    from sglang.srt.environ import envs

    monkeypatch.setenv(control_mac.ENV_STAGING, "true")
    assert envs.SGLANG_DISAGG_STAGING_BUFFER.get() is True, "the variable upstream reads"
    monkeypatch.setenv(bootstrap_auth.ENV_TOKEN, KEY)
    with pytest.raises(control_mac.ClusterKeyError, match=control_mac.ENV_STAGING) as e:
        control_mac.rank_starting(SimpleNamespace(api_key=None))
    assert control_mac.ENV_ENABLE in str(e.value)
    monkeypatch.setenv(control_mac.ENV_ENABLE, "0")
    assert control_mac.rank_starting(SimpleNamespace(api_key=None)) is False


# =========================================================================== pairing


def _prefill_info_under(monkeypatch, d: Any, key: str | None) -> dict[str, Any]:
    """What a fork prefill whose cluster key is ``key`` publishes (its settings agree with
    ``d``'s otherwise)."""
    with monkeypatch.context() as p:
        if key is None:
            p.delenv(bootstrap_auth.ENV_TOKEN, raising=False)
        else:
            p.setenv(bootstrap_auth.ENV_TOKEN, key)
        return cap.fork_prefill_info(d)


@pytest.mark.parametrize("prefill_key", [OTHER_KEY, None], ids=["other-key", "no-key"])
def test_a_leg_with_another_key_or_none_is_refused_at_pairing(monkeypatch, prefill_key) -> None:
    _keyed(monkeypatch)
    d = cap._decode_manager("mooncake", cap._identity("mooncake"))
    assert cap._pair(monkeypatch, d, _prefill_info_under(monkeypatch, d, prefill_key)) is not True
    message = pair_agreement._refused(d, cap.ADDR)
    assert message is not None and "control_key" in message, message
    assert bootstrap_auth.ENV_TOKEN in message and "rotation" in message, message


def test_a_rotation_in_progress_pairs(monkeypatch) -> None:
    """The decode moved to ``new,old``; the prefill accepts both with the old one first."""
    _keyed(monkeypatch, f"{OTHER_KEY},{KEY}")
    d = cap._decode_manager("nixl", cap._identity("nixl"))
    assert cap._pair(monkeypatch, d, _prefill_info_under(monkeypatch, d, f"{KEY},{OTHER_KEY}"))


# =========================================================================== served, signed


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_keyed_pair_signs_every_transfer_message_and_is_served(monkeypatch, backend) -> None:
    _keyed(monkeypatch)
    room = tgt._room()
    rank = tgt._Rank(monkeypatch, backend)
    registration = rank.registration()
    assert [m[0] for m in registration][:1] == [peer_capability.ANNOUNCE_TAG]
    assert all(_mac(m[-1]) for m in registration), "announcement and registration signed"
    dreq = rank.reserve("r", room)
    assert _mac(rank.last_metadata()[-1]), "metadata signed"
    assert rank.last_metadata()[-2] == tgt._gen(dreq.kv_receiver.pdsafe_transfer_generation())
    prefill = tgt._Prefill(backend)
    _real_sends(prefill)
    before = _counts()
    prefill.receive(monkeypatch, rank)
    assert list(prefill.m.transfer_infos[room]) == [rank.kv.pdsafe_decode_identity()]
    assert prefill.m.request_status[room] == KVPoll.WaitingForInput
    assert prefill.registered == [rank.kv.pdsafe_decode_identity()]

    prefill.m.conclude_transfer(bootstrap_room=room, status=KVPoll.Success)
    (success,) = prefill.take(rank)
    assert _mac(success[-1]), "the status carries the generation, so it goes signed"
    tgt._deliver(monkeypatch, rank.kv, [success])
    assert dreq.kv_receiver.poll() == KVPoll.Success
    assert _delta(before) == {}


# =========================================================================== the attacker


def _attacker_frames(monkeypatch, backend: str, room: int, *, key: str | None) -> list[list]:
    """What a process without the cluster key sends a prefill rank: an announcement of this
    wire version, a registration of its own transport identity and metadata naming the live
    ``room``, with a generation it made up: unsigned, or (``key``) signed with its own key."""
    attacker = cap._decode_manager(backend, "attacker-" + cap._identity(backend))
    attacker.rank_port = 6666
    frames = [
        [peer_capability.ANNOUNCE_TAG, pair_agreement.WIRE_VERSION.encode(),
         attacker.pdsafe_decode_identity().encode()],
        attacker.build_receiver_registration_message(),
        attacker.build_receiver_metadata_message(
            bootstrap_room=room, required_dst_info_num=1,
            kv_indices=np.arange(4, dtype=np.int32), aux_index=0, state_indices=None,
            decode_prefix_len=None, is_dummy=False) + [tgt._gen(12345)],
    ]
    if key is not None:
        (k,) = control_mac._mac_keys((key,))
        frames = [control_mac.seal(k, control_mac.D2P, f) for f in frames]
    return attacker, frames


@pytest.mark.parametrize("protected", [True, False], ids=["keyed", "no-key"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_keyless_attacker_neither_registers_nor_receives_a_live_rooms_kv(
        monkeypatch, backend, protected) -> None:
    """The victim's room is bootstrapped on the prefill. The attacker sends its frames twice:
    unsigned, then signed with a key of its own. Keyed, every one is dropped and counted by
    type before a parser sees it: the attacker is not registered with the transport, the room's
    metadata names only the victim (so the prefill writes the room's KV nowhere else), no
    notice goes out, the victim's room is untouched. Without a key (upstream's behaviour) the
    prefill registers the attacker and adds it to the room's destinations: it would write the
    victim's KV into the attacker's memory."""
    _keyed(monkeypatch, KEY if protected else None)
    room = tgt._room()
    rank, dreq, prefill = tgt._served(monkeypatch, backend, room)
    victim = rank.kv.pdsafe_decode_identity()
    attacker, unsigned = _attacker_frames(monkeypatch, backend, room, key=None)
    _, forged = _attacker_frames(monkeypatch, backend, room, key=OTHER_KEY)
    before = _counts()
    prefill.m._stopped = False
    cap._run_bootstrap_loop(monkeypatch, prefill.m, unsigned + forged)
    destinations = set(prefill.m.transfer_infos[room])
    if not protected:
        assert attacker.pdsafe_decode_identity() in prefill.registered
        if backend != "mori":
            assert attacker.pdsafe_decode_identity() in destinations, destinations
        # MORI's own handler ignores metadata for a room past Bootstrapping (upstream's
        # guard): the attacker registers, but must race the victim's metadata to be added.
        return
    assert destinations == {victim}
    assert prefill.registered == [victim]
    assert peer_capability.announced_version(prefill.m,
                                             attacker.pdsafe_decode_identity()) is None
    assert prefill.m.request_status[room] == KVPoll.WaitingForInput and prefill.sent == []
    assert _delta(before) == {control_mac.unauthenticated_counter(k): 2
                              for k in ("announce", "registration", "transfer_info")}
    assert dreq.kv_receiver.pdsafe_transfer_generation() == tg.target_generation(
        prefill.m, room, *rank.endpoint)


@pytest.mark.parametrize("protected", [True, False], ids=["keyed", "no-key"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_status_forged_with_an_observed_generation_is_dropped(monkeypatch, backend,
                                                                protected) -> None:
    """The attacker saw the reservation's generation on the wire (the metadata goes in clear)
    and sends the decode a Success carrying it, unsigned and signed with its own key, before
    any KV arrived. Keyed: both dropped, counted, the receiver still waits; the prefill's real
    Success is taken. Without a key the first forgery concludes the transfer: the decode
    would decode over pages nobody wrote."""
    _keyed(monkeypatch, KEY if protected else None)
    room = tgt._room()
    rank, dreq, prefill = tgt._served(monkeypatch, backend, room)
    g = dreq.kv_receiver.pdsafe_transfer_generation()
    empty = [b""] if backend == "mooncake" else []
    forged = tgt._upstream_status(backend, room, KVPoll.Success) + empty + [tgt._gen(g)]
    (other,) = control_mac._mac_keys((OTHER_KEY,))
    before = _counts()
    tgt._deliver(monkeypatch, rank.kv, [forged, control_mac.seal(other, control_mac.P2D, forged)])
    if not protected:
        assert dreq.kv_receiver.poll() == KVPoll.Success, "upstream takes the forgery"
        return
    assert dreq.kv_receiver.poll() != KVPoll.Success
    assert _delta(before) == {control_mac.unauthenticated_counter("kv_status"): 2}
    _real_sends(prefill)
    prefill.m.conclude_transfer(bootstrap_room=room, status=KVPoll.Success)
    tgt._deliver(monkeypatch, rank.kv, prefill.take(rank))
    assert dreq.kv_receiver.poll() == KVPoll.Success


@pytest.mark.parametrize("backend", BACKENDS)
def test_replayed_signed_metadata_of_an_earlier_reservation_is_dropped(monkeypatch,
                                                                       backend) -> None:
    """Room R reserved (g1) and released; reserved again (g2, other pages). The g1 metadata,
    signed and captured off the wire, replayed after g2's: dropped and counted; the prefill
    still writes to g2's pages."""
    _keyed(monkeypatch)
    room = tgt._room()
    rank = tgt._Rank(monkeypatch, backend, slots=2)
    first = rank.reserve("r", room)
    captured = list(rank.last_metadata())  # signed, as it went over the wire
    assert _mac(captured[-1])
    g1 = first.kv_receiver.pdsafe_transfer_generation()
    prefill = tgt._Prefill(backend)
    prefill.receive(monkeypatch, rank)
    assert tg.target_generation(prefill.m, room, *rank.endpoint) == g1
    rank.release(first)
    tgt._sender(prefill, room).clear()
    second = rank.reserve("r2", room)
    g2 = second.kv_receiver.pdsafe_transfer_generation()
    assert g2 != g1
    prefill.receive(monkeypatch, rank)
    assert tg.target_generation(prefill.m, room, *rank.endpoint) == g2
    before = _counts()
    prefill.m._stopped = False
    cap._run_bootstrap_loop(monkeypatch, prefill.m, [captured])
    assert tg.target_generation(prefill.m, room, *rank.endpoint) == g2
    info = prefill.m.transfer_infos[room][rank.kv.pdsafe_decode_identity()]
    assert list(np.asarray(info.dst_kv_indices)) == rank.page_order(second)
    assert _delta(before) == {control_mac.REPLAYED: 1}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_check_that_cannot_run_fails_the_room_at_once_on_both_legs(monkeypatch, backend):
    """The failure policy of ``control_mac.verified`` (what the hook-failure suite injects on
    real servers): the message is dropped, the room it names fails here, and a prefill tells
    the decode endpoint of dropped metadata at once (tagged with its generation), so neither
    client waits for a timeout."""
    from sglang.pdsafe import policy

    _keyed(monkeypatch)
    room = tgt._room()
    rank = tgt._Rank(monkeypatch, backend)
    dreq = rank.reserve("r", room)
    metadata = list(rank.last_metadata())
    prefill = tgt._Prefill(backend)
    prefill.m._stopped = False
    cap._run_bootstrap_loop(monkeypatch, prefill.m, rank.registration())
    spec = policy.HOOKS["control_mac.verified"]

    def broken(*a, **k):
        raise RuntimeError("the check cannot run")

    monkeypatch.setattr(spec, "body", broken)
    failed0 = metrics.value(control_mac.FAILED)
    assert prefill.m.pdsafe_verified_message(metadata) is None
    assert room not in prefill.m.transfer_infos
    (told,) = prefill.take(rank)
    r, status, _, reason = rank.kv.parse_kv_status_message(told)
    assert (r, status) == (room, int(KVPoll.Failed)) and "authenticated" in reason, reason
    assert told[-1] == tgt._gen(dreq.kv_receiver.pdsafe_transfer_generation())

    success = tgt._upstream_status(backend, room, KVPoll.Success)
    assert rank.kv.pdsafe_verified_message(success) is None
    assert rank.kv.request_status[room] == KVPoll.Failed
    assert metrics.value(control_mac.FAILED) >= failed0 + 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_unsigned_metadata_never_fails_a_live_room_whoever_sends_it(monkeypatch, backend):
    """A keyless sender names the room of a request whose sender is open on the prefill,
    before its decode's metadata arrived, from an identity that never announced (what a stock
    decode looks like): dropped and counted; the room is not refused, nothing is stored or
    sent, the room's own decode then bootstraps it signed. (Unkeyed, such metadata gets the
    stock-decode refusal, which fails the room: test_peer_capability.py.)"""
    _keyed(monkeypatch)
    room = tgt._room()
    rank = tgt._Rank(monkeypatch, backend)
    rank.reserve("r", room)
    prefill = tgt._Prefill(backend)
    prefill.m.request_status[room] = KVPoll.Bootstrapping  # the prefill's request is open
    attacker, frames = _attacker_frames(monkeypatch, backend, room, key=None)
    before = _counts()
    prefill.m._stopped = False
    cap._run_bootstrap_loop(monkeypatch, prefill.m, [frames[1], frames[2]])
    assert room not in prefill.m.transfer_infos and prefill.sent == []
    assert prefill.m.request_status[room] == KVPoll.Bootstrapping
    assert _delta(before) == {control_mac.unauthenticated_counter(k): 1
                              for k in ("registration", "transfer_info")}
    prefill.receive(monkeypatch, rank)
    assert list(prefill.m.transfer_infos[room]) == [rank.kv.pdsafe_decode_identity()]
    assert prefill.m.request_status[room] == KVPoll.WaitingForInput


# =========================================================================== ABORT / ABORT_ACK


def _aborted(monkeypatch, backend: str):
    """A decode rank (deferred release on) whose reservation of a room the prefill took, then
    aborted: its deferred release armed with the generation g (test_abort_generation's
    harness), the prefill sending through its real ``_send_multipart_locked``."""
    from . import test_abort_generation as abg

    room = tgt._room()
    rank, dreq, prefill = abg._served(monkeypatch, backend, room)
    _real_sends(prefill)
    g = dreq.kv_receiver.pdsafe_transfer_generation()
    dreq.kv_receiver.abort()
    assert abg._armed(rank, room) == g
    (abort,) = abg._aborts(rank)
    return room, rank, prefill, g, abort


@pytest.mark.parametrize("protected", [True, False], ids=["keyed", "no-key"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_forged_abort_ack_never_releases_pages_the_prefill_may_still_write(
        monkeypatch, backend, protected) -> None:
    """The decode aborted a transfer whose generation g went over the wire in clear; its pages
    stay held until every prefill rank that could write them acknowledges the drain. The
    attacker sends that ACK naming g, unsigned and signed with its own key, before the
    prefill drained. Keyed: both dropped, counted, the pages still held; the prefill's own
    (signed) ACK then releases them. Without a key (upstream's behaviour) the forgery makes
    the release safe at once: the decode would hand pages to the next request while the
    prefill may still write into them (the distributed use-after-free)."""
    from sglang.srt.disaggregation.common.conn import AbortAck

    _keyed(monkeypatch, KEY if protected else None)
    room, rank, prefill, g, abort = _aborted(monkeypatch, backend)
    assert _mac(abort[-1]) is protected, "the ABORT goes signed to a keyed prefill"
    forged = AbortAck(room, tgt.PREFILL_RANK, g).to_zmq()
    (other,) = control_mac._mac_keys((OTHER_KEY,))
    before = _counts()
    tgt._deliver(monkeypatch, rank.kv, [forged, control_mac.seal(other, control_mac.P2D, forged)])
    if not protected:
        assert rank.kv.is_abort_release_safe(room, 1), "upstream takes the forged ACK"
        return
    assert not rank.kv.is_abort_release_safe(room, 1)
    assert _delta(before) == {control_mac.unauthenticated_counter("abort_ack"): 2}
    prefill.m._stopped = False
    cap._run_bootstrap_loop(monkeypatch, prefill.m, [abort])
    assert prefill.m.request_status[room] == KVPoll.Failed
    (ack,) = [p for p in prefill.take(rank) if p[0] == b"ABORT_ACK"]
    assert _mac(ack[-1]) and ack[3] == str(g).encode(), "the drain ACK goes signed"
    tgt._deliver(monkeypatch, rank.kv, [ack])
    assert rank.kv.is_abort_release_safe(room, 1)
    assert _delta(before) == {control_mac.unauthenticated_counter("abort_ack"): 2}


@pytest.mark.parametrize("protected", [True, False], ids=["keyed", "no-key"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_forged_abort_neither_fails_a_live_transfer_nor_arms_an_ack(
        monkeypatch, backend, protected) -> None:
    """The attacker names a live room and its observed generation in an ABORT (its own
    endpoint as the ACK target, so a drain ACK would tell it when the KV stops), unsigned and
    signed with its own key. Keyed: both dropped and counted; the prefill's transfer goes on,
    no ACK is sent anywhere. Without a key the first one fails the live request."""
    from sglang.srt.disaggregation.common.conn import AbortNotification

    from . import test_abort_generation as abg

    _keyed(monkeypatch, KEY if protected else None)
    room = tgt._room()
    rank, dreq, prefill = abg._served(monkeypatch, backend, room)
    _real_sends(prefill)
    g = dreq.kv_receiver.pdsafe_transfer_generation()
    forged = AbortNotification(room=room, decode_ip=tgt.HOST, decode_port=6666,
                               generation=g).to_zmq()
    (other,) = control_mac._mac_keys((OTHER_KEY,))
    before = _counts()
    prefill.m._stopped = False
    cap._run_bootstrap_loop(monkeypatch, prefill.m,
                            [forged, control_mac.seal(other, control_mac.D2P, forged)])
    if not protected:
        assert prefill.m.request_status[room] == KVPoll.Failed, "upstream takes the forgery"
        return
    assert prefill.m.request_status[room] == KVPoll.WaitingForInput
    assert prefill.sent == []
    assert _delta(before) == {control_mac.unauthenticated_counter("abort"): 2}


def _unclaimed_abort(monkeypatch, backend: str) -> tuple[tgt._Prefill, int, list[bytes]]:
    """A keyed prefill whose sender of a fresh room is open (no decode sent metadata for it)
    takes an unsigned ABORT of that room through its real bootstrap loop (the grace long
    enough that only the test resolves it)."""
    from sglang.pdsafe import unsigned_abort
    from sglang.srt.disaggregation.common.conn import AbortNotification

    _keyed(monkeypatch)
    monkeypatch.setenv(unsigned_abort.ENV_GRACE, "600")
    prefill = tgt._Prefill(backend)
    room = tgt._room()
    prefill.m.update_status(room, KVPoll.Bootstrapping)
    abort = AbortNotification(room=room, decode_ip=tgt.HOST, decode_port=6666).to_zmq()
    prefill.m._stopped = False
    cap._run_bootstrap_loop(monkeypatch, prefill.m, [abort])
    assert prefill.m.request_status[room] == KVPoll.Bootstrapping, "held, not acted on yet"
    return prefill, room, abort


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_unsigned_abort_of_an_unclaimed_room_is_honoured_after_the_grace(
        monkeypatch, backend) -> None:
    """A decode of another release refuses this keyed prefill at pairing and tells it with an
    unsigned ABORT (it signs nothing for a prefill of another wire version). No decode claims
    the room with signed metadata within the grace: the ABORT is honoured, the prefill's side
    of the request fails at once (not at its waiting timeout), counted."""
    from sglang.pdsafe import unsigned_abort

    before = metrics.value(unsigned_abort.HONOURED)
    dropped = metrics.value(unsigned_abort.DROPPED)
    prefill, room, _ = _unclaimed_abort(monkeypatch, backend)
    unsigned_abort.expire(prefill.m, unsigned_abort._table(prefill.m), time.monotonic() + 900)
    assert prefill.m.request_status[room] == KVPoll.Failed
    assert metrics.value(unsigned_abort.HONOURED) == before + 1
    assert metrics.value(unsigned_abort.DROPPED) == dropped


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_early_unsigned_abort_cannot_fail_a_room_its_decode_then_claims(
        monkeypatch, backend) -> None:
    """A keyless sender that learnt a room sends its ABORT before the decode's metadata: held;
    the decode of this release then claims the room with signed metadata; at the end of the
    grace the ABORT is dropped (counted) and the transfer goes on."""
    from sglang.pdsafe import unsigned_abort

    prefill, room, _ = _unclaimed_abort(monkeypatch, backend)
    dropped = metrics.value(unsigned_abort.DROPPED)
    rank = tgt._Rank(monkeypatch, backend)
    rank.reserve("r", room)
    prefill.receive(monkeypatch, rank)
    assert room in prefill.m.transfer_infos
    prefill.m.update_status(room, KVPoll.WaitingForInput)
    unsigned_abort.expire(prefill.m, unsigned_abort._table(prefill.m), time.monotonic() + 900)
    assert prefill.m.request_status[room] == KVPoll.WaitingForInput
    assert metrics.value(unsigned_abort.DROPPED) == dropped + 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_peer_release_notices_go_signed_to_a_prefill_of_this_release(monkeypatch, backend):
    """A server's HTTP layer tells a prefill to drop a room (a bare ABORT, ``peer_notifier``):
    signed for a prefill that published this wire version, so the keyed prefill acts on it
    at once even after the room's decode sent signed metadata; unchanged for one that
    published another or none (it would misread the frame)."""
    from sglang.pdsafe import pair_settings
    from sglang.pdsafe.peer_release_wire import ORIGIN_PEER, encode_abort

    from . import test_abort_generation as abg

    _keyed(monkeypatch)
    room = tgt._room()
    rank, dreq, prefill = abg._served(monkeypatch, backend, room)
    notice = encode_abort(room, ORIGIN_PEER, "the decode server's HTTP layer refused it")
    ours = {"pdsafe_pair": {"wire_version": pair_settings.WIRE_VERSION}}
    for other in ({}, {"pdsafe_pair": {"wire_version": "sglang-pdsafe-pair/5"}}):
        assert control_mac.sealed_notice(other, list(notice)) == notice
    signed = control_mac.sealed_notice(ours, list(notice))
    assert len(signed) == len(notice) + 1 and _mac(signed[-1])
    before = _counts()
    prefill.m._stopped = False
    cap._run_bootstrap_loop(monkeypatch, prefill.m, [notice])
    assert prefill.m.request_status[room] == KVPoll.WaitingForInput, "unsigned: dropped"
    assert _delta(before) == {control_mac.unauthenticated_counter("abort"): 1}
    prefill.m._stopped = False
    cap._run_bootstrap_loop(monkeypatch, prefill.m, [signed])
    assert prefill.m.request_status[room] == KVPoll.Failed
    assert _delta(before) == {control_mac.unauthenticated_counter("abort"): 1}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_keyed_decode_drops_unsigned_staging_and_takes_a_stock_prefills_unsigned_ack(
        monkeypatch, backend) -> None:
    """An unsigned staging message at a keyed decode is nobody's (a keyed server runs no
    staging): dropped. An unsigned ABORT_ACK of a room whose metadata carried no transfer
    generation (a stock prefill's, under the operator's waiver) is upstream's to handle; one
    naming no generation (upstream's feature-off format) is not counted either."""
    from sglang.srt.disaggregation.common.conn import ABORT_ACK_TAG

    _keyed(monkeypatch)
    rank = tgt._Rank(monkeypatch, backend)
    before = _counts()
    staging = [b"STAGING_REQ", b"1", b"0", b"0", b"0"]
    assert rank.kv.pdsafe_verified_message(staging) is None
    stranger = tgt._room()  # no metadata of this room went to any prefill
    ack = [ABORT_ACK_TAG, str(stranger).encode(), b"0", b"77"]
    assert rank.kv.pdsafe_verified_message(ack) == ack
    legacy = [ABORT_ACK_TAG, str(stranger).encode()]
    assert rank.kv.pdsafe_verified_message(legacy) == legacy
    assert _delta(before) == {control_mac.unauthenticated_counter("staging"): 1}
