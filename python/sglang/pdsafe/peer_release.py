"""Peer released at once: a PD request refused or aborted on one side frees the other side now.

Upstream keeps a refused request out of its own side's queues (``is_unadmitted_reject`` at both
PD doors), but never tells the other side. A prefill that refuses a prompt leaves the decode
server holding the pages it reserved, waiting for a transfer that never comes, until
``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (300 s); a decode that refuses leaves the prefill
holding a sender (and a queue slot) until ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``. Anyone who
can send over-long prompts can pin the other side's memory that way (a DoS lever). Through the
router the peer is freed only when its HTTP connection is dropped and the tokenizer's disconnect
poll notices (seconds), and a direct client of the peer just hangs.

Peer release closes it through the backends' existing control channel, in the common layer
(``disaggregation/common/conn.py``), so Mooncake, NIXL, MORI and Ascend run the same logic. It
is three modules:

* this one, the **prefill side**: the prefill remembers every room it refused or aborted before
  the transfer (``prefill_rejected``, with an expiry) and answers decode's bootstrap metadata
  for that room with a ``Failed`` KV status carrying the reason, at once if the metadata is
  already there, else the moment it arrives (``on_metadata_complete``). Decode then fails the
  request with that reason and frees its pages through upstream's deferred-release
  ABORT/ABORT_ACK. A bare ABORT from decode (or from this prefill's own HTTP layer) fails the
  room's sender at once, or the sender created later for it (``on_abort_message``,
  ``on_sender_created``).
* :mod:`sglang.pdsafe.peer_notifier`, the **decode / HTTP side**: a decode that refuses a
  request at its door, aborts it before it knew the prefill ranks, or whose HTTP layer refuses
  it, sends a bare ``ABORT(room)`` to every prefill rank that may own the room; a prefill's HTTP
  layer sends it to its own ranks. Its public hooks are re-exported here.
* :mod:`sglang.pdsafe.peer_release_wire`: the bare ABORT frame, the switch, the counters.

This module reaches upstream only through public members and the named methods that patch
0013 adds to ``CommonKVManager`` (``pdsafe_decode_endpoints``, ``pdsafe_send_failed_status``,
``pdsafe_forget_room``, ``pdsafe_room_status``), declared below for the startup self-check.

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

import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from sglang.pdsafe import metrics, policy, transfer, transfer_generation
from sglang.pdsafe.hook_api import require
from sglang.pdsafe.peer_notifier import (  # noqa: F401 - the patches' call sites use these names
    decode_rejected,
    finish_message,
    is_fake_bootstrap,
    notify_prefill,
    on_http_undelivered,
    on_receiver_aborted,
)
from sglang.pdsafe.peer_release_wire import (  # noqa: F401 - re-exported for the call sites
    ABORT_TAG,
    ENV_ENABLE,
    FAILED,
    FAILURE_PREFIX,
    ORIGIN_HTTP,
    ORIGIN_LOCAL,
    ORIGIN_PEER,
    WIRE_PREFIX,
    count_notified,
    enabled,
    notify_failed,
    parse_abort,
    peer_refusal_status,
    request_refusal_status,
    status_note,
    wire_frame,
)
from sglang.pdsafe.policy import Outcome, hook, returns
from sglang.srt.disaggregation.base.conn import KVPoll

logger = logging.getLogger("sglang.pdsafe.peer_release")

ENV_TTL = "SGLANG_PDSAFE_PEER_RELEASE_TTL"
#: Default lifetime of a refused room: a decode may publish its metadata late (its prealloc
#: queue can wait for memory), so keep the answer ready well past upstream's 300 s timeouts.
DEFAULT_TTL_S = 600.0
#: Bound on remembered rooms per prefill manager (oldest dropped first, counted).
MAX_ROOMS = 65536

_KV_MANAGER = "sglang.srt.disaggregation.common.conn.CommonKVManager"
require(_KV_MANAGER,
        "pdsafe_decode_endpoints(bootstrap_room)",
        "pdsafe_send_failed_status(bootstrap_room, endpoints, message)",
        "pdsafe_forget_room(bootstrap_room)",
        "pdsafe_room_status(bootstrap_room)",
        why="the prefill answers decode's metadata for a refused room with Failed and drops it "
            "(patch 0013's named API)")
require(_KV_MANAGER, "record_failure(bootstrap_room, failure_reason)",
        "update_status(bootstrap_room, status)",
        why="a room refused or aborted on the other side fails its sender with the reason")
require(_KV_MANAGER, "pdsafe_on_abort_message(msg)",
        "pdsafe_failure_reason_or(bootstrap_room, default)",
        why="the backends' prefill ABORT handlers route ABORT frames to on_abort_message, and "
            "NIXL's keeps the reason it recorded (patch 0013)")
require("sglang.srt.disaggregation.base.conn.KVPoll", "Failed", "Success",
        why="room states peer release reads and sets")



def _wire(origin: str, reason: str) -> bytes:
    """Kept for callers of the pre-split module (tests): see ``peer_release_wire.wire_frame``."""
    return wire_frame(origin, reason)


def _ttl_s() -> float:
    raw = os.environ.get(ENV_TTL)
    if raw is None:
        return DEFAULT_TTL_S
    try:
        return max(1.0, float(raw))
    except ValueError:
        logger.warning("pdsafe peer release: %s=%r is not a number of seconds; using the "
                       "default %.0f s", ENV_TTL, raw, DEFAULT_TTL_S)
        return DEFAULT_TTL_S


@dataclass(slots=True)
class _Room:
    """A room this prefill must not serve: why, since when, and whether decode was told."""

    reason: str
    origin: str
    t0: float  # time.monotonic() of the rejection (receipt, for a peer/HTTP notice)
    t0_wall: float | None  # wall clock of the rejection as sent by our own HTTP layer
    expires: float
    #: (decode endpoint, the transfer generation of the metadata it was told about) pairs
    #: already told: a later request of the room from the same endpoint is a new reservation
    #: with a new generation, and is told too (None: a stock decode, which sends none).
    answered: set[tuple[tuple[str, int], int | None]] = field(default_factory=set)
    counted: bool = False
    status: int | None = None  # the 4xx this prefill answered its own client with, if any
    reanswer: bool = False  # answer every metadata arrival, not each endpoint once (duplicates)


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
                metrics.inc(FAILED)
                logger.warning("pdsafe peer release: more than %d refused rooms remembered; "
                               "dropped room %s before its decode asked for it", MAX_ROOMS, room)

    def record(self, room: int, reason: str, origin: str,
               t0_wall: float | None = None, status: int | None = None,
               ttl_s: float | None = None) -> _Room:
        now = time.monotonic()
        with self.lock:
            rec = self.rooms.get(room)
            if rec is None or rec.expires <= now:
                rec = _Room(reason, origin, now, t0_wall, now + (ttl_s or _ttl_s()),
                            status=status)
                self.rooms[room] = rec
            elif origin != ORIGIN_PEER and rec.origin == ORIGIN_PEER:
                # A local verdict is the one decode should hear (a peer ABORT carries none).
                rec.reason, rec.origin, rec.t0, rec.t0_wall = reason, origin, now, t0_wall
                rec.status = status
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

    def is_live(self, room: int) -> bool:
        with self.lock:
            return room in self.live

    def claim_targets(self, rec: _Room, targets: list[tuple[str, int]],
                      generations: list[int | None]) -> tuple[list[tuple[str, int]], bool]:
        """The decode endpoints not told yet about the reservation they published now
        (``generations[i]``: the transfer generation of ``targets[i]``'s metadata; each
        reservation is told once), and whether this is the room's first answer (counted
        once)."""
        keyed = list(zip(targets, generations, strict=True))
        with self.lock:
            fresh = keyed if rec.reanswer else [k for k in keyed if k not in rec.answered]
            rec.answered.update(fresh)
            new = [t for t, _ in fresh]
            first = bool(new) and not rec.counted
            rec.counted = rec.counted or bool(new)
            return new, first


def _registry(kv_mgr: Any) -> _Registry:
    """The registry of a prefill KV manager (a table of its leg)."""
    return transfer.leg(kv_mgr).table("peer_release", _Registry)


def _is_prefill(kv_mgr: Any) -> bool:
    mode = kv_mgr.disaggregation_mode
    return getattr(mode, "value", mode) == "prefill"


def _kvpoll() -> Any:
    return KVPoll


def _failure_message(room: int, rec: _Room) -> str:
    """The error both clients read: which side gave up the room, and its own reason.

    Starts with ``FAILURE_PREFIX``; a refusal that was a client error carries its status as
    ``(HTTP 4xx)`` (``status_note``), which the peer answers its own client with.
    """
    who = {
        ORIGIN_LOCAL: "the prefill server refused or aborted it",
        ORIGIN_HTTP: "the prefill server's HTTP layer refused it",
        ORIGIN_PEER: "it was aborted on the decode side",
    }[rec.origin]
    return (f"{FAILURE_PREFIX} (bootstrap room {room}) was given up before its KV "
            f"transfer completed: {who}{status_note(rec.status)}: {rec.reason}")


def _answer_decode(kv_mgr: Any, room: int, rec: _Room) -> bool:
    """Tell every decode endpoint that published metadata for ``room`` that it failed.

    Returns True when decode's metadata was known (answered now, or earlier). Without a live
    sender for the room, also drops the metadata, so nothing can ever be written for it.
    """
    targets = kv_mgr.pdsafe_decode_endpoints(room)
    if not targets:
        return False
    reg = _registry(kv_mgr)
    generations = [transfer_generation.target_generation(kv_mgr, room, host, port)
                   for host, port in targets]
    targets, first = reg.claim_targets(rec, targets, generations)
    sent = 0
    if targets:
        for (host, port), err in transfer_generation.send_failed_status(
                kv_mgr, room, targets, _failure_message(room, rec)):
            if err is None:
                sent += 1
            else:  # a dead decode must not stop the others
                notify_failed(f"send the Failed status of room {room} to decode {host}:{port}",
                              err)
    if not reg.is_live(room):
        kv_mgr.pdsafe_forget_room(room)
    if sent and first:
        count_notified(None if rec.origin == ORIGIN_HTTP else rec.t0, rec.t0_wall)
    if sent:
        logger.info("pdsafe peer release: told decode %s that room %s failed (%s)",
                    targets, room, rec.reason)
    return True


@hook("peer_release.prefill_rejected", outcome=Outcome.REFUSE, counter=FAILED, internal=True,
      on_failure=returns(None), key=lambda kv_mgr, room, *a, **k: ("room", room),
      effect="the request stays refused; its decode is not told and frees at its own timeout "
             "(counted)")
def prefill_rejected(kv_mgr: Any, room: int | None, reason: str, origin: str = ORIGIN_LOCAL,
                     t0_wall: float | None = None, status: int | None = None,
                     ttl_s: float | None = None) -> None:
    """This prefill will not serve ``room``: answer decode's metadata with Failed (now or later).

    Called at the prefill doors (request refused before a sender exists), when a sender is
    aborted before its transfer, for a bare ABORT from our own HTTP layer, and when an
    unclaimed room's metadata is dropped. The refusal is remembered for ``ttl_s`` (default
    ``SGLANG_PDSAFE_PEER_RELEASE_TTL``); a room already remembered keeps its first expiry.
    """
    if room is None or kv_mgr is None or not enabled() or not _is_prefill(kv_mgr):
        return
    if kv_mgr.pdsafe_room_status(int(room)) == _kvpoll().Success:
        return  # the KV was already sent: nothing is reserved for it any more
    rec = _registry(kv_mgr).record(int(room), reason, origin, t0_wall, status, ttl_s=ttl_s)
    _answer_decode(kv_mgr, int(room), rec)


#: How long a prefill answers decode metadata for a room whose refused duplicate's counterpart
#: may still arrive (short: a client may reuse the room legitimately once both are gone).
DUPLICATE_TTL_S = 10.0


@hook("peer_release.duplicate_released", outcome=Outcome.REFUSE, counter=FAILED, internal=True,
      on_failure=returns(None), key=lambda kv_mgr, room, *a, **k: ("room", room),
      effect="the refused duplicate's decode leg is not told; it fails at its own timeout "
             "(counted)")
def duplicate_released(kv_mgr: Any, room: int, reason: str, status: int) -> None:
    """The live request of ``room`` on this prefill is being cleared, and a duplicate of the
    room was refused here while it held it (``sglang.pdsafe.room_guard``). The duplicate's
    decode leg, if that decode admitted it, waits for a transfer no sender will make: answer
    its metadata with Failed, now (still in ``transfer_infos``) or when it arrives within
    ``DUPLICATE_TTL_S``. Called before upstream drops the room's state; unlike
    :func:`prefill_rejected` it also acts when the live request's transfer succeeded (that is
    the case to cover: the room's one transfer is done, the duplicate's leg has none).
    """
    if not enabled() or not _is_prefill(kv_mgr):
        return
    reg = _registry(kv_mgr)
    rec = reg.record(int(room), reason, ORIGIN_LOCAL, status=status, ttl_s=DUPLICATE_TTL_S)
    # Every request of the room comes from the same decode endpoints (the live one's leg, the
    # duplicate's, a client's retry within the TTL): each metadata arrival is answered, not
    # each endpoint once (a Failed for a room decode no longer holds is ignored there).
    with reg.lock:
        rec.reanswer = True
    _answer_decode(kv_mgr, int(room), rec)


def _metadata_failed(failure: policy.Failure) -> bool:
    """The check could not run: on a prefill, the room is not bootstrapped (no sender may
    serve it unchecked) and fails here; the decode is told Failed through upstream's path.
    A decode's room (``update_status`` runs there too; the check is prefill-only, its first
    step, repeated here) is left to upstream: failing it there on a check that does not apply
    left the prefill leg waiting for its timeout (hook-failure suite, 2026-12-07)."""
    kv_mgr, room = failure.args[0], failure.args[1]
    if not _is_prefill(kv_mgr):
        return False
    transfer.fail_room(kv_mgr, room, failure.refusal(
        503, "the KV transfer (this prefill could not check whether it refused the room)"))
    return True


@hook("peer_release.on_metadata_complete", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_metadata_failed, key=lambda kv_mgr, room: ("room", room),
      effect="the room is not bootstrapped and fails at once (503; the decode told Failed)")
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
    return not reg.is_live(room)


def _sender_created_failed(failure: policy.Failure) -> None:
    """The check could not run: the new sender's room fails now (it may have been refused)."""
    sender = failure.args[0]
    transfer.fail_room(sender.kv_mgr, sender.bootstrap_room, failure.refusal(
        503, "the KV transfer (this prefill could not check whether it refused the room)"))


