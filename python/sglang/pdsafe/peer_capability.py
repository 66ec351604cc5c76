"""A prefill transfers KV only to decodes that announce this release's pdsafe wire version.

The fork's isolation guarantee needs both legs: the prefill attests what it wrote, and the
*decode* checks the attestation before it commits (coverage check, commit gate), verifies the
KV digest before the first decode step, quarantines pages a failed transfer may still be
written to, and guards its rooms. A stock SGLang decode
does none of that, and a fork decode of another release may speak another wire format. Until
now a fork prefill served either one without a word (issue 11, item 1).

The exchange, on the KV control socket each backend already has:

* **Announce** (decode): right before a decode rank registers its KV args with a prefill rank
  (``CommonKVReceiver._register_kv_args``), it sends one control message on the same ZMQ
  socket::

      [ANNOUNCE_TAG, b"<wire version>", b"<decode identity>"]

  The identity is the key the prefill stores that decode's metadata under
  (``CommonKVManager.pdsafe_decode_identity``: Mooncake and Ascend the transfer-engine
  session id, NIXL the agent name, MORI the engine key). It is sent **only to a prefill that
  published this release's wire version** in its pair settings (``pair_agreement``
  records what each prefill published when the decode pairs with it): a stock prefill, or a
  fork prefill of wire version ``sglang-pdsafe-pair/1``, would misparse an unknown control
  message in its bootstrap thread (Mooncake and NIXL would lose that thread), so it never
  gets one.
* **Record** (prefill): each backend's bootstrap thread hands every message to
  ``pdsafe_on_peer_announce`` before its own dispatch (as it does with ABORT); an
  announcement is consumed there and kept as *pending* for that identity. When the same
  identity's registration follows (``pdsafe_on_decode_registration``; same socket, so it comes
  after), the pending announcement becomes the identity's version, and a registration
  without one clears it (a decode restarted as a stock build on the same identity is not
  taken for the fork it was).
* **Check** (prefill): decode metadata for a room (a ``TransferInfo``) goes through
  ``pdsafe_refuses_decode`` before the backend stores it. From an identity that announced
  this release's wire version it is stored as upstream does. Otherwise the room is refused:
  the metadata is dropped (nothing is ever written to that decode), the room's sender fails
  with the reason (now, or when it is opened: peer release's registry), and the decode is
  told ``Failed`` with the reason through upstream's KV status path, so a stock decode fails
  its request with that message at once. The refusal is logged as an ERROR naming both
  versions, the missing capability and the remedy, and counted in
  ``sglang:pdsafe_decode_peer_refused_total``, once per decode identity and version.

**Opt-in for an upgrade window:** ``decode-protections`` in
``SGLANG_PDSAFE_WAIVE_FOR_STOCK_PEERS`` on the prefill (``peer_policy``) serves decodes that
announced *no* wire version, without their protections: logged once per decode identity
(WARNING) and counted once in ``sglang:pdsafe_stock_decode_served_total``. A decode that
announced another wire version is never waived.

Invariant: a pdsafe prefill stores metadata, and so writes KV, only for decode identities
whose latest registration was preceded by an announcement of this release's wire version,
unless the operator waived ``decode-protections`` and the identity announced nothing; every
other room is failed on both legs at once with an explicit error. A decode sends the
announcement only to prefills that published this release's wire version. A failing hook
refuses (the check) or leaves the decode unannounced (the announcement): fail closed, counted
in ``peer_capability_failed_total``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from sglang.pdsafe import (
    metrics,
    pair_settings,
    peer_policy,
    peer_release,
    policy,
    transfer,
    transfer_generation,
)
from sglang.pdsafe.hook_api import require
from sglang.pdsafe.peer_release_wire import notify_failed
from sglang.pdsafe.policy import Outcome, hook, returns
from sglang.pdsafe.version import build_info
from sglang.srt.disaggregation.base.conn import KVPoll

logger = logging.getLogger("sglang.pdsafe.peer_capability")

#: First frame of a decode's announcement (never a room number, an upstream tag or a guard).
ANNOUNCE_TAG = b"PDSAFE_PEER"
REFUSED = "decode_peer_refused_total"
SERVED = "stock_decode_served_total"
FAILED = "peer_capability_failed_total"
#: Decode identities remembered per prefill manager (oldest forgotten first: fail closed).
MAX_PEERS = 65536
#: Longest version / identity frame accepted.
MAX_FRAME = 1024
#: A malformed announcement is logged at most this often.
WARN_INTERVAL_S = 10.0

_KV_MANAGER = "sglang.srt.disaggregation.common.conn.CommonKVManager"
require(_KV_MANAGER, "pdsafe_decode_identity()", "pdsafe_on_peer_announce(msg)",
        "pdsafe_on_decode_registration(decode_identity)",
        "pdsafe_refuses_decode(bootstrap_room, decode_identity, endpoint, dst_port, msg)",
        why="decodes announce their pdsafe wire version before registering, and prefills "
            "refuse metadata from decodes that did not (decode capability, issue 11)")
require(_KV_MANAGER, "pdsafe_room_status(bootstrap_room)",
        "pdsafe_send_failed_status(bootstrap_room, endpoints, message)",
        "record_failure(bootstrap_room, failure_reason)", "update_status(bootstrap_room, status)",
        why="a refused decode's room fails on the prefill and the decode is told Failed")
require("sglang.srt.disaggregation.base.conn.KVPoll", "Failed", "Success",
        why="room states the decode-capability check reads and sets")

#: What a decode whose announcement could not be built announces: a version no prefill
#: shares, so the prefill refuses it (an announced version is never waived).
ANNOUNCE_FAILED = "sglang-pdsafe-pair/announcement-unavailable"


def _wire_version() -> str:
    return pair_settings.WIRE_VERSION


# --------------------------------------------------------------------------- decode side


def _announce_failed(failure: policy.Failure) -> list[bytes] | None:
    """The announcement could not be built: announce a version no prefill shares, so the
    prefill refuses this decode (never served as an unannounced, waivable stock decode); if
    even the identity cannot be read, this decode is poisoned."""
    kv_mgr = failure.args[0]
    try:
        identity = str(kv_mgr.pdsafe_decode_identity())
    except Exception as e:  # noqa: BLE001
        policy.poison(f"this decode cannot announce itself to its prefills ({e})",
                      by=failure.spec.name)
        return None
    return [ANNOUNCE_TAG, ANNOUNCE_FAILED.encode("ascii"), identity.encode("ascii")]


@hook("peer_capability.announce", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_announce_failed, key=lambda kv_mgr, addr: ("prefill", addr),
      effect="the decode announces a version no prefill shares: the prefill refuses it at "
             "once (naming it); if even its identity is unreadable, the decode is poisoned")
def announce_frames(kv_mgr: Any, bootstrap_addr: str) -> list[bytes] | None:
    """The announcement a decode sends before registering with the prefill at
    ``bootstrap_addr``, or None when that prefill must not get one (it did not publish this
    release's wire version: a stock prefill, another release, or not paired through
    ``pair_agreement``), or this backend has no identity to announce."""
    mine = _wire_version()
    if pair_settings.prefill_wire_version(kv_mgr, bootstrap_addr) != mine:
        return None
    identity = kv_mgr.pdsafe_decode_identity()
    if not identity:
        return None
    return [ANNOUNCE_TAG, mine.encode("ascii"), str(identity).encode("ascii")]


# --------------------------------------------------------------------------- prefill side


def parse_announce(msg: list[bytes]) -> tuple[str, str] | None:
    """(wire version, decode identity) of an announcement, or None when malformed. Frames
    after the third are ignored (room for a later release)."""
    if len(msg) < 3 or msg[0] != ANNOUNCE_TAG:
        return None
    if not (0 < len(msg[1]) <= MAX_FRAME and 0 < len(msg[2]) <= MAX_FRAME):
        return None
    try:
        return msg[1].decode("ascii"), msg[2].decode("ascii")
    except UnicodeDecodeError:
        return None


class _Peers:
    """Per prefill manager: announcements awaiting their registration, the version of each
    registered decode identity, and which identities were logged (refused or served)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: OrderedDict[str, str] = OrderedDict()
        self.versions: OrderedDict[str, str] = OrderedDict()
        self.refused: OrderedDict[tuple[str, str | None], bool] = OrderedDict()
        self.served: OrderedDict[str, bool] = OrderedDict()
        self.last_warn = float("-inf")

    @staticmethod
    def put(table: OrderedDict[Any, Any], key: Any, value: Any) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > MAX_PEERS:
            table.popitem(last=False)

    def first(self, table: OrderedDict[Any, bool], key: Any) -> bool:
        """Record ``key``; True the first time (the caller logs and counts)."""
        with self.lock:
            if key in table:
                return False
            self.put(table, key, True)
            return True


