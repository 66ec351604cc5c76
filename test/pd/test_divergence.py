"""Divergence family: prefill and decode shape one prompt differently (issue #3, items 4 and 5).

Every case must end in the reference answer or an explicit error, never a 200 with other
content. Without the coverage attestation, decode commits the transfer although prefill wrote
fewer positions than decode reserved, and decodes over pages nobody wrote for the request.

Stacks (dedicated, module-scoped, one alive at a time; Mooncake by default, NIXL too with
``PDSAFE_FULL_BACKENDS=all``: the coverage gate is decode-side logic over the metadata row both
backends move alike, and CI time on 2 cores is bounded; the row's transfer itself is covered
on both backends by test/pd/test_pd_content.py and test/kv):

* ``incident``: the incident's configuration: prefill pool 320 tokens, decode pool 1024, page
  size 1, ``--allow-auto-truncate`` on both sides, a 400-token prompt. Every PD server runs with
  ``--context-length`` equal to its pool unless stated (a PD server refuses to start with a
  pool smaller than its context length; the operator's remedy, not the clamp flag). Request
  B runs first so that A (allocated B's freed pages, in order) would read B's KV in the
  positions prefill did not write.
* ``cfgdiv``: page size 16, prefill ``--context-length 106`` and another ``--chat-template``
  than decode; a 105-token prompt diverges inside the last partial page (7 pages either way).
  Requests go to prefill and decode directly (what the router does): the SMG router retries a
  5xx five times and opens both workers' circuit breakers after 10 failures in 120 s, which
  would turn this module's several refusals into "no available workers".
* ``page64``: page size 64, prefill ``--context-length 106``: the same inside one 64-page.

After each refused request, normal requests on the same stack must be reference-identical.
"""

from __future__ import annotations

import json
import random
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from pdsafe_testkit.backends import ci_backends
from pdsafe_testkit.metrics import metric_total
from pdsafe_testkit.oracle import Oracle, Verdict, random_prompt
from pdsafe_testkit.servers import (
    GenResult,
    Limits,
    PDStack,
    ServerConfig,
    direct_pd_generate,
    generate,
    pd_stack,
    skip_pair_check,
)

pytestmark = pytest.mark.server

MAX_NEW = 16
PREFILL_CTX = 106  # prefill's scheduler limit: min(106 - 1, pool - 1) - 5 = 100 tokens
CHAT_P = "{% for m in messages %}{{ m['content'] }} {% endfor %}w1 w2"
CHAT_D = "{% for m in messages %}{{ m['content'] }} {% endfor %}w1 w2 w3 w4 w5"


def max_req_input_len(url: str) -> int:
    """The shortest prompt the server refuses, as it advertises it (/model_info)."""
    return Limits.of(url).max_req_input_len


COVERAGE_COUNTER = "sglang:pdsafe_coverage_mismatch_total"


class Stacks:
    """Starts the named stack for one backend, stopping the previous one (CPU is scarce)."""

    def __init__(self, backend: str, log_dir: Path, model_path: Path, tmp: Path) -> None:
        self.backend, self.log_dir, self.model_path, self.tmp = backend, log_dir, model_path, tmp
        self.name: str | None = None
        self.stack: PDStack | None = None
        self._cm: Any = None

    def _configs(self, name: str) -> tuple[ServerConfig, ServerConfig, bool]:
        m = self.model_path
        if name == "incident":
            return (ServerConfig(role="prefill", model_path=m, max_total_tokens=320,
                                 context_length=320, allow_auto_truncate=True),
                    ServerConfig(role="decode", model_path=m, max_total_tokens=1024,
                                 context_length=1024, allow_auto_truncate=True,
                                 env=skip_pair_check("context_length")), True)
        if name == "cfgdiv":
            p_tpl, d_tpl = self.tmp / "prefill.jinja", self.tmp / "decode.jinja"
            p_tpl.write_text(CHAT_P)
            d_tpl.write_text(CHAT_D)
            return (ServerConfig(role="prefill", model_path=m, max_total_tokens=1024,
                                 page_size=16, context_length=PREFILL_CTX,
                                 allow_auto_truncate=True,
                                 extra_args=["--chat-template", str(p_tpl)]),
                    ServerConfig(role="decode", model_path=m, max_total_tokens=1024,
                                 page_size=16, context_length=1024, allow_auto_truncate=True,
                                 extra_args=["--chat-template", str(d_tpl)],
                                 env=skip_pair_check("context_length", "chat_template")), False)
        if name == "page64":
            return (ServerConfig(role="prefill", model_path=m, max_total_tokens=1024,
                                 page_size=64, context_length=PREFILL_CTX,
                                 allow_auto_truncate=True),
                    ServerConfig(role="decode", model_path=m, max_total_tokens=1024,
                                 page_size=64, context_length=1024,
                                 allow_auto_truncate=True,
                                 env=skip_pair_check("context_length")), False)
        raise KeyError(name)

    def get(self, name: str) -> PDStack:
        if self.name == name and self.stack is not None:
            return self.stack
        self.close()
        prefill, decode, router = self._configs(name)
        self._cm = pd_stack(self.backend, self.log_dir, prefill=prefill, decode=decode,
                            with_router=router)
        self.stack = self._cm.__enter__()
        self.name = name
        return self.stack

    def close(self) -> None:
        if self._cm is not None:
            cm, self._cm, self.stack, self.name = self._cm, None, None, None
            cm.__exit__(None, None, None)


