"""Peer released at once: a PD request refused or aborted on one side frees the other side now.

Upstream keeps a refused request out of its own side's queues (``is_unadmitted_reject`` at both
PD doors), but never tells the other side. A prefill that refuses a prompt leaves the decode
server holding the pages it reserved, waiting for a transfer that never comes, until
``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (300 s); a decode that refuses leaves the prefill
holding a sender (and a queue slot) until ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``. Anyone who
can send over-long prompts can pin the other side's memory that way (a DoS lever). Through the
router the peer is freed only when its HTTP connection is dropped and the tokenizer's disconnect
poll notices (seconds), and a direct client of the peer just hangs.

This module closes it through the backends' existing control channel, in the common layer
(``disaggregation/common/conn.py``), so Mooncake, NIXL, MORI and Ascend run the same logic:

* **prefill -> decode**: the prefill remembers every room it refused or aborted before the
  transfer (``prefill_rejected``, with an expiry) and answers decode's bootstrap metadata for
  that room with a ``Failed`` KV status carrying the reason, at once if the metadata is already
  there, else the moment it arrives (``on_metadata_complete``). Decode then fails the request
  with that reason and frees its pages through upstream's deferred-release ABORT/ABORT_ACK.
* **decode -> prefill**: a decode that refuses a request at its door, aborts it before it knew
  the prefill ranks, or whose HTTP layer refuses it, sends a bare ``ABORT(room)`` frame (the
  upstream ABORT tag; every backend's prefill control thread already routes it) to every
  prefill rank that may own the room (``notify_prefill``). The prefill fails the room's sender
  at once, or the sender created later for it (``on_sender_created``).
* **HTTP layer**: a request refused before it reached the scheduler (``on_http_undelivered``,
  called from ``TokenizerManager._release_req_states_on_failure``): a prefill sends the same
  bare ABORT to its own ranks (its scheduler then answers decode as above); a decode sends it
  to the prefill named in the request.

Invariant: when one side refuses or aborts a PD request before its KV was sent, the other side
is told through the control channel (once per room), so it fails the request with an explicit
error and frees what it reserved, without waiting for a timeout. If telling fails, the specific
counter ``peer_release_notify_failed_total`` says so and the peer falls back to its timeout.

Counters: ``peer_notified_release_total`` (counted by the side that told its peer),
``peer_release_notify_failed_total``; histogram ``peer_release_latency_seconds``: time from the
local rejection until the release notice left for the peer (the peer frees on receipt: one
scheduler step, plus one ABORT_ACK round trip on decode).

Off switch (default on): ``SGLANG_PDSAFE_PEER_RELEASE=0`` (logged as a warning at startup).
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sglang.pdsafe import metrics
from sglang.pdsafe.protections import Protection, is_pd, register

logger = logging.getLogger("sglang.pdsafe.peer_release")

ENV_ENABLE = "SGLANG_PDSAFE_PEER_RELEASE"
ENV_TTL = "SGLANG_PDSAFE_PEER_RELEASE_TTL"
#: Default lifetime of a refused room: a decode may publish its metadata late (its prealloc
#: queue can wait for memory), so keep the answer ready well past upstream's 300 s timeouts.
DEFAULT_TTL_S = 600.0
#: Bound on remembered rooms per prefill manager (oldest dropped first, counted).
MAX_ROOMS = 65536
#: Wire marker of our bare ABORT's third frame. Upstream's ``AbortNotification.from_zmq``
#: reads a 3-frame ABORT as room-only, so an unpatched prefill still aborts the room.
WIRE_PREFIX = b"pdsafe-reject:v1:"
ABORT_TAG = b"ABORT"
FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # upstream disaggregation.utils.FAKE_BOOTSTRAP_HOST

ORIGIN_LOCAL = "local"  # this prefill's scheduler refused or aborted the request
ORIGIN_HTTP = "http"  # this prefill's own HTTP layer refused it (bare ABORT to itself)
ORIGIN_PEER = "peer"  # the decode side refused or aborted it


def enabled() -> bool:
    """Peer release is on unless ``SGLANG_PDSAFE_PEER_RELEASE`` is 0/false/off/no."""
    return os.environ.get(ENV_ENABLE, "1").strip().lower() not in ("0", "false", "off", "no")


def _ttl_s() -> float:
    try:
        return max(1.0, float(os.environ.get(ENV_TTL, DEFAULT_TTL_S)))
    except ValueError:
        return DEFAULT_TTL_S


register(Protection(
    name="peer-release",
    guards="a PD request refused or aborted on one side before its KV transfer is failed on "
           "the other side at once through the KV control channel, which frees its pages",
    is_active=lambda server_args: is_pd(server_args) and enabled(),
    disabled_by=f"{ENV_ENABLE}=0",
))


def _count_notified(t0_monotonic: float | None = None, t0_wall: float | None = None) -> None:
    metrics.inc("peer_notified_release_total")
    if t0_monotonic is not None:
        metrics.observe("peer_release_latency_seconds", max(0.0, time.monotonic() - t0_monotonic))
    elif t0_wall is not None:
        metrics.observe("peer_release_latency_seconds", max(0.0, time.time() - t0_wall))


def _hook(default: Any = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Hooks run inside upstream's scheduler, control threads and exception handlers: a bug
    here must never take those down or replace the error being handled. It is logged and
    counted instead, and the caller gets ``default`` (upstream's behaviour)."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001
                metrics.inc("peer_release_notify_failed_total")
                logger.exception("pdsafe peer release: %s failed (%s); the peer falls back to "
                                 "its timeout", fn.__name__, e)
                return default

        return inner

    return wrap


def _notify_failed(what: str, err: Any) -> None:
    metrics.inc("peer_release_notify_failed_total")
    logger.warning(
        "pdsafe peer release: could not %s (%s). The peer keeps its reservation until its "
        "own timeout (SGLANG_DISAGGREGATION_WAITING_TIMEOUT / _BOOTSTRAP_TIMEOUT); check that "
        "the prefill bootstrap server and the KV control ports are reachable.", what, err)


# =========================================================================== prefill side


@dataclass
class _Room:
    """A room this prefill must not serve: why, since when, and whether decode was told."""

    reason: str
    origin: str
    t0: float  # time.monotonic() of the rejection (receipt, for a peer/HTTP notice)
    t0_wall: float | None  # wall clock of the rejection as sent by our own HTTP layer
    expires: float
    answered: set[tuple[str, int]] = field(default_factory=set)  # decode endpoints told
    counted: bool = False


class _Registry:
    """Refused rooms (with expiry) and rooms with a live sender, for one prefill manager."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rooms: OrderedDict[int, _Room] = OrderedDict()
        self.live: set[int] = set()

    def _expire(self, now: float) -> None:
        while self.rooms:
            room, rec = next(iter(self.rooms.items()))
            if rec.expires > now and len(self.rooms) <= MAX_ROOMS:
                return
            self.rooms.popitem(last=False)
            if rec.expires > now and not rec.answered and rec.origin != ORIGIN_PEER:
                metrics.inc("peer_release_notify_failed_total")
                logger.warning("pdsafe peer release: more than %d refused rooms remembered; "
                               "dropped room %s before its decode asked for it", MAX_ROOMS, room)

    def record(self, room: int, reason: str, origin: str,
               t0_wall: float | None = None) -> _Room:
        now = time.monotonic()
        with self.lock:
            rec = self.rooms.get(room)
            if rec is None or rec.expires <= now:
                rec = _Room(reason, origin, now, t0_wall, now + _ttl_s())
                self.rooms[room] = rec
            elif origin != ORIGIN_PEER and rec.origin == ORIGIN_PEER:
                # A local verdict is the one decode should hear (a peer ABORT carries none).
                rec.reason, rec.origin, rec.t0, rec.t0_wall = reason, origin, now, t0_wall
            self._expire(now)
            return rec

    def get(self, room: int) -> _Room | None:
        now = time.monotonic()
        with self.lock:
            rec = self.rooms.get(room)
            if rec is not None and rec.expires <= now:
                del self.rooms[room]
                return None
            return rec

    def claim_targets(self, rec: _Room,
                      targets: list[tuple[str, int]]) -> tuple[list[tuple[str, int]], bool]:
        """The decode endpoints not told yet (each is told once), and whether this is the
        room's first answer (counted once)."""
        with self.lock:
            new = [t for t in targets if t not in rec.answered]
            rec.answered.update(new)
            first = bool(new) and not rec.counted
            rec.counted = rec.counted or bool(new)
            return new, first


