"""Decode-page quarantine: pages a remote writer may still touch are never reused.

In PD mode the prefill pushes KV with one-sided writes into pages the decode reserved; the
decode cannot refuse a write when it lands. When a transfer fails or is aborted, upstream
0.5.23 holds the decode pages ("deferred decode KV release") until every prefill rank that may
write them acknowledges the drain (ABORT_ACK), but after
``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT`` (30 s) it releases them anyway,
even when the prefill is still writing: the pages go back to the allocator and the late write
lands in another request's KV (a distributed use-after-free). This module makes the hold a
quarantine that only terminal evidence ends.

**State.** A held transfer is its :class:`~sglang.pdsafe.transfer.Transfer` record in state
HELD (the record's lifecycle: ``REFUSED -> HELD -> RELEASED``), with a :class:`Hold` (the
slot, the tokens, the writer and its incarnation, the deadline, whether it is overdue) and an
entry in the leg's quarantine table (:class:`Quarantine`, by metadata slot). Upstream's
deadline never releases anything: past it the hold is marked overdue (alarm logged once,
``quarantine_overdue_total``) and the pages stay held.

**Evidence** that no writer can touch the pages again (:class:`Evidence`):

* *ACK*: upstream's ``is_abort_release_safe(room, required_acks)``: every prefill rank that was
  sent this room's destinations acknowledged, for the generation of this hold, that its
  transfer worker has nothing queued or in flight for the room.
* *Incarnation*: the writer's process is gone. Every pdsafe prefill process publishes a random
  incarnation id when it registers with its bootstrap server (``pair_agreement``); the decode
  records the incarnation it registered with when it sends a transfer's destinations, and
  only that process ever received them (a process that took over the address later has not
  received this decode's registration, so it cannot write its pages). When the decode sees
  that address registered with *another* incarnation, the old process has exited and can no
  longer post a write. It sees it at its pairing step (a request names the prefill again;
  ``pair_settings``) or through the **incarnation probe** (:mod:`quarantine_probe`): while a
  writer's holds are overdue or the heartbeat declared it gone, a daemon thread asks its
  bootstrap server every ``SGLANG_PDSAFE_QUARANTINE_PROBE_S`` seconds (default 5) which
  incarnation is registered there (:meth:`Quarantine.note_incarnation`), started from
  :func:`ready` at most once a second per KV manager. The newer of the two observations
  counts (an older one never overrides a newer one). An answer with the *same* incarnation
  means the writer is alive: its pages stay held (logged once); no answer is counted
  (``quarantine_probe_failed_total``) and keeps them held. A stock prefill publishes no
  incarnation: its holds end only on an ACK or an operator.
* *Operator*: an operator released the writer's holds explicitly (``POST
  /pdsafe/quarantine/release`` on the decode, :mod:`operator_api`, patch 0028, counted and
  logged; the operator asserts that the writer is gone, e.g. after fencing its host). It
  covers the holds whose destinations went out before the release.

Missed heartbeats are **not** evidence: a partitioned prefill that is alive can still post a
write after its heartbeat stopped. Upstream's heartbeat verdict (``_handle_node_failure``) only
raises an alarm here (``quarantine_peer_gone_alarm_total``) and starts the incarnation probe.

**Backend teardown is no evidence either, and 0.5.23 offers none.** Mooncake (TCP): the decode
is the passive target of the prefill's one-sided writes; its ``TransferEngine`` binding
exposes transfers, notifications and ``send_probe`` (an initiator's reachability check), no
callback or state for a peer's session going away. NIXL/UCX: the decode never adds the prefill
as a remote agent (only the prefill adds the decode's metadata; the decode's control messages
arrive over ZMQ), so it has no NIXL peer whose invalidation it could observe; NIXL's
remote-disconnect handling is on the initiator side. Either way a torn-down connection would
prove no more than a missed heartbeat: the process behind it may still be alive and connect
again. So the backends contribute nothing here; the process incarnation is the proof.

**Quarantine limit.** When the tokens held *past upstream's deadline* (pages upstream would
have freed) exceed ``SGLANG_PDSAFE_QUARANTINE_LIMIT`` (a fraction of the decode's KV pool,
default 0.25; holds inside the deadline are an abort's normal drain and never count), the
decode refuses new PD requests (503, the prefill told at once) and ``/health`` answers 503 with
the reason, instead of serving from an ever smaller pool; it recovers by itself once evidence
releases enough pages.

**Metrics**: ``quarantined_tokens`` and ``quarantined_transfers`` (gauges),
``quarantine_age_seconds`` (histogram, at release), releases by evidence
(``quarantine_released_ack_total``, ``quarantine_released_incarnation_total``,
``quarantine_released_operator_total``), ``quarantine_overdue_total``,
``quarantine_peer_gone_alarm_total`` and ``quarantine_probe_failed_total`` (alarms),
``quarantine_operator_release_total`` (operator calls), ``quarantine_limit_refused_total``,
``quarantine_failed_total`` (a hook failed; the hold is kept).

Failure policy: every hook of this module that can end a hold fails closed by holding (its
failure answers "not ready"); the door refuses (503); a hold that could not be recorded is
still held by upstream's deferred release and released only on its drain ACK.

Upstream variable names keep working: ``deferred_kv_release_timeout`` is now the alarm
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

from sglang.pdsafe import (
    metrics,
    pair_settings,
    peer_notifier,
    policy,
    quarantine_probe,
    transfer,
)
from sglang.pdsafe.kv_breaker import refusal_message as breaker_refusal
from sglang.pdsafe.policy import Outcome, Refusal, hook, refuse_with, returns
from sglang.pdsafe.protections import Protection, off_by, register, switch_on
from sglang.pdsafe.transfer import State, Transfer

logger = logging.getLogger("sglang.pdsafe.quarantine")

ENV_ENABLE = "SGLANG_PDSAFE_QUARANTINE"
ENV_LIMIT = "SGLANG_PDSAFE_QUARANTINE_LIMIT"
UPSTREAM_DEFERRED_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
DEFAULT_LIMIT = 0.25
FAILED = "quarantine_failed_total"
LIMIT_STATUS = 503
TABLE = "quarantine"


@policy.passthrough("quarantine.enabled",
                    why="reads a switch: whether upstream's timeout-release warning applies")
def enabled() -> bool:
    """Default on; ``SGLANG_PDSAFE_QUARANTINE=0`` restores upstream's timeout release."""
    return switch_on(ENV_ENABLE)


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
           "prefill writer acknowledged the drain, its process is proven gone (a new "
           "incarnation registered) or an operator releases them; a timeout or missed "
           "heartbeats only alarm, and admission stops (503, /health says why) past the "
           "quarantine limit",
    roles=frozenset({"decode"}),
    switched_off=off_by(ENV_ENABLE),
))


