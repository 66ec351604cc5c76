"""Late writes: an aborted request's KV write lands in pages a later request owns (issue 9).

Upstream's deferred decode KV release (``decode.py`` ``DecodeTransferQueue._defer_release`` /
``resolve_deferred_releases``) holds an aborted request's decode pages until every prefill rank
sent ABORT_ACK (the prefill transfer worker sends it only once the room's in-flight write
drained), but frees them anyway after ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``
(30 s; 2 s here). A write still in flight then lands in freed pages: a distributed
use-after-free. This test makes one happen and judges the request that owns the pages by then.

The mechanics (the stack, the choreography below, the crash) live in ``pdsafe_testkit.late_write``,
shared with the regression benchmark (``late-write-*``, ``crash-prefill-mid-transfer``); this
file picks the prompts, rooms and seeds and asserts on what those functions observe.

Setup, per variant (a fresh stack each, no other traffic): one decode server (release timeout
2 s, KV pool = context = ``POOL`` tokens, page size 1, ``--skip-server-warmup`` so that the first
request gets the first pages), prefill ``held`` whose transfer worker holds every KV write of
the late room range ``SECONDS_LATE`` seconds (test-only fault ``late_write``,
``pdsafe_testkit.faults``; the hold sits after the worker's "room failed/aborted" check, so it
is a write already under way), and a second prefill ``other`` (same fault, which only logs where
the writes of traced rooms go). Prefills run one chunk per prompt. Mooncake over loopback by
default; ``PDSAFE_LATE_WRITE_BACKENDS=mooncake,nixl`` also runs NIXL (same scenario; left out
of the default run for CI time only).

1. Victim V (``V_LEN``-token prompt, a late room) goes to ``held`` and the decode directly. Once
   ``held`` logs that it holds V's write, V is aborted on the decode (``POST /abort_request``:
   the scheduler's ``abort_request`` finds V in ``disagg_decode_transfer_queue`` and calls
   ``kv_receiver.abort()``, which marks the room Failed and sends ABORT to the prefill; the next
   ``pop_transferred`` turns the Failed poll into a deferred release).
2. ``LEAD_S`` before the held write lands (well after the 2 s timeout), canary B (``B_LEN``-token
   prompt, greedy, ``B_NEW`` tokens, ``ignore_eos``; a traced room) goes to ``other`` and the
   decode. In PD mode the decode allocator puts freed pages aside and merges them back (sorted)
   only once its never-used free list cannot serve an allocation; the sizes make that happen
   for B (``POOL - V_LEN < B_LEN``), so B gets the lowest pages, V's, and V's pages cover every
   position B will ever hold (``B_LEN + B_NEW + 16 <= V_LEN``): wherever B is when the late
   write lands, the 16 positions the tiny model copies from are V's. A decode that refuses B
   with an explicit error (the fork while V's pages are quarantined) is retried, as a client
   told to retry would, for up to ``B_RETRY_S``.
3. The held write lands (in the base variant, while B decodes). B's answer is judged against the
   co-located reference.

Checked from the logs, in both variants (the scenario happened as designed, or the test says
which step did not): the write really went out after the abort (V's room Failed or already
cleared on the prefill when it wrote), where V's and B's destination pages are (the fault logs
each write's decode pages), and the order of B's transfer, the late write and B's end.

* ``base`` (stock: upstream 0.5.23 + CPU patches 0001-0003): must show the bug. The decode logs
  "timed out ... releasing anyway", B is served at once, B's prompt pages overlap V's, the late
  write lands after B's transfer and before B ends, and B's answer differs from the reference
  with V's prompt tokens in it (a run of ``EVIDENCE_RUN`` consecutive tokens of V's prompt): the
  late write put V's KV under B.
* ``fork`` (the installed package): B must be served, reference-identical (explicit refusals
  before that are allowed and recorded).

The crash scenarios (same fork stack, after the late write; ``run_crash``): the prefill
``held`` is SIGKILLed while it holds V2's write. V2's decode client must get an explicit error
at once; V2's pages must stay quarantined through a hold window (the heartbeat declared the
prefill gone: an alarm only; the decode's incarnation probe gets no answer: counted) and be
released only by evidence that the writer cannot write: ``held`` started again on the same
ports (a new process incarnation the probe sees), or, in the second scenario, where ``held``
stays dead, the operator's ``POST /pdsafe/quarantine/release`` naming it. Canary B2 through
``other`` must then be reference-identical.

What this does not prove: prefill-side source pages freed early, the aux/metadata slot the late
write's ``send_aux`` also hits, the staging ring, late writes after a prefill crash, or a
quarantine below the fork's admission limit (V here holds 85% of the pool, so the fork refuses
B until V's pages are released instead of serving B from other pages). A fork pass proves that
this one late write did not reach B; it does not prove every late write is fenced.

Why two prefills: Mooncake and NIXL prefills shard chunks to worker queues by the decode's
session ports, so every request from one prefill to one decode shares one worker thread; B's
chunk would wait behind V's held write and then overwrite V's late KV itself. A second prefill
(an ordinary N-prefill deployment) sends B's KV while V's write is still held.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from pdsafe_testkit.backends import BACKENDS, ci_backends
from pdsafe_testkit.late_write import (
    B_LEN,
    CRASH_BOUND_S,
    INCARNATION_METRIC,
    OPERATOR_METRIC,
    V_LEN,
    CrashObservation,
    Evidence,
    Observation,
    Trio,
    design_problems,
    late_write_stack,
    operator_release,
    random_rooms,
    restart_prefill,
    run_crash,
    run_late_write,
    writer_address,
)
from pdsafe_testkit.oracle import Oracle, random_prompt

pytestmark = pytest.mark.server

#: Backends the scenario runs on: Mooncake by default (CI time); ``PDSAFE_LATE_WRITE_BACKENDS=
#: mooncake,nixl`` adds NIXL (see the module docstring).
LATE_WRITE_BACKENDS: tuple[str, ...] = (
    tuple(b for b in os.environ["PDSAFE_LATE_WRITE_BACKENDS"].split(",") if b in BACKENDS)
    if os.environ.get("PDSAFE_LATE_WRITE_BACKENDS") else ci_backends())
#: Consecutive tokens of V's prompt that must appear in B's wrong answer (random prompts over a
#: 508-token vocabulary: a chance run of 8 over the 64 x 3500 alignments checked is ~1e-16).
EVIDENCE_RUN = 8


@pytest.fixture(scope="module")
def stock_env() -> dict[str, str]:
    """Environment that makes a server run the stock tree (built and byte-compiled once,
    reused by key)."""
    from benchmark.base_tree import prepare_base_tree

    return prepare_base_tree().env()


def _inputs(seed: int, model_path: Path) -> tuple[list[int], list[int], int, int]:
    """The victim's and the canary's prompts and rooms of one seeded run."""
    rng = random.Random(seed)
    v_ids = random_prompt(rng, V_LEN, model_path)
    b_ids = random_prompt(rng, B_LEN, model_path)
    return (v_ids, b_ids, *random_rooms(rng))


def run_scenario(trio: Trio, oracle: Oracle, model_path: Path, variant: str,
                 seed: int) -> Observation:
    """Victim V aborted while its write is held, canary B on V's pages, the write lands
    (``pdsafe_testkit.late_write.run_late_write``; random prompts over the whole vocabulary)."""
    v_ids, b_ids, v_room, b_room = _inputs(seed, model_path)
    return run_late_write(trio, v_ids, b_ids, expected=oracle.expected, variant=variant,
                          v_room=v_room, b_room=b_room)


def _record(log_dir: Path, obs: Observation) -> None:
    print(obs.timeline())
    path = log_dir / f"late-write-{obs.variant}.json"
    path.write_text(json.dumps(obs.to_json(), indent=1))


def _assert_versions(trio: Trio, stock: bool) -> None:
    """The servers run the stock build (``stock``) or the fork. Under ``pdsafe-patches ablate``
    (``PDSAFE_ABLATION_TREE``) the "fork" is a materialized tree without some patch, which
    reports upstream's plain version: not checked there."""
    if not stock and os.environ.get("PDSAFE_ABLATION_TREE"):
        return
    for s in (trio.held, trio.other, trio.decode):
        version = str(s.server_info().get("version", ""))
        assert ("+pdsafe" not in version) == stock, (
            f"{s.config.role} runs {version!r}; expected the {'stock' if stock else 'fork'} build")


