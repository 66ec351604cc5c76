"""Normal PD traffic returns exactly the co-located server's tokens, on both backends.

Also the oracle's self-test: with a test-only fault that writes another request's KV into a
request's pages, the oracle must see the foreign content (else the other tests prove nothing).
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from pdsafe_testkit.kv_checks import answer_with_foreign_kv_after_checks
from pdsafe_testkit.oracle import Verdict, random_prompt
from pdsafe_testkit.servers import (
    SHARED_DECODE_POOL,
    ServerConfig,
    decode_idle,
    direct_pd_generate,
    generate,
    pd_stack,
)

pytestmark = pytest.mark.server

MAX_NEW = 24


def test_concurrent_traffic_through_router_matches_reference(pd, oracle, model_path):
    rng = random.Random(1234)
    prompts = [random_prompt(rng, rng.randint(17, 300), model_path) for _ in range(24)]
    # Far more tokens than the decode pool holds: pages are reused many times over.
    assert sum(len(p) + MAX_NEW for p in prompts) > 3 * SHARED_DECODE_POOL
    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(lambda p: generate(pd.router.url, p, MAX_NEW), prompts))
    for i, (p, r) in enumerate(zip(prompts, results, strict=True)):
        oracle.assert_identical(r, p, MAX_NEW, what=f"{pd.backend} request {i}")


def test_direct_and_streaming_match_reference(pd, oracle, model_path):
    rng = random.Random(99)
    p = random_prompt(rng, 120, model_path)
    _, d = direct_pd_generate(pd, p, MAX_NEW)
    oracle.assert_identical(d, p, MAX_NEW, what=f"{pd.backend} direct")
    s = generate(pd.router.url, p, MAX_NEW, stream=True)
    oracle.assert_identical(s, p, MAX_NEW, what=f"{pd.backend} streaming")


def test_oracle_sees_injected_foreign_kv(pd, oracle, model_path):
    """Self-test: foreign KV in a request's last pages must change its answer, visibly.

    The decode server runs with SGLANG_PDSAFE_TEST_FAULTS=foreign_kv:16 (conftest), which only
    acts on rids with the fault prefixes. Request A's last 16 prompt positions are captured at
    its commit; request B (same length) gets them written over its own last 16 positions
    right before its first decode step, after every check (``pdsafe-fault-postcheck-``: KV
    that changes after decode verified it, which no protection of the series can see, so the
    oracle is shown to see it in every tree). The tiny model copies the token 16 positions
    back, so B's answer must now show A's tokens.
    """
    rng = random.Random(7)
    a = random_prompt(rng, 200, model_path)
    b = random_prompt(rng, 200, model_path)
    rb = answer_with_foreign_kv_after_checks(pd, oracle, a, b, MAX_NEW)
    assert oracle.judge(rb, b, MAX_NEW) is Verdict.WRONG_CONTENT, "oracle missed foreign KV"
    # The first token comes from prefill (clean); the next 15 copy the foreign positions.
    assert rb.output_ids[1:16] == a[-15:], (
        f"expected A's tokens to surface in B's answer:\n  got {rb.output_ids}\n  A[-15:] {a[-15:]}"
    )
    # The same request without the fault prefix is clean again.
    _, rc = direct_pd_generate(pd, b, MAX_NEW)
    oracle.assert_identical(rc, b, MAX_NEW, what="same prompt, no fault")


@pytest.mark.parametrize("backend,page_size", [("mooncake", 64), ("nixl", 16)])
def test_larger_pages_match_reference(backend, page_size, oracle, model_path, log_dir):
    """Paged pools (16, 64 tokens a page): partial last pages and page reuse stay exact."""
    pool = 1024  # 12 requests of up to 150+24 tokens overfill it: pages are reused
    with pd_stack(
        backend, log_dir, with_router=False,
        prefill=ServerConfig(role="prefill", model_path=model_path, page_size=page_size,
                             max_total_tokens=pool, context_length=pool),
        decode=ServerConfig(role="decode", model_path=model_path, page_size=page_size,
                            max_total_tokens=pool, context_length=pool),
    ) as stack:
        rng = random.Random(page_size)
        prompts = [random_prompt(rng, rng.randint(17, 150), model_path) for _ in range(12)]
        assert sum(len(p) + MAX_NEW for p in prompts) > pool
        with ThreadPoolExecutor(4) as ex:
            results = list(ex.map(lambda p: direct_pd_generate(stack, p, MAX_NEW)[1], prompts))
        for i, (p, r) in enumerate(zip(prompts, results, strict=True)):
            oracle.assert_identical(r, p, MAX_NEW, what=f"{backend} page {page_size} req {i}")


def test_prefill_complete_allocation_matches_reference(oracle, model_path, log_dir):
    """Upstream's ``prefill_complete`` decode allocation (Mooncake only): the decode reserves
    no pages until its prefill finished, and tells the prefill its endpoint first with a
    deferred BOOTSTRAP, so notices may reach the decode before any metadata (the one path on
    which :func:`sglang.pdsafe.transfer_generation.drops_stale_message` lets a generation-less
    notice through, for that reservation only). Under page reuse (the pool holds a third of
    the traffic) every answer equals the co-located server's, and the decode holds nothing
    afterwards."""
    import requests

    pool = 1024
    policy = ["--disaggregation-decode-allocation-policy", "prefill_complete"]
    with pd_stack(
        "mooncake", log_dir, with_router=False,
        prefill=ServerConfig(role="prefill", model_path=model_path, max_total_tokens=pool,
                             context_length=pool, extra_args=list(policy)),
        decode=ServerConfig(role="decode", model_path=model_path, max_total_tokens=pool,
                            context_length=pool, extra_args=list(policy)),
    ) as stack:
        for leg in (stack.prefill, stack.decode):
            info = requests.get(leg.url + "/server_info", timeout=10).json()
            assert info.get("disaggregation_decode_allocation_policy") == "prefill_complete", (
                f"{leg.config.role} does not run the policy under test")
        rng = random.Random(2024)
        prompts = [random_prompt(rng, rng.randint(17, 200), model_path) for _ in range(20)]
        assert sum(len(p) + MAX_NEW for p in prompts) > 2 * pool
        with ThreadPoolExecutor(4) as ex:
            results = list(ex.map(lambda p: direct_pd_generate(stack, p, MAX_NEW)[1], prompts))
        for i, (p, r) in enumerate(zip(prompts, results, strict=True)):
            oracle.assert_identical(r, p, MAX_NEW, what=f"prefill_complete request {i}")
        held = decode_idle(stack.decode, 10)
        assert not any(held.values()), f"the decode still holds {held}"


def test_startup_report_and_hook_self_check_ran(pd):
    """The startup hook (last patch of the series) ran on both PD legs: the hook-API
    self-check passed and the active protections were logged, peer release and pair
    agreement among them (an operator reads this line to know what guards the server)."""
    for leg in (pd.prefill, pd.decode):
        log = leg.process.log_text()
        assert "pdsafe hook API self-check:" in log, f"{pd.backend} {leg.config.role}: " \
            "no hook-API self-check in the startup log"
        line = next((x for x in log.splitlines() if "protections active:" in x), "")
        for name in ("no-placeholder-handoff", "coverage-attestation", "peer-release",
                     "pair-agreement"):
            assert name in line, f"{pd.backend} {leg.config.role}: {name!r} missing from " \
                f"the startup report: {line!r}"
