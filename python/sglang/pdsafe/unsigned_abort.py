"""A keyed prefill acts on an unsigned ABORT only for a room no decode of this release claims.

With a cluster key, a prefill drops every unsigned ABORT of a room whose decode sent it signed
metadata (:mod:`sglang.pdsafe.control_mac`): a forged one would fail a live transfer. But a
decode of *another* release signs nothing for this prefill: it refuses this prefill at pairing
(its wire version differs) and tells it so with an unsigned ABORT, and that ABORT is how the
prefill's side of the request ends at once instead of at upstream's waiting timeout (a hang,
from the client's side; operator guide, "Rolling upgrades").

**Rule.** An unsigned ABORT for a room that no decode has sent this prefill metadata for is
*held* for ``SGLANG_PDSAFE_UNSIGNED_ABORT_GRACE_S`` (default 3 s), then:

* if signed metadata named the room meanwhile (a decode of this release reserved it: the
  normal case is milliseconds), the ABORT is dropped and counted
  (``unauthenticated_abort_dropped_total``): a keyless sender that learnt a room early cannot
  fail its transfer;
* otherwise it is honoured as upstream would (the reason recorded, the room remembered as
  refused so a sender opened later fails at once, the room failed now:
  ``unsigned_abort_honoured_total``).

At most :data:`LIMIT` rooms have ABORTs held; past that the oldest room's are dropped
(counted), so a flood holds bounded memory. One daemon thread per prefill KV manager drives the
deadlines.

What it leaves open: a sender without the key that learns a room before its decode sends
metadata, for a request whose decode holds it in its queue for longer than the grace (a busy
decode pool), can fail that request (an explicit error, never a redirect of its KV). A decode
of another release is refused at pairing whatever happens here.

Failure policy: an ABORT that cannot be held is dropped (counted): the request then ends at
its waiting timeout, never by an unauthenticated message; a failing sweep is counted and
retried.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from sglang.pdsafe import metrics, policy, transfer, transfer_generation
from sglang.pdsafe.log_limit import LogLimit
from sglang.pdsafe.policy import Outcome, hook, returns
from sglang.pdsafe.protections import positive_seconds

logger = logging.getLogger("sglang.pdsafe.unsigned_abort")

ENV_GRACE = "SGLANG_PDSAFE_UNSIGNED_ABORT_GRACE_S"
DEFAULT_GRACE_S = 3.0
#: Rooms with held ABORTs per prefill KV manager; past it the oldest room's are dropped.
LIMIT = 1024
#: ABORTs held per room (upstream's and the peer-release notice, with room to spare).
PER_ROOM = 4
SWEEP_MAX_SLEEP_S = 1.0
HONOURED = "unsigned_abort_honoured_total"
DROPPED = "unauthenticated_abort_dropped_total"
FAILED = "unsigned_abort_failed_total"
TABLE = "unsigned_abort"
_LOG = LogLimit(10.0)


def grace_s() -> float:
    """How long an unsigned ABORT of an unclaimed room is held; a bad value raises (at
    startup, :func:`check_settings`)."""
    return positive_seconds(ENV_GRACE, DEFAULT_GRACE_S,
                            "an unsigned ABORT waits for the room's signed metadata")


class UnsignedAbortSettingError(policy.StartupRefusedError):
    """A prefill cannot start: its unsigned-ABORT grace is malformed."""


def check_settings() -> None:
    """Startup: the grace parses (a malformed value refuses the start, naming it)."""
    try:
        grace_s()
    except ValueError as e:
        raise UnsignedAbortSettingError(
            f"pdsafe: this prefill refuses to start: its unsigned-ABORT grace is malformed: "
            f"{e}") from e


class Held:
    """The unsigned ABORTs one prefill KV manager holds: room -> (deadline, frames) in arrival
    order, a heap for the sweeper, its wake-up event and thread.

    Invariant: each held ABORT is resolved (honoured or dropped, counted) exactly once, with
    the other ABORTs of its room (a refusing decode sends upstream's and a peer-release notice
    with the reason): at most :data:`PER_ROOM` per room, later ones dropped (counted)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rooms: OrderedDict[int, tuple[float, list[list[bytes]]]] = OrderedDict()
        self.heap: list[tuple[float, int]] = []
        self.wake = threading.Event()
        self.sweeper: threading.Thread | None = None


def _table(kv_mgr: Any) -> Held:
    return transfer.leg(kv_mgr).table(TABLE, Held)


def room_of(body: Sequence[Any]) -> int | None:
    """The room an upstream ABORT names (None: malformed, upstream drops it anyway)."""
    try:
        return int(bytes(body[1]).decode("ascii"))
    except (IndexError, ValueError, UnicodeDecodeError):
        return None


