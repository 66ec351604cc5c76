"""Signed control messages: the PD legs' control messages carry a MAC under the cluster key.

Why: every control message of a PD transfer travels in clear over ZMQ, and the receiving leg
acted on whatever arrived. A keyless process that can reach a prefill's bootstrap port could
register itself as a decode and send metadata naming a live room: the prefill then writes that
request's KV into the sender's memory (one tenant's KV handed to a stranger). It could
re-register a real decode's identity with other page addresses (the prefill writes KV over
another request's pages), or, having seen one reservation's generation on the wire, forge that
reservation's Success, aux data or CHUNK_READY toward the decode (issue 21, item 2). Keyed
transfer generations (:mod:`sglang.pdsafe.generation_key`) stop guessing, not observing.

**The key.** The cluster key both legs share: ``SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN``
(upstream's proposed name; ``new,old`` during a rotation), else ``--api-key``
(:func:`sglang.pdsafe.bootstrap_auth.configured_keys`, the one place keys are resolved). The
MAC key is ``HMAC-SHA256(cluster key, label)``: never the token itself. Every configured key is
accepted; the first one signs. No configured key: the legs run **unsigned** (a WARNING at
every scheduler start, the gauge ``sglang:pdsafe_control_messages_unsigned`` = 1, the protection
report lists ``signed-control-messages`` as off); ``SGLANG_PDSAFE_REQUIRE_CLUSTER_KEY=1`` makes
that a startup error. ``SGLANG_PDSAFE_CONTROL_MAC=0`` turns signing off with a key configured
(startup warning).

**Wire** (wire version ``sglang-pdsafe-pair/5`` and later): one frame ``PDSAFE_MAC1:<32 hex>``,
always the very last, after every other frame (the transfer generation's included): a 128-bit
BLAKE2b MAC under the MAC key, personalised ``pdsafe-mac1``, over the direction
(``d2p``/``p2d``: a message of one direction is never valid in the other) and every other
frame, each length-prefixed. The receiver strips it before anything else reads the message, so
every parser (upstream's and ours) sees exactly what it saw before.

Signed (a leg signs only for peers that speak this wire version: a stock peer under the
operator's waiver never sees the frame, which its parsers would misread as an optional field):

* decode -> prefill, every message through upstream's ``_send_bootstrap_message``: the
  capability announcement, the KV-args registration (the page base addresses the prefill writes
  to) and the transfer metadata (room, page ids, metadata slot, generation), and the two it
  sends on the bootstrap socket directly: the receiver's ABORT and the deferred-bootstrap
  BOOTSTRAP; to a prefill that published this wire version (:func:`sealed_for_prefill`);
* prefill -> decode, every message that carries the transfer generation (KV status: bootstrap
  readiness, Success, Failed, peer-release and refusal notices; Mooncake TCP aux data; staging
  CHUNK_READY) and every drain ABORT_ACK that echoes a generation a decode of this release sent
  for the room, signed in upstream's ``_send_multipart_locked`` (:func:`sealed`): the
  generation frame goes only to decodes of this wire version.

Checked (each backend's control thread, first thing after the receive, :func:`verified`):

* a message whose MAC frame does not verify under any accepted key is dropped and counted by
  type (``unauthenticated_<type>_dropped_total``); it never reaches a parser, so it changes no
  state;
* a keyed decode drops an unsigned message that carries a transfer generation (only a peer of
  this release sends one, and it signs); unsigned messages without one go on to the transfer
  generation's checks, which drop any of them for a room whose generation was sent;
* a keyed decode drops an unsigned ABORT_ACK that names a generation for a room whose metadata
  carried a transfer generation (its prefill is of this release and signs its ACKs): a forged
  ACK echoing a generation seen on the wire would make the decode's deferred release free pages
  that the prefill may still write (the distributed use-after-free);
* a keyed leg drops every unsigned staging message (WATERMARK, STAGING_REQ, STAGING_RSP: they
  carry staging offsets, and this release does not sign them, so a keyed server refuses to
  start with ``SGLANG_DISAGG_STAGING_BUFFER`` on: :func:`rank_starting`);
* a keyed prefill drops an unsigned announcement, registration, transfer metadata, ABORT or
  BOOTSTRAP (an unsigned ABORT for a room no decode has sent it metadata for is held for a
  grace and honoured if none arrives meanwhile: a decode of another release refusing this
  prefill at pairing ends the request that way; :mod:`sglang.pdsafe.unsigned_abort`), unless
  its operator waived the decode protections for stock decodes
  (``SGLANG_PDSAFE_WAIVE_FOR_STOCK_PEERS=decode-protections``: a stock decode cannot sign; the
  waiver is what lets it in, and everyone who can reach the port with it). Nothing unsigned
  reaches the decode-capability check either, so a keyless sender cannot make the prefill refuse
  (fail) a live room by naming it. The price: a stock decode paired with a keyed prefill is not
  told (its metadata is dropped, counted, logged): its requests fail at their waiting timeout;
  introduce the cluster key once no stock decode is left (operator guide, "Rolling upgrades");
* a keyed prefill also drops signed metadata that names a generation the same decode endpoint
  already replaced for the room (a replay of an earlier reservation's metadata would point the
  transfer at pages that reservation freed), counted in ``replayed_transfer_info_dropped_total``.

**Pairing.** Each leg publishes the ids of its accepted keys (a keyed BLAKE2b of a fixed label,
6 bytes each; useless for forging) as the pair setting ``control_key``. A decode refuses to pair
with a prefill unless each leg's signing key is one the other accepts (the usual pair-agreement
refusal, naming both values), so a wrong key on one leg is an explicit error at pairing, not a
stream of dropped messages. Rotation: add the new key second on every server (``old,new``),
then first (``new,old``), then drop the old one; each step keeps every pair compatible.

Failure policy: a MAC check that cannot run drops the message (the room it names fails, 500:
its request gets an explicit error instead of a timeout); a MAC that cannot be computed sends
the message unsigned, which the keyed peer drops, and fails the room here.

What it does not sign (yet): the staging WATERMARK / STAGING_REQ / STAGING_RSP messages (a
keyed server refuses to start with staging on, and drops them unsigned); an ABORT_ACK without
a generation (upstream's feature-off format, which upstream's decode ignores). A captured
registration can be replayed after its decode restarted at the same address (it carries no
freshness of its own).
The key ids are public (``GET /route``): a weak cluster key can be brute-forced offline from
them; use a random key of at least 32 bytes.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

from sglang.pdsafe import (
    bootstrap_auth,
    metrics,
    pair_settings,
    peer_policy,
    policy,
    transfer,
    transfer_generation,
    unsigned_abort,
)
from sglang.pdsafe.hook_api import require
from sglang.pdsafe.log_limit import LogLimit
from sglang.pdsafe.policy import Outcome, hook
from sglang.pdsafe.protections import Protection, register, switch_on

logger = logging.getLogger("sglang.pdsafe.control_mac")

FRAME_PREFIX = b"PDSAFE_MAC1:"
MAC_BYTES = 16
ENV_ENABLE = "SGLANG_PDSAFE_CONTROL_MAC"
ENV_REQUIRE = "SGLANG_PDSAFE_REQUIRE_CLUSTER_KEY"
GAUGE = "control_messages_unsigned"
FAILED = "control_mac_failed_total"
REPLAYED = "replayed_transfer_info_dropped_total"
#: Message types, by direction (the counter of each: ``unauthenticated_<type>_dropped_total``;
#: ``staging`` arrives at both).
DECODE_KINDS = ("kv_status", "aux_data", "chunk_ready", "abort_ack", "staging")
PREFILL_KINDS = ("announce", "registration", "transfer_info", "abort", "bootstrap", "staging",
                 "other")
#: Prefill messages that a keyed prefill accepts only signed (``staging`` is never signed: a
#: keyed server does not run staging, so an unsigned one is nobody's).
MUST_SIGN_TO_PREFILL = frozenset({"announce", "registration", "transfer_info", "abort",
                                  "bootstrap", "staging"})
#: Upstream's switch of the staging transfer mode (its messages are not signed).
ENV_STAGING = "SGLANG_DISAGG_STAGING_BUFFER"
D2P = b"d2p"
P2D = b"p2d"
#: The published value of a leg that does not sign.
UNSIGNED = "none"
OFF = "off"
SCHEME = "blake2b-mac:"
_PERSON = b"pdsafe-mac1"
_ID_PERSON = b"pdsafe-keyid"
_LABEL = b"sglang-pdsafe control message MAC key v1\0"
# Upstream's first frames (literals of upstream 0.5.23; test_control_mac checks them against
# the installed modules): Mooncake's TCP aux data, staging chunk-ready, NIXL's and MORI's
# message guards, and the prefill messages this module does not sign.
_AUX = b"AUX_DATA"
_CHUNK_READY = b"CHUNK_READY"
_NIXL_GUARD = b"NixlMsgGuard"
_MORI_GUARD = b"MoriMsgGuard"
#: A leading frame some backends put before the room of a prefill-bound message.
_GUARDS = frozenset({_NIXL_GUARD, _MORI_GUARD})
_ANNOUNCE = b"PDSAFE_PEER"
_ABORT = b"ABORT"
_ABORT_ACK = b"ABORT_ACK"
_BOOTSTRAP = b"BOOTSTRAP"
_STAGING = frozenset({b"WATERMARK", b"STAGING_RSP", b"STAGING_REQ"})
_LOG = {kind: LogLimit(10.0) for kind in DECODE_KINDS + PREFILL_KINDS + ("replayed",)}

_KV_MANAGER = "sglang.srt.disaggregation.common.conn.CommonKVManager"
require(_KV_MANAGER, "pdsafe_sealed(parts)",
        "pdsafe_sealed_for_prefill(bootstrap_room, bootstrap_addr, message)",
        "pdsafe_verified_message(msg)", "pdsafe_transfer_generation_wired",
        why="signed control messages: prefill signs what it sends a decode, decode signs its "
            "bootstrap messages, each control thread checks what arrives (issue 21, item 2)")

register(Protection(
    name="signed-control-messages",
    guards="the PD legs' transfer messages (announcement, registration, metadata; KV status, "
           "aux data, chunk-ready) carry a MAC under the cluster key; a message that fails it "
           "is dropped and counted, a leg with another key is refused at pairing",
    switched_off=lambda args: (f"{ENV_ENABLE}=0" if not enabled() else
                               None if bootstrap_auth.configured_keys(args) else
                               f"no cluster key: {bootstrap_auth.ENV_TOKEN} and --api-key unset"),
))


class ClusterKeyError(policy.StartupRefusedError):
    """The server cannot start: a cluster key is required and none is configured."""


#: The counter of each message type's drops.
UNAUTHENTICATED = {
    "kv_status": "unauthenticated_kv_status_dropped_total",
    "aux_data": "unauthenticated_aux_data_dropped_total",
    "chunk_ready": "unauthenticated_chunk_ready_dropped_total",
    "abort_ack": "unauthenticated_abort_ack_dropped_total",
    "staging": "unauthenticated_staging_dropped_total",
    "abort": "unauthenticated_abort_dropped_total",
    "bootstrap": "unauthenticated_bootstrap_dropped_total",
    "announce": "unauthenticated_announce_dropped_total",
    "registration": "unauthenticated_registration_dropped_total",
    "transfer_info": "unauthenticated_transfer_info_dropped_total",
    "other": "unauthenticated_other_dropped_total",
}


def unauthenticated_counter(kind: str) -> str:
    """The counter of dropped messages of ``kind``."""
    return UNAUTHENTICATED[kind]


def enabled() -> bool:
    """Default on; ``SGLANG_PDSAFE_CONTROL_MAC=0`` sends and accepts unsigned messages."""
    return switch_on(ENV_ENABLE)


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "on", "yes", "y")


def _required() -> bool:
    return _truthy(ENV_REQUIRE)


@functools.lru_cache(maxsize=8)
def _mac_keys(raw: tuple[str, ...]) -> tuple[bytes, ...]:
    """The MAC keys for the configured keys ``raw`` (first: the signing one); cached: every
    message reads them."""
    return tuple(hmac.new(k.encode("utf-8"), _LABEL, hashlib.sha256).digest() for k in raw)


def keys(server_args: Any) -> tuple[bytes, ...]:
    """The MAC keys this leg signs with (first) and accepts (all); empty: unsigned."""
    if not enabled():
        return ()
    return _mac_keys(tuple(bootstrap_auth.configured_keys(server_args)))


#: The MAC keys of this process's PD scheduler, set by :func:`rank_starting` (from the
#: environment and ``--api-key``); None until then (the environment's key alone).
_process_server_args: list[Any] = []


def _keys_of(kv_mgr: Any) -> tuple[bytes, ...]:
    """The keys of the server ``kv_mgr`` belongs to (this process's scheduler)."""
    return keys(_process_server_args[-1] if _process_server_args else None)


def row_keys() -> tuple[bytes, ...]:
    """The keys that seal this process's checked metadata rows, the coverage row
    (:mod:`sglang.pdsafe.coverage`) and the KV digest row (:mod:`sglang.pdsafe.kv_integrity`):
    its MAC keys, signing key first, or ``(b"",)`` on an unkeyed leg (never empty)."""
    return _keys_of(None) or (b"",)


def launcher_starting(server_args: Any) -> None:
    """The launcher process (``startup.launching``), where the HTTP layer's peer-release
    notifier runs: its notices are signed with the keys its schedulers sign with."""
    if not _process_server_args:
        _process_server_args[:] = [server_args]


def sealed_notice(topology: Any, frames: list[Any]) -> list[Any]:
    """A peer-release notice (a bare ABORT from a server's HTTP layer, ``peer_notifier``) to
    the prefill whose ``GET /route`` topology is ``topology``: signed when this process has a
    key and that prefill published this release's wire version, else unchanged (a prefill of
    another release would misread the frame; it takes unsigned ABORTs)."""
    ks = _keys_of(None)
    pair = topology.get("pdsafe_pair") if isinstance(topology, dict) else None
    if not ks or not isinstance(pair, dict) or \
            pair.get("wire_version") != pair_settings.WIRE_VERSION:
        return frames
    theirs = pair.get("control_key")
    if isinstance(theirs, str) and not compatible(theirs, _advertised_keys(ks)):
        return frames  # it does not accept our key (pairing is refused): see sealed_for_prefill
    return seal(ks[0], D2P, frames)


def _advertised_keys(ks: Sequence[bytes]) -> str:
    return SCHEME + ",".join(key_id(k) for k in ks)


def key_id(mac_key: bytes) -> str:
    """A public id of one MAC key (reveals nothing that helps forge a MAC)."""
    return hashlib.blake2b(b"key id", digest_size=6, key=mac_key, person=_ID_PERSON).hexdigest()


def advertised(server_args: Any) -> str:
    """The ``control_key`` pair setting: ``blake2b-mac:<id>,<id>`` (signing key first),
    ``none`` (no cluster key) or ``off``."""
    if not enabled():
        return OFF
    ks = keys(server_args)
    return SCHEME + ",".join(key_id(k) for k in ks) if ks else UNSIGNED


def compatible(prefill: Any, decode: Any) -> bool:
    """Whether two legs' ``control_key`` settings can talk: equal, or both signed and each
    one's signing key (its first id) accepted by the other (a rotation in progress)."""
    if prefill == decode:
        return True
    if not (isinstance(prefill, str) and isinstance(decode, str)
            and prefill.startswith(SCHEME) and decode.startswith(SCHEME)):
        return False
    p = prefill[len(SCHEME):].split(",")
    d = decode[len(SCHEME):].split(",")
    return p[0] in d and d[0] in p


pair_settings.advertise("control_key", advertised)
pair_settings.comparator("control_key", compatible)


def mac(mac_key: bytes, direction: bytes, frames: Sequence[Any]) -> bytes:
    """The MAC of ``frames`` sent in ``direction`` (pure)."""
    h = hashlib.blake2b(digest_size=MAC_BYTES, key=mac_key, person=_PERSON)
    h.update(direction)
    for f in frames:
        b = f if isinstance(f, bytes) else bytes(f)
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.digest()


def seal(mac_key: bytes, direction: bytes, frames: Sequence[Any]) -> list[Any]:
    """``frames`` with their MAC frame appended (pure)."""
    return [*frames, FRAME_PREFIX + mac(mac_key, direction, frames).hex().encode("ascii")]


def split(msg: Sequence[Any]) -> tuple[list[Any], bytes | None]:
    """(the message without its MAC frame, the MAC; b"" when the frame is malformed), or
    (the message, None) when it carries none."""
    frames = list(msg)
    if not frames:
        return frames, None
    last = frames[-1]
    if not isinstance(last, (bytes, bytearray)) or not bytes(last).startswith(FRAME_PREFIX):
        return frames, None
    try:
        tag = bytes.fromhex(bytes(last)[len(FRAME_PREFIX):].decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        tag = b""
    return frames[:-1], tag if len(tag) == MAC_BYTES else b""


def valid(accepted: Sequence[bytes], direction: bytes, body: Sequence[Any], tag: bytes) -> bool:
    """Whether ``tag`` is the MAC of ``body`` under one of the ``accepted`` keys."""
    return any(hmac.compare_digest(mac(k, direction, body), tag) for k in accepted)


# --------------------------------------------------------------------------- startup


def rank_starting(server_args: Any) -> bool:
    """Every PD scheduler: True when this leg signs. Without a cluster key: a WARNING and the
    gauge, or :class:`ClusterKeyError` under :data:`ENV_REQUIRE`."""
    _process_server_args[:] = [server_args]
    signing = bool(keys(server_args))
    if signing and _truthy(ENV_STAGING):
        raise ClusterKeyError(
            f"pdsafe: {ENV_STAGING} is on and this server signs its PD control messages (a "
            f"cluster key is configured), but the staging messages (WATERMARK, STAGING_REQ, "
            f"STAGING_RSP: they carry staging-buffer offsets) are not signed in this release, "
            f"so a keyed peer drops them. Turn staging off (it serves only pairs whose "
            f"attention TP sizes differ, which the KV digest refuses at pairing anyway), or "
            f"run unsigned with {ENV_ENABLE}=0 (every control message is then forgeable by "
            f"anyone who can reach the ports).")
    if not signing and _required():
        raise ClusterKeyError(
            f"pdsafe: {ENV_REQUIRE}=1 but no cluster key is configured"
            + (f" ({ENV_ENABLE}=0 turns signing off)" if not enabled() else "")
            + f": the PD control messages of this server would go unsigned. Set "
            f"{bootstrap_auth.ENV_TOKEN} (or --api-key) to the same random value (32 bytes or "
            f"more) on every prefill and decode server.")
    if not signing:
        logger.warning(
            "pdsafe: this server's PD control messages are UNSIGNED (%s). Anyone who can reach "
            "its KV control or bootstrap ports can register as a decode and name a live room "
            "(receiving its KV), re-point a decode's page addresses, or forge a transfer's "
            "status once they saw its generation. Set %s (or --api-key) to the same random "
            "value on every prefill and decode server.",
            f"{ENV_ENABLE}=0" if not enabled() else "no cluster key configured",
            bootstrap_auth.ENV_TOKEN)
    metrics.set_gauge(GAUGE, 0 if signing else 1)
    return signing


# --------------------------------------------------------------------------- signing

_failing = threading.local()


def _abort_ack_generation(frames: Sequence[Any]) -> tuple[int, int] | None:
    """(room, generation) of an upstream ABORT_ACK that names a generation, else None."""
    if len(frames) < 4 or bytes(frames[0]) != _ABORT_ACK:
        return None
    try:
        return int(bytes(frames[1]).decode("ascii")), int(bytes(frames[3]).decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return None


def _decode_bound_room(kv_mgr: Any, parts: Sequence[Any]) -> int | None:
    """The room a message for a decode's control port names (a KV status read with the
    backend's own parser: Mooncake's starts with the room, NIXL's with a tag)."""
    body = split(parts)[0]
    try:
        if decode_kind(body) == "kv_status":
            parsed = kv_mgr.parse_kv_status_message(list(body))
            return None if parsed is None else int(parsed[0])
        return int(bytes(body[1]).decode("ascii"))
    except (IndexError, ValueError, UnicodeDecodeError, TypeError, AttributeError):
        return None


def _seal_failed(failure: policy.Failure) -> list[Any]:
    """The MAC could not be computed: the message goes unsigned (the keyed decode drops it)
    and the room it names fails here: its prefill client gets an explicit error, and so does
    its decode client when the room's Failed notice can be signed. When signing keeps
    failing, that notice goes unsigned too (re-entry sends without failing again) and is
    dropped there, as any unsigned notice must be: the decode leg ends at its waiting timeout,
    through the router as well (it does not cancel the decode leg; the hook-failure suite's
    full run, 2026-12-07)."""
    kv_mgr, parts = failure.args[0], failure.args[1]
    if not getattr(_failing, "active", False):
        _failing.active = True
        try:
            transfer.fail_room(kv_mgr, _decode_bound_room(kv_mgr, parts), failure.refusal(
                500, "the KV transfer (a control message for it could not be signed)"))
        finally:
            _failing.active = False
    return list(parts)


@hook("control_mac.sealed", outcome=Outcome.REFUSE, counter=FAILED, on_failure=_seal_failed,
      key=lambda kv_mgr, parts: ("room", _decode_bound_room(kv_mgr, parts)),
      effect="the message goes unsigned (the keyed decode drops it) and its room fails here "
             "(500); the decode is told when the room's Failed can be signed, else it fails "
             "at its waiting timeout (the router does not cancel it)")
def sealed(kv_mgr: Any, parts: list[Any]) -> list[Any]:
    """Prefill, every message sent to a decode's control port (upstream's
    ``_send_multipart_locked``): signed when this leg has a key and the message carries a
    transfer generation (only decodes of this wire version get one) or is a drain ABORT_ACK
    echoing a generation a decode of this release sent for the room; otherwise unchanged (a
    stock decode's parsers would misread the frame)."""
    ks = _keys_of(kv_mgr)
    if not ks:
        return parts
    if transfer_generation.frame_generation(parts) is None:
        ack = _abort_ack_generation(parts)
        if ack is None or not transfer_generation.known_generation(kv_mgr, *ack):
            return parts
    return seal(ks[0], P2D, parts)


def _seal_for_prefill_failed(failure: policy.Failure) -> list[Any]:
    """The MAC could not be computed: the message goes unsigned (the keyed prefill drops it)
    and the receiver's room fails here (500), its prefill told by upstream's ABORT."""
    kv_mgr, room, message = failure.args[0], failure.args[1], failure.args[3]
    transfer.fail_room(kv_mgr, room, failure.refusal(
        500, "the KV transfer (its metadata for the prefill could not be signed)"))
    return list(message)


@hook("control_mac.sealed_for_prefill", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_seal_for_prefill_failed, key=lambda kv_mgr, room, *a: ("room", room),
      effect="the message goes unsigned (the keyed prefill drops it) and the receiver's room "
             "fails at once (500)")
def sealed_for_prefill(kv_mgr: Any, room: Any, bootstrap_addr: str,
                       message: list[Any]) -> list[Any]:
    """Decode, every message to a prefill's bootstrap socket (upstream's
    ``_send_bootstrap_message``: announcement, registration, metadata; and the receiver's
    ABORT and deferred BOOTSTRAP; ``room``: the receiver sending it): signed when that
    prefill published this wire version and this leg has a key; otherwise unchanged (a
    stock prefill under the waiver)."""
    if message and bytes(message[0]) == _BOOTSTRAP:
        # Its prefill may now address notices of the room to this decode (before metadata).
        transfer_generation.note_bootstrap_sent(kv_mgr, room)
    ks = _keys_of(kv_mgr)
    if not ks or not kv_mgr.pdsafe_transfer_generation_wired:
        return message  # a backend whose prefill does not check (nor expect) the frame
    if pair_settings.prefill_wire_version(kv_mgr, bootstrap_addr) != pair_settings.WIRE_VERSION:
        return message
    theirs = pair_settings.prefill_control_key(kv_mgr, bootstrap_addr)
    if theirs is not None and not compatible(theirs, _advertised_keys(ks)):
        # Pairing with it is refused (it does not accept our key): our MAC would fail there,
        # while an unsigned ABORT of a room we never sent it metadata for is acted on
        # (:mod:`sglang.pdsafe.unsigned_abort`), so its side of the request ends too.
        return message
    return seal(ks[0], D2P, message)


# --------------------------------------------------------------------------- checking


def decode_kind(msg: Sequence[Any]) -> str:
    """The type of a message arriving at a decode's control port."""
    first = bytes(msg[0]) if msg else b""
    return ("aux_data" if first == _AUX else "chunk_ready" if first == _CHUNK_READY else
            "abort_ack" if first == _ABORT_ACK else "staging" if first in _STAGING else
            "kv_status")


def prefill_kind(msg: Sequence[Any]) -> str:
    """The type of a message arriving at a prefill's bootstrap socket."""
    frames = [bytes(f) for f in msg[:2]]
    if not frames:
        return "other"
    if frames[0] == _ANNOUNCE:
        return "announce"
    if frames[0] == _ABORT:
        return "abort"
    if frames[0] == _BOOTSTRAP:
        return "bootstrap"
    if frames[0] in _STAGING:
        return "staging"
    room = frames[1] if frames[0] in _GUARDS and len(frames) > 1 else frames[0]
    return "registration" if room == b"None" else "transfer_info"


def _drop(kind: str, counter: str, why: str) -> None:
    metrics.inc(counter)
    suppressed = _LOG[kind if counter != REPLAYED else "replayed"].admit()
    if suppressed is not None:
        logger.warning(
            "pdsafe: dropped a %s control message: %s (counted in %s%s%s). A peer of this "
            "release signs with the cluster key; a steady rate means a peer with another key "
            "(its pairing is refused too) or someone on the network without it.", kind, why,
            metrics.PREFIX, counter.removesuffix("_total"),
            f"; {suppressed} more since the last log" if suppressed else "")


def _unguarded(msg: Sequence[Any]) -> list[Any]:
    """A prefill-bound message without its MAC frame and NIXL's or MORI's leading guard
    frame: the frames upstream's parsers index (room first)."""
    frames = list(split(msg)[0])
    return frames[1:] if frames and bytes(frames[0]) in _GUARDS else frames


def _room_of(kv_mgr: Any, msg: Sequence[Any], side: str) -> int | None:
    """The room a received message names (None: none, or unreadable)."""
    if side != "prefill":
        return _decode_bound_room(kv_mgr, msg)
    try:
        frames = _unguarded(msg)
        first = bytes(frames[0])
        # ABORT and BOOTSTRAP name their room second; metadata and registrations first.
        return int(bytes(frames[1 if first in (_ABORT, _BOOTSTRAP) else 0]).decode("ascii"))
    except (IndexError, ValueError, UnicodeDecodeError, TypeError):
        return None


def _metadata_target(msg: Sequence[Any]) -> tuple[list[Any], int, str, int] | None:
    """(frames without NIXL's guard, room, decode endpoint, port) of transfer metadata."""
    frames = _unguarded(msg)
    try:
        return (frames, int(bytes(frames[0]).decode("ascii")),
                bytes(frames[1]).decode("ascii"), int(bytes(frames[2]).decode("ascii")))
    except (IndexError, ValueError, UnicodeDecodeError, TypeError):
        return None


def _verify_failed(failure: policy.Failure) -> None:
    """The check could not run: the message is dropped, and the room it names (when it can be
    read) fails here, so its request gets an explicit error instead of a timeout. On a prefill,
    the decode endpoint that sent metadata is told ``Failed`` at once (tagged with the
    generation it sent): a check that could not run is this server's fault, not a forgery, so
    its peer is not left waiting for its timeout."""
    kv_mgr, msg = failure.args[0], failure.args[1]
    refusal = failure.refusal(
        500, "the KV transfer (a control message for it could not be authenticated)")
    try:
        side = transfer._side_of(kv_mgr)
        room = _room_of(kv_mgr, msg, side)
        target = _metadata_target(msg) if side == "prefill" and \
            prefill_kind(split(msg)[0]) == "transfer_info" else None
    except Exception:  # noqa: BLE001 - unreadable: dropped, nothing to fail
        room, target = None, None
    try:
        transfer.fail_room(kv_mgr, room, refusal)
    finally:
        if target is not None:
            frames, room, endpoint, port = target
            transfer_generation.note_metadata(kv_mgr, room, frames)  # a hook: never raises
            transfer_generation.send_failed_status(kv_mgr, room, [(endpoint, port)],
                                                   refusal.reason)
    return None


def _verify_key(kv_mgr: Any, msg: Sequence[Any]) -> Any:
    try:
        return ("room", _room_of(kv_mgr, msg, transfer._side_of(kv_mgr)))
    except Exception:  # noqa: BLE001
        return ("room", None)


@hook("control_mac.verified", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_verify_failed, key=_verify_key,
      effect="the message is dropped (it changes nothing) and the room it names fails at "
             "once (500)")
def verified(kv_mgr: Any, msg: list[Any]) -> list[Any] | None:
    """Each backend's control thread, first thing after a message arrived (decode: status,
    aux, chunk-ready, ...; prefill: announcement, registration, metadata, ...): the message
    without its MAC frame when it may be acted on, None when it is dropped (counted)."""
    side = transfer._side_of(kv_mgr)
    body, tag = split(msg)
    ks = _keys_of(kv_mgr)
    if side == "prefill":
        kind, direction = prefill_kind(body), D2P
    else:
        kind, direction = decode_kind(body), P2D
    counter = unauthenticated_counter(kind)
    if tag is not None:
        if not ks:
            return body  # unsigned leg: a MAC it cannot check adds nothing, takes nothing
        if not tag or not valid(ks, direction, body, tag):
            _drop(kind, counter, "its MAC does not verify under this server's cluster key")
            return None
        if side == "prefill" and kind == "transfer_info" and _replayed(kv_mgr, body):
            return None
        return body
    if not ks:
        return body
    if side == "prefill":
        if kind == "abort" and not peer_policy.decode_protections_waived():
            unsigned_abort.hold(kv_mgr, body)  # resolved (and counted) there
            return None
        if kind in MUST_SIGN_TO_PREFILL and not peer_policy.decode_protections_waived():
            _drop(kind, counter, "it is unsigned (a decode of this release signs it; a stock "
                                 "decode sends it unsigned: its requests fail at their waiting "
                                 "timeout unless the operator waives decode-protections, and "
                                 "a sender without the cluster key is never heard)")
            return None
        return body
    if kind == "staging":
        _drop(kind, counter, "staging messages are not signed in this release and a keyed "
                             "server runs no staging")
        return None
    if transfer_generation.frame_generation(body) is not None:
        _drop(kind, counter, "it carries a transfer generation but no MAC (a prefill of this "
                             "release signs every such message)")
        return None
    ack = _abort_ack_generation(body) if kind == "abort_ack" else None
    if ack is not None and transfer_generation.sent_generation(kv_mgr, ack[0]) is not None:
        _drop(kind, counter, f"it acknowledges room {ack[0]} unsigned, whose prefill is of "
                             "this release and signs its ACKs (a forged ACK would release "
                             "pages its prefill may still write)")
        return None
    return body


def _replayed(kv_mgr: Any, body: Sequence[Any]) -> bool:
    """Signed metadata naming a generation its decode endpoint already replaced for the room:
    dropped and counted (True)."""
    target = _metadata_target(body)
    if target is None:
        return False  # upstream's parser refuses it
    frames, room, endpoint, port = target
    generation = transfer_generation.frame_generation(frames)
    if generation is None or generation <= 0:
        return False
    if not transfer_generation.retired(kv_mgr, room, endpoint, port, generation):
        return False
    _drop("transfer_info", REPLAYED, f"it names generation {generation} of room {room}, which "
                                     f"decode {endpoint}:{port} already replaced (a replay)")
    return True
