"""A process on the cluster network without the cluster key (test-only): what it can send a
prefill rank's bootstrap socket.

It reads what anyone can (the prefill's ``GET /route``: the rank's ZMQ address and wire
version) and builds its frames with upstream's own message builders (each backend's
``build_receiver_registration_message`` / ``build_receiver_metadata_message``) on a stand-in
decode manager, so every frame is what a real decode of that backend would send, except that
the transport identity, the page addresses and the transfer generation are the attacker's.
It holds no key: its frames go unsigned, or signed with a key of its own.
"""

from __future__ import annotations

import random
import struct
from types import SimpleNamespace
from typing import Any

import numpy as np
import requests

RANK0 = "?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
ANNOUNCE_TAG = b"PDSAFE_PEER"  # what a decode of this release announces itself with


def _manager(backend: str, identity: str, port: int) -> Any:
    """A decode manager of ``backend`` with what upstream's message builders read."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager
    from sglang.srt.disaggregation.utils import DisaggregationMode

    cls = {"mooncake": MooncakeKVManager, "nixl": NixlKVManager}[backend]
    m = object.__new__(cls)
    m.disaggregation_mode = DisaggregationMode.DECODE
    m.local_ip, m.rank_port = "127.0.0.1", port
    m.attn_tp_size, m.dcp_size, m.dcp_rank = 1, 1, 0
    m.enable_staging = False
    m.kv_args = SimpleNamespace(
        kv_data_ptrs=[4096], kv_data_lens=[1 << 20], kv_item_lens=[64],
        kv_data_mem_kinds=["DRAM"], kv_layer_ids=[0], aux_data_ptrs=[16384],
        state_data_ptrs=[], state_item_lens=[], state_data_lens=[], state_dim_per_tensor=[],
        state_layer_ids=[], engine_rank=0, gpu_id=0, page_size=1, kv_cache_dtype_str="float32",
        kv_layout=None)
    m.engine = SimpleNamespace(get_session_id=lambda: identity)
    m.agent = SimpleNamespace(name=identity, get_agent_metadata=lambda: b"agent-md")
    m.kv_mem_descs, m.aux_mem_descs, m.state_mem_descs = [], [], []
    return m


class Attacker:
    """Frames for one prefill rank of ``backend`` whose bootstrap server is ``bootstrap``
    (``host:port``)."""

    def __init__(self, backend: str, bootstrap: str) -> None:
        route = requests.get(f"http://{bootstrap}/route{RANK0}", timeout=10).json()
        self.rank_addr = f"tcp://{route['rank_ip']}:{route['rank_port']}"
        pair = route.get("pdsafe_pair") or {}
        from sglang.pdsafe import pair_settings

        self.wire_version = str(pair.get("wire_version") or pair_settings.WIRE_VERSION)
        self.identity = f"attacker-{random.randrange(1 << 30)}"
        self.manager = _manager(backend, self.identity, 6666)

    def frames(self, room: int, generation: int) -> list[list[bytes]]:
        """Announcement, registration, metadata and two ABORTs (one naming ``generation``, one
        in the generation-less format of an earlier decode) naming ``room`` (unsigned)."""
        from sglang.srt.disaggregation.common.conn import AbortNotification

        m = self.manager
        aborts = [list(AbortNotification(room=room, decode_ip=m.local_ip, decode_port=m.rank_port,
                                         generation=g).to_zmq()) for g in (generation, None)]
        return [
            [ANNOUNCE_TAG, self.wire_version.encode(), self.identity.encode()],
            list(m.build_receiver_registration_message()),
            list(m.build_receiver_metadata_message(
                bootstrap_room=room, required_dst_info_num=1,
                kv_indices=np.arange(8, dtype=np.int32), aux_index=0, state_indices=None,
                decode_prefix_len=None, is_dummy=False))
            + [b"PDSAFE_GEN1:" + str(generation).encode()],
        ] + aborts

    @staticmethod
    def signed_with_own_key(frames: list[list[bytes]], key: str) -> list[list[bytes]]:
        """``frames`` with a decode-to-prefill MAC under ``key`` (not the cluster's)."""
        return signed_with(frames, key, to_prefill=True)

    def send(self, messages: list[list[bytes]]) -> None:
        """Push ``messages`` to the prefill rank's bootstrap socket."""
        push(self.rank_addr, messages)


def signed_with(messages: list[list[bytes]], key: str, *, to_prefill: bool
                ) -> list[list[bytes]]:
    """``messages`` with a MAC under ``key`` for the given direction (the attacker's own key:
    the cluster's is what it does not hold)."""
    from sglang.pdsafe import control_mac

    (k,) = control_mac._mac_keys((key,))
    direction = control_mac.D2P if to_prefill else control_mac.P2D
    return [control_mac.seal(k, direction, m) for m in messages]


def push(addr: str, messages: list[list[bytes]]) -> None:
    """Send ``messages`` to the ZMQ socket at ``addr`` from a PUSH socket of the attacker's."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(addr)
    try:
        for msg in messages:
            sock.send_multipart(msg)
    finally:
        sock.close()


# ------------------------------------------------------------------------- the decode side

#: ZMTP 3's greeting starts with 0xFF, eight padding bytes, then 0x7F (the signature): what
#: any ZMQ socket sends first on a new TCP connection, so a port scan can tell them apart.
_ZMTP_SIGNATURE = (0xFF, 0x7F)


def zmq_listening_ports(pid: int, host: str = "127.0.0.1") -> list[int]:
    """The TCP ports a server process tree listens on at ``host`` that answer with a ZMQ
    greeting: what a scanning attacker finds. The decode publishes its control port nowhere
    (its prefill learns it from the decode's own metadata), so an attacker on the network
    scans for it; here the scan is narrowed to the server's process tree."""
    import socket

    import psutil

    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    ports: set[int] = set()
    for p in procs:
        try:
            conns = p.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        ports |= {c.laddr.port for c in conns
                  if c.status == psutil.CONN_LISTEN and c.laddr.ip in (host, "0.0.0.0")}
    found = []
    for port in sorted(ports):
        try:
            with socket.create_connection((host, port), timeout=1.0) as s:
                s.settimeout(1.0)
                head = s.recv(10)
        except OSError:
            continue
        if len(head) >= 10 and (head[0], head[9]) == _ZMTP_SIGNATURE:
            found.append(port)
    return found


class DecodeAttacker:
    """What a process without the cluster key can send a decode's control port (found by a
    scan, :func:`zmq_listening_ports`) to name a room it learnt: every message type a prefill
    sends a decode, in upstream's own frame formats for ``backend``, with a generation it
    guessed and without one, unsigned or signed with a key of its own."""

    PREFILL_RANK = 0

    def __init__(self, backend: str, ports: list[int], host: str = "127.0.0.1") -> None:
        assert ports, "the scan found no ZMQ port on the decode"
        self.backend = backend
        self.addrs = [f"tcp://{host}:{p}" for p in ports]

    def _status(self, room: int, status: int, generation: int | None) -> list[bytes]:
        head = [str(room).encode(), str(status).encode(), str(self.PREFILL_RANK).encode()]
        gen = [] if generation is None else [b"PDSAFE_GEN1:" + str(generation).encode()]
        if self.backend == "nixl":
            return [b"KV_STATUS", *head, b"forged by a keyless process"] + gen
        return head + [b"forged by a keyless process"] + gen

    def frames(self, room: int, generation: int) -> dict[str, list[list[bytes]]]:
        """Message kind (``control_mac.decode_kind``) -> the unsigned forgeries naming ``room``:
        Success and Failed statuses, aux data (Mooncake sends it over TCP; NIXL writes it),
        CHUNK_READY (NIXL's staging notice) and ABORT_ACK, each with ``generation`` and
        without one (the format of a prefill that carries none)."""
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.common.conn import AbortAck

        gen = [b"PDSAFE_GEN1:" + str(generation).encode()]
        out: dict[str, list[list[bytes]]] = {
            "kv_status": [self._status(room, int(s), g)
                          for s in (KVPoll.Success, KVPoll.Failed) for g in (generation, None)],
            "abort_ack": [list(AbortAck(room, self.PREFILL_RANK, g).to_zmq())
                          for g in (generation, None)],
        }
        if self.backend == "mooncake":
            data = b"\x00" * 64
            aux = [b"AUX_DATA", str(room).encode(), b"0", b"0",
                   struct.pack(">I", len(data)), data]
            out["aux_data"] = [aux + gen, aux]
        else:
            chunk = [b"CHUNK_READY", str(room).encode(), b"0", b"0", b"1", b"attacker",
                     str(self.PREFILL_RANK).encode()]
            out["chunk_ready"] = [chunk + gen, chunk]
        return out

    @staticmethod
    def signed_with_own_key(messages: list[list[bytes]], key: str) -> list[list[bytes]]:
        """``messages`` with a prefill-to-decode MAC under ``key`` (not the cluster's)."""
        return signed_with(messages, key, to_prefill=False)

    def send(self, messages: list[list[bytes]]) -> None:
        """Push ``messages`` to every port the scan found."""
        for addr in self.addrs:
            push(addr, messages)
