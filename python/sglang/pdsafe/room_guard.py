"""Client-chosen ``bootstrap_room`` values made harmless: one live request per room per server.

Upstream keys all of a PD server's per-transfer state by the bootstrap room alone: the KV
manager's ``request_status``, ``transfer_infos``, ``failure_records``, the decode's
``prefill_response_tracker``, the aux/metadata rows, the ABORT/KV_STATUS messages. The room is
client-controlled (``bootstrap_room`` of ``/generate``, the router only suggests one), and
upstream never checks that a room is free. Two concurrent requests with the same room share
one status entry: the second sender or receiver reads the first one's ``Transferring`` or
``Success`` where it expects ``Bootstrapping``, and the scheduler raises out of its event loop
(decode ``DecodePreallocQueue._update_handshake_waiters``: ``ValueError: Unexpected poll case:
4``; prefill ``pop_bootstrapped``: ``Unexpected poll state``), taking the server down for every
tenant (sgl-project/sglang#40125). Parallel sampling (``n>1``) sends its prefix-cache request
and all ``n`` samples with the request's one room (#26486, #40297): the same collision, by
construction.

This module closes both:

* **The scheduler doors** (``PrefillBootstrapQueue.add``, ``DecodePreallocQueue.add``) refuse a
  request whose room is live on this server with HTTP 409 (``CONFLICT_STATUS``), counted in
  ``sglang:pdsafe_room_duplicate_refused_total``, before anything touches the KV manager's
  per-room state (no sender or receiver is created, nothing is reserved). The peer is **not**
  told: a peer-release ABORT carries only the room, so it would fail the live request that
  owns it; the peer sees the same duplicate and refuses it itself. If the two legs kept
  different requests of one room (prefill kept A, decode kept B), decode's commit gate refuses
  the transfer (the coverage attestation's token digest binds prefill's tokens, see
  :mod:`sglang.pdsafe.coverage`): an explicit error, never another request's KV.
* **Parallel sampling** (``n>1``) on a PD server is served with one room per sample
  (:mod:`sglang.pdsafe.sample_rooms`, patch 0031); a tokenizer manager without that patch (an
  earlier prefix of the series, or an upstream in another shape) refuses ``n>1`` at the HTTP
  layer with 400 (:class:`ParallelSamplingRefusedError`), counted in
  ``sglang:pdsafe_room_parallel_sampling_refused_total``, before the request is registered.

State: the room's live :class:`~sglang.pdsafe.transfer.Transfer` record in the KV manager's
leg (:mod:`sglang.pdsafe.transfer`; a room is live from its claim until its endpoint drops the
room's state), per room::

    free --claim (a sender/receiver is about to be created for the room)--> live(record)
    live --release (that sender/receiver is cleared; a prefill sender is aborted)--> free
    live --door(another request, same room)--> live (the newcomer is refused 409)
    any  --release again (the same sender/receiver, a later clear)--> unchanged; the caller
         drops upstream's per-room state only if the room is free (never a newcomer's)

Invariant: while a room is live on a server, no second request of that room gets a KV sender
or receiver there (a re-entry of the same request, decode retraction or re-bootstrap, is not a
new request and is never refused). A room is released exactly where upstream drops the KV
manager's per-room state (``CommonKVSender.clear``, ``CommonKVReceiver`` ``_clear``) and when a
prefill sender is aborted (upstream keeps an aborted prefill sender's state without clearing
it; a later request of that room then fails explicitly in upstream's own path), so a room is
never held past its request. All transitions happen on the scheduler thread, in the same order
on every rank (the doors and the clears follow the ranks' all-reduced polls), so every rank
reaches the same verdict; nothing is released by timeout or garbage collection.

A refused duplicate's other leg, admitted by a peer that had no live request of that room,
would wait for a transfer nobody makes. On the prefill side, the release of the room's live
request (``CommonKVSender.clear``, before upstream drops the room's state) answers the decode
metadata of that room with Failed, now or when it arrives within
``peer_release.DUPLICATE_TTL_S`` (``peer_release.duplicate_released``), so that decode leg gets
an explicit 409 instead of hanging.

What this does not do: it is no generation. A request of room R that arrives after the live
one was released (a replay) is admitted (after ``DUPLICATE_TTL_S`` when a duplicate was
refused); telling the two transfers apart is the job of the per-transfer generation (issue 9,
items 1-2). On the decode side the counterpart (a prefill leg the prefill admitted after the
room's live decode request was gone) is not told: a peer-release notice would keep the room
refused on the prefill for its whole TTL; that leg waits for its own bootstrap timeout.

Failure policy (:mod:`sglang.pdsafe.policy`): a door or claim that cannot run refuses the
request (503) before anything is reserved, and the claim's refusal is told to the peer; a
release that cannot run keeps the room refused here (nothing is freed by it).

Off switch (default on): ``SGLANG_PDSAFE_ROOM_GUARD=0`` (logged as a warning at startup; the
prefill source lease, which keeps a draining room live here, is then weaker).
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from sglang.pdsafe import metrics, peer_release, policy, transfer
from sglang.pdsafe.admission import AdmissionError
from sglang.pdsafe.log_limit import LogLimit
from sglang.pdsafe.peer_notifier import decode_rejected, is_fake_bootstrap
from sglang.pdsafe.policy import Outcome, Refusal, hook, raise_refusal, refuse_with
from sglang.pdsafe.protections import (
    PDModeUnknownError,
    Protection,
    is_pd,
    off_by,
    pd_mode,
    register,
    switch_on,
)

logger = logging.getLogger("sglang.pdsafe.room_guard")

ENV_ENABLE = "SGLANG_PDSAFE_ROOM_GUARD"
#: A room live on this server: the request conflicts with one in flight (retry with a new room).
CONFLICT_STATUS = HTTPStatus.CONFLICT
REFUSED_DUPLICATE = "room_duplicate_refused_total"
REFUSED_PARALLEL = "room_parallel_sampling_refused_total"
FAILED = "room_guard_failed_total"
#: Log a refusal at most this often (every one is counted).
LOG_INTERVAL_S = 10.0


def enabled() -> bool:
    """Default on; ``SGLANG_PDSAFE_ROOM_GUARD=0`` (or false/off/no) turns it off."""
    return switch_on(ENV_ENABLE)


register(Protection(
    name="bootstrap-room-guard",
    guards="a bootstrap_room live on this server is refused (409) at the PD scheduler doors "
           "(shared rooms crash the schedulers and share one transfer's state); each sample of "
           "an n>1 request is transferred under its own room",
    switched_off=off_by(ENV_ENABLE),
))


# --------------------------------------------------------------------------- state


class LiveRooms:
    """The rooms live on one KV manager: a view of its leg's live records (no state of its
    own)."""

    def __init__(self, leg: transfer.Leg) -> None:
        self._leg = leg

    def holder(self, room: int) -> transfer.Transfer | None:
        """The record that holds ``room`` (None: the room is free)."""
        return self._leg.of_room(room)

    def claim(self, room: int, rid: str) -> transfer.Transfer | None:
        """Open ``rid``'s record on ``room``; returns the previous holder if it was another
        request (the caller's door should have refused; the newcomer holds it now)."""
        prev = self._leg.of_room(room)
        self._leg.open(int(room), str(rid))
        return prev if prev is not None and prev.rid != str(rid) else None

    def note_refused(self, room: int) -> None:
        """A duplicate of the live ``room`` was refused (told to the peer at release)."""
        rec = self._leg.of_room(room)
        if rec is not None:
            rec.duplicates_refused += 1

    def release(self, room: int) -> tuple[bool, int]:
        """Free ``room``: (whether it was live, duplicates refused while it was)."""
        rec = self._leg.of_room(room)
        if rec is None:
            return False, 0
        self._leg.close(rec)
        return True, rec.duplicates_refused

    def rooms(self) -> set[int]:
        with self._leg.lock:
            return set(self._leg.live)

    def __len__(self) -> int:
        with self._leg.lock:
            return len(self._leg.live)


def live_rooms(kv_mgr: Any) -> LiveRooms:
    """The live rooms of ``kv_mgr``."""
    return LiveRooms(transfer.leg(kv_mgr))


def live_record(kv_mgr: Any, room: int) -> transfer.Transfer | None:
    """The record that holds ``room`` live on ``kv_mgr`` (None: the room is free)."""
    return live_rooms(kv_mgr).holder(room)


def _side(kv_mgr: Any) -> str:
    """"prefill" or "decode" (the one PD-mode decision, ``protections.pd_mode``), else "PD"."""
    try:
        mode = pd_mode(kv_mgr)
    except PDModeUnknownError:
        return "PD"
    return mode if mode in ("prefill", "decode") else "PD"


def _guarded_manager(queue: Any) -> Any | None:
    """The queue's KV manager if it keeps per-room state (``request_status``, what two
    requests of one room would share); None for a queue without one (upstream's unit tests
    build bare queues) and for the fake backend's manager, which keeps none."""
    kv_mgr = getattr(queue, "kv_manager", None)
    return kv_mgr if isinstance(getattr(kv_mgr, "request_status", None), dict) else None


def _room_of(req: Any) -> int | None:
    """The room the guard covers for ``req``: None without a room or for the server's own
    fake-transfer requests (warmup, health checks), which create no real sender/receiver."""
    room = getattr(req, "bootstrap_room", None)
    if room is None or is_fake_bootstrap(getattr(req, "bootstrap_host", None)):
        return None
    return int(room)


_log_limit = LogLimit(LOG_INTERVAL_S)


def _log_refusal(side: str, room: int, rid: str) -> None:
    suppressed = _log_limit.admit()
    if suppressed is None:
        return
    logger.warning("pdsafe room guard: refused request %s on this %s server (409): its "
                   "bootstrap_room %s is live here. (%d similar suppressed)", rid, side, room,
                   suppressed)


def refusal_message(room: int, side: str) -> str:
    return (f"bootstrap_room {room} is already in use by another request in flight on this "
            f"{side} server; two requests may not share a room (they would share one KV "
            f"transfer). The request was refused before anything was reserved for it. Retry "
            f"with a fresh random bootstrap_room (a random 63-bit integer per request), or "
            f"send the request through the PD router, which assigns unique rooms.")


# --------------------------------------------------------------------------- scheduler hooks

def _queue_room_key(queue: Any, req: Any, *_: Any, **__: Any) -> Any:
    return ("room", getattr(req, "bootstrap_room", None), str(getattr(req, "rid", "?")))


@hook("room_guard.door", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=refuse_with(503, "the request (its bootstrap_room could not be checked)"),
      key=_queue_room_key,
      effect="503 at the PD queue door, before anything is reserved")
def door(queue: Any, req: Any, reentry: bool = False) -> Refusal | None:
    """A PD queue door (``PrefillBootstrapQueue.add``, ``DecodePreallocQueue.add``): refuse
    ``req`` (409) when its room is live on this server. ``reentry``: a request coming back
    (decode retraction, re-bootstrap), which is never refused.

    Takes the queue, not its KV manager: a queue without one (upstream's unit tests build bare
    queues) or with the fake backend's is not guarded. The caller aborts and retires a refused
    request itself and does not tell the peer. A request already rejected at intake keeps its
    own verdict (message and status); it is only kept away from the peer notice, which would
    fail the live request.
    """
    if reentry:
        return None
    if policy.state_dir() is None:  # no launcher shares the poison: this door refuses
        poisoned = policy.poison_refusal()
        if poisoned is not None:
            return poisoned
    kv_mgr = _guarded_manager(queue)
    if kv_mgr is None or not enabled():
        return None
    room = _room_of(req)
    if room is None:
        return None
    rooms = live_rooms(kv_mgr)
    if rooms.holder(room) is None:
        return None
    side = _side(kv_mgr)
    metrics.inc(REFUSED_DUPLICATE)
    rooms.note_refused(room)
    _log_refusal(side, room, str(getattr(req, "rid", "?")))
    verdict = getattr(req, "to_finish", None)
    message = getattr(verdict, "message", None)
    if isinstance(message, str) and message:
        status = getattr(verdict, "status_code", None)
        return Refusal(int(status) if status else int(CONFLICT_STATUS), message,
                       REFUSED_DUPLICATE)
    return Refusal(int(CONFLICT_STATUS), refusal_message(room, side), REFUSED_DUPLICATE)


def _claim_failed(failure: Any) -> Refusal:
    """A claim that cannot run refuses the request (503) and its peer is told at once:
    nothing proves the room free, so no sender/receiver is built for it (a second live
    request of the room would crash upstream's scheduler). The decode tells its prefill
    here; a prefill's caller tells the decode (``prefill_door_rejected``, as for every
    refusal of its creation path)."""
    refusal = failure.refusal(503, "the request (its bootstrap_room could not be claimed)")
    queue, req = failure.args[0], failure.args[1]
    if _side(getattr(queue, "kv_manager", None)) == "decode":
        decode_rejected(req, refusal.reason)
    return refusal


@hook("room_guard.claim", outcome=Outcome.REFUSE, counter=FAILED, on_failure=_claim_failed,
      key=_queue_room_key,
      effect="503 before the sender/receiver is built; the peer is told at once")
def claim(queue: Any, req: Any) -> Refusal | None:
    """A KV sender/receiver is about to be created for ``req``: its room is live from now on,
    and ``req`` gets its transfer record. Returns None (the caller builds the endpoint) or
    the refusal the caller answers the request with (a claim that could not run).

    Called after every refusal of the creation path, right before the endpoint is built, so a
    claim is always followed by an endpoint whose clear (or prefill abort) releases it.
    """
    kv_mgr = _guarded_manager(queue)
    if kv_mgr is None:
        return None
    room = _room_of(req)
    if room is None:
        return None
    prev = live_record(kv_mgr, room)
    rid = str(getattr(req, "rid", "?"))
    transfer.open_for(kv_mgr, req)
    if prev is not None and prev.rid != rid:  # only a re-bootstrap reaches here past a holder
        logger.warning("pdsafe room guard: request %s re-entered with bootstrap_room %s, which "
                       "request %s holds on this %s server", rid, room, prev.rid,
                       _side(kv_mgr))
    return None


def _endpoint_key(endpoint: Any) -> Any:
    return ("room", getattr(endpoint, "bootstrap_room", None))


def _released_failed(failure: Any) -> bool:
    """A release that cannot run keeps the room: the record stays live (new requests of the
    room are refused 409) and the caller keeps upstream's per-room state too."""
    return False


@hook("room_guard.released", outcome=Outcome.HOLD, counter=FAILED,
      on_failure=_released_failed, key=_endpoint_key,
      effect="the room stays live here (new requests of it refused 409) and upstream keeps "
             "its per-room state; nothing is freed")
def released(endpoint: Any) -> bool:
    """A KV sender/receiver is about to drop its room's per-room state (``clear``) or a
    prefill sender was aborted: the room is free on this server (unless a source lease keeps
    it: its drained release frees it, ``transfer.Leg.release_room``).

    Returns whether the caller may drop upstream's per-room state of the room (status,
    transfer infos, trackers). False only for an endpoint that released its room before
    while another request holds the room now: upstream clears a receiver a second time on
    its failure paths (``failure_exception`` clears it, the queue clears it again when it
    retires the request), and by then the room guard may have admitted the room's next
    request, whose status that second clear would drop (the decode scheduler then dies in
    ``check_status`` with a KeyError). A release is counted once per endpoint: a second one
    never frees a record of another request."""
    room = getattr(endpoint, "bootstrap_room", None)
    kv_mgr = getattr(endpoint, "kv_mgr", None)
    if room is None or kv_mgr is None:
        return True
    lg = transfer.leg_if_any(kv_mgr)
    if lg is None:
        return True
    rec = lg.of_room(int(room))
    if not lg.first_release(endpoint):
        return rec is None
    if rec is None or rec.keeps_room:  # a source lease holds the room until it drained
        return True
    lg.close(rec)
    transfer.room_freed(kv_mgr, rec)
    return True


def _answer_refused_duplicates(kv_mgr: Any, rec: transfer.Transfer) -> None:
    """``rec`` no longer holds its room here: a duplicate refused while it did gets its
    decode leg answered (prefill). A room-freed listener (``transfer.ROOM_FREED``)."""
    if rec.duplicates_refused and _side(kv_mgr) == "prefill" and rec.room is not None:
        peer_release.duplicate_released(kv_mgr, int(rec.room),
                                        duplicate_peer_reason(int(rec.room)),
                                        int(CONFLICT_STATUS))


transfer.ROOM_FREED.append(_answer_refused_duplicates)


def duplicate_peer_reason(room: int) -> str:
    """What the refused duplicate's decode leg is told when the room's live request is gone."""
    return (f"bootstrap_room {room} is already in use by another request in flight on the "
            f"prefill server, which refused this request as a duplicate "
            f"(HTTP {int(CONFLICT_STATUS)}); retry with a fresh random bootstrap_room, or send "
            f"the request through the PD router")


# --------------------------------------------------------------------------- HTTP layer


class ParallelSamplingRefusedError(AdmissionError):
    """``n>1`` sent to a PD server: every sample would share the request's bootstrap room."""

    error_code = "parallel_sampling_unsupported_in_pd"
    param = "n"

    def __init__(self, n: int, side: str) -> None:
        self.n = n
        super().__init__(
            f"n={n} (parallel sampling) is not supported by this PD-disaggregated {side} "
            f"server: every sample would share the request's bootstrap room, and with it one KV "
            f"transfer. Send n separate requests with n=1 (each gets its own room), or use a "
            f"co-located server for parallel sampling."
        )


@hook("room_guard.check_http_request", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=raise_refusal, effect="503 at the HTTP layer, before the request is registered")
def check_http_request(tokenizer_manager: Any, obj: Any) -> None:
    """After normalization: refuse ``n>1`` on a PD server whose tokenizer manager cannot give
    each sample its own room (400, before it is registered).

    Raises :class:`ParallelSamplingRefusedError`. A server whose PD mode cannot be read is
    treated as PD (fail closed).
    """
    n = getattr(obj, "parallel_sample_num", 1)
    if not isinstance(n, int) or n <= 1 or not enabled():
        return
    if callable(getattr(type(tokenizer_manager), "pdsafe_sample_room", None)):
        return  # each sample is transferred under its own room (sample_rooms)
    server_args = getattr(tokenizer_manager, "server_args", None)
    try:
        if not is_pd(server_args):
            return
        side: str = pd_mode(server_args)
    except PDModeUnknownError:
        side = "PD"
    metrics.inc(REFUSED_PARALLEL)
    raise ParallelSamplingRefusedError(n, side)
