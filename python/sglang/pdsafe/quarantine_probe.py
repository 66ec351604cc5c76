"""The quarantine's incarnation probe: which process is registered at a held writer's address.

A decode learns a prefill's process incarnation (``pair_settings.INCARNATION``, published at
registration) only when its pairing step fetches that prefill's settings, that is when a new
request names the prefill. A prefill that crashed is named by no request: upstream's heartbeat
drops it from ``prefill_info_table`` and the router stops sending it traffic, so a restarted
prefill would never be seen and the pages its old process may have written stay quarantined
until an operator acts. The probe closes that gap.

**What it does.** Each pass (:func:`tick`, called by ``quarantine.ready`` on the scheduler
thread, at most every :data:`PASS_EVERY_S` per decode KV manager; it only reads a clock and
starts threads) takes the writers :meth:`Quarantine.needs_probe` lists (a hold past upstream's
deadline, or a writer the heartbeat declared gone) whose holds know the incarnation their
destinations went to, and for each one not probed within ``SGLANG_PDSAFE_QUARANTINE_PROBE_S``
seconds (default 5) starts a daemon thread that GETs the writer's bootstrap server
``/route?...&pdsafe_pair=1`` (the query the pairing uses, :func:`pair_settings.route_url`;
timeout :data:`TIMEOUT_S`) and records the incarnation published there
(:meth:`Quarantine.note_incarnation`). The next ``ready`` pass releases the holds whose
destinations went to another incarnation (evidence ``INCARNATION``: that process has exited).

**Answers.**

* a new incarnation: the process the destinations went to is gone; its holds are released at
  the next pass (logged);
* the same incarnation: the writer is alive; its pages stay held until its drain ACK or an
  operator releases them (logged once per writer and incarnation);
* a 200 without an incarnation (a stock prefill, or a fork prefill of a release before
  incarnations): no evidence (logged once);
* no answer (connection refused, timeout, 503 while a restarted prefill registers, garbage):
  counted in ``quarantine_probe_failed_total``, the holds stay held, asked again after the
  interval (the first failure of a streak logged).

Invariants: the probe never releases anything itself, it records an observation that
``Quarantine.evidence`` reads (an older observation never overrides a newer one); it never
runs a request on the scheduler thread; at most one probe is in flight per writer, at most
:data:`MAX_WRITERS` writers are tracked per decode KV manager, and the state of a writer that
no longer needs a probe is dropped at the next pass.

A writer whose holds know no incarnation (a stock prefill publishes none) is not probed: no
answer could release its holds; only its drain ACK or an operator does.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import requests
from sglang.pdsafe import metrics, pair_settings

logger = logging.getLogger("sglang.pdsafe.quarantine")

ENV_PROBE_S = "SGLANG_PDSAFE_QUARANTINE_PROBE_S"
DEFAULT_PROBE_S = 5.0
#: Bounds of ``SGLANG_PDSAFE_QUARANTINE_PROBE_S`` (seconds).
MIN_PROBE_S, MAX_PROBE_S = 0.1, 3600.0
#: (connect, read) timeout of one probe, seconds.
TIMEOUT_S = (1.0, 2.0)
#: A pass looks for due writers at most this often (seconds, per decode KV manager).
PASS_EVERY_S = 1.0
#: Writers tracked per decode KV manager (sorted by address; the rest wait their turn).
MAX_WRITERS = 256
FAILED = "quarantine_probe_failed_total"
TABLE = "quarantine_probe"


def interval() -> float:
    """Seconds between two probes of one writer; a malformed value raises ``ValueError``
    naming the variable (checked when the decode starts: ``quarantine.
    require_deferred_release``)."""
    raw = os.environ.get(ENV_PROBE_S, "").strip()
    if not raw:
        return DEFAULT_PROBE_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and MIN_PROBE_S <= value <= MAX_PROBE_S):
        raise ValueError(f"{ENV_PROBE_S}={raw!r}: give the seconds between two probes of a "
                         f"quarantined writer's bootstrap server, in [{MIN_PROBE_S:g}, "
                         f"{MAX_PROBE_S:g}] (default {DEFAULT_PROBE_S:g})")
    return value


class Probed(Protocol):
    """What the probe needs of a quarantine (``quarantine.Quarantine``)."""

    def needs_probe(self) -> list[str]: ...

    def hold_incarnations(self, writer: str) -> set[str]: ...

    def note_incarnation(self, writer: str, incarnation: str | None) -> int: ...


@dataclass(frozen=True)
class Answer:
    """What one probe saw: ``incarnation`` (None: none published), or ``failure`` (no
    answer: why)."""

    incarnation: str | None = None
    failure: str | None = None


def fetch(writer: str, timeout: tuple[float, float] = TIMEOUT_S) -> Answer:
    """Ask the bootstrap server at ``writer`` (``host:port``) which incarnation is registered
    there. Never raises for what the network or the server does."""
    try:
        r = requests.get(pair_settings.route_url(writer), timeout=timeout)
    except requests.RequestException as e:
        return Answer(failure=f"{type(e).__name__}: {str(e)[:200]}")
    if r.status_code != 200:
        return Answer(failure=f"HTTP {r.status_code}: {r.text[:200]}")
    try:
        body = r.json()
    except ValueError:
        return Answer(failure=f"HTTP 200 without JSON: {r.text[:200]}")
    pair = body.get("pdsafe_pair") if isinstance(body, dict) else None
    inc = pair.get("incarnation") if isinstance(pair, dict) else None
    return Answer(incarnation=inc if isinstance(inc, str) and inc else None)


@dataclass
class _Writer:
    """The probe's state of one writer (dropped once it needs no probe)."""

    next_at: float = 0.0  # monotonic
    in_flight: bool = False
    failing: bool = False  # the last probe got no answer (a streak is logged once)
    logged: set[str] = field(default_factory=set)  # what was logged once


