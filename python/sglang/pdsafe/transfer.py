"""One home for a transfer's state: a record per reservation and leg, and its lifecycle.

Every protection that reads or advances a transfer keeps what it knows in that transfer's
:class:`Transfer` record, not in attributes of its own on upstream objects. Upstream objects
carry exactly two handles: a request (``Req``) carries its current record
(:data:`REQ_HANDLE`), and a KV manager carries its :class:`Leg` (:data:`LEG_HANDLE`), the
registry of the records and the per-server tables of that leg.

**Lifecycle** (``Transfer.state``; :meth:`Transfer.advance` raises :class:`IllegalTransition`
for anything not listed in :data:`TRANSITIONS`)::

    RESERVED --the reservation went out (decode metadata; prefill: a chunk queued)-> SENT
    SENT ------more of it went out (re-sent metadata, next chunk)------------------> SENT
    SENT ------the backend reported the transfer done----------------------------> WRITTEN
    WRITTEN ---decode: page generations and coverage attestation checked---------> VERIFIED
    VERIFIED --decode: the KV digest verified before the first decode step-------> COMMITTED
    WRITTEN ---prefill: Success stood, the source pages went back to upstream----> COMMITTED
    RESERVED | SENT | WRITTEN | VERIFIED --a check refused it, it failed, or it was
                                          aborted------------------------------> REFUSED
    REFUSED ---a writer may still touch the pages: held until evidence-----------> HELD
    REFUSED ---no writer can (none got them, or the transfer had completed)------> RELEASED
    HELD ------terminal evidence (drain ACK; the writer's process is gone; an
               operator's release)-----------------------------------------------> RELEASED
    REFUSED | HELD --evidence can never come (a hook failed, the backend cannot
                     prove its writes settled): held for good--------------------> LEAKED

COMMITTED, RELEASED and LEAKED are terminal. Only terminal evidence retires memory (the
TensorRT-LLM transceiver rule): a page of a transfer is handed back to the allocator by
upstream's release only in RELEASED, never from HELD, and never from LEAKED. A LEAKED
record's rows stay accounted to this server (:func:`held_rows`, read by the idle memory
check), so upstream's leak check does not mistake a deliberate hold for a bug.

**Legs.** A :class:`Leg` is one KV manager's side of PD (prefill or decode): the live records
by room (a room is live on a server from its claim until its endpoint is cleared), the
records still held after that (quarantined decode pages, leased prefill source pages), and
the named tables of the protections (:meth:`Leg.table`). Records are created and retired on
the scheduler thread; the KV control threads only read them (under :attr:`Leg.lock`).

What it proves and what it does not: the record makes every transfer's state readable in one
place and every change checked against the table; it does not by itself decide anything (the
protections do, each in its own module, through the record).
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sglang.pdsafe import metrics
from sglang.pdsafe.policy import Refusal, passthrough
from sglang.pdsafe.protections import PDModeUnknownError, pd_mode

logger = logging.getLogger("sglang.pdsafe.transfer")

#: The one attribute a request carries: its current transfer record.
REQ_HANDLE = "pdsafe_transfer"
#: The one attribute a KV manager carries: its leg.
LEG_HANDLE = "pdsafe_leg"
#: Retired records a leg remembers (for post-mortem reads such as an ABORT's generation).
MAX_RETIRED = 4096

T = TypeVar("T")


class State(enum.Enum):
    RESERVED = "reserved"
    SENT = "sent"
    WRITTEN = "written"
    VERIFIED = "verified"
    COMMITTED = "committed"
    REFUSED = "refused"
    HELD = "held"
    RELEASED = "released"
    LEAKED = "leaked"


_OPEN = (State.RESERVED, State.SENT, State.WRITTEN, State.VERIFIED)
#: The allowed transitions (see the module doc); anything else raises.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.RESERVED: frozenset({State.SENT, State.REFUSED}),
    State.SENT: frozenset({State.SENT, State.WRITTEN, State.REFUSED}),
    State.WRITTEN: frozenset({State.VERIFIED, State.COMMITTED, State.REFUSED}),
    State.VERIFIED: frozenset({State.COMMITTED, State.REFUSED}),
    State.COMMITTED: frozenset(),
    State.REFUSED: frozenset({State.HELD, State.RELEASED, State.LEAKED}),
    State.HELD: frozenset({State.RELEASED, State.LEAKED}),
    State.RELEASED: frozenset(),
    State.LEAKED: frozenset(),
}
TERMINAL = frozenset(s for s, nxt in TRANSITIONS.items() if not nxt)


class IllegalTransition(RuntimeError):
    """A record was asked to move along a transition :data:`TRANSITIONS` does not list."""


@dataclass(eq=False)
class Transfer:
    """What the protections know about one reservation on one leg.

    Invariant: ``state`` changes only through :meth:`advance`, along :data:`TRANSITIONS`;
    ``history`` lists every state it was in, in order.
    """

    seq: int
    leg: str  # "prefill" | "decode"
    room: int | None
    rid: str
    state: State = State.RESERVED
    since: float = field(default_factory=time.monotonic)
    # -- transfer generation (decode: minted and sent with the metadata; prefill: the one
    #    the room's decode ranks sent, read from the leg's table)
    generation: int = 0
    generation_sent: bool = False
    aux_index: int | None = None
    # -- the writer (decode): the prefill bootstrap address the destinations went to, and the
    #    incarnation of the prefill process registered there when they did
    writer: str = ""
    writer_incarnation: str | None = None
    # -- what each protection recorded (typed by its module)
    coverage: Any = None       # coverage.Coverage: decode's reservation
    pages: Any = None          # page_generation.Reservation (decode) / SourceRecord (prefill)
    digest: Any = None         # kv_integrity.Expected (decode, from commit to first step)
    hold: Any = None           # quarantine.Hold (decode) / source_lease.Lease (prefill)
    # -- the room guard: duplicates of the room refused while this record held it; whether
    #    it keeps the room live past its endpoint's clear (a draining source lease)
    duplicates_refused: int = 0
    keeps_room: bool = False
    metadata_out: bool = False  # decode: the reservation's metadata went to its prefill
    #: decode: the receiver sent its prefill a deferred BOOTSTRAP (``prefill_complete``
    #: allocation): that prefill may address the room's notices before any metadata
    bootstrap_out: bool = False
    rejection: Any = None  # placeholder_guard.Rejection: refused at intake, typed
    # -- how it ended
    refusal: Refusal | None = None
    evidence: str = ""
    history: list[State] = field(default_factory=list)

    def advance(self, to: State, *, why: str = "") -> None:
        """Move to ``to`` (raises :class:`IllegalTransition` when not allowed)."""
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(
                f"transfer {self.rid} (room {self.room}, {self.leg}): {self.state.value} -> "
                f"{to.value} is not an allowed transition{f' ({why})' if why else ''}")
        self.history.append(self.state)
        self.state = to
        if why and to in (State.RELEASED, State.LEAKED, State.HELD):
            self.evidence = why

    def refuse(self, refusal: Refusal | None = None) -> None:
        """Into REFUSED from any open state (idempotent once refused or later)."""
        if refusal is not None and self.refusal is None:
            self.refusal = refusal
        if self.state in _OPEN:
            self.advance(State.REFUSED, why=refusal.reason if refusal else "")

    def reach(self, to: State) -> None:
        """Advance to ``to`` if not there yet (SENT again is a no-op)."""
        if self.state is not to:
            self.advance(to)

    @property
    def is_open(self) -> bool:
        return self.state in _OPEN

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


class Leg:
    """One KV manager's records and tables (see the module doc)."""

    def __init__(self, side: str) -> None:
        self.side = side
        self.lock = threading.RLock()
        self.live: dict[int, Transfer] = {}
        self.held: dict[int, Transfer] = {}
        self.retired: OrderedDict[int, Transfer] = OrderedDict()
        self._seq = itertools.count(1)
        self._tables: dict[str, Any] = {}
        #: Endpoints (KV senders/receivers) that released their room here already (weak: an
        #: endpoint is forgotten with its request).
        self._released_endpoints: weakref.WeakSet[Any] = weakref.WeakSet()

    # -- records
    def open(self, room: int | None, rid: str) -> Transfer:
        """The live record of ``room`` for ``rid`` (a new one unless ``rid`` already holds
        the room: a re-entry of the same request). A record of another request still live
        on the room is retired first (only a re-bootstrap or a disabled room guard gets
        here past a live holder)."""
        with self.lock:
            rec = self.live.get(room) if room is not None else None
            if rec is not None and rec.rid == rid and rec.is_open:
                return rec
            new = Transfer(seq=next(self._seq), leg=self.side, room=room, rid=rid)
            if room is not None:
                if rec is not None:
                    self._retire(rec)
                self.live[room] = new
        if room is not None:
            for listener in ROOM_OPENED:
                listener(self, new)
        return new

    def of_room(self, room: int | None) -> Transfer | None:
        with self.lock:
            return None if room is None else self.live.get(int(room))

    def close(self, rec: Transfer) -> None:
        """The endpoint of ``rec``'s room dropped its per-room state (upstream's clear): the
        room is free on this server. A record that ended before anything was written
        (RESERVED, SENT) is refused; one still HELD stays in :attr:`held`."""
        if rec.state in (State.RESERVED, State.SENT):
            rec.refuse()
        with self.lock:
            if rec.room is not None and self.live.get(rec.room) is rec:
                del self.live[rec.room]
            if rec.state is State.HELD:
                self.held[rec.seq] = rec
            else:
                self._retire(rec)

    def first_release(self, endpoint: Any) -> bool:
        """True the first time ``endpoint`` releases its room here, False on every later
        call (upstream clears an endpoint more than once on some failure paths). Upstream's
        endpoints are ordinary objects; one that cannot be weakly referenced raises
        ``TypeError`` (the caller's hook then keeps the room: fail closed)."""
        with self.lock:
            if endpoint in self._released_endpoints:
                return False
            self._released_endpoints.add(endpoint)
            return True

    def keep_room(self, rec: Transfer) -> Transfer | None:
        """Keep ``rec``'s room live past its endpoint's clear (a draining source lease);
        returns the record that held the room before, if any."""
        with self.lock:
            prev = self.live.get(rec.room) if rec.room is not None else None
            if rec.room is not None:
                self.live[rec.room] = rec
            rec.keeps_room = True
            return prev

    def release_room(self, kv_mgr: Any, rec: Transfer) -> None:
        """``rec`` stops keeping its room live; the room-freed listeners run."""
        with self.lock:
            rec.keeps_room = False
            if rec.room is not None and self.live.get(rec.room) is rec:
                del self.live[rec.room]
        room_freed(kv_mgr, rec)

    def hold(self, rec: Transfer) -> None:
        """``rec`` holds pages past its room's release (listed until released)."""
        with self.lock:
            self.held[rec.seq] = rec

    def unhold(self, rec: Transfer) -> None:
        with self.lock:
            self.held.pop(rec.seq, None)
            if rec.state in TERMINAL and not (rec.room is not None
                                              and self.live.get(rec.room) is rec):
                self._retire(rec)

    def _retire(self, rec: Transfer) -> None:
        self.retired[rec.seq] = rec
        while len(self.retired) > MAX_RETIRED:
            self.retired.popitem(last=False)

    def records(self) -> list[Transfer]:
        with self.lock:
            return list(self.live.values()) + [r for r in self.held.values()
                                              if r not in self.live.values()]

    def held_records(self) -> list[Transfer]:
        with self.lock:
            return list(self.held.values())

    # -- the protections' per-leg tables
    def table(self, name: str, factory: Callable[[], T]) -> T:
        """The leg's table ``name`` (created by ``factory`` on first use, under the lock)."""
        t = self._tables.get(name)
        if t is None:
            with self.lock:
                t = self._tables.get(name)
                if t is None:
                    t = self._tables[name] = factory()
        return t

    def tables(self) -> dict[str, Any]:
        return dict(self._tables)


