"""The KV digest covers the speculative-decoding draft pool the PD transfer carries with the
target pool (issue 20, item 2, first half; ``kv_digest.draft_components``, patch 0021 passes
each leg's ``draft_token_to_kv_pool``).

Upstream 0.5.23 appends the draft pool's buffers (EAGLE, MTP) to ``kv_data_ptrs`` and writes
them for the same token indices as the target's; the fork digested the target pool only, so
stale or foreign draft KV (which seeds speculation) went unchecked, with no log and no counter.
Real upstream pools on the CPU: an MHA target with an MHA draft (EAGLE's shape) and an MLA
target with an MLA draft (DeepSeek/GLM MTP's). What it does not show: a draft transfer over a
real backend (the KV harness), and a speculative-decoding server end to end (no draft model
runs on the CPU engine here).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from sglang.pdsafe import kv_digest as kd
from sglang.pdsafe import kv_integrity
from sglang.srt.mem_cache import memory_pool as mp

CPU = {"device": "cpu", "enable_memory_saver": False}
ROOM = 77


def _mha(layers: int) -> Any:
    return mp.MHATokenToKVPool(size=300, page_size=1, dtype=torch.bfloat16, head_num=2,
                               head_dim=16, layer_num=layers, enable_alt_stream=False, **CPU)


def _mla(layers: int) -> Any:
    return mp.MLATokenToKVPool(size=300, page_size=1, dtype=torch.bfloat16, kv_lora_rank=32,
                               qk_rope_head_dim=16, layer_num=layers, **CPU)


def _buffers(pool: Any) -> list[torch.Tensor]:
    if hasattr(pool, "k_buffer"):
        return list(pool.k_buffer) + list(pool.v_buffer)
    return list(pool.kv_buffer)


def _fill(pool: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for b in _buffers(pool):
        b.view(torch.uint8).copy_(torch.randint(0, 256, b.view(torch.uint8).shape,
                                                generator=g, dtype=torch.uint8))


@pytest.fixture(params=["mha", "mla"])
def pools(request) -> tuple[Any, Any]:
    make = _mha if request.param == "mha" else _mla
    target, draft = make(3), make(1)
    _fill(target, 1)
    _fill(draft, 2)
    return target, draft


ROW = torch.tensor(random.Random(3).sample(range(1, 300), 48), dtype=torch.int32)


def _digest(prepared: kd.Prepared) -> kd.KvDigest:
    return kd.digest_request(prepared, ROW, prefix=4, length=48, room=ROOM)


def test_a_bit_flip_in_the_draft_kv_changes_the_digest(pools) -> None:
    target, draft = pools
    prepared = kd.prepare(target, draft)
    assert any(c.name.startswith("draft.") for c in prepared.components)
    base = _digest(prepared)
    for buf in _buffers(draft):
        row = int(ROW[random.Random(buf.numel()).randrange(4, 48)])
        cell = buf[row].view(torch.uint8).reshape(-1)
        cell[0] ^= 1
        assert _digest(prepared).value != base.value, "a draft bit flip went unseen"
        cell[0] ^= 1
    assert _digest(prepared).value == base.value
    # Outside the request's range: not its KV, not digested.
    outside = int(ROW[2])
    _buffers(draft)[0][outside].view(torch.uint8).reshape(-1)[0] ^= 1
    assert _digest(prepared).value == base.value


def test_a_leg_without_the_draft_never_shares_a_signature(pools) -> None:
    target, draft = pools
    with_draft, without = kd.prepare(target, draft), kd.prepare(target)
    assert with_draft.signature.digest != without.signature.digest
    assert "draft=" in with_draft.signature.text and "draft=" not in without.signature.text


def test_scrub_zeroes_the_draft_rows_too(pools) -> None:
    target, draft = pools
    prepared = kd.prepare(target, draft)
    kd.scrub_request(prepared, ROW, prefix=4, length=48)
    owned = ROW[4:48].to(torch.int64)
    for buf in _buffers(draft) + _buffers(target):
        assert not bool(buf[owned].any())


def test_the_digester_of_a_leg_takes_its_draft_pool(pools) -> None:
    target, draft = pools
    d = kv_integrity.Digester(target, draft)
    assert {c.name.split(".")[0] for c in d.prepared.components} >= {"draft"}
    assert d.prepared.signature == kd.prepare(target, draft).signature


def test_a_draft_pool_of_a_refused_layout_refuses_the_digest() -> None:
    class Unclassified(mp.MHATokenToKVPool):
        pass

    draft = Unclassified(size=300, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=16,
                         layer_num=1, enable_alt_stream=False, **CPU)
    with pytest.raises(kd.UnsupportedLayout, match="Unclassified"):
        kd.prepare(_mha(2), draft)