class Evidence(enum.Enum):
    """What ended a quarantine (the label of the release counters)."""

    ACK = "ack"
    INCARNATION = "incarnation"
    OPERATOR = "operator"
    POOL_GONE = "pool_gone"


_RELEASE_COUNTER = {Evidence.ACK: "quarantine_released_ack_total",
                    Evidence.INCARNATION: "quarantine_released_incarnation_total",
                    Evidence.OPERATOR: "quarantine_released_operator_total",
                    Evidence.POOL_GONE: "quarantine_released_pool_gone_total"}


@dataclass
class Hold:
    """What a held transfer's record keeps about its hold."""

    key: Any  # the metadata slot (unique while held)
    tokens: int
    writer: str  # the prefill's bootstrap address ("" when unknown: only an ACK releases)
    held_since: float  # monotonic
    deadline: float  # monotonic: upstream's release deadline, now only the alarm
    writer_since: float = 0.0  # wall clock: when the writer got this transfer's destinations
    incarnation: str | None = None  # the writer process the destinations went to
    overdue: bool = False
    ready_evidence: Evidence | None = None  # what :func:`ready` saw (released() uses it)


@dataclass
class _Writer:
    """What the decode knows about one prefill writer (bootstrap address)."""

    incarnation: str | None = None  # the incarnation it was registered with at the probe
    incarnation_seen: int = 0  # the observation's order (``pair_settings.observation``)
    gone_at: float | None = None  # wall clock: upstream's heartbeat declared it gone
    released_by_operator: float | None = None  # wall clock of an operator's release


