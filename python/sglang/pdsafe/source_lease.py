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

**Lifecycle.** A lease is the request's :class:`~sglang.pdsafe.transfer.Transfer` record
(``REFUSED -> HELD -> RELEASED``, or ``LEAKED``), with a :class:`Lease` in ``record.hold``
(the tree cache and checkpoint of the deferred release, the fence, the deadline, whether the
backend poisoned the room, whether it is overdue), listed in the leg's lease table::

    (armed by draining)  --no transfer worker on this manager: nothing can read---> RELEASED
    (armed by draining)  --upstream's release deferred; fences queued-------------> HELD
    HELD --past the alarm deadline, no evidence yet: alarm once, still HELD (overdue)
    HELD --drained on every attention TP/CP rank: freed by upstream's release-----> RELEASED
    HELD --the backend cannot prove the room settled (poisoned), a hook failed----> LEAKED

A lease is armed by :func:`draining` around the upstream call that frees an aborted or failed
request's KV; upstream's ``release_kv_cache`` asks :func:`deferred` first, which takes the pages
over (HELD). :func:`release_drained` (top of every pass of the prefill inflight queue) frees
them with upstream's own ``release_kv_cache`` once the evidence below holds on every rank of the
attention TP and CP groups (MIN all-reduce, as upstream agrees on polls: the ranks' allocators
and prefix trees stay identical). A timeout never frees: it only alarms. While held (HELD or
LEAKED) the request's row is accounted as in use (``transfer.held_rows``): the server counts as
idle, and its idle memory check sees the row as held, not leaked.

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
on this server (its record stays the room's live record: the room guard answers a new request
of R with 409) until it is released. Invariant: the pages of a lease leave the allocator's
hands from the moment upstream would have freed them until the evidence holds on every rank,
and are then freed exactly once, by upstream's own function; a lease whose hook failed (or
whose arming failed) is never freed.

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

Failure policy: every hook here holds (a lease that cannot be armed, taken, checked or released
keeps its pages for good, counted once per request); a worker's fence check that fails still
treats a fence as a fence; a poison mark that cannot be latched poisons the server.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from sglang.pdsafe import metrics, policy, transfer
from sglang.pdsafe.hook_api import require
from sglang.pdsafe.peer_notifier import is_fake_bootstrap
from sglang.pdsafe.policy import Outcome, hook, returns
from sglang.pdsafe.protections import Protection, off_by, register, switch_on
from sglang.pdsafe.transfer import State, Transfer
from sglang.srt.disaggregation import utils as disagg_utils
from sglang.srt.mem_cache import common as mem_common

logger = logging.getLogger("sglang.pdsafe.source_lease")

ENV_ENABLE = "SGLANG_PDSAFE_SOURCE_LEASE"
ENV_ALARM = "SGLANG_PDSAFE_SOURCE_LEASE_ALARM_S"
UPSTREAM_DEFERRED_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
DEFAULT_ALARM_S = 30.0
FAILED = "source_lease_failed_total"
POISONED = "source_lease_poisoned_total"
OVERDUE = "source_lease_overdue_total"
RELEASED = "source_lease_released_drained_total"
TABLE = "source_leases"

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
    """Seconds a lease may be held before it is reported overdue (alarm only); > 0."""
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


def _switched_off(args: Any) -> str | None:
    return off_by(ENV_ENABLE)(args) or off_by(UPSTREAM_DEFERRED_ENV)(args)


register(Protection(
    name="prefill-source-lease",
    guards="a prefill's KV pages of a failed or aborted transfer stay out of the allocator "
           "until every transfer worker of every rank drained the room (queues fenced, nothing "
           "in flight, nothing unsettled); a timeout only alarms",
    roles=frozenset({"prefill"}),
    switched_off=_switched_off,
    leans_on=("bootstrap-room-guard",),
    weaker_without="the lease keeps a draining room live so that a new request of the room "
                   "cannot reset upstream's per-room drain accounting; with the room guard "
                   "off, such a request is admitted, and the old chunks of the room can pass "
                   "the workers' status check and read pages the new request owns",
))


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
class Lease:
    """What a held source lease keeps (``record.hold``): the deferred release's arguments and
    the evidence state. Invariant: set once the record is HELD (or LEAKED)."""

    req: Any
    tree_cache: Any = None
    checkpoint: bool = False
    pages: int = 0
    fence: Fence | None = None
    held_since: float = 0.0
    deadline: float = math.inf
    poisoned: bool = False
    overdue: bool = False
    #: The key of the request row's hold (``transfer.hold_row``; None: not held yet).
    row_key: int | None = None


