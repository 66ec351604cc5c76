"""Prefill source pages stay held until no transfer worker can read them again.

In PD mode the prefill's transfer workers (Mooncake and NIXL ``transfer_worker``, MORI
``_transfer_worker`` and its drainer) read a request's KV pages, the transfer's *source*, and
write them into the decode's pages with one-sided writes. Upstream 0.5.23 gives those pages back
to the allocator as soon as the request's sender polls Failed (``handle_inflight_transfer_failure``,
reached also by ``abort_request`` on an in-flight request), when an aborted request is retired
after its forward (``_retire_aborted_prefill_result``) and when a chunked prefill is aborted
between chunks (``process_pending_chunked_abort``), while chunks of the room may still be queued
or posted. A new request that gets the pages has its KV read into the aborted request's decode
pages (the decode may be about to free them to a third tenant), or the old transfer sends a mix.

**Lifecycle** of one lease (``SourceLease.state``), transitions checked by
:meth:`SourceLease.move`::

    LEASED --(no transfer worker on this manager: nothing can read)--> RELEASED    (freed at once)
    LEASED --(upstream's release deferred; fences queued)------------> HELD
    HELD ----(past the alarm deadline, no evidence yet)--------------> OVERDUE     (alarm, once)
    HELD | OVERDUE --(drained on every attention TP/CP rank)--------> RELEASED_DRAINED (freed)
    LEASED | HELD | OVERDUE --(a lease hook failed)------------------> FAILED      (held for good)

A lease is armed (``LEASED``) by :func:`draining` around the upstream call that frees an
aborted or failed request's KV; upstream's ``release_kv_cache`` asks :func:`deferred` first,
which takes the pages over (``HELD``). :func:`release_drained` (top of every pass of the prefill
inflight queue) frees them with upstream's own ``release_kv_cache`` once the evidence below holds
on every rank of the attention TP and CP groups (MIN all-reduce, as upstream agrees on polls:
the ranks' allocators and prefix trees stay identical). A timeout never frees: it only alarms.

**Evidence** that no worker will read room R's source pages again (``_drained``), all of:

* *Every queued chunk was handled.* At the hold, R's sender has concluded (Failed or aborted:
  upstream's ``send`` and ``add_transfer_request`` queue nothing more for it), and a
  :class:`Fence` is put on every transfer queue of the KV manager (the fan-out is the queue
  count, ``SGLANG_DISAGGREGATION_QUEUE_SIZE`` / ``SGLANG_MORI_TRANSFER_SHARDS``; each queue has
  exactly one worker thread, which handles its items in order). A worker that dequeues the
  fence has finished or dropped every chunk queued before it on that queue: Mooncake's
  ``batch_transfer_sync`` and its futures and NIXL's ``_await_handles`` settle inside the loop.
* *Nothing dequeued is still in flight*: upstream's per-room count of chunks dequeued and not
  finished (``_staging_outstanding``, counted at dequeue, before the status check) is zero. It
  covers what the fence cannot: a staging chunk re-queued behind the fence, and a MORI chunk
  whose wait was handed to the drainer thread.
* *The backend can prove it settled*: R is not one of upstream's poisoned rooms (a Mooncake
  batch that timed out while still running, a NIXL handle that never settled, a MORI failed
  status, a worker thread that raised). A poisoned lease is never released (``source_lease_
  poisoned_total``, the alarm names it); a restart of the prefill frees its memory.

Upstream resets R's count and poison when R starts a new lifecycle, and a new request of R
would let R's stale queued chunks through the workers' status check: so the lease keeps R live
in the room guard (:mod:`sglang.pdsafe.room_guard`, 409 for a new request of R) until it is
released. Invariant: the pages of a lease leave the allocator's hands from the moment upstream
would have freed them until the evidence holds on every rank, and are then freed exactly once,
by upstream's own function; a lease whose hook failed is never freed.

What it proves and what it does not: it proves that every chunk of the room was dequeued and
finished or dropped by the manager's workers, and that the backend reported nothing it could not
settle. It relies on upstream's drain accounting, which exists only with
``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE`` on (upstream default; off, Mooncake returns
with futures still running and MORI counts nothing): with it off the lease is off, and the
startup report says so. It does not hold the aux (metadata) slot the last chunk reads, nor pages
of requests aborted in the waiting or bootstrap queues (no chunk is sent before the forward
there); under pipeline parallelism a held lease is released at the next microbatch, not while
idle. Off switch (default on): ``SGLANG_PDSAFE_SOURCE_LEASE=0`` (warned at startup).

**Metrics**: ``source_pages_held`` and ``source_leases_held`` (gauges),
``source_lease_hold_seconds`` (histogram, at release), ``source_lease_released_drained_total``,
``source_lease_overdue_total`` (alarms), ``source_lease_poisoned_total``,
``source_lease_failed_total`` (a hook failed; the pages are held for good).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sglang.pdsafe import metrics
from sglang.pdsafe.hook_api import attached, guarded, require
from sglang.pdsafe.protections import Protection, pd_mode, register, switch_on

logger = logging.getLogger("sglang.pdsafe.source_lease")

ENV_ENABLE = "SGLANG_PDSAFE_SOURCE_LEASE"
ENV_ALARM = "SGLANG_PDSAFE_SOURCE_LEASE_ALARM_S"
UPSTREAM_DEFERRED_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
DEFAULT_ALARM_S = 30.0
FAILED = "source_lease_failed_total"
POISONED = "source_lease_poisoned_total"
OVERDUE = "source_lease_overdue_total"
RELEASED = "source_lease_released_drained_total"
_REGISTRY_ATTR = "_pdsafe_source_leases"

require("sglang.srt.disaggregation.common.conn.CommonKVManager",
        "pdsafe_fence_transfer_workers(fence)", "pdsafe_room_in_flight(bootstrap_room)",
        why="the source lease fences a prefill's transfer queues and reads a room's "
            "in-flight chunk count and poison mark")
require("sglang.srt.mem_cache.common", "release_kv_cache",
        why="the source lease frees held pages with upstream's own release")
require("sglang.srt.disaggregation.utils", "all_reduce_flags(flags, group, op)",
        why="the source lease releases in step on every attention TP/CP rank")


def enabled() -> bool:
    """Default on; ``SGLANG_PDSAFE_SOURCE_LEASE=0`` restores upstream's immediate release."""
    return switch_on(ENV_ENABLE)


