"""The failure policy (``sglang.pdsafe.policy``): one refusal type, declared outcomes, counted
once per request, the poison threshold, the poison shared through the state directory.

No servers: hooks declared here on stand-ins, and the product's own hook table. What the real
hooks do on real servers when they fail is ``test/pd/test_hook_failures.py``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from types import SimpleNamespace

import pytest
from sglang.pdsafe import hook_api, metrics, policy, startup
from sglang.pdsafe.policy import Outcome, Refusal, hook, refuse_with, returns

FAILED = "room_guard_failed_total"
_names = itertools.count()


def _name() -> str:
    """A fresh hook name per declaration (names are unique in the table)."""
    return f"test_policy.hook_{next(_names)}"


def _drop(name: str) -> None:
    policy.HOOKS.pop(name, None)


@pytest.fixture(autouse=True)
def _all_modules_imported():
    import importlib

    for m in startup.HOOK_MODULES:
        importlib.import_module(m)


def test_every_hook_declares_an_outcome_a_counter_and_an_effect():
    assert len(policy.HOOKS) >= 60
    for spec in policy.table():
        assert isinstance(spec.outcome, Outcome), spec.name
        assert spec.counter in metrics.COUNTERS, spec.name
        assert len(spec.effect) > 15, spec.name
        assert spec.function.startswith("sglang.pdsafe."), spec.name
        assert not spec.function.endswith("upstream"), spec.name


def test_a_failure_answers_with_the_declared_outcome_and_counts_once_per_key(caplog):
    name = _name()

    @hook(name, outcome=Outcome.REFUSE, counter=FAILED, on_failure=refuse_with(503),
          key=lambda room: ("room", room), effect="503 for the request in hand")
    def door(room: int) -> Refusal | None:
        raise RuntimeError(f"broken for {room}")

    try:
        before = metrics.value(FAILED)
        with caplog.at_level(logging.ERROR, logger="sglang.pdsafe.policy"):
            first = door(1)
        assert isinstance(first, Refusal) and first.status == 503 and first.counter == FAILED
        assert name in first.reason and "RuntimeError" in first.reason
        assert "could not run" in first.reason and "Retry" in first.reason
        for _ in range(50):  # the scheduler loop calls it again every pass
            door(1)
        assert metrics.value(FAILED) == before + 1, "counted on every iteration"
        door(2)
        assert metrics.value(FAILED) == before + 2, "another request is another failure"
        errors = [r for r in caplog.records if name in r.getMessage()]
        assert len(errors) == 1 and errors[0].exc_info is not None
        assert "REFUSE" in errors[0].getMessage()
    finally:
        _drop(name)


def test_an_upstream_shape_change_is_counted_as_a_mismatch_not_a_failure():
    name = _name()

    @hook(name, outcome=Outcome.HOLD, counter=FAILED, on_failure=returns(False),
          effect="the pages stay held")
    def ready() -> bool:
        raise AttributeError("'CommonKVManager' object has no attribute 'pdsafe_x'")

    try:
        m0, f0 = metrics.value(hook_api.MISMATCH_COUNTER), metrics.value(FAILED)
        assert ready() is False
        assert metrics.value(hook_api.MISMATCH_COUNTER) == m0 + 1
        assert metrics.value(FAILED) == f0
    finally:
        _drop(name)


def test_answers_and_upstreams_own_exceptions_pass_through_unchanged():
    name, name2 = _name(), _name()

    @hook(name, outcome=Outcome.REFUSE, counter=FAILED, on_failure=returns(None),
          effect="503 at the HTTP layer")
    def check(n: int) -> None:
        raise policy.RefusedError(f"n={n} is refused", status=400)

    @hook(name2, outcome=Outcome.HOLD, counter=FAILED, on_failure=returns(None),
          effect="held")
    def release(fn) -> None:
        try:
            fn()
        except Exception as e:
            raise policy.UpstreamRaised(e) from e

    try:
        before = metrics.value(FAILED)
        with pytest.raises(policy.RefusedError, match="n=3 is refused") as ei:
            check(3)
        assert ei.value.status_code == 400
        with pytest.raises(KeyError, match="upstream"):
            release(lambda: {}["upstream"])
        assert metrics.value(FAILED) == before, "a decision or upstream's error is no failure"
    finally:
        _drop(name)
        _drop(name2)


def test_a_startup_hook_refuses_the_start_with_its_own_exception():
    name = _name()

    @hook(name, outcome=Outcome.POISON, counter="startup_failed_total",
          on_failure=policy.reraise_at_startup, effect="the server refuses to start")
    def starting() -> None:
        raise ValueError("SGLANG_X='bad': expected a number")

    try:
        with pytest.raises(ValueError, match="expected a number"):
            starting()
        assert policy.poisoned() is not None, "a POISON hook that failed poisons"
    finally:
        _drop(name)


def test_the_threshold_poisons_after_distinct_failures(monkeypatch):
    monkeypatch.setenv(policy.ENV_POISON_AFTER, "3")
    name = _name()

    @hook(name, outcome=Outcome.REFUSE, counter=FAILED, on_failure=returns(None),
          key=lambda k: k, effect="refused")
    def check(k: int) -> None:
        raise RuntimeError("x")

    try:
        check(1)
        check(1)
        check(2)
        assert policy.poisoned() is None, "two distinct failures are below a threshold of 3"
        before = metrics.value(policy.POISONED_COUNTER)
        check(3)
        p = policy.poisoned()
        assert p is not None and "3 pdsafe hook failures" in p.reason and name in p.reason
        assert metrics.value(policy.POISONED_COUNTER) == before + 1
        refusal = policy.poison_refusal()
        assert refusal.status == 503 and policy.POISON_MARKER in refusal.reason
        assert "restart" in refusal.reason
    finally:
        _drop(name)


def test_a_failing_outcome_poisons_instead_of_raising():
    name = _name()

    def broken(failure):
        raise RuntimeError("the outcome itself failed")

    @hook(name, outcome=Outcome.HOLD, counter=FAILED, on_failure=broken, effect="held")
    def ready() -> bool:
        raise RuntimeError("x")

    try:
        assert ready() is None
        assert "failure outcome" in policy.poisoned().reason
    finally:
        _drop(name)


@pytest.mark.parametrize("raw", ["0", "-1", "many"])
def test_a_bad_threshold_is_a_startup_error(monkeypatch, raw):
    monkeypatch.setenv(policy.ENV_POISON_AFTER, raw)
    with pytest.raises(ValueError, match=policy.ENV_POISON_AFTER):
        policy.poison_after()


def test_the_poison_reaches_the_servers_other_processes_through_the_state_dir(
        tmp_path, monkeypatch):
    """A scheduler process poisons itself; the HTTP process (another process, here simulated
    by forgetting this process's own poison) reads it from the state directory, and /health
    reports it."""
    monkeypatch.setenv(policy.ENV_STATE_DIR, str(tmp_path))
    policy.poison("the room_guard.claim hook failed", by="room_guard.claim")
    data = json.loads((tmp_path / "poison.json").read_text())
    assert data["by"] == "room_guard.claim" and data["pid"] == os.getpid()
    policy.reset_for_tests()  # now "another process": no poison of its own
    seen = policy.poisoned()
    assert seen is not None and seen.by == "room_guard.claim"
    assert policy.POISON_MARKER in policy.health_reason()


def test_an_unreadable_poison_record_fails_closed(tmp_path, monkeypatch):
    monkeypatch.setenv(policy.ENV_STATE_DIR, str(tmp_path))
    (tmp_path / "poison.json").write_text("{not json")
    assert "unreadable" in policy.poisoned().reason


def test_health_reason_recognises_the_registered_refusals():
    from sglang.pdsafe import kv_breaker, quarantine

    assert policy.health_reason() is None
    for marker in (quarantine.LIMIT_MARKER, kv_breaker.MARKER):
        assert policy.health_reason([RuntimeError(f"{marker}: details")]).startswith(marker)
    assert policy.health_reason([RuntimeError("some other error")]) is None


def test_a_health_probe_refused_by_a_failed_check_is_unhealthy_at_once():
    """/health's own probe refused because a check could not run: 503 with that refusal now,
    not after upstream's 20 s health timeout (found by the hook-failure suite)."""
    name = _name()

    @hook(name, outcome=Outcome.REFUSE, counter=FAILED, on_failure=policy.raise_refusal,
          effect="503 for the request in hand")
    def door() -> None:
        raise RuntimeError("broken")

    try:
        with pytest.raises(policy.RefusedError) as info:
            door()
        reason = policy.health_reason([info.value])
        assert reason is not None and name in reason and "could not run" in reason
        assert policy.health_reason([RuntimeError("the detokenizer is slow")]) is None
    finally:
        _drop(name)


def test_a_hook_name_is_declared_once_and_needs_a_declared_counter():
    with pytest.raises(ValueError, match="declared twice"):
        hook("room_guard.claim", outcome=Outcome.REFUSE, counter=FAILED,
             on_failure=returns(None), effect="x")
    with pytest.raises(KeyError):
        hook(_name(), outcome=Outcome.REFUSE, counter="no_such_counter_total",
             on_failure=returns(None), effect="x")


def test_base_exceptions_are_never_swallowed():
    name = _name()

    @hook(name, outcome=Outcome.REFUSE, counter=FAILED, on_failure=returns(None), effect="x")
    def interrupted() -> None:
        raise KeyboardInterrupt

    try:
        with pytest.raises(KeyboardInterrupt):
            interrupted()
    finally:
        _drop(name)


def test_the_spec_keeps_the_body_the_guard_calls_through():
    """The testkit's fault plugin wraps ``spec.body``; the guard must call through it."""
    name = _name()

    @hook(name, outcome=Outcome.REFUSE, counter=FAILED, on_failure=returns("refused"),
          effect="x")
    def check(x: int) -> str:
        return f"ok {x}"

    spec = policy.HOOKS[name]
    try:
        assert check(1) == "ok 1" and spec.calls == 1
        original = spec.body

        def raising(*a, **k):
            raise RuntimeError("injected")

        spec.body = raising
        assert check(2) == "refused"
        spec.body = original
        assert check(3) == "ok 3"
    finally:
        _drop(name)


def test_refused_error_carries_one_refusal():
    r = Refusal(409, "room in use", "room_duplicate_refused_total")
    e = policy.RefusedError.of(r)
    assert isinstance(e, ValueError) and e.status_code == 409 and e.refusal == r
    assert policy.CheckFailedError.of(Refusal(503, "x", FAILED)).error_type == "server_error"
    assert SimpleNamespace(status=r.status, message=r.message) == SimpleNamespace(
        status=409, message="room in use")


def test_the_cost_table_charges_outermost_calls_once_and_exports_them():
    """With timing on, every call of a hook is timed, nested (internal) hooks are charged
    to their caller only, and the totals reach the exported counters; off, nothing is."""
    inner_name, outer_name = _name(), _name()

    @hook(inner_name, outcome=Outcome.REFUSE, counter=FAILED, on_failure=returns(None),
          effect="stand-in inner hook", internal=True)
    def inner_hook(x: int) -> int:
        return x + 1

    @hook(outer_name, outcome=Outcome.REFUSE, counter=FAILED, on_failure=returns(None),
          effect="stand-in outer hook")
    def outer_hook(x: int) -> int:
        return inner_hook(x) + inner_hook(x)

    try:
        policy.reset_cost()
        outer_hook(1)
        assert policy.hook_cost()["*"] == (0, 0)  # timing off: nothing charged
        policy.measure_cost(True)
        before_calls = metrics.value("hook_calls_total")
        assert [outer_hook(i) for i in range(3)] == [2, 4, 6]
        table = policy.hook_cost()
        assert table[outer_name][0] == 4 and table[inner_name][0] == 8
        assert table["*"][0] == 3  # the inner calls ran inside the outer ones
        assert table["*"][1] >= table[outer_name][1] * 3 // 4 > 0
        assert table[outer_name][1] >= table[inner_name][1]
        policy.flush_cost()
        assert metrics.value("hook_calls_total") - before_calls == 3
        assert metrics.value("hook_seconds_total") > 0
    finally:
        policy.measure_cost(False)
        policy.reset_cost()
        _drop(inner_name)
        _drop(outer_name)


def test_the_cost_table_excludes_upstream_work_and_counts_hooks_inside_it_once():
    """A hook that runs upstream code (a release) through ``policy.run_upstream`` is charged
    its own time only; a pdsafe hook that the upstream code calls in turn (a free's stamp) is
    charged to that hook and is not an outermost call of its own (issue 22: hook seconds
    would otherwise count upstream's release, and the stamp twice)."""
    import time

    stamp_name, release_name = _name(), _name()

    @hook(stamp_name, outcome=Outcome.REFUSE, counter=FAILED, on_failure=returns(None),
          effect="stand-in stamp hook")
    def stamp() -> None:
        time.sleep(0.02)

    def upstream_release() -> None:
        time.sleep(0.2)  # upstream's own work
        stamp()

    @hook(release_name, outcome=Outcome.REFUSE, counter=FAILED, on_failure=returns(None),
          effect="stand-in release hook")
    def release() -> None:
        policy.run_upstream(upstream_release)

    try:
        policy.reset_cost()
        policy.measure_cost(True)
        release()
        table = policy.hook_cost()
        outer = policy.hook_cost_outermost()
        assert table[stamp_name][0] == 1 and table[stamp_name][1] >= 20_000_000
        # the release's charge: its stamp, not upstream's 0.2 s
        assert 20_000_000 <= table[release_name][1] < 150_000_000
        # the stamp ran inside the release: not an outermost call of its own
        assert outer[release_name] == (1, table[release_name][1]) and stamp_name not in outer
        # "*" counts the outermost calls only (of every thread: background threads of other
        # tests' KV managers, such as an unclaimed-room sweep, may run hooks meanwhile)
        calls, ns = table["*"]
        assert calls >= 1 and ns >= table[release_name][1]
        policy.measure_cost(False)
        assert policy.run_upstream(lambda x: x + 1, 1) == 2  # off: just the call
    finally:
        policy.measure_cost(False)
        policy.reset_cost()
        _drop(stamp_name)
        _drop(release_name)