_leg_lock = threading.Lock()


def _side_of(kv_mgr: Any) -> str:
    try:
        mode = pd_mode(kv_mgr)
    except PDModeUnknownError:
        return "PD"
    return mode if mode in ("prefill", "decode") else "PD"


def leg(kv_mgr: Any) -> Leg:
    """The leg of ``kv_mgr`` (created on first use, under a lock; the one attribute pdsafe
    keeps on a KV manager)."""
    found = getattr(kv_mgr, LEG_HANDLE, None)
    if isinstance(found, Leg):
        return found
    with _leg_lock:
        found = getattr(kv_mgr, LEG_HANDLE, None)
        if not isinstance(found, Leg):
            found = Leg(_side_of(kv_mgr))
            setattr(kv_mgr, LEG_HANDLE, found)
            _LEGS.append(found)
    return found


def leg_if_any(kv_mgr: Any) -> Leg | None:
    found = getattr(kv_mgr, LEG_HANDLE, None)
    return found if isinstance(found, Leg) else None


#: Every leg of this process (a scheduler process has one per KV manager).
_LEGS: list[Leg] = []


def of(req: Any) -> Transfer | None:
    """The record ``req`` carries (None: none)."""
    rec = getattr(req, REQ_HANDLE, None)
    return rec if isinstance(rec, Transfer) else None