@dataclass
class Quarantine:
    """The held transfers of one decode KV manager (records by slot) and its writers.

    Invariant: ``tokens_held()`` is the sum of the tokens of the records held, every one of
    them in state HELD, and the gauges follow every change.
    """

    _held: dict[Any, Transfer] = field(default_factory=dict)
    _writers: dict[str, _Writer] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    leg: transfer.Leg | None = None

    # -- holding
    def hold(self, key: Any, *, room: int, rid: str, tokens: int, writer: str, now: float,
             deadline: float, writer_since: float | None = None,
             record: Transfer | None = None) -> Transfer:
        """Hold ``key``'s pages: its record moves to HELD. ``now``/``deadline`` are monotonic;
        ``writer_since`` is the wall-clock time the writer got the destinations (default:
        now). A slot is held once (a second hold of it raises)."""
        rec = record if record is not None else Transfer(seq=-1, leg="decode", room=int(room),
                                                         rid=str(rid))
        with self._lock:
            if key in self._held:
                raise transfer.IllegalTransition(
                    f"quarantine slot {key!r} is already held (room {self._held[key].room}); "
                    "a slot is held once")
            known = self._writers.get(str(writer or ""))
            rec.hold = Hold(key=key, tokens=max(int(tokens), 0), writer=str(writer or ""),
                            held_since=now, deadline=deadline,
                            writer_since=time.time() if writer_since is None
                            else float(writer_since),
                            incarnation=rec.writer_incarnation
                            or self._incarnation_now(str(writer or ""), known))
            rec.refuse()
            rec.advance(State.HELD, why="its transfer failed while a writer may still write")
            self._held[key] = rec
        if self.leg is not None:
            self.leg.hold(rec)
        self._publish()
        return rec

    def _incarnation_now(self, writer: str, w: _Writer | None) -> str | None:
        """The incarnation registered at ``writer`` now: the newer of what the decode's
        pairing last fetched (``pair_settings``) and what the probe last saw (an older
        answer never overrides a newer one: a stale incarnation is no evidence)."""
        seen = None
        if self.leg is not None and writer:
            seen = pair_settings.published_seen(self.leg, writer)
        probed = (w.incarnation, w.incarnation_seen) if w is not None and w.incarnation \
            else None
        if seen is None:
            return probed[0] if probed else None
        if probed is not None and probed[1] > seen.seen:
            return probed[0]
        return seen.incarnation

    def _writer(self, writer: str) -> _Writer:
        w = self._writers.get(writer)
        if w is None:
            w = self._writers[writer] = _Writer()
        return w

    def peer_gone(self, writer: str, now: float) -> None:
        """Upstream's heartbeat declared ``writer`` dead at ``now`` (wall clock): an alarm,
        not evidence (a partitioned writer may still write)."""
        with self._lock:
            self._writer(str(writer)).gone_at = now

    def note_incarnation(self, writer: str, incarnation: str | None) -> int:
        """The writer at ``writer`` is registered with ``incarnation`` now (seen at pairing
        or by the probe). Returns how many holds this makes releasable (their destinations
        went to another incarnation: that process has exited)."""
        if not incarnation:
            return 0
        with self._lock:
            w = self._writer(str(writer))
            w.incarnation = str(incarnation)
            w.incarnation_seen = pair_settings.observation()
            return sum(1 for r in self._held.values()
                       if r.hold.writer == writer and r.hold.incarnation
                       and r.hold.incarnation != incarnation)

    def operator_release(self, writer: str | None, now: float) -> int:
        """An operator released the holds of ``writer`` (None: every writer). Returns how
        many holds it covers."""
        with self._lock:
            writers = {r.hold.writer for r in self._held.values()} if writer is None \
                else {str(writer)}
            for w in writers:
                self._writer(w).released_by_operator = now
            return sum(1 for r in self._held.values() if r.hold.writer in writers)

    def evidence(self, key: Any, *, drained: bool, now: float) -> Evidence | None:
        """Terminal evidence for ``key``, or None; marks a hold past its deadline overdue
        (alarm logged once, counted). Never releases anything itself."""
        with self._lock:
            rec = self._held.get(key)
            if rec is None:
                raise KeyError(f"quarantine key {key!r} is not held")
            h = rec.hold
            if drained:
                return Evidence.ACK
            w = self._writers.get(h.writer) if h.writer else None
            now_seen = self._incarnation_now(h.writer, w)
            if h.incarnation and now_seen and now_seen != h.incarnation:
                return Evidence.INCARNATION
            if w is not None and w.released_by_operator is not None \
                    and w.released_by_operator >= h.writer_since:
                return Evidence.OPERATOR
            overdue = not h.overdue and now >= h.deadline
            if overdue:
                h.overdue = True
            gone = w is not None and w.gone_at is not None
        if overdue:
            metrics.inc("quarantine_overdue_total")
            logger.error(
                "pdsafe quarantine: the KV pages of aborted request %s (room %s, %d tokens) "
                "are still held %.1f s after the abort: prefill %s%s has not acknowledged "
                "that its writes drained, and no new incarnation of it registered. They stay "
                "quarantined (upstream would have reused them now, exposing them to a late "
                "write). Operator: check that prefill's health and transfer engine; restarting "
                "it releases the pages once it registers again; if it is fenced off for good, "
                "POST /pdsafe/quarantine/release on this decode.", rec.rid, rec.room,
                h.tokens, now - h.held_since, h.writer or "(unknown)",
                " (declared gone by the heartbeat)" if gone else "")
        return None

    def release(self, key: Any, evidence: Evidence, now: float) -> Transfer:
        """End ``key``'s quarantine on ``evidence`` (its pages may be freed by the caller)."""
        with self._lock:
            rec = self._held.pop(key)
            rec.advance(State.RELEASED, why=f"evidence: {evidence.value}")
        if self.leg is not None:
            self.leg.unhold(rec)
        metrics.inc(_RELEASE_COUNTER[evidence])
        metrics.observe("quarantine_age_seconds", max(0.0, now - rec.hold.held_since))
        if evidence is not Evidence.ACK:
            logger.warning("pdsafe quarantine: released the %d held KV tokens of request %s "
                           "(room %s) on evidence %s from writer %s", rec.hold.tokens,
                           rec.rid, rec.room, evidence.value, rec.hold.writer or "(unknown)")
        self._publish()
        return rec

    def drop_all(self) -> list[Transfer]:
        """The KV pool is torn down (``release_memory_occupation``): no page remains to guard."""
        with self._lock:
            recs = list(self._held.values())
            self._held.clear()
        for rec in recs:
            rec.advance(State.RELEASED, why=f"evidence: {Evidence.POOL_GONE.value}")
            if self.leg is not None:
                self.leg.unhold(rec)
        self._publish()
        return recs

    # -- reading
    def tokens_held(self) -> int:
        with self._lock:
            return sum(r.hold.tokens for r in self._held.values())

    def entries(self) -> list[Transfer]:
        with self._lock:
            return list(self._held.values())

    def is_held(self, key: Any) -> bool:
        with self._lock:
            return key in self._held

    def writers(self) -> dict[str, tuple[str | None, str | None]]:
        """Writer -> (incarnation now, incarnation of its oldest hold), for the probe."""
        with self._lock:
            out: dict[str, tuple[str | None, str | None]] = {}
            for r in self._held.values():
                w = self._writers.get(r.hold.writer)
                out.setdefault(r.hold.writer, (w.incarnation if w else None,
                                               r.hold.incarnation))
            return out

    def needs_probe(self) -> list[str]:
        """Writers with a hold that is overdue or whose writer was declared gone."""
        with self._lock:
            return sorted({r.hold.writer for r in self._held.values() if r.hold.writer
                           and (r.hold.overdue or (self._writers.get(r.hold.writer)
                                                   and self._writers[r.hold.writer].gone_at))})

    def hold_incarnations(self, writer: str) -> set[str]:
        """The incarnations ``writer``'s holds sent their destinations to (known ones only:
        a hold of unknown incarnation is released by no probe answer)."""
        with self._lock:
            return {r.hold.incarnation for r in self._held.values()
                    if r.hold.writer == writer and r.hold.incarnation}

    def tokens_overdue(self) -> int:
        """Tokens of the holds past upstream's deadline (the ones upstream would have freed)."""
        with self._lock:
            return sum(r.hold.tokens for r in self._held.values() if r.hold.overdue)

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
            "quarantined_tokens": sum(r.hold.tokens for r in entries),
            "overdue_tokens": sum(r.hold.tokens for r in entries if r.hold.overdue),
            "pool_tokens": int(pool_tokens),
            "limit_fraction": limit_fraction(),
            "over_limit": self.over_limit(pool_tokens),
            "overdue": sum(r.hold.overdue for r in entries),
            "oldest_age_s": round(max((now - r.hold.held_since for r in entries),
                                      default=0.0), 3),
            "writers": sorted({r.hold.writer for r in entries if r.hold.writer}),
        }

    def _publish(self) -> None:
        entries = self.entries()
        metrics.set_gauge("quarantined_tokens", float(sum(r.hold.tokens for r in entries)))
        metrics.set_gauge("quarantined_transfers", float(len(entries)))


