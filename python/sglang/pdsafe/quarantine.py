"""Decode-page quarantine: pages a remote writer may still touch are never reused.

In PD mode the prefill pushes KV with one-sided writes into pages the decode reserved; the
decode cannot refuse a write when it lands. When a transfer fails or is aborted, upstream
0.5.23 holds the decode pages ("deferred decode KV release") until every prefill rank that may
write them acknowledges the drain (ABORT_ACK), but after
``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT`` (30 s) it releases them anyway,
even when the prefill is still writing: the pages go back to the allocator and the late write
lands in another request's KV (a distributed use-after-free). This module makes the hold a
quarantine that only terminal evidence ends.

Lifecycle of one held transfer (``HeldTransfer.state``), the allowed transitions checked by
:meth:`HeldTransfer.move`::

    HELD ----(drain ACK from every writer rank)-------------> RELEASED_ACK
    HELD ----(the writer is proven gone)--------------------> RELEASED_PEER_GONE
    HELD ----(upstream's deadline passes)-------------------> OVERDUE     (alarm: logged once,
    OVERDUE -(drain ACK)------------------------------------> RELEASED_ACK  counted; the pages
    OVERDUE -(the writer is proven gone)--------------------> RELEASED_PEER_GONE  stay held)
    HELD | OVERDUE --(the KV pool itself is torn down)------> DROPPED

A timeout is never evidence: it only moves HELD to OVERDUE. The released and dropped states
are terminal.

**Evidence.**

* *ACK*: upstream's ``is_abort_release_safe(room, required_acks)``: every prefill rank that was
  sent this room's destinations acknowledged, for the generation of this hold, that its
  transfer worker has nothing queued or in flight for the room.
* *Peer gone*: the decode's heartbeat checker declared the writer's bootstrap server dead
  (upstream's ``_handle_node_failure``, after ``SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE``
  missed heartbeats) *after* this transfer's destinations were sent to it (the receiver's
  ``init_time``; a prefill restarted since then is another process that never had them; an
  earlier death proves nothing about a later process). Usually the heartbeat fails first and
  the hold follows (the failure is what aborts the transfer). What it proves and what it does
  not: a prefill process that exited can no longer post writes (on TCP its connections are
  closed; on RDMA the kernel destroys its queue pairs at exit, which flushes them). A prefill
  that is alive but unreachable for that long (a partition, a stalled process) is taken for
  gone too; that is the one assumption this evidence rests on, and
  ``SGLANG_PDSAFE_QUARANTINE_PEER_GONE=0`` removes it (then only an ACK, or a restart of this
  decode, ends a quarantine).

**Quarantine limit.** When the tokens held *past upstream's deadline* (OVERDUE: pages upstream
would have freed) exceed ``SGLANG_PDSAFE_QUARANTINE_LIMIT`` (a fraction of the decode's KV pool,
default 0.25; holds inside the deadline are an abort's normal drain and never count), the
decode refuses new PD requests (503, the prefill told at once) and ``/health`` answers 503 with
the reason, instead of serving from an ever smaller pool; it recovers by itself once evidence
releases enough pages.

**Metrics**: ``quarantined_tokens`` and ``quarantined_transfers`` (gauges),
``quarantine_age_seconds`` (histogram, at release), ``quarantine_released_total{evidence}``
split as ``quarantine_released_ack_total`` / ``quarantine_released_peer_gone_total``,
``quarantine_overdue_total`` (alarms), ``quarantine_limit_refused_total``,
``quarantine_failed_total`` (a hook failed; the hold is kept).

What this does not do (yet; issue 9): pages are held per transfer, not tagged per page with a
generation; KV status and aux data carry no generation; the prefill's source pages are not
held. Upstream variable names keep working: ``deferred_kv_release_timeout`` is now the alarm
deadline, not a release deadline.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sglang.pdsafe import metrics
from sglang.pdsafe.hook_api import attached, guarded
from sglang.pdsafe.protections import Protection, pd_mode, register, switch_on
from sglang.pdsafe.room_guard import Refusal  # the PD doors' one refusal type

logger = logging.getLogger("sglang.pdsafe.quarantine")

ENV_ENABLE = "SGLANG_PDSAFE_QUARANTINE"
ENV_LIMIT = "SGLANG_PDSAFE_QUARANTINE_LIMIT"
ENV_PEER_GONE = "SGLANG_PDSAFE_QUARANTINE_PEER_GONE"
UPSTREAM_DEFERRED_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
DEFAULT_LIMIT = 0.25
FAILED = "quarantine_failed_total"
LIMIT_STATUS = 503
_REGISTRY_ATTR = "_pdsafe_quarantine"


def enabled() -> bool:
    """Default on; ``SGLANG_PDSAFE_QUARANTINE=0`` restores upstream's timeout release."""
    return switch_on(ENV_ENABLE)


