"""The test-only ``hook_fail`` and ``free_reserved`` faults and the suite's hook table, without
servers (``pdsafe_testkit.hook_fail``, ``pdsafe_testkit.faults``, ``pdsafe_testkit.hook_suite``).

What the faults do on real servers, for every hook: ``test/pd/test_hook_failures.py``. Here:
the shim is transparent unarmed and fails an armed hook through its real guard (entry: the body
never runs; mid: it ran), the control file arms, resets and swaps legacy outcomes, the status
file says what happened, the allocator audit sees a page freed twice or both free and held, and
the suite's source scan finds exactly the hooks the product declares.
"""

from __future__ import annotations

import importlib
import itertools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pdsafe_testkit import faults, hook_fail, hook_suite
from pdsafe_testkit.hook_fail import Control, HookFail, InjectedHookFailure
from sglang.pdsafe import metrics, policy, startup, transfer

COUNTER = "room_guard_failed_total"
_names = itertools.count()


@pytest.fixture(autouse=True)
def _modules() -> None:
    for m in startup.HOOK_MODULES:
        importlib.import_module(m)


@pytest.fixture
def probe() -> Any:
    """A hook of our own (a stand-in): records its calls, refuses with 503 when it fails."""
    name = f"test_hook_fail.probe_{next(_names)}"
    calls: list[int] = []

    @policy.hook(name, outcome=policy.Outcome.REFUSE, counter=COUNTER,
                 on_failure=policy.refuse_with(503), key=lambda x: ("x", x),
                 effect="503 for the request in hand")
    def fn(x: int) -> str:
        calls.append(x)
        return f"served {x}"

    yield SimpleNamespace(name=name, fn=fn, calls=calls)
    policy.HOOKS.pop(name, None)
    policy.reset_for_tests()


@pytest.fixture
def fault(tmp_path: Path) -> Any:
    hf = HookFail(tmp_path / "control.json", "unit")
    yield hf
    hf.uninstall()
    policy.reset_for_tests()


def _arm(hf: HookFail, seq: int, **kw: Any) -> None:
    Control(seq=seq, **kw).write(hf.control_path)
    hf.poll()


def test_unarmed_the_hook_is_untouched_and_armed_it_fails_through_its_own_guard(probe, fault):
    fault.install([probe.name], poller=False)
    assert probe.fn(1) == "served 1" and probe.calls == [1]

    before = metrics.value(COUNTER)
    _arm(fault, 1, armed={probe.name: "entry"})
    out = probe.fn(2)
    assert isinstance(out, policy.Refusal) and out.status == 503
    assert f"the {probe.name} check could not run" in out.reason
    assert "InjectedHookFailure" in out.reason
    assert probe.calls == [1], "entry: the body must not run"
    assert metrics.value(COUNTER) == before + 1

    _arm(fault, 2, armed={probe.name: "mid"}, reset=1)
    out = probe.fn(3)
    assert isinstance(out, policy.Refusal)
    assert probe.calls == [1, 3], "mid: the body ran, then the hook failed"
    assert fault.injected == {probe.name: 2}

    _arm(fault, 3)
    assert probe.fn(4) == "served 4"


def test_another_hook_never_fails(probe, fault):
    other = next(iter(policy.HOOKS))
    fault.install([probe.name, other], poller=False)
    _arm(fault, 1, armed={other: "entry"})
    assert probe.fn(5) == "served 5"
    assert probe.name not in fault.injected


def test_a_body_that_answers_by_raising_is_not_an_injection(fault):
    name = f"test_hook_fail.answers_{next(_names)}"

    @policy.hook(name, outcome=policy.Outcome.REFUSE, counter=COUNTER,
                 on_failure=policy.raise_refusal, effect="503 at the HTTP layer")
    def door() -> None:
        raise policy.RefusedError("no", status=409)

    try:
        fault.install([name], poller=False)
        _arm(fault, 1, armed={name: "mid"})
        with pytest.raises(policy.RefusedError) as e:
            door()
        assert e.value.status_code == 409 and fault.injected == {}
    finally:
        policy.HOOKS.pop(name, None)


def test_the_injected_failure_is_not_an_upstream_mismatch():
    from sglang.pdsafe.hook_api import is_mismatch

    assert not is_mismatch(InjectedHookFailure("x"))


def test_control_round_trip_and_refusals():
    c = Control(seq=3, armed={"room_guard.door": "mid"}, legacy=("room_guard.claim",),
                reset=2, audit=5)
    assert Control.from_json(c.to_json()) == c
    with pytest.raises(ValueError, match="unknown modes"):
        Control.from_json(json.dumps({"armed": {"room_guard.door": "later"}}))
    with pytest.raises(ValueError, match="no legacy outcome"):
        Control.from_json(json.dumps({"legacy": ["quarantine.hold"]}))


def test_legacy_outcomes_are_swapped_in_and_back(fault):
    assert set(hook_fail.LEGACY) <= set(policy.HOOKS)
    fault.install(list(hook_fail.LEGACY), poller=False)
    claim = policy.HOOKS["room_guard.claim"]
    original = claim.on_failure
    _arm(fault, 1, legacy=("room_guard.claim",))
    assert claim.on_failure is hook_fail.LEGACY["room_guard.claim"]
    assert claim.on_failure(SimpleNamespace()) is None  # the old guard: build it unclaimed
    released = []
    fail = SimpleNamespace(args=(object(), lambda: released.append(1)))
    hook_fail.LEGACY["page_generation.release_request"](fail)
    assert released == [1]  # the old release: upstream's, with every page
    _arm(fault, 2)
    assert claim.on_failure is original


