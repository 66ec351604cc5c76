"""Each PD leg's prompt limit is the longest prompt it can schedule (issue #7, finding 14).

``sglang.pdsafe.limits`` gives closed forms; these tests hold them against the real upstream
0.5.23 classes on an idle pool, so a rebase that changes upstream's admission arithmetic fails
here instead of as a request that waits forever:

* prefill: the real ``PrefillAdder.add_one_req`` with a real paged (or token) allocator and a
  real ``UnifiedRadixCache`` (what a 0.5.23 server builds by default) or ``RadixCache``, each
  enabled and disabled (with ``ignore_eos`` a disabled cache takes the second admission path),
  with and without chunked prefill. The limit is admitted, one more token is not.
* decode: upstream's pre-allocation arithmetic (``DecodePreallocQueue._required_alloc_tokens``
  and ``_required_admission_tokens``, called on a stand-in queue) against the real allocator's
  ``prealloc_fits`` with the whole pool as budget (an idle decode), and the allocator's
  ``max_new_tokens_for_memory`` (decode keeps room for one new token).

No servers; with servers: test/pd/test_liveness_limits.py.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from sglang.pdsafe import limits
from sglang.srt.disaggregation.decode import DecodePreallocQueue
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import PrefillAdder
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.runtime_context import publish, reset_context
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

PAGES = (1, 2, 4, 16, 64)
POOLS = (512, 1024, 1536)


@pytest.fixture(autouse=True)
def prefill_context() -> Iterator[None]:
    """The scheduler classes read the published server arguments (a PD prefill's)."""
    reset_context()
    publish(ServerArgs(model_path="dummy", disaggregation_mode="prefill", device="cpu"),
            role="scheduler")
    yield
    reset_context()


def _allocator(pool: int, page: int):
    if page == 1:
        return TokenToKVPoolAllocator(pool, torch.float32, "cpu", None, False)
    return PagedTokenToKVPoolAllocator(pool, page, torch.float32, "cpu", None, False)


def prefill_admits(pool: int, page: int, prompt: int, *, radix_disabled: bool,
                   chunk: int | None, ignore_eos: bool = True, unified: bool = True) -> bool:
    """Whether upstream's PrefillAdder admits (the first chunk of) a ``prompt``-token PD
    prefill request on an idle ``pool``-token KV pool."""
    alloc = _allocator(pool, page)
    req_pool = ReqToTokenPool(size=4, max_context_len=pool + 2 * page, device="cpu",
                              enable_memory_saver=False)
    params = CacheInitParams(disable=radix_disabled, req_to_token_pool=req_pool,
                             token_to_kv_pool_allocator=alloc, page_size=page)
    if unified:
        params.tree_components = (ComponentType.FULL,)
        cache = UnifiedRadixCache(params)
    else:
        cache = RadixCache(params)
    # A PD prefill runs every request with max_new_tokens = 1 (PrefillBootstrapQueue).
    params = SamplingParams(max_new_tokens=limits.PD_PREFILL_MAX_NEW_TOKENS,
                            ignore_eos=ignore_eos)
    params.normalize(None)
    req = Req("r", "", array("q", [5] * prompt), params)
    req.init_next_round_input(cache)
    adder = PrefillAdder(page, cache, alloc, None, 1.0, 1 << 20, chunk)
    adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    return req in adder.can_run_list


@pytest.mark.parametrize("unified", [True, False], ids=["unified", "radix"])
@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("radix_disabled", [False, True])
def test_prefill_limit_is_exactly_what_the_prefill_adder_admits(page, pool, radix_disabled,
                                                                unified):
    best, binding, _ = limits.prefill_max_prompt(pool, page, radix_cache_disabled=radix_disabled)
    kw = {"radix_disabled": radix_disabled, "unified": unified}
    for chunk in (None, 128):
        for ignore_eos in (True, False):
            fits = prefill_admits(pool, page, best, chunk=chunk, ignore_eos=ignore_eos, **kw)
            assert fits, (pool, page, best, chunk, ignore_eos, binding)
        for below in (1, best // 2, best - page, best - 1):
            assert prefill_admits(pool, page, max(below, 1), chunk=chunk, **kw)
    # One token more waits forever on an idle pool on the path the limit names.
    assert not prefill_admits(pool, page, best + 1, chunk=128, ignore_eos=True, **kw)


def test_prefill_limit_values():
    """The numbers behind finding 14 (pool 512): upstream advertised 505 for every page."""
    assert limits.upstream_max_req_input_len(512, 512) - 1 == 505
    assert limits.prefill_max_prompt(512, 1, radix_cache_disabled=False)[0] == 509
    assert limits.prefill_max_prompt(512, 16, radix_cache_disabled=False)[0] == 494
    assert limits.prefill_max_prompt(512, 64, radix_cache_disabled=False)[0] == 446
    assert limits.prefill_max_prompt(512, 64, radix_cache_disabled=True)[0] == 384


def _upstream_decode_fits(pool: int, page: int, reserved: int, prompt: int,
                          max_new: int) -> bool:
    """Upstream's decode pre-allocation on an idle server (budget = the whole pool)."""
    alloc = _allocator(pool, page)
    queue = SimpleNamespace(token_to_kv_pool_allocator=alloc,
                            num_reserved_decode_tokens=reserved,
                            _rebootstrap_prefill_len=DecodePreallocQueue._rebootstrap_prefill_len)
    req = SimpleNamespace(origin_input_ids=[5] * prompt, output_ids=[],
                          sampling_params=SimpleNamespace(max_new_tokens=max_new))
    fill = DecodePreallocQueue._pre_alloc_fill_len(req)
    allocated = DecodePreallocQueue._required_alloc_tokens(queue, fill_len=fill, prefix_len=0)
    required = DecodePreallocQueue._required_admission_tokens(queue, req, allocated, 0, 0)
    return alloc.prealloc_fits(None, required, required, full_budget_tokens=alloc.available_size())


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("pool,reserved", [(1024, 512), (1280, 512), (896, 512), (800, 512),
                                           (1024, 64), (600, 500)])
def test_decode_limit_is_exactly_what_decode_preallocates(page, pool, reserved):
    best, binding, _ = limits.decode_max_prompt(pool, page, reserved)
    assert best >= 1
    max_new = 4  # the tokenizer keeps prompt + max_new within the context length
    assert _upstream_decode_fits(pool, page, reserved, best, max_new), (pool, page, best)
    assert not _upstream_decode_fits(pool, page, reserved, best + 1, max_new) or \
        binding == "decode-new-token", (pool, page, best)
    # ...and the scheduler leaves it at least one new token.
    alloc = _allocator(pool, page)
    assert alloc.max_new_tokens_for_memory(best, max_new, token_capacity=pool,
                                           sliding_window_size=None, chunk_size=None) >= 1


def _args(mode: str, reserved: int = 512, radix_disabled: bool = False) -> SimpleNamespace:
    return SimpleNamespace(disaggregation_mode=mode, num_reserved_decode_tokens=reserved,
                           disable_radix_cache=radix_disabled)


def test_pd_input_limit_lowers_each_leg_and_leaves_colocated_alone():
    up = limits.upstream_max_req_input_len(512, 512)  # 506
    assert limits.pd_input_limit(_args("prefill"), 512, up, 64) == 447
    assert limits.pd_input_limit(_args("prefill"), 512, up, 16) == 495
    assert limits.pd_input_limit(_args("prefill"), 512, up, 1) == up  # upstream binds
    assert limits.pd_input_limit(_args("prefill", radix_disabled=True), 512, up, 64) == 385
    assert limits.pd_input_limit(_args("decode"), 896, up, 64) == 385  # floor_64(896-512)+1
    assert limits.pd_input_limit(_args("null"), 512, up, 64) == up


def test_pd_input_limit_refuses_a_leg_that_can_schedule_nothing():
    # Decode: 560 tokens are 8 pages of 64, all of them reserved for decoding.
    with pytest.raises(limits.NoSchedulablePromptError, match="num-reserved-decode-tokens"):
        limits.pd_input_limit(_args("decode", reserved=512), 560, 554, 64)
    # Prefill: one page cannot also hold the page of headroom admission keeps.
    with pytest.raises(limits.NoSchedulablePromptError, match="page-size"):
        limits.pd_input_limit(_args("prefill"), 64, 58, 64)


def test_leg_limit_names_the_binding_rule():
    lim = limits.leg_limit("prefill", kv_capacity=512, upstream_limit=506, page_size=64)
    assert (lim.max_prompt_tokens, lim.binding) == (446, "prefill-admission")
    assert "512" in lim.reason and "64" in lim.reason
    lim = limits.leg_limit("decode", kv_capacity=896, upstream_limit=506, page_size=64,
                           reserved_decode_tokens=512)
    assert (lim.max_prompt_tokens, lim.binding) == (384, "decode-preallocation")
    lim = limits.leg_limit("decode", kv_capacity=4096, upstream_limit=506, page_size=64,
                           reserved_decode_tokens=512)
    assert (lim.max_prompt_tokens, lim.binding) == (505, "upstream")
