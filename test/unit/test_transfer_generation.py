"""Every control message of a PD transfer carries its reservation's generation
(``sglang.pdsafe.transfer_generation``, patch 0025; issue 9 item 2).

No servers. The decode side is upstream's real ``DecodePreallocQueue._send_kv_metadata`` on
test_page_generation's queue (a real paged allocator with page generations installed, a real
request pool and metadata slots) with the backend's real receiver (upstream's constructor,
``send_metadata``, ``clear``) on test_peer_capability's decode manager (built without its
constructor, after the real pairing step saw what the prefill published; the bootstrap sockets
are recorders), and each backend's real decode control loop (Mooncake ``start_decode_thread``,
NIXL ``_start_decode_listener_thread``) fed frames through a stand-in socket, down to upstream's
``apply_prefill_status``, ``_handle_aux_data`` (into a real numpy aux buffer) and
``handle_chunk_ready``. The prefill side is each backend's real bootstrap-thread loop fed what
the decode ranks sent, then its real ``send_kv_status_message``,
``pdsafe_send_failed_status_tagged``,
``conclude_transfer``, ``send_aux_tcp`` and ``send_chunk_ready`` (socket replaced by a
recorder), ``CommonKVSender.pdsafe_transfer_generation`` / ``clear``, and the real digest row
of test_kv_integrity_wiring's prefill (``send_kv_chunk`` with the real digester). What the
decode reads back is parsed with the backend's own ``parse_kv_status_message``.

What this does not show: real servers and transports (ZMQ, Mooncake/NIXL engines), TP > 1 in
separate processes (two ranks here are two queues driven alike), MORI/Ascend (MORI carries no
generation; Ascend inherits Mooncake's loops), staging end to end (only the CHUNK_READY
check), and the receiver's ``init`` (its prefill fields are set as the bootstrap server would).
The last three tests cover what the module's first version missed: the window before a
reservation's metadata is out (a late Success or aux message of the room's previous transfer),
and a room reused through another decode endpoint (not a split).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from sglang.pdsafe import (
    coverage,
    kv_integrity,
    metrics,
    page_generation,
    pair_agreement,
    peer_policy,
    peer_release,
    transfer,
)
from sglang.pdsafe import transfer_generation as tg
from sglang.srt.disaggregation.base.conn import KVPoll

from . import test_kv_integrity_wiring as kvw
from . import test_page_generation as pg
from . import test_peer_capability as cap
from .test_peer_capability import _mori_engine_desc  # noqa: F401 - autouse: MORI's real parsers

#: MORI runs these tests too, from test/unit/test_mori_control_messages.py (named by the patch
#: that wires it, 0034, so the earlier prefixes of the series do not run them).
BACKENDS = ["mooncake", "nixl"]
#: Backends with a staging path (CHUNK_READY) and with a TCP aux-data path.
STAGING_BACKENDS = ("mooncake", "nixl")
TCP_AUX_BACKENDS = ("mooncake", "mori")
HOST = "127.0.0.1"
PREFILL_PORT = cap.PREFILL_RANKS[0]["rank_port"]  # the prefill rank the tests talk to
PREFILL_RANK = 1  # its unique rank (attn_tp_rank 1): every status it sends names it
AUX_LEN = 16  # bytes of the one aux buffer per metadata slot
WATCHED = (tg.STALE_STATUS, tg.STALE_AUX, tg.STALE_CHUNK, tg.SPLIT, tg.FAILED,
           "hook_api_mismatch_total", kv_integrity.FAILED)


@pytest.fixture(autouse=True)
def _env(monkeypatch) -> Iterator[None]:
    from pdsafe_testkit.pd_context import published_pd_context

    for var in (peer_policy.ENV_WAIVE, pair_agreement.ENV_ENABLE, pair_agreement.ENV_SKIP,
                peer_release.ENV_ENABLE, page_generation.ENV_ENABLE, kv_integrity.ENV_ENABLE,
                coverage.ENV_MODE):
        monkeypatch.delenv(var, raising=False)
    with published_pd_context("decode"):  # the decode queues build real Reqs
        yield


def _counts() -> dict[str, float]:
    return {n: metrics.value(n) for n in WATCHED}


def _delta(before: dict[str, float]) -> dict[str, float]:
    return {n: metrics.value(n) - v for n, v in before.items() if metrics.value(n) != v}


def _gen(g: int) -> bytes:
    """The generation frame, spelled out here (not by the module)."""
    return b"PDSAFE_GEN1:" + str(g).encode("ascii")


def _upstream_status(backend: str, room: int, status: KVPoll, reason: str | None = None,
                     *, reason_frame: bool = False) -> list[bytes]:
    """Upstream 0.5.23's status frames from prefill rank ``PREFILL_RANK``: NIXL tags them and
    always carries a reason frame; Mooncake sends three frames (plus the reason on pdsafe's
    Failed notice only, ``reason_frame``)."""
    head = [str(room).encode(), str(int(status)).encode(), str(PREFILL_RANK).encode()]
    if backend == "nixl":
        return [b"KV_STATUS", *head, (reason or "").encode()]
    if backend == "mori":  # tagged with its guard, always with a reason frame
        return [b"MoriMsgGuard", *head, (reason or "").encode()]
    return head + ([(reason or "").encode()] if reason_frame else [])


def _receiver_cls(backend: str) -> type:
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver
    from sglang.srt.disaggregation.nixl.conn import NixlKVReceiver

    if backend == "mori":
        return _mori_module().MoriKVReceiver
    return {"mooncake": MooncakeKVReceiver, "nixl": NixlKVReceiver}[backend]


def _mori_module() -> Any:
    """MORI's conn module (imported with the mori package's stand-ins: ROCm only)."""
    import sys

    from pdsafe_testkit.backends import import_mori_manager

    return sys.modules[import_mori_manager().__module__]


def _sender(prefill: _Prefill, room: int) -> Any:
    """The backend's real sender for ``room`` on ``prefill``, without its constructor."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender
    from sglang.srt.disaggregation.nixl.conn import NixlKVSender

    s = object.__new__({"mooncake": MooncakeKVSender, "nixl": NixlKVSender,
                        "mori": _mori_module().MoriKVSender}[prefill.backend])
    s.kv_mgr, s.bootstrap_room, s.conclude_state = prefill.m, room, None
    s._owns_bootstrap_room = True
    return s


