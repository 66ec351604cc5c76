"""Parallel sampling (``n>1``) on a PD pair is served, each sample reference-identical (issue 21,
item 5; ``sglang.pdsafe.sample_rooms``, patch 0031), on Mooncake and NIXL.

Stock 0.5.23 sends all ``n`` samples (and a prefix-cache warmup) with the request's one bootstrap
room: ``n+1`` transfers share one room's state, which crashes the decode scheduler or decodes a
sample over pages another sample's transfer wrote (docs/benchmark.md, ``room-n-greater-1``);
sglang-pdsafe refused ``n>1`` with 400 until each sample got its own room. Checked on content:
through the router and sent to both legs directly, every sample of every request equals, token
for token, the co-located server's sample for the same greedy request, also while other
``n>1`` and normal requests run at the same time; afterwards the decode holds nothing and the pair
serves a normal request identically.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests
from pdsafe_testkit.oracle import random_prompt
from pdsafe_testkit.servers import decode_idle, direct_pd_generate, generate

pytestmark = pytest.mark.server

MAX_NEW = 10


def _params(n: int) -> dict[str, Any]:
    return {"max_new_tokens": MAX_NEW, "n": n, "temperature": 0.0, "ignore_eos": True}


def _post(url: str, ids: list[int], n: int, **extra: Any) -> tuple[int, Any]:
    payload = {"input_ids": ids, "sampling_params": _params(n), **extra}
    r = requests.post(url + "/generate", json=payload, timeout=120)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


def _samples(status: int, body: Any, n: int, what: str) -> list[list[int]]:
    assert status == 200, f"{what}: HTTP {status}: {str(body)[:400]}"
    assert isinstance(body, list) and len(body) == n, f"{what}: {str(body)[:400]}"
    return [list(s["output_ids"]) for s in body]


def _reference(reference, ids: list[int], n: int) -> list[list[int]]:
    return _samples(*_post(reference.url, ids, n), n, f"co-located n={n}")


def test_every_sample_is_reference_identical(pd, reference, oracle, model_path):
    rng = random.Random(f"parallel-sampling-{pd.backend}")
    for n in (2, 3):
        ids = random_prompt(rng, rng.randint(40, 120), model_path)
        ref = _reference(reference, ids, n)
        assert all(s == oracle.expected(ids, MAX_NEW) for s in ref)
        got = _samples(*_post(pd.router.url, ids, n), n, f"{pd.backend} router n={n}")
        assert got == ref, f"{pd.backend} router n={n}: {got} != {ref}"
        p, d = direct_pd_generate(pd, ids, MAX_NEW, room=rng.randrange(1 << 62),
                                  sampling_params=_params(n))
        assert p.status == 200, f"{pd.backend} prefill leg n={n}: {p}"
        got = _samples(d.status, d.body, n, f"{pd.backend} decode leg n={n}")
        assert got == ref, f"{pd.backend} direct n={n}: {got} != {ref}"


def test_concurrent_parallel_and_normal_requests(pd, reference, oracle, model_path):
    rng = random.Random(f"parallel-sampling-mix-{pd.backend}")
    jobs = []
    for i in range(6):
        ids = random_prompt(rng, rng.randint(30, 100), model_path)
        jobs.append((ids, 1 + i % 3))
    refs = [_reference(reference, ids, n) if n > 1 else None for ids, n in jobs]

    def run(job: tuple[list[int], int]) -> Any:
        ids, n = job
        if n == 1:
            return generate(pd.router.url, ids, MAX_NEW)
        return _post(pd.router.url, ids, n)

    with ThreadPoolExecutor(len(jobs)) as ex:
        answers = list(ex.map(run, jobs))
    for (ids, n), ref, ans in zip(jobs, refs, answers, strict=True):
        if n == 1:
            oracle.assert_identical(ans, ids, MAX_NEW, what=f"{pd.backend} normal request")
        else:
            got = _samples(*ans, n, f"{pd.backend} concurrent n={n}")
            assert got == ref, f"{pd.backend} concurrent n={n}: {got} != {ref}"
    assert not any(decode_idle(pd.decode, 15.0).values()), \
        "the decode still holds pages or requests"
    q = random_prompt(rng, 50, model_path)
    oracle.assert_identical(generate(pd.router.url, q, MAX_NEW), q, MAX_NEW,
                            what=f"{pd.backend} after parallel sampling")