def _assert_scenario_ran(obs: Observation) -> None:
    """The preconditions both variants share: V's write really was held past its abort."""
    problems = design_problems(obs)
    assert not problems, problems


@pytest.mark.parametrize("backend", LATE_WRITE_BACKENDS)
def test_late_write_base_corrupts_reused_pages(backend: str, log_dir: Path, model_path: Path,
                                               oracle: Oracle, stock_env: dict[str, str]) -> None:
    """Stock 0.5.23: the timeout frees V's pages, B gets them, V's late write changes B's answer.

    Proves the test can see the bug: each link of the chain is asserted (timeout release, page
    reuse, write order) and the wrong answer carries V's tokens. Does not prove how often it
    happens in production (the hold and the timeout are chosen to make it certain here).
    """
    with late_write_stack(backend, log_dir, model_path, stock_env) as trio:
        _assert_versions(trio, stock=True)
        obs = run_scenario(trio, oracle, model_path, f"base-{backend}", seed=90091)
    _record(log_dir, obs)
    _assert_scenario_ran(obs)
    t = obs.timeline()
    assert not obs.b_refusals, f"stock decode refused B: {t}"
    assert obs.t_release_seen is not None, f"stock decode did not free V on its timeout: {t}"
    assert obs.overlap, f"B did not get any of V's pages (reuse assumption broken): {t}"
    assert obs.t_b_transfer is not None and obs.t_b_transfer < obs.t_late_write < obs.t_b_done, (
        f"the late write did not land between B's transfer and B's end (timing): {t}")
    assert obs.b_status == 200, f"B failed instead of decoding on the reused pages: {t}"
    assert obs.first_divergence is not None, (
        f"the late write landed in B's pages but B's answer equals the reference: {t}")
    assert obs.v_run_in_b >= EVIDENCE_RUN, (
        f"B's answer differs but does not carry V's tokens (got {obs.got_excerpt}, want "
        f"{obs.want_excerpt}): {t}")