def _deliver(monkeypatch, kv: Any, frames: list[list[bytes]]) -> None:
    """Run the backend's real decode control loop of ``kv`` over ``frames``, in this thread."""
    start = (getattr(kv, "start_decode_thread", None)
             or getattr(kv, "_start_decode_listener_thread", None) or kv._start_decode_thread)
    cap._run_control_loop(monkeypatch, kv, start, frames)


# --------------------------------------------------------------------------- decode rank


class _Rank:
    """One decode rank: test_page_generation's real prealloc queue and test_peer_capability's
    decode manager of ``backend`` (its control-thread state added), paired with the prefill at
    ``cap.ADDR`` (``prefill``: "fork" of this release, "stock" under the pair-agreement
    waiver, "older" fork of wire version /2 with pair agreement off)."""

    def __init__(self, monkeypatch, backend: str, *, port: int = cap.DECODE_PORT,
                 prefill: str = "fork", slots: int = 8) -> None:
        from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator

        self.backend = backend
        self.q = pg._Decode()
        self.q.meta_alloc = ReqToMetadataIdxAllocator(slots)
        self.q.pq.req_to_metadata_buffer_idx_allocator = self.q.meta_alloc
        self.q.tq.req_to_metadata_buffer_idx_allocator = self.q.meta_alloc
        kv = cap._decode_manager(backend, cap._identity(backend))
        kv.rank_port = port
        kv.request_status, kv.prefill_response_tracker = {}, {}
        kv.required_prefill_response_num_table = {}
        kv.addr_to_rooms_tracker = defaultdict(set)
        kv.failure_lock, kv.failure_records = threading.Lock(), {}
        kv._deferred_ack_targets, kv._deferred_ack_poisoned_rooms = {}, set()
        kv._staging_outstanding, kv._staging_handler = {}, None
        kv.enable_deferred_decode_kv_release = False
        kv._worker_threads = []
        kv.server_args = SimpleNamespace(enable_pd_role_switch=False)
        kv._start_heartbeat_checker_thread = lambda: None  # a real thread otherwise
        if prefill == "stock":
            monkeypatch.setenv(peer_policy.ENV_WAIVE, peer_policy.PAIR_AGREEMENT)
            info = cap.STOCK_PREFILL_INFO
        elif prefill == "older":
            monkeypatch.setenv(pair_agreement.ENV_ENABLE, "0")
            info = cap.fork_prefill_info(kv, "sglang-pdsafe-pair/2")
        else:
            info = cap.fork_prefill_info(kv)
        assert cap._pair(monkeypatch, kv, info) is True
        self.aux = np.zeros((slots, AUX_LEN), dtype=np.uint8)  # upstream's aux buffer
        kv.kv_args.aux_data_ptrs, kv.kv_args.aux_item_lens = [self.aux.ctypes.data], [AUX_LEN]
        self.kv = kv
        self.metadata: list[tuple[int, list[bytes]]] = []  # (prefill rank port, frames)

    @property
    def endpoint(self) -> tuple[str, int]:
        return HOST, self.kv.rank_port

    @property
    def tcp(self) -> str:
        return f"tcp://{HOST}:{self.kv.rank_port}"

    def registration(self) -> list[list[bytes]]:
        """What the real ``_register_kv_args`` sends prefill rank ``PREFILL_PORT``."""
        return [parts for port, parts in cap._register(self.kv, self.backend)
                if port == PREFILL_PORT]

    def receiver(self, room: int, ports: tuple[int, ...] = (PREFILL_PORT,),
                 dst_info_num: int = 1) -> Any:
        """The backend's receiver for ``room`` through upstream's constructor (status
        Bootstrapping); what ``init`` would read from the prefill's bootstrap server is set."""
        r = _receiver_cls(self.backend)(self.kv, cap.ADDR, room)
        r.bootstrap_infos = [{"rank_ip": HOST, "rank_port": p, "is_dummy": False}
                             for p in ports]
        r.required_dst_info_num = dst_info_num
        self.kv.required_prefill_response_num_table[room] = 1

        def connect(info: dict[str, Any]) -> tuple[Any, Any]:
            return SimpleNamespace(send_multipart=lambda parts: self.metadata.append(
                (info["rank_port"], list(parts)))), threading.Lock()

        r._connect_to_bootstrap_server = connect
        return r

    def reserve(self, rid: str, room: int, receiver: Any = None) -> Any:
        """Upstream's real ``_send_kv_metadata`` for a new request (``receiver`` or a new one)."""
        from sglang.srt.disaggregation.decode import DecodeRequest

        req = self.q.request(rid, room)
        r = receiver if receiver is not None else self.receiver(room)
        dreq = DecodeRequest(req=req, kv_receiver=r)
        kv_indices = self.q.rtt.req_to_token[req.kv.req_pool_idx, :pg.TOKENS]
        # Each rank is its own process in a server: only its own tables are attached there.
        saved = page_generation._PROCESS_TABLES
        page_generation._PROCESS_TABLES = _tables(self)
        try:
            self.q.pq._send_kv_metadata(dreq, kv_indices, pg.PAGE, None, decode_prefix_len=0)
        finally:
            page_generation._PROCESS_TABLES = saved
        return dreq

    def release(self, dreq: Any) -> None:
        """The request is gone: upstream's receiver ``clear``, page release, slot free."""
        dreq.kv_receiver.clear()
        self.q.tq._release_request(dreq)
        self.q.meta_alloc.free(dreq.metadata_buffer_index)
        self.q.alloc.merge_and_sort_free()

    def page_order(self, dreq: Any) -> list[int]:
        """The reservation's pages in transfer order, from its request-pool row."""
        row = self.q.rtt.req_to_token[dreq.req.kv.req_pool_idx, :pg.TOKENS]
        return list(dict.fromkeys(int(p) for p in (row // pg.PAGE).tolist()))

    def upstream_metadata(self, dreq: Any) -> list[bytes]:
        """The backend's own metadata frames for ``dreq``'s reservation (no pdsafe frame)."""
        return self.kv.build_receiver_metadata_message(
            bootstrap_room=dreq.req.bootstrap_room, required_dst_info_num=1,
            kv_indices=np.asarray(self.page_order(dreq), dtype=np.int32),
            aux_index=dreq.metadata_buffer_index, state_indices=None, decode_prefix_len=0,
            is_dummy=False)

    def last_metadata(self) -> list[bytes]:
        return self.metadata[-1][1]


def _break_lockstep(rank: _Rank) -> None:
    """This rank frees one page the others did not: its allocator's epoch moves ahead."""
    rank.q.alloc.free(rank.q.alloc.alloc(pg.PAGE))
    rank.q.alloc.merge_and_sort_free()


# --------------------------------------------------------------------------- prefill rank


class _Prefill:
    """One prefill rank of ``backend`` (test_peer_capability's, unique rank PREFILL_RANK) with
    a real aux buffer whose slot ``i`` holds bytes ``i*16 .. i*16+15``."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.m, self.sent, self.registered = cap._prefill(backend)
        self.m.attn_tp_rank = PREFILL_RANK
        self.aux = np.arange(8 * AUX_LEN, dtype=np.uint8).reshape(8, AUX_LEN)
        self.m.kv_args = SimpleNamespace(engine_rank=0, aux_data_ptrs=[self.aux.ctypes.data],
                                         aux_item_lens=[AUX_LEN])

    def receive(self, monkeypatch, *ranks: _Rank) -> None:
        """The real bootstrap loop over each rank's registration and the metadata it sent
        this prefill rank since the last call."""
        frames: list[list[bytes]] = []
        for rank in ranks:
            frames += rank.registration()
            frames += [parts for port, parts in rank.metadata if port == PREFILL_PORT]
            rank.metadata.clear()
        self.m._stopped = False  # the previous run's drain stopped Mooncake's loop
        cap._run_bootstrap_loop(monkeypatch, self.m, frames)

    def take(self, rank: _Rank) -> list[list[bytes]]:
        """The messages sent to ``rank`` since the last call (removed from the record)."""
        mine = [parts for ep, parts in self.sent if ep == rank.tcp]
        self.sent[:] = [(ep, parts) for ep, parts in self.sent if ep != rank.tcp]
        return mine


def _served(monkeypatch, backend: str, room: int, **rank_kw: Any) -> tuple[_Rank, Any, _Prefill]:
    """A decode rank that reserved ``room`` (rid "r") and a prefill rank that took its
    metadata through the real bootstrap loop."""
    rank = _Rank(monkeypatch, backend, **rank_kw)
    dreq = rank.reserve("r", room)
    prefill = _Prefill(backend)
    prefill.receive(monkeypatch, rank)
    assert room in prefill.m.transfer_infos and prefill.sent == []
    return rank, dreq, prefill


def _room() -> int:
    return cap._rooms(1)[0]


# =========================================================================== decode: mint, send


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_sends_its_generation_last_to_a_prefill_of_this_release(monkeypatch, backend):
    room = _room()
    rank = _Rank(monkeypatch, backend)
    before = _counts()
    r = rank.receiver(room, ports=(7001, 7002))
    dreq = rank.reserve("rid-1", room, r)
    g = r.pdsafe_transfer_generation()
    assert 0 < g < 1 << 63
    assert [port for port, _ in rank.metadata] == [7001, 7002], "one message per prefill rank"
    for _, parts in rank.metadata:
        assert parts == rank.upstream_metadata(dreq) + [_gen(g)]
        assert sum(p.startswith(b"PDSAFE_GEN1:") for p in parts) == 1
    assert _delta(before) == {}


@pytest.mark.parametrize("prefill", ["stock", "older"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prefill_without_this_wire_version_gets_upstreams_metadata_and_nothing_is_dropped(
        monkeypatch, backend, prefill):
    """A stock prefill (paired under the pair-agreement waiver) or a fork prefill of /2 (pair
    agreement off) never sees the frame, and never sends one back: the decode then handles
    every message for the room as upstream does (status, aux, chunk-ready)."""
    room = _room()
    rank = _Rank(monkeypatch, backend, prefill=prefill)
    dreq = rank.reserve("r", room)
    rec = transfer.of(dreq.req)
    assert rec.generation != 0 and not rec.generation_sent, "minted, just not sent"
    assert dreq.kv_receiver.pdsafe_transfer_generation() == 0, \
        "the digest must bind the generation sent (none), not the one minted"
    assert rank.last_metadata() == rank.upstream_metadata(dreq)
    before = _counts()
    slot = dreq.metadata_buffer_index
    arrived: list[tuple] = []
    rank.kv._staging_handler = SimpleNamespace(
        handle_chunk_arrived=lambda *a: arrived.append(a))
    frames = [[b"CHUNK_READY", str(room).encode(), b"0", b"0", b"2", b"w0", b"1"]] \
        if backend in STAGING_BACKENDS else []
    if backend in TCP_AUX_BACKENDS:
        frames.append([b"AUX_DATA", str(room).encode(), b"0", str(slot).encode(),
                       AUX_LEN.to_bytes(4, "big"), bytes(range(100, 100 + AUX_LEN))])
    frames.append(_upstream_status(backend, room, KVPoll.Success))
    for f in frames:
        kind = {b"CHUNK_READY": "chunk_ready", b"AUX_DATA": "aux_data"}.get(f[0], "kv_status")
        assert rank.kv.pdsafe_drops_stale_message(kind, f) is False, f
    _deliver(monkeypatch, rank.kv, frames)
    assert arrived == ([(room, 0, 0, 2, "w0")] if backend in STAGING_BACKENDS else [])
    if backend in TCP_AUX_BACKENDS:
        assert rank.aux[slot].tolist() == list(range(100, 100 + AUX_LEN))
    assert rank.kv.request_status[room] == KVPoll.Success
    assert _delta(before) == {}


def _tables(rank: Any) -> list[Any]:
    """The generation tables attached to ``rank``'s allocator (its process's, in a server)."""
    return [page_generation.table_of(p.leaf) for p in page_generation._parts(rank.q.alloc)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_new_reservation_of_a_replayed_room_gets_a_new_generation_and_ranks_agree(
        monkeypatch, backend):
    """Same room, same rid, same metadata slot, same pages, after a free: only the epochs of
    the page-generation tables differ, and they give a new generation. Two ranks driven alike
    (lockstep) derive the same generations without talking."""
    room = _room()
    ranks = [_Rank(monkeypatch, backend, port=5555 + i, slots=1) for i in range(2)]
    seen: list[list[tuple[int, list[int], int, tuple[int, ...]]]] = [[], []]
    for _ in range(2):
        for i, rank in enumerate(ranks):
            monkeypatch.setattr(page_generation, "_PROCESS_TABLES", _tables(rank))
            epochs = page_generation.process_epochs()  # what reserve() reads
            dreq = rank.reserve("rid-same", room)
            g = dreq.kv_receiver.pdsafe_transfer_generation()
            assert rank.last_metadata()[-1] == _gen(g)
            seen[i].append((g, rank.page_order(dreq), dreq.metadata_buffer_index, epochs))
            rank.release(dreq)
    (g1, pages1, slot1, ep1), (g2, pages2, slot2, ep2) = seen[0]
    assert (pages1, slot1) == (pages2, slot2), "the same pages and slot were reserved again"
    assert ep1 and ep1 != ep2, "the free in between moved the epochs"
    assert g1 != g2
    assert [s[0] for s in seen[1]] == [g1, g2], "the other rank derived the same generations"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_keyed_generation_cannot_be_computed_from_the_reservation(monkeypatch, backend):
    """With the key the decode's launcher prepares (``generation_key.prepare``), the minted
    generation is a MAC: someone who knows everything the reservation is (room, metadata
    slot, pages in transfer order, page epochs) but not the key computes another value (the
    unkeyed derivation, what upstream-style hashing would give), while the key reproduces
    it, and two ranks holding the key derive the same generation. A second launch (a restart)
    has a new key, so the same reservation gets another generation."""
    from sglang.pdsafe import generation_key

    monkeypatch.delenv(generation_key.ENV_KEY, raising=False)
    args = SimpleNamespace(nnodes=1, api_key=None)
    monkeypatch.delenv("SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN", raising=False)
    generation_key.prepare(args)
    key = generation_key.current()
    assert len(key) == generation_key.KEY_BYTES
    room = _room()
    seen = []
    for i in range(2):
        rank = _Rank(monkeypatch, backend, port=5655 + i, slots=1)
        monkeypatch.setattr(page_generation, "_PROCESS_TABLES", _tables(rank))
        epochs = page_generation.process_epochs()
        dreq = rank.reserve("rid-keyed", room)
        inputs = dict(room=room, aux_index=dreq.metadata_buffer_index,
                      page_indices=rank.page_order(dreq), epochs=epochs)
        seen.append((dreq.kv_receiver.pdsafe_transfer_generation(), inputs))
    (g0, inputs), (g1, _) = seen
    assert g0 == g1, "two ranks holding the key must mint alike"
    assert tg.derive(**inputs, key=key) == g0, "the generation is the MAC of the reservation"
    assert tg.derive(**inputs) != g0, "without the key the generation must not be computable"
    generation_key.prepare(args)  # a restarted decode's launcher
    assert tg.derive(**inputs, key=generation_key.current()) != g0


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_page_generations_a_reservation_counter_stands_in(monkeypatch, backend):
    room = _room()
    ranks = [_Rank(monkeypatch, backend, port=5555 + i, slots=1) for i in range(2)]
    monkeypatch.setenv(page_generation.ENV_ENABLE, "0")
    gens: list[list[int]] = [[], []]
    for _ in range(2):
        for i, rank in enumerate(ranks):
            monkeypatch.setattr(page_generation, "_PROCESS_TABLES", _tables(rank))
            assert page_generation.process_epochs() == ()
            dreq = rank.reserve("rid-same", room)
            gens[i].append(dreq.kv_receiver.pdsafe_transfer_generation())
            rank.release(dreq)
    assert gens[0][0] != gens[0][1] and 0 not in gens[0]
    assert gens[1] == gens[0]


# =========================================================================== prefill: echo


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_tags_each_status_with_the_generation_that_endpoint_sent(monkeypatch,
                                                                        backend):
    """Four decode endpoints of one room on one prefill rank: A and B sent different
    generations (out of lockstep), C sent none (its metadata is upstream's alone, as a stock
    decode's), D a malformed one (taken as none). The real loop records them; every status
    path tags each target with its own, C and D get upstream's exact frames, and the decode's
    parser still reads room, status, rank and reason (never the generation frame)."""
    room = _room()
    a, b, c, d = (_Rank(monkeypatch, backend, port=p) for p in (5555, 5556, 5557, 5558))
    _break_lockstep(b)
    ga = a.reserve("r", room, a.receiver(room, dst_info_num=4)).kv_receiver
    gb = b.reserve("r", room, b.receiver(room, dst_info_num=4)).kv_receiver
    ga, gb = ga.pdsafe_transfer_generation(), gb.pdsafe_transfer_generation()
    assert ga != gb
    for rank, extra in ((c, []), (d, [b"PDSAFE_GEN1:0"])):
        rank.metadata.append((PREFILL_PORT, rank.kv.build_receiver_metadata_message(
            bootstrap_room=room, required_dst_info_num=4,
            kv_indices=np.arange(4, dtype=np.int32), aux_index=0, state_indices=None,
            decode_prefix_len=None, is_dummy=False) + extra))
    prefill = _Prefill(backend)
    prefill.receive(monkeypatch, a, b, c, d)
    assert prefill.m.request_status[room] == KVPoll.WaitingForInput
    targets = [a.endpoint, b.endpoint, c.endpoint, d.endpoint]
    before = _counts()

    prefill.m.send_kv_status_message(targets=targets, bootstrap_room=room,
                                     status=KVPoll.Success)
    prefill.m.send_kv_status_message(targets=targets, bootstrap_room=room,
                                     status=KVPoll.Failed, failure_reason="prefill failed")
    notice = "refused on the prefill: the prompt is too long"
    results = prefill.m.pdsafe_send_failed_status_tagged(room, targets, notice)
    assert [err for _, err in results] == [None] * 4
    assert [ep for ep, _ in prefill.sent] == [a.tcp, b.tcp, c.tcp, d.tcp] * 3
    assert _delta(before) == {}

    nixl = backend in ("nixl", "mori")  # their status always carries a reason frame
    for rank, g in ((a, ga), (b, gb), (c, None), (d, None)):
        success, failed, refused = prefill.take(rank)
        up_success = _upstream_status(backend, room, KVPoll.Success)
        up_failed = _upstream_status(backend, room, KVPoll.Failed,
                                     "prefill failed" if nixl else None)
        up_refused = _upstream_status(backend, room, KVPoll.Failed, notice, reason_frame=True)
        if g is None:
            assert (success, failed, refused) == (up_success, up_failed, up_refused)
        else:
            empty = [] if nixl else [b""]  # Mooncake: an empty reason frame goes first
            assert success == up_success + empty + [_gen(g)]
            assert failed == up_failed + empty + [_gen(g)]
            assert refused == up_refused + [_gen(g)]
        parse = rank.kv.parse_kv_status_message
        assert parse(success) == (room, int(KVPoll.Success), PREFILL_RANK, None)
        assert parse(failed) == (room, int(KVPoll.Failed), PREFILL_RANK,
                                 "prefill failed" if nixl else None)
        assert parse(refused) == (room, int(KVPoll.Failed), PREFILL_RANK, notice)


@pytest.mark.parametrize("backend", BACKENDS)
def test_conclude_transfer_success_reaches_the_decode_through_its_real_loop(monkeypatch,
                                                                           backend):
    room = _room()
    rank, dreq, prefill = _served(monkeypatch, backend, room)
    g = dreq.kv_receiver.pdsafe_transfer_generation()
    assert prefill.m.conclude_transfer(bootstrap_room=room, status=KVPoll.Success) == \
        KVPoll.Success
    (msg,) = prefill.take(rank)
    assert msg[-1] == _gen(g)
    before = _counts()
    _deliver(monkeypatch, rank.kv, [msg])
    assert rank.kv.request_status[room] == KVPoll.Success
    assert dreq.kv_receiver.poll() == KVPoll.Success
    assert _delta(before) == {}


# =========================================================================== decode: verdicts


def _variants(msg: list[bytes], g: int, backend: str) -> dict[str, list[bytes]]:
    """``msg`` (tagged with ``g``) with another, no or a malformed generation."""
    body = msg[:-1]
    if backend == "mooncake" and body[-1] == b"":
        stock = body[:-1]  # upstream's exact frames (no empty reason)
    else:
        stock = body
    return {
        "another": body + [_gen(g - 1 if g > 1 else g + 1)],
        "none": stock,
        "empty": body + [b"PDSAFE_GEN1:"],
        "zero": body + [b"PDSAFE_GEN1:0"],
        "not-digits": body + [b"PDSAFE_GEN1:x" + str(g).encode()],
        "negative": body + [b"PDSAFE_GEN1:-" + str(g).encode()],
        "too-long": body + [b"PDSAFE_GEN1:" + b"9" * 20],
        "over-63-bits": body + [_gen(1 << 63)],
        "with-suffix": body + [_gen(g) + b" "],
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_drops_a_status_without_the_live_generation_until_the_receiver_is_cleared(
        monkeypatch, backend):
    room = _room()
    rank, dreq, prefill = _served(monkeypatch, backend, room)
    g = dreq.kv_receiver.pdsafe_transfer_generation()
    prefill.m.send_kv_status_message(targets=[rank.endpoint], bootstrap_room=room,
                                     status=KVPoll.Success)
    (live,) = prefill.take(rank)
    variants = _variants(live, g, backend)
    drops = rank.kv.pdsafe_drops_stale_message
    before = _counts()
    assert drops("kv_status", live) is False
    for name, msg in variants.items():
        assert rank.kv.parse_kv_status_message(msg)[:3] == (room, int(KVPoll.Success),
                                                            PREFILL_RANK), name
        assert drops("kv_status", msg) is True, name
    assert _delta(before) == {tg.STALE_STATUS: len(variants)}

    rank.release(dreq)  # the real clear(): the room has no live reservation here any more
    before = _counts()
    for name, msg in [("live", live), *variants.items()]:
        # A Success for a room whose metadata is not out (released here) is stale whatever
        # it carries; upstream would drop it too (the room is cleared), now it is counted.
        assert drops("kv_status", msg) is True, name
    assert _delta(before) == {tg.STALE_STATUS: 1 + len(variants)}
    prefill.m.send_kv_status_message(targets=[rank.endpoint], bootstrap_room=room,
                                     status=KVPoll.Failed, failure_reason="late")
    (failed,) = prefill.take(rank)
    assert drops("kv_status", failed) is False, \
        "a Failed notice changes no page: upstream's handling (it drops a cleared room's)"


def _send_aux_tcp(prefill: _Prefill, room: int, info: Any, src_slot: int) -> None:
    """The backend's real TCP aux send of prefill slot ``src_slot`` for ``info``'s decode."""
    if prefill.backend == "mori":
        # MORI sends on a socket of its own cache (not _send_multipart_locked): record it.
        prefill.m._connect_threadsafe = lambda ep, is_ipv6=False: SimpleNamespace(
            send_multipart=lambda parts: prefill.sent.append((ep, list(parts))))
        peer = SimpleNamespace(endpoint=info.endpoint, dst_port=info.dst_port,
                               dst_aux_mem_descs=[object()])
        assert prefill.m.send_aux_tcp(peer, src_slot, info.dst_aux_index, room) == []
    else:
        assert prefill.m.send_aux_tcp(info, prefill_aux_index=src_slot, dst_aux_ptrs=[0]) == 0


def _send_aux_data(prefill: _Prefill, port: int, room: int, slot: int, data: bytes) -> None:
    """The backend's real single aux-data message to the decode control port ``port``."""
    if prefill.backend == "mori":
        prefill.m._send_aux_data_to_endpoint(HOST, port, room, 0, slot, data)
    else:
        prefill.m.send_aux_data_to_endpoint(HOST, port, room, 0, slot, data)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in TCP_AUX_BACKENDS])
def test_tcp_aux_data_needs_the_generation_and_the_reservations_slot(monkeypatch, backend):
    """Through the real decode loop into a real aux buffer: only the prefill's aux data with
    the room's generation and the reservation's own slot is written; a stale generation, none,
    another slot, or a room this decode holds no reservation of write nothing. MORI sends its
    aux data on its own sockets (patch 0034 tags and signs it there)."""
    room = _room()
    rank, dreq, prefill = _served(monkeypatch, backend, room)
    g, slot = dreq.kv_receiver.pdsafe_transfer_generation(), dreq.metadata_buffer_index
    other_slot = (slot + 1) % len(rank.aux)
    info = next(iter(prefill.m.transfer_infos[room].values()))
    assert info.dst_aux_index == slot
    _send_aux_tcp(prefill, room, info, 3)
    (aux,) = prefill.take(rank)
    assert aux[0] == b"AUX_DATA" and aux[3] == str(slot).encode() and aux[-1] == _gen(g)
    assert aux[5] == bytes(prefill.aux[3])
    data = bytes(range(200, 200 + AUX_LEN))
    _send_aux_data(prefill, rank.kv.rank_port, room, other_slot, data)
    _send_aux_data(prefill, rank.kv.rank_port, room + 1, slot, data)
    wrong_slot, unknown_room = prefill.take(rank)
    assert wrong_slot[-1] == _gen(g), "the prefill's own generation: only the slot is wrong"
    stale = {"another generation": aux[:-1] + [_gen(g + 1)], "none": aux[:-1],
             "malformed": aux[:-1] + [b"PDSAFE_GEN1:?"], "another slot": wrong_slot,
             "unknown room": unknown_room, "unknown room, forged": unknown_room + [_gen(g)]}
    before = _counts()
    _deliver(monkeypatch, rank.kv, list(stale.values()))
    assert not rank.aux.any(), "a stale aux message wrote the buffer"
    assert _delta(before) == {tg.STALE_AUX: len(stale)}
    _deliver(monkeypatch, rank.kv, [aux])
    assert rank.aux[slot].tolist() == prefill.aux[3].tolist()
    assert not np.delete(rank.aux, slot, axis=0).any()
    assert _delta(before) == {tg.STALE_AUX: len(stale)}


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in STAGING_BACKENDS])
def test_a_stale_chunk_ready_never_reaches_the_staging_handler(monkeypatch, backend):
    room = _room()
    rank, dreq, prefill = _served(monkeypatch, backend, room)
    g = dreq.kv_receiver.pdsafe_transfer_generation()
    arrived: list[tuple] = []
    rank.kv._staging_handler = SimpleNamespace(
        handle_chunk_arrived=lambda *a: arrived.append(a))
    prefill.m.send_chunk_ready(room=room, chunk_idx=1, page_start=2, num_pages=3,
                               writer_id="w7", targets=[rank.endpoint])
    (ready,) = prefill.take(rank)
    assert ready[0] == b"CHUNK_READY" and ready[-1] == _gen(g)
    before = _counts()
    _deliver(monkeypatch, rank.kv, [ready[:-1] + [_gen(g + 1)], ready[:-1],
                                    ready[:-1] + [b"PDSAFE_GEN1:1e3"]])
    assert arrived == []
    assert _delta(before) == {tg.STALE_CHUNK: 3}
    _deliver(monkeypatch, rank.kv, [ready])
    assert arrived == [(room, 1, 2, 3, "w7")]
    assert _delta(before) == {tg.STALE_CHUNK: 3}