@hook("peer_release.on_sender_created", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_sender_created_failed,
      key=lambda sender: ("room", getattr(sender, "bootstrap_room", None)),
      effect="the new sender's room fails at once (503; the decode told Failed)")
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
    kv_mgr.record_failure(room, _failure_message(room, rec))
    kv_mgr.update_status(room, _kvpoll().Failed)
    logger.info("pdsafe peer release: room %s was refused before its sender opened; failing "
                "it now (%s)", room, rec.reason)


@hook("peer_release.on_sender_cleared", outcome=Outcome.HOLD, counter=FAILED,
      on_failure=returns(None),
      key=lambda sender: ("room", getattr(sender, "bootstrap_room", None)),
      effect="the room stays marked live in peer release (its metadata is kept, never "
             "dropped early); nothing is freed")
def on_sender_cleared(sender: Any) -> None:
    """A sender was cleared: the room has no live sender any more."""
    if not _is_prefill(sender.kv_mgr):
        return
    reg = _registry(sender.kv_mgr)
    with reg.lock:
        reg.live.discard(sender.bootstrap_room)


@hook("peer_release.on_sender_aborted", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=returns(None),
      key=lambda sender, *a: ("room", getattr(sender, "bootstrap_room", None)),
      effect="the sender is aborted as upstream does; its decode is not told and frees at "
             "its own timeout (counted)")