_REGISTRY_ATTR = "_pdsafe_peer_release"
_registry_create_lock = threading.Lock()


def _registry(kv_mgr: Any) -> _Registry:
    reg = getattr(kv_mgr, _REGISTRY_ATTR, None)
    if reg is None:
        with _registry_create_lock:
            reg = getattr(kv_mgr, _REGISTRY_ATTR, None)
            if reg is None:
                reg = _Registry()
                setattr(kv_mgr, _REGISTRY_ATTR, reg)
    return reg


def _is_prefill(kv_mgr: Any) -> bool:
    mode = getattr(kv_mgr, "disaggregation_mode", None)
    return getattr(mode, "value", mode) == "prefill"


def _failed_status() -> Any:
    from sglang.srt.disaggregation.base.conn import KVPoll

    return KVPoll.Failed


def _success_status() -> Any:
    from sglang.srt.disaggregation.base.conn import KVPoll

    return KVPoll.Success


def _failure_message(room: int, rec: _Room) -> str:
    """The error both clients read: which side gave up the room, and its own reason."""
    who = {
        ORIGIN_LOCAL: "the prefill server refused or aborted it",
        ORIGIN_HTTP: "the prefill server's HTTP layer refused it",
        ORIGIN_PEER: "it was aborted on the decode side",
    }[rec.origin]
    return (f"pdsafe: the PD request (bootstrap room {room}) was given up before its KV "
            f"transfer completed: {who}: {rec.reason}")


