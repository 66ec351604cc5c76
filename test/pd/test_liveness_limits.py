"""Every request a PD pair admits ends, and the pools never wedge (issue #7, finding 14).

Backends: Mooncake by default; ``PDSAFE_FULL_BACKENDS=all`` adds NIXL (the limits are the
schedulers' arithmetic, not the transfer's; left out of the default run for CI time only).

Tried as a new user would: page sizes 1, 16 and 64, chunked prefill smaller than the limit
(``--chunked-prefill-size 128``), the default ``--num-reserved-decode-tokens`` (512), and every
prompt length from ``limit - page - 1`` to ``limit + 1``, where ``limit`` is the pair's
advertised ``max_prompt_tokens`` (the smaller of both legs' ``/model_info``). Before the fix,
a prefill with page size 64 and a 512-token pool advertised 505 tokens but could schedule only
446: longer prompts waited forever at the head of its queue, and every request behind them
waited too.

Discriminator (never a timed assertion): within a generous bound each request is either
answered with the co-located reference's tokens, or, above the limit, refused with a 4xx that
names the prompt length by the leg whose limit it exceeds (the other leg ends with an error
through peer release). After the sweep a normal request is answered (nothing wedged).

A second test pairs the decode of one stack with the prefill of another (different page size
and context length): the decode refuses the pairing at bootstrap, the error names both values
of each setting, both legs end at once, the refusal is counted once, and both servers keep
serving their own pairs.

Stacks: per backend, three PD pairs (one per page size), started together and module-scoped;
both legs of a pair share ``--context-length`` (pair agreement), and the decode pool decides
which leg binds: across the two backends each page size is swept with the prefill's limit
binding once and the decode's once (page 1 on NIXL: both legs at 505). Requests go to both
legs directly (what the router does), four at a time.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pdsafe_testkit.backends import ci_backends
from pdsafe_testkit.metrics import metric_total
from pdsafe_testkit.oracle import Oracle, random_prompt
from pdsafe_testkit.servers import (
    GenResult,
    Limits,
    PDStack,
    ServerConfig,
    SGLangServer,
    generate,
    launch_server,
    wait_server,
)

pytestmark = pytest.mark.server

MAX_NEW = 4
CHUNK = 128
#: Generous bound for one request; the discriminator is the outcome, not the time.
BOUND_S = 60.0
IN_FLIGHT = 4
PAGES = (1, 16, 64)
MISMATCH_COUNTER = "sglang:pdsafe_pair_setting_mismatch_total"


@dataclass(frozen=True)
class Case:
    """One PD pair: page size, shared context length (= prefill pool), decode pool, and the
    limit each leg must advertise (hard-coded, so that a limit that is too low fails too)."""

    page: int
    ctx: int
    decode_pool: int
    prefill_limit: int
    decode_limit: int


# prefill limit: min(ctx - 7, pool - page - 2); decode: min(ctx - 7, floor_page(pool - 512)).
CASES: dict[str, dict[int, Case]] = {
    "mooncake": {
        1: Case(1, 512, 912, prefill_limit=505, decode_limit=400),  # decode binds
        16: Case(16, 496, 1024, prefill_limit=478, decode_limit=489),  # prefill binds
        64: Case(64, 512, 896, prefill_limit=446, decode_limit=384),  # decode binds
    },
    "nixl": {
        1: Case(1, 512, 1024, prefill_limit=505, decode_limit=505),  # both legs at 505
        16: Case(16, 496, 896, prefill_limit=478, decode_limit=384),  # decode binds
        64: Case(64, 512, 1024, prefill_limit=446, decode_limit=505),  # prefill binds
    },
}


def _configs(case: Case, model_path: Path, backend: str) -> tuple[ServerConfig, ServerConfig]:
    extra = ["--chunked-prefill-size", str(CHUNK)]
    return (ServerConfig(role="prefill", model_path=model_path, backend=backend,
                         max_total_tokens=case.ctx, page_size=case.page,
                         context_length=case.ctx, extra_args=list(extra)),
            ServerConfig(role="decode", model_path=model_path, backend=backend,
                         max_total_tokens=case.decode_pool, page_size=case.page,
                         context_length=case.ctx, extra_args=list(extra)))


@pytest.fixture(scope="module", params=ci_backends())
def stacks(request: pytest.FixtureRequest, log_dir: Path,
           model_path: Path) -> Iterator[dict[int, PDStack]]:
    """The three PD pairs of one backend, started together (no router)."""
    backend = request.param
    servers: list[SGLangServer] = []
    try:
        pairs = {}
        for page, case in CASES[backend].items():
            pcfg, dcfg = _configs(case, model_path, backend)
            p = launch_server(pcfg, log_dir, wait=False)
            servers.append(p)
            d = launch_server(dcfg, log_dir, wait=False)
            servers.append(d)
            pairs[page] = (p, d)
        for s in servers:
            wait_server(s)
        yield {page: PDStack(backend, p, d, None) for page, (p, d) in pairs.items()}
    finally:
        # Stop all six at once (each may take its SIGTERM grace period).
        stoppers = [threading.Thread(target=s.stop) for s in servers]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()


@dataclass
class Outcome:
    """Both legs of one request (``None``: the leg did not answer within the bound)."""

    n: int
    prefill: GenResult | None
    decode: GenResult | None
    errors: list[str]


def pd_request(prefill_url: str, decode_url: str, bootstrap_port: int | None,
               ids: list[int]) -> Outcome:
    """One request sent to both legs at once, as the router does; each leg within BOUND_S."""
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
            "bootstrap_room": random.randrange(1 << 62)}
    out: dict[str, Any] = {}
    errors: list[str] = []

    def go(key: str, url: str) -> None:
        try:
            out[key] = generate(url, ids, MAX_NEW, timeout=BOUND_S, **boot)
        except Exception as e:  # noqa: BLE001 - a timeout is the failure this test looks for
            errors.append(f"{key}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=go, args=kv)
               for kv in (("p", prefill_url), ("d", decode_url))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return Outcome(len(ids), out.get("p"), out.get("d"), errors)


def names_length(r: GenResult | None, n: int) -> bool:
    return r is not None and 400 <= r.status < 500 and f"{n} tokens" in r.error_message


@pytest.mark.parametrize("page", PAGES)
def test_every_length_near_the_limit_ends(stacks, page, oracle: Oracle, model_path):
    stack = stacks[page]
    case = CASES[stack.backend][page]
    p_lim, d_lim = Limits.of(stack.prefill.url), Limits.of(stack.decode.url)
    # The advertised limits are the real ones (a limit set too low would pass the sweep).
    assert (p_lim.max_prompt_tokens, d_lim.max_prompt_tokens) == (
        case.prefill_limit, case.decode_limit), (p_lim, d_lim)
    limit = min(p_lim.max_prompt_tokens, d_lim.max_prompt_tokens)
    rng = random.Random(page)
    prompts = [random_prompt(rng, n, model_path) for n in range(limit - page - 1, limit + 2)]
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        outcomes = list(pool.map(lambda ids: pd_request(
            stack.prefill.url, stack.decode.url, stack.prefill.bootstrap_port, ids), prompts))

    problems = []
    for ids, o in zip(prompts, outcomes, strict=True):
        if o.errors:
            problems.append(f"{o.n} tokens: no answer within {BOUND_S:.0f} s: {o.errors}")
        elif o.n <= limit:
            if not (o.prefill.ok and o.decode.ok):
                problems.append(f"{o.n} tokens (limit {limit}) refused: prefill "
                                f"{o.prefill.status} {o.prefill.error_message[:200]}; decode "
                                f"{o.decode.status} {o.decode.error_message[:200]}")
            elif o.decode.output_ids != oracle.expected(ids, MAX_NEW):
                problems.append(f"{o.n} tokens: answer differs from the reference")
        else:
            binding = [leg for leg, lim in (("prefill", p_lim), ("decode", d_lim))
                       if o.n > lim.max_prompt_tokens]
            if o.decode.ok or o.prefill.ok:
                problems.append(f"{o.n} tokens (limit {limit}) answered 200 by a leg")
            if not any(names_length(getattr(o, leg), o.n) for leg in binding):
                problems.append(f"{o.n} tokens: no 4xx naming the length from {binding}: "
                                f"prefill {o.prefill.status} {o.prefill.error_message[:200]}; "
                                f"decode {o.decode.status} {o.decode.error_message[:200]}")
    assert not problems, "\n".join(problems)

    # Nothing wedged: a normal request is answered with the reference's tokens.
    ids = random_prompt(rng, 40, model_path)
    o = pd_request(stack.prefill.url, stack.decode.url, stack.prefill.bootstrap_port, ids)
    assert not o.errors and o.decode is not None and o.decode.ok, o
    oracle.assert_identical(o.decode, ids, MAX_NEW, what="after the sweep")


def test_mismatched_pair_is_refused_at_bootstrap(stacks, oracle: Oracle, model_path):
    """The decode of the page-16 pair (context 496) paired with the prefill of the page-64 pair
    (context 512): refused at bootstrap naming both values, counted once, nothing hangs."""
    decode, prefill = stacks[16].decode, stacks[64].prefill
    before = metric_total(decode.url, MISMATCH_COUNTER)
    rng = random.Random(16064)
    for attempt in range(2):
        ids = random_prompt(rng, 50, model_path)
        o = pd_request(prefill.url, decode.url, prefill.bootstrap_port, ids)
        assert not o.errors, o.errors
        assert not o.decode.ok and not o.prefill.ok, o
        msg = o.decode.error_message
        for text in ("page_size: prefill=64, decode=16",
                     "context_length: prefill=512, decode=496", "--page-size"):
            assert text in msg, (attempt, msg)
        assert "page_size" in o.prefill.error_message, o.prefill.error_message
    # Once per prefill, however many requests name it.
    assert metric_total(decode.url, MISMATCH_COUNTER) == before + 1
    # Both servers keep serving their own pairs.
    for page in (16, 64):
        st = stacks[page]
        ids = random_prompt(rng, 30, model_path)
        o = pd_request(st.prefill.url, st.decode.url, st.prefill.bootstrap_port, ids)
        assert not o.errors and o.decode is not None and o.decode.ok, o
        oracle.assert_identical(o.decode, ids, MAX_NEW, what=f"page-{page} pair afterwards")
