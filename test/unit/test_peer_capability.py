"""A prefill transfers KV only to decodes that announced this release's wire version
(``sglang.pdsafe.peer_capability``, issue 11 item 1: fork prefill + stock decode).

No servers. The decode side is upstream's real ``CommonKVReceiver._register_kv_args`` and each
backend's real ``build_receiver_registration_message`` / ``build_receiver_metadata_message``
on a decode manager built without its constructor (its socket replaced by a recorder), after
the real pairing step (``pair_agreement.ensure_prefill_info``) saw what the prefill published.
The prefill side is each backend's real bootstrap-thread loop (Mooncake, NIXL, MORI; Ascend
inherits Mooncake's) on a prefill manager built without its constructor, fed those frames
through a stand-in socket; its status channel is a recorder, read back with the backend's own
``parse_kv_status_message`` (what the decode's control thread runs). What registers a peer
with the transport (``_publish_peer_registration``/``_add_remote_peer``) is replaced by a
recorder: it lies behind the hook, and needs a transfer engine.

What this does not show: real servers (a stock decode failing its request with the message,
end to end): ``test/pd/test_mixed_versions.py`` must change for that (fork prefill + stock
decode becomes refused by default, served under the waiver).
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from sglang.pdsafe import metrics, pair_agreement, peer_capability, peer_policy, peer_release
from sglang.srt.disaggregation.base.conn import KVPoll

from .test_peer_release_backends import _backend_managers, _prefill_manager

BACKENDS = ["mooncake", "nixl", "mori", "ascend"]
ADDR = "10.1.2.3:8998"  # the prefill's bootstrap server, as the decode names it
DECODE_PORT = 5555  # the decode rank's control port (its status messages go there)
PREFILL_RANKS = [{"rank_ip": "127.0.0.1", "rank_port": 7001},
                 {"rank_ip": "127.0.0.1", "rank_port": 7002}]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for var in (peer_policy.ENV_WAIVE, pair_agreement.ENV_ENABLE, pair_agreement.ENV_SKIP,
                peer_release.ENV_ENABLE):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(autouse=True)
def _mori_engine_desc(monkeypatch):
    """MORI's ``EngineDesc`` comes from the ``mori`` package (a stand-in here): unpack the
    engine key our decode stand-in packs, so the real ``KVArgsRegisterInfo.from_zmq`` runs."""
    _backend_managers()  # imports mori.conn with its stand-ins
    import sys

    mori_conn = sys.modules["sglang.srt.disaggregation.mori.conn"]
    monkeypatch.setattr(mori_conn, "EngineDesc", SimpleNamespace(
        unpack=lambda blob: SimpleNamespace(key=blob.decode("ascii"))))


# --------------------------------------------------------------------------- decode side


def _decode_manager(backend: str, identity: str) -> Any:
    """A decode manager of ``backend`` with what its registration and metadata builders and
    ``pdsafe_decode_identity`` read (its transport identity is ``identity``)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    m = object.__new__(_backend_managers()[backend])
    m.disaggregation_mode = DisaggregationMode.DECODE
    m.local_ip, m.rank_port = "127.0.0.1", DECODE_PORT
    m.attn_tp_size, m.dcp_size, m.dcp_rank = 1, 1, 0
    m.enable_staging = False
    m.kv_args = SimpleNamespace(
        kv_data_ptrs=[4096, 8192], kv_data_lens=[1024, 1024], kv_item_lens=[64, 64],
        kv_data_mem_kinds=["DRAM", "DRAM"], kv_layer_ids=[0, 1], aux_data_ptrs=[16384],
        state_data_ptrs=[], state_item_lens=[], state_data_lens=[], state_dim_per_tensor=[],
        state_layer_ids=[], engine_rank=0, gpu_id=0, page_size=16, kv_cache_dtype_str="float32",
        kv_layout=None)
    m.engine = SimpleNamespace(get_session_id=lambda: identity)  # Mooncake, Ascend
    m.agent = SimpleNamespace(name=identity, get_agent_metadata=lambda: b"agent-md")  # NIXL
    m.engine_desc = SimpleNamespace(key=identity, pack=lambda: identity.encode())  # MORI
    m.kv_mem_descs, m.aux_mem_descs, m.state_mem_descs = [], [], []
    m.prefill_info_table = {}
    return m


SCHEDULER = SimpleNamespace(tp_worker=SimpleNamespace(model_config=SimpleNamespace(
    context_len=512)), max_req_input_len=500, server_args=SimpleNamespace(chat_template="chatml"))