def of(kv_mgr: Any) -> Quarantine:
    """The quarantine of ``kv_mgr`` (its leg's table)."""
    lg = transfer.leg(kv_mgr)
    q = lg.table(TABLE, Quarantine)
    q.leg = lg
    return q


def _if_any(kv_mgr: Any) -> Quarantine | None:
    lg = transfer.leg_if_any(kv_mgr)
    return None if lg is None else lg.tables().get(TABLE)


# --------------------------------------------------------------------------- scheduler hooks


@hook("quarantine.require_deferred_release", outcome=Outcome.POISON, counter=FAILED,
      on_failure=policy.reraise_at_startup, effect="the decode refuses to start")
def require_deferred_release(upstream_enabled: bool) -> bool:
    """``DecodeTransferQueue.__init__``: the quarantine is built on upstream's deferred release
    (the ABORT/ABORT_ACK drain protocol). With it on, an operator who turned upstream's off
    gets a startup error (decode would free pages at once on failure) instead of silently
    unprotected pages. Returns the value upstream keeps."""
    if enabled():
        quarantine_probe.interval()  # a malformed probe interval refuses the start
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


def _slot_key(kv_mgr: Any, key: Any, *_: Any, **__: Any) -> Any:
    return ("slot", id(kv_mgr), key)