def peer_gone_is_evidence() -> bool:
    """Default on; ``SGLANG_PDSAFE_QUARANTINE_PEER_GONE=0``: only a drain ACK releases."""
    return switch_on(ENV_PEER_GONE)


def limit_fraction() -> float:
    """The quarantine limit as a fraction of the KV pool, in (0, 1]; a bad value raises."""
    raw = os.environ.get(ENV_LIMIT, "").strip()
    if not raw:
        return DEFAULT_LIMIT
    try:
        value = float(raw)
    except ValueError as e:
        raise ValueError(f"{ENV_LIMIT}={raw!r} is not a number; give a fraction of the decode "
                         f"KV pool in (0, 1], e.g. {DEFAULT_LIMIT}") from e
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{ENV_LIMIT}={raw!r} is outside (0, 1]; give a fraction of the "
                         f"decode KV pool, e.g. {DEFAULT_LIMIT}")
    return value


register(Protection(
    name="decode-page-quarantine",
    guards="decode pages of an aborted or failed transfer stay quarantined until every "
           "prefill writer acknowledged the drain or is proven gone; a timeout only alarms, "
           "and admission stops (503, /health says why) past the quarantine limit",
    is_active=lambda server_args: pd_mode(server_args) == "decode" and enabled(),
    disabled_by=f"{ENV_ENABLE}=0",
))


class Evidence(enum.Enum):
    """What ended a quarantine (the label of the release counters)."""

    ACK = "ack"
    PEER_GONE = "peer_gone"


class HoldState(enum.Enum):
    HELD = "held"
    OVERDUE = "overdue"
    RELEASED_ACK = "released_ack"
    RELEASED_PEER_GONE = "released_peer_gone"
    DROPPED = "dropped"


#: The allowed transitions; anything else is a bug and raises :class:`IllegalTransition`.
TRANSITIONS: dict[HoldState, frozenset[HoldState]] = {
    HoldState.HELD: frozenset({HoldState.OVERDUE, HoldState.RELEASED_ACK,
                               HoldState.RELEASED_PEER_GONE, HoldState.DROPPED}),
    HoldState.OVERDUE: frozenset({HoldState.RELEASED_ACK, HoldState.RELEASED_PEER_GONE,
                                  HoldState.DROPPED}),
    HoldState.RELEASED_ACK: frozenset(),
    HoldState.RELEASED_PEER_GONE: frozenset(),
    HoldState.DROPPED: frozenset(),
}
_RELEASED_BY = {Evidence.ACK: HoldState.RELEASED_ACK,
                Evidence.PEER_GONE: HoldState.RELEASED_PEER_GONE}
_RELEASE_COUNTER = {Evidence.ACK: "quarantine_released_ack_total",
                    Evidence.PEER_GONE: "quarantine_released_peer_gone_total"}


class IllegalTransition(RuntimeError):
    """A held transfer was asked to move along a transition :data:`TRANSITIONS` forbids."""


@dataclass
class HeldTransfer:
    """Decode pages of one failed transfer, held until terminal evidence.

    Invariant: ``state`` only changes through :meth:`move`, along :data:`TRANSITIONS`.
    """

    room: int
    rid: str
    tokens: int
    writer: str  # the prefill's bootstrap address ("" when unknown: only an ACK can release)
    held_since: float
    deadline: float
    writer_since: float = 0.0  # wall clock: when the writer got this transfer's destinations
    state: HoldState = HoldState.HELD

    def move(self, to: HoldState) -> None:
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"room {self.room} (rid {self.rid}): {self.state.value} -> "
                                    f"{to.value} is not an allowed quarantine transition")
        self.state = to

    @property
    def terminal(self) -> bool:
        return not TRANSITIONS[self.state]