# =========================================================================== prefill: digest


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_digests_with_the_generation_its_decode_ranks_sent(monkeypatch, backend):
    room = _room()
    a, b = (_Rank(monkeypatch, backend, port=p) for p in (5555, 5556))
    gens = {r.reserve("r", room, r.receiver(room, dst_info_num=2))
            .kv_receiver.pdsafe_transfer_generation() for r in (a, b)}
    assert len(gens) == 1 and 0 not in gens, "ranks in lockstep agree"
    prefill = _Prefill(backend)
    prefill.receive(monkeypatch, a, b)
    sender = _sender(prefill, room)
    assert {sender.pdsafe_transfer_generation()} == gens
    p, req = _digest_row(sender, room)
    row = kv_integrity.decode_row(p.disagg_metadata_buffers.kv_checksum[kvw.PREFILL_IDX]
                                  .tolist())
    assert (row.room, row.generation) == (room, gens.pop())


def _digest_row(sender: Any, room: int) -> tuple[Any, Any]:
    """test_kv_integrity_wiring's prefill: the real ``send_kv_chunk`` with the real digester
    writes the room's digest row for a request whose sender is ``sender``."""
    pool = kvw._pool(1)
    p = kvw._Prefill(pool, kv_integrity.leg_digester(pool, kvw._disagg("prefill")))
    req = kvw._prefill_req(room=room)
    req.disagg_kv_sender = sender
    p.disagg_metadata_buffers.kv_checksum[kvw.PREFILL_IDX] = 7  # stale content of the slot
    p.send_kv_chunk(req, last_chunk=True)
    return p, req


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_generations_refuse_the_transfer_and_zero_the_digest_row(monkeypatch, backend):
    room = _room()
    a, b = (_Rank(monkeypatch, backend, port=p) for p in (5555, 5556))
    _break_lockstep(b)
    gens = [r.reserve("r", room, r.receiver(room, dst_info_num=2))
            .kv_receiver.pdsafe_transfer_generation() for r in (a, b)]
    assert gens[0] != gens[1]
    prefill = _Prefill(backend)
    prefill.receive(monkeypatch, a, b)
    sender = _sender(prefill, room)
    before = _counts()
    with pytest.raises(tg.GenerationSplitError) as e:
        sender.pdsafe_transfer_generation()
    assert str(room) in str(e.value) and all(str(g) in str(e.value) for g in gens)
    assert _delta(before) == {tg.SPLIT: 1}
    p, _ = _digest_row(sender, room)
    assert p.disagg_metadata_buffers.kv_checksum[kvw.PREFILL_IDX].tolist() == [0] * 8
    assert p.sent and p.sent[-1][2] == [0] * 8, "the chunk went out with a zero row"
    # The split is counted once for the room, though the coverage and digest rows asked again.
    assert _delta(before) == {tg.SPLIT: 1, kv_integrity.FAILED: 1}


