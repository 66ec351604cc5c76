"""The startup capacity invariant's logic (``sglang.pdsafe.admission.enforce_kv_capacity``), no
servers. With real servers: test/admission/test_startup_capacity.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang.pdsafe import admission
from sglang.pdsafe.admission import CLAMP_FLAG as CLAMP


def _args(mode: str, clamp: bool = False, reserved: int = 512) -> SimpleNamespace:
    return SimpleNamespace(disaggregation_mode=mode, num_reserved_decode_tokens=reserved,
                           disaggregation_clamp_context_to_kv_capacity=clamp)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_enforce_refuses_pd_below_context(mode):
    with pytest.raises(admission.CapacityInvariantError) as e:
        admission.enforce_kv_capacity(_args(mode), 600, 4096)
    msg = str(e.value)
    assert "holds 600 tokens" in msg and "context length 4096" in msg
    assert "--context-length" in msg and CLAMP in msg


def test_enforce_clamps_with_flag_and_leaves_colocated_alone():
    assert admission.enforce_kv_capacity(_args("prefill", clamp=True), 600, 4096) == 600
    assert admission.enforce_kv_capacity(_args("null"), 600, 4096) == 4096
    assert admission.enforce_kv_capacity(_args("decode"), 4096, 4096) == 4096


def test_enforce_refuses_decode_pool_not_above_reserved_decode_tokens():
    """Such a decode server could never pre-allocate a request (its warmup hangs upstream)."""
    with pytest.raises(admission.CapacityInvariantError) as e:
        admission.enforce_kv_capacity(_args("decode", clamp=True), 512, 4096)
    assert "--num-reserved-decode-tokens 512" in str(e.value)
    assert admission.enforce_kv_capacity(_args("prefill", clamp=True), 512, 4096) == 512
