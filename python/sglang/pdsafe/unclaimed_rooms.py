"""A prefill keeps a decode's page addresses only for rooms its own sender claims.

Upstream 0.5.23's prefill stores every decode metadata message it receives (``transfer_infos``:
the decode's page addresses for a bootstrap room) whether or not any request of that room ever
reaches this prefill, and keeps it until a sender for the room is cleared. Two failures follow
(issue 21, item 4; CVE-2026-93688 for the first):

* a flood of metadata naming arbitrary rooms grows the prefill's state without bound;
* a request sent to a decode alone (a client, or a router that lost the prefill leg) holds its
  decode reservation until upstream's waiting timeout (300 s by default), and its client gets
  no answer meanwhile; on a small decode pool it stalls every other request of the pair.

**Rule.** A room's metadata that no sender of this prefill claims within
``SGLANG_PDSAFE_UNCLAIMED_ROOM_TIMEOUT_S`` (default 10 s; a sender is created when the room's
request enters this prefill's scheduler, normally milliseconds after the decode's metadata) is
*dropped*: its page addresses are forgotten, the room is remembered as refused for one more
timeout (a sender opened for it meanwhile, the late request itself, fails at once,
:mod:`peer_release`; after that the room is free for a new request of a client that reuses
room numbers, whose decode sends new metadata), and every decode endpoint that sent it is
answered ``Failed`` with the reason, so the decode's client gets an explicit error (HTTP 400:
the request never reached the prefill; send it through the router, or to both legs) and the
decode releases the reservation. At most ``SGLANG_PDSAFE_UNCLAIMED_ROOM_LIMIT`` rooms (default
4096) wait unclaimed; past that the oldest is dropped the same way at once, so a flood holds
bounded memory.

**Why releasing those decode pages is safe.** The only process that received the reservation's
page addresses is this prefill (the decode sends them to the prefill ranks its bootstrap
server named, and to nobody else). Dropping the room here removes them from
``transfer_infos`` before the decode is told, no sender owns the room at that moment (a claimed
room is never dropped), and a sender opened for the room afterwards fails at once without
reading them (peer release's refused-room record). A sender opened after the record expired
finds no page addresses of the dropped reservation either (they were forgotten, not kept
for it): it waits for metadata of a new reservation of the room, or fails at upstream's
bootstrap timeout. So no write can ever target those pages,
and the decode's usual failure path (ABORT, the drain ACK this prefill answers at once) frees
them. A room that was claimed is never dropped here: its transfer runs under upstream's and
the other protections' rules.

**State.** Per prefill KV manager (a table of its :class:`~sglang.pdsafe.transfer.Leg`): the
unclaimed rooms in arrival order with their deadlines, and one daemon sweeper thread that
drops the expired ones (it sleeps until the next deadline, at most
:data:`SWEEP_MAX_SLEEP_S`).

**Metrics.** ``prefill_unclaimed_room_dropped_total`` (rooms dropped because no request
claimed them in time), ``prefill_unclaimed_room_evicted_total`` (dropped early because more
than the limit were waiting: a flood or a misrouting router), ``unclaimed_rooms`` (gauge: rooms
waiting now), ``unclaimed_rooms_failed_total`` (a hook of this module failed).

Failure policy: a note that cannot run refuses the room (it fails at once here; the decode is
told Failed); a claim that cannot run keeps the room listed, so at worst a room that was
claimed is dropped at its deadline, which fails that one request explicitly (never serves it
unchecked, never frees anything twice: the prefill's sender keeps its own pages).

What it does not do: it authenticates nobody. Without a cluster key a caller that can reach the
prefill's bootstrap port can still name the room of a request in flight; with one, its unsigned
metadata never gets here (:mod:`sglang.pdsafe.control_mac` drops it first).
"""

from __future__ import annotations

import functools
import heapq
import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Any

from sglang.pdsafe import metrics, peer_release, policy, transfer, transfer_generation
from sglang.pdsafe.log_limit import LogLimit
from sglang.pdsafe.policy import Outcome, hook, returns
from sglang.pdsafe.protections import (
    Protection,
    off_by,
    positive_seconds,
    register,
    switch_on,
)