def upstream_drain_accounting() -> bool:
    """Upstream's drain accounting (deferred decode KV release; default on): the evidence."""
    return switch_on(UPSTREAM_DEFERRED_ENV)


def alarm_after_s() -> float:
    """Seconds a lease may be held before it is reported OVERDUE (alarm only); > 0."""
    raw = os.environ.get(ENV_ALARM, "").strip()
    if not raw:
        return DEFAULT_ALARM_S
    try:
        value = float(raw)
    except ValueError as e:
        raise ValueError(f"{ENV_ALARM}={raw!r} is not a number of seconds") from e
    if not value > 0:
        raise ValueError(f"{ENV_ALARM}={raw!r} must be > 0 (it only alarms, it never frees)")
    return value


register(Protection(
    name="prefill-source-lease",
    guards="a prefill's KV pages of a failed or aborted transfer stay out of the allocator "
           "until every transfer worker of every rank drained the room (queues fenced, nothing "
           "in flight, nothing unsettled); a timeout only alarms",
    is_active=lambda server_args: (pd_mode(server_args) == "prefill" and enabled()
                                   and upstream_drain_accounting()),
    disabled_by=f"{ENV_ENABLE}=0, or {UPSTREAM_DEFERRED_ENV}=0 (no drain evidence)",
))


class LeaseState(enum.Enum):
    LEASED = "leased"
    RELEASED = "released"
    HELD = "held"
    OVERDUE = "overdue"
    RELEASED_DRAINED = "released_drained"
    FAILED = "failed"


#: The allowed transitions; anything else is a bug and raises :class:`IllegalTransition`.
TRANSITIONS: dict[LeaseState, frozenset[LeaseState]] = {
    LeaseState.LEASED: frozenset({LeaseState.RELEASED, LeaseState.HELD, LeaseState.FAILED}),
    LeaseState.HELD: frozenset({LeaseState.OVERDUE, LeaseState.RELEASED_DRAINED,
                                LeaseState.FAILED}),
    LeaseState.OVERDUE: frozenset({LeaseState.RELEASED_DRAINED, LeaseState.FAILED}),
    LeaseState.RELEASED: frozenset(),
    LeaseState.RELEASED_DRAINED: frozenset(),
    LeaseState.FAILED: frozenset(),  # terminal, and the pages stay held
}
#: States whose pages the lease keeps out of the allocator.
HOLDING = frozenset({LeaseState.HELD, LeaseState.OVERDUE, LeaseState.FAILED})


