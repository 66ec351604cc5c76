"""Transfer generations: every control message of a PD transfer names the reservation it is for.

Upstream 0.5.23 keys a transfer by its ``bootstrap_room`` alone, and the room is
client-controlled. The room guard (:mod:`sglang.pdsafe.room_guard`) keeps one live request per
room per server, but a room is free again once its request is gone, and a message of the old
transfer can still be on its way: a late ``KVPoll.Success`` from prefill makes decode commit a
new reservation of the same room before its KV arrived (it would decode the pages' earlier
content), a late TCP aux message writes the metadata slot its *old* reservation named (now
another request's), a late ``CHUNK_READY`` scatters a staging chunk into the new reservation.
Only the (possibly replayed) room ties any of them to a transfer.

**The generation.** When a decode rank sends the metadata of a transfer's reservation
(``CommonKVReceiver.send_metadata``, after ``DecodePreallocQueue._send_kv_metadata`` reserved
its pages and metadata slot), :func:`mint` derives the reservation's transfer generation (63
bits, never 0) from what that reservation is on this server: room, metadata slot, page ids,
and the epochs of this process's page-generation tables (:mod:`sglang.pdsafe.page_generation`),
which move with every free. Two reservations of one server can only share pages or a slot if
one freed them before the other took them, so the epochs differ: a new reservation gets a new
generation even for a replayed room.
Nothing of it comes from a client field alone. The ranks of a decode TP group reserve and free
in lockstep, so they derive the same generation without a collective (the prefill checks it:
below). With page generations off (``SGLANG_PDSAFE_PAGE_GENERATION=0``) a per-manager
reservation counter stands in for the epochs (the same lockstep argument).

**On the wire** (frame ``PDSAFE_GEN1:<decimal>``, the *last* frame, appended after upstream's
fixed frames, which stock parsers never read past; with a cluster key the MAC frame of
:mod:`sglang.pdsafe.control_mac` follows it on the wire and is stripped on receipt, before
anything here reads the message):

* decode -> prefill, the receiver metadata (``TransferInfo``) for each prefill rank: sent only
  to a prefill that published this release's wire version (``pair_agreement``; a stock
  prefill or another release never sees it), and only on backends whose managers carry it
  back (``pdsafe_transfer_generation_wired``: Mooncake, Ascend through Mooncake, NIXL, MORI
  through patch 0034);
* prefill -> decode, every message for that decode endpoint: KV status (bootstrap readiness,
  Success, Failed, peer-release and refusal notices), TCP aux data (Mooncake
  ``SGLANG_MOONCAKE_SEND_AUX_TCP``) and staging ``CHUNK_READY``, each with the generation that
  endpoint sent for the room (:func:`note_metadata` records it before anything else looks at
  the metadata);
* ABORT and ABORT_ACK carry it in upstream's own generation frame (no frame of ours): a decode
  arms the deferred release of a room whose metadata carried a generation with that generation
  (:func:`abort_generation`, in place of upstream's per-manager counter), so its ABORT names
  it and the prefill's drain ACK echoes it;
* the KV digest row (:mod:`sglang.pdsafe.kv_integrity`) and the coverage attestation's token
  digest (:mod:`sglang.pdsafe.coverage`) bind it: prefill writes them with the room's generation
  (:func:`prefill_generation`), decode checks with its own, so a row from another reservation of
  the room is a binding failure (500), never accepted.

**Checks** (decode, each backend's control thread, before upstream acts on the message),
dropped and counted by type (``stale_kv_status_dropped_total``,
``stale_aux_data_dropped_total``, ``stale_chunk_ready_dropped_total``):

* a room whose metadata this rank has not sent (not reserved yet, or released): a Success,
  aux data or CHUNK_READY for it cannot be for a reservation of it (upstream would conclude a
  receiver that sent nothing, which also stops its scheduler with "Unexpected poll case", or
  write whatever slot the aux message names). Readiness and Failed notices may precede the
  metadata (deferred bootstrap, peer release) and change no page: upstream handles them;
* a room for which this rank sent a generation: only a message carrying exactly that
  generation (another one, none, a malformed one are dropped); aux data must also name the
  reservation's own metadata slot;
* a room whose metadata went without a generation (its prefill is a waived stock peer):
  upstream's handling;
* an ABORT_ACK that upstream ignores (no release of the room armed, one of another
  generation, or no generation named): counted (``stale_abort_ack_dropped_total``); it never
  released a page.

And prefill drops and counts (``stale_abort_dropped_total``) an ABORT naming a generation that
an earlier metadata of the same decode endpoint carried for the room and a later one replaced
(:func:`drops_stale_abort`): it would fail the room's live transfer and arm a drain ACK for a
reservation that no longer holds it. An ABORT naming the current generation, none, or one this
prefill never saw (a newer reservation whose metadata did not reach this rank) is upstream's:
failing a transfer never hands KV to anyone, and withholding a drain ACK would keep the
decode's pages quarantined.

Prefill: when the decode ranks of the room's current transfer (the endpoints whose metadata the
manager holds for it) named different generations (they broke lockstep),
:func:`prefill_generation` refuses: the digest row is zeroed and decode refuses the transfer,
counted in ``transfer_generation_split_total``.

State: on decode, the reservation's :class:`~sglang.pdsafe.transfer.Transfer` record (the
room's live record in the KV manager's leg, from its claim to the receiver's clear) carries
the generation minted, whether it was sent, the metadata slot and whether the metadata went
out (``metadata_out``); the leg's ``transfer_generation`` table keeps, per room, the
generation its latest metadata carried (kept past the release for the ABORT of a failed
transfer, which upstream sends after clearing the receiver; bounded). On prefill, the leg's
table keeps (room, endpoint, port) -> generation and the generations it replaced
(:data:`RETIRED_PER_TARGET`), bounded (:data:`MAX_ROOMS` rooms, oldest dropped: its later
messages carry no generation and are dropped by the decode, which then fails the request at
its own timeout; fail closed): what decodes sent, not one transfer's state.
Transitions (decode, per room)::

    (claimed, RESERVED) --mint--> minted(g) --metadata out (SENT)--> live(g, slot, sent)
                                                                   | live(0, unsent)
    minted / live --receiver cleared--> (none)      live --mint (re-sent metadata)--> minted(g')

and prefill: (none) --metadata(room, endpoint, g)--> known(g) --later metadata--> known(g').

Invariant: no Success, aux data or CHUNK_READY reaches upstream for a room before this decode
rank sent its metadata for it; while it holds a reservation whose generation it sent, no
status, aux or chunk-ready message without that generation changes the reservation's state or
its metadata slot; prefill tags every such message with the generation the endpoint sent for
the room, and digests with it.

What it does not cover: an ABORT without a generation (upstream sends one only for an armed
release: an abort before the metadata went out) or from a decode endpoint whose metadata
carried none can still fail a live room of the same number on the prefill (a failed request,
never a leak; the room guard refuses a second live request of a room on each server).
One-sided KV writes carry nothing:
a late write lands where its old reservation pointed; the quarantine holds those pages
until the drain is acknowledged. MORI does not carry the generation (it cannot run here),
so a PD server on MORI refuses to start unless ``SGLANG_PDSAFE_WAIVE_UNWIRED_GENERATION=1``
(:func:`check_backend`; then its rooms are handled as upstream does, warned, gauged).
Two decode servers with identical histories may mint the same generation for a room;
harmless, since every message is addressed to one decode endpoint and the prefill keys
generations by (room, endpoint). The coverage attestation row
has no free slot: its freshness comes from the digest row, checked before the first decode
step. A prefill's refusal of a decode that did not announce its wire version (peer capability)
happens before the metadata is stored, so that Failed carries no generation: a decode that
sent one (it announced, so only if its announcement was lost) drops it and fails the request
at its own timeout.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash
from sglang.pdsafe import generation_key, metrics, pair_settings, policy, transfer
from sglang.pdsafe.hook_api import require
from sglang.pdsafe.page_generation import process_epochs
from sglang.pdsafe.policy import Outcome, hook, returns
from sglang.pdsafe.protections import Protection, register
from sglang.srt.disaggregation.base.conn import KVPoll

logger = logging.getLogger("sglang.pdsafe.transfer_generation")

#: Prefix of the generation frame (never a room number, an upstream tag or a guard).
FRAME_PREFIX = b"PDSAFE_GEN1:"
STALE_STATUS = "stale_kv_status_dropped_total"
STALE_AUX = "stale_aux_data_dropped_total"
STALE_CHUNK = "stale_chunk_ready_dropped_total"
STALE_ABORT = "stale_abort_dropped_total"
STALE_ABORT_ACK = "stale_abort_ack_dropped_total"
SPLIT = "transfer_generation_split_total"
FAILED = "transfer_generation_failed_total"
#: Rooms a prefill manager remembers generations for (oldest forgotten first: fail closed).
MAX_ROOMS = 65536
#: A dropped message of one type is logged at most this often (the counter counts all).
LOG_EVERY_S = 10.0
_U63 = (1 << 63) - 1
_KV_MANAGER = "sglang.srt.disaggregation.common.conn.CommonKVManager"
_RECEIVER = "sglang.srt.disaggregation.common.conn.CommonKVReceiver"

#: Transfer backends whose managers do not carry the generation back to the decode
#: (``pdsafe_transfer_generation_wired`` is False there): none since patch 0034 wired MORI.
#: A backend upstream adds is unclassified until listed here or wired
#: (test/unit/test_support_matrix.py checks every backend's manager class against this).
UNWIRED_BACKENDS: frozenset[str] = frozenset()
#: ``1``: serve a PD server on such a backend anyway (warned, gauge :data:`UNWIRED_GAUGE`).
ENV_WAIVE_UNWIRED = "SGLANG_PDSAFE_WAIVE_UNWIRED_GENERATION"
UNWIRED_GAUGE = "transfer_generation_unwired"


def _backend(args: Any) -> str:
    return str(getattr(args, "disaggregation_transfer_backend", "") or "").lower()


def unwired_waived() -> bool:
    return os.environ.get(ENV_WAIVE_UNWIRED, "").strip().lower() in ("1", "true", "on", "yes")


def _class_unwired(backend: str) -> bool:
    """The backend's KV manager class, as installed, says its messages do not carry the
    generation (``pdsafe_transfer_generation_wired`` False: a tree without the patch that wires
    it, or a backend upstream added). False when upstream's ``get_kv_class`` cannot import the
    class here: such a server cannot run that backend either (upstream fails at the same
    import), and the fake backend is refused by its own check."""
    if backend in ("", "fake"):
        return False
    try:
        from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

        cls = get_kv_class(TransferBackend(backend), KVClassType.MANAGER)
    except Exception:  # noqa: BLE001 - not importable here: the server cannot start on it
        return False
    return not getattr(cls, "pdsafe_transfer_generation_wired", False)


def unwired(backend: str, *, read_class: bool = False) -> bool:
    """A PD server on ``backend`` would run without the transfer generation: listed in
    :data:`UNWIRED_BACKENDS`, or (``read_class``: only in a scheduler process, which imports
    that class anyway; a launcher that imported it before forking its scheduler broke the
    scheduler's start, CI of 438b319) its installed manager class says so."""
    return backend in UNWIRED_BACKENDS or (read_class and _class_unwired(backend))


def _switched_off(args: Any) -> str | None:
    if unwired_waived() and unwired(_backend(args)):
        return f"{ENV_WAIVE_UNWIRED}=1 on the {_backend(args)} transfer backend"
    return None


register(Protection(
    name="transfer-generation",
    guards="every status, aux and chunk-ready message of a PD transfer carries the "
           "reservation's server-minted generation; stale or replayed ones are dropped",
    switched_off=_switched_off,
))


class UnwiredGenerationError(policy.StartupRefusedError):
    """A PD server on a transfer backend that does not carry the generation (no waiver)."""


def check_backend(server_args: Any, *, read_class: bool = False) -> None:
    """Startup (both legs, launcher and scheduler): a PD server on a backend whose messages
    do not carry the transfer generation (:func:`unwired`; the manager class is read only with
    ``read_class``, in the scheduler) refuses to start, unless
    :data:`ENV_WAIVE_UNWIRED` waives it (then a warning and :data:`UNWIRED_GAUGE` = 1). Without
    the generation its KV digest and coverage rows bind generation 0, so a stale row of the
    same room and token range (an earlier reservation's late write) would verify: that check
    cannot be made there, so the fork does not pretend it is."""
    backend = _backend(server_args)
    if not unwired(backend, read_class=read_class):
        metrics.set_gauge(UNWIRED_GAUGE, 0)
        return
    if not unwired_waived():
        raise UnwiredGenerationError(
            f"pdsafe: the {backend} transfer backend does not carry the transfer generation: "
            "a decode could not tell a stale KV status, aux row or digest row of an earlier "
            "reservation of the same room from the current one. This PD server refuses to "
            f"start. Use mooncake or nixl, or set {ENV_WAIVE_UNWIRED}=1 on both legs to serve "
            "it without (warned at every start; gauge sglang:pdsafe_transfer_generation_unwired"
            " = 1).")
    metrics.set_gauge(UNWIRED_GAUGE, 1)
    logger.warning(
        "pdsafe: %s=1: this server runs on the %s transfer backend, whose messages carry no "
        "transfer generation; its digest and coverage rows bind generation 0, so a stale row "
        "of the same room and token range would verify. Never rely on it for tenant "
        "isolation across reservations of a room.", ENV_WAIVE_UNWIRED, backend)

require(_KV_MANAGER, "pdsafe_transfer_generation_wired", "pdsafe_room_status(bootstrap_room)",
        "pdsafe_decode_endpoints(bootstrap_room)",
        "parse_kv_status_message(msg)", "kv_status_msg_carries_reason",
        "pdsafe_note_transfer_generation(bootstrap_room, msg)",
        "pdsafe_generation_frames(bootstrap_room, endpoint, dst_port)",
        "pdsafe_drops_stale_message(kind, msg)",
        "pdsafe_send_failed_status_tagged(bootstrap_room, endpoints, message)",
        "pdsafe_abort_generation(bootstrap_room, fallback)",
        "pdsafe_drops_stale_abort(notification)",
        "pdsafe_note_stale_abort_ack(bootstrap_room, prefill_rank, generation)",
        why="transfer generations: prefill records and echoes the generation decode sent, "
            "decode drops control messages without it (issue 9, item 2)")
require(_RECEIVER, "pdsafe_metadata_generation_frames()", "pdsafe_transfer_generation()",
        "pdsafe_mint_transfer_generation(kv_indices, aux_index)",
        why="transfer generations: decode sends its reservation's generation with the metadata")
require("sglang.srt.disaggregation.common.conn.CommonKVSender",
        "pdsafe_transfer_generation()",
        why="transfer generations: prefill binds the room's generation into the KV digest")



class GenerationSplitError(RuntimeError):
    """The decode ranks of one room named different transfer generations."""


def encode_frame(generation: int) -> bytes:
    """The wire frame for ``generation`` (1 .. 2**63-1)."""
    if not 0 < int(generation) <= _U63:
        raise ValueError(f"transfer generation out of range: {generation}")
    return FRAME_PREFIX + str(int(generation)).encode("ascii")


def frame_generation(msg: Sequence[bytes]) -> int | None:
    """The generation a message carries in its last frame: None when it carries none, -1 when
    the frame is malformed (never equal to a live generation)."""
    if not msg:
        return None
    last = msg[-1]
    if not isinstance(last, (bytes, bytearray, memoryview)):
        return None
    last = bytes(last)
    if not last.startswith(FRAME_PREFIX):
        return None
    digits = last[len(FRAME_PREFIX):]
    if not digits.isdigit() or len(digits) > 19:
        return -1
    value = int(digits)
    return value if 0 < value <= _U63 else -1


def derive(*, room: int, aux_index: int | None, page_indices: Any,
           epochs: Sequence[int], key: bytes = b"") -> int:
    """The generation of one reservation (pure): a 63-bit BLAKE2b MAC under ``key`` (the
    decode's generation key, :mod:`sglang.pdsafe.generation_key`; b"": unkeyed) of everything
    the reservation is on this server (the page ids through their XXH3-128: a million pages
    hash at memory speed, where BLAKE2b over them took tens of milliseconds, issue 22); never
    0. Without ``key`` nobody can compute it from the inputs."""
    pages = np.ascontiguousarray(np.asarray(page_indices, dtype=np.int64))
    h = hashlib.blake2b(digest_size=8, person=b"pdsafe-gen2", key=key[:64])
    h.update(str(int(room)).encode("ascii") + b"\0")
    h.update(str(-1 if aux_index is None else int(aux_index)).encode("ascii") + b"\0")
    h.update(str(int(pages.size)).encode("ascii") + b"\0" + xxhash.xxh3_128_digest(pages))
    h.update(b",".join(str(int(e)).encode("ascii") for e in epochs))
    return (int.from_bytes(h.digest(), "little") & _U63) or 1


# =========================================================================== decode side
#
# A decode rank's reservation of a room is its live transfer record (room guard claim ->
# receiver clear); from the moment its metadata went out (``record.metadata_out``) the record
# carries the generation (``record.generation``, ``record.generation_sent``: it went to at
# least one prefill rank) and the metadata slot (``record.aux_index``).


@dataclass(frozen=True)
class Live:
    """A decode rank's current reservation of a room, from the moment its metadata went out
    (``generation`` 0 and ``sent`` False: none was sent, its prefill is a stock peer)."""

    generation: int
    aux_index: int | None
    sent: bool = False  # the generation went to at least one prefill rank


class _DecodeTable:
    """Per decode leg: the fallback counter (page generations off) and, per room, the
    generation its latest metadata carried, kept past the release (the ABORT of a failed
    transfer goes out after ``_clear``), replaced by the room's next metadata, bounded
    (:data:`MAX_ROOMS`, oldest dropped)."""

    def __init__(self) -> None:
        self.counter = itertools.count(1)
        self.last_sent: OrderedDict[int, int] = OrderedDict()


def _decode_table(kv_mgr: Any) -> _DecodeTable:
    return transfer.leg(kv_mgr).table("transfer_generation", _DecodeTable)


def _epochs(kv_mgr: Any) -> tuple[int, ...]:
    epochs = process_epochs()
    if epochs:
        return epochs
    return (-next(_decode_table(kv_mgr).counter),)


def _room_record(kv_mgr: Any, room: int) -> transfer.Transfer:
    """The live record of ``room`` on this decode leg (a new one when nothing claimed it: a
    receiver built without the scheduler's door, as upstream's tests do)."""
    lg = transfer.leg(kv_mgr)
    rec = lg.of_room(room)
    if rec is None or not rec.is_open:
        rec = lg.open(room, f"room-{room}")
    return rec


def _receiver_record(receiver: Any) -> transfer.Transfer:
    """The live record of ``receiver``'s room (:func:`_room_record`)."""
    return _room_record(receiver.kv_mgr, int(receiver.bootstrap_room))


def _receiver_key(receiver: Any, *_: Any, **__: Any) -> Any:
    return ("room", getattr(receiver, "bootstrap_room", None), id(receiver))


def _fail_receiver_room(failure: policy.Failure) -> Any:
    """Refuse the reservation now: its room fails on this decode (the request aborts at the
    next poll, its prefill told by upstream's failure path)."""
    receiver = failure.args[0]
    transfer.fail_room(receiver.kv_mgr, receiver.bootstrap_room,
                       failure.refusal(500, "the KV transfer (its transfer generation could "
                                            "not be minted or sent)"))
    return []


@hook("transfer_generation.mint", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_fail_receiver_room, key=_receiver_key,
      effect="the room fails at once on the decode (500; the prefill told)")
def mint(receiver: Any, page_indices: Any, aux_index: int | None) -> None:
    """``CommonKVReceiver.send_metadata``, before the metadata for the reservation of
    ``page_indices`` and metadata slot ``aux_index`` goes to any prefill rank: mint the
    reservation's generation into its record (a re-sent metadata, a new reservation, mints
    anew), and record its writer (the prefill address and the incarnation registered
    there, which the quarantine's evidence needs)."""
    kv_mgr = receiver.kv_mgr
    rec = _receiver_record(receiver)
    lg = transfer.leg(kv_mgr)
    writer = str(getattr(receiver, "bootstrap_addr", "") or "")
    incarnation = pair_settings.prefill_incarnation(kv_mgr, writer)
    with lg.lock:
        rec.generation, rec.generation_sent, rec.metadata_out = 0, False, False
        rec.writer, rec.writer_incarnation = writer, incarnation
    if not getattr(kv_mgr, "pdsafe_transfer_generation_wired", False):
        return
    room = int(receiver.bootstrap_room)
    generation = derive(room=room, aux_index=aux_index, page_indices=page_indices,
                        epochs=_epochs(kv_mgr), key=generation_key.current())
    with lg.lock:
        rec.generation = generation
        rec.aux_index = None if aux_index is None else int(aux_index)


@policy.passthrough("transfer_generation.receiver_generation",
                    why="behind CommonKVReceiver.pdsafe_transfer_generation, which only "
                        "pdsafe's own checks call (their hooks' policy applies)")
def receiver_generation(receiver: Any) -> int:
    """The generation ``receiver`` sent with its metadata (0: none was sent; its prefill then
    digests with 0 too): what ``CommonKVReceiver.pdsafe_transfer_generation`` answers."""
    rec = transfer.leg(receiver.kv_mgr).of_room(int(receiver.bootstrap_room))
    return rec.generation if rec is not None and rec.generation_sent else 0


@hook("transfer_generation.metadata_frames", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_fail_receiver_room, key=_receiver_key,
      effect="the room fails at once on the decode (500; the prefill told); nothing sent "
             "untagged is relied on")
def metadata_frames(receiver: Any) -> list[bytes]:
    """``CommonKVReceiver.send_metadata``: the frames appended to the metadata for the room's
    prefill: the generation frame when this rank minted one and the prefill published this
    release's wire version, else none (then nothing is expected back). Either way the room's
    metadata is now out: from here on its prefill may send for it (before, nothing it sends
    can be for this reservation: :func:`drops_stale_message`)."""
    kv_mgr = receiver.kv_mgr
    room = int(receiver.bootstrap_room)
    lg = transfer.leg(kv_mgr)
    rec = lg.of_room(room)
    send = bool(rec is not None and rec.generation) and pair_settings.prefill_wire_version(
        kv_mgr, receiver.bootstrap_addr) == pair_settings.WIRE_VERSION
    table = _decode_table(kv_mgr)
    with lg.lock:
        if rec is None:
            return []
        rec.metadata_out = True
        rec.generation_sent = rec.generation_sent or send
        if send:
            table.last_sent[room] = rec.generation
            table.last_sent.move_to_end(room)
            while len(table.last_sent) > MAX_ROOMS:
                table.last_sent.popitem(last=False)
        elif not rec.generation_sent:
            table.last_sent.pop(room, None)
        if rec.state is transfer.State.RESERVED:
            rec.advance(transfer.State.SENT)
    return [encode_frame(rec.generation)] if send else []


@hook("transfer_generation.released", outcome=Outcome.HOLD, counter=FAILED,
      on_failure=returns(None), key=_receiver_key,
      effect="the reservation's generation stays live until the room's next claim "
             "replaces it (messages for it are still checked)")
def released(receiver: Any) -> None:
    """``CommonKVReceiver._clear``: the reservation is gone; its record stops being the
    room's live one (if the room guard did not close it already)."""
    lg = transfer.leg_if_any(receiver.kv_mgr)
    rec = lg.of_room(int(receiver.bootstrap_room)) if lg is not None else None
    if rec is not None and not rec.keeps_room:
        lg.close(rec)


def note_bootstrap_sent(kv_mgr: Any, room: Any) -> None:
    """Decode, as its receiver sends the room's deferred BOOTSTRAP (upstream's
    ``prefill_complete`` allocation policy, the only one that sends it): from here on the
    room's prefill knows this decode's endpoint and may address readiness or Failed notices to
    the room before any metadata went out (:func:`drops_stale_message`). Kept in the room's
    live record (``Transfer.bootstrap_out``; a receiver built without the scheduler's door
    gets one, as :func:`mint` does), so it ends with that reservation: a later reservation of
    the same room number has to send its own."""
    if room is None:
        return
    rec = _room_record(kv_mgr, int(room))
    with transfer.leg(kv_mgr).lock:
        rec.bootstrap_out = True


def _bootstrap_sent(kv_mgr: Any, room: int) -> bool:
    """Whether the room's live reservation on this decode sent its prefill a deferred
    BOOTSTRAP (:func:`note_bootstrap_sent`)."""
    rec = transfer.leg(kv_mgr).of_room(int(room))
    return rec is not None and rec.bootstrap_out


def live_reservation(kv_mgr: Any, room: int) -> Live | None:
    """The room's reservation on this decode rank once its metadata went out, else None."""
    lg = transfer.leg_if_any(kv_mgr)
    if lg is None:
        return None
    with lg.lock:
        rec = lg.live.get(int(room))
        if rec is None or not rec.metadata_out:
            return None
        return Live(rec.generation if rec.generation_sent else 0, rec.aux_index,
                    rec.generation_sent)


def expected(kv_mgr: Any, room: int) -> Live | None:
    """The room's live reservation on this decode rank if its generation was sent (then every
    message for the room must carry it), else None."""
    live = live_reservation(kv_mgr, room)
    return live if live is not None and live.sent else None


_last_log: dict[str, float] = {}


def _drop(counter: str, kind: str, room: Any, why: str) -> bool:
    metrics.inc(counter)
    now = time.monotonic()
    if now - _last_log.get(kind, -LOG_EVERY_S) >= LOG_EVERY_S:
        _last_log[kind] = now
        logger.warning("pdsafe transfer generation: dropped a %s message for room %s: %s "
                       "(stale, replayed or forged; counted in %s%s). Nothing to do unless "
                       "the counter keeps rising: then look for a peer sending for rooms it "
                       "no longer owns.", kind, room, why, metrics.PREFIX, counter)
    return True


def _parse(kv_mgr: Any, kind: str, msg: Sequence[bytes]) -> tuple[int, int | None] | None:
    """(room, aux slot; for a KV status the status) a message is for; None when upstream's
    parser would drop it anyway."""
    if kind == "kv_status":
        parsed = kv_mgr.parse_kv_status_message(list(msg))
        return None if parsed is None else (int(parsed[0]), int(parsed[1]))
    try:
        room = int(bytes(msg[1]).decode("ascii"))
        slot = int(bytes(msg[3]).decode("ascii")) if kind == "aux_data" else None
    except (IndexError, ValueError, UnicodeDecodeError):
        return None
    return room, slot


def _is_success(status: int | None) -> bool:
    return status == int(KVPoll.Success)


_COUNTERS = {"kv_status": STALE_STATUS, "aux_data": STALE_AUX, "chunk_ready": STALE_CHUNK}


def _drop_and_fail(failure: policy.Failure) -> bool:
    """The check could not run: the message is dropped, and the room it names (when it can
    be read) fails now, so its request gets an explicit error instead of a timeout."""
    kv_mgr, kind, msg = failure.args[0], failure.args[1], failure.args[2]
    try:
        parsed = _parse(kv_mgr, kind, msg)
    except Exception:  # noqa: BLE001 - unreadable: dropped, nothing to fail
        parsed = None
    if parsed is not None:
        transfer.fail_room(kv_mgr, parsed[0], failure.refusal(
            500, f"the KV transfer (a {kind} message for it could not be checked)"))
    return True


def _message_key(kv_mgr: Any, kind: str, msg: Sequence[bytes]) -> Any:
    try:
        parsed = _parse(kv_mgr, kind, msg)
    except Exception:  # noqa: BLE001
        parsed = None
    return ("room", parsed[0] if parsed else None, kind)


@hook("transfer_generation.drops_stale_message", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_drop_and_fail, key=_message_key,
      effect="the message is dropped and its room fails at once (500; the prefill told)")
def drops_stale_message(kv_mgr: Any, kind: str, msg: Sequence[bytes]) -> bool:
    """Decode control thread, before upstream handles ``msg`` (``kind``: ``kv_status``,
    ``aux_data`` or ``chunk_ready``): True when the message is dropped (counted)."""
    counter = _COUNTERS[kind]
    parsed = _parse(kv_mgr, kind, msg)
    if parsed is None:
        return False  # not well-formed: upstream's own parser drops it
    room, detail = parsed  # detail: the aux slot, or the KV status
    reservation = live_reservation(kv_mgr, room)
    if reservation is None:
        # No metadata of this decode for the room is out: nothing its prefill sends can be
        # for a reservation of it (a Success would conclude a receiver that sent nothing, aux
        # data would write a slot the room does not own). Readiness and Failed notices may
        # come first only after a deferred BOOTSTRAP (they change no page): upstream's.
        if kind == "aux_data":
            held = kv_mgr.pdsafe_room_status(room) is not None
            return _drop(counter, kind, room, "this decode holds no reservation of the room"
                         + (" yet" if held else "") + f", so metadata slot {detail} is not its")
        if kind == "chunk_ready" or _is_success(detail):
            return _drop(counter, kind, room, "this decode sent no metadata for the room "
                                              "(it was not reserved, or was released)")
        if kv_mgr.pdsafe_room_status(room) is not None and not _bootstrap_sent(kv_mgr, room):
            # A receiver holds the room and has told no prefill about it yet (no metadata, no
            # deferred BOOTSTRAP): no prefill has this decode's endpoint for the room, so the
            # notice is forged or an earlier reservation's late one, and upstream would take a
            # Failed as the new request's terminal state. (With no receiver, upstream ignores
            # any status but a request's opening one: passed on.)
            return _drop(counter, kind, room, "this decode has sent no prefill the room's "
                                              "metadata or a deferred BOOTSTRAP yet, so no "
                                              "prefill can address a notice of it here")
        return False
    live = reservation if reservation.sent else None
    if live is None:
        return False  # no generation sent for the room (stock peer): upstream's handling
    carried = frame_generation(msg)
    if carried != live.generation:
        got = "none" if carried is None else ("malformed" if carried < 0 else str(carried))
        return _drop(counter, kind, room, f"it carries generation {got}, the room's live "
                                          f"reservation has {live.generation}")
    if kind == "aux_data" and live.aux_index is not None and detail != live.aux_index:
        return _drop(counter, kind, room, f"it names metadata slot {detail}, the reservation's "
                                          f"is {live.aux_index}")
    return False


# =========================================================================== prefill side


def send_failed_status(kv_mgr: Any, room: int, endpoints: list[tuple[str, int]],
                       message: str) -> list[tuple[tuple[str, int], BaseException | None]]:
    """Send ``Failed`` with ``message`` to the room's decode endpoints, each tagged with the
    generation it sent (the patch's ``pdsafe_send_failed_status_tagged``); a tree without
    that patch (an earlier prefix of the series) sends upstream's untagged format."""
    send = getattr(kv_mgr, "pdsafe_send_failed_status_tagged", None)
    if send is None:
        send = kv_mgr.pdsafe_send_failed_status
    return send(room, endpoints, message)


#: Replaced generations a prefill remembers per (room, decode endpoint) (:func:`note_metadata`).
RETIRED_PER_TARGET = 8


class _PrefillRooms:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rooms: OrderedDict[int, dict[tuple[str, int], int]] = OrderedDict()
        #: room -> endpoint -> generations that endpoint sent for the room before its current
        #: metadata replaced them (newest last); evicted with the room.
        self.retired: dict[int, dict[tuple[str, int], tuple[int, ...]]] = {}
        #: splits already counted: (room, generations), so a room is counted once however
        #: many rows (coverage, digest) ask for its generation.
        self.splits_counted: OrderedDict[tuple[int, frozenset[int]], None] = OrderedDict()


def _prefill_rooms(kv_mgr: Any) -> _PrefillRooms:
    return transfer.leg(kv_mgr).table("transfer_generation", _PrefillRooms)


def _text(value: Any) -> str:
    return bytes(value).decode("ascii") if isinstance(value, (bytes, bytearray)) else str(value)


def _note_failed(failure: policy.Failure) -> None:
    """The note could not run: the room fails here now. Its prefill client gets an explicit
    error (the sender opened later fails at once). The decode is told ``Failed`` tagged with
    the generation its message carried, when that one step still runs on its own (it reads
    the frame and stores it, nothing else); otherwise the untagged notice is dropped there,
    as it must be, and the decode fails at its own waiting timeout (counted here; the router
    does not cancel the decode leg when the prefill leg fails). The room's metadata is
    dropped, so upstream's bootstrap thread skips the room
    (``pdsafe_note_transfer_generation`` returns False) and nothing is ever written to it."""
    kv_mgr, room, msg = failure.args[0], failure.args[1], failure.args[2]
    try:
        _record_generation(kv_mgr, int(room), msg)
    except Exception:  # noqa: BLE001 - the decode then waits for its timeout, as declared
        logger.warning("pdsafe transfer generation: the refusal of room %s goes out untagged "
                       "(its generation could not be read either); its decode drops it and "
                       "fails at its own timeout", room, exc_info=True)
    transfer.fail_room(kv_mgr, room, failure.refusal(
        500, "the KV transfer (the decode's transfer generation could not be recorded)"))


#: Called with (kv_mgr, room) after :func:`note_metadata` recorded a decode metadata message
#: for ``room`` on a prefill (registered by the protections that act on every arrival: the
#: unclaimed-room table). Each listener is a guarded hook of its own.
METADATA_NOTED: list[Callable[[Any, int], None]] = []


@hook("transfer_generation.note_metadata", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_note_failed, key=lambda kv_mgr, room, msg: ("room", room),
      effect="the room fails on the prefill at once and its metadata is dropped (upstream "
             "skips the room); its decode is told Failed, tagged with the generation its "
             "message carried")
def note_metadata(kv_mgr: Any, room: int, msg: Sequence[bytes]) -> None:
    """Prefill bootstrap thread, when decode metadata for ``room`` arrives (``msg``: room,
    endpoint, port, ... as upstream's ``TransferInfo.from_zmq`` reads it): remember the
    generation that endpoint sent (or that it sent none: a metadata message always replaces
    what the endpoint sent for the room before)."""
    _record_generation(kv_mgr, int(room), msg)
    for listener in METADATA_NOTED:
        listener(kv_mgr, int(room))


def _record_generation(kv_mgr: Any, room: int, msg: Sequence[bytes]) -> None:
    """:func:`note_metadata`'s record step: the generation ``msg``'s endpoint sent for
    ``room`` replaces what it sent before (a replaced one is kept as retired)."""
    endpoint, port = _text(msg[1]), int(_text(msg[2]))
    carried = frame_generation(msg)
    state = _prefill_rooms(kv_mgr)
    with state.lock:
        targets = state.rooms.get(int(room))
        if targets is None:
            targets = state.rooms[int(room)] = {}
            while len(state.rooms) > MAX_ROOMS:
                evicted, _ = state.rooms.popitem(last=False)
                state.retired.pop(evicted, None)
        else:
            state.rooms.move_to_end(int(room))
        previous = targets.get((endpoint, port))
        if carried is None or carried < 0:
            targets.pop((endpoint, port), None)
        else:
            targets[(endpoint, port)] = carried
        if previous is not None and previous != carried:
            retired = state.retired.setdefault(int(room), {})
            old = retired.get((endpoint, port), ())
            retired[(endpoint, port)] = (old + (previous,))[-RETIRED_PER_TARGET:]


def room_has_generations(kv_mgr: Any, room: int) -> bool:
    """Prefill: whether some decode endpoint's current metadata for ``room`` carried a
    generation (a decode of this release sent it)."""
    state = _prefill_rooms(kv_mgr)
    with state.lock:
        return bool(state.rooms.get(int(room)))


def retired(kv_mgr: Any, room: int, endpoint: Any, port: Any, generation: int) -> bool:
    """Prefill: whether ``endpoint:port`` already replaced ``generation`` for ``room`` with
    later metadata (a message naming it again is a replay of an earlier reservation's)."""
    state = _prefill_rooms(kv_mgr)
    with state.lock:
        gone = state.retired.get(int(room), {}).get((_text(endpoint), int(port)), ())
        return int(generation) in gone and state.rooms.get(int(room), {}).get(
            (_text(endpoint), int(port))) != int(generation)


def known_generation(kv_mgr: Any, room: int, generation: int) -> bool:
    """Prefill: whether some decode endpoint sent ``generation`` for ``room`` (with its current
    metadata, or with metadata a later one replaced): that decode is of this release (only one
    sends a transfer generation), so a message echoing it may carry this release's frames."""
    state = _prefill_rooms(kv_mgr)
    with state.lock:
        if int(generation) in (state.rooms.get(int(room)) or {}).values():
            return True
        return any(int(generation) in gens
                   for gens in (state.retired.get(int(room)) or {}).values())


def room_has_metadata(kv_mgr: Any, room: int) -> bool:
    """Prefill: whether some decode endpoint sent metadata for ``room`` that this prefill
    recorded (current or replaced)."""
    state = _prefill_rooms(kv_mgr)
    with state.lock:
        return bool(state.rooms.get(int(room)) or state.retired.get(int(room)))


def sent_generation(kv_mgr: Any, room: int) -> int | None:
    """Decode: the transfer generation the room's latest metadata carried to its prefill (only
    a prefill of this release gets one), kept past the receiver's release like
    :func:`abort_generation`; None when it carried none."""
    table = _decode_table(kv_mgr)
    with transfer.leg(kv_mgr).lock:
        return table.last_sent.get(int(room))


def target_generation(kv_mgr: Any, room: int, endpoint: Any, port: Any) -> int | None:
    """Prefill: the generation ``endpoint:port`` sent with its current metadata for ``room``
    (None: it sent none, or this prefill holds no metadata of it)."""
    state = _prefill_rooms(kv_mgr)
    with state.lock:
        targets = state.rooms.get(int(room))
        return None if targets is None else targets.get((_text(endpoint), int(port)))


def _frames_failed(failure: policy.Failure) -> list[bytes]:
    """The frame could not be read: the room fails here now; the message goes without a
    generation (the decode drops it, and fails at its waiting timeout: the router does not
    cancel the decode leg when the prefill leg fails, measured by the hook-failure suite)."""
    kv_mgr, room = failure.args[0], failure.args[1]
    transfer.fail_room(kv_mgr, room, failure.refusal(
        500, "the KV transfer (its transfer generation could not be attached)"))
    return []


@hook("transfer_generation.generation_frames", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_frames_failed, key=lambda kv_mgr, room, *a: ("room", room),
      effect="the room fails on the prefill at once; the untagged message is dropped by "
             "the decode, which fails at its waiting timeout (the router does not cancel it)")
def generation_frames(kv_mgr: Any, room: int, endpoint: Any, port: Any) -> list[bytes]:
    """Prefill, for a message to one decode endpoint: the generation frame that endpoint sent
    for the room, or none (it sent none: a stock decode, or a room this prefill forgot)."""
    generation = target_generation(kv_mgr, room, endpoint, port)
    return [] if generation is None else [encode_frame(generation)]


@hook("transfer_generation.status_frames", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_frames_failed, key=lambda kv_mgr, room, *a, **k: ("room", room),
      effect="the room fails on the prefill at once; the untagged message is dropped by "
             "the decode, which fails at its waiting timeout (the router does not cancel it)")
def status_frames(kv_mgr: Any, room: int, endpoint: Any, port: Any, *,
                  has_reason: bool) -> list[bytes]:
    """:func:`generation_frames` for a KV status message: an empty reason frame goes first
    when the message has none, so that a parser reading the fourth frame as the failure reason
    never reads the generation."""
    frames = generation_frames(kv_mgr, room, endpoint, port)
    return frames if has_reason or not frames else [b""] + frames


@policy.passthrough("transfer_generation.prefill_generation",
                    why="behind CommonKVSender.pdsafe_transfer_generation, which only pdsafe's "
                        "own checks call (the digest row's hook refuses the transfer on a "
                        "split or a failure)")
def prefill_generation(kv_mgr: Any, room: int) -> int:
    """The generation the decode ranks of ``room``'s current transfer sent (those whose
    metadata the manager holds for it now: ``pdsafe_decode_endpoints``; 0: none sent one).
    Raises :class:`GenerationSplitError` when they sent different ones (counted once per room
    and set of generations, however many rows ask)."""
    current = {(_text(e), int(p)) for e, p in kv_mgr.pdsafe_decode_endpoints(int(room))}
    state = _prefill_rooms(kv_mgr)
    with state.lock:
        targets = state.rooms.get(int(room)) or {}
        gens = {g for key, g in targets.items() if key in current}
        first_report = False
        if len(gens) > 1:
            key = (int(room), frozenset(gens))
            first_report = key not in state.splits_counted
            state.splits_counted[key] = None
            while len(state.splits_counted) > MAX_ROOMS:
                state.splits_counted.popitem(last=False)
    if len(gens) > 1:
        if first_report:
            metrics.inc(SPLIT)
        raise GenerationSplitError(
            f"the decode ranks of room {room} sent different transfer generations "
            f"{sorted(gens)} (their reservations are out of lockstep); the transfer is "
            "refused. Operators: restart the decode server and report it.")
    return gens.pop() if gens else 0


# =========================================================================== ABORT / ABORT_ACK


@hook("transfer_generation.abort_generation", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=lambda failure: int(failure.args[2]),
      key=lambda kv_mgr, room, fallback: ("room", room),
      effect="the ABORT carries upstream's counter: the prefill treats it as a generation it "
             "never saw (accepts it, acknowledges the drain); the transfer fails either way")
def abort_generation(kv_mgr: Any, room: int, fallback: int) -> int:
    """Decode, arming a deferred release for ``room`` (upstream's
    ``register_deferred_abort_room``): the generation its ABORT carries in upstream's generation
    frame and its ABORT_ACKs must echo. The transfer generation the room's latest metadata
    carried (kept past the receiver's release: a failed transfer's ABORT goes out after
    ``_clear``), else ``fallback`` (upstream's per-manager counter: a stock prefill, or an abort
    before any metadata went out). The room guard keeps one reservation of a room per decode
    at a time, so the latest metadata is the aborted reservation's."""
    table = _decode_table(kv_mgr)
    with transfer.leg(kv_mgr).lock:
        sent = table.last_sent.get(int(room))
    return int(sent) if sent else int(fallback)


def _abort_fields(msg: Sequence[bytes]) -> tuple[int, str, int, int] | None:
    """(room, decode host, decode port, generation) of an upstream ABORT message that names
    all four, else None (quiet: upstream's parser logs malformed ones)."""
    if len(msg) < 5 or bytes(msg[0]) != b"ABORT":
        return None
    try:
        return (int(bytes(msg[1]).decode("ascii")), bytes(msg[2]).decode("ascii"),
                int(bytes(msg[3]).decode("ascii")), int(bytes(msg[4]).decode("ascii")))
    except (ValueError, UnicodeDecodeError):
        return None


def _stale_abort_reason(kv_mgr: Any, room: int, host: Any, port: Any,
                        generation: int | None) -> str | None:
    """Why an ABORT for ``room`` from decode endpoint (host, port) naming ``generation`` is
    stale, or None when it is not. Stale: ``generation`` is one that endpoint's earlier
    metadata for the room carried and a later metadata replaced (an earlier reservation's
    ABORT, replayed or late). Anything else is upstream's to handle, failing a transfer never
    hands KV to anyone: an ABORT without a generation, or naming the current one, or one this
    prefill never saw (a newer reservation whose metadata did not reach this rank, a partial
    publish: its drain ACK must not be withheld, or the decode's pages stay quarantined)."""
    if generation is None or host is None or port is None:
        return None
    key = (_text(host), int(port))
    state = _prefill_rooms(kv_mgr)
    with state.lock:
        current = (state.rooms.get(int(room)) or {}).get(key)
        retired = (state.retired.get(int(room)) or {}).get(key, ())
    if int(generation) == current or int(generation) not in retired:
        return None
    now = "none" if current is None else str(current)
    return (f"it names generation {generation}, which an earlier reservation of decode "
            f"endpoint {key[0]}:{key[1]} used for the room; its current metadata carries {now}")


def abort_message_is_stale(kv_mgr: Any, msg: Sequence[bytes]) -> bool:
    """Prefill, on a raw ABORT message (peer release looks at it before upstream parses it):
    True when :func:`drops_stale_abort` will drop it. Not counted here; never raises."""
    try:
        fields = _abort_fields(msg)
        return fields is not None and _stale_abort_reason(kv_mgr, *fields) is not None
    except Exception:  # noqa: BLE001 - the backend's own check counts and decides
        return False


@hook("transfer_generation.drops_stale_abort", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=returns(False),
      key=lambda kv_mgr, notification: ("room", getattr(notification, "room", None)),
      effect="the ABORT is accepted: the room's transfer fails (never a leak)")
def drops_stale_abort(kv_mgr: Any, notification: Any) -> bool:
    """Prefill control thread, on an ABORT (upstream's parsed ``AbortNotification``), before
    upstream fails the room or registers its drain ACK: True when it is dropped (counted in
    ``stale_abort_dropped_total``). A stale ABORT (an earlier reservation's, replayed or
    forged) would fail the room's live transfer and arm an ACK for a reservation that no
    longer holds the room. A legitimate decode never sends one: it sends a reservation's
    ABORT before it releases the room (``room_guard``), so before any later metadata of the
    room on the same connection. A failing check accepts the ABORT (a failed transfer is
    never a leak)."""
    room = int(notification.room)
    why = _stale_abort_reason(kv_mgr, room, notification.decode_ip, notification.decode_port,
                              notification.generation)
    if why is None:
        return False
    return _drop(STALE_ABORT, "ABORT", room, why)


@hook("transfer_generation.stale_abort_ack", outcome=Outcome.HOLD, counter=FAILED,
      on_failure=returns(None), key=lambda kv_mgr, room, *a: ("room", room),
      effect="the ignored ACK is not counted; it released nothing either way")
def stale_abort_ack(kv_mgr: Any, room: int, prefill_rank: int,
                    generation: int | None) -> None:
    """Decode, upstream ignored an ABORT_ACK: no deferred release of the room is armed (a late
    or duplicated ACK after the release, or a forged one), it is armed for another generation
    (an earlier reservation's ACK), or the ACK names no generation at all (``None``: an older
    peer's format, which upstream drops with a one-time warning). Upstream already ignores it
    (no page is released by it); count and log it."""
    if generation is None:
        why = (f"prefill rank {prefill_rank} acknowledged no generation (an older peer's "
               "format), so it cannot release a deferred hold of the room")
    else:
        why = (f"prefill rank {prefill_rank} acknowledged generation {generation}, which holds "
               "no deferred release of the room on this decode")
    _drop(STALE_ABORT_ACK, "ABORT_ACK", room, why)