logger = logging.getLogger("sglang.pdsafe.unclaimed_rooms")

ENV_ENABLE = "SGLANG_PDSAFE_UNCLAIMED_ROOMS"
ENV_TIMEOUT = "SGLANG_PDSAFE_UNCLAIMED_ROOM_TIMEOUT_S"
ENV_LIMIT = "SGLANG_PDSAFE_UNCLAIMED_ROOM_LIMIT"
#: Short, because a reservation nobody claims holds the decode's pages plus its reserved
#: decode tokens until then, and on a small pool that stalls every other request of the pair:
#: with 60 s, 29 of the 44 requests of the benchmark's concurrent trace (1024-token decode
#: pool, four decode-only requests among them) got no answer within 60 s; with 10 s all were
#: answered within 33 s (docs/benchmark.md). A legitimate claim comes milliseconds to a
#: scheduler iteration after the decode's metadata: both legs tokenize the same prompt.
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_LIMIT = 4096
#: The sweeper wakes at least this often (a new earlier deadline wakes it at once).
SWEEP_MAX_SLEEP_S = 1.0
#: The status the decode's client is answered with: the request never reached this prefill.
STATUS = 400
DROPPED = "prefill_unclaimed_room_dropped_total"
EVICTED = "prefill_unclaimed_room_evicted_total"
FAILED = "unclaimed_rooms_failed_total"
GAUGE = "unclaimed_rooms"
TABLE = "unclaimed_rooms"
#: One warning per interval per class (a flood drops thousands of rooms; each is counted).
_LOG_DROPPED = LogLimit(10.0)
_LOG_EVICTED = LogLimit(10.0)

register(Protection(
    name="prefill-unclaimed-rooms",
    guards="decode metadata for a room no request on this prefill claims is dropped within "
           f"{ENV_TIMEOUT} (default {DEFAULT_TIMEOUT_S:.0f} s) and its decode told at once "
           f"(HTTP {STATUS}); at most {ENV_LIMIT} rooms wait (a flood holds bounded memory)",
    roles=frozenset({"prefill"}),
    switched_off=off_by(ENV_ENABLE),
    leans_on=("peer-release",),
    weaker_without="a dropped room's decode is told through peer release; without it the "
                   "metadata is kept and the decode waits for upstream's timeout again",
))


def enabled() -> bool:
    """Default on; ``SGLANG_PDSAFE_UNCLAIMED_ROOMS=0`` keeps upstream's unbounded table."""
    return switch_on(ENV_ENABLE)


def timeout_s() -> float:
    """How long a room's metadata may wait for its sender; a bad value raises (at startup).
    Read on every metadata message: the parse is cached per raw value."""
    return positive_seconds(ENV_TIMEOUT, DEFAULT_TIMEOUT_S, "a decode's metadata may wait for "
                            "the room's request on this prefill")


def limit() -> int:
    """How many rooms may wait unclaimed; a bad value raises (at startup). Cached per raw
    value, as :func:`timeout_s`."""
    return _limit_of(os.environ.get(ENV_LIMIT, "").strip())


@functools.lru_cache(maxsize=4)
def _limit_of(raw: str) -> int:
    if not raw:
        return DEFAULT_LIMIT
    try:
        value = int(raw)
    except ValueError as e:
        raise ValueError(f"{ENV_LIMIT}={raw!r} is not a whole number of rooms; give e.g. "
                         f"{DEFAULT_LIMIT}") from e
    if value < 1:
        raise ValueError(f"{ENV_LIMIT}={raw!r} must be at least 1")
    return value


class UnclaimedRoomSettingError(policy.StartupRefusedError):
    """A prefill cannot start: a setting of the unclaimed-room table is malformed."""


def check_settings() -> None:
    """Startup: the timeout and the limit parse (a malformed value refuses the start with
    the variable's name, instead of failing the first room)."""
    try:
        timeout_s()
        limit()
    except ValueError as e:
        raise UnclaimedRoomSettingError(
            f"pdsafe: this prefill refuses to start: a setting of its unclaimed-room table is "
            f"malformed: {e}") from e