def _pair(monkeypatch, d: Any, info: dict[str, Any]) -> bool | None:
    """The real pairing step of ``d`` with a prefill whose bootstrap server answers ``info``."""
    monkeypatch.setattr(pair_agreement, "_fetch_info", lambda addr: info)
    d.try_ensure_parallel_info = lambda addr: d.prefill_info_table.setdefault(addr, info) and True
    queue = SimpleNamespace(kv_manager=d, scheduler=SCHEDULER)
    return pair_agreement.ensure_prefill_info(queue, ADDR, [])


def fork_prefill_info(d: Any, wire_version: str | None = None) -> dict[str, Any]:
    """What a fork prefill's bootstrap server answers a decode that asks (``?pdsafe_pair=1``),
    with settings that agree with ``d``'s."""
    mine = pair_agreement.local_settings(SCHEDULER, d.kv_args).to_wire()
    if wire_version is not None:
        mine["wire_version"] = wire_version
    return {"page_size": 16, "kv_cache_dtype": "float32", "pdsafe_pair": mine}


STOCK_PREFILL_INFO = {"page_size": 16, "kv_cache_dtype": "float32"}  # upstream's fields only


def _register(d: Any, backend: str) -> list[tuple[int, list[bytes]]]:
    """Run upstream's real ``_register_kv_args`` of a receiver of ``d`` for ``ADDR``; returns
    (prefill rank port, frames) of every message sent, in order."""
    import sys

    module = sys.modules[type(d).__module__]
    receiver_cls = next(v for k, v in vars(module).items()
                        if k.endswith("KVReceiver") and isinstance(v, type)
                        and v.__module__ == module.__name__)
    r = object.__new__(receiver_cls)
    r.kv_mgr, r.bootstrap_addr, r.bootstrap_room = d, ADDR, 1
    r.bootstrap_infos = [dict(i) for i in PREFILL_RANKS]
    sent: list[tuple[int, list[bytes]]] = []

    def connect(info: dict[str, Any]) -> tuple[Any, Any]:
        sock = SimpleNamespace(send_multipart=lambda parts: sent.append(
            (info["rank_port"], list(parts))))
        return sock, threading.Lock()

    r._connect_to_bootstrap_server = connect
    assert r._register_kv_args() is True
    return sent


def _metadata(d: Any, room: int) -> list[bytes]:
    """The metadata message ``d`` sends a prefill rank for ``room`` (the backend's builder)."""
    return d.build_receiver_metadata_message(
        bootstrap_room=room, required_dst_info_num=1, kv_indices=np.arange(4, dtype=np.int32),
        aux_index=0, state_indices=None, decode_prefix_len=None, is_dummy=False)


# --------------------------------------------------------------------------- prefill side


class _Drained(Exception):
    """The stand-in socket has no more messages: ends the bootstrap loop."""


def _prefill(backend: str) -> tuple[Any, list[tuple[str, list[bytes]]], list[str]]:
    """A prefill manager of ``backend`` for the real bootstrap loop: (manager, status messages
    sent to decodes, decode identities whose registration reached the transport)."""
    m, sent = _prefill_manager(_backend_managers()[backend])
    registered: list[str] = []
    m._stopped = False
    m._worker_threads = []
    m.server_args = SimpleNamespace(enable_pd_role_switch=False)
    m.is_mla_backend = False
    m.enable_staging = False
    m.dcp_size, m.dcp_rank = 1, 0
    m.kv_args = SimpleNamespace(engine_rank=0)  # NIXL's loop names it when the loop ends
    m._publish_peer_registration = lambda sid, args: registered.append(sid)  # Mooncake
    m._add_remote_peer = lambda info: registered.append(  # NIXL, MORI
        getattr(info, "agent_name", None) or info.engine_key)
    return m, sent, registered


def _run_bootstrap_loop(monkeypatch, m: Any, frames: list[list[bytes]]) -> None:
    """Run the backend's real prefill bootstrap loop over ``frames``, in this thread."""
    start = getattr(m, "start_prefill_thread", None) or m._start_bootstrap_thread
    _run_control_loop(monkeypatch, m, start, frames)