def _answer_decode(kv_mgr: Any, room: int, rec: _Room) -> bool:
    """Tell every decode endpoint that published metadata for ``room`` that it failed.

    Returns True when the answer was sent now (decode's metadata was known). Without a live
    sender for the room, also drops the metadata, so nothing can ever be written for it.
    """
    targets = kv_mgr._room_notify_targets(room)
    if not targets:
        return False
    reg = _registry(kv_mgr)
    targets, first = reg.claim_targets(rec, targets)
    from sglang.srt.utils.network import NetworkAddress

    message = _failure_message(room, rec)
    parts = kv_mgr._encode_kv_status_message(
        bootstrap_room=room, status=_failed_status(), failure_reason=message)
    if not getattr(kv_mgr, "kv_status_msg_carries_reason", False):
        # The legacy 3-frame layout (Mooncake, Ascend); decode reads a 4th frame as the reason.
        parts.append(message.encode("utf-8"))
    sent = 0
    for endpoint, port in targets:
        na = NetworkAddress(endpoint, port)
        try:
            kv_mgr._send_multipart_locked(na.to_tcp(), parts, is_ipv6=na.is_ipv6)
            sent += 1
        except Exception as e:  # noqa: BLE001 - a dead peer must not break the caller
            _notify_failed(f"send the Failed status of room {room} to decode "
                           f"{na.to_host_port_str()}", e)
    with reg.lock:
        has_sender = room in reg.live
    if not has_sender:
        kv_mgr.transfer_infos.pop(room, None)
        kv_mgr.req_to_decode_prefix_len.pop(room, None)
        status = kv_mgr.request_status.get(room)
        if status is not None and status != _success_status():
            kv_mgr.request_status.pop(room, None)
    if sent and first:
        _count_notified(None if rec.origin == ORIGIN_HTTP else rec.t0, rec.t0_wall)
    if sent:
        logger.info("pdsafe peer release: told decode %s that room %s failed (%s)",
                    targets, room, rec.reason)
    return True