@functools.lru_cache(maxsize=8)
def reason(wait_s: float) -> str:
    """What the decode's client reads when its room was dropped here."""
    return (f"no request for this bootstrap room reached the prefill server within "
            f"{wait_s:g} s of the decode's reservation ({ENV_TIMEOUT}), so the prefill dropped "
            f"the reservation's page addresses and nothing was transferred. Send PD requests "
            f"through the PD router, or to the prefill and the decode with the same "
            f"bootstrap_room")


@functools.lru_cache(maxsize=8)
def evicted_reason(cap: int) -> str:
    """The reason of a room dropped early (one string per limit: a flood's rooms share it)."""
    return (f"more than {cap} bootstrap rooms were waiting on the prefill server for their "
            f"request ({ENV_LIMIT}), so the oldest, this one, was dropped with its page "
            f"addresses and nothing was transferred. Retry; if it repeats, the prefill is "
            f"receiving decode metadata that no request follows (a misrouting client or router, "
            f"or a flood)")


class Unclaimed:
    """The unclaimed rooms of one prefill KV manager: room -> deadline in arrival order, a
    heap of (deadline, room) for the sweeper, and the sweeper's wake-up event (one daemon
    thread per prefill KV manager, for the process's life).

    Invariant: a room is in ``rooms`` only while no sender of this manager claimed it since
    its metadata arrived; each room is dropped (answered Failed) at most once per listing.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rooms: OrderedDict[int, float] = OrderedDict()
        self.heap: list[tuple[float, int]] = []
        self.wake = threading.Event()
        self.sweeper: threading.Thread | None = None

    def __len__(self) -> int:
        with self.lock:
            return len(self.rooms)


def _table(kv_mgr: Any) -> Unclaimed:
    return transfer.leg(kv_mgr).table(TABLE, Unclaimed)


def _is_prefill(kv_mgr: Any) -> bool:
    """The manager's leg is a prefill (the one PD-mode decision, ``protections.pd_mode``)."""
    return transfer.leg(kv_mgr).side == "prefill"


def _drop(kv_mgr: Any, room: int, why: str, counter: str) -> None:
    """Forget ``room``'s metadata, remember it as refused, answer its decodes Failed."""
    metrics.inc(counter)
    suppressed = (_LOG_EVICTED if counter == EVICTED else _LOG_DROPPED).admit()
    if suppressed is not None:
        logger.warning("pdsafe unclaimed rooms: dropped the decode metadata of bootstrap room "
                       "%s and told its decode: %s (%d similar suppressed; all counted in "
                       "%s)", room, why, suppressed, metrics.PREFIX + counter.removesuffix(
                           "_total"))
    # Remembered for one more timeout, not peer release's default (600 s): the refusal's job
    # is to fail the dropped room's own late request at once; a room number reused by its
    # client for a new request afterwards must be served (its decode sends new metadata).
    peer_release.prefill_rejected(kv_mgr, room, why, status=STATUS, ttl_s=timeout_s())


def _note_failed(failure: policy.Failure) -> None:
    """The room could not be listed: it fails here now (its decode is told Failed)."""
    kv_mgr, room = failure.args[0], failure.args[1]
    transfer.fail_room(kv_mgr, room, failure.refusal(
        500, "the KV transfer (this prefill could not track whether a request claims the "
             "room)"))


@hook("unclaimed_rooms.note_metadata", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_note_failed, internal=True, key=lambda kv_mgr, room: ("room", room),
      effect="the room fails on the prefill at once; its decode is told Failed")