def _peers(kv_mgr: Any) -> _Peers:
    return transfer.leg(kv_mgr).table("peer_capability", _Peers)


@hook("peer_capability.on_announce", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=returns(None),
      effect="the decode stays unannounced: refused (served only as a stock decode under "
             "the operator's waiver, where its own protections still run)")
def on_announce(kv_mgr: Any, msg: list[bytes]) -> None:
    """Prefill control thread: a decode announced itself (consumed by the caller either way)."""
    parsed = parse_announce(msg)
    peers = _peers(kv_mgr)
    if parsed is None:
        now = time.monotonic()
        with peers.lock:
            warn = now - peers.last_warn >= WARN_INTERVAL_S
            peers.last_warn = now if warn else peers.last_warn
        if warn:
            logger.warning("pdsafe: dropped a malformed decode announcement (%d frames); the "
                           "decode it came from stays unannounced", len(msg))
        return
    version, identity = parsed
    with peers.lock:
        peers.put(peers.pending, identity, version)
    logger.debug("pdsafe: decode %s announced wire version %s", identity, version)


def _registration_failed(failure: policy.Failure) -> None:
    """The registration could not be recorded: the identity's earlier version is forgotten
    (a decode restarted as a stock build is never taken for the fork it was); if even that
    fails, this prefill is poisoned."""
    kv_mgr, identity = failure.args[0], str(failure.args[1])
    try:
        peers = _peers(kv_mgr)
        with peers.lock:
            peers.versions.pop(identity, None)
            peers.pending.pop(identity, None)
    except Exception as e:  # noqa: BLE001
        policy.poison(f"this prefill cannot track its decodes' versions ({e})",
                      by=failure.spec.name)