@hook("quarantine.hold", outcome=Outcome.HOLD, counter=FAILED, on_failure=returns(None),
      key=_slot_key, effect="upstream's deferred release keeps the pages; only the drain ACK "
                            "frees them (ready() answers ACK-only for a slot not recorded)")
def hold(kv_mgr: Any, key: Any, *, room: int, rid: str, tokens: int, writer: str,
         now: float, deadline: float, writer_since: float | None) -> None:
    """``DecodeTransferQueue._defer_release``: the pages of a failed transfer are held; its
    record (the room's live one, or a new one when it carries none) moves to HELD.
    ``writer_since``: the receiver's ``init_time`` (wall clock; None: never sent)."""
    if not enabled():
        return
    lg = transfer.leg(kv_mgr)
    rec = lg.of_room(room)
    if rec is None or rec.rid != str(rid) or not (rec.is_open or rec.state is State.REFUSED):
        rec = lg.open(None, str(rid))
        rec.room = int(room)
    of(kv_mgr).hold(key, room=room, rid=rid, tokens=tokens, writer=writer, now=now,
                    deadline=deadline, writer_since=writer_since, record=rec)


@hook("quarantine.ready", outcome=Outcome.HOLD, counter=FAILED, on_failure=returns(False),
      key=_slot_key, effect="answers not ready: the pages stay held (counted once per hold)")
def ready(kv_mgr: Any, key: Any, *, drained: bool, now: float, deadline: float) -> bool:
    """``resolve_deferred_releases``: whether the held pages of ``key`` may be freed now.

    Fail closed: a failing check answers False (held; counted once per hold).
    With the quarantine off, upstream's rule applies (drained, or the deadline passed).
    """
    if not enabled():
        return drained or now >= deadline
    q = of(kv_mgr)
    if not q.is_held(key):  # held before the hook could record it: hold it on ACK only
        return bool(drained)
    _read_operator_releases(q)
    probe(q)
    found = q.evidence(key, drained=drained, now=now)
    if found is None:
        return False
    rec = next(r for r in q.entries() if r.hold.key == key)
    rec.hold.ready_evidence = found
    return True