def _dropped(room: int, why: str) -> None:
    metrics.inc(DROPPED)
    suppressed = _LOG.admit()
    if suppressed is not None:
        logger.warning("pdsafe: dropped an unsigned ABORT of bootstrap room %s: %s (%d similar "
                       "suppressed; all counted in %s)", room, why, suppressed,
                       metrics.PREFIX + DROPPED.removesuffix("_total"))


@hook("unsigned_abort.hold", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=returns(None), internal=True,
      key=lambda kv_mgr, body: ("room", room_of(body)),
      effect="the ABORT is dropped: the prefill's request ends at its waiting timeout")
def hold(kv_mgr: Any, body: list[bytes]) -> None:
    """Prefill bootstrap thread, for an unsigned ABORT (the keyed prefill's
    :func:`control_mac.verified` calls this instead of passing it on): hold it until the grace
    ends, unless a decode already sent metadata for its room (then it is dropped now)."""
    room = room_of(body)
    if room is None:
        _dropped(-1, "malformed")
        return
    if transfer_generation.room_has_metadata(kv_mgr, room):
        _dropped(room, "a decode of this release claimed the room with signed metadata, so "
                       "its ABORTs must be signed")
        return
    table = _table(kv_mgr)
    evicted: list[int] = []
    with table.lock:
        held = table.rooms.get(room)
        duplicate = held is not None and len(held[1]) >= PER_ROOM
        if held is not None and not duplicate:
            held[1].append(list(body))
        elif held is None:
            deadline = time.monotonic() + grace_s()
            table.rooms[room] = (deadline, [list(body)])
            heapq.heappush(table.heap, (deadline, room))
            while len(table.rooms) > LIMIT:
                oldest, _ = table.rooms.popitem(last=False)
                evicted.append(oldest)
        if table.sweeper is None:
            table.sweeper = threading.Thread(target=_sweep, args=(kv_mgr, table),
                                             name="pdsafe-unsigned-abort", daemon=True)
            table.sweeper.start()
    table.wake.set()
    if duplicate:
        _dropped(room, f"{PER_ROOM} unsigned ABORTs of this room are already held")
    for oldest in evicted:
        _dropped(oldest, f"more than {LIMIT} rooms had unsigned ABORTs held (a flood)")


def _honour(kv_mgr: Any, room: int, bodies: list[list[bytes]]) -> None:
    """What upstream does with the ABORTs of a room nobody else claimed: the reason recorded,
    the room remembered as refused, the room failed now."""
    for body in bodies:
        kv_mgr.pdsafe_on_abort_message(body)
    default = (f"the decode serving this request aborted it (bootstrap room {room}); it never "
               "sent this prefill its metadata: a decode of another sglang-pdsafe release "
               "refuses this prefill at pairing. Run the same release on both servers")
    reason = kv_mgr.pdsafe_failure_reason_or(room, default)
    metrics.inc(HONOURED)
    transfer.fail_room(kv_mgr, room, policy.Refusal(500, reason, HONOURED))


def expire(kv_mgr: Any, table: Held, now: float) -> float | None:
    """Resolve every held ABORT whose grace ended by ``now``; the next deadline (None: none
    held). The sweeper's step, callable directly (tests)."""
    due: list[tuple[int, list[list[bytes]]]] = []
    with table.lock:
        while table.heap and table.heap[0][0] <= now:
            deadline, room = heapq.heappop(table.heap)
            held = table.rooms.get(room)
            if held is not None and held[0] == deadline:
                del table.rooms[room]
                due.append((room, held[1]))
        nxt = table.heap[0][0] if table.heap else None
    for room, bodies in due:
        if transfer_generation.room_has_metadata(kv_mgr, room):
            for _ in bodies:
                _dropped(room, "a decode of this release claimed the room with signed "
                               "metadata within the grace")
        else:
            _honour(kv_mgr, room, bodies)
    return nxt


def _sweep(kv_mgr: Any, table: Held) -> None:
    """The sweeper thread: resolve expired ABORTs, sleep until the next deadline."""
    failing = False
    while True:
        try:
            nxt = expire(kv_mgr, table, time.monotonic())
            failing = False
        except Exception:  # noqa: BLE001 - counted, logged once per run of failures, retried
            metrics.inc(FAILED)
            if not failing:
                logger.exception("pdsafe: the unsigned-ABORT sweep failed (counted in %s); "
                                 "retrying", metrics.PREFIX + FAILED.removesuffix("_total"))
            failing = True
            nxt = None
        wait = SWEEP_MAX_SLEEP_S if nxt is None else max(0.0, min(SWEEP_MAX_SLEEP_S,
                                                                  nxt - time.monotonic()))
        table.wake.wait(wait)
        table.wake.clear()
