"""Fixtures for the model-free KV transfer tests: one process pair per backend per session.

Each pair hosts one lane per page size in ``PAGE_SIZES`` (see ``pdsafe_testkit.kv.KVPair``).
The pairs of all backends the session needs are launched together at the first use, so their
(slow, CPU-bound) imports overlap; each test then waits only for its own backend.

Invariants: every pair is closed at session end and its children are verified gone; a pair
that failed to start fails the tests of its backend only, with both children's log tails.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from pdsafe_testkit.backends import BACKENDS
from pdsafe_testkit.kv import HarnessError, KVLane, KVPair
from pdsafe_testkit.kv.pair import launched

PAGE_SIZES: tuple[int, ...] = (1, 16, 64)
NUM_PAGES = 64

_MEASUREMENTS: list[str] = []


def _needed_backends(session: pytest.Session) -> list[str]:
    needed = {
        item.callspec.params["backend"]
        for item in session.items
        if hasattr(item, "callspec") and "backend" in item.callspec.params
    }
    return [b for b in BACKENDS if b in needed]


@pytest.fixture(scope="package")  # torn down after test/kv: its children poll busily
def kv_pairs(request: pytest.FixtureRequest) -> Iterator[dict[str, KVPair]]:
    """Launched (not yet ready) pairs, one per backend the session's tests use."""
    pairs = {backend: KVPair(backend, page_size=PAGE_SIZES, num_pages=NUM_PAGES, seed=1234)
             for backend in _needed_backends(request.session)}
    with launched(pairs):
        yield pairs


@pytest.fixture
def kv_pair(kv_pairs: dict[str, KVPair], backend: str) -> KVPair:
    """The ready pair of ``backend`` (a test parameter)."""
    pair = kv_pairs[backend]
    try:
        pair.wait_ready()
    except HarnessError as e:
        pytest.fail(f"{backend} KV pair unusable: {e}\n{pair.logs()}", pytrace=False)
    if pair.startup_s is not None and not any(
        m.startswith(f"{backend} startup") for m in _MEASUREMENTS
    ):
        init = pair.child_init
        _MEASUREMENTS.append(
            f"{backend} startup {pair.startup_s:.1f}s (import prefill "
            f"{init['prefill']['import_s']:.1f}s / decode {init['decode']['import_s']:.1f}s, "
            f"lanes prefill {_fmt_lanes(init['prefill']['lane_s'])} / decode "
            f"{_fmt_lanes(init['decode']['lane_s'])}, warm-up transfers "
            f"{', '.join(f'{r.wall_s * 1e3:.0f}ms' for r in pair.warmup_results)})"
        )
    return pair


def _fmt_lanes(lane_s: dict[int, float]) -> str:
    return ",".join(f"ps{ps}={s:.1f}s" for ps, s in lane_s.items())


@pytest.fixture
def kv_lane(kv_pair: KVPair, page_size: int) -> KVLane:
    """The ``page_size`` lane (a test parameter) of the ready pair of ``backend``."""
    return kv_pair.lane(page_size)


@pytest.fixture
def kv_measure() -> Callable[[str], None]:
    """Record one line for the terminal summary (timings the report quotes)."""
    return _MEASUREMENTS.append


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _MEASUREMENTS:
        terminalreporter.section("KV harness measurements")
        for line in _MEASUREMENTS:
            terminalreporter.write_line(line)