def attach(req: Any, rec: Transfer) -> Transfer:
    """Give ``req`` its record (the one attribute pdsafe keeps on a request)."""
    setattr(req, REQ_HANDLE, rec)
    return rec


def open_for(kv_mgr: Any, req: Any) -> Transfer:
    """``req``'s live record on ``kv_mgr``'s leg: the one it carries if still open on that
    leg, else a new one (claimed for its room) attached to it."""
    rec = of(req)
    lg = leg(kv_mgr)
    if rec is not None and rec.is_open and rec.leg == lg.side \
            and lg.of_room(rec.room) is rec:
        return rec
    room = getattr(req, "bootstrap_room", None)
    return attach(req, lg.open(None if room is None else int(room), str(getattr(req, "rid", "?"))))


def record_for(req: Any, kv_mgr: Any = None) -> Transfer:
    """``req``'s open record: the one it carries, else one opened on ``kv_mgr``'s leg, else
    (no manager in hand: a stand-in) a record of no leg, attached to ``req``."""
    rec = of(req)
    if rec is not None and rec.is_open:
        return rec
    if kv_mgr is not None:
        return open_for(kv_mgr, req)
    room = getattr(req, "bootstrap_room", None)
    return attach(req, Transfer(seq=-1, leg="", room=None if room is None else int(room),
                                rid=str(getattr(req, "rid", "?"))))


