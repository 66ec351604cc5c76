"""Unit-test isolation: the failure policy's process state (counted failures, poison) and the
KV mismatch breaker are per process; every test starts without them. A prefill KV manager that
a test leaves with decode metadata nobody claimed would drop it one
``SGLANG_PDSAFE_UNCLAIMED_ROOM_TIMEOUT_S`` later from its sweeper thread, in the middle of a
later test (hooks run, counters move): unless a test sets that timeout itself
(test/unit/test_unclaimed_rooms.py does), it is an hour here."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sglang.pdsafe import kv_breaker, policy, unclaimed_rooms


@pytest.fixture(autouse=True)
def _fresh_failure_policy(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(policy.ENV_STATE_DIR, raising=False)
    monkeypatch.setenv(unclaimed_rooms.ENV_TIMEOUT, "3600")
    policy.reset_for_tests()
    yield
    policy.reset_for_tests()
    kv_breaker.reset_for_tests()