@pytest.fixture(scope="module", params=LATE_WRITE_BACKENDS)
def fork_trio(request, log_dir: Path, model_path: Path) -> Iterator[Trio]:
    """One fork stack per backend for the late-write and the two crash scenarios (in that
    order: the first crash restarts the prefill it killed, the second leaves it dead)."""
    with late_write_stack(request.param, log_dir, model_path, {}) as trio:
        _assert_versions(trio, stock=False)
        yield trio


def test_late_write_fork_keeps_reused_pages_clean(fork_trio: Trio, model_path: Path,
                                                  log_dir: Path, oracle: Oracle) -> None:
    """The installed fork: the same late write must not change B's answer.

    Proves that V's late write did not reach the request that owns its pages next (B's answer
    is reference-identical, and served), whatever the fork does instead (e.g. keep V's pages
    until the write drained, B waiting for them). Does not prove every late write is fenced
    (see the module docstring).
    """
    obs = run_scenario(fork_trio, oracle, model_path, f"fork-{fork_trio.backend}", seed=90092)
    _record(log_dir, obs)
    _assert_scenario_ran(obs)
    assert obs.b_status == 200, f"B was not served: {obs.timeline()}"
    assert obs.b_identical, (
        f"V's late write reached B: B's answer differs from the co-located reference from token "
        f"{obs.first_divergence} (got {obs.got_excerpt}, want {obs.want_excerpt}): "
        f"{obs.timeline()}")
    # How the fork kept B clean (patch 0019): V's pages stayed quarantined past upstream's
    # timeout (alarm) until the drain ACK; V held more than the limit, so the decode refused
    # new requests meanwhile and /health said why, and both recovered with the ACK.
    t = f"{obs.timeline()} metrics {obs.metric_deltas} health {obs.health_during!r} -> " \
        f"{obs.health_after!r}"
    assert obs.metric_deltas["quarantine_overdue_total"] >= 1, t
    assert obs.metric_deltas["quarantine_released_ack_total"] >= 1, t
    assert obs.b_refusals and all("decode KV quarantine over its limit" in r
                                  for r in obs.b_refusals), t
    assert obs.metric_deltas["quarantine_limit_refused_total"] >= len(obs.b_refusals), t
    assert obs.health_during.startswith("503") and "quarantine" in obs.health_during, t
    assert obs.health_after.startswith("200"), t


def run_crash_scenario(trio: Trio, oracle: Oracle, model_path: Path, seed: int,
                       evidence: Evidence, release_metric: str) -> CrashObservation:
    """V2 held in the prefill's transfer worker, that prefill SIGKILLed, the hold window, the
    ``evidence``, B2 through the other (``pdsafe_testkit.late_write.run_crash``)."""
    v2_ids, b2_ids, v2_room, b2_room = _inputs(seed, model_path)
    obs = run_crash(trio, v2_ids, b2_ids, expected=oracle.expected, v2_room=v2_room,
                    b2_room=b2_room, evidence=evidence, release_metric=release_metric)
    return obs