#: Called with (leg, record) after a request's record was opened on its room (outside the
#: leg's lock; registered by the protections that act then: the prefill's unclaimed-room
#: table stops counting down the room). A listener must not raise.
ROOM_OPENED: list[Callable[[Leg, Transfer], None]] = []

#: Called with (kv_mgr, record) when a record stops holding its room (registered by the
#: protections that act then: the room guard answers duplicates refused meanwhile).
ROOM_FREED: list[Callable[[Any, Transfer], None]] = []


def room_freed(kv_mgr: Any, rec: Transfer) -> None:
    """Tell the room-freed listeners that ``rec`` no longer holds its room on ``kv_mgr``."""
    for listener in ROOM_FREED:
        listener(kv_mgr, rec)


# =========================================================================== held rows

#: Request rows held for good (LEAKED) or awaiting evidence (HELD) outside upstream's own
#: queues; the idle memory check counts them as in use (patch: ``PoolStatsObserver``).
_held_rows: dict[int, HeldRow] = {}
_rows_lock = threading.Lock()


@dataclass(frozen=True)
class HeldRow:
    """One held request row: ``row`` is the KV record upstream's idle memory check counts
    (a ``ReqKvInfo``); ``pages``, when set, are the page ids the hold keeps, narrower than the
    row's slot range (pages freed under a transfer are no longer the row's: a diagnostic
    that walks the row's slots must use these instead)."""

    row: Any
    pages: Any | None = None


#: Keys of the held-row table, minted here. Never a caller's ``id()``: Python reuses the id of
#: a collected object, so a later request's hold would replace an earlier one's under the same
#: key and drop that row from the accounting (a hold for good is never dropped, and upstream's
#: strict idle memory check then stops the scheduler: "req_to_token_pool memory leak").
_row_keys = itertools.count(1)


def hold_row(kv_row: Any, pages: Any | None = None, *, key: int | None = None) -> int:
    """Keep ``kv_row`` (a request's KV record, or its accounting copy) accounted as in use;
    ``pages``: see :class:`HeldRow`. Returns the row's key in the table: a fresh one, or
    ``key`` (a key this function returned) to replace the row that key holds (the same row
    held again, counted once). Invariant: two holds made without a key never share one."""
    with _rows_lock:
        if key is None:
            key = next(_row_keys)
        _held_rows[key] = HeldRow(kv_row, pages)
        n = len(_held_rows)
    metrics.set_gauge("held_rows", float(n))
    return key