# =========================================================================== the replay


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_replayed_success_of_an_earlier_reservation_is_dropped(monkeypatch, backend):
    """Room R reserved (g1), prefill concludes Success: accepted. The request ends, R is
    reserved again for the same rid (g2). Prefill's recorded g1 Success replayed: dropped
    before upstream's ``apply_prefill_status``, the status stays as upstream set it. The new
    transfer's own Success (g2) is accepted."""
    room = _room()
    rank, first, prefill = _served(monkeypatch, backend, room, slots=1)
    g1 = first.kv_receiver.pdsafe_transfer_generation()
    prefill.m.conclude_transfer(bootstrap_room=room, status=KVPoll.Success)
    (success_g1,) = prefill.take(rank)
    applied: list[dict[str, Any]] = []
    apply = rank.kv.apply_prefill_status
    rank.kv.apply_prefill_status = lambda **kw: (applied.append(kw), apply(**kw))[1]
    _deliver(monkeypatch, rank.kv, [success_g1])
    assert first.kv_receiver.poll() == KVPoll.Success and len(applied) == 1
    rank.release(first)
    _sender(prefill, room).clear()  # the prefill's side of the first request ends too
    assert room not in rank.kv.request_status and room not in prefill.m.transfer_infos

    second = rank.reserve("r", room)
    g2 = second.kv_receiver.pdsafe_transfer_generation()
    assert g2 != g1 and rank.last_metadata()[-1] == _gen(g2)
    status = rank.kv.request_status[room]
    assert status == KVPoll.Bootstrapping  # upstream's constructor set it
    before = _counts()
    _deliver(monkeypatch, rank.kv, [success_g1])
    assert len(applied) == 1, "apply_prefill_status was reached"
    assert rank.kv.request_status[room] == status
    assert rank.kv.prefill_response_tracker[room] == set()
    assert second.kv_receiver.poll() == status
    assert _delta(before) == {tg.STALE_STATUS: 1}

    prefill.receive(monkeypatch, rank)
    prefill.m.conclude_transfer(bootstrap_room=room, status=KVPoll.Success)
    (success_g2,) = prefill.take(rank)
    assert success_g2[-1] == _gen(g2)
    _deliver(monkeypatch, rank.kv, [success_g2])
    assert len(applied) == 2 and second.kv_receiver.poll() == KVPoll.Success
    assert _delta(before) == {tg.STALE_STATUS: 1}