@pytest.fixture(scope="module", params=ci_backends())
def stacks(request: pytest.FixtureRequest, log_dir: Path, model_path: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stacks]:
    s = Stacks(request.param, log_dir, model_path, tmp_path_factory.mktemp("templates"))
    try:
        yield s
    finally:
        s.close()


def stream_abort(r: GenResult) -> tuple[int, str] | None:
    """(status, message) of an abort delivered inside a 200 stream (upstream's convention:
    the last chunk's ``finish_reason`` is ``abort`` with a status code), else None."""
    fr = r.body.get("meta_info", {}).get("finish_reason") if isinstance(r.body, dict) else None
    if r.status == 200 and isinstance(fr, dict) and fr.get("type") == "abort":
        return int(fr.get("status_code") or 0), str(fr.get("message", ""))
    return None


def refusal(r: GenResult) -> tuple[int, str] | None:
    """(status, message) when ``r`` is an explicit error (HTTP error or in-stream abort)."""
    if r.status != 200:
        return r.status, r.error_message
    return stream_abort(r)


_COUNTS = re.compile(r"prefill wrote tokens \[\d+, \d+\) = (\d+) tokens.*decode reserved "
                     r"tokens \[\d+, \d+\) = (\d+) tokens")


def assert_refused(r: GenResult, what: str, prefill_limit: int, decode_tokens: int) -> None:
    """An explicit 5xx naming the coverage mismatch and both sides' token counts: decode's
    full prompt, prefill's truncation of it (at most its own limit)."""
    ref = refusal(r)
    assert ref is not None and ref[0] >= 500 and not r.output_ids, (
        f"{what}: expected a 5xx, got {r.status} {r.output_ids}")
    msg = ref[1]
    m = _COUNTS.search(msg)
    assert "coverage mismatch" in msg and m, f"{what}: unexpected error message: {msg}"
    wrote, reserved = int(m.group(1)), int(m.group(2))
    assert reserved == decode_tokens and wrote <= prefill_limit < decode_tokens, (
        f"{what}: counts in the message ({wrote} written, {reserved} reserved) do not match "
        f"the configuration (prefill limit {prefill_limit}, prompt {decode_tokens}): {msg}")
    assert "--allow-auto-truncate" in msg and "--context-length" in msg, msg


