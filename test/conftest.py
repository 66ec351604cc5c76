"""Shared fixtures: one co-located reference server and one PD stack per backend per session.

Servers are slow to start on 2 cores (~30 s), so they are session-scoped and shared; a test
that needs special server flags starts its own stack through ``pdsafe_testkit.servers`` (the
test-only harness distribution in test/testkit, installed editable by the test profile).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from pdsafe_testkit.backends import BACKENDS
from pdsafe_testkit.oracle import Oracle
from pdsafe_testkit.servers import (
    DEFAULT_MODEL,
    SHARED_DECODE_POOL,
    SHARED_PREFILL_POOL,
    PDStack,
    ServerConfig,
    colocated_server,
    new_log_dir,
    pd_stack,
)

MODEL = DEFAULT_MODEL  # PDSAFE_MODEL overrides it (pdsafe_testkit.servers)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    """A SIGTERM (``timeout``, a CI runner's cancel) stops the run like Ctrl-C does, so the
    fixtures' finalizers stop every server they started instead of leaving them running."""
    signal.signal(signal.SIGTERM, _interrupt)


@pytest.fixture(scope="session")
def model_path() -> Path:
    assert (MODEL / "config.json").is_file(), f"tiny model missing at {MODEL}"
    return MODEL


@pytest.fixture(scope="session")
def log_dir() -> Path:
    return new_log_dir()


@pytest.fixture(scope="session")
def reference(log_dir: Path, model_path: Path) -> Iterator:
    with colocated_server(log_dir, ServerConfig(role="colocated", model_path=model_path,
                                                max_total_tokens=8192)) as s:
        yield s


@pytest.fixture(scope="session")
def oracle(reference) -> Oracle:
    return Oracle(reference.url)



@pytest.fixture(scope="session", params=BACKENDS)
def pd(request: pytest.FixtureRequest, log_dir: Path, model_path: Path) -> Iterator[PDStack]:
    """A shared PD pair + router per backend (small pools, page size 1), default configuration:
    the context length is the pool's size (the operator's remedy for a small pool). These
    run under upstream's own ``spawn`` start method, as in production; other test servers
    start their subprocesses from a forkserver (``pdsafe_testkit.launch``)."""
    backend = request.param
    with pd_stack(
        backend, log_dir,
        prefill=ServerConfig(role="prefill", model_path=model_path,
                             max_total_tokens=SHARED_PREFILL_POOL,
                             context_length=SHARED_PREFILL_POOL,
                             # Only acts on bootstrap rooms of its reserved range (the
                             # transfer generation's end-to-end test).
                             env={"SGLANG_PDSAFE_TEST_FAULTS": "stale_status",
                                  # Metadata no request claims is dropped after 10 s
                                  # (test/pd/test_unclaimed_rooms.py; the default).
                                  "SGLANG_PDSAFE_UNCLAIMED_ROOM_TIMEOUT_S": "10"},
                             upstream_spawn=True),
        decode=ServerConfig(role="decode", model_path=model_path,
                            max_total_tokens=SHARED_DECODE_POOL,
                            context_length=SHARED_DECODE_POOL,
                            # Only acts on rids with the fault prefixes (the oracle's
                            # self-test, the KV digest's end-to-end corruption tests).
                            env={"SGLANG_PDSAFE_TEST_FAULTS": "foreign_kv:16,kv_corrupt"},
                            upstream_spawn=True),
    ) as stack:
        yield stack


# Tests written against a contributor's own patch tree and not yet run against the integrated
# series are listed here and marked `pending_validation`; scripts/run-tests.sh deselects that
# marker unless PDSAFE_ALL_TESTS=1, so CI stays an honest record of what has been verified
# together. None now: test/pd/test_incident_walk.py (issue 22 item 2) was validated on
# 2026-12-06 (its steps 2 and 3 had failed on two mistakes of the test, see its history).
PENDING_VALIDATION: set[str] = set()
PENDING_VALIDATION_TESTS: set[str] = set()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(__file__).resolve().parent.parent
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(root).as_posix()
        if rel in PENDING_VALIDATION or item.originalname in PENDING_VALIDATION_TESTS:
            item.add_marker(pytest.mark.pending_validation)