@_hook(None)
def prefill_rejected(kv_mgr: Any, room: int | None, reason: str, origin: str = ORIGIN_LOCAL,
                     t0_wall: float | None = None) -> None:
    """This prefill will not serve ``room``: answer decode's metadata with Failed (now or later).

    Called at the prefill doors (request refused before a sender exists), when a sender is
    aborted before its transfer, and for a bare ABORT from our own HTTP layer.
    """
    if room is None or kv_mgr is None or not enabled() or not _is_prefill(kv_mgr):
        return
    status = kv_mgr.request_status.get(room)
    if status == _success_status():
        return  # the KV was already sent: nothing is reserved for it any more
    rec = _registry(kv_mgr).record(int(room), reason, origin, t0_wall)
    _answer_decode(kv_mgr, int(room), rec)


@_hook(False)
def on_metadata_complete(kv_mgr: Any, room: int) -> bool:
    """Decode's metadata for ``room`` is complete (``update_status(room, WaitingForInput)``).

    If the room was refused here, answer Failed at once. Returns True when the caller must not
    record the room as bootstrapped (no sender owns it).
    """
    if not enabled() or not _is_prefill(kv_mgr):
        return False
    reg = _registry(kv_mgr)
    rec = reg.get(room)
    if rec is None:
        return False
    _answer_decode(kv_mgr, room, rec)
    with reg.lock:
        return room not in reg.live


@_hook(None)
def on_sender_created(sender: Any) -> None:
    """A sender was opened for a room: fail it at once if the room was refused or aborted."""
    kv_mgr = sender.kv_mgr
    if not enabled() or not _is_prefill(kv_mgr):
        return
    room = sender.bootstrap_room
    reg = _registry(kv_mgr)
    with reg.lock:
        reg.live.add(room)
    rec = reg.get(room)
    if rec is None:
        return
    message = _failure_message(room, rec)
    kv_mgr.record_failure(room, message)
    kv_mgr.update_status(room, _failed_status())
    logger.info("pdsafe peer release: room %s was refused before its sender opened; failing "
                "it now (%s)", room, rec.reason)


@_hook(None)
def on_sender_cleared(sender: Any) -> None:
    if not _is_prefill(sender.kv_mgr):
        return
    reg = _registry(sender.kv_mgr)
    with reg.lock:
        reg.live.discard(sender.bootstrap_room)


@_hook(None)
def on_sender_aborted(sender: Any, reason: str = "aborted on the prefill server") -> None:
    """``CommonKVSender.abort()``, before upstream marks the room Failed: the prefill gave the
    room up. Nothing to tell when its transfer already succeeded."""
    if getattr(sender, "conclude_state", None) == _success_status():
        return
    prefill_rejected(sender.kv_mgr, sender.bootstrap_room, reason)


