"""No placeholder handoff, with real servers: a request both PD legs reject at intake is told
explicitly, nothing is transferred, later requests are clean. The guard at the real upstream
call sites, without servers: test/unit/test_placeholder_guard.py."""

from __future__ import annotations

import random

import pytest
from pdsafe_testkit.oracle import random_prompt
from pdsafe_testkit.servers import direct_pd_generate, generate

pytestmark = pytest.mark.server


def test_intake_rejection_in_pd_tells_client_and_transfers_nothing(pd, oracle, model_path):
    """A request both legs reject at intake: explicit 400s, no tokens, no handoff, and the
    pages that follow are clean (the scheduler would have died in strict mode otherwise)."""
    rng = random.Random(5)
    prompt = random_prompt(rng, 60, model_path)
    pr, dr = direct_pd_generate(pd, prompt, 8, return_logprob=True, logprob_start_len=10_000,
                                timeout=60)
    for leg, r in (("prefill", pr), ("decode", dr)):
        assert r.status == 400, f"{leg}: HTTP {r.status} {r.body}"
        assert "logprob_start_len" in r.error_message, r.error_message
        assert r.output_ids == []
    for server in (pd.prefill, pd.decode):
        blocked = server.metric("sglang:pdsafe_placeholder_blocked_total")
        assert blocked == 0, f"{server.config.role}: an aborted request reached a KV endpoint"
    for n in (40, 100):
        p = random_prompt(rng, n, model_path)
        oracle.assert_identical(generate(pd.router.url, p, 16), p, 16, what="after rejection")
