"""Peer release, shared by both sides: the bare ABORT wire format, the switch, the counting.

A bare ABORT is upstream's own ABORT control message with three frames::

    [b"ABORT", b"<room>", WIRE_PREFIX + b"<origin>:<unix time>:<reason utf-8>"]

Upstream's ``AbortNotification.from_zmq`` reads a 3-frame ABORT as "abort this room" (the third
frame is ignored), so an unpatched prefill still drops the room; a patched one also reads who
refused it (the origin), when, and why, and hands that reason to the clients.

Invariant: :func:`parse_abort` accepts exactly what :func:`encode_abort` produces, plus any
upstream ABORT (which it reports as a decode-side abort with a generic reason); it never
raises on malformed input (it returns None). Every notice that could not be delivered is
counted in ``peer_release_notify_failed_total`` (:func:`notify_failed`), every delivered one
once in ``peer_notified_release_total`` (:func:`count_notified`).

The refusing side's HTTP status travels inside the reason text, as ``(HTTP 4xx)`` right after
the refusing side is named ("the decode server refused it (HTTP 400): ..."): the peer's
scheduler reads it back with :func:`peer_refusal_status` and answers its own client with the
same 4xx instead of upstream's 500 for a failed transfer, so a client (or the router, which
answers with the prefill's error first) sees a refusal of its request as a client error on
both sides. Only 4xx statuses travel; anything else stays the peer's own 500.

Off switch (default on): ``SGLANG_PDSAFE_PEER_RELEASE=0`` (logged as a warning at startup).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from sglang.pdsafe import metrics
from sglang.pdsafe.policy import Outcome, hook
from sglang.pdsafe.protections import Protection, off_by, register, switch_on

logger = logging.getLogger("sglang.pdsafe.peer_release")

ENV_ENABLE = "SGLANG_PDSAFE_PEER_RELEASE"
#: Failure counter of every peer-release hook and of every notice that could not be delivered.
FAILED = "peer_release_notify_failed_total"

#: Upstream's ABORT control tag (every backend's prefill control thread routes it).
ABORT_TAG = b"ABORT"
#: Marker of our third frame.
WIRE_PREFIX = b"pdsafe-reject:v1:"
#: Longest reason carried on the wire (bytes of UTF-8).
MAX_REASON_BYTES = 1024

ORIGIN_LOCAL = "local"  # this prefill's scheduler refused or aborted the request
ORIGIN_HTTP = "http"  # this prefill's own HTTP layer refused it (bare ABORT to itself)
ORIGIN_PEER = "peer"  # the decode side refused or aborted it

#: The reason a plain upstream ABORT (no pdsafe frame) stands for.
DECODE_ABORT_REASON = "the decode server aborted the request"


def enabled() -> bool:
    """Peer release is on unless ``SGLANG_PDSAFE_PEER_RELEASE`` is 0/false/off/no."""
    return switch_on(ENV_ENABLE)


register(Protection(
    name="peer-release",
    guards="a PD request refused or aborted on one side before its KV transfer is failed on "
           "the other side at once through the KV control channel, which frees its pages",
    switched_off=off_by(ENV_ENABLE),
))


def count_notified(t0_monotonic: float | None = None, t0_wall: float | None = None) -> None:
    """The peer was told: count it, and the time since the local rejection when known."""
    metrics.inc("peer_notified_release_total")
    if t0_monotonic is not None:
        metrics.observe("peer_release_latency_seconds", max(0.0, time.monotonic() - t0_monotonic))
    elif t0_wall is not None:
        metrics.observe("peer_release_latency_seconds", max(0.0, time.time() - t0_wall))


def notify_failed(what: str, err: Any, count: int = 1, log: bool = True) -> None:
    """The peer could not be told (``count`` notices): it frees only at its own timeout."""
    metrics.inc(FAILED, count)
    if log:
        logger.warning(
            "pdsafe peer release: could not %s (%s). The peer keeps its reservation until its "
            "own timeout (SGLANG_DISAGGREGATION_WAITING_TIMEOUT / _BOOTSTRAP_TIMEOUT); check "
            "that the prefill bootstrap server and the KV control ports are reachable.", what,
            err)


@dataclass(frozen=True)
class AbortNotice:
    """A parsed ABORT: the room, who gave it up, when (wall clock, if sent), and why."""

    room: int
    origin: str
    t0_wall: float | None
    reason: str


def wire_frame(origin: str, reason: str, now: float | None = None) -> bytes:
    """The third frame of a bare ABORT."""
    ts = time.time() if now is None else now
    return (WIRE_PREFIX + f"{origin}:{ts:.6f}:".encode()
            + reason.encode("utf-8")[:MAX_REASON_BYTES])


def parse_wire_frame(frame: bytes) -> tuple[str, float | None, str]:
    """(origin, t0_wall, reason) of a third frame that starts with WIRE_PREFIX. Only the
    origins a remote sender may claim (http, peer) are accepted; anything else reads as peer."""
    body = frame[len(WIRE_PREFIX):].decode("utf-8", errors="replace")
    origin, _, rest = body.partition(":")
    ts, _, reason = rest.partition(":")
    try:
        t0_wall: float | None = float(ts)
    except ValueError:
        t0_wall = None
    if origin not in (ORIGIN_HTTP, ORIGIN_PEER):
        origin = ORIGIN_PEER
    return origin, t0_wall, reason or "refused"


def encode_abort(room: int, origin: str, reason: str) -> list[bytes]:
    """The frames of a bare ABORT for ``room``."""
    return [ABORT_TAG, str(int(room)).encode("ascii"), wire_frame(origin, reason)]


def parse_abort(msg: list[bytes]) -> AbortNotice | None:
    """The notice an ABORT message carries, or None when ``msg`` is not a well-formed ABORT."""
    if len(msg) < 2 or msg[0] != ABORT_TAG:
        return None
    try:
        room = int(msg[1].decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return None
    if len(msg) == 3 and msg[2].startswith(WIRE_PREFIX):
        origin, t0_wall, reason = parse_wire_frame(msg[2])
        return AbortNotice(room, origin, t0_wall, reason)
    return AbortNotice(room, ORIGIN_PEER, None, DECODE_ABORT_REASON)


#: The status note in a refusal reason; only client errors (4xx) travel.
_STATUS_NOTE = re.compile(r"\(HTTP (4\d\d)\)")
#: How every failure message peer release hands a client starts (``peer_release``).
FAILURE_PREFIX = "pdsafe: the PD request"


def client_error_status(status: Any) -> int | None:
    """``status`` as an int when it is a client error (400-499), else None."""
    try:
        code = int(status)
    except (TypeError, ValueError):
        return None
    return code if 400 <= code < 500 else None


def status_note(status: Any) -> str:
    """`` (HTTP 4xx)`` for a client-error status, else the empty string."""
    code = client_error_status(status)
    return f" (HTTP {code})" if code is not None else ""


def request_refusal_status(req: Any) -> int | None:
    """The 4xx status a refused request's own client gets (its ``FINISH_ABORT``), or None."""
    for reason in (getattr(req, "finished_reason", None), getattr(req, "to_finish", None)):
        code = client_error_status(getattr(reason, "status_code", None))
        if code is not None:
            return code
    return None


def error_refusal_status(error: BaseException | None) -> int | None:
    """The 4xx status the HTTP layer answers ``error`` with: its ``status_code``, or 400 for
    a ValueError (upstream's HTTP handlers answer a ValueError with 400); else None."""
    if error is None:
        return None
    code = client_error_status(getattr(error, "status_code", None))
    if code is None and isinstance(error, ValueError):
        return 400
    return code


@hook("peer_release_wire.peer_refusal_status", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=lambda failure: failure.args[1],
      effect="the request is refused with upstream's status (500) instead of the peer's 4xx")
def peer_refusal_status(error_message: Any, default: int) -> int:
    """The status a PD side answers its client with when its KV transfer or bootstrap failed.

    Invariant: returns ``default`` (upstream's 500) unless ``error_message`` carries a peer
    release failure (``FAILURE_PREFIX``) whose reason names a 4xx refusal; then that 4xx, the
    status the refusing side gave its own client. A failure is never turned into a success,
    and only a message our own peer-release path wrote can change the status.
    """
    if not isinstance(error_message, str):
        return default
    at = error_message.find(FAILURE_PREFIX)
    if at < 0:
        return default
    m = _STATUS_NOTE.search(error_message, at)
    return int(m.group(1)) if m else default
