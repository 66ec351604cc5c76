"""One warning per interval for a refusal class that a client can repeat at will (every one is
still counted in its Prometheus counter; only the log line is limited).

Invariant: :meth:`LogLimit.admit` returns the number of calls suppressed since the last
admitted one (0 or more) at most once per ``interval_s``, and None for every other call.
"""

from __future__ import annotations

import threading
import time


class LogLimit:
    """A thread-safe log-rate limiter (one per refusal class)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last = float("-inf")
        self._suppressed = 0

    def admit(self) -> int | None:
        """None: do not log now (counted as suppressed); else log, saying how many were."""
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.interval_s:
                self._suppressed += 1
                return None
            suppressed, self._suppressed, self._last = self._suppressed, 0, now
            return suppressed
