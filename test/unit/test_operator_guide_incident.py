"""docs/operator-guide.md, "A KV pool smaller than the context length", quotes the messages the
operator sees on the way from the incident's configuration to a working pair, with the
incident's numbers; this test builds each message with the function the server builds it with
(the same numbers) and checks that the section quotes exactly those, in the operator's order, so
the guide cannot drift from the code (issue 22, item 2).

The numbers: context 1,048,576, prefill pool 681,280, decode pool 1,310,720, page size 64, the
prefill's bootstrap address 10.0.0.1:8998. The prompt limits come from ``sglang.pdsafe.limits``
(each leg's ``max_req_input_len`` as the server computes it, from upstream's formula and the
leg's scheduling arithmetic), so the quoted pairing lines and the 400 are the servers' own.
The walk on real servers: test/pd/test_incident_walk.py.
"""

from __future__ import annotations

import re
from pathlib import Path

from sglang.pdsafe import limits
from sglang.pdsafe.admission import (
    CLAMP_FLAG,
    PromptTooLongError,
    capacity_refusal,
    clamp_warning,
)
from sglang.pdsafe.pair_agreement import Mismatch, pairing_message, refusal_message

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "operator-guide.md"
HEADING = "## A KV pool smaller than the context length"

CONTEXT = 1_048_576
PREFILL_POOL = 681_280
DECODE_POOL = 1_310_720
PAGE = 64
RESERVED = 512  # upstream's default --num-reserved-decode-tokens
ADDR = "10.0.0.1:8998"
LONG_PROMPT = 700_000


def _section() -> str:
    text = GUIDE.read_text()
    start = text.index(HEADING)
    end = text.find("\n## ", start + len(HEADING))
    return text[start:end if end != -1 else None]


def _quotes(section: str) -> list[str]:
    """The fenced blocks of the section, in order (one message each, indentation stripped)."""
    return [b.strip() for b in re.findall(r"```\n(.*?)\n\s*```", section, flags=re.S)]


def _leg(mode: str, pool: int, context: int) -> limits.LegLimit:
    kv = limits.floor_page(pool, PAGE)
    return limits.leg_limit(mode, kv_capacity=kv,
                            upstream_limit=limits.upstream_max_req_input_len(context, kv),
                            page_size=PAGE,
                            reserved_decode_tokens=RESERVED if mode == "decode" else 0)


def _expected() -> tuple[list[str], int]:
    """The messages of the operator's path, in its order, and step 3's aligned context."""
    working = PREFILL_POOL
    p, d = _leg("prefill", PREFILL_POOL, working), _leg("decode", DECODE_POOL, working)
    aligned = working - (d.max_prompt_tokens - p.max_prompt_tokens)
    p2, d2 = _leg("prefill", PREFILL_POOL, aligned), _leg("decode", DECODE_POOL, aligned)
    assert p2.max_prompt_tokens == d2.max_prompt_tokens, (p2, d2)
    return [
        capacity_refusal("prefill", PREFILL_POOL, CONTEXT),
        clamp_warning(PREFILL_POOL, CONTEXT),
        refusal_message(ADDR, [Mismatch("context_length", PREFILL_POOL, CONTEXT)]),
        pairing_message(ADDR, p.max_prompt_tokens, d.max_prompt_tokens),
        str(PromptTooLongError(LONG_PROMPT, p.max_req_input_len, working, PREFILL_POOL)),
        pairing_message(ADDR, p2.max_prompt_tokens, d2.max_prompt_tokens),
    ], aligned


def test_the_section_quotes_the_servers_messages_in_the_operators_order() -> None:
    expected, _ = _expected()
    quoted = _quotes(_section())
    assert quoted == expected, "\n\n".join(
        f"quote {i}:\n  guide: {q}\n  code:  {e}"
        for i, (q, e) in enumerate(zip(quoted + [""] * len(expected),
                                       expected + [""] * len(quoted), strict=False))
        if q != e)


def test_the_section_names_the_numbers_and_remedies_the_code_uses() -> None:
    text = _section()
    _, aligned = _expected()
    p = _leg("prefill", PREFILL_POOL, PREFILL_POOL)
    d = _leg("decode", DECODE_POOL, PREFILL_POOL)
    assert f"`--context-length {PREFILL_POOL}`" in " ".join(text.split())
    assert f"`--context-length {aligned}`" in text
    assert f"differ by {d.max_prompt_tokens - p.max_prompt_tokens} tokens" in text
    assert CLAMP_FLAG in text
    # The remedy the server gives at pairing is the one the guide's step 3 follows.
    assert "start both with the same --context-length" in refusal_message(
        ADDR, [Mismatch("context_length", 1, 2)])
    steps = [text.index(s) for s in ("**The first start is refused.**",
                                     "**The clamp on one leg is refused at pairing.**",
                                     "**The same `--context-length` on both legs")]
    assert steps == sorted(steps)


def test_the_install_section_points_here_instead_of_recommending_the_clamp() -> None:
    text = GUIDE.read_text()
    install = text[text.index("## Install on GPU machines"):text.index(HEADING)]
    assert "see the next section" in install
    assert f"or pass `{CLAMP_FLAG}`" not in install
