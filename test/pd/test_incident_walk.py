"""The incident's deployment walked from the refused start to a working pair (issue 22, item 2).

The shape (``pdsafe_testkit.incident.Shape.scaled``): the tiny model's context (4096), a prefill
KV pool of 65 % of it (2661 tokens, the incident's 681,280 of 1,048,576), a larger decode pool
(4608). The operator's path, as docs/operator-guide.md ("A KV pool smaller than the context
length") tells it, each step checked on what the operator sees, with the messages built by the
fork's own functions (``pdsafe_testkit.incident.expected_*``):

1. the incident's configuration: the prefill refuses to start naming its pool and context
   (``admission.capacity_refusal``); the decode, whose pool holds the context, starts;
2. the clamp flag on the refused prefill, next to step 1's decode: the prefill starts and warns
   (``admission.clamp_warning``), both servers answer /health, and every request is refused at
   pairing on both legs (``pair_agreement.refusal_message``: the context lengths differ; the
   remedy "the same --context-length on both"), logged once;
3. both legs with ``--context-length`` = the pool step 1 named: decode logs the pair's limit
   (``pair_agreement.pairing_message``); after a victim that fills decode's pages, prompts up
   to the pair's advertised limit are answered as the co-located reference answers them, and
   every longer one up to the model's context gets a 400 naming the limit, or, with
   ``--allow-auto-truncate`` (a second pair), the reference answer of its first ``limit`` tokens.

Mooncake, page size 1 (the steps are admission and pairing decisions, not the transfer's wire;
the benchmark's ``incident-walk*`` scenarios run every backend and page size, and stock).

Server starts are shared: step 1's decode serves step 2, and the clamped prefill and both
step-3 pairs start together while step 1 is judged (seven servers in all, the reference
included). Measured wall time: in the module docstring of the commit that adds it
(``pytest -s`` prints it).

Without the fork (stock 0.5.23) step 1's prefill starts and nothing else holds; with the
refusal or pairing messages changed, the checks name the difference.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from pdsafe_testkit import incident as inc
from pdsafe_testkit.oracle import Oracle, random_prompt
from pdsafe_testkit.servers import (
    PDStack,
    SGLangServer,
    direct_pd_generate,
    launch_server,
    stop_together,
    wait_server,
)

pytestmark = pytest.mark.server

BACKEND = "mooncake"
PAGE = 1
MAX_NEW = 4
BOUND_S = 120.0
#: Step 2's requests (each refused at pairing).
PAIR_PROBES = 2


@dataclass
class Walk:
    """What the module's steps share: the shape, the checks, the servers, the wall times."""

    shape: inc.Shape
    checks: inc.Checks = field(default_factory=inc.Checks)
    pairs: dict[str, PDStack] = field(default_factory=dict)
    times: dict[str, float] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)

    def mark(self, what: str) -> None:
        self.times[what] = round(time.monotonic() - self.t0, 1)


@pytest.fixture(scope="module")
def walk(request: pytest.FixtureRequest, log_dir: Path, model_path: Path) -> Iterator[Walk]:
    """Steps 1 and 2, and step 3's two pairs started (their requests are the tests')."""
    w = Walk(inc.Shape.scaled(model_path, PAGE))
    first = {role: launch_server(inc.incident_config(w.shape, role, BACKEND, model=model_path),
                                 log_dir, wait=False) for role in ("prefill", "decode")}
    started: list[SGLangServer] = list(first.values())
    try:
        request.getfixturevalue("reference")  # starts (once per session) beside step 1
        inc.settle(list(first.values()))
        w.mark("step 1 settled")
        inc.check_first_start(w.checks, w.shape, first["prefill"], first["decode"])
        # The operator reads step 1's refusal and tries the clamp; step 3's pairs start now too
        # (their context is the pool the refusal named).
        clamped = launch_server(inc.clamp_config(w.shape, BACKEND, model=model_path), log_dir,
                                wait=False)
        started.append(clamped)
        ctx = w.shape.working_context
        for name, truncate in (("plain", False), ("auto-truncate", True)):
            legs = {role: launch_server(inc.working_config(w.shape, role, BACKEND, ctx,
                                                           model=model_path,
                                                           truncate=truncate),
                                        log_dir, wait=False) for role in ("prefill", "decode")}
            started += list(legs.values())
            w.pairs[name] = PDStack(BACKEND, legs["prefill"], legs["decode"], None)
        wait_server(clamped)
        w.mark("step 2 clamped prefill up")
        _step_clamp(w, clamped, first["decode"])
        w.mark("step 2 judged")
        clamped.stop()
        first["decode"].stop()
        for st in w.pairs.values():
            wait_server(st.prefill)
            wait_server(st.decode)
        w.mark("step 3 pairs up")
        yield w
    finally:
        stop_together(*started)
        print(f"\nincident walk wall times (s from the module's start): {w.times}")


