"""The benchmark's late-write and crash scenarios without servers: registry, stack, judging.

The scenarios themselves need the ``late_write`` stack (real servers; measured in
docs/benchmark.md, the mechanics proven by test/pd/test_late_write.py). These tests pin what can
go wrong without a server: the two late-write scenarios really differ (one hold past upstream's
release timeout, one within it), only the prefills of the harness stack are armed with the
test-only fault and deployment mode never imports it, a testkit answer is judged like any other
(a hang stays a hang, a victim's tokens in a canary's answer are a leak naming the victim), and
a prefill the crash scenario killed on purpose is not reported as a crash.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
from pdsafe_testkit import late_write as lw
from pdsafe_testkit.faults import ENV as FAULT_ENV
from pdsafe_testkit.faults import parse_late_write
from pdsafe_testkit.servers import GenResult, ManagedProcess, ServerConfig, SGLangServer

from benchmark import regression
from benchmark.canary import CanaryBook
from benchmark.evidence import Counters, Reservations
from benchmark.outcomes import Outcome
from benchmark.scenarios import (
    FULL_ONLY,
    SCENARIOS,
    Ctx,
    Knobs,
    Reference,
    Scenario,
    _answered_job,
    _late_answer,
    answer_of,
    applicable,
)
from benchmark.targets import LATE_HOLDS_S, STACK_KINDS, PDTarget

REPO = Path(__file__).resolve().parents[2]
NAMES = ("late-write-past-release-timeout", "late-write-past-abort", "crash-prefill-mid-transfer")


def test_registered_harness_only_and_full_matrix_only() -> None:
    for name in NAMES:
        s = SCENARIOS[name]
        assert s.implemented and s.harness_ok and s.stack == "late_write", name
        assert not s.deployment_ok, name  # a server-side fault
        assert not applicable(s, deployment=True)[0], name
        assert applicable(s, deployment=False) == (True, ""), name
        assert applicable(s, deployment=False, quick=True) == (False, FULL_ONLY), name
    assert SCENARIOS["late-write-past-release-timeout"].known_unsafe_upstream
    # Stock is expected safe in the control and after a SIGKILL (no writer left).
    assert not SCENARIOS["late-write-past-abort"].known_unsafe_upstream
    assert not SCENARIOS["crash-prefill-mid-transfer"].known_unsafe_upstream
    order = [n for n in SCENARIOS if SCENARIOS[n].stack == "late_write"]
    assert order[-1] == "crash-prefill-mid-transfer"  # it kills a prefill: last on its stack


def test_the_two_late_write_scenarios_differ_in_the_hold() -> None:
    """past-release-timeout's victim prefill holds past upstream's (shortened) timeout, the
    CI test's 6 s; past-abort's within it (so stock's drain ACK comes first)."""
    assert LATE_HOLDS_S["held"] == lw.SECONDS_LATE > lw.RELEASE_TIMEOUT_S
    assert 0 < LATE_HOLDS_S["other"] < lw.RELEASE_TIMEOUT_S
    k = STACK_KINDS["late_write"]
    assert k.late_write_trio and not k.router
    assert (k.prefill_pool, k.decode_pool) == (lw.PREFILL_POOL, lw.POOL)
    assert k.context_length("prefill") == k.context_length("decode") == lw.POOL


def test_only_the_prefills_are_armed() -> None:
    held, other, decode = lw.stack_configs("mooncake", Path("m"), {"PYTHONPATH": "base"},
                                           held_s=LATE_HOLDS_S["held"],
                                           other_s=LATE_HOLDS_S["other"], page_size=16)
    assert [c.role for c in (held, other, decode)] == ["prefill", "prefill", "decode"]
    assert parse_late_write(held.env[FAULT_ENV]) == LATE_HOLDS_S["held"]
    assert parse_late_write(other.env[FAULT_ENV]) == LATE_HOLDS_S["other"]
    assert FAULT_ENV not in decode.env
    assert decode.env[lw.RELEASE_ENV] == "2"
    assert lw.HEARTBEAT_ENV.items() <= decode.env.items()
    assert "--skip-server-warmup" in decode.extra_args
    assert all(c.env["PYTHONPATH"] == "base" and c.page_size == 16
               for c in (held, other, decode))
    # The CI test's stack: both prefills hold 6 s.
    a, b, _ = lw.stack_configs("mooncake", Path("m"), {})
    assert a.env[FAULT_ENV] == b.env[FAULT_ENV] == "late_write:6"


def test_deployment_mode_never_imports_the_fault_plugin() -> None:
    code = ("import sys, benchmark.regression, benchmark.scenarios, benchmark.targets\n"
            "bad = [m for m in ('pdsafe_testkit.late_write', 'pdsafe_testkit.faults') "
            "if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_testkit_answers_are_judged_like_any_other() -> None:
    hang = answer_of(GenResult(0, [], {"error": {"message": "no answer within 20s"}},
                               timed_out=True))
    assert hang.timed_out and hang.status is None
    from benchmark.outcomes import classify

    assert classify(hang, [1])[0] is Outcome.HANG
    gone = answer_of(GenResult(0, [], {"error": {"message": "client gave up: reset"}}))
    assert classify(gone, [1])[0] is Outcome.BROKEN
    refused = answer_of(GenResult(503, [], {"error": {"message": "quarantine over its limit"}}))
    assert classify(refused, [1])[0] is Outcome.EXPLICIT_ERROR
    aborted = answer_of(GenResult(200, [], {"meta_info": {"finish_reason": {
        "type": "abort", "message": "Aborted by AbortReq."}}}))
    assert classify(aborted, [1])[0] is Outcome.EXPLICIT_ERROR
    ok = answer_of(GenResult(200, [5, 6], {"output_ids": [5, 6], "meta_info": {}}), 1.5)
    assert classify(ok, [5, 6])[0] is Outcome.IDENTICAL and ok.e2e_s == 1.5
    assert classify(ok, [5, 7])[0] is Outcome.LEAK
    # A victim's answer counts from the abort/kill: later than the bound is a hang.
    late = _late_answer(GenResult(500, [], {"error": {"message": "lost"}}), 25.0, 20.0, "v")
    assert late.timed_out
    assert _late_answer(GenResult(500, [], {"error": {"message": "lost"}}), 2.6, 20.0,
                        "v").status == 500
    assert _late_answer(None, None, 20.0, "v").status is None


def _server(role: str, port: int) -> SGLangServer:
    proc = ManagedProcess(f"{role}-{port}", [], {}, Path(f"/nonexistent/{role}.log"))
    return SGLangServer(ServerConfig(role=role), port, proc, 1 if role == "prefill" else None)


def _target() -> PDTarget:
    trio = lw.Trio("mooncake", _server("prefill", 1), _server("prefill", 2),
                   _server("decode", 3), held_s=6.0, other_s=1.0)
    return PDTarget("fork", "mooncake", 1, "late_write", trio.other.url, trio.decode.url, None,
                    "127.0.0.1", 1, {}, CanaryBook(512), trio.pair(trio.other), trio=trio)


def test_a_victims_tokens_in_the_canary_are_a_leak_naming_it(monkeypatch) -> None:
    import benchmark.scenarios as sc

    t = _target()
    assert set(t.urls()) == {"prefill-held", "prefill-other", "decode"}
    monkeypatch.setattr(sc, "read_counters", lambda p, d: Counters(1, 1, complete=True))
    ref = Reference("http://ref")
    ctx = Ctx(t, ref, Knobs.for_mode(True, evidence_wait_s=0.0), random.Random(0))
    v_owner, v_ids = ctx.canary("late-victim", 64)
    b_owner, b_ids = ctx.canary("canary-B", 32)
    want = b_ids[-16:] * 2
    ref._cache[(tuple(b_ids), 32)] = want
    ref._cache[(tuple(v_ids), 8)] = v_ids[-8:]
    leaked = v_ids[-32:]  # B decoded over V's KV: V's tokens
    jobs = [_answered_job("late-victim", "pd-direct", v_ids, 8, v_owner,
                          answer_of(GenResult(500, [], {"error": {"message": "aborted"}}))),
            _answered_job("canary-B-try0", "pd-direct", b_ids, 32, b_owner,
                          answer_of(GenResult(503, [], {"error": {"message": "quarantine"}}))),
            _answered_job("canary-B-try1", "pd-direct", b_ids, 32, b_owner,
                          answer_of(GenResult(200, leaked, {"output_ids": leaked,
                                                            "meta_info": {}})))]
    recs = ctx.judge_phase("late-write", jobs, before=Counters(), wall_s=1.0,
                           prefill_urls=[t.prefill_url])
    assert [r.outcome for r in recs] == [Outcome.EXPLICIT_ERROR, Outcome.EXPLICIT_ERROR,
                                         Outcome.LEAK]
    assert recs[2].leaked_from == ["late-victim"], recs[2].attribution
    assert ctx.phases[0]["sent"] == 3 and len(ctx.records) == 3


def test_a_prefill_killed_on_purpose_is_not_a_crash(monkeypatch) -> None:
    t = _target()

    def kill(ctx: Ctx) -> None:
        ctx.target.killed.add("prefill-held")

    monkeypatch.setattr(PDTarget, "down", lambda self: ["prefill-held"])
    seen: dict[str, object] = {}

    def fake_reservations(prefills, decode, page, *, settle_s):
        seen["prefills"] = prefills
        return Reservations(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, settled=True)

    monkeypatch.setattr(regression, "reservations_after", fake_reservations)
    s = Scenario("crash-prefill-mid-transfer", "crash", "late_write", kill)
    cell = regression.run_scenario(s, t, Reference("http://ref"), Knobs.for_mode(True),
                                   regression.Progress(1, False))
    assert cell.status == "ran" and cell.servers_down == []
    assert any("killed by the scenario on purpose" in n for n in cell.notes)
    assert seen["prefills"] == [t.trio.other.url]  # the dead prefill is not read
    assert not t.healthy()  # so the slot restarts the stack before any later scenario
    # Another role down is still a crash.
    monkeypatch.setattr(PDTarget, "down", lambda self: ["prefill-held", "decode"])
    cell = regression.run_scenario(s, t, Reference("http://ref"), Knobs.for_mode(True),
                                   regression.Progress(1, False))
    assert cell.servers_down == ["decode"]


@pytest.mark.parametrize("name", NAMES)
def test_docstrings_say_what_is_proven_and_not(name: str) -> None:
    doc = SCENARIOS[name].doc.lower()
    assert "leak" in doc and ("does not" in doc or "not known unsafe" in doc), name