@hook("quarantine.probe", outcome=Outcome.HOLD, counter=FAILED, internal=True,
      on_failure=returns(None),
      key=lambda q: ("probe", id(q)),
      effect="no incarnation probe this pass; the holds stay held until an ACK, an operator "
             "or a later probe's answer (the pass still applies the evidence it has)")
def probe(q: Quarantine) -> None:
    """From :func:`ready`: start the incarnation probes that are due (:mod:`quarantine_probe`:
    at most one pass per second per manager; the requests run on daemon threads). A failure
    never blocks the pass's other evidence (the drain ACK, an operator's release)."""
    if q.leg is not None:
        quarantine_probe.of(q.leg).tick(q)


@hook("quarantine.released", outcome=Outcome.HOLD, counter=FAILED,
      on_failure=returns(None), key=_slot_key,
      effect="the pages were already freed by upstream on evidence; the record stays listed "
             "(gauges high) until the server restarts")
def released(kv_mgr: Any, key: Any, *, drained: bool, now: float) -> None:
    """The pages of ``key`` were freed (after :func:`ready` answered True): the record ends
    RELEASED with the evidence :func:`ready` saw."""
    if not enabled():
        return
    q = _if_any(kv_mgr)
    if q is None or not q.is_held(key):
        return
    rec = next(r for r in q.entries() if r.hold.key == key)
    found = getattr(rec.hold, "ready_evidence", None) or (Evidence.ACK if drained else None)
    if found is None:
        raise RuntimeError(f"quarantine slot {key!r} released without evidence")
    q.release(key, found, now)


@hook("quarantine.peer_gone", outcome=Outcome.HOLD, counter=FAILED, on_failure=returns(None),
      key=lambda kv_mgr, addr: ("writer", addr),
      effect="no alarm for that writer; its holds stay held (the heartbeat is no evidence)")
def peer_gone(kv_mgr: Any, bootstrap_addr: str) -> None:
    """``CommonKVManager._handle_node_failure``: the heartbeat declared the prefill at
    ``bootstrap_addr`` gone. An alarm, not evidence: its quarantined pages stay held until a
    new incarnation of it registers, its drain ACK arrives, or an operator releases them."""
    if not enabled():
        return
    q = of(kv_mgr)
    q.peer_gone(bootstrap_addr, time.time())
    held = sum(1 for r in q.entries() if r.hold.writer == bootstrap_addr)
    metrics.inc("quarantine_peer_gone_alarm_total")
    logger.warning("pdsafe quarantine: prefill %s declared gone by the heartbeat; the pages of "
                   "its %d quarantined transfers stay held until it registers again with a new "
                   "incarnation, acknowledges the drain, or an operator releases them (missed "
                   "heartbeats do not prove that a partitioned writer stopped writing).",
                   bootstrap_addr, held)


@hook("quarantine.note_incarnation", outcome=Outcome.HOLD, counter=FAILED, internal=True,
      on_failure=returns(0), key=lambda kv_mgr, addr, incarnation: ("writer", addr),
      effect="the new incarnation is not taken as evidence; the holds stay held")
def note_incarnation(kv_mgr: Any, bootstrap_addr: str, incarnation: str | None) -> int:
    """Decode pairing (``pair_agreement``) or the probe saw the prefill at ``bootstrap_addr``
    registered with ``incarnation``: holds whose destinations went to another incarnation of
    it become releasable (that process has exited). Returns how many."""
    if not enabled() or not incarnation:
        return 0
    return of(kv_mgr).note_incarnation(bootstrap_addr, incarnation)


def _read_operator_releases(q: Quarantine) -> None:
    """Apply the operator releases the HTTP process wrote into the state directory."""
    for writer, at in operator_requests():
        q.operator_release(writer, at)


