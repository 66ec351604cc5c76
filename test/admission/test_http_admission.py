"""Earliest rejection: the HTTP layer refuses prompts over the real, KV-derived limit (issue #3,
item 2), with a 4xx that names the prompt length and the limit, on every generation endpoint,
streaming or not, co-located and PD (through the router and direct to each side).

Without the admission patch, a prompt between the KV capacity and the context length passes
HTTP admission (upstream checks only the context length): a co-located server answers it from
the scheduler door (streaming: "200 OK" with an error event), and in PD mode it reaches the
bootstrap/pre-allocation of the other side; the decode side of a pair even waits forever for
a prompt whose pages plus the reserved decode tokens can never fit.

The admission logic alone (no servers): test/unit/test_admission_limits.py.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import requests
from pdsafe_testkit.metrics import metric_total
from pdsafe_testkit.oracle import random_prompt
from pdsafe_testkit.servers import (
    GenResult,
    Limits,
    direct_pd_generate,
    error_message,
    generate,
)

pytestmark = pytest.mark.server

MAX_NEW = 4  # a clamped context of 400 must fit the longest prompt (393) plus the output
COUNTER = "sglang:pdsafe_rejected_over_capacity_http_total"


def assert_refused(r: GenResult, n: int, limit: int, what: str) -> None:
    """A 4xx that names the prompt length and the limit, and not a single output token."""
    assert 400 <= r.status < 500, (
        f"{what}: a {n}-token prompt (limit {limit}) must be refused with a 4xx, got HTTP "
        f"{r.status}: {str(r.body)[:300]}"
    )
    assert r.output_ids == [], f"{what}: refused request produced tokens {r.output_ids}"
    msg = error_message(r.body)
    assert f"The prompt has {n} tokens" in msg, f"{what}: message lacks the length: {msg}"
    assert f"at most {limit} prompt tokens" in msg, f"{what}: message lacks the limit: {msg}"
    assert "--max-total-tokens" in msg, f"{what}: message lacks the operator remedy: {msg}"


def post_generate(url: str, ids: list[int], stream: bool, timeout: float = 120.0,
                  **extra: object) -> GenResult:
    """/generate with the server's real HTTP status, also when streaming (the harness's
    ``generate`` maps an error event inside a 200 stream to 400; here a 200 stays a 200)."""
    if not stream:
        return generate(url, ids, MAX_NEW, timeout=timeout, **extra)
    payload = {"input_ids": ids, "stream": True, **extra,
               "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0.0,
                                   "ignore_eos": True}}
    r = requests.post(url + "/generate", json=payload, timeout=timeout)
    try:
        body: object = r.json()
    except ValueError:
        body = r.text
    # A 200 stream counts as output even when it only carries an error event.
    return GenResult(r.status_code, [1] if r.status_code == 200 else [], body)


def openai_post(url: str, path: str, body: dict, stream: bool,
                model: str = "default") -> GenResult:
    """POST an OpenAI request; streaming answers are read whole. Output ids are not parsed:
    a 200 counts as output (the refusal assertions need a 4xx). The router routes by
    ``model`` (the served model name); a server alone accepts any name."""
    body = {**body, "model": model, "stream": stream}
    r = requests.post(url + path, json=body, timeout=120)
    try:
        parsed = r.json()
    except ValueError:
        parsed = r.text
    return GenResult(r.status_code, [1] if r.status_code == 200 else [], parsed)


def words(ids: Sequence[int]) -> str:
    """Text that the tiny model's word-level tokenizer maps back to ``ids``."""
    return " ".join(f"w{i - 4}" for i in ids)


def _check_refusals(url: str, prompt: list[int], limit: int, what: str) -> int:
    """Send ``prompt`` through /generate, /v1/completions and /v1/chat/completions, streaming
    and not; all must be refused. Returns the number of refusals."""
    n = len(prompt)
    for stream in (False, True):
        assert_refused(post_generate(url, prompt, stream), n, limit,
                       f"{what} /generate stream={stream}")
        assert_refused(openai_post(url, "/v1/completions",
                                   {"prompt": prompt, "max_tokens": MAX_NEW}, stream),
                       n, limit, f"{what} /v1/completions stream={stream}")
        assert_refused(openai_post(url, "/v1/chat/completions",
                                   {"messages": [{"role": "user", "content": words(prompt)}],
                                    "max_tokens": MAX_NEW}, stream),
                       n, limit, f"{what} /v1/chat/completions stream={stream}")
    return 6


def test_colocated_refuses_over_kv_limit(small, small_oracle, model_path):
    lim = Limits.of(small.url)
    # The KV pool, not the context length (4096), sets the limit; /model_info says so.
    assert lim.kv_capacity_tokens == 512 and lim.context_length == 4096
    assert lim.max_req_input_len == min(lim.context_length - 1, 512 - 1) - 5
    assert lim.max_prompt_tokens == lim.max_req_input_len - 1
    L = lim.max_prompt_tokens
    rng = random.Random(11)
    ok = {n: random_prompt(rng, n, model_path) for n in (L - 1, L)}
    normal = [random_prompt(rng, n, model_path) for n in (40, 200, 480)]
    for p in normal:  # reference answers before any refusal
        small_oracle.expected(p, MAX_NEW)
    before = metric_total(small.url, COUNTER)

    for n, p in ok.items():
        for stream in (False, True):
            r = generate(small.url, p, MAX_NEW, stream=stream)
            assert r.status == 200 and len(r.output_ids) == MAX_NEW, (n, stream, r.body)
    refused = 0
    # limit+1 (page size 1), and a prompt between the KV capacity and the context length
    # (the incident's class: upstream's HTTP check lets it through).
    for n in (L + 1, 1000):
        refused += _check_refusals(small.url, random_prompt(rng, n, model_path), L,
                                   f"co-located n={n}")

    assert metric_total(small.url, COUNTER) - before == refused
    for p in normal:  # the server is unharmed: same answers as before
        small_oracle.assert_identical(generate(small.url, p, MAX_NEW), p, MAX_NEW,
                                      what="normal request after refusals")