class Prober:
    """The probe of one decode KV manager's quarantine (a table of its leg)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.writers: dict[str, _Writer] = {}
        self.last_pass = -math.inf
        self.started = 0  # probes started (tests read it)

    def tick(self, q: Probed, *, now: float | None = None) -> list[str]:
        """One pass: start a probe thread for every due writer. Returns the writers probed.
        Cheap: returns at once when the last pass was less than :data:`PASS_EVERY_S` ago."""
        now = time.monotonic() if now is None else now
        with self.lock:
            if now - self.last_pass < PASS_EVERY_S:
                return []
            self.last_pass = now
        wanted = [w for w in q.needs_probe() if q.hold_incarnations(w)][:MAX_WRITERS]
        every = interval()
        due: list[str] = []
        with self.lock:
            for gone in set(self.writers) - set(wanted):
                if not self.writers[gone].in_flight:
                    del self.writers[gone]
            for w in wanted:
                st = self.writers.setdefault(w, _Writer())
                if st.in_flight or now < st.next_at:
                    continue
                st.in_flight, st.next_at = True, now + every
                due.append(w)
            self.started += len(due)
        for w in due:
            threading.Thread(target=self._probe, args=(q, w), daemon=True,
                             name="pdsafe-quarantine-probe").start()
        return due

    def _probe(self, q: Probed, writer: str) -> None:
        """Probe thread: fetch, record, log; never raises (a failure of pdsafe's own code is
        counted in ``quarantine_failed_total``, the holds stay held)."""
        try:
            self._record(q, writer, fetch(writer))
        except Exception as e:  # noqa: BLE001 - a daemon thread: count and keep holding
            metrics.inc("quarantine_failed_total")
            if self._once(writer, f"error:{type(e).__name__}"):
                logger.error("pdsafe quarantine: the incarnation probe of prefill %s failed "
                             "(%s: %s); its quarantined pages stay held", writer,
                             type(e).__name__, e, exc_info=True)
        finally:
            with self.lock:
                st = self.writers.get(writer)
                if st is not None:
                    st.in_flight = False

    def _record(self, q: Probed, writer: str, answer: Answer) -> None:
        if answer.failure is not None:
            metrics.inc(FAILED)
            with self.lock:
                st = self.writers.get(writer)
                first = st is not None and not st.failing
                if st is not None:
                    st.failing = True
            if first:
                logger.warning("pdsafe quarantine: prefill %s does not answer the incarnation "
                               "probe (%s); its quarantined pages stay held until it registers "
                               "again with a new incarnation, acknowledges the drain, or an "
                               "operator releases them (asked again every %g s; %s%s counts "
                               "the misses).", writer, answer.failure, interval(),
                               metrics.PREFIX, FAILED)
            return
        with self.lock:
            st = self.writers.get(writer)
            if st is not None:
                st.failing = False
        held = q.hold_incarnations(writer)
        if answer.incarnation is None:
            if self._once(writer, "none"):
                logger.warning("pdsafe quarantine: prefill %s answers the probe without a "
                               "process incarnation; its quarantined pages stay held until "
                               "its drain ACK or an operator releases them.", writer)
            return
        releasable = q.note_incarnation(writer, answer.incarnation)
        if releasable:
            logger.warning("pdsafe quarantine: prefill %s is registered with a new process "
                           "incarnation %s (the quarantined destinations went to %s): that "
                           "process has exited; %d holds are released at the next pass.",
                           writer, answer.incarnation, ", ".join(sorted(held)), releasable)
        elif answer.incarnation in held and self._once(writer, f"alive:{answer.incarnation}"):
            logger.warning("pdsafe quarantine: prefill %s answers the probe with the same "
                           "process incarnation %s: it is alive and may still write; its "
                           "quarantined pages stay held until its drain ACK or an operator "
                           "releases them.", writer, answer.incarnation)

    def _once(self, writer: str, what: str) -> bool:
        """True the first time ``what`` is logged for ``writer`` (while it is tracked)."""
        with self.lock:
            st = self.writers.get(writer)
            if st is None or what in st.logged:
                return False
            st.logged.add(what)
            return True


def of(leg: Any) -> Prober:
    """The prober of a decode KV manager's leg."""
    return leg.table(TABLE, Prober)