def _assert_held_until_the_evidence(obs: CrashObservation, log_dir: Path, backend: str) -> str:
    """What both crash tests share: V2's client told at once, the pages held through the hold
    window (the heartbeat's alarm, the probe's misses, no release of any kind), released only
    after the evidence, B2 reference-identical, both survivors up. Returns the record."""
    out = log_dir / f"late-write-crash-{obs.evidence}-{backend}.json"
    out.write_text(json.dumps(obs.to_json(), indent=1))
    t = json.dumps(obs.to_json())
    assert obs.v2_decode_status != 200 and obs.v2_decode_error, (
        f"V2's decode client was not told about the crash: {t}")
    assert obs.v2_answer_s is not None and obs.v2_answer_s <= CRASH_BOUND_S, t
    held = obs.hold_deltas
    assert held["quarantine_peer_gone_alarm_total"] >= 1, f"no heartbeat alarm: {t}"
    assert held["quarantine_probe_failed_total"] >= 1, (
        f"the probe never asked the dead prefill: {t}")
    released = {m: v for m, v in held.items() if m.startswith("quarantine_released_") and v}
    assert not released and not obs.released_before_evidence, (
        f"V2's pages were released before any evidence that the writer is gone: {t}")
    assert obs.quarantined_before_evidence >= 1, f"V2's pages were not quarantined: {t}"
    assert obs.release_s is not None and obs.evidence_s is not None, (
        f"the decode never released V2's pages after the evidence ({obs.evidence}): {t}")
    assert obs.b2_status == 200 and obs.b2_identical, f"B2 was not served correctly: {t}"
    assert obs.decode_alive and obs.other_prefill_alive, t
    return t


def test_crashed_prefill_pages_stay_held_until_it_restarts(
        fork_trio: Trio, log_dir: Path, model_path: Path, oracle: Oracle) -> None:
    """The fork, prefill SIGKILLed while its write into V2's decode pages is held: V2's client
    gets an error at once; the pages stay quarantined although the heartbeat declared the
    prefill gone (an alarm only) and the decode's incarnation probe finds nobody; the prefill
    is started again on the same ports (a new process, a new incarnation), the probe sees it
    and the decode releases the pages (counted as incarnation evidence, nothing else); a
    request through the surviving prefill is then reference-identical and the survivors are
    up. The restarted prefill serves the next test.

    Does not show a prefill alive but partitioned (missed heartbeats then; the same hold
    applies, it is not exercised here), nor a restart that keeps its process (a same-
    incarnation answer keeps the pages held: ``test/unit/test_quarantine_probe.py``).
    """
    obs = run_crash_scenario(fork_trio, oracle, model_path, 90093, restart_prefill,
                             INCARNATION_METRIC)
    t = _assert_held_until_the_evidence(obs, log_dir, fork_trio.backend)
    assert obs.evidence_deltas["quarantine_released_incarnation_total"] >= 1, t
    assert obs.evidence_deltas["quarantine_released_operator_total"] == 0, t
    assert fork_trio.held.process.alive(), t


def test_crashed_prefill_not_restarted_pages_released_by_operator(
        fork_trio: Trio, log_dir: Path, model_path: Path, oracle: Oracle) -> None:
    """The fork, prefill SIGKILLed mid-transfer and NOT restarted: the pages stay quarantined
    past the heartbeat's verdict and the probe's misses, until the operator's ``POST
    /pdsafe/quarantine/release`` names that prefill (patch 0028: counted, logged); then they
    are released (operator evidence), and B2 through the surviving prefill is
    reference-identical. Runs last on its stack (its held prefill stays dead).

    Does not show what the operator asserts (that the writer cannot write): that is theirs.
    """
    obs = run_crash_scenario(fork_trio, oracle, model_path, 90094, operator_release,
                             OPERATOR_METRIC)
    t = _assert_held_until_the_evidence(obs, log_dir, fork_trio.backend)
    assert obs.evidence_deltas["quarantine_operator_release_total"] == 1, t
    assert obs.evidence_deltas["quarantine_released_operator_total"] >= 1, t
    assert obs.evidence_deltas["quarantine_released_incarnation_total"] == 0, t
    log = fork_trio.decode.process.log_text()
    assert f"released the quarantined pages of {writer_address(fork_trio.held)}" in log, t