@dataclass
class Quarantine:
    """The held transfers of one decode KV manager, and the writers proven gone.

    Keys are chosen by the caller (one per held transfer; the scheduler uses the request's
    metadata-buffer slot, unique while held). Invariant: ``tokens_held()`` is the sum of the
    tokens of the entries not yet released, and the gauges follow every change.
    """

    _held: dict[Any, HeldTransfer] = field(default_factory=dict)
    _gone: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- holding
    def hold(self, key: Any, *, room: int, rid: str, tokens: int, writer: str, now: float,
             deadline: float, writer_since: float | None = None) -> HeldTransfer:
        """Hold ``key``'s pages. ``now``/``deadline`` are monotonic; ``writer_since`` is the
        wall-clock time the writer got the destinations (default: now, wall clock)."""
        entry = HeldTransfer(room=int(room), rid=str(rid), tokens=max(int(tokens), 0),
                             writer=str(writer or ""), held_since=now, deadline=deadline,
                             writer_since=time.time() if writer_since is None
                             else float(writer_since))
        with self._lock:
            if key in self._held:
                raise IllegalTransition(f"quarantine key {key!r} is already held (room "
                                        f"{self._held[key].room}); a slot is held once")
            self._held[key] = entry
        self._publish()
        return entry

    def peer_gone(self, writer: str, now: float) -> None:
        """The writer at ``writer`` (a bootstrap address) was declared dead at ``now`` (wall
        clock, comparable with ``writer_since``)."""
        with self._lock:
            self._gone[str(writer)] = now

    def evidence(self, key: Any, *, drained: bool, now: float) -> Evidence | None:
        """Terminal evidence for ``key``, or None; moves a held entry past its deadline to
        OVERDUE (alarm logged once, counted). Never releases anything itself."""
        with self._lock:
            entry = self._held.get(key)
            if entry is None:
                raise KeyError(f"quarantine key {key!r} is not held")
            if drained:
                return Evidence.ACK
            gone_at = self._gone.get(entry.writer) if entry.writer else None
            if gone_at is not None and gone_at >= entry.writer_since and peer_gone_is_evidence():
                return Evidence.PEER_GONE
            overdue = entry.state is HoldState.HELD and now >= entry.deadline
            if overdue:
                entry.move(HoldState.OVERDUE)
        if overdue:
            metrics.inc("quarantine_overdue_total")
            logger.error(
                "pdsafe quarantine: the KV pages of aborted request %s (room %s, %d tokens) "
                "are still held %.1f s after the abort: prefill %s has not acknowledged that "
                "its writes drained and is not known to be gone. They stay quarantined (upstream "
                "would have reused them now, exposing them to a late write). Operator: check "
                "that prefill's health and transfer engine; restarting it releases the pages "
                "once this decode's heartbeat declares it gone.", entry.rid, entry.room,
                entry.tokens, now - entry.held_since, entry.writer or "(unknown)")
        return None

    def release(self, key: Any, evidence: Evidence, now: float) -> HeldTransfer:
        """End ``key``'s quarantine on ``evidence`` (its pages may be freed by the caller)."""
        with self._lock:
            entry = self._held[key]
            entry.move(_RELEASED_BY[evidence])
            del self._held[key]
        metrics.inc(_RELEASE_COUNTER[evidence])
        metrics.observe("quarantine_age_seconds", max(0.0, now - entry.held_since))
        self._publish()
        return entry

    def drop_all(self) -> list[HeldTransfer]:
        """The KV pool is torn down (``release_memory_occupation``): no page remains to guard."""
        with self._lock:
            entries = list(self._held.values())
            for e in entries:
                e.move(HoldState.DROPPED)
            self._held.clear()
        self._publish()
        return entries

    # -- reading
    def tokens_held(self) -> int:
        with self._lock:
            return sum(e.tokens for e in self._held.values())

    def entries(self) -> list[HeldTransfer]:
        with self._lock:
            return list(self._held.values())

    def is_held(self, key: Any) -> bool:
        with self._lock:
            return key in self._held

    def tokens_overdue(self) -> int:
        """Tokens of the holds past upstream's deadline (the ones upstream would have freed)."""
        with self._lock:
            return sum(e.tokens for e in self._held.values() if e.state is HoldState.OVERDUE)

    def over_limit(self, pool_tokens: int, fraction: float | None = None) -> bool:
        """Whether the *overdue* tokens exceed ``fraction`` of a pool of ``pool_tokens``.

        A hold still inside upstream's deadline is the normal drain of an abort (its ACK is
        usually milliseconds away) and does not count: only pages a timeout would have freed,
        and that no evidence released, can stop admission."""
        frac = limit_fraction() if fraction is None else fraction
        return pool_tokens > 0 and self.tokens_overdue() > frac * pool_tokens

    def status(self, pool_tokens: int) -> dict[str, Any]:
        """The quarantine's state (plain data): what the limit refusal, and so ``/health``,
        reports."""
        entries = self.entries()
        now = time.monotonic()
        return {
            "quarantined_transfers": len(entries),
            "quarantined_tokens": sum(e.tokens for e in entries),
            "overdue_tokens": sum(e.tokens for e in entries if e.state is HoldState.OVERDUE),
            "pool_tokens": int(pool_tokens),
            "limit_fraction": limit_fraction(),
            "over_limit": self.over_limit(pool_tokens),
            "overdue": sum(e.state is HoldState.OVERDUE for e in entries),
            "oldest_age_s": round(max((now - e.held_since for e in entries), default=0.0), 3),
            "writers": sorted({e.writer for e in entries if e.writer}),
        }

    def _publish(self) -> None:
        entries = self.entries()
        metrics.set_gauge("quarantined_tokens", float(sum(e.tokens for e in entries)))
        metrics.set_gauge("quarantined_transfers", float(len(entries)))


