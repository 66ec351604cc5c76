"""Peer release, decode / HTTP side: tell a prefill to drop a room with a bare ABORT frame.

A decode that refuses a request at its door (``decode_rejected``), aborts it before it knew the
prefill ranks (``on_receiver_aborted``), or whose HTTP layer refuses it
(``on_http_undelivered``) sends a bare ``ABORT(room)`` (see
:mod:`sglang.pdsafe.peer_release_wire`) to every prefill rank that may own the room; a prefill's
HTTP layer sends it to its own ranks. The prefill side (:mod:`sglang.pdsafe.peer_release`) then
fails the room's sender, or answers decode's metadata with Failed.

Finding the ranks is an HTTP lookup at the prefill's bootstrap server (``/route``), named by the
request's ``bootstrap_host``/``bootstrap_port`` -- which a client can set to anything. So the
notifier runs off the scheduler and event loop, in one process-wide :class:`Notifier`, built so
that bogus hosts cannot hold up notices to real prefills:

* **Per-destination queues.** Notices wait in a queue per bootstrap address; each address is
  handled by one worker at a time and is in at most one lane queue.
* **Three lanes.** A destination whose route (topology and rank endpoints) is cached and fresh
  goes to the *send* lane: one thread that only does ZMQ sends (non-blocking queueing, bounded
  by ``SEND_TIMEOUT_MS``), never HTTP. A destination that resolved before but whose route went
  stale goes to the *refresh* lane (its own thread). A destination never resolved goes to the
  *lookup* lane: ``LOOKUP_WORKERS`` threads, first come first served.
* **Deadlines, not read timeouts.** Each ``/route`` request is a plain HTTP/1.0 exchange that
  must finish whole (connect, request, full answer) within ``HTTP_TIMEOUT_S``, so a host that
  hangs or drips bytes costs one timeout; all requests of one destination's lookup finish within
  ``LOOKUP_BUDGET_S``, and a topology of more than ``MAX_RANKS`` ranks is refused. A failed
  lookup marks the address bad for ``BAD_ADDR_S``: notices for it are refused (counted) without
  another lookup. A client-supplied prefill dp rank the prefill does not have is ignored (its
  failed lookup would otherwise mark a real prefill bad).
* **Bounds.** Every cache is an LRU with a maximum size: routes (``MAX_ROUTES``), bad addresses
  (``MAX_BAD_ADDRS``), sockets (``MAX_SOCKETS``, closed on eviction); at most
  ``MAX_PENDING_PER_DEST`` notices wait per destination, and at most ``MAX_NEW_DESTS``
  destinations without a route wait for a lookup. Overflow is refused at once, counted in
  ``peer_release_notify_failed_total`` and logged (at most once per ``WARN_INTERVAL_S``, with
  the number of notices not logged since).

Invariant: a notice to a prefill whose route is cached never waits for an HTTP lookup; a
first-contact notice is either refused at once (counted) or looked up after at most
``ceil(MAX_NEW_DESTS / LOOKUP_WORKERS)`` lookups of other unresolved hosts, each ending within
``HTTP_TIMEOUT_S`` when the host does not answer (``LOOKUP_BUDGET_S`` at worst); memory is
bounded by the limits above whatever hosts clients name. A notice that cannot be delivered is
counted and the peer falls back to its timeout. (Resolving a host *name* is the system
resolver's and is bounded by its own timeouts.)
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from sglang.pdsafe import control_mac
from sglang.pdsafe.hook_api import require
from sglang.pdsafe.peer_release_wire import (
    ABORT_TAG,
    FAILED,
    MAX_REASON_BYTES,
    ORIGIN_HTTP,
    ORIGIN_PEER,
    count_notified,
    enabled,
    error_refusal_status,
    notify_failed,
    request_refusal_status,
    status_note,
    wire_frame,
)
from sglang.pdsafe.policy import Outcome, hook, returns
from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST
from sglang.srt.runtime_context import get_disagg, get_serving
from sglang.srt.utils.network import NetworkAddress

logger = logging.getLogger("sglang.pdsafe.peer_release")

#: The failure effect of a hook that tells the peer: the refusal stands, the telling is lost.
UNTOLD = "the request stays refused; its prefill is not told and frees at its own timeout (counted)"

require("sglang.srt.utils.network.NetworkAddress", "to_tcp()", "to_host_port_str()", "is_ipv6",
        "parse(addr)",
        why="the notifier names prefill bootstrap servers and rank endpoints (IPv4/IPv6)")
require("sglang.srt.disaggregation.utils", "FAKE_BOOTSTRAP_HOST",
        why="a fake (warm-up) transfer has no prefill to tell")
require("sglang.srt.runtime_context", "get_disagg()", "get_serving()",
        why="on_http_undelivered reads this server's PD mode, host and bootstrap port")

#: Longest ``/route`` answer read (upstream's are a few hundred bytes).
MAX_ROUTE_RESPONSE_BYTES = 65536

K = TypeVar("K")
V = TypeVar("V")
Endpoint = tuple[str, int]


class LRU(Generic[K, V]):
    """A dict with a maximum size that drops its least recently used entries (not
    thread-safe: the owner locks). ``on_evict(key, value)`` runs for each dropped entry."""

    def __init__(self, max_size: int, on_evict: Callable[[K, V], None] | None = None) -> None:
        self.max_size = max(1, int(max_size))
        self.on_evict = on_evict
        self._d: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        v = self._d.get(key)
        if v is not None:
            self._d.move_to_end(key)
        return v

    def put(self, key: K, value: V) -> None:
        self._d[key] = value
        self._d.move_to_end(key)
        while len(self._d) > self.max_size:
            k, v = self._d.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(k, v)

    def pop(self, key: K) -> V | None:
        return self._d.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def __len__(self) -> int:
        return len(self._d)


@dataclass
class _Job:
    addr: str  # the prefill's bootstrap server, host:port
    room: int
    dp_rank: int | None
    reason: str
    origin: str
    t0: float


@dataclass
class _Route:
    """A prefill's topology (from ``/route`` with all -1) and the rank endpoints resolved so
    far, per dp selection."""

    t: float
    topology: dict[str, Any]
    ranks: dict[tuple[int, ...], list[Endpoint]] = field(default_factory=dict)


def _dp_ranks(topology: dict[str, Any], room: int, dp_rank: int | None) -> tuple[int, ...]:
    """The prefill dp ranks that may own ``room``. A client-supplied ``dp_rank`` the prefill
    does not have is ignored: its failed lookup would otherwise mark a real prefill bad."""
    dp_size = int(topology.get("dp_size", 1))
    if dp_rank is not None and 0 <= int(dp_rank) < dp_size:
        return (int(dp_rank),)
    if dp_size == 1:
        return (0,)
    if topology.get("follow_bootstrap_room", True):
        return (room % dp_size,)
    return tuple(range(dp_size))  # unknown owner: every dp rank drops the room


class Notifier:
    """Resolves prefill ranks and sends bare ABORT frames; see the module docstring."""

    ROUTE_TTL_S = 30.0
    HTTP_TIMEOUT_S = 2.0
    SEND_TIMEOUT_MS = 500
    LINGER_MS = 1000
    BAD_ADDR_S = 30.0
    LOOKUP_WORKERS = 4
    MAX_ROUTES = 64
    MAX_BAD_ADDRS = 1024
    MAX_SOCKETS = 64
    MAX_PENDING_PER_DEST = 256
    MAX_NEW_DESTS = 64
    #: All HTTP requests of one destination's lookup finish within this budget.
    LOOKUP_BUDGET_S = 10.0
    #: A topology with more ranks (dp * cp * tp * pp) than this is refused as implausible.
    MAX_RANKS = 1024
    WARN_INTERVAL_S = 5.0

    def __init__(self, **limits: Any) -> None:
        for k, v in limits.items():  # tests shrink the limits
            if not hasattr(Notifier, k):
                raise AttributeError(f"unknown Notifier limit {k}")
            setattr(self, k, v)
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self._last_warn, self._suppressed = float("-inf"), 0
        self.routes: LRU[str, _Route] = LRU(self.MAX_ROUTES)
        self.bad_addrs: LRU[str, float] = LRU(self.MAX_BAD_ADDRS)
        self.pending: dict[str, deque[_Job]] = {}  # destinations in a lane queue or a worker
        self.sockets: LRU[str, Any] = LRU(self.MAX_SOCKETS, self._close_socket)  # send lane only
        self.ctx: Any = None
        self.send_q: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.refresh_q: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.lookup_q: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._send_loop, name="pdsafe-peer-send",
                                         daemon=True),
                        threading.Thread(target=self._lookup_loop, args=(self.refresh_q,),
                                         name="pdsafe-peer-refresh", daemon=True)]
        self.threads += [threading.Thread(target=self._lookup_loop, args=(self.lookup_q,),
                                          name=f"pdsafe-peer-lookup-{i}", daemon=True)
                         for i in range(int(self.LOOKUP_WORKERS))]
        for t in self.threads:
            t.start()

    # ------------------------------------------------------------------ submission

    def _fresh(self, route: _Route | None) -> bool:
        return route is not None and time.monotonic() - route.t < self.ROUTE_TTL_S

    def _dispatch(self, addr: str) -> None:
        """Put ``addr`` in its lane (caller holds the lock and owns ``pending[addr]``)."""
        route = self.routes.get(addr)
        if self._fresh(route):
            self.send_q.put(addr)
        elif route is not None:
            self.refresh_q.put(addr)
        else:
            self.lookup_q.put(addr)

    def submit(self, job: _Job) -> bool:
        """Queue ``job``; False (counted, logged) when it is refused."""
        refused = None
        with self.lock:
            until = self.bad_addrs.get(job.addr)
            if until is not None and time.monotonic() < until:
                refused = "its bootstrap server did not answer recently"
            elif (dq := self.pending.get(job.addr)) is not None:
                if len(dq) >= self.MAX_PENDING_PER_DEST:
                    refused = f"{self.MAX_PENDING_PER_DEST} notices already wait for it"
                else:
                    dq.append(job)
            elif job.addr not in self.routes and self._new_dests() >= self.MAX_NEW_DESTS:
                refused = (f"{self.MAX_NEW_DESTS} unresolved prefill addresses already wait for "
                           "a lookup (bogus bootstrap hosts?)")
            else:
                self.pending[job.addr] = deque([job])
                self._dispatch(job.addr)
        if refused is not None:
            self._warn(f"queue the notice for room {job.room} to prefill {job.addr}", refused)
            return False
        return True

    def _warn(self, what: str, err: Any, count: int = 1) -> None:
        """Count ``count`` undelivered notices; log at most once per ``WARN_INTERVAL_S`` (a
        flood of bogus hosts must not flood the log), saying how many were not logged."""
        now = time.monotonic()
        with self.lock:
            log = now - self._last_warn >= self.WARN_INTERVAL_S
            if log:
                self._last_warn, suppressed, self._suppressed = now, self._suppressed, 0
            else:
                self._suppressed += count
        if log and suppressed:
            err = f"{err}; {suppressed} more undelivered notices since the last such warning"
        notify_failed(what, err, count=count, log=log)

    def _new_dests(self) -> int:
        return sum(1 for a in self.pending if a not in self.routes)

    def _finish(self, addr: str) -> None:
        """A worker is done with ``addr``: hand it on if notices arrived meanwhile."""
        with self.lock:
            if self.pending.get(addr):
                self._dispatch(addr)
            else:
                self.pending.pop(addr, None)

    # ------------------------------------------------------------------ lookups

    def _http_route(self, addr: str, budget_end: float, **q: int) -> dict[str, Any]:
        """GET ``/route`` from the bootstrap server at ``addr``, finished (connect, request,
        whole answer) within ``HTTP_TIMEOUT_S`` and by ``budget_end``, whatever the server
        does: a plain HTTP/1.0 exchange with a deadline, since an HTTP client's timeouts bound
        each read, not the answer (a server that drips bytes would hold a worker forever)."""
        end = min(time.monotonic() + self.HTTP_TIMEOUT_S, budget_end)
        na = NetworkAddress.parse(addr)
        query = "&".join(f"{k}={v}" for k, v in q.items())
        request = (f"GET /route?{query} HTTP/1.0\r\nHost: {addr}\r\n"
                   "Accept: application/json\r\nConnection: close\r\n\r\n").encode()
        buf = bytearray()
        with socket.create_connection((na.host, na.port),
                                      timeout=max(0.001, end - time.monotonic())) as sock:
            sock.settimeout(max(0.001, end - time.monotonic()))
            sock.sendall(request)
            while chunk := self._recv(sock, end):
                buf += chunk
                if len(buf) > MAX_ROUTE_RESPONSE_BYTES:
                    raise ValueError(f"answer longer than {MAX_ROUTE_RESPONSE_BYTES} bytes")
        head, sep, body = bytes(buf).partition(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0].split()
        if not sep or len(status) < 2 or not status[0].startswith(b"HTTP/"):
            raise ValueError(f"not an HTTP answer: {bytes(buf[:80])!r}")
        if status[1] != b"200":
            raise ValueError(f"HTTP {status[1].decode('latin-1')}: {body[:200]!r}")
        return json.loads(body)

    @staticmethod
    def _recv(sock: socket.socket, end: float) -> bytes:
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError("no complete answer in time")
        sock.settimeout(left)
        return sock.recv(65536)

    def _resolve(self, addr: str, route: _Route | None, keys: set[tuple[int, ...]]) -> _Route:
        """``route`` (refreshed when stale or absent) with endpoints for every dp selection,
        all within ``LOOKUP_BUDGET_S``."""
        budget_end = time.monotonic() + self.LOOKUP_BUDGET_S
        if not self._fresh(route):
            topology = self._http_route(addr, budget_end, prefill_dp_rank=-1,
                                        prefill_cp_rank=-1, target_tp_rank=-1, target_pp_rank=-1,
                                        pdsafe_pair=1)  # its wire version: sign for it?
            route = _Route(time.monotonic(), topology)
        assert route is not None
        info = route.topology
        sizes = [int(info.get(k, 1)) for k in ("dp_size", "attn_cp_size", "attn_tp_size",
                                                "pp_size")]
        if min(sizes) < 1 or math.prod(sizes) > self.MAX_RANKS:
            raise ValueError(f"implausible prefill topology {sizes} (dp, cp, tp, pp)")
        for dps in keys:
            if dps in route.ranks:
                continue
            out: list[Endpoint] = []
            for dp in dps:
                for cp in range(int(info.get("attn_cp_size", 1))):
                    for tp in range(int(info.get("attn_tp_size", 1))):
                        for pp in range(int(info.get("pp_size", 1))):
                            r = self._http_route(addr, budget_end, prefill_dp_rank=dp,
                                                 prefill_cp_rank=cp, target_tp_rank=tp,
                                                 target_pp_rank=pp)
                            ep = (str(r["rank_ip"]), int(r["rank_port"]))
                            if ep not in out:
                                out.append(ep)
            route.ranks[dps] = out
        return route

    def _lookup_loop(self, lane: queue.SimpleQueue[str]) -> None:
        while True:
            addr = lane.get()
            try:
                self._lookup(addr)
            except Exception as e:  # noqa: BLE001 - keep the worker alive
                self._drop(addr, f"look up the prefill ranks at {addr}", e)

    def _lookup(self, addr: str) -> None:
        with self.lock:
            route = self.routes.get(addr)
            jobs = list(self.pending.get(addr, ()))
        topology = route.topology if self._fresh(route) else None
        keys = {_dp_ranks(topology, j.room, j.dp_rank) for j in jobs} if topology else set()
        try:
            route = self._resolve(addr, route, keys)
            if topology is None:  # keys needed the topology: resolve them now
                keys = {_dp_ranks(route.topology, j.room, j.dp_rank) for j in jobs}
                route = self._resolve(addr, route, keys)
        except Exception as e:  # noqa: BLE001 - unreachable, bogus or not ready
            with self.lock:
                self.routes.pop(addr)
                self.bad_addrs.put(addr, time.monotonic() + self.BAD_ADDR_S)
            self._drop(addr, f"look up the prefill ranks at {addr}", e)
            return
        with self.lock:
            self.routes.put(addr, route)
            self.bad_addrs.pop(addr)
            self.send_q.put(addr)

    def _drop(self, addr: str, what: str, err: Any) -> None:
        """Give up every notice waiting for ``addr`` (counted; one log line)."""
        with self.lock:
            jobs = self.pending.pop(addr, None) or deque()
        if jobs:
            rooms = ", ".join(str(j.room) for j in list(jobs)[:5])
            more = f" and {len(jobs) - 5} more" if len(jobs) > 5 else ""
            self._warn(f"{what} for room(s) {rooms}{more}", err, count=len(jobs))

    # ------------------------------------------------------------------ sends

    def _close_socket(self, endpoint: str, sock: Any) -> None:
        sock.close(linger=self.LINGER_MS)

    def _socket(self, endpoint: str, is_ipv6: bool) -> Any:
        import zmq

        sock = self.sockets.get(endpoint)
        if sock is None:
            if self.ctx is None:
                self.ctx = zmq.Context()
            sock = self.ctx.socket(zmq.PUSH)
            if is_ipv6:
                sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.LINGER, self.LINGER_MS)
            sock.setsockopt(zmq.SNDTIMEO, self.SEND_TIMEOUT_MS)
            sock.connect(endpoint)
            self.sockets.put(endpoint, sock)
        return sock

    def _send_loop(self) -> None:
        while True:
            addr = self.send_q.get()
            try:
                done = self._send(addr)
            except Exception as e:  # noqa: BLE001 - keep the thread alive
                self._drop(addr, f"tell prefill {addr} to drop its rooms", e)
                continue
            if done:
                self._finish(addr)

    def _send(self, addr: str) -> bool:
        """Send every notice waiting for ``addr``. False when ``addr`` went to the refresh
        lane instead (its route went stale, or a notice needs ranks not resolved yet)."""
        with self.lock:
            route = self.routes.get(addr)
            if route is None or not self._fresh(route):
                self._handoff(addr, route)  # went stale or was evicted while queued
                return False
            jobs = list(self.pending.get(addr, ()))
            self.pending[addr] = deque()
        unresolved: list[_Job] = []
        for job in jobs:
            endpoints = route.ranks.get(_dp_ranks(route.topology, job.room, job.dp_rank))
            if endpoints is None:
                unresolved.append(job)
                continue
            frames = control_mac.sealed_notice(route.topology, [
                ABORT_TAG, str(job.room).encode("ascii"), wire_frame(job.origin, job.reason)])
            sent = 0
            for ip, port in endpoints:
                na = NetworkAddress(ip, port)
                endpoint = na.to_tcp()
                try:
                    self._socket(endpoint, na.is_ipv6).send_multipart(frames)
                    sent += 1
                except Exception as e:  # noqa: BLE001
                    sock = self.sockets.pop(endpoint)
                    if sock is not None:
                        self._close_socket(endpoint, sock)
                    with self.lock:
                        self.routes.pop(addr)  # look it up again next time
                    self._warn(f"send ABORT for room {job.room} to prefill rank "
                               f"{na.to_host_port_str()}", e)
            if sent and job.origin == ORIGIN_PEER:
                count_notified(job.t0)
            if sent:
                logger.info("pdsafe peer release: told prefill %s to drop room %s (%s)",
                            addr, job.room, job.reason)
        if unresolved:  # a dp selection not resolved yet: back to a lookup, in order
            with self.lock:
                self.pending[addr].extendleft(reversed(unresolved))
                self._handoff(addr, self.routes.get(addr))
            return False
        return True

    def _handoff(self, addr: str, route: _Route | None) -> None:
        """Send ``addr`` from the send lane to a lookup (caller holds the lock)."""
        (self.refresh_q if route is not None else self.lookup_q).put(addr)

    def stats(self) -> dict[str, int]:
        """Current sizes of the bounded state (for tests and debugging)."""
        with self.lock:
            return {"routes": len(self.routes), "bad_addrs": len(self.bad_addrs),
                    "sockets": len(self.sockets), "pending_dests": len(self.pending),
                    "pending_notices": sum(len(d) for d in self.pending.values())}


_notifier: Notifier | None = None
_notifier_lock = threading.Lock()


def get_notifier() -> Notifier:
    """The process's notifier (a new one after fork)."""
    global _notifier
    with _notifier_lock:
        if _notifier is None or _notifier.pid != os.getpid():
            _notifier = Notifier()
        return _notifier


