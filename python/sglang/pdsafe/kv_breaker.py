"""Stop serving after repeated KV digest mismatches: a breaker for suspected hardware faults.

A single KV digest mismatch fails one request (HTTP 500, :mod:`sglang.pdsafe.kv_integrity`).
Repeated mismatches on one decode point at its memory, its NIC or its transfer path, and every
later transfer through it is suspect; an operator may prefer that such a server stops serving
(the router and the orchestrator then take it out) over failing requests one by one while it
keeps taking traffic. This module is that option, **off unless configured**::

    SGLANG_PDSAFE_KV_MISMATCH_BREAKER=N/SECONDS     e.g. 3/600

States and transitions (per decode scheduler process)::

    CLOSED --N mismatches within SECONDS--> OPEN      (logged CRITICAL, counted once)
    OPEN   --(none: only a restart closes it)

While OPEN, the decode's admission door (``quarantine.door``, the hook in
``DecodePreallocQueue.add``) refuses every new PD request with 503 and the reason, its
prefill is told at once (peer release), and ``/health`` answers 503 with the same reason
(``quarantine.health_refusal``). Requests already admitted finish; their KV was checked.

What counts: a transfer the decode refused because the KV bytes it holds differ from what
prefill digested (``kv_digest_mismatch_total``'s class), after the TP ranks agreed on the
refused set (``kv_integrity.agreed``), so every rank counts the same mismatches and opens at
the same step (a rank-local count could refuse a request on one rank only and hang the
next collective). A missing digest, another layout or a failed digest is a configuration or
software problem, not counted here (each has its own counter and alert).

Invariant: once OPEN, this process admits no new PD request until it is restarted.
What it does not do: it does not diagnose the fault, and it does not drain or restart the
server itself.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass

from sglang.pdsafe import metrics, policy

logger = logging.getLogger("sglang.pdsafe.kv_breaker")

ENV = "SGLANG_PDSAFE_KV_MISMATCH_BREAKER"
#: The 503 reason's first words; ``quarantine.health_refusal`` looks for them.
MARKER = "decode stopped serving after repeated KV digest mismatches"
STATUS = 503
policy.health_marker(MARKER)


@dataclass(frozen=True)
class Setting:
    """``N/SECONDS``: open after ``count`` mismatches within ``window_s`` seconds."""

    count: int
    window_s: float


def parse(value: str | None) -> Setting | None:
    """The breaker setting in ``value`` (None: off). A malformed value raises ``ValueError``
    naming the variable (a server asked to fail closed must not start without it)."""
    text = (value or "").strip().lower()
    if text in ("", "0", "off", "none"):
        return None
    n, sep, s = text.partition("/")
    try:
        count, window = int(n), float(s)
    except ValueError:
        raise ValueError(f"{ENV}={value!r}: expected N/SECONDS, e.g. 3/600") from None
    if not sep or count < 1 or not window > 0:
        raise ValueError(f"{ENV}={value!r}: expected N/SECONDS with N >= 1 and SECONDS > 0")
    return Setting(count, window)


class Breaker:
    """Mismatch times within the window, and whether the breaker is open."""

    def __init__(self, setting: Setting) -> None:
        self.setting = setting
        self.times: deque[float] = deque()
        self.opened_at: float | None = None
        self.lock = threading.Lock()

    def note(self, mismatches: int, now: float) -> bool:
        """Record ``mismatches`` at ``now``; True when this call opened the breaker."""
        with self.lock:
            if self.opened_at is not None or mismatches <= 0:
                return False
            self.times.extend([now] * mismatches)
            while self.times and now - self.times[0] > self.setting.window_s:
                self.times.popleft()
            if len(self.times) < self.setting.count:
                return False
            self.opened_at = now
            return True

    def message(self) -> str:
        s = self.setting
        return (f"{MARKER}: {s.count} or more transfers in {s.window_s:g} s held KV that "
                f"differed from what prefill digested ({ENV}={s.count}/{s.window_s:g}). A "
                "hardware or transport fault is suspected, so this decode admits no new "
                "request until it is restarted. Retry on another decode; operators: check "
                "this host's GPU memory, NIC and transfer path (decode log: 'KV integrity "
                "check failed'; sglang:pdsafe_kv_digest_mismatch_total), then restart it.")


_breaker: Breaker | None = None
_loaded = False
_load_lock = threading.Lock()


def breaker() -> Breaker | None:
    """This process's breaker (None: off), built from the environment on first use."""
    global _breaker, _loaded
    if not _loaded:
        with _load_lock:
            if not _loaded:
                setting = parse(os.environ.get(ENV))
                _breaker = Breaker(setting) if setting else None
                _loaded = True
    return _breaker


def reset_for_tests() -> None:
    """Forget the breaker so that the next use re-reads the environment (tests only)."""
    global _breaker, _loaded
    with _load_lock:
        _breaker, _loaded = None, False


def note_mismatches(count: int, now: float | None = None) -> None:
    """Count ``count`` agreed digest mismatches; open the breaker at its threshold."""
    b = breaker()
    if b is None or count <= 0:
        return
    if b.note(count, time.monotonic() if now is None else now):
        metrics.inc("kv_breaker_opened_total")
        logger.critical("sglang-pdsafe: %s", b.message())


def refusal_message() -> str | None:
    """The 503 reason while the breaker is open, else None."""
    b = breaker()
    if b is None or b.opened_at is None:
        return None
    return b.message()
