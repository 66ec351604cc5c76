"""The KV digest covers the speculative-decoding draft pool the PD transfer carries with the
target pool (issue 20, item 2, first half; ``kv_digest.draft_components``, patch 0021 passes
each leg's ``draft_token_to_kv_pool``).

Upstream 0.5.23 appends the draft pool's buffers (EAGLE, MTP) to ``kv_data_ptrs`` and writes
them for the same token indices as the target's; the fork digested the target pool only, so
stale or foreign draft KV (which seeds speculation) went unchecked, with no log and no counter.
Real upstream pools on the CPU: an MHA target with an MHA draft (EAGLE's shape) and an MLA
target with an MLA draft (DeepSeek/GLM MTP's). What it does not show: a draft transfer over a
real backend (``test/kv/test_kv_digest_layouts.py`` does: the KV harness's ``mha-draft`` and
``mla-draft`` lanes, over the real Mooncake and NIXL), and a speculative-decoding server end to
end (no draft model runs on the CPU engine here).
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


def _dsa(layers: int, group: int, extra: int = 2) -> Any:
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_dcp_size=1):
        pool = mp.DSATokenToKVPool(size=1024, page_size=64 * group, kv_lora_rank=32,
                                   dtype=torch.bfloat16, qk_rope_head_dim=16, layer_num=layers,
                                   index_head_dim=128, kv_cache_dim=48, index_kpool=group,
                                   index_kpool_compress=True, tail_extra_slots=extra,
                                   max_running_requests=4, **CPU)
    g = torch.Generator().manual_seed(layers * 10 + group)
    bufs = list(pool.kv_buffer) + list(pool.index_k_with_scale_buffer) + [
        t for lid in range(layers) for t in pool.get_compress_tail_buffers(lid)]
    for b in bufs:
        b.view(torch.uint8).copy_(torch.randint(0, 256, b.view(torch.uint8).shape,
                                                generator=g, dtype=torch.uint8))
    return pool


def test_a_grouped_dsa_draft_is_digested_index_and_tail_included() -> None:
    """MTP's draft of a GLM-5.3-Flash-style target: both DSA with index_kpool 4 and the
    compressed tail. The draft's index entries and its tail-ring rows (the request's row,
    addressed like the target's) are digested: a flipped bit in either changes the digest. A
    draft whose grouping differs from the target's is refused, not half digested."""
    target, draft = _dsa(2, 4), _dsa(1, 4)
    prepared = kd.prepare(target, draft)
    names = {c.name for c in prepared.components}
    assert {"draft.index.k4", "draft.tail_k", "draft.tail_score"} <= names
    row = torch.arange(256 * 2, 256 * 2 + 256 + 7, dtype=torch.int32)  # page 2, then 7 more
    length, mine = int(row.numel()), 1

    def digest() -> bytes:
        return kd.digest_request(prepared, row, prefix=0, length=length, room=ROOM,
                                 tail_row=mine).value

    base = digest()
    index = draft.index_k_with_scale_buffer[0].view(torch.uint8)
    index[2, 0] ^= 1  # page 2, entry 0: the first entry's first key byte
    assert digest() != base, "a draft index bit flip went unseen"
    index[2, 0] ^= 1
    tail_k, _ = draft.get_compress_tail_buffers(0)
    slot = (length - length % 4) % 6  # the ring row of the last, partial group
    tail_k[mine, slot].view(torch.uint8)[0] ^= 1
    assert digest() != base, "a draft tail-ring bit flip went unseen"
    tail_k[mine, slot].view(torch.uint8)[0] ^= 1
    assert digest() == base
    with pytest.raises(kd.UnsupportedLayout, match="grouping"):
        kd.prepare(target, _dsa(1, 4, extra=3))  # another ring: other tail rows