def reset_notifier(**limits: Any) -> Notifier:
    """Replace the process's notifier with a new one (tests: smaller limits). The old one's
    threads stay idle."""
    global _notifier
    with _notifier_lock:
        _notifier = Notifier(**limits)
        return _notifier


def _bootstrap_addr(host: str, port: int | str) -> str:
    return NetworkAddress(host, int(port)).to_host_port_str()


def is_fake_bootstrap(host: str | None) -> bool:
    """Whether ``host`` is upstream's fake bootstrap host (warm-up requests: no prefill)."""
    return host == FAKE_BOOTSTRAP_HOST


def finish_message(req: Any) -> str:
    """The refusal message upstream set on ``req``."""
    for reason in (getattr(req, "finished_reason", None), getattr(req, "to_finish", None)):
        message = getattr(reason, "message", None)
        if message:
            return str(message)
    return "refused"


@hook("peer_notifier.notify_prefill", outcome=Outcome.REFUSE, counter=FAILED, internal=True,
      on_failure=returns(False), key=lambda host, port, room, *a, **k: ("room", room),
      effect=UNTOLD)
def notify_prefill(bootstrap_host: str | None, bootstrap_port: int | None,
                   room: int | None, reason: str, *, dp_rank: int | None = None,
                   origin: str = ORIGIN_PEER) -> bool:
    """Queue a bare ABORT(room) to every prefill rank behind ``bootstrap_host:port``.

    Returns False when nothing was queued (no room, fake transfer, feature off, refused).
    """
    if (not enabled() or room is None or not bootstrap_host or bootstrap_port is None
            or is_fake_bootstrap(bootstrap_host)):
        return False
    try:
        addr = _bootstrap_addr(bootstrap_host, bootstrap_port)
    except (TypeError, ValueError) as e:
        notify_failed(f"parse the bootstrap address {bootstrap_host}:{bootstrap_port}", e)
        return False
    reason = reason.encode("utf-8")[:MAX_REASON_BYTES].decode("utf-8", errors="ignore")
    return get_notifier().submit(_Job(addr, int(room), dp_rank, reason, origin,
                                      time.monotonic()))