class IllegalTransition(RuntimeError):
    """A lease was asked to move along a transition :data:`TRANSITIONS` forbids."""


class Fence:
    """A marker put on every transfer queue of a KV manager behind a concluded room's chunks.

    Each queue's one worker calls :meth:`reach` when it dequeues the marker, having finished or
    dropped every item queued before it. Invariant: :attr:`passed` only once every queue it was
    put on was reached (``expected`` is set after the puts, so an early reach is counted too).
    """

    def __init__(self, room: int) -> None:
        self.room = int(room)  # upstream's worker error paths read ``.room`` of what they hold
        self._lock = threading.Lock()
        self._reached = 0
        self._expected: int | None = None

    def reach(self) -> None:
        with self._lock:
            self._reached += 1

    def expect(self, queues: int) -> None:
        with self._lock:
            self._expected = int(queues)

    @property
    def passed(self) -> bool:
        with self._lock:
            return self._expected is not None and self._reached >= self._expected


@dataclass(eq=False)
class SourceLease:
    """The source pages of one request whose transfer may still be read.

    Invariant: ``state`` changes only through :meth:`move` (or :meth:`fail`, into FAILED).
    """

    seq: int
    room: int | None
    rid: str
    req: Any
    sender: Any
    kv_mgr: Any
    state: LeaseState = LeaseState.LEASED
    tree_cache: Any = None
    checkpoint: bool = False
    pages: int = 0
    fence: Fence | None = None
    held_since: float = 0.0
    deadline: float = math.inf
    poisoned: bool = False
    room_claimed: bool = False

    def move(self, to: LeaseState) -> None:
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"source lease of {self.rid} (room {self.room}): "
                                    f"{self.state.value} -> {to.value} is not allowed")
        self.state = to

    def fail(self) -> None:
        """Into FAILED from any holding or leased state (a hook failed: keep the pages)."""
        if self.state in (LeaseState.LEASED, LeaseState.HELD, LeaseState.OVERDUE):
            self.state = LeaseState.FAILED