def of(kv_mgr: Any) -> Quarantine:
    """The quarantine of ``kv_mgr`` (created on first use, under a pdsafe-owned attribute)."""
    return attached(kv_mgr, _REGISTRY_ATTR, Quarantine)


# --------------------------------------------------------------------------- scheduler hooks


def require_deferred_release(upstream_enabled: bool) -> bool:
    """``DecodeTransferQueue.__init__``: the quarantine is built on upstream's deferred release
    (the ABORT/ABORT_ACK drain protocol). With it on, an operator who turned upstream's off
    gets a startup error (decode would free pages at once on failure) instead of silently
    unprotected pages. Returns the value upstream keeps."""
    if upstream_enabled or not enabled():
        if not enabled():
            logger.warning("pdsafe: %s=0: the decode page quarantine is OFF; pages of aborted "
                           "transfers are released after upstream's timeout even if the prefill "
                           "may still write them (a late write then corrupts another request).",
                           ENV_ENABLE)
        return bool(upstream_enabled)
    raise RuntimeError(
        f"pdsafe: {UPSTREAM_DEFERRED_ENV} is off, so this decode would free the pages of an "
        f"aborted transfer at once while the prefill may still write them. Unset it (upstream "
        f"default: on), or turn the quarantine off explicitly with {ENV_ENABLE}=0 (unsafe).")


@guarded("quarantine.hold", FAILED, default=None)
def hold(kv_mgr: Any, key: Any, *, room: int, rid: str, tokens: int, writer: str,
         now: float, deadline: float, writer_since: float | None) -> None:
    """``DecodeTransferQueue._defer_release``: the pages of a failed transfer are held.
    ``writer_since``: the receiver's ``init_time`` (wall clock; None: never sent)."""
    if not enabled():
        return
    of(kv_mgr).hold(key, room=room, rid=rid, tokens=tokens, writer=writer, now=now,
                    deadline=deadline, writer_since=writer_since)


@guarded("quarantine.ready", FAILED, default=False)
def ready(kv_mgr: Any, key: Any, *, drained: bool, now: float, deadline: float) -> bool:
    """``resolve_deferred_releases``: whether the held pages of ``key`` may be freed now.

    Fail closed: a failing check answers False (held; counted in ``quarantine_failed_total``).
    With the quarantine off, upstream's rule applies (drained, or the deadline passed).
    """
    if not enabled():
        return drained or now >= deadline
    q = of(kv_mgr)
    if not q.is_held(key):  # held before the hook could record it: hold it on ACK only
        return bool(drained)
    return q.evidence(key, drained=drained, now=now) is not None


@guarded("quarantine.released", FAILED, default=None)
def released(kv_mgr: Any, key: Any, *, drained: bool, now: float) -> None:
    """The pages of ``key`` were freed (after :func:`ready` answered True)."""
    if not enabled():
        return
    q = of(kv_mgr)
    if not q.is_held(key):
        return
    # ready() answered True on exactly one of these: the drain ACK, else the writer gone.
    q.release(key, Evidence.ACK if drained else Evidence.PEER_GONE, now)


