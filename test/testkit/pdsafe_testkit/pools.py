"""Real upstream KV pools in layouts this CPU cannot select by itself (test and benchmark only)."""

from __future__ import annotations

import os
from typing import Any

import torch

_LAYOUT_ENV = "SGLANG_AITER_KV_CACHE_LAYOUT"


def vectorized_5d_pool(*, size: int, page_size: int, heads: int, head_dim: int, layers: int,
                       dtype: torch.dtype = torch.bfloat16) -> Any:
    """A real ``MHATokenToKVPool`` in ROCm AITER's ``vectorized_5d`` layout, built on the CPU by
    upstream's own constructor: only its platform flag is set for the build (the layout needs
    AITER's kernels to be *written*, not to be laid out)."""
    from sglang.srt.mem_cache import memory_pool as mp

    old_env, old_flag = os.environ.get(_LAYOUT_ENV), mp._use_aiter
    os.environ[_LAYOUT_ENV], mp._use_aiter = "vectorized_5d", True
    try:
        pool = mp.MHATokenToKVPool(size=size, page_size=page_size, dtype=dtype, head_num=heads,
                                   head_dim=head_dim, layer_num=layers, device="cpu",
                                   enable_memory_saver=False, enable_alt_stream=False)
    finally:
        mp._use_aiter = old_flag
        if old_env is None:
            os.environ.pop(_LAYOUT_ENV, None)
        else:
            os.environ[_LAYOUT_ENV] = old_env
    assert pool.kv_cache_layout == "vectorized_5d" and pool.k_buffer[0].dim() == 5
    return pool