# ============================================================= the window before the metadata


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_replayed_success_before_the_new_reservation_is_minted_is_dropped(monkeypatch,
                                                                           backend):
    room = _room()
    rank, first, prefill = _served(monkeypatch, backend, room, slots=1)
    prefill.m.conclude_transfer(bootstrap_room=room, status=KVPoll.Success)
    (success_g1,) = prefill.take(rank)
    _deliver(monkeypatch, rank.kv, [success_g1])
    rank.release(first)
    receiver = rank.receiver(room)  # the next request of the room, still bootstrapping
    _deliver(monkeypatch, rank.kv, [success_g1])
    assert receiver.poll() == KVPoll.Bootstrapping


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_notice_before_the_metadata_went_out_is_dropped(monkeypatch, backend):
    """A receiver holds the room and has told no prefill about it yet (bootstrapping, no
    metadata, no deferred BOOTSTRAP): a Failed naming the room, without a generation (what a
    keyless process sends) or with one (an earlier reservation's late notice), is dropped and
    counted; upstream would take it as the new request's terminal state (the decode-side
    attacker's denial, test/pd/test_control_mac.py). A room whose receiver sent a deferred
    BOOTSTRAP (``prefill_complete`` allocation) takes its prefill's notices before any
    metadata: upstream's, as before; only while that reservation lives."""
    rank = _Rank(monkeypatch, backend)
    room, deferred = cap._rooms(2)
    receiver = rank.receiver(room)
    before = _counts()
    failed = _upstream_status(backend, room, KVPoll.Failed, "forged", reason_frame=True)
    _deliver(monkeypatch, rank.kv, [failed, failed + [_gen(12345)]])
    assert receiver.poll() == KVPoll.Bootstrapping, "a notice nobody could address was taken"
    assert _delta(before) == {tg.STALE_STATUS: 2}

    other = rank.receiver(deferred)
    tg.note_bootstrap_sent(rank.kv, deferred)
    _deliver(monkeypatch, rank.kv, [_upstream_status(backend, deferred, KVPoll.Failed,
                                                     "Prefill bootstrap failed",
                                                     reason_frame=True)])
    assert other.poll() == KVPoll.Failed
    assert _delta(before) == {tg.STALE_STATUS: 2}

    # The BOOTSTRAP belonged to that reservation: once it is cleared, the next receiver of the
    # same room number has told no prefill anything yet, and a Failed for it is dropped again.
    other.clear()
    again = rank.receiver(deferred)
    _deliver(monkeypatch, rank.kv, [_upstream_status(backend, deferred, KVPoll.Failed,
                                                     "forged", reason_frame=True)])
    assert again.poll() == KVPoll.Bootstrapping, "a cleared reservation's BOOTSTRAP still counted"
    assert _delta(before) == {tg.STALE_STATUS: 3}


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in TCP_AUX_BACKENDS])
def test_late_aux_before_the_new_reservation_is_minted_writes_nothing(monkeypatch, backend):
    room = _room()
    rank, first, prefill = _served(monkeypatch, backend, room)
    info = next(iter(prefill.m.transfer_infos[room].values()))
    _send_aux_tcp(prefill, room, info, 3)
    (aux,) = prefill.take(rank)
    rank.release(first)
    rank.receiver(room)  # the next request of the room, still bootstrapping
    _deliver(monkeypatch, rank.kv, [aux])
    assert not rank.aux.any(), "the late aux message wrote a metadata slot"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_room_reused_through_another_decode_endpoint_is_not_a_split(monkeypatch, backend):
    room = _room()
    a, first, prefill = _served(monkeypatch, backend, room)
    prefill.m.conclude_transfer(bootstrap_room=room, status=KVPoll.Success)
    a.release(first)
    _sender(prefill, room).clear()
    g1 = first.kv_receiver.pdsafe_transfer_generation()
    b = _Rank(monkeypatch, backend, port=5556)  # another decode instance (or DP rank)
    _break_lockstep(b)  # with a history of its own (an identical one may mint the same g)
    g = b.reserve("r-retry", room).kv_receiver.pdsafe_transfer_generation()  # a new request
    assert g != g1
    prefill.receive(monkeypatch, b)
    try:
        got: Any = _sender(prefill, room).pdsafe_transfer_generation()
    except tg.GenerationSplitError as e:
        got = e
    assert got == g