@dataclass
class SourceLeases:
    """The leases of one prefill KV manager, in the order they were taken.

    Taken and released only on the scheduler thread, in the same order on every rank (the
    release sites follow the ranks' all-reduced polls, the releases an all-reduced verdict), so
    every rank holds the same list; the workers only latch poison marks.
    Invariant: a lease is listed from the moment it takes the pages over until they are freed
    (its state then in :data:`HOLDING`, or briefly LEASED while it is being taken).
    """

    _leases: dict[int, SourceLease] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _seq: int = 0

    def new(self, kv_mgr: Any, req: Any) -> SourceLease:
        with self._lock:
            self._seq += 1
            seq = self._seq
        room = getattr(req, "bootstrap_room", None)
        return SourceLease(seq=seq, room=None if room is None else int(room),
                           rid=str(getattr(req, "rid", "?")), req=req,
                           sender=getattr(req, "disagg_kv_sender", None), kv_mgr=kv_mgr)

    def add(self, lease: SourceLease) -> None:
        with self._lock:
            self._leases[lease.seq] = lease
        self.publish()

    def remove(self, lease: SourceLease) -> None:
        with self._lock:
            self._leases.pop(lease.seq, None)
        self.publish()

    def leases(self) -> list[SourceLease]:
        with self._lock:
            return list(self._leases.values())

    def latch_poison(self, room: int) -> list[SourceLease]:
        """Mark every held lease of ``room`` poisoned; returns the newly marked ones."""
        with self._lock:
            hit = [x for x in self._leases.values() if x.room == room and not x.poisoned]
            for x in hit:
                x.poisoned = True
        return hit

    def pages_held(self) -> int:
        with self._lock:
            return sum(x.pages for x in self._leases.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def publish(self) -> None:
        with self._lock:
            pages = sum(x.pages for x in self._leases.values())
            count = len(self._leases)
        metrics.set_gauge("source_pages_held", float(pages))
        metrics.set_gauge("source_leases_held", float(count))


def of(kv_mgr: Any) -> SourceLeases:
    """The leases of ``kv_mgr`` (created on first use, under a pdsafe-owned attribute)."""
    return attached(kv_mgr, _REGISTRY_ATTR, SourceLeases)


def _manager_supports(kv_mgr: Any) -> bool:
    """Whether ``kv_mgr`` is a transferring manager with the lease API and drain accounting.

    Upstream's fake backend manager has no transfer workers and no API: nothing to hold. A
    manager with upstream's drain accounting off gives no evidence: the lease is off there (the
    startup report says so)."""
    return (callable(getattr(kv_mgr, "pdsafe_fence_transfer_workers", None))
            and bool(getattr(kv_mgr, "enable_deferred_decode_kv_release", True)))


#: Leases armed by :func:`draining`, by ``id(req)``, while upstream's release call runs
#: (scheduler thread only).
_ARMED: dict[int, SourceLease] = {}


def _count_failure(where: str, lease: SourceLease | None, exc: BaseException) -> None:
    metrics.inc(FAILED)
    logger.error("pdsafe source lease: %s failed for request %s (room %s): %s: %s. Its KV "
                 "pages stay held for good (fail closed; counted in %s%s).", where,
                 getattr(lease, "rid", "?"), getattr(lease, "room", "?"), type(exc).__name__,
                 exc, metrics.PREFIX, FAILED, exc_info=True)


# --------------------------------------------------------------------------- hooks


@contextlib.contextmanager
def draining(kv_mgr: Any, req: Any) -> Iterator[None]:
    """Around an upstream call that frees the KV of a request whose transfer failed or was
    aborted (its sender has concluded): a ``release_kv_cache`` of ``req`` inside is deferred
    (:func:`deferred`) until the room drained. Off, or for a manager without transfer workers,
    nothing changes. Never raises on its own account."""
    lease: SourceLease | None = None
    try:
        if enabled() and _manager_supports(kv_mgr):
            lease = of(kv_mgr).new(kv_mgr, req)
            _ARMED[id(req)] = lease
    except Exception as e:  # noqa: BLE001 - the hook never takes its caller down
        # Nothing armed: upstream frees at once (this rank's lists stay as the others').
        metrics.inc(FAILED)
        logger.error("pdsafe source lease: arming failed for request %s (%s: %s); upstream "
                     "frees its pages at once.", getattr(req, "rid", "?"), type(e).__name__, e,
                     exc_info=True)
        lease = None
    try:
        yield
    finally:
        if lease is not None and _ARMED.get(id(req)) is lease:
            del _ARMED[id(req)]


def deferred(req: Any, tree_cache: Any, checkpoint: bool) -> bool:
    """``release_kv_cache``: True when the source lease took ``req``'s pages over (the caller
    frees nothing now). Only a request armed by :func:`draining` is ever taken; any failure
    while taking it keeps the pages (FAILED, counted). A second release of pages already held
    inside the same call frees nothing either (they are freed once, by the lease)."""
    lease = _ARMED.get(id(req))
    if lease is None or lease.req is not req:
        return False
    if lease.state in HOLDING:
        return True
    if lease.state is not LeaseState.LEASED:
        return False
    return _take(lease, tree_cache, bool(checkpoint))


def _take(lease: SourceLease, tree_cache: Any, checkpoint: bool) -> bool:
    kv_mgr = lease.kv_mgr
    lease.tree_cache, lease.checkpoint = tree_cache, checkpoint
    reg: SourceLeases | None = None
    try:
        reg = of(kv_mgr)
        reg.add(lease)  # first: every rank lists the lease, whatever happens below
        lease.pages = _pages_of(lease.req, tree_cache)
        fence = Fence(lease.room if lease.room is not None else -1)
        queues = int(kv_mgr.pdsafe_fence_transfer_workers(fence))
        fence.expect(queues)
        if queues == 0:  # no transfer worker on this manager: nothing can read the pages
            lease.move(LeaseState.RELEASED)
            reg.remove(lease)
            return False
        lease.fence = fence
        now = time.monotonic()
        lease.held_since, lease.deadline = now, now + alarm_after_s()
        lease.move(LeaseState.HELD)
        if lease.room is not None:
            _, poisoned = kv_mgr.pdsafe_room_in_flight(lease.room)
            if poisoned and not lease.poisoned:
                lease.poisoned = True
                _mark_poisoned([lease])
            lease.room_claimed = _claim_room(kv_mgr, lease)
        reg.publish()
        logger.debug("pdsafe source lease: holding %d pages of %s (room %s) behind %d "
                     "transfer queues", lease.pages, lease.rid, lease.room, queues)
        return True
    except Exception as e:  # noqa: BLE001 - fail closed: the pages stay held
        lease.fail()
        with contextlib.suppress(Exception):
            (reg or of(kv_mgr)).add(lease)
        _count_failure("holding", lease, e)
        return True


def _pages_of(req: Any, tree_cache: Any) -> int:
    """Pages of the request's KV row (for the gauge only; 0 when unknown)."""
    try:
        tokens = int(req.kv.kv_allocated_len)
        page = int(getattr(tree_cache.token_to_kv_pool_allocator, "page_size", 1) or 1)
    except Exception:  # noqa: BLE001 - a gauge, never a reason to fail a lease
        return 0
    return -(-max(tokens, 0) // page)


def _claim_room(kv_mgr: Any, lease: SourceLease) -> bool:
    """Keep the room live on this server while its chunks may sit in the queues (a new request
    of it would restart upstream's per-room accounting and let them through)."""
    from sglang.pdsafe import room_guard
    from sglang.pdsafe.peer_notifier import is_fake_bootstrap

    if (not room_guard.enabled() or lease.room is None
            or is_fake_bootstrap(getattr(lease.req, "bootstrap_host", None))):
        return False
    prev = room_guard.live_rooms(kv_mgr).claim(lease.room, lease.rid)
    if prev is not None:
        logger.warning("pdsafe source lease: room %s of %s was live for request %s",
                       lease.room, lease.rid, prev.rid)
    return True


def _mark_poisoned(leases: Iterable[SourceLease]) -> None:
    for lease in leases:
        metrics.inc(POISONED)
        logger.error("pdsafe source lease: the transfer backend cannot prove that the writes of "
                     "request %s (room %s) settled; its %d KV pages stay held for good (a "
                     "restart of this prefill frees them).", lease.rid, lease.room, lease.pages)


@guarded("source_lease.room_poisoned", FAILED, default=None)
def room_poisoned(kv_mgr: Any, room: int) -> None:
    """``CommonKVManager.poison_deferred_ack_room`` (any thread): the backend cannot prove
    ``room``'s transfer settled; a held lease of it is never released."""
    reg = getattr(kv_mgr, _REGISTRY_ATTR, None)
    if reg is not None:
        _mark_poisoned(reg.latch_poison(int(room)))


def fence_reached(item: Any) -> bool:
    """A transfer worker dequeued ``item``: True (and the fence is marked) when it is a
    :class:`Fence`, which the worker then skips. Never raises."""
    if not isinstance(item, Fence):
        return False
    try:
        item.reach()
    except Exception:  # noqa: BLE001 - a worker thread must survive; the fence never passes
        logger.exception("pdsafe source lease: a fence could not be marked")
    return True


@guarded("source_lease.holding", FAILED, default=True)
def holding(kv_mgr: Any) -> bool:
    """``Scheduler.is_fully_idle``: leased pages are not idle (upstream's idle leak check would
    count them as leaked). Fail closed: a failing check answers True."""
    reg = getattr(kv_mgr, _REGISTRY_ATTR, None)
    return reg is not None and len(reg) > 0


def _drained(kv_mgr: Any, lease: SourceLease, now: float) -> bool:
    """This rank's evidence for ``lease`` (see the module doc); moves it OVERDUE past its
    deadline (alarm once, counted). A failure moves it FAILED (held for good, counted)."""
    try:
        if lease.state is LeaseState.FAILED:
            return False
        drained = False
        if not lease.poisoned and lease.fence is not None and lease.fence.passed:
            in_flight, poisoned = kv_mgr.pdsafe_room_in_flight(lease.room)
            if poisoned and not lease.poisoned:
                lease.poisoned = True
                _mark_poisoned([lease])
            drained = not poisoned and int(in_flight) <= 0
        if not drained and lease.state is LeaseState.HELD and now >= lease.deadline:
            lease.move(LeaseState.OVERDUE)
            metrics.inc(OVERDUE)
            if lease.poisoned:
                why = "the backend marked its transfer unsettled"
            elif lease.fence is None or not lease.fence.passed:
                why = "a transfer queue has not reached its fence"
            else:
                why = "a chunk of it is still in flight"
            logger.error(
                "pdsafe source lease: the %d KV pages of request %s (room %s) are still held "
                "%.1f s after its transfer failed: %s. They stay held (upstream would have "
                "reused them while a transfer worker may still read them). Operator: check the "
                "transfer engine and the decode peer (sglang:pdsafe_source_pages_held).",
                lease.pages, lease.rid, lease.room, now - lease.held_since, why)
        return drained
    except Exception as e:  # noqa: BLE001 - fail closed
        lease.fail()
        _count_failure("the drain check", lease, e)
        return False


def _agree(flags: list[int], groups: Iterable[Any]) -> list[int]:
    """MIN of every rank's flags over each group (upstream's poll agreement)."""
    groups = [g for g in groups if g is not None]
    if not groups or not flags:
        return flags
    import torch.distributed as dist
    from sglang.srt.disaggregation.utils import all_reduce_flags

    for group in groups:
        flags = all_reduce_flags(flags=flags, group=group, op=dist.ReduceOp.MIN)
    return [int(f) for f in flags]


@guarded("source_lease.release_drained", FAILED, default=0)
def release_drained(kv_mgr: Any, groups: Iterable[Any] = ()) -> int:
    """Top of ``process_disagg_prefill_inflight_queue`` (every scheduler pass): free, with
    upstream's ``release_kv_cache``, the pages of every lease drained on all ranks of
    ``groups`` (attention TP, then CP). Returns how many were freed.

    Every rank holds the same leases in the same order and takes part in the all-reduce
    whenever it holds any; this rank's evidence cannot raise (a failure is a FAILED lease)."""
    reg = getattr(kv_mgr, _REGISTRY_ATTR, None)
    if reg is None or len(reg) == 0:
        return 0
    leases = reg.leases()
    now = time.monotonic()
    flags = [1 if _drained(kv_mgr, lease, now) else 0 for lease in leases]
    try:
        agreed = _agree(flags, groups)
        if len(agreed) != len(leases):
            raise RuntimeError(f"{len(agreed)} verdicts for {len(leases)} leases")
    except Exception as e:  # noqa: BLE001 - nothing is freed without agreement
        metrics.inc(FAILED)
        logger.error("pdsafe source lease: the ranks could not agree on drained leases (%s: "
                     "%s); nothing freed this pass.", type(e).__name__, e, exc_info=True)
        return 0
    freed = 0
    for lease, ok in zip(leases, agreed, strict=True):
        if ok and lease.state in (LeaseState.HELD, LeaseState.OVERDUE):
            _release(reg, kv_mgr, lease, now)
            freed += 1
    return freed


def _release(reg: SourceLeases, kv_mgr: Any, lease: SourceLease, now: float) -> None:
    """Free ``lease``'s pages exactly once: it leaves the registry and its state is terminal
    before upstream's release runs, so a failing release is never retried."""
    lease.move(LeaseState.RELEASED_DRAINED)
    reg.remove(lease)
    metrics.inc(RELEASED)
    metrics.observe("source_lease_hold_seconds", max(0.0, now - lease.held_since))
    try:
        from sglang.srt.mem_cache.common import release_kv_cache

        release_kv_cache(lease.req, lease.tree_cache, checkpoint=lease.checkpoint)
    except Exception as e:  # noqa: BLE001 - upstream's release of drained pages
        _count_failure("freeing the drained pages", lease, e)
    if lease.room_claimed:
        from sglang.pdsafe import room_guard

        if getattr(lease.sender, "kv_mgr", None) is kv_mgr:
            room_guard.released(lease.sender)  # guarded; answers duplicates refused meanwhile
        else:
            room_guard.live_rooms(kv_mgr).release(int(lease.room))
    lease.req = lease.sender = lease.tree_cache = lease.kv_mgr = None