def test_pd_refuses_over_the_smaller_sides_limit(pd_case, small_oracle, model_path):
    st = pd_case.stack
    P, D = pd_case.limits("prefill"), pd_case.limits("decode")
    # The configured capacities give the intended order (see conftest).
    smaller, larger = (P, D) if pd_case.smaller == "prefill" else (D, P)
    assert smaller.max_prompt_tokens < larger.max_prompt_tokens, (P, D)
    small_side = getattr(st, pd_case.smaller)
    large_side = st.decode if pd_case.smaller == "prefill" else st.prefill
    L = smaller.max_prompt_tokens
    page = pd_case.page_size
    rng = random.Random(5)
    before_s, before_l = metric_total(small_side.url, COUNTER), metric_total(large_side.url,
                                                                            COUNTER)
    what = pd_case.name

    # At the limit: reference-identical through the router (streaming and not) and direct.
    for n in (L - 1, L):
        p = random_prompt(rng, n, model_path)
        for stream in (False, True):
            small_oracle.assert_identical(generate(st.router.url, p, MAX_NEW, stream=stream),
                                          p, MAX_NEW, what=f"{what} router n={n} s={stream}")
    p = random_prompt(rng, L, model_path)
    _, d = direct_pd_generate(st, p, MAX_NEW)
    small_oracle.assert_identical(d, p, MAX_NEW, what=f"{what} direct n={L}")

    # Over the limit: refused through the router, streaming and not.
    over = sorted({L + 1, L + page})
    router_refusals = 0
    for n in over:
        p = random_prompt(rng, n, model_path)
        for stream in (False, True):
            assert_refused(post_generate(st.router.url, p, stream), n, L,
                           f"{what} router stream={stream}")
            router_refusals += 1

    # Direct to each side, over that side's own limit: refused before any bootstrap.
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": st.prefill.bootstrap_port}
    direct = {}
    for side, lim in (("prefill", P), ("decode", D)):
        url = getattr(st, side).url
        direct[side] = 0
        for n in sorted({lim.max_prompt_tokens + 1, lim.max_prompt_tokens + page}):
            p = random_prompt(rng, n, model_path)
            for stream in (False, True):
                r = post_generate(url, p, stream, timeout=60,
                                  bootstrap_room=rng.randrange(1 << 62), **boot)
                assert_refused(r, n, lim.max_prompt_tokens, f"{what} direct {side} s={stream}")
                direct[side] += 1
        # /v1/completions too (token ids, non-streaming and streaming).
        p = random_prompt(rng, lim.max_prompt_tokens + 1, model_path)
        for stream in (False, True):
            assert_refused(openai_post(url, "/v1/completions",
                                       {"prompt": p, "max_tokens": MAX_NEW,
                                        "bootstrap_room": rng.randrange(1 << 62), **boot},
                                       stream), len(p), lim.max_prompt_tokens,
                           f"{what} direct {side} /v1/completions s={stream}")
            direct[side] += 1

    # Counters: the smaller side refused the router's requests and its own direct ones.
    assert metric_total(small_side.url, COUNTER) - before_s == (
        router_refusals + direct[pd_case.smaller])
    assert metric_total(large_side.url, COUNTER) - before_l == direct[
        "decode" if pd_case.smaller == "prefill" else "prefill"]

    # Next normal requests (reusing the pages) are reference-identical.
    prompts = [random_prompt(rng, rng.randint(17, L), model_path) for _ in range(6)]
    for i, p in enumerate(prompts):
        small_oracle.assert_identical(generate(st.router.url, p, MAX_NEW, timeout=120), p,
                                      MAX_NEW, what=f"{what} normal request {i}")
    _, d = direct_pd_generate(st, prompts[0], MAX_NEW)
    small_oracle.assert_identical(d, prompts[0], MAX_NEW, what=f"{what} normal direct")


def test_pd_chat_over_limit_refused_through_router(pd_case, small_oracle, model_path):
    """The OpenAI endpoints through the router: chat refused over the limit, served under."""
    st = pd_case.stack
    L = pd_case.limit
    rng = random.Random(8)
    over = random_prompt(rng, L + pd_case.page_size, model_path)
    for stream in (False, True):
        r = openai_post(st.router.url, "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": words(over)}],
                         "max_tokens": MAX_NEW, "temperature": 0}, stream,
                        model=str(model_path))
        assert 400 <= r.status < 500, (stream, r.status, str(r.body)[:300])
        assert f"at most {L} prompt tokens" in error_message(r.body), r.body
    under = random_prompt(rng, 30, model_path)
    r = requests.post(st.router.url + "/v1/chat/completions", json={
        "model": str(model_path), "messages": [{"role": "user", "content": words(under)}],
        "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text[:300]
    # The chat template renders the message text alone: same tokens as ``under``.
    exp = [f"w{i - 4}" for i in small_oracle.expected(under, MAX_NEW) if i >= 4]
    assert r.json()["choices"][0]["message"]["content"].split() == exp