@_hook(None)
def on_abort_message(kv_mgr: Any, msg: list[bytes]) -> None:
    """Prefill control thread, on an ABORT frame, before the backend handles it.

    A live sender for the room gets the reason recorded first (the backend then marks the room
    Failed, and the prefill client sees why). The room is remembered, so a sender opened later
    fails at once. Our bare ABORT from this prefill's own HTTP layer (3 frames, ``WIRE_PREFIX``,
    origin ``http``) also gets decode's metadata answered with Failed, now or when it arrives.
    """
    if not enabled() or not _is_prefill(kv_mgr) or len(msg) < 2 or msg[0] != ABORT_TAG:
        return
    try:
        room = int(msg[1].decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return
    if len(msg) == 3 and msg[2].startswith(WIRE_PREFIX):
        origin, t0_wall, reason = _parse_wire(msg[2])
    else:  # a decode's own ABORT (client abort, transfer failure, deferred release)
        origin, t0_wall, reason = ORIGIN_PEER, None, "the decode server aborted the request"
    status = kv_mgr.request_status.get(room)
    if status == _success_status():
        return  # the KV was already sent: nothing is reserved for it any more
    reg = _registry(kv_mgr)
    with reg.lock:
        live = room in reg.live
    if live and status is not None and status != _failed_status():
        # Before the backend marks the room Failed, so the scheduler never reads it bare.
        message = _failure_message(room, _Room(reason, origin, 0.0, None, 0.0))
        with kv_mgr.failure_lock:
            kv_mgr.failure_records[room] = message
    if origin == ORIGIN_HTTP:
        prefill_rejected(kv_mgr, room, reason, ORIGIN_HTTP, t0_wall)
    else:
        reg.record(room, reason, ORIGIN_PEER)


# =========================================================================== decode side / HTTP


def _wire(origin: str, reason: str) -> bytes:
    return WIRE_PREFIX + f"{origin}:{time.time():.6f}:".encode() + reason.encode("utf-8")[:1024]


def _parse_wire(frame: bytes) -> tuple[str, float | None, str]:
    body = frame[len(WIRE_PREFIX):].decode("utf-8", errors="replace")
    origin, _, rest = body.partition(":")
    ts, _, reason = rest.partition(":")
    try:
        t0_wall: float | None = float(ts)
    except ValueError:
        t0_wall = None
    if origin not in (ORIGIN_HTTP, ORIGIN_PEER):
        origin = ORIGIN_PEER
    return origin, t0_wall, reason or "refused"


@dataclass
class _Job:
    bootstrap_addr: str
    room: int
    dp_rank: int | None
    reason: str
    origin: str
    t0: float


class _Notifier:
    """One daemon thread per process: resolves prefill ranks and sends bare ABORT frames.

    Runs off the scheduler/event loop, since resolving ranks is an HTTP call to the prefill's
    bootstrap server.
    """

    RANK_CACHE_TTL_S = 30.0
    HTTP_TIMEOUT_S = 2.0
    SEND_TIMEOUT_MS = 2000
    #: After a failed lookup, skip that bootstrap address for this long: a client-named host
    #: that does not answer must not hold up notices to the real prefills.
    BAD_ADDR_S = 30.0
    MAX_QUEUED = 10000

    def __init__(self) -> None:
        self.q: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self.pid = os.getpid()
        self.ranks: dict[tuple[str, int | None, int], tuple[float, list[tuple[str, int]]]] = {}
        self.topologies: dict[str, tuple[float, dict[str, Any]]] = {}
        self.bad_addrs: dict[str, float] = {}
        self.sockets: dict[str, Any] = {}
        self.ctx: Any = None
        self.thread = threading.Thread(target=self._run, name="pdsafe-peer-release",
                                       daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.q.get()
            try:
                self._send(job)
            except Exception as e:  # noqa: BLE001 - keep the thread alive
                _notify_failed(f"tell prefill {job.bootstrap_addr} to drop room {job.room}", e)

    def _route(self, addr: str, **q: int) -> dict[str, Any]:
        import requests

        query = "&".join(f"{k}={v}" for k, v in q.items())
        r = requests.get(f"http://{addr}/route?{query}", timeout=self.HTTP_TIMEOUT_S)
        r.raise_for_status()
        return r.json()

    def _topology(self, addr: str) -> dict[str, Any]:
        """The prefill's parallel layout (dp/cp/tp/pp sizes), cached like the ranks: a notice
        to a known prefill then needs no HTTP round trip (the bootstrap server shares its
        process with the prefill's busy HTTP front end)."""
        hit = self.topologies.get(addr)
        if hit is not None and time.monotonic() - hit[0] < self.RANK_CACHE_TTL_S:
            return hit[1]
        info = self._route(addr, prefill_dp_rank=-1, prefill_cp_rank=-1, target_tp_rank=-1,
                           target_pp_rank=-1)
        self.topologies[addr] = (time.monotonic(), info)
        return info

    def _resolve(self, addr: str, room: int, dp_rank: int | None) -> list[tuple[str, int]]:
        info = self._topology(addr)
        dp_size = int(info.get("dp_size", 1))
        if dp_rank is not None:
            dps = [int(dp_rank)]
        elif dp_size == 1:
            dps = [0]
        elif info.get("follow_bootstrap_room", True):
            dps = [room % dp_size]
        else:
            dps = list(range(dp_size))  # unknown owner: every dp rank drops the room
        key = (addr, dp_rank if dp_rank is not None else None, dps[0] if len(dps) == 1 else -1)
        hit = self.ranks.get(key)
        if hit is not None and time.monotonic() - hit[0] < self.RANK_CACHE_TTL_S:
            return hit[1]
        out: list[tuple[str, int]] = []
        for dp in dps:
            for cp in range(int(info.get("attn_cp_size", 1))):
                for tp in range(int(info.get("attn_tp_size", 1))):
                    for pp in range(int(info.get("pp_size", 1))):
                        r = self._route(addr, prefill_dp_rank=dp, prefill_cp_rank=cp,
                                        target_tp_rank=tp, target_pp_rank=pp)
                        ep = (str(r["rank_ip"]), int(r["rank_port"]))
                        if ep not in out:
                            out.append(ep)
        self.ranks[key] = (time.monotonic(), out)
        return out

    def _socket(self, endpoint: str, is_ipv6: bool) -> Any:
        import zmq

        sock = self.sockets.get(endpoint)
        if sock is None:
            if self.ctx is None:
                self.ctx = zmq.Context()
            sock = self.ctx.socket(zmq.PUSH)
            if is_ipv6:
                sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.setsockopt(zmq.SNDTIMEO, self.SEND_TIMEOUT_MS)
            sock.connect(endpoint)
            self.sockets[endpoint] = sock
        return sock

    def _send(self, job: _Job) -> None:
        from sglang.srt.utils.network import NetworkAddress

        until = self.bad_addrs.get(job.bootstrap_addr)
        if until is not None and time.monotonic() < until:
            _notify_failed(f"tell prefill {job.bootstrap_addr} to drop room {job.room}",
                           "its bootstrap server did not answer recently")
            return
        try:
            endpoints = self._resolve(job.bootstrap_addr, job.room, job.dp_rank)
        except Exception as e:  # noqa: BLE001
            self.bad_addrs[job.bootstrap_addr] = time.monotonic() + self.BAD_ADDR_S
            _notify_failed(f"look up the prefill ranks at {job.bootstrap_addr} for room "
                           f"{job.room}", e)
            return
        self.bad_addrs.pop(job.bootstrap_addr, None)
        frames = [ABORT_TAG, str(job.room).encode("ascii"), _wire(job.origin, job.reason)]
        sent = 0
        for ip, port in endpoints:
            na = NetworkAddress(ip, port)
            endpoint = na.to_tcp()
            try:
                self._socket(endpoint, na.is_ipv6).send_multipart(frames)
                sent += 1
            except Exception as e:  # noqa: BLE001
                sock = self.sockets.pop(endpoint, None)
                if sock is not None:
                    sock.close(linger=0)
                self.ranks.clear()
                self.topologies.clear()
                _notify_failed(f"send ABORT for room {job.room} to prefill rank "
                               f"{na.to_host_port_str()}", e)
        if sent and job.origin == ORIGIN_PEER:
            _count_notified(job.t0)
        if sent:
            logger.info("pdsafe peer release: told prefill %s to drop room %s (%s)",
                        job.bootstrap_addr, job.room, job.reason)


_notifier: _Notifier | None = None
_notifier_lock = threading.Lock()


def _get_notifier() -> _Notifier:
    global _notifier
    with _notifier_lock:
        if _notifier is None or _notifier.pid != os.getpid():
            _notifier = _Notifier()
        return _notifier


def _bootstrap_addr(host: str, port: int | str) -> str:
    from sglang.srt.utils.network import NetworkAddress

    return NetworkAddress(host, int(port)).to_host_port_str()


@_hook(False)
def notify_prefill(bootstrap_host: str | None, bootstrap_port: int | None,
                   room: int | None, reason: str, *, dp_rank: int | None = None,
                   origin: str = ORIGIN_PEER) -> bool:
    """Queue a bare ABORT(room) to every prefill rank behind ``bootstrap_host:port``.

    Returns False when there is nothing to tell (no room, fake transfer, feature off).
    """
    if (not enabled() or room is None or not bootstrap_host or bootstrap_port is None
            or bootstrap_host == FAKE_BOOTSTRAP_HOST):
        return False
    try:
        addr = _bootstrap_addr(bootstrap_host, bootstrap_port)
    except (TypeError, ValueError) as e:
        _notify_failed(f"parse the bootstrap address {bootstrap_host}:{bootstrap_port}", e)
        return False
    notifier = _get_notifier()
    if notifier.q.qsize() >= notifier.MAX_QUEUED:
        _notify_failed(f"queue the notice for room {room} to prefill {addr}",
                       f"{notifier.MAX_QUEUED} notices already pending")
        return False
    notifier.q.put(_Job(addr, int(room), dp_rank, reason, origin, time.monotonic()))
    return True


def _finish_message(req: Any) -> str:
    for reason in (getattr(req, "finished_reason", None), getattr(req, "to_finish", None)):
        message = getattr(reason, "message", None)
        if message:
            return str(message)
    return "refused"


@_hook(None)
def decode_rejected(req: Any, reason: str | None = None) -> None:
    """A decode door refused ``req`` (no receiver exists): tell its prefill to drop the room."""
    notify_prefill(getattr(req, "bootstrap_host", None), getattr(req, "bootstrap_port", None),
                   getattr(req, "bootstrap_room", None),
                   f"the decode server refused it: {reason or _finish_message(req)}",
                   dp_rank=getattr(req, "disagg_prefill_dp_rank", None))


@_hook(None)
def prefill_door_rejected(kv_mgr: Any, req: Any, reason: str | None = None) -> None:
    """A prefill door refused ``req`` before a sender existed."""
    if getattr(req, "bootstrap_host", None) == FAKE_BOOTSTRAP_HOST:
        return
    prefill_rejected(kv_mgr, getattr(req, "bootstrap_room", None),
                     reason or _finish_message(req))


@_hook(None)
def on_receiver_aborted(receiver: Any) -> None:
    """``CommonKVReceiver.abort()``: if upstream could not send ABORT (the prefill ranks were
    not known yet), send our bare ABORT so the prefill drops the room's sender."""
    if getattr(receiver, "abort_notified", False):
        return
    if getattr(receiver, "bootstrap_infos", None) is not None:
        return
    host, _, port = str(receiver.bootstrap_addr).rpartition(":")
    host = host.strip("[]")
    try:
        port_i = int(port)
    except ValueError:
        return
    if notify_prefill(host, port_i, receiver.bootstrap_room,
                      "the decode server aborted it before its bootstrap",
                      dp_rank=getattr(receiver, "prefill_dp_rank", None)):
        receiver.abort_notified = True


@_hook(None)
def on_http_undelivered(obj: Any, error: BaseException | None) -> None:
    """A PD request refused before it reached this server's scheduler (HTTP layer).

    Called from ``TokenizerManager._release_req_states_on_failure`` for each undelivered
    request. A prefill tells its own ranks (which answer decode's metadata), a decode tells the
    prefill named in the request.
    """
    if not enabled():
        return
    room = getattr(obj, "bootstrap_room", None)
    host = getattr(obj, "bootstrap_host", None)
    if room is None or isinstance(room, list) or isinstance(host, list):
        return
    from sglang.srt.runtime_context import get_disagg, get_serving

    mode = get_disagg().disaggregation_mode
    reason = f"{type(error).__name__}: {error}" if error is not None else "refused"
    if mode == "prefill":
        own_host = get_serving().host or "127.0.0.1"
        if own_host in ("0.0.0.0", "::", ""):
            own_host = "127.0.0.1"
        notify_prefill(own_host, get_disagg().disaggregation_bootstrap_port, room,
                       f"the prefill server's HTTP layer refused it: {reason}",
                       dp_rank=getattr(obj, "routed_dp_rank", None), origin=ORIGIN_HTTP)
    elif mode == "decode":
        notify_prefill(host, getattr(obj, "bootstrap_port", None), room,
                       f"the decode server's HTTP layer refused it: {reason}",
                       dp_rank=getattr(obj, "disagg_prefill_dp_rank", None))