def _step_clamp(w: Walk, prefill: SGLangServer, decode: SGLangServer) -> None:
    inc.check_clamped(w.checks, w.shape, prefill, decode)
    pair = PDStack(BACKEND, prefill, decode, None)
    rng = random.Random(2201)
    answers = []
    for _ in range(PAIR_PROBES):
        ids = random_prompt(rng, 64, prefill.config.model_path)
        p, d = direct_pd_generate(pair, ids, MAX_NEW, timeout=BOUND_S)
        answers.append((p.status, p.error_message, d.status, d.error_message))
    inc.check_pair_refusals(w.checks, w.shape, prefill, decode, answers)


def _assert_step(w: Walk, step: str) -> None:
    made = w.checks.of(step)
    assert made, f"no check was made for step {step!r}"
    assert not w.checks.failed(step), w.checks.report(step)


def test_step1_the_incident_configuration_is_refused(walk: Walk) -> None:
    """The prefill (pool 65 % of the context) refuses to start with the message the guide
    quotes; the decode (pool above the context) starts."""
    _assert_step(walk, inc.STEP_FIRST_START)


def test_step2_the_clamp_on_one_leg_is_refused_at_pairing(walk: Walk) -> None:
    """Both servers up, every request refused on both legs with decode's pairing refusal
    naming both context lengths and the remedy, logged once."""
    _assert_step(walk, inc.STEP_CLAMP)


@pytest.mark.parametrize("name", ["plain", "auto-truncate"])
def test_step3_the_same_context_length_on_both_legs_serves(walk: Walk, name: str,
                                                           oracle: Oracle) -> None:
    """The pair serves every prompt within its advertised limit as the reference does (after a
    victim filled decode's pages), and answers every longer prompt with a 400 naming the limit
    (``plain``) or with the reference answer of its first ``limit`` tokens (auto-truncate)."""
    st = walk.pairs[name]
    checks = inc.Checks()
    limits = inc.check_working(checks, walk.shape.working_context, st.prefill, st.decode)
    assert limits is not None and not checks.failed(), checks.report()
    limit = inc.pair_limit(limits)
    rng = random.Random(2202 if name == "plain" else 2203)
    model = st.prefill.config.model_path
    # A victim whose KV covers every position a truncated probe reads.
    victim = random_prompt(rng, limit - 1, model)
    # As many new tokens as the pair's scheduler grants a prompt of this length: upstream caps
    # max_new_tokens at max_req_len - len(prompt) - 1, where max_req_len = context - 1
    # (scheduler.py, tp_worker.py). One more and the pair answers one token short of the
    # reference, whose context is the model's (the CI run of 2026-12-02 failed on that).
    v_new = walk.shape.working_context - len(victim) - 2
    p, d = direct_pd_generate(st, victim, v_new, timeout=BOUND_S)
    oracle.assert_identical(d, victim, v_new, f"{name}: the victim")
    inc.check_paired(checks, st.prefill, st.decode, limits)
    for n in (limit - 1, limit):
        ids = random_prompt(rng, n, model)
        p, d = direct_pd_generate(st, ids, MAX_NEW, timeout=BOUND_S)
        oracle.assert_identical(d, ids, MAX_NEW, f"{name}: a {n}-token prompt (limit {limit})")
    over = sorted({limit + 1, walk.shape.kv("prefill") + 1, walk.shape.context - 2 * MAX_NEW})
    for n in over:
        ids = random_prompt(rng, n, model)
        p, d = direct_pd_generate(st, ids, MAX_NEW, timeout=BOUND_S)
        if name == "plain":
            for leg, r in (("prefill", p), ("decode", d)):
                inc.check_over_long(checks, n, r.status, r.error_message, limits,
                                    label=f"{n}-token prompt, {leg}'s client")
        else:
            oracle.assert_identical(d, ids[:limit], MAX_NEW,
                                    f"{name}: a {n}-token prompt cut at the pair's {limit}")
    after = random_prompt(rng, 200, model)
    p, d = direct_pd_generate(st, after, MAX_NEW, timeout=BOUND_S)
    oracle.assert_identical(d, after, MAX_NEW, f"{name}: a normal request after the probes")
    assert not checks.failed(), checks.report()
    walk.mark(f"step 3 {name} judged")
