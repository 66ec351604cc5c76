"""The incident's shape as the walk scales it (``pdsafe_testkit.incident``) and the benchmark's
probe lengths on it (``benchmark.incident``), without servers.

The walk is only a reproduction of the incident if its pools keep the incident's proportions
(prefill pool 65 % of the context, a decode pool above both), if step 3's ``--context-length``
is the pool step 1's refusal names, if the auto-truncate realignment really makes both legs
advertise one limit (computed with the servers' own ``sglang.pdsafe.limits``), and if the
over-long probes include prompts between the prefill's pool and the context (where stock
hands off a placeholder). Servers: test/pd/test_incident_walk.py.
"""

from __future__ import annotations

import pytest
from pdsafe_testkit import incident as inc
from sglang.pdsafe import limits
from sglang.pdsafe.admission import CLAMP_FLAG

from benchmark.incident import PROBE_NEW, probe_lengths


def test_shape_matches_the_product_and_the_incident() -> None:
    shape = inc.Shape.scaled()
    assert inc.CLAMP_FLAG == CLAMP_FLAG
    assert shape.context == inc.model_context() == 4096
    ratio = inc.INCIDENT_PREFILL_POOL / inc.INCIDENT_CONTEXT
    assert abs(shape.prefill_pool / shape.context - ratio) < 1 / shape.context
    assert shape.decode_pool >= shape.context + inc.RESERVED_DECODE_TOKENS
    assert shape.decode_pool > shape.prefill_pool


def _leg(mode: str, shape: inc.Shape, context: int) -> limits.LegLimit:
    kv = shape.kv(mode)
    return limits.leg_limit(mode, kv_capacity=kv,
                            upstream_limit=limits.upstream_max_req_input_len(context, kv),
                            page_size=shape.page_size,
                            reserved_decode_tokens=(inc.RESERVED_DECODE_TOKENS
                                                    if mode == "decode" else 0))


@pytest.mark.parametrize("page", [1, 16, 64])
def test_working_context_and_the_auto_truncate_alignment(page: int) -> None:
    shape = inc.Shape.scaled(page_size=page)
    ctx = shape.working_context
    assert ctx == shape.kv("prefill") == shape.prefill_pool // page * page
    p, d = _leg("prefill", shape, ctx), _leg("decode", shape, ctx)
    # Page 1: both legs advertise the same limit at once; above 5 the prefill's page
    # rounding puts its limit below decode's, and the guide's rule realigns them.
    assert (p.max_prompt_tokens == d.max_prompt_tokens) == (page <= 5)
    aligned = inc.aligned_context(ctx, p.max_prompt_tokens, d.max_prompt_tokens)
    p2, d2 = _leg("prefill", shape, aligned), _leg("decode", shape, aligned)
    assert p2.max_prompt_tokens == d2.max_prompt_tokens == p.max_prompt_tokens


@pytest.mark.parametrize("page", [1, 16, 64])
def test_probes_cover_the_incidents_band(page: int) -> None:
    shape = inc.Shape.scaled(page_size=page)
    limit = _leg("prefill", shape, shape.working_context).max_prompt_tokens
    within, over = probe_lengths(shape, limit)
    assert within == [limit - 1, limit]
    assert over and all(limit < n <= shape.context - 2 * PROBE_NEW for n in over)
    assert any(shape.kv("prefill") < n < shape.context for n in over)
    assert limit + 1 in over and shape.context - 2 * PROBE_NEW in over