def _run_control_loop(monkeypatch, m: Any, start: Callable[[], None],
                      frames: list[list[bytes]]) -> None:
    """Run the control loop that ``start`` (a bound method of ``m`` that starts one thread)
    starts, over ``frames`` from a stand-in socket, in this thread, until they are drained."""
    import sys

    queue = [list(f) for f in frames]

    def recv_multipart() -> list[bytes]:
        if not queue:
            m._stopped = True
            raise _Drained
        return queue.pop(0)

    m._stopped = False
    m.server_socket = SimpleNamespace(recv_multipart=recv_multipart)
    targets: list[Callable[[], None]] = []

    class Thread:
        def __init__(self, target: Callable[[], None], **_: Any) -> None:
            targets.append(target)

        def start(self) -> None:
            pass

    module = sys.modules[start.__func__.__module__]  # Ascend: Mooncake's loop
    with monkeypatch.context() as p:
        p.setattr(module, "threading", SimpleNamespace(Thread=Thread))
        start()
    assert len(targets) == 1
    try:
        targets[0]()
    except _Drained:
        pass
    assert not queue, f"the loop stopped before reading {len(queue)} messages"


def _failed_statuses(m: Any, sent: list[tuple[str, list[bytes]]]) -> dict[int, str]:
    """room -> reason of every Failed status the prefill sent to the decode's control port."""
    out = {}
    for endpoint, parts in sent:
        assert endpoint == f"tcp://127.0.0.1:{DECODE_PORT}", endpoint
        room, status, _, reason = m.parse_kv_status_message(parts)
        assert status == int(KVPoll.Failed)
        out[room] = reason
    return out


def _rooms(n: int) -> list[int]:
    return [random.randrange(1 << 62) for _ in range(n)]


def _identity(backend: str) -> str:
    return f"decode-{backend}-{random.randrange(1 << 30)}"


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_announces_before_registering_to_a_prefill_of_this_release(monkeypatch, backend):
    d = _decode_manager(backend, _identity(backend))
    assert _pair(monkeypatch, d, fork_prefill_info(d)) is True
    sent = _register(d, backend)
    assert [port for port, _ in sent] == [7001, 7001, 7002, 7002]
    for i in (0, 2):
        announce, registration = sent[i][1], sent[i + 1][1]
        assert announce == [peer_capability.ANNOUNCE_TAG, pair_agreement.WIRE_VERSION.encode(),
                            d.pdsafe_decode_identity().encode()]
        assert peer_capability.ANNOUNCE_TAG not in registration