@hook("peer_notifier.decode_rejected", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=returns(None),
      key=lambda req, *a, **k: ("room", getattr(req, "bootstrap_room", None)),
      effect=UNTOLD)
def decode_rejected(req: Any, reason: str | None = None) -> None:
    """A decode door refused ``req`` (no receiver exists): tell its prefill to drop the room."""
    notify_prefill(getattr(req, "bootstrap_host", None), getattr(req, "bootstrap_port", None),
                   getattr(req, "bootstrap_room", None), decode_refusal_reason(req, reason),
                   dp_rank=getattr(req, "disagg_prefill_dp_rank", None))


def decode_refusal_reason(req: Any, reason: str | None = None) -> str:
    """The reason a decode refusal of ``req`` carries to the prefill, with the 4xx status
    decode's own client got (``status_note``), which the prefill's client then gets too."""
    return (f"the decode server refused it{status_note(request_refusal_status(req))}: "
            f"{reason or finish_message(req)}")


@hook("peer_notifier.on_receiver_aborted", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=returns(None),
      key=lambda receiver: ("room", getattr(receiver, "bootstrap_room", None)),
      effect=UNTOLD)
def on_receiver_aborted(receiver: Any) -> None:
    """``CommonKVReceiver.abort()``: if upstream could not send ABORT (the prefill ranks were
    not known yet), send our bare ABORT so the prefill drops the room's sender."""
    if receiver.abort_notified:
        return
    if getattr(receiver, "bootstrap_infos", None) is not None:  # set by init(), if it ran
        return
    host, _, port = str(receiver.bootstrap_addr).rpartition(":")
    host = host.strip("[]")
    try:
        port_i = int(port)
    except ValueError as e:  # counted: the prefill is never told, it waits for its timeout
        notify_failed(f"parse the bootstrap address {receiver.bootstrap_addr!r} of room "
                      f"{receiver.bootstrap_room}", e)
        return
    if notify_prefill(host, port_i, receiver.bootstrap_room,
                      "the decode server aborted it before its bootstrap",
                      dp_rank=getattr(receiver, "prefill_dp_rank", None)):
        receiver.abort_notified = True


@hook("peer_notifier.on_http_undelivered", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=returns(None),
      key=lambda obj, error: ("room", getattr(obj, "bootstrap_room", None)),
      effect=UNTOLD)
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
    mode = get_disagg().disaggregation_mode
    reason = f"{type(error).__name__}: {error}" if error is not None else "refused"
    note = status_note(error_refusal_status(error))
    if mode == "prefill":
        own_host = get_serving().host or "127.0.0.1"
        if own_host in ("0.0.0.0", "::", ""):
            own_host = "127.0.0.1"
        notify_prefill(own_host, get_disagg().disaggregation_bootstrap_port, room,
                       f"the prefill server's HTTP layer refused it{note}: {reason}",
                       dp_rank=getattr(obj, "routed_dp_rank", None), origin=ORIGIN_HTTP)
    elif mode == "decode":
        notify_prefill(host, getattr(obj, "bootstrap_port", None), room,
                       f"the decode server's HTTP layer refused it{note}: {reason}",
                       dp_rank=getattr(obj, "disagg_prefill_dp_rank", None))