@guarded("quarantine.peer_gone", FAILED, default=None)
def peer_gone(kv_mgr: Any, bootstrap_addr: str) -> None:
    """``CommonKVManager._handle_node_failure``: the prefill at ``bootstrap_addr`` is gone."""
    if enabled():
        of(kv_mgr).peer_gone(bootstrap_addr, time.time())
        logger.warning("pdsafe quarantine: prefill %s declared gone by the heartbeat; pages "
                       "quarantined for its aborted transfers are released.", bootstrap_addr)


def dropped(kv_mgrs: Iterable[Any]) -> None:
    """``release_memory_occupation``: the pool is torn down; the holds end without a free."""
    for kv_mgr in kv_mgrs:
        q = getattr(kv_mgr, _REGISTRY_ATTR, None)
        if q is not None:
            q.drop_all()


#: How every over-limit refusal begins (``/health`` recognises its own refusal by it).
LIMIT_MARKER = "decode KV quarantine over its limit"


def limit_message(status: dict[str, Any]) -> str:
    return (f"{LIMIT_MARKER}: {status['overdue_tokens']} of "
            f"{status['pool_tokens']} KV tokens are held past the release timeout for "
            f"{status['overdue']} aborted transfers whose prefill writers have not confirmed "
            f"that their writes drained (limit {status['limit_fraction']:.0%} of the pool). This "
            f"decode admits no new PD request until they do, instead of reusing pages a late "
            f"write could hit. "
            f"Retry on another decode; operators: check the prefills "
            f"{', '.join(status['writers']) or '(unknown)'} (sglang:pdsafe_quarantined_tokens, "
            f"sglang:pdsafe_quarantine_overdue_total).")


#: What the door answers when its own check failed: fail closed (refused, retryable).
CHECK_FAILED_REFUSAL = Refusal(
    "pdsafe quarantine: this decode could not check its KV quarantine and refused the request "
    "before anything was reserved. Retry; operators: see the server log (ERROR "
    "'quarantine.door') and sglang:pdsafe_quarantine_failed_total.", LIMIT_STATUS)


@guarded("quarantine.door", FAILED, default=CHECK_FAILED_REFUSAL)
def door(queue: Any, *, reentry: bool = False) -> Refusal | None:
    """``DecodePreallocQueue.add``: refuse a new PD request (503) while over the limit, or
    while the KV mismatch breaker is open (:mod:`kv_breaker`: the decode stopped serving).

    Takes the queue (its ``kv_manager`` anchors the quarantine, its
    ``token_to_kv_pool_allocator.size`` is the pool); a queue whose manager never held
    anything (upstream's unit tests build bare queues) is not checked. A retracted or
    re-bootstrapping request (``reentry``) is never refused: it already owns its place. The
    caller aborts the request and tells the prefill.
    """
    if reentry:
        return None
    from sglang.pdsafe import kv_breaker

    stopped = kv_breaker.refusal_message()
    if stopped is not None:  # the KV mismatch breaker is open: this decode stopped serving
        metrics.inc("kv_breaker_refused_total")
        return Refusal(stopped, kv_breaker.STATUS)
    if not enabled():
        return None
    q = getattr(getattr(queue, "kv_manager", None), _REGISTRY_ATTR, None)
    if q is None:
        return None
    pool_tokens = int(queue.token_to_kv_pool_allocator.size)
    if not q.over_limit(pool_tokens):
        return None
    metrics.inc("quarantine_limit_refused_total")
    return Refusal(limit_message(q.status(pool_tokens)), LIMIT_STATUS)


@guarded("quarantine.refused", FAILED, default=None)
def refused(req: Any) -> None:
    """The door refused ``req`` (already aborted by the caller): tell its prefill to drop the
    room now (peer release), so its client gets the same 503 instead of waiting."""
    from sglang.pdsafe import peer_notifier

    peer_notifier.decode_rejected(req)


def health_refusal(errors: Iterable[BaseException]) -> str | None:
    """``/health``: the reason to answer 503 when the health check itself was refused because
    this decode is over its quarantine limit or its KV mismatch breaker is open (the message
    of that refusal), else None."""
    from sglang.pdsafe.kv_breaker import MARKER as BREAKER_MARKER

    for e in errors:
        text = str(getattr(e, "detail", None) or e)
        if LIMIT_MARKER in text or BREAKER_MARKER in text:
            return text
    return None