def drop_row(key: int) -> None:
    """Forget the row held under ``key`` (a key :func:`hold_row` returned)."""
    with _rows_lock:
        _held_rows.pop(key, None)
        n = len(_held_rows)
    metrics.set_gauge("held_rows", float(n))


def held_items() -> list[tuple[int, HeldRow]]:
    """Every held row with its key (for audits and the tests' cleanup)."""
    with _rows_lock:
        return list(_held_rows.items())


@passthrough("transfer.held_rows",
             why="reads the rows this process holds for upstream's idle memory check; it "
                 "frees and refuses nothing")
def held_rows() -> list[Any]:
    """The request rows pdsafe holds in this process (read by upstream's idle memory
    check, so that a deliberate hold is not reported as a leak)."""
    return [h.row for h in held()]


def held() -> list[HeldRow]:
    """Every held row that still holds KV, with the pages it keeps where they are narrower
    than its slot range (for audits and reports)."""
    with _rows_lock:
        return [h for h in _held_rows.values() if getattr(h.row, "holds_kv", True)]


# =========================================================================== outcomes


#: (id of the KV manager, room) pairs :func:`fail_room` is failing on this thread right now.
_failing = threading.local()


def fail_room(kv_mgr: Any, room: Any, refusal: Refusal) -> bool:
    """Refuse the transfer of ``room`` now, through upstream's own failure path: record the
    reason and mark the room Failed; the scheduler's next poll fails the request with it.

    The other leg is told at once. On decode, upstream's failure handling sends the prefill
    its ABORT. On prefill, upstream tells the decode only when a transfer fails mid-write, so
    a room failed before or between writes would leave its decode waiting for its bootstrap
    timeout: this function answers the decode's metadata with ``Failed`` and the reason,
    tagged with the generation it sent, now or when the metadata arrives (peer release's
    ``prefill_rejected``). A prefill room with no state yet (its decode's metadata came
    first, its request has not arrived) is remembered as refused the same way: the sender
    opened for it later fails at once (``peer_release.on_sender_created``) instead of waiting
    for metadata that was dropped. Returns False when the room has no state on ``kv_mgr``
    (nothing failed now: the caller refuses by other means).

    Re-entrant calls for the same room on the same thread return at once (True: the outer
    call is failing it): telling the decode runs hooks of its own (the generation frames of the
    Failed), and the failure outcome of such a hook is this function again; without the guard
    a failing frame hook recursed until the stack overflowed, and the server poisoned itself."""
    if room is None or kv_mgr is None:
        return False
    room = int(room)
    active: set[tuple[int, int]] | None = getattr(_failing, "rooms", None)
    if active is None:
        active = _failing.rooms = set()
    key = (id(kv_mgr), room)
    if key in active:
        return True
    active.add(key)
    try:
        return _fail_room_once(kv_mgr, room, refusal)
    finally:
        active.discard(key)


def _fail_room_once(kv_mgr: Any, room: int, refusal: Refusal) -> bool:
    """:func:`fail_room`'s body, entered once per room and thread at a time."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    rec = leg(kv_mgr).of_room(room)
    if rec is not None:
        rec.refuse(refusal)
    kv_mgr.record_failure(room, refusal.reason)
    status = kv_mgr.pdsafe_room_status(room)
    if status != KVPoll.Success:  # None too: a prefill remembers a room it has no state for
        if status is not None:
            kv_mgr.update_status(room, KVPoll.Failed)
        if _side_of(kv_mgr) == "prefill":
            # peer_release imports this module: the import cannot be at module level.
            from sglang.pdsafe import peer_release

            peer_release.prefill_rejected(kv_mgr, room, refusal.reason,
                                          status=refusal.status)
    return status is not None


def records(kv_mgrs: Iterable[Any]) -> list[Transfer]:
    """Every record of the given managers (for reports and tests)."""
    out: list[Transfer] = []
    for m in kv_mgrs:
        lg = leg_if_any(m)
        if lg is not None:
            out += lg.records()
    return out