def operator_requests() -> list[tuple[str | None, float]]:
    """The operator's release requests of this server (writer or None for all, wall time),
    read from the state directory (written by :func:`request_operator_release`)."""
    d = policy.state_dir()
    if d is None:
        return []
    path = os.path.join(d, OPERATOR_FILE)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return []
    cached = _operator_cache.get(path)
    if cached is not None and cached[0] == st.st_mtime_ns:
        return cached[1]
    out: list[tuple[str | None, float]] = []
    with open(path) as f:
        for line in f:
            parts = line.strip().split("\t")
            if len(parts) == 2:
                out.append((None if parts[0] == "*" else parts[0], float(parts[1])))
    _operator_cache[path] = (st.st_mtime_ns, out)
    return out


OPERATOR_FILE = "quarantine-operator-release.tsv"
_operator_cache: dict[str, tuple[int, list[tuple[str | None, float]]]] = {}


def request_operator_release(writer: str | None, *, who: str) -> dict[str, Any]:
    """HTTP side of ``POST /pdsafe/quarantine/release``: record an operator's release of the
    holds of ``writer`` (None: every writer) for the decode schedulers (state directory).
    Counted and logged. Raises ``RuntimeError`` when this server has no state directory."""
    d = policy.state_dir()
    if d is None:
        raise RuntimeError("this server has no pdsafe state directory (not a PD server "
                           "started through sglang's launcher)")
    now = time.time()
    with open(os.path.join(d, OPERATOR_FILE), "a") as f:
        f.write(f"{writer or '*'}\t{now}\n")
    metrics.inc("quarantine_operator_release_total")
    logger.warning("pdsafe quarantine: operator %s released the quarantined pages of %s; the "
                   "operator asserts that writer can no longer post a write (counted in "
                   "sglang:pdsafe_quarantine_operator_release_total).", who,
                   writer or "every writer")
    return {"released_writer": writer or "*", "at": now}


@hook("quarantine.dropped", outcome=Outcome.HOLD, counter=FAILED, on_failure=returns(None),
      effect="the records stay listed; the pool itself is gone (nothing to free)")
def dropped(kv_mgrs: Iterable[Any]) -> None:
    """``release_memory_occupation``: the pool is torn down; the holds end without a free."""
    for kv_mgr in kv_mgrs:
        q = _if_any(kv_mgr)
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


@hook("quarantine.door", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=refuse_with(503, "the request (this decode could not check its KV "
                                  "quarantine)"),
      key=lambda queue, **_: None, effect="503 at the decode queue door; the prefill told")
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
    stopped = breaker_refusal()
    if stopped is not None:  # the KV mismatch breaker is open: this decode stopped serving
        metrics.inc("kv_breaker_refused_total")
        return Refusal(503, stopped, "kv_breaker_refused_total")
    if not enabled():
        return None
    q = _if_any(getattr(queue, "kv_manager", None))
    if q is None:
        return None
    pool_tokens = int(queue.token_to_kv_pool_allocator.size)
    if not q.over_limit(pool_tokens):
        return None
    metrics.inc("quarantine_limit_refused_total")
    return Refusal(LIMIT_STATUS, limit_message(q.status(pool_tokens)),
                   "quarantine_limit_refused_total")


@hook("quarantine.refused", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=returns(None), key=lambda req: ("room", getattr(req, "bootstrap_room", None)),
      effect="the request stays refused; its prefill is not told and frees at its own timeout")
def refused(req: Any) -> None:
    """The door refused ``req`` (already aborted by the caller): tell its prefill to drop the
    room now (peer release), so its client gets the same 503 instead of waiting."""
    peer_notifier.decode_rejected(req)


policy.health_marker(LIMIT_MARKER)


@hook("quarantine.health_refusal", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=lambda failure: failure.refusal(503, "the health check").reason,
      effect="/health answers 503 with the failure (unhealthy, never healthy unchecked)")
def health_refusal(errors: Iterable[BaseException]) -> str | None:
    """``/health``: the reason to answer 503 (this server is poisoned, or its health check
    was refused by the quarantine limit, the KV mismatch breaker or a check that could not
    run), else None."""
    return policy.health_reason(tuple(errors))
