"""Unit-test isolation: the failure policy's process state (counted failures, poison) and the
KV mismatch breaker are per process; every test starts without them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sglang.pdsafe import kv_breaker, policy


@pytest.fixture(autouse=True)
def _fresh_failure_policy(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(policy.ENV_STATE_DIR, raising=False)
    policy.reset_for_tests()
    yield
    policy.reset_for_tests()
    kv_breaker.reset_for_tests()
