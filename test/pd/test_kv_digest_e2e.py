"""The KV digest end to end (issue 10): corrupted KV is refused with a 500, clean KV never is.

The shared PD stack's decode runs the test-only faults ``foreign_kv:16,kv_corrupt`` (conftest;
each acts only on rids with its prefix). At decode commit, after the transfer landed and
before decode's digest check, the fault changes the request's transferred KV
(``pdsafe-fault-corrupt-MODE-``: one bit; one bit of the last owned position, i.e. the partial
last page's slot; one page of one layer's K; one bit in every position of one layer's V) or
writes another request's KV over its last 16 positions (``pdsafe-fault-inject-``). Each must
end in HTTP 500 "KV integrity check failed" naming the room, one more
``kv_digest_mismatch_total``, and the next requests reference-identical with no new refusal
(no false alarm; ``kv_digest_verified_total`` shows their checks ran). Without the digest
patch these requests are answered with HTTP 200 (the one-bit cases often with the reference's
tokens: only the digest can see them).

Backends: ``pdsafe_testkit.backends.ci_backends()`` (Mooncake in CI; every backend with
``PDSAFE_FULL_BACKENDS=all``): the check runs after the transfer, the same code for every
backend; NIXL's digest path (its row's transfer, its verification of every clean request) is
exercised by ``test_pd_content.py`` on every run, with the digest on by default.
"""

from __future__ import annotations

import random
import uuid

import pytest
from pdsafe_testkit.backends import ci_backends
from pdsafe_testkit.faults import CORRUPT_MODES
from pdsafe_testkit.kv_checks import (
    DIGEST_REFUSED,
    clean_traffic_is_verified,
    corrupted_transfer_is_refused,
    digest_counters,
)
from pdsafe_testkit.oracle import random_prompt
from pdsafe_testkit.servers import direct_pd_generate

pytestmark = pytest.mark.server

MAX_NEW = 16


@pytest.fixture(autouse=True)
def _ci_backends_only(pd) -> None:
    if pd.backend not in ci_backends():
        pytest.skip(f"{pd.backend}: corruption cases run on {ci_backends()} "
                    "(PDSAFE_FULL_BACKENDS=all runs every backend)")


def _clean_traffic_matches(pd, oracle, model_path, seed: int, n: int = 4) -> None:
    """``n`` concurrent clean requests through the router: reference-identical, each checked,
    none refused."""
    rng = random.Random(seed)
    prompts = [random_prompt(rng, rng.randint(20, 160), model_path) for _ in range(n)]
    clean_traffic_is_verified(pd, oracle, prompts, MAX_NEW, what=pd.backend, workers=n)


@pytest.mark.parametrize("mode", CORRUPT_MODES)
def test_corrupted_kv_is_refused_with_500_and_the_next_requests_match(pd, oracle, model_path,
                                                                      mode):
    rng = random.Random(f"corrupt-{mode}")
    prompt = random_prompt(rng, 150, model_path)
    corrupted_transfer_is_refused(pd, prompt, mode, rng, MAX_NEW, what=pd.backend)
    _clean_traffic_matches(pd, oracle, model_path, seed=len(mode))


def test_foreign_kv_written_before_the_check_is_refused(pd, oracle, model_path):
    """Another request's KV in a request's last 16 positions (what a misdirected or late
    write leaves) is refused by the digest; the same prompt without the fault is clean."""
    rng = random.Random(11)
    a = random_prompt(rng, 200, model_path)
    b = random_prompt(rng, 200, model_path)
    tag = uuid.uuid4().hex
    _, ra = direct_pd_generate(pd, a, MAX_NEW, rid=f"pdsafe-fault-source-{tag}")
    oracle.assert_identical(ra, a, MAX_NEW, what="fault source request")
    before = digest_counters(pd.decode.url)
    _, rb = direct_pd_generate(pd, b, MAX_NEW, rid=f"pdsafe-fault-inject-{tag}")
    assert rb.status == 500 and DIGEST_REFUSED in rb.error_message, (
        f"{pd.backend}: foreign KV before the check was answered {rb.status}: "
        f"{rb.error_message[:300]}")
    assert digest_counters(pd.decode.url)["mismatch"] == before["mismatch"] + 1
    _, rc = direct_pd_generate(pd, b, MAX_NEW)
    oracle.assert_identical(rc, b, MAX_NEW, what="same prompt, no fault")


def test_a_client_health_check_rid_is_refused_not_waved_through(pd):
    """Upstream skipped the KV checksum for rids starting with HEALTH_CHECK; a client cannot
    use that prefix at all (400), and the server's own health check passes."""
    import requests

    p, d = direct_pd_generate(pd, [5, 6, 7, 8], 4, rid=f"HEALTH_CHECK_{uuid.uuid4().hex}")
    for leg, r in (("prefill", p), ("decode", d)):
        assert r.status == 400 and "HEALTH_CHECK" in r.error_message, \
            (leg, r.status, r.error_message[:300])
    assert requests.get(pd.decode.url + "/health", timeout=60).status_code == 200
