"""Server-test steps shared by the KV digest's end-to-end tests (any model, any PD stack whose
decode runs the test-only faults ``foreign_kv:16,kv_corrupt``).

* :func:`digest_counters`: the decode's KV digest counters (verified and each refusal class);
* :func:`clean_traffic_is_verified`: concurrent clean requests through the router are
  reference-identical, each verified by the decode's digest, none refused (no false alarm);
* :func:`corrupted_transfer_is_refused`: one request whose transferred KV the ``kv_corrupt``
  fault changes at commit must end in HTTP 500 "KV integrity check failed" naming its room, with
  one more ``kv_digest_mismatch_total``;
* :func:`answer_with_foreign_kv_after_checks`: request A's last 16 positions written over
  request B's after every check (the ``pdsafe-fault-postcheck-`` fault, which no protection can
  see): B's answer, for the oracle's self-test.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pdsafe_testkit.faults import CORRUPT_LOG, CORRUPT_PREFIX
from pdsafe_testkit.metrics import metric_total
from pdsafe_testkit.oracle import Oracle
from pdsafe_testkit.servers import GenResult, direct_pd_generate, generate

#: The head of every digest refusal's error message.
DIGEST_REFUSED = "KV integrity check failed"
#: The digest's refusal classes (``sglang:pdsafe_kv_digest_<class>_total``).
REFUSALS = ("mismatch", "missing", "invalid", "failed")


def digest_counters(url: str) -> dict[str, float]:
    """The server's ``kv_digest_{verified, mismatch, missing, invalid, failed}_total``."""
    return {k: metric_total(url, f"sglang:pdsafe_kv_digest_{k}_total")
            for k in (*REFUSALS, "verified")}


def clean_traffic_is_verified(stack: Any, oracle: Oracle, prompts: Sequence[Sequence[int]],
                              max_new: int, what: str, workers: int = 4) -> None:
    """Send ``prompts`` through ``stack``'s router, ``workers`` at a time: every answer equals
    the reference's, the decode verified at least one transfer per prompt, and refused none."""
    before = digest_counters(stack.decode.url)
    with ThreadPoolExecutor(workers) as ex:
        results = list(ex.map(lambda p: generate(stack.router.url, p, max_new), prompts))
    for i, (p, r) in enumerate(zip(prompts, results, strict=True)):
        oracle.assert_identical(r, p, max_new, what=f"{what} clean request {i}")
    after = digest_counters(stack.decode.url)
    assert {k: after[k] - before[k] for k in REFUSALS} == dict.fromkeys(REFUSALS, 0), \
        f"{what}: the digest refused clean transfers (false alarm)"
    assert after["verified"] - before["verified"] >= len(prompts), \
        f"{what}: the decode did not verify the clean transfers (is the digest running?)"


def corrupted_transfer_is_refused(stack: Any, prompt: Sequence[int], mode: str,
                                  rng: random.Random, max_new: int, what: str) -> None:
    """Send ``prompt`` with a ``kv_corrupt`` rid of ``mode``; assert the fault acted and the
    decode refused the request with 500 naming its room, counted as one mismatch."""
    rid = f"{CORRUPT_PREFIX}{mode}-{uuid.uuid4().hex}"
    room = rng.randrange(1 << 62)
    before = digest_counters(stack.decode.url)
    _, r = direct_pd_generate(stack, prompt, max_new, rid=rid, room=room)
    assert f"{CORRUPT_LOG}: rid {rid}, mode {mode}" in stack.decode.process.log_text(), \
        "the corruption fault did not act (the test proves nothing)"
    assert r.status == 500, (f"{what}: decode answered KV corrupted at commit ({mode}) with "
                             f"{r.status}: {r.error_message[:300]}")
    assert DIGEST_REFUSED in r.error_message and str(room) in r.error_message, r.error_message
    assert digest_counters(stack.decode.url)["mismatch"] == before["mismatch"] + 1


def answer_with_foreign_kv_after_checks(stack: Any, oracle: Oracle, a: Sequence[int],
                                        b: Sequence[int], max_new: int) -> GenResult:
    """Serve A (the fault's source: its last 16 positions are captured at commit, and A must be
    reference-identical), then B of the same length with A's captured KV written over B's last
    16 positions right before B's first decode step. Returns B's answer (HTTP 200 asserted)."""
    assert len(a) == len(b), "the fault copies position for position"
    tag = uuid.uuid4().hex
    _, ra = direct_pd_generate(stack, a, max_new, rid=f"pdsafe-fault-source-{tag}")
    oracle.assert_identical(ra, a, max_new, what="fault source request")
    _, rb = direct_pd_generate(stack, b, max_new, rid=f"pdsafe-fault-postcheck-{tag}")
    assert rb.status == 200, rb.body
    return rb