def note_metadata(kv_mgr: Any, room: int) -> None:
    """Prefill bootstrap thread, after decode metadata for ``room`` was stored: unless a
    sender of this manager holds the room, list it with its deadline (kept from its first
    message; a later message of the same room does not extend it). Past the limit the oldest
    listed room is dropped now."""
    if not enabled() or not _is_prefill(kv_mgr):
        return
    room = int(room)
    if _claimed_now(kv_mgr, room):
        return
    table = _table(kv_mgr)
    now = time.monotonic()
    cap = limit()
    evict: list[int] = []
    with table.lock:
        if room not in table.rooms:
            deadline = now + timeout_s()
            table.rooms[room] = deadline
            heapq.heappush(table.heap, (deadline, room))
            while len(table.rooms) > cap:
                oldest, _ = table.rooms.popitem(last=False)
                evict.append(oldest)
        size = len(table.rooms)
        if table.sweeper is None:
            table.sweeper = threading.Thread(target=_sweep, args=(kv_mgr, table),
                                             name="pdsafe-unclaimed-rooms", daemon=True)
            table.sweeper.start()
    metrics.set_gauge(GAUGE, size)
    table.wake.set()
    for oldest in evict:
        _drop(kv_mgr, oldest, evicted_reason(cap), EVICTED)


def _claimed_now(kv_mgr: Any, room: int) -> bool:
    """A request of this prefill holds ``room`` (its transfer record is live: a sender
    exists, or its source lease still drains)."""
    return transfer.leg(kv_mgr).of_room(room) is not None


@hook("unclaimed_rooms.claimed", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=returns(None), internal=True,
      key=lambda leg, rec: ("room", getattr(rec, "room", None)),
      effect="the room stays listed: if its request still holds it at the deadline it is "
             "kept (checked again then); if the request already ended, the room is dropped "
             "(its decode metadata is gone with the request; nothing is freed twice)")
def claimed(leg: transfer.Leg, rec: transfer.Transfer) -> None:
    """``transfer.ROOM_OPENED``: a request's record was opened on a room of a prefill leg
    (its sender is about to be built): the room is no longer unclaimed."""
    if leg.side != "prefill" or rec.room is None:
        return
    table = leg.tables().get(TABLE)
    if table is None:
        return
    with table.lock:
        table.rooms.pop(int(rec.room), None)
        size = len(table.rooms)
    metrics.set_gauge(GAUGE, size)


def expire(kv_mgr: Any, table: Unclaimed, now: float) -> float | None:
    """Drop every listed room whose deadline passed by ``now``; the next deadline (None: none
    is listed). The sweeper's step, callable directly (tests)."""
    due: list[int] = []
    with table.lock:
        while table.heap and table.heap[0][0] <= now:
            deadline, room = heapq.heappop(table.heap)
            if table.rooms.get(room) == deadline:  # still listed, and this is its entry
                del table.rooms[room]
                due.append(room)
        # Entries of rooms claimed or re-listed since are skipped above; keep the heap small.
        if len(table.heap) > 4 * max(len(table.rooms), 64):
            table.heap = [(d, r) for r, d in table.rooms.items()]
            heapq.heapify(table.heap)
        size = len(table.rooms)
        nxt = table.heap[0][0] if table.heap else None
    if due:
        metrics.set_gauge(GAUGE, size)
    wait = timeout_s()
    for room in due:
        if _claimed_now(kv_mgr, room):
            continue  # claimed without the claim reaching the table (its hook failed): kept
        _drop(kv_mgr, room, reason(wait), DROPPED)
    return nxt


def _sweep(kv_mgr: Any, table: Unclaimed) -> None:
    """The sweeper thread: drop expired rooms, sleep until the next deadline. A failing sweep
    is counted and logged once per run of failures (not once a second), and retried: the
    rooms stay listed, which holds their decodes' pages no longer than upstream would."""
    failing = False
    while True:
        try:
            nxt = expire(kv_mgr, table, time.monotonic())
            failing = False
        except Exception as e:
            if not failing:
                metrics.inc(FAILED)
                logger.error("pdsafe unclaimed rooms: the sweep failed (%s: %s); the rooms "
                             "stay listed and are retried every %.0f s", type(e).__name__, e,
                             SWEEP_MAX_SLEEP_S)
            failing = True
            nxt = None
        sleep = SWEEP_MAX_SLEEP_S if nxt is None else \
            min(SWEEP_MAX_SLEEP_S, max(0.0, nxt - time.monotonic()))
        table.wake.wait(sleep)
        table.wake.clear()


transfer.ROOM_OPENED.append(claimed)
transfer_generation.METADATA_NOTED.append(note_metadata)