@pytest.mark.parametrize("prefill", ["stock", "older-release", "unpaired"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prefill_without_this_wire_version_never_gets_an_announcement(monkeypatch, backend,
                                                                       prefill):
    """A stock prefill (paired under the decode's pair-agreement waiver) or a fork prefill of
    wire version /1 (paired with pair agreement off) would misparse the announcement in its
    bootstrap thread: it gets upstream's registration only."""
    d = _decode_manager(backend, _identity(backend))
    if prefill == "stock":
        monkeypatch.setenv(peer_policy.ENV_WAIVE, peer_policy.PAIR_AGREEMENT)
        assert _pair(monkeypatch, d, STOCK_PREFILL_INFO) is True
    elif prefill == "older-release":
        monkeypatch.setenv(pair_agreement.ENV_ENABLE, "0")
        assert _pair(monkeypatch, d, fork_prefill_info(d, "sglang-pdsafe-pair/1")) is True
    sent = _register(d, backend)
    assert [port for port, _ in sent] == [7001, 7002]
    assert all(parts[0] != peer_capability.ANNOUNCE_TAG for _, parts in sent), sent


def _fork_decode_frames(monkeypatch, backend: str, rooms: list[int]) -> tuple[Any, list]:
    """What a fork decode of this release sends one prefill rank: announcement, registration,
    then metadata for each room."""
    d = _decode_manager(backend, _identity(backend))
    assert _pair(monkeypatch, d, fork_prefill_info(d)) is True
    frames = [parts for port, parts in _register(d, backend) if port == 7001]
    return d, frames + [_metadata(d, r) for r in rooms]


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_announced_decode_is_served(monkeypatch, backend):
    rooms = _rooms(2)
    d, frames = _fork_decode_frames(monkeypatch, backend, rooms)
    identity = d.pdsafe_decode_identity()
    m, sent, registered = _prefill(backend)
    before = metrics.value(peer_capability.REFUSED)
    _run_bootstrap_loop(monkeypatch, m, frames)
    assert registered == [identity]
    assert peer_capability.announced_version(m, identity) == pair_agreement.WIRE_VERSION
    for room in rooms:
        assert list(m.transfer_infos[room]) == [identity], "stored under the announced key"
        assert m.request_status[room] == KVPoll.WaitingForInput
    assert sent == [] and metrics.value(peer_capability.REFUSED) == before


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_unannounced_decode_is_refused_naming_both_versions(monkeypatch, backend, caplog):
    """A stock decode sends the same upstream frames without the announcement. Room A's
    sender is open (Bootstrapping), room B's opens later: both fail on the prefill with the
    reason, the decode is told Failed with it for each room, nothing is stored for it, and
    the refusal is logged and counted once for the decode."""
    room_a, room_b = _rooms(2)
    d, frames = _fork_decode_frames(monkeypatch, backend, [room_a, room_b])
    stock_frames = [f for f in frames if f[0] != peer_capability.ANNOUNCE_TAG]
    m, sent, registered = _prefill(backend)
    m.request_status[room_a] = KVPoll.Bootstrapping  # its sender is open
    before = metrics.value(peer_capability.REFUSED)
    with caplog.at_level(logging.ERROR, logger="sglang.pdsafe.peer_capability"):
        _run_bootstrap_loop(monkeypatch, m, stock_frames)
    assert registered == [d.pdsafe_decode_identity()], "upstream's registration still runs"
    assert room_a not in m.transfer_infos and room_b not in m.transfer_infos
    told = _failed_statuses(m, sent)
    assert set(told) == {room_a, room_b}
    for reason in told.values():
        for text in (pair_agreement.WIRE_VERSION, "no sglang-pdsafe wire version",
                     d.pdsafe_decode_identity(), "decode-protections", peer_policy.ENV_WAIVE):
            assert text in reason, (text, reason)
    assert m.request_status[room_a] == KVPoll.Failed
    assert "decode-protections" in m.failure_records[room_a]
    # Room B's sender opens after the refusal (CommonKVSender.__init__ order): it fails at once.
    m.request_status[room_b] = KVPoll.Bootstrapping
    peer_release.on_sender_created(SimpleNamespace(kv_mgr=m, bootstrap_room=room_b))
    assert m.request_status[room_b] == KVPoll.Failed
    assert "decode-protections" in m.failure_records[room_b]
    assert metrics.value(peer_capability.REFUSED) == before + 1
    errors = [r for r in caplog.records
              if r.name == "sglang.pdsafe.peer_capability" and r.levelno == logging.ERROR]
    assert len(errors) == 1 and d.pdsafe_decode_identity() in errors[0].getMessage()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_decode_of_another_wire_version_is_refused_even_under_the_waiver(monkeypatch,
                                                                          backend):
    room = _rooms(1)[0]
    d, frames = _fork_decode_frames(monkeypatch, backend, [room])
    other = b"sglang-pdsafe-pair/99"
    frames = [[f[0], other, f[2]] if f[0] == peer_capability.ANNOUNCE_TAG else f for f in frames]
    monkeypatch.setenv(peer_policy.ENV_WAIVE, peer_policy.DECODE_PROTECTIONS)
    m, sent, _ = _prefill(backend)
    before = metrics.value(peer_capability.SERVED)
    _run_bootstrap_loop(monkeypatch, m, frames)
    assert room not in m.transfer_infos
    reason = _failed_statuses(m, sent)[room]
    for text in ("sglang-pdsafe-pair/99", pair_agreement.WIRE_VERSION, "never waived"):
        assert text in reason, (text, reason)
    assert metrics.value(peer_capability.SERVED) == before


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_waiver_serves_an_unannounced_decode_and_counts_it_once(monkeypatch, backend,
                                                                     caplog):
    rooms = _rooms(2)
    d, frames = _fork_decode_frames(monkeypatch, backend, rooms)
    stock_frames = [f for f in frames if f[0] != peer_capability.ANNOUNCE_TAG]
    monkeypatch.setenv(peer_policy.ENV_WAIVE, peer_policy.DECODE_PROTECTIONS)
    m, sent, _ = _prefill(backend)
    served, refused = (metrics.value(peer_capability.SERVED),
                       metrics.value(peer_capability.REFUSED))
    with caplog.at_level(logging.WARNING, logger="sglang.pdsafe.peer_capability"):
        _run_bootstrap_loop(monkeypatch, m, stock_frames)
    for room in rooms:
        assert list(m.transfer_infos[room]) == [d.pdsafe_decode_identity()]
        assert m.request_status[room] == KVPoll.WaitingForInput
    assert sent == []
    assert metrics.value(peer_capability.SERVED) == served + 1
    assert metrics.value(peer_capability.REFUSED) == refused
    warnings = [r for r in caplog.records
                if r.name == "sglang.pdsafe.peer_capability" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and peer_policy.DECODE_PROTECTIONS in warnings[0].getMessage()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_registration_without_announcement_clears_the_earlier_one(monkeypatch, backend):
    """A decode restarted as a stock build under the same identity (a Mooncake session id is
    host:port) registers again without announcing: it is no longer taken for the fork."""
    room_a, room_b = _rooms(2)
    d, frames = _fork_decode_frames(monkeypatch, backend, [room_a])
    registration = next(f for f in frames if f[0] != peer_capability.ANNOUNCE_TAG)
    m, sent, _ = _prefill(backend)
    _run_bootstrap_loop(monkeypatch, m, frames + [registration, _metadata(d, room_b)])
    assert room_a in m.transfer_infos and room_b not in m.transfer_infos
    assert set(_failed_statuses(m, sent)) == {room_b}


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_a_malformed_announcement_is_consumed_and_the_loop_goes_on(monkeypatch, backend):
    """Upstream's parser would take it for metadata (Mooncake: IndexError, NIXL: assertion),
    killing the bootstrap thread; it never reaches it. Its decode stays unannounced."""
    room = _rooms(1)[0]
    d, frames = _fork_decode_frames(monkeypatch, backend, [room])
    frames[0] = [peer_capability.ANNOUNCE_TAG, b"\xff"]
    m, sent, _ = _prefill(backend)
    _run_bootstrap_loop(monkeypatch, m, frames)
    assert room not in m.transfer_infos and set(_failed_statuses(m, sent)) == {room}


def test_a_failing_check_refuses(monkeypatch):
    """Fail closed: a check that raises refuses the room (counted as a hook failure)."""
    room = _rooms(1)[0]
    d, frames = _fork_decode_frames(monkeypatch, "mooncake", [room])
    m, sent, _ = _prefill("mooncake")

    def boom(*a: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(peer_capability, "announced_version", boom)
    before = metrics.value(peer_capability.FAILED)
    _run_bootstrap_loop(monkeypatch, m, frames)
    assert room not in m.transfer_infos
    status = _failed_statuses(m, sent)[room]
    assert "peer_capability.refuses_transfer_info check could not run" in status
    assert metrics.value(peer_capability.FAILED) == before + 1


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
@pytest.mark.parametrize("why", ["refused", "check failed"])
def test_the_refusals_failed_echoes_the_generation_the_metadata_carried(monkeypatch, backend,
                                                                         why):
    """A decode that sent a transfer generation with its metadata drops any status for the
    room without it (a stale message). The refusal is sent before the metadata is stored, so
    it must still carry that generation: the decode then fails the request at once instead
    of waiting for its bootstrap timeout (hook-failure suite, issue 19 item 4)."""
    from sglang.pdsafe import transfer_generation
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    if not hasattr(CommonKVManager, "pdsafe_send_failed_status_tagged"):
        pytest.skip("this tree predates the transfer generation's tagged status (patch 0025): "
                    "there is no generation to echo")
    room = _rooms(1)[0]
    generation = random.randrange(1, 1 << 62)
    d, frames = _fork_decode_frames(monkeypatch, backend, [room])
    frames[-1] = [*frames[-1], transfer_generation.encode_frame(generation)]
    if why == "refused":  # a stock-like decode: no announcement
        frames = [f for f in frames if f[0] != peer_capability.ANNOUNCE_TAG]
    else:
        def boom(*a: Any) -> None:
            raise RuntimeError("boom")

        monkeypatch.setattr(peer_capability, "announced_version", boom)
    m, sent, _ = _prefill(backend)
    _run_bootstrap_loop(monkeypatch, m, frames)
    assert room not in m.transfer_infos
    tagged = [transfer_generation.frame_generation(parts) for _, parts in sent]
    assert _failed_statuses(m, sent).keys() == {room}
    assert tagged == [generation], f"the Failed carried {tagged}, the metadata {generation}"


def test_every_backend_names_its_own_identity():
    """Each backend says what its prefills key its metadata by (the common default, None,
    would leave its decodes unannounced: refused by every pdsafe prefill)."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    base = CommonKVManager.pdsafe_decode_identity
    for name, cls in _backend_managers().items():
        assert cls.pdsafe_decode_identity is not base, name


def test_decode_protections_is_a_waivable_name(monkeypatch):
    monkeypatch.setenv(peer_policy.ENV_WAIVE, "decode-protections")
    assert peer_policy.waived() == frozenset({"decode-protections"})
    assert peer_policy.decode_protections_waived() and not peer_policy.pair_waived()