@hook("peer_capability.on_registration", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_registration_failed, key=lambda kv_mgr, identity: ("decode", identity),
      effect="the decode's earlier version is forgotten: it is refused as unannounced; if "
             "that fails too, the prefill is poisoned")
def on_registration(kv_mgr: Any, decode_identity: str) -> None:
    """Prefill control thread: ``decode_identity`` registered its KV args. The announcement
    sent just before (same socket) applies from now on; none clears an earlier one."""
    identity = str(decode_identity)
    peers = _peers(kv_mgr)
    with peers.lock:
        version = peers.pending.pop(identity, None)
        if version is None:
            peers.versions.pop(identity, None)
        else:
            peers.put(peers.versions, identity, version)


def announced_version(kv_mgr: Any, decode_identity: str) -> str | None:
    """The wire version ``decode_identity`` announced before its latest registration."""
    peers = _peers(kv_mgr)
    with peers.lock:
        return peers.versions.get(str(decode_identity))


def announced_or_pending(kv_mgr: Any, decode_identity: str) -> bool:
    """Whether ``decode_identity`` announced a wire version (registered, or announced and about
    to register): a decode of a pdsafe release, not a stock one."""
    peers = _peers(kv_mgr)
    identity = str(decode_identity)
    with peers.lock:
        return identity in peers.versions or identity in peers.pending


def _release() -> str:
    return f"sglang-pdsafe {build_info().get('version')}"


def refusal_message(decode_identity: str, endpoint: str, dst_port: int,
                    version: str | None) -> str:
    """What the prefill logs and both clients read: both versions, the missing capability and
    the remedy."""
    mine = _wire_version()
    if version is None:
        theirs = ("no sglang-pdsafe wire version (a stock SGLang decode, or an sglang-pdsafe "
                  f"release older than wire version {mine})")
        fix = (f"run this sglang-pdsafe release on the decode, or, for a rolling upgrade "
               f"window only, set {peer_policy.ENV_WAIVE}={peer_policy.DECODE_PROTECTIONS} on "
               f"this prefill to serve such decodes without these protections")
    else:
        theirs = f"wire version {version!r}"
        fix = ("run the same sglang-pdsafe release on both servers (a decode of another "
               "release is never waived)")
    return (f"pdsafe: this prefill server ({_release()}, wire version {mine}) refuses to "
            f"transfer KV to the decode {decode_identity} at {endpoint}:{dst_port}: it "
            f"announced {theirs}. Missing capability: {peer_policy.DECODE_PROTECTIONS} (the "
            f"decode's coverage check before commit, KV digest check, page quarantine and room "
            f"guard, without which the isolation this prefill promises does not hold). Fix: {fix}.")