# ================================================================ the coverage row binds it


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_coverage_row_binds_the_transfer_generation(monkeypatch, backend):
    """Slot 2 of the coverage attestation binds the generation: prefill attests with the one
    its decode rank sent (``CommonKVSender.pdsafe_transfer_generation``), decode checks with
    the one it sent (``CommonKVReceiver.pdsafe_transfer_generation``). The room reserved again
    for the same tokens: the row its earlier reservation's transfer wrote is refused
    (``token_digest``), the row written for the new one is accepted."""
    from . import test_coverage as tc

    room = _room()
    rank, first, prefill = _served(monkeypatch, backend, room, slots=1)

    def attest(dreq: Any) -> Any:
        """What prefill's last chunk writes for ``dreq``'s transfer, moved into a decode row
        like Mooncake's TCP aux path moves it."""
        pbuf, dbuf = tc._buffers(), tc._buffers()
        preq = SimpleNamespace(bootstrap_room=room, metadata_buffer_index=2,
                               origin_input_ids=list(dreq.req.origin_input_ids),
                               disagg_decode_prefix_len=0,
                               disagg_kv_sender=_sender(prefill, room))
        pbuf.bootstrap_room[2, 0] = room  # upstream's set_buf
        coverage.attest_prefill_hook(pbuf, preq, pg.TOKENS, pg.PAGE)
        tc._transfer_row(pbuf, dbuf, 2, dreq.metadata_buffer_index)
        return SimpleNamespace(metadata_buffers=dbuf)

    row_g1 = attest(first)
    assert coverage.check_commit_hook(row_g1, first).ok
    g1 = first.kv_receiver.pdsafe_transfer_generation()
    rank.release(first)
    _sender(prefill, room).clear()

    second = rank.reserve("r", room)
    assert second.kv_receiver.pdsafe_transfer_generation() not in (0, g1)
    assert list(second.req.origin_input_ids) == list(first.req.origin_input_ids)
    prefill.receive(monkeypatch, rank)
    stale = coverage.check_commit_hook(row_g1, second)
    assert stale.outcome is coverage.Outcome.MISMATCH and stale.differs == ("token_digest",)
    assert "another transfer of this bootstrap room" in stale.message
    assert coverage.check_commit_hook(attest(second), second).ok
