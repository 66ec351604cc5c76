"""The benchmark's stack kinds, chat client and scenario selection (no server).

The divergence scenarios judge an answer against the reference for what decode was configured
to see; these tests pin the configuration each stack gives each leg (a stack that silently gave
both legs the same settings would make a stock pair look safe), that the chat templates render
to the token ids the scenario judges against, how a chat answer is read, and the CI smoke's
scenario set (one stack, still a scenario where stock 0.5.23 is known to leak).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jinja2
import pytest
import tokenizers
from pdsafe_testkit.servers import DEFAULT_MODEL

from benchmark import client
from benchmark.canary import owner_of
from benchmark.outcomes import Outcome, classify
from benchmark.regression import parse_args
from benchmark.scenarios import (
    FULL_ONLY,
    OWN_SERVERS,
    SCENARIOS,
    SMOKE_SCENARIOS,
    _planned,
    applicable,
)
from benchmark.targets import (
    CHAT_SUFFIX,
    CTX_DIV_PREFILL_CONTEXT,
    STACK_KINDS,
    chat_template_text,
    word_vocab,
)


def test_every_harness_scenario_has_its_stack() -> None:
    for s in SCENARIOS.values():
        if s.implemented and s.harness_ok and s.stack != OWN_SERVERS:
            assert s.stack in STACK_KINDS, (s.name, s.stack)


def test_scenarios_with_their_own_servers_are_harness_only_and_full_matrix() -> None:
    """They restart and reconfigure servers (``benchmark.incident``): never against a
    deployment, and not in --quick (several server starts per cell)."""
    own = [s for s in SCENARIOS.values() if s.stack == OWN_SERVERS]
    assert {s.name for s in own} == {"incident-walk", "incident-walk-auto-truncate"}
    for s in own:
        assert s.implemented and s.harness_ok and not s.deployment_ok and not s.in_quick
        assert not applicable(s, deployment=True)[0]
        assert applicable(s, deployment=False) == (True, "")
        assert applicable(s, deployment=False, quick=True) == (False, FULL_ONLY)


def test_divergence_stacks_differ_in_exactly_their_setting() -> None:
    ctx = STACK_KINDS["ctx_div"]
    assert ctx.context_length("prefill") == CTX_DIV_PREFILL_CONTEXT
    assert ctx.context_length("decode") == 1024 > CTX_DIV_PREFILL_CONTEXT
    assert ctx.prefill_pool == ctx.decode_pool and ctx.auto_truncate and not ctx.chat_templates
    tpl = STACK_KINDS["tpl_div"]
    assert tpl.chat_templates and not tpl.auto_truncate
    assert tpl.context_length("prefill") == tpl.context_length("decode")
    assert tpl.prefill_pool == tpl.decode_pool
    inc = STACK_KINDS["p_lt_d_truncate"]
    assert (inc.context_length("prefill"), inc.context_length("decode")) == (320, 1024)
    assert STACK_KINDS["d_lt_p"].context_length("prefill") == 768  # shared: the smaller pool
    # Legs that may refuse to pair get no router (its start waits for one good generation).
    for name in ("ctx_div", "tpl_div", "p_lt_d_truncate"):
        assert not STACK_KINDS[name].router, name
    for name in ("divergence-context-length", "divergence-chat-template"):
        s = SCENARIOS[name]
        assert s.implemented and s.known_unsafe_upstream and s.family == "divergence"
        assert applicable(s, deployment=False)[0]
        assert not applicable(s, deployment=True)[0]  # needs its own server configuration


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_chat_templates_render_to_the_judged_token_ids(role: str) -> None:
    """The server renders the template and tokenizes the text; the scenario judges against
    ``content + CHAT_SUFFIX["decode"]``: both must be the same ids."""
    words = word_vocab(DEFAULT_MODEL)
    tok = tokenizers.Tokenizer.from_file(str(Path(DEFAULT_MODEL) / "tokenizer.json"))
    content = [20, 21, 22, 27, 300, 301]
    text = jinja2.Template(chat_template_text(CHAT_SUFFIX[role], words)).render(
        messages=[{"role": "user", "content": " ".join(words[t] for t in content)}])
    assert tok.encode(text).ids == content + list(CHAT_SUFFIX[role])
    assert all(owner_of(t, len(words)) is None for t in CHAT_SUFFIX[role])  # no canary owner
    assert len(CHAT_SUFFIX["decode"]) - len(CHAT_SUFFIX["prefill"]) == 3


def test_chat_answers_are_read_like_generate_answers() -> None:
    ok = client._parse_chat(200, {"choices": [{"finish_reason": "length",
                                               "response_token_ids": [5, 6, 7],
                                               "prompt_token_ids": [1, 2]}]})
    assert ok.output_ids == [5, 6, 7] and ok.prompt_ids == [1, 2] and ok.ok
    assert classify(ok, [5, 6, 7])[0] is Outcome.IDENTICAL
    assert classify(ok, [5, 6, 8])[0] is Outcome.LEAK
    refused = client._parse_chat(500, {"object": "error", "message": "pair refused",
                                       "code": 500})
    assert classify(refused, [5])[0] is Outcome.EXPLICIT_ERROR
    assert "pair refused" in refused.message
    aborted = client._parse_chat(200, {"choices": [{"finish_reason": "abort",
                                                    "message": {"content": "coverage"}}]})
    assert classify(aborted, [5])[0] is Outcome.EXPLICIT_ERROR
    empty = client._parse_chat(200, {"choices": []})
    # A 200 without an answer counts as other content (never identical, never an error).
    assert classify(empty, [5])[0] is Outcome.LEAK
    body = client.chat_payload("w1 w2", 4, model="m")
    assert body["return_token_ids"] and body["temperature"] == 0.0 and not body["stream"]


def test_smoke_is_quick_on_one_stack_and_still_sees_the_bug() -> None:
    a = parse_args(["--smoke"])
    assert a.quick and a.scenarios == list(SMOKE_SCENARIOS)
    assert a.backends == ["mooncake"] and a.page_sizes == [1]
    assert set(a.variants) == {"base", "fork"}
    assert a.out.name == "bench-smoke"
    stacks = {SCENARIOS[n].stack for n in SMOKE_SCENARIOS}
    assert stacks == {"default"}
    assert "steady-state" in SMOKE_SCENARIOS
    assert any(SCENARIOS[n].known_unsafe_upstream for n in SMOKE_SCENARIOS)
    assert all(SCENARIOS[n].implemented for n in SMOKE_SCENARIOS)
    with pytest.raises(SystemExit):
        parse_args(["--smoke", "--scenarios", "steady-state"])


def test_quick_leaves_full_only_scenarios_to_the_full_matrix() -> None:
    s = dataclasses.replace(SCENARIOS["divergence-chat-template"], in_quick=False)
    assert applicable(s, deployment=False) == (True, "")
    ok, why = applicable(s, deployment=False, quick=True)
    assert not ok and why == FULL_ONLY
    planned = _planned("planned-x", "room", "a scenario registered before it runs", "ownership")
    assert applicable(planned, deployment=False, quick=True) == (False, planned.reason)
    assert parse_args(["--quick", "--scenarios", "divergence-chat-template"]).scenarios_named
    assert not parse_args(["--quick"]).scenarios_named
    assert not parse_args(["--smoke"]).scenarios_named