def _verdict(kv_mgr: Any, decode_identity: str, endpoint: str, dst_port: int) -> str | None:
    """None to serve ``decode_identity``, else the refusal message (logged and counted the
    first time for this identity and announced version)."""
    version = announced_version(kv_mgr, decode_identity)
    if version == _wire_version():
        return None
    peers = _peers(kv_mgr)
    if version is None and peer_policy.decode_protections_waived():
        if peers.first(peers.served, decode_identity):
            metrics.inc(SERVED)
            logger.warning(
                "pdsafe: serving decode %s at %s:%s, which announced no sglang-pdsafe wire "
                "version (a stock SGLang decode or an older fork; this prefill speaks %s), "
                "because %s waives %s. Its requests run without the decode's coverage check, "
                "KV digest check, page quarantine and room guard. Remove the waiver once "
                "every decode runs this sglang-pdsafe release.", decode_identity, endpoint,
                dst_port, _wire_version(), peer_policy.ENV_WAIVE, peer_policy.DECODE_PROTECTIONS)
        return None
    message = refusal_message(decode_identity, endpoint, dst_port, version)
    if peers.first(peers.refused, (decode_identity, version)):
        metrics.inc(REFUSED)
        logger.error("%s Every request from this decode fails at once (this is logged once "
                     "per decode).", message)
    return message


def _refuse_room(kv_mgr: Any, room: int, endpoint: str, dst_port: int, message: str) -> None:
    """Fail ``room`` here (now if its sender is open, else when it opens) and tell the decode
    endpoint ``Failed`` with ``message`` through upstream's KV status path."""
    status = kv_mgr.pdsafe_room_status(room)
    if status is not None and status != KVPoll.Success:
        kv_mgr.record_failure(room, message)
        kv_mgr.update_status(room, KVPoll.Failed)
    # Remembered by peer release: a sender opened later for this room fails at once, and
    # metadata other decode ranks published for it is answered Failed too.
    peer_release.prefill_rejected(kv_mgr, room, message)
    for (host, port), err in transfer_generation.send_failed_status(
            kv_mgr, room, [(endpoint, dst_port)], message):
        if err is not None:
            notify_failed(f"send the Failed status of refused room {room} to decode "
                          f"{host}:{port}", err)
    logger.debug("pdsafe: refused room %s of decode %s:%s", room, endpoint, dst_port)


def _text(value: Any) -> str:
    return value.decode("ascii", errors="replace") if isinstance(value, bytes) else str(value)


def _check_failed(failure: policy.Failure) -> bool:
    """The capability check could not run: the metadata is refused (dropped) and the room
    fails here; the decode is told Failed (tagged with its generation) when possible."""
    kv_mgr, room = failure.args[0], int(failure.args[1])
    endpoint, dst_port = _text(failure.args[3]), int(_text(failure.args[4]))
    refusal = failure.refusal(503, "the KV transfer (this prefill could not check the "
                                   "decode's capability)")
    _note_generation(kv_mgr, room, failure.kwargs.get("msg"))  # a hook: it never raises
    try:
        _refuse_room(kv_mgr, room, endpoint, dst_port, refusal.reason)
    finally:
        transfer.fail_room(kv_mgr, room, refusal)
    return True


@hook("peer_capability.refuses_transfer_info", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_check_failed,
      key=lambda kv_mgr, room, identity, *a: ("room", room, str(identity)),
      effect="the decode's metadata is refused (nothing written to it); the room fails on "
             "both legs at once (503)")
def refuses_transfer_info(kv_mgr: Any, room: int, decode_identity: str, endpoint: Any,
                          dst_port: Any, msg: Sequence[bytes] | None = None) -> bool:
    """Prefill control thread, decode metadata for ``room`` arrived, before the backend stores
    it: True when the decode is refused (the room is failed on both legs; the caller drops the
    metadata), False to store it as upstream does. ``msg``: the metadata message, where the
    backend passes it; its transfer generation tags the refusal's ``Failed``, so a decode
    that sent one takes it at once instead of dropping it as stale."""
    host = _text(endpoint)
    try:
        port = int(_text(dst_port))
    except ValueError:
        port = -1  # never reached through the backends (they parse the port first)
    message = _verdict(kv_mgr, str(decode_identity), host, port)
    if message is None:
        return False
    _note_generation(kv_mgr, room, msg)
    if port >= 0:
        _refuse_room(kv_mgr, int(room), host, port, message)
    return True


def _note_generation(kv_mgr: Any, room: int, msg: Sequence[bytes] | None) -> None:
    """Remember the generation the refused metadata carries (as for stored metadata), so the
    refusal's ``Failed`` echoes it. A failure to note it fails the room here too (that
    hook's policy); the refusal goes out either way."""
    if msg is not None:
        transfer_generation.note_metadata(kv_mgr, int(room), msg)