def on_sender_aborted(sender: Any, reason: str = "aborted on the prefill server") -> None:
    """``CommonKVSender.abort()``, before upstream marks the room Failed: the prefill gave the
    room up. Nothing to tell when its transfer already succeeded."""
    if sender.conclude_state == _kvpoll().Success:
        return
    prefill_rejected(sender.kv_mgr, sender.bootstrap_room, reason)


@hook("peer_release.on_abort_message", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=returns(None),
      effect="the backend still handles the ABORT (the room fails with upstream's generic "
             "reason instead of the peer's)")
def on_abort_message(kv_mgr: Any, msg: list[bytes]) -> None:
    """Prefill control thread, on an ABORT frame, before the backend handles it.

    A live sender for the room gets the reason recorded first (``record_failure``; the backend
    then marks the room Failed, and NIXL's own generic reason goes through
    ``pdsafe_failure_reason_or``, so this reason wins and the prefill client sees why). The
    room is remembered, so a sender opened later fails at once. Our bare ABORT from this
    prefill's own HTTP layer (origin ``http``) also gets decode's metadata answered with
    Failed, now or when it arrives.
    """
    if not enabled() or not _is_prefill(kv_mgr):
        return
    notice = parse_abort(msg)
    if notice is None:
        return
    if transfer_generation.abort_message_is_stale(kv_mgr, msg):
        return  # an earlier reservation's ABORT: the backend drops it (counted there)
    room = notice.room
    kvpoll = _kvpoll()
    status = kv_mgr.pdsafe_room_status(room)
    if status == kvpoll.Success:
        return  # the KV was already sent: nothing is reserved for it any more
    reg = _registry(kv_mgr)
    if reg.is_live(room) and status is not None and status != kvpoll.Failed:
        # Before the backend marks the room Failed, so the scheduler never reads it bare.
        rec = _Room(notice.reason, notice.origin, 0.0, None, 0.0)
        kv_mgr.record_failure(room, _failure_message(room, rec))
    if notice.origin == ORIGIN_HTTP:
        prefill_rejected(kv_mgr, room, notice.reason, ORIGIN_HTTP, notice.t0_wall)
    else:
        reg.record(room, notice.reason, ORIGIN_PEER)


@hook("peer_release.prefill_door_rejected", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=returns(None),
      key=lambda queue, req, *a: ("room", getattr(req, "bootstrap_room", None)),
      effect="the request stays refused; its decode is not told and frees at its own "
             "timeout (counted)")
def prefill_door_rejected(bootstrap_queue: Any, req: Any, reason: str | None = None) -> None:
    """A prefill door (``PrefillBootstrapQueue.add``) refused ``req`` before a sender existed.

    Takes the queue, not its KV manager: the manager is read here, inside the guard, so a
    queue without one (upstream's unit tests build bare queues) never fails at the call site.
    """
    if is_fake_bootstrap(getattr(req, "bootstrap_host", None)):
        return
    prefill_rejected(bootstrap_queue.kv_manager, getattr(req, "bootstrap_room", None),
                     reason or finish_message(req), status=request_refusal_status(req))