class SourceLeases:
    """The leases of one prefill KV manager (their records), in the order they were taken.

    Taken and released only on the scheduler thread, in the same order on every rank (the
    release sites follow the ranks' all-reduced polls, the releases an all-reduced verdict), so
    every rank holds the same list; the workers only latch poison marks.
    Invariant: a record is listed from the moment it takes the pages over until they are freed
    (RELEASED); a LEAKED one is listed for good, its row accounted as held.
    """

    def __init__(self) -> None:
        self._records: dict[int, Transfer] = {}
        self._lock = threading.Lock()
        self.poisoned_rooms: set[int] = set()

    def add(self, rec: Transfer) -> None:
        with self._lock:
            self._records[rec.seq] = rec
        self.publish()

    def remove(self, rec: Transfer) -> None:
        with self._lock:
            self._records.pop(rec.seq, None)
        self.publish()

    def leases(self) -> list[Transfer]:
        """The records still awaiting evidence (HELD), in order."""
        with self._lock:
            return [r for r in self._records.values() if r.state is State.HELD]

    def records(self) -> list[Transfer]:
        with self._lock:
            return list(self._records.values())

    def latch_poison(self, room: int) -> list[Transfer]:
        """Mark every held lease of ``room`` poisoned; returns the newly marked ones."""
        with self._lock:
            self.poisoned_rooms.add(int(room))
            hit = [r for r in self._records.values()
                   if r.room == room and r.state is State.HELD and not r.hold.poisoned]
            for r in hit:
                r.hold.poisoned = True
        return hit

    def pages_held(self) -> int:
        with self._lock:
            return sum(r.hold.pages for r in self._records.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def publish(self) -> None:
        with self._lock:
            pages = sum(r.hold.pages for r in self._records.values())
            count = len(self._records)
        metrics.set_gauge("source_pages_held", float(pages))
        metrics.set_gauge("source_leases_held", float(count))


def of(kv_mgr: Any) -> SourceLeases:
    """The leases of ``kv_mgr`` (its leg's table)."""
    return transfer.leg(kv_mgr).table(TABLE, SourceLeases)


def _if_any(kv_mgr: Any) -> SourceLeases | None:
    lg = transfer.leg_if_any(kv_mgr)
    return None if lg is None else lg.tables().get(TABLE)


def _manager_supports(kv_mgr: Any) -> bool:
    """Whether ``kv_mgr`` is a transferring manager with the lease API and drain accounting.

    Upstream's fake backend manager has no transfer workers and no API: nothing to hold. A
    manager with upstream's drain accounting off gives no evidence: the lease is off there (the
    startup report says so)."""
    return (callable(getattr(kv_mgr, "pdsafe_fence_transfer_workers", None))
            and bool(getattr(kv_mgr, "enable_deferred_decode_kv_release", True)))


@dataclass
class _Armed:
    """What :func:`draining` armed for a request: its manager and whether arming failed (a
    failed arming holds the pages for good instead of letting upstream free them at once)."""

    kv_mgr: Any
    req: Any
    failed: bool = False


#: Requests armed by :func:`draining`, by ``id(req)``, while upstream's release call runs
#: (scheduler thread only).
_ARMED: dict[int, _Armed] = {}


class _Draining:
    """The context :func:`draining` returns: armed from construction until it exits."""

    def __init__(self, armed: _Armed | None) -> None:
        self.armed = armed

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        a = self.armed
        if a is not None and _ARMED.get(id(a.req)) is a:
            del _ARMED[id(a.req)]


def _arming_failed(failure: Any) -> _Draining:
    """Arming could not run: the release inside is still deferred, and held for good."""
    kv_mgr, req = failure.args[0], failure.args[1]
    armed = _Armed(kv_mgr, req, failed=True)
    _ARMED[id(req)] = armed
    return _Draining(armed)


def _req_key(kv_mgr: Any, req: Any, *_: Any, **__: Any) -> Any:
    return ("room", getattr(req, "bootstrap_room", None), str(getattr(req, "rid", "")))


def _deferred_key(req: Any, *_: Any, **__: Any) -> Any:
    return ("room", getattr(req, "bootstrap_room", None), str(getattr(req, "rid", "")))


# --------------------------------------------------------------------------- hooks


@hook("source_lease.draining", outcome=Outcome.HOLD, counter=FAILED,
      on_failure=_arming_failed, key=_req_key,
      effect="the release inside is deferred and held for good (row accounted), never freed "
             "at once")
def draining(kv_mgr: Any, req: Any) -> _Draining:
    """Around an upstream call that frees the KV of a request whose transfer failed or was
    aborted (its sender has concluded): a ``release_kv_cache`` of ``req`` inside is deferred
    (:func:`deferred`) until the room drained. Off, or for a manager without transfer
    workers, nothing changes."""
    if not (enabled() and _manager_supports(kv_mgr)):
        return _Draining(None)
    armed = _Armed(kv_mgr, req)
    _ARMED[id(req)] = armed
    return _Draining(armed)


def _deferred_failed(failure: Any) -> bool:
    """Taking the pages over could not run: an armed request's pages are held for good (the
    caller frees nothing), once. A request no :func:`draining` armed is not under a lease
    (the hook's first step, a dict lookup, repeated here): upstream frees it as it would have.
    Holding every released request's pages instead (the hook-failure suite's
    ``source_lease.deferred`` case, 2026-12-07) put finished decode requests' rows outside
    upstream's accounting: its pool check found a page both free and in use and stopped the
    decode."""
    req = failure.args[0]
    armed = _ARMED.get(id(req))
    if armed is None or armed.req is not req:
        return False
    if not _already_held(req):
        _hold_for_good(armed.kv_mgr, req, f"the {failure.spec.name} hook failed")
    return True


def _already_held(req: Any) -> bool:
    """``req``'s pages are held by its lease already (a second release inside the same call
    frees nothing: they are freed once, by the lease)."""
    rec = transfer.of(req)
    return rec is not None and isinstance(rec.hold, Lease) \
        and rec.state in (State.HELD, State.LEAKED)


@hook("source_lease.deferred", outcome=Outcome.HOLD, counter=FAILED,
      on_failure=_deferred_failed, key=_deferred_key,
      effect="the pages are held for good (row accounted), upstream frees nothing")
def deferred(req: Any, tree_cache: Any, checkpoint: bool) -> bool:
    """``release_kv_cache``: True when the source lease took ``req``'s pages over (the caller
    frees nothing now). Only a request armed by :func:`draining` is ever taken. A second
    release of pages already held inside the same call frees nothing either (they are freed
    once, by the lease)."""
    armed = _ARMED.get(id(req))
    if armed is None or armed.req is not req:
        return False
    if _already_held(req):
        return True
    if armed.failed:
        _hold_for_good(armed.kv_mgr, req, "arming its source lease failed")
        return True
    return _take(armed.kv_mgr, req, tree_cache, bool(checkpoint))


def _record_of(kv_mgr: Any, req: Any) -> Transfer:
    """``req``'s record (a new detached one when it carries none, or an ended one, e.g. a
    request refused before its claim)."""
    rec = transfer.of(req)
    if rec is None or rec.terminal or rec.state is State.HELD:
        room = getattr(req, "bootstrap_room", None)
        rec = transfer.leg(kv_mgr).open(None, str(getattr(req, "rid", "?")))
        rec.room = None if room is None else int(room)
        transfer.attach(req, rec)
    return rec


def _take(kv_mgr: Any, req: Any, tree_cache: Any, checkpoint: bool) -> bool:
    rec = _record_of(kv_mgr, req)
    lease = Lease(req=req, tree_cache=tree_cache, checkpoint=checkpoint,
                  pages=_pages_of(req, tree_cache))
    fence = Fence(rec.room if rec.room is not None else -1)
    queues = int(kv_mgr.pdsafe_fence_transfer_workers(fence))
    fence.expect(queues)
    rec.refuse()
    rec.hold = lease
    if queues == 0:  # no transfer worker on this manager: nothing can read the pages
        rec.advance(State.RELEASED, why="no transfer worker on this manager")
        return False
    lease.fence = fence
    now = time.monotonic()
    lease.held_since, lease.deadline = now, now + alarm_after_s()
    rec.advance(State.HELD, why="its transfer workers may still read the pages")
    reg = of(kv_mgr)
    reg.add(rec)
    transfer.leg(kv_mgr).hold(rec)
    lease.row_key = transfer.hold_row(req.kv)
    if rec.room is not None:
        _, poisoned = kv_mgr.pdsafe_room_in_flight(rec.room)
        if (poisoned or rec.room in reg.poisoned_rooms) and not lease.poisoned:
            lease.poisoned = True
            _mark_poisoned([rec])
        _keep_room(kv_mgr, rec)
    reg.publish()
    logger.debug("pdsafe source lease: holding %d pages of %s (room %s) behind %d "
                 "transfer queues", lease.pages, rec.rid, rec.room, queues)
    return True


def _hold_for_good(kv_mgr: Any, req: Any, why: str) -> None:
    """Keep ``req``'s pages for good: its record LEAKED (listed in the lease table), its row
    accounted as held."""
    rec = transfer.of(req)
    if rec is not None:
        if rec.is_open:
            rec.refuse()
        if rec.state in (State.REFUSED, State.HELD):
            rec.advance(State.LEAKED, why=why)
        if not isinstance(rec.hold, Lease):
            rec.hold = Lease(req=req)
        if kv_mgr is not None:
            of(kv_mgr).add(rec)
            transfer.leg(kv_mgr).hold(rec)
    lease = rec.hold if rec is not None else None
    # The lease's row, if it held one already, is held again under its key (counted once).
    key = transfer.hold_row(getattr(req, "kv", None),
                            key=lease.row_key if lease is not None else None)
    if lease is not None:
        lease.row_key = key
    metrics.inc("rows_held_for_good_total")
    logger.error("pdsafe source lease: request %s (room %s) keeps its KV pages for good: %s. "
                 "Restart the prefill to reclaim them.", getattr(req, "rid", "?"),
                 getattr(req, "bootstrap_room", "?"), why)


def _pages_of(req: Any, tree_cache: Any) -> int:
    """Pages of the request's KV row (for the gauge only; 0 when unknown)."""
    try:
        tokens = int(req.kv.kv_allocated_len)
        page = int(getattr(tree_cache.token_to_kv_pool_allocator, "page_size", 1) or 1)
    except Exception:  # noqa: BLE001 - a gauge, never a reason to fail a lease
        return 0
    return -(-max(tokens, 0) // page)


def _keep_room(kv_mgr: Any, rec: Transfer) -> None:
    """Keep the room live on this server while its chunks may sit in the queues (a new
    request of it would restart upstream's per-room accounting and let them through)."""
    if rec.room is None or is_fake_bootstrap(
            getattr(rec.hold.req, "bootstrap_host", None)):
        return
    prev = transfer.leg(kv_mgr).keep_room(rec)
    if prev is not None and prev is not rec:
        logger.warning("pdsafe source lease: room %s of %s was live for request %s",
                       rec.room, rec.rid, prev.rid)


def _mark_poisoned(records: Iterable[Transfer]) -> None:
    for rec in records:
        metrics.inc(POISONED)
        logger.error("pdsafe source lease: the transfer backend cannot prove that the writes of "
                     "request %s (room %s) settled; its %d KV pages stay held for good (a "
                     "restart of this prefill frees them).", rec.rid, rec.room, rec.hold.pages)


@hook("source_lease.room_poisoned", outcome=Outcome.POISON, counter=FAILED,
      on_failure=returns(None), key=lambda kv_mgr, room: ("room", room),
      effect="the server is poisoned: it can no longer tell which leases are unsettled")
def room_poisoned(kv_mgr: Any, room: int) -> None:
    """``CommonKVManager.poison_deferred_ack_room`` (any thread): the backend cannot prove
    ``room``'s transfer settled; a held lease of it is never released."""
    _mark_poisoned(of(kv_mgr).latch_poison(int(room)))


@hook("source_lease.fence_reached", outcome=Outcome.HOLD, counter=FAILED,
      on_failure=lambda failure: isinstance(failure.args[0], Fence),
      effect="a fence is still skipped as a fence; its lease never sees it passed (held)")
def fence_reached(item: Any) -> bool:
    """A transfer worker dequeued ``item``: True (and the fence is marked) when it is a
    :class:`Fence`, which the worker then skips."""
    if not isinstance(item, Fence):
        return False
    item.reach()
    return True


def _drained(kv_mgr: Any, rec: Transfer, now: float) -> bool:
    """This rank's evidence for ``rec``'s lease (see the module doc); marks it overdue past
    its deadline (alarm once, counted)."""
    lease: Lease = rec.hold
    drained = False
    if not lease.poisoned and lease.fence is not None and lease.fence.passed:
        in_flight, poisoned = kv_mgr.pdsafe_room_in_flight(rec.room)
        if poisoned and not lease.poisoned:
            lease.poisoned = True
            _mark_poisoned([rec])
        drained = not poisoned and int(in_flight) <= 0
    if not drained and not lease.overdue and now >= lease.deadline:
        lease.overdue = True
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
            lease.pages, rec.rid, rec.room, now - lease.held_since, why)
    return drained


def _agree(flags: list[int], groups: Iterable[Any]) -> list[int]:
    """MIN of every rank's flags over each group (upstream's poll agreement)."""
    groups = [g for g in groups if g is not None]
    if not groups or not flags:
        return flags
    for group in groups:
        flags = disagg_utils.all_reduce_flags(flags=flags, group=group, op=dist.ReduceOp.MIN)
    return [int(f) for f in flags]


@hook("source_lease.release_drained", outcome=Outcome.HOLD, counter=FAILED,
      on_failure=returns(0),
      effect="nothing is freed this pass (counted once); the leases stay held")
def release_drained(kv_mgr: Any, groups: Iterable[Any] = ()) -> int:
    """Top of ``process_disagg_prefill_inflight_queue`` (every scheduler pass): free, with
    upstream's ``release_kv_cache``, the pages of every lease drained on all ranks of
    ``groups`` (attention TP, then CP). Returns how many were freed.

    Every rank holds the same leases in the same order and takes part in the all-reduce
    whenever it holds any."""
    reg = _if_any(kv_mgr)
    if reg is None:
        return 0
    leases = reg.leases()
    if not leases:
        return 0
    now = time.monotonic()
    flags = [1 if _drained(kv_mgr, rec, now) else 0 for rec in leases]
    agreed = _agree(flags, groups)
    if len(agreed) != len(leases):
        raise RuntimeError(f"{len(agreed)} verdicts for {len(leases)} leases")
    freed = 0
    for rec, ok in zip(leases, agreed, strict=True):
        if ok and rec.state is State.HELD:
            _release(reg, kv_mgr, rec, now)
            freed += 1
    return freed


def _release(reg: SourceLeases, kv_mgr: Any, rec: Transfer, now: float) -> None:
    """Free ``rec``'s pages exactly once: it leaves the registry and its state is terminal
    before upstream's release runs, so a failing release is never retried."""
    lease: Lease = rec.hold
    rec.advance(State.RELEASED, why="drained on every rank")
    reg.remove(rec)
    if lease.row_key is not None:
        transfer.drop_row(lease.row_key)
    metrics.inc(RELEASED)
    metrics.observe("source_lease_hold_seconds", max(0.0, now - lease.held_since))
    try:
        policy.run_upstream(mem_common.release_kv_cache, lease.req, lease.tree_cache,
                            checkpoint=lease.checkpoint)
    finally:
        lg = transfer.leg(kv_mgr)
        if rec.keeps_room:
            lg.release_room(kv_mgr, rec)  # its listeners answer duplicates refused meanwhile
        lg.unhold(rec)
        lease.req = lease.tree_cache = None