def test_a_reset_forgets_the_poison_and_the_status_says_what_happened(probe, fault):
    fault.install([probe.name], poller=False)
    _arm(fault, 1, armed={probe.name: "entry"})
    probe.fn(1)
    policy.poison("a unit test", by=probe.name)
    fault.write_status(force=True)
    (status,) = hook_fail.read_statuses(fault.control_path)
    assert status["seq"] == 1 and status["tag"] == "unit"
    assert status["injected"] == {probe.name: 1} and status["calls"][probe.name] >= 1
    assert status["poisoned"] == "a unit test"
    assert status["hooks"][probe.name] == ["refuse", COUNTER]
    _arm(fault, 2, reset=1)
    assert policy.poisoned() is None


def test_the_source_scan_finds_every_declared_hook_with_its_outcome():
    found = {h.name: h for h in hook_suite.catalog()}
    declared = {n: s for n, s in policy.HOOKS.items() if s.module.startswith("sglang.pdsafe")}
    assert set(found) == set(declared)
    for name, spec in declared.items():
        h = found[name]
        assert (h.outcome, h.counter) == (spec.outcome.value, spec.counter), name
        assert h.startup == (spec.on_failure is policy.reraise_at_startup), name


# =========================================================================== the audit


def _scheduler(size: int = 64) -> Any:
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(size=size, page_size=1, dtype=torch.float32, head_num=1,
                            head_dim=4, layer_num=1, device="cpu", enable_memory_saver=False,
                            enable_alt_stream=False)
    alloc = TokenToKVPoolAllocator(size, torch.float32, "cpu", pool, need_sort=True)
    rtt = torch.zeros((4, 32), dtype=torch.int32)
    checker = SimpleNamespace(_requests_owning_rows=lambda: [],
                              _check_all_pools=lambda ps, uncached=0: (False, ["(stand-in)"]))
    return SimpleNamespace(token_to_kv_pool_allocator=alloc,
                           req_to_token_pool=SimpleNamespace(req_to_token=rtt),
                           tree_cache=SimpleNamespace(), invariant_checker=checker,
                           pool_stats_observer=SimpleNamespace(get_pool_stats=lambda: None))


@pytest.fixture
def no_held_rows() -> Any:
    """An empty held-row table for an audit of a stand-in scheduler (rows other tests left
    held belong to their own pools), restored afterwards."""
    saved = transfer.held_items()
    for key, _ in saved:
        transfer.drop_row(key)
    yield
    for key, h in saved:
        transfer.hold_row(h.row, h.pages, key=key)


def _row(sched: Any, idx: int, n: int) -> Any:
    slots = sched.token_to_kv_pool_allocator.alloc(n)
    sched.req_to_token_pool.req_to_token[idx, :n] = slots.int()
    return SimpleNamespace(req_pool_idx=idx, cache_protected_len=0, kv_allocated_len=n,
                           holds_kv=True), slots


def test_a_clean_allocator_passes_the_audit(no_held_rows):
    sched = _scheduler()
    kv, _ = _row(sched, 1, 8)
    key = transfer.hold_row(kv)
    try:
        result = hook_fail.audit(sched)
    finally:
        transfer.drop_row(key)
    assert result["ok"], result
    assert result["rows"]["held"] == 1 and result["owned_pages"] == 8


def test_the_audit_sees_a_page_freed_twice_and_one_both_free_and_held(no_held_rows):
    sched = _scheduler()
    kv, slots = _row(sched, 1, 8)
    alloc = sched.token_to_kv_pool_allocator
    alloc.free(slots[2:3])  # freed under the row (what free_reserved does) ...
    key = transfer.hold_row(kv)  # ... and the row held with it
    try:
        held = hook_fail.audit(sched)
        alloc.free(slots[2:3])  # ... and freed a second time (the old release)
        twice = hook_fail.audit(sched)
    finally:
        transfer.drop_row(key)
    assert not held["ok"] and "1 pages both free and in use" in held["problems"][0]
    assert not twice["ok"]
    assert any("1 pages freed twice" in p for p in twice["problems"]), twice


# =========================================================================== free_reserved


def test_free_reserved_frees_the_second_page_of_a_fault_request_once():
    sched = _scheduler()
    kv, slots = _row(sched, 2, 6)
    fr = faults.FreeReserved()
    queue = SimpleNamespace(scheduler=sched)

    def dreq(rid: str) -> Any:
        return SimpleNamespace(req=SimpleNamespace(rid=rid, kv=kv))

    before = sched.token_to_kv_pool_allocator.available_size()
    fr.before_commit_check(queue, dreq("normal-request"))
    assert sched.token_to_kv_pool_allocator.available_size() == before
    rid = faults.FREE_RESERVED_PREFIX + "x"
    fr.before_commit_check(queue, dreq(rid))
    fr.before_commit_check(queue, dreq(rid))  # once per rid
    assert sched.token_to_kv_pool_allocator.available_size() == before + 1
    free = set(sched.token_to_kv_pool_allocator.get_all_free_pages().tolist())
    assert int(slots[1]) in free and int(slots[0]) not in free


def test_the_fault_names_are_known():
    assert faults.parse_spec("hook_fail,free_reserved") == {"hook_fail": "", "free_reserved": ""}
