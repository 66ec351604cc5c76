"""Bootstrap writes need the prefill's key, on the shared PD stacks (patch 0029, issue 21 item
7: "``PUT /route`` without the key gets 401, and the real ranks keep serving").

On each backend's running pair (real prefill, decode and router; no key configured, so the
prefill's launcher generated a per-server secret its ranks registered with): an attacker's
``PUT /route`` re-pointing rank 0 at another address, with no key and with a guessed one, and
a keyless ``POST /register_dp_rank``, get 401 and are counted on the prefill's ``/metrics``;
``GET /route`` still returns the rank the prefill registered; requests through the router and
sent to both legs directly are then the co-located reference's answers, token for token.
What an unprotected server does with the same PUT: ``test/unit/test_bootstrap_auth.py`` (the
attack re-points the rank on upstream's code with the check off).
"""

from __future__ import annotations

import random

import pytest
import requests
from pdsafe_testkit.oracle import random_prompt
from pdsafe_testkit.servers import direct_pd_generate, generate

pytestmark = pytest.mark.server

UNAUTHORIZED = "sglang:pdsafe_bootstrap_unauthorized_total"
RANK0 = "?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
MAX_NEW = 12


def test_put_route_without_the_key_gets_401_and_the_ranks_keep_serving(pd, oracle, model_path):
    base = f"http://127.0.0.1:{pd.prefill.bootstrap_port}"
    registered = requests.get(base + "/route" + RANK0, timeout=10)
    assert registered.status_code == 200, registered.text
    real = registered.json()
    forged = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
              "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
              "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.2",
              "rank_port": 9, "page_size": 1, "kv_cache_dtype": "float32"}
    before = pd.prefill.metric(UNAUTHORIZED)
    answers = [
        requests.put(base + "/route", json=forged, timeout=10),
        requests.put(base + "/route", json=forged, timeout=10,
                     headers={"Authorization": "Bearer 0123456789abcdef"}),
        requests.post(base + "/register_dp_rank", json={"bootstrap_room": 1, "dp_rank": 0},
                      timeout=10),
    ]
    for r in answers:
        assert r.status_code == 401, f"{pd.backend}: {r.status_code} {r.text}"
        assert "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN" in r.text
    assert pd.prefill.metric(UNAUTHORIZED) == before + len(answers)
    after = requests.get(base + "/route" + RANK0, timeout=10).json()
    assert (after["rank_ip"], after["rank_port"]) == (real["rank_ip"], real["rank_port"]), (
        f"{pd.backend}: a refused PUT re-pointed rank 0: {real} -> {after}")

    rng = random.Random(f"bootstrap-auth-{pd.backend}")
    for i in range(2):
        p = random_prompt(rng, rng.randint(20, 80), model_path)
        r = generate(pd.router.url, p, MAX_NEW)
        oracle.assert_identical(r, p, MAX_NEW, what=f"{pd.backend} router request {i}")
        _, d = direct_pd_generate(pd, p, MAX_NEW)
        oracle.assert_identical(d, p, MAX_NEW, what=f"{pd.backend} direct request {i}")