def check_normal_traffic(url_or_stack: Any, oracle: Oracle, model_path: Path, limit: int,
                         seed: int) -> None:
    """After a refusal, ordinary requests (which reuse the freed pages) are reference-exact."""
    rng = random.Random(seed)
    for n in (limit // 3, limit - 1, limit // 2 + 7):
        p = random_prompt(rng, n, model_path)
        if isinstance(url_or_stack, str):
            r = generate(url_or_stack, p, MAX_NEW)
        else:
            _, r = direct_pd_generate(url_or_stack, p, MAX_NEW)
        oracle.assert_identical(r, p, MAX_NEW, what=f"normal request of {n} tokens after refusal")


# --------------------------------------------------------------------------- (1) the incident


def test_incident_auto_truncate_divergence_is_refused(stacks, oracle, model_path):
    """Prefill pool 320 / decode pool 1024 / page 1 / auto-truncate: 400-token prompt A.

    Stock 0.5.23: prefill truncates A to its own limit, decode reserves all 400 positions, and
    the positions prefill did not write still hold B's KV: A's answer is HTTP 200 with B's
    tokens in it, different from both the full-prompt and the truncated-prompt reference.
    """
    stack = stacks.get("incident")
    url = stack.router.url
    p_limit, d_limit = max_req_input_len(stack.prefill.url), max_req_input_len(stack.decode.url)
    assert p_limit < 400 < d_limit, (p_limit, d_limit)
    rng = random.Random(2024)
    a = random_prompt(rng, 400, model_path)
    full_ref = oracle.expected(a, MAX_NEW)
    trunc_ref = oracle.expected(a[:p_limit], MAX_NEW)
    before = metric_total(stack.decode.url, COVERAGE_COUNTER)
    answers: list[GenResult] = []
    leaks: list[str] = []
    for i, stream in enumerate((False, True)):
        b = random_prompt(rng, 300, model_path)
        # B's KV occupies the pages A gets next; decode itself writes B's positions 300..399.
        oracle.assert_identical(generate(url, b, 100), b, 100, what=f"B{i}")
        r = generate(url, a, MAX_NEW, stream=stream)
        answers.append(r)
        if refusal(r) is None:
            foreign = [t for t in r.output_ids if t in b and t not in a]
            leaks.append(
                f"A after B{i} (stream={stream}): HTTP 200 {r.output_ids} (= full-prompt ref: "
                f"{r.output_ids == full_ref}, = truncated-prompt ref: {r.output_ids == trunc_ref}"
                f", tokens found only in B: {foreign}); full-prompt ref {full_ref}; truncated "
                f"ref {trunc_ref}")
    ok_answers = [r for r in answers if refusal(r) is None]
    assert all(r.output_ids == full_ref for r in ok_answers), (
        "KV leak: HTTP 200 with content that is not the reference answer "
        f"(prefill limit {p_limit}, decode limit {d_limit}; answers differ between B0 and B1: "
        f"{len({tuple(r.output_ids) for r in ok_answers}) > 1}):\n  " + "\n  ".join(leaks))
    for i, r in enumerate(answers):
        if refusal(r) is not None:
            assert_refused(r, f"A after B{i}", p_limit, 400)
    if ok_answers != answers:
        assert metric_total(stack.decode.url, COVERAGE_COUNTER) > before
    check_normal_traffic(url, oracle, model_path, p_limit, seed=1)


# --------------------------------------------------------------------------- (2) context length


def test_context_length_divergence_is_refused(stacks, oracle, model_path):
    """Page 16: prefill --context-length 106 cuts to 100 tokens, decode keeps all of them."""
    stack = stacks.get("cfgdiv")
    p_limit = max_req_input_len(stack.prefill.url)
    assert p_limit == PREFILL_CTX - 6, p_limit
    rng = random.Random(77)
    for n in (105, 200):  # 105: same 7 pages, divergence inside the last partial page
        a = random_prompt(rng, n, model_path)
        _, r = direct_pd_generate(stack, a, MAX_NEW)
        v = oracle.assert_identical_or_error(r, a, MAX_NEW, what=f"{n}-token prompt")
        if v is Verdict.EXPLICIT_ERROR:
            assert_refused(r, f"{n}-token prompt", p_limit, n)
        check_normal_traffic(stack, oracle, model_path, p_limit, seed=n)


# --------------------------------------------------------------------------- (3) chat template


def direct_pd_chat(stack: PDStack, body: dict[str, Any]) -> requests.Response:
    """One /v1/chat/completions to prefill and decode directly (what the router does)."""
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": stack.prefill.bootstrap_port,
            "bootstrap_room": random.randrange(1 << 62)}
    out: dict[str, requests.Response] = {}

    def go(key: str, url: str) -> None:
        out[key] = requests.post(url + "/v1/chat/completions", json={**body, **boot},
                                 timeout=120)

    ts = [threading.Thread(target=go, args=kv)
          for kv in (("p", stack.prefill.url), ("d", stack.decode.url))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out["d"]


def test_chat_template_divergence_is_refused(stacks, oracle, model_path):
    """Prefill renders the chat with 3 words fewer than decode: decode would read 3 positions
    that nobody wrote for this request (on prefill's side, the tail of its last page)."""
    stack = stacks.get("cfgdiv")
    vocab = json.loads((model_path / "tokenizer.json").read_text())["model"]["vocab"]
    rng = random.Random(5)
    words = sorted(w for w in vocab if w.startswith("w"))
    content = " ".join(rng.choice(words) for _ in range(60))
    ids_p = [vocab[w] for w in (content + " w1 w2").split()]
    ids_d = [vocab[w] for w in (content + " w1 w2 w3 w4 w5").split()]
    model = requests.get(stack.decode.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = direct_pd_chat(stack, body)
    if r.status_code == 200:
        choice = r.json()["choices"][0]
        refs = {"decode template": oracle.expected(ids_d, MAX_NEW),
                "prefill template": oracle.expected(ids_p, MAX_NEW)}
        assert choice.get("prompt_token_ids") in (None, ids_d), choice.get("prompt_token_ids")
        assert choice.get("response_token_ids") == refs["decode template"], (
            f"chat answer is HTTP 200 with other content: {choice.get('response_token_ids')} "
            f"({choice['message']['content']!r}); references {refs}")
    else:
        msg = r.text
        assert r.status_code >= 500, f"{r.status_code}: {msg}"
        assert "coverage mismatch" in msg and f"{len(ids_p)} tokens" in msg \
            and f"{len(ids_d)} tokens" in msg, msg
    check_normal_traffic(stack, oracle, model_path, max_req_input_len(stack.prefill.url), seed=3)


# --------------------------------------------------------------------------- (4) page size 64


def test_partial_page_divergence_page64(stacks, oracle, model_path):
    """Page 64: prefill writes 100 tokens, decode reserved 105: both 2 pages."""
    stack = stacks.get("page64")
    p_limit = max_req_input_len(stack.prefill.url)
    rng = random.Random(64)
    a = random_prompt(rng, 105, model_path)
    _, r = direct_pd_generate(stack, a, MAX_NEW)
    v = oracle.assert_identical_or_error(r, a, MAX_NEW, what="105-token prompt, page 64")
    if v is Verdict.EXPLICIT_ERROR:
        assert_refused(r, "105-token prompt, page 64", p_limit, 105)
    check_normal_traffic(stack, oracle, model_path, p_limit, seed=64)
