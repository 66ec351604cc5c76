"""Unit tests of the KV content digest (sglang.pdsafe.kv_digest) on REAL sglang pools, on CPU.

Every layout below is a real ``sglang.srt.mem_cache`` pool class built on ``device="cpu"`` and
filled with random bytes. The bytes a request owns are located here *independently* of the
module: from the pools' own buffers (``k_buffer``, ``v_buffer``, the scale buffers,
``kv_buffer``, the DSA index page layout that ``IndexKeyCache.move`` documents, the SWA
sub-pool through the full-to-SWA mapping, ``mamba_cache``), so a component the module forgot,
or addressed wrongly, shows up as an undetected flip or a flip outside the range that changes
the digest.

Layouts covered: MHA (bf16 page 16, fp16 page 64 with several leaves per component, fp8 store,
FP4 with scales, MXFP8 with flat scales and with the page-128 interleaved scales), K-only
(MHATokenToKOnlyPool), MLA, MLA FP4, DSA (MLA latent + indexer keys and scales), SWA (full +
sliding-window sub-pools), hybrid linear attention (MHA full layers + Mamba2 conv and temporal
state per request slot).

Not covered, and why: ``MiniMaxSparseKVPool`` (its constructor needs a pipeline layer range and
composes three sub-pools with a sparse index; ``components`` refuses it as an unknown layout),
``PageMajorMHATokenToKVPool`` (0.5.23 raises NotImplementedError when it is built), HND and
AITER ``vectorized_5d`` MHA layouts (PD transfer refuses them too), DSA with ``index_kpool > 1``
or the AITER preshuffled index, ``NoOpMHATokenToKVPool``, the DeepSeek-V4, QSA and unified
(virtual page id) pools: all refused with ``UnsupportedLayout`` (one representative is tested);
the Mamba ReplaySSM / speculative scratch buffers are not transferred, so not digested.
"""

from __future__ import annotations

import random
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from sglang.pdsafe import kv_digest as kd
from sglang.srt.mem_cache import memory_pool as mp
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

CPU = {"device": "cpu", "enable_memory_saver": False}
ROOM = 0xDEAD_BEEF_0042


def _randomize(tensors: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in tensors:
        u8 = t.view(torch.uint8)
        u8.copy_(torch.randint(0, 256, u8.shape, dtype=torch.uint8, generator=g))


def _locs(pages: list[int], page_size: int, tokens: int) -> torch.Tensor:
    """Positions on the given pages, in order: the request's req_to_token row."""
    locs = [p * page_size + o for p in pages for o in range(page_size)]
    return torch.tensor(locs[:tokens], dtype=torch.int32)


# A byte target: a uint8 view into a pool buffer; every byte of it is owned (or not owned).
Region = tuple[str, torch.Tensor]


@dataclass
class Case:
    name: str
    pool: Any
    row: torch.Tensor
    prefix: int
    length: int
    owned: list[Region]
    outside: list[Region]
    kwargs: dict[str, Any] = field(default_factory=dict)
    trials: int = 60

    def digest(self, **over: Any) -> kd.KvDigest:
        args: dict[str, Any] = {"prefix": self.prefix, "length": self.length, "room": ROOM,
                                "generation": 0, **self.kwargs}
        args.update(over)
        return kd.digest_request(self.pool, self.row, **args)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _slot_regions(name: str, bufs: list[torch.Tensor], slots: list[int]) -> list[Region]:
    return [(f"{name}[{li}][{s}]", _u8(b)[s]) for li, b in enumerate(bufs) for s in slots]


def _split(row: torch.Tensor, prefix: int, length: int, page_size: int,
           other: torch.Tensor) -> tuple[list[int], list[int]]:
    """Owned slots, and slots outside: the last page's unowned tail, the prefix, another
    request's slots."""
    owned = [int(x) for x in row[prefix:length]]
    last = owned[-1]
    tail = list(range(last + 1, (last // page_size + 1) * page_size))
    outside = tail + [int(x) for x in row[:prefix]] + [int(x) for x in other]
    assert not set(owned) & set(outside)
    return owned, outside


def _tail_nonempty(owned: list[int], page_size: int) -> None:
    assert (owned[-1] + 1) % page_size != 0, "the case must end on a partial page"


# --------------------------------------------------------------------------- layouts


def case_mha(page_size: int = 16, dtype: torch.dtype = torch.bfloat16, heads: int = 2,
             head_dim: int = 16, size: int = 512, pages: tuple[int, ...] = (5, 2, 9),
             tokens: int = 37, prefix: int = 0, trials: int = 200,
             cls: type = mp.MHATokenToKVPool, name: str = "") -> Case:
    pool = cls(size=size, page_size=page_size, dtype=dtype, head_num=heads,
               head_dim=head_dim, layer_num=2, enable_alt_stream=False, **CPU)
    bufs = list(pool.k_buffer) + list(pool.v_buffer)
    scales = [b for b in (getattr(pool, "k_scale_buffer", None) or []) +
              (getattr(pool, "v_scale_buffer", None) or [])]
    _randomize(bufs + scales, seed=page_size)
    row = _locs(list(pages), page_size, tokens)
    other = _locs([max(pages) + 1, max(pages) + 2], page_size, page_size + 3)
    owned, outside = _split(row, prefix, tokens, page_size, other)
    _tail_nonempty(owned, page_size)
    regions = _slot_regions("kv", bufs, owned)
    out_regions = _slot_regions("kv", bufs, outside)
    interleaved = getattr(pool, "mxfp8_sf_interleaved", False)
    if scales and interleaved:
        # (pages, head, 32, page // 32, sf): the scales of slot o of page p are [p, :, o%32, o//32]
        def at(b: torch.Tensor, s: int) -> torch.Tensor:
            p, o = divmod(s, page_size)
            return _u8(b)[p, :, o % 32, o // 32, :]
        regions += [(f"scale[{s}]", at(b, s)) for b in scales for s in owned]
        out_regions += [(f"scale[{s}]", at(b, s)) for b in scales for s in outside]
    elif scales:
        regions += _slot_regions("scale", scales, owned)
        out_regions += _slot_regions("scale", scales, outside)
    return Case(name or f"{cls.__name__}-{dtype}-p{page_size}", pool, row, prefix, tokens,
                regions, out_regions, trials=trials)


def _vectorized_5d_pool(page_size: int = 16, heads: int = 2, head_dim: int = 32,
                        size: int = 512) -> Any:
    from pdsafe_testkit.pools import vectorized_5d_pool

    return vectorized_5d_pool(size=size, page_size=page_size, heads=heads, head_dim=head_dim,
                              layers=2)


def _v5d_slot_regions(pool: Any, slots: list[int]) -> list[Region]:
    """The bytes of each slot in upstream's documented vectorized_5d shapes: K
    ``(pages, H, Dk // X, page, X)`` at ``[p, :, :, o, :]``; V ``(pages, H, page // X, Dv, X)``
    at ``[p, :, o // X, :, o % X]`` (element ``o % X`` of the last dim is ``esize`` bytes)."""
    page = int(pool.page_size)
    out: list[Region] = []
    for li, (k, v) in enumerate(zip(pool.k_buffer, pool.v_buffer, strict=True)):
        x, es = int(v.shape[-1]), v.element_size()
        for s in slots:
            p, o = divmod(s, page)
            out.append((f"k5d[{li}][{s}]", _u8(k)[p, :, :, o, :]))
            out.append((f"v5d[{li}][{s}]",
                        _u8(v)[p, :, o // x, :, (o % x) * es:(o % x + 1) * es]))
    return out


def case_vectorized_5d() -> Case:
    pool = _vectorized_5d_pool()
    _randomize(list(pool.k_buffer) + list(pool.v_buffer), seed=5)
    row = _locs([5, 2, 9], 16, 37)
    other = _locs([10, 11], 16, 19)
    owned, outside = _split(row, 0, 37, 16, other)
    _tail_nonempty(owned, 16)
    return Case("mha-vectorized_5d-p16", pool, row, 0, 37, _v5d_slot_regions(pool, owned),
                _v5d_slot_regions(pool, outside), trials=120)


def case_konly() -> Case:
    pool = mp.MHATokenToKOnlyPool(size=256, page_size=16, dtype=torch.bfloat16, head_num=2,
                                  head_dim=16, layer_num=2, **CPU)
    _randomize(list(pool.k_buffer), 3)
    row = _locs([3, 6], 16, 20)
    owned, outside = _split(row, 0, 20, 16, _locs([1], 16, 16))
    return Case("KOnly", pool, row, 0, 20, _slot_regions("k", list(pool.k_buffer), owned),
                _slot_regions("k", list(pool.k_buffer), outside))


def case_mla(cls: type = mp.MLATokenToKVPool) -> Case:
    pool = cls(size=256, page_size=16, dtype=torch.bfloat16, kv_lora_rank=32,
               qk_rope_head_dim=16, layer_num=3, **CPU)
    bufs = list(pool.kv_buffer) + list(getattr(pool, "kv_scale_buffer", None) or [])
    _randomize(bufs, 4)
    row = _locs([4, 1, 7], 16, 16 + 16 + 9)
    owned, outside = _split(row, 16, len(row), 16, _locs([2], 16, 16))
    return Case(cls.__name__, pool, row, 16, len(row), _slot_regions("kv", bufs, owned),
                _slot_regions("kv", bufs, outside))


def case_dsa() -> Case:
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_dcp_size=1):
        pool = mp.DSATokenToKVPool(size=256, page_size=64, kv_lora_rank=32,
                                   dtype=torch.bfloat16, qk_rope_head_dim=16, layer_num=2,
                                   index_head_dim=128, kv_cache_dim=48, **CPU)
    idx_bufs = list(pool.index_k_with_scale_buffer)
    _randomize(list(pool.kv_buffer) + idx_bufs, 5)
    row = _locs([2, 1], 64, 64 + 21)
    owned, outside = _split(row, 0, len(row), 64, _locs([3], 64, 10))
    return Case("DSA", pool, row, 0, len(row),
                _slot_regions("kv", list(pool.kv_buffer), owned)
                + _index_regions(idx_bufs, owned, 64),
                _slot_regions("kv", list(pool.kv_buffer), outside)
                + _index_regions(idx_bufs, outside, 64))


def _index_regions(bufs: list[torch.Tensor], entries: list[int], per_page: int,
                   dim: int = 128) -> list[Region]:
    """The key and scale bytes of each index entry (a token with index_kpool 1): an
    IndexKeyCache page row holds its ``per_page`` entries' key bytes (``dim`` each), then their
    scale bytes (4 each)."""
    out = []
    for b in bufs:
        for e in entries:
            p, o = divmod(e, per_page)
            out.append((f"index_k[{e}]", b[p, o * dim:(o + 1) * dim]))
            out.append((f"index_scale[{e}]",
                        b[p, per_page * dim + o * 4:per_page * dim + o * 4 + 4]))
    return out


def _dsa_kpool_pool(group: int = 4, compress: bool = True, extra: int = 2) -> Any:
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_dcp_size=1):
        return mp.DSATokenToKVPool(size=1024, page_size=64 * group, kv_lora_rank=32,
                                   dtype=torch.bfloat16, qk_rope_head_dim=16, layer_num=2,
                                   index_head_dim=128, kv_cache_dim=48, index_kpool=group,
                                   index_kpool_compress=compress, tail_extra_slots=extra,
                                   max_running_requests=4, **CPU)


def case_dsa_kpool() -> Case:
    """GLM-5.3-Flash's indexer: index_kpool 4 (a 256-token KV page has one 64-entry index page;
    four positions share an entry) with the compressed index, whose last ``length % 4``
    positions live in the request's tail ring (6 rows, wrapping here). Prefix: one page that
    decode holds; the request ends mid-group on a partial page."""
    group, page, dim, ring, mine = 4, 256, 128, 6, 2
    pool = _dsa_kpool_pool(group)
    idx_bufs = list(pool.index_k_with_scale_buffer)
    tails = [t for lid in range(2) for t in pool.get_compress_tail_buffers(lid)]
    _randomize(list(pool.kv_buffer) + idx_bufs + tails, 8)
    row = _locs([2, 1, 3], page, 2 * page + 23)  # 535 positions: 535 % 4 = 3 in the tail
    prefix, length = page, len(row)
    owned, outside = _split(row, prefix, length, page, _locs([0], page, 0))
    entries = page // group

    def entry_of(loc: int) -> int:
        return loc // page * entries + loc % page // group

    own_entries = sorted({entry_of(loc) for loc in owned})
    # Entries no owned position maps to: decode's prefix page, and the groups of the last
    # page after the last owned position's group.
    other_entries = sorted({entry_of(loc) for loc in outside} - set(own_entries))
    n = length % group
    start = (length - n) % ring
    own_slots = [(start + i) % ring for i in range(n)]
    assert own_slots == [4, 5, 0], "the case must wrap the ring"
    own_tail = [(f"tail[{mine}][{s}]", _u8(t)[mine, s]) for t in tails for s in own_slots]
    other_tail = [(f"tail[{r}][{s}]", _u8(t)[r, s]) for t in tails for r in range(t.shape[0])
                  for s in range(ring) if (r, s) not in {(mine, x) for x in own_slots}]
    return Case("DSA-kpool4-compress", pool, row, prefix, length,
                _slot_regions("kv", list(pool.kv_buffer), owned)
                + _index_regions(idx_bufs, own_entries, entries, dim) + own_tail,
                _slot_regions("kv", list(pool.kv_buffer), outside)
                + _index_regions(idx_bufs, other_entries, entries, dim) + other_tail,
                kwargs={"tail_row": mine})


def case_swa() -> Case:
    page = 16
    pool = SWAKVPool(size=256, size_swa=128, page_size=page, dtype=torch.bfloat16, head_num=2,
                     head_dim=16, swa_attention_layer_ids=[0, 2], full_attention_layer_ids=[1, 3],
                     enable_alt_stream=False, **CPU)
    full = [*pool.full_kv_pool.k_buffer, *pool.full_kv_pool.v_buffer]
    swa = [*pool.swa_kv_pool.k_buffer, *pool.swa_kv_pool.v_buffer]
    _randomize(full + swa, 6)
    length, window = 37, 20
    row = _locs([5, 2, 9], page, length)
    other = _locs([3], page, 16)
    # full -> SWA mapping (what the SWA allocator keeps); every position of both requests is
    # still mapped, the ones before the window too (they must not count).
    mapping = torch.zeros(256 + page + 1, dtype=torch.int64)
    swa_slots = _locs([2, 4, 6], page, length).to(torch.int64)
    mapping[row.long()] = swa_slots
    other_swa = _locs([5], page, 16).to(torch.int64)
    mapping[other.long()] = other_swa
    pool.register_mapping(mapping)
    start = length - window
    owned_full, outside_full = _split(row, 0, length, page, other)
    owned_swa = [int(x) for x in swa_slots[start:]]
    outside_swa = [int(x) for x in swa_slots[:start]] + [int(x) for x in other_swa] + list(
        range(owned_swa[-1] + 1, (owned_swa[-1] // page + 1) * page))
    return Case("SWA", pool, row, 0, length,
                _slot_regions("full", full, owned_full) + _slot_regions("swa", swa, owned_swa),
                _slot_regions("full", full, outside_full)
                + _slot_regions("swa", swa, outside_swa),
                kwargs={"swa_window": window})


def _mamba_pool() -> Any:
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape

    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=64, n_groups=1,
                                    num_heads=4, head_dim=16, state_size=8, conv_kernel=4)
    return mp.MambaPool(size=8, spec_state_size=0,
                        cache_params=Mamba2CacheParams(shape=shape, layers=[0, 2]),
                        mamba_layer_ids=[0, 2], device="cpu")


def case_hybrid_linear() -> Case:
    mamba = _mamba_pool()
    pool = mp.HybridLinearKVPool(size=256, dtype=torch.bfloat16, page_size=16, head_num=2,
                                 head_dim=16, full_attention_layer_ids=[1, 3], device="cpu",
                                 mamba_pool=mamba)
    full = [*pool.full_kv_pool.k_buffer, *pool.full_kv_pool.v_buffer]
    states = [*mamba.mamba_cache.conv, mamba.mamba_cache.temporal]
    _randomize(full + states, 7)
    row = _locs([4, 2], 16, 25)
    owned, outside = _split(row, 0, 25, 16, _locs([6], 16, 16))
    mine, others = 3, [1, 5]
    # state tensors are [layer, slot, ...]: the request's slot in every layer
    own_state = [(f"state[{li}][{mine}]", _u8(t)[li, mine]) for t in states
                 for li in range(t.shape[0])]
    other_state = [(f"state[{li}][{s}]", _u8(t)[li, s]) for t in states
                   for li in range(t.shape[0]) for s in others]
    return Case("HybridLinear+Mamba2", pool, row, 0, 25,
                _slot_regions("full", full, owned) + own_state,
                _slot_regions("full", full, outside) + other_state,
                kwargs={"state_indices": [mine]})


CASES: dict[str, Callable[[], Case]] = {
    "mha-bf16-p16": lambda: case_mha(16),
    "mha-fp16-p64-leaves": lambda: case_mha(64, torch.float16, heads=4, head_dim=64, size=1024,
                                            pages=(3, 9, 1, 12, 6), tokens=300, prefix=64),
    "mha-fp8": lambda: case_mha(16, torch.float8_e4m3fn, trials=60),
    "mha-fp4": lambda: case_mha(16, torch.bfloat16, cls=mp.MHATokenToKVPoolFP4, trials=60),
    "mha-mxfp8-flat": lambda: case_mha(16, torch.bfloat16, head_dim=32,
                                       cls=mp.MHATokenToKVPoolMXFP8, trials=60),
    "mha-mxfp8-interleaved": lambda: case_mha(128, torch.bfloat16, head_dim=32, size=512,
                                              pages=(2, 1), tokens=128 + 45,
                                              cls=mp.MHATokenToKVPoolMXFP8, trials=60),
    "mha-vectorized_5d": case_vectorized_5d,
    "konly": case_konly,
    "mla": case_mla,
    "mla-fp4": lambda: case_mla(mp.MLATokenToKVPoolFP4),
    "dsa": case_dsa,
    "dsa-kpool4-compress": case_dsa_kpool,
    "swa": case_swa,
    "hybrid-linear-mamba2": case_hybrid_linear,
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    return CASES[request.param]()


def _flip(region: torch.Tensor, rnd: random.Random) -> tuple[torch.Tensor, int, int]:
    flat_index = rnd.randrange(region.numel())
    pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), region.shape))
    bit = 1 << rnd.randrange(8)
    region[pos] ^= bit
    return region, flat_index, bit


def _unflip(region: torch.Tensor, flat_index: int, bit: int) -> None:
    pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), region.shape))
    region[pos] ^= bit


# --------------------------------------------------------------------------- detection


def test_one_bit_flip_in_any_owned_byte_changes_the_digest(case: Case) -> None:
    """A flipped bit at a random offset of a random owned row of any component (K, V, scales,
    latent, index, SWA window, state; the partial last page's owned slots) is detected, every
    time; flipping it back restores the digest (no false alarm)."""
    base = case.digest()
    rnd = random.Random(f"flip-{case.name}")
    last_slot = int(case.row[case.length - 1])
    last = [r for r in case.owned if r[0].endswith(f"[{last_slot}]")]
    assert case.owned and (last or "state" in case.name or "SWA" in case.name)
    for trial in range(case.trials):
        # every fourth trial hits the last (partial) page's last owned slot
        name, region = rnd.choice(last if last and trial % 4 == 0 else case.owned)
        region, i, bit = _flip(region, rnd)
        try:
            assert case.digest().value != base.value, f"flip in {name} byte {i} not detected"
        finally:
            _unflip(region, i, bit)
    assert case.digest() == base


def test_bytes_outside_the_owned_range_do_not_change_it(case: Case) -> None:
    """Another request's slots, the unowned tail of the last page, the prefix, positions before
    the SWA window, other state slots: rewriting them leaves the digest equal."""
    base = case.digest()
    rnd = random.Random(f"outside-{case.name}")
    gen = torch.Generator().manual_seed(rnd.randrange(1 << 30))
    assert case.outside
    for _ in range(max(case.trials // 2, 40)):
        _, region = rnd.choice(case.outside)
        region.copy_(torch.randint(0, 256, region.shape, dtype=torch.uint8, generator=gen))
    assert case.digest() == base
    # ... and the same regions are really in the pool: flipping an owned byte still counts
    name, region = case.owned[0]
    region, i, bit = _flip(region, rnd)
    try:
        assert case.digest().value != base.value
    finally:
        _unflip(region, i, bit)


def test_paths_agree_and_are_deterministic(case: Case) -> None:
    """The zero-copy and gather paths hash the same bytes (the GPU path must too)."""
    ref = case.digest(path="gather")
    assert case.digest(path="auto") == ref
    prepared = kd.prepare(case.pool)
    assert kd.digest_request(prepared, case.row, prefix=case.prefix, length=case.length,
                             room=ROOM, **case.kwargs) == ref
    if all(c.rows is not None for c in kd.components(case.pool)):
        assert case.digest(path="stream") == ref
    assert case.digest(path="gather") == ref


def test_transfer_buffers_are_all_digested(case: Case) -> None:
    """Every buffer the PD transfer registers for the pool is the storage of a component."""
    comps = kd.components(case.pool)
    ptrs = {c.storage_ptr for c in comps}
    registered = kd._transfer_buffers(case.pool)
    assert all(p in ptrs for _, p in registered)
    names = {c.name.split(".")[-1] for c in comps}
    assert names & {"k", "kv"}


# --------------------------------------------------------------------------- the definition


def _reference_mha(pool: Any, row: torch.Tensor, prefix: int, length: int, room: int,
                   generation: int) -> bytes:
    """The documented definition, written out independently for a plain MHA pool."""
    comps = [("k", i, b) for i, b in enumerate(pool.k_buffer)] + [
        ("v", i, b) for i, b in enumerate(pool.v_buffer)]
    dtype = str(pool.k_buffer[0].dtype).removeprefix("torch.")
    shape = "x".join(str(d) for d in pool.k_buffer[0].shape[1:])
    sig = ";".join([kd.SCHEME, f"leaf={kd.LEAF_BYTES}", f"byteorder={sys.byteorder}",
                    "pool=MHATokenToKVPool"] + [f"{n}@{li}:{dtype}:{shape}:token"
                                                 for n, li, _ in comps])
    locs = [int(x) for x in row[prefix:length]]
    body = b""
    for _, _, b in comps:
        rows = [b[s].contiguous().view(torch.uint8).numpy().tobytes() for s in locs]
        t = max(1, kd.LEAF_BYTES // len(rows[0]))
        leaves = [xxhash.xxh3_128_digest(b"".join(rows[i:i + t])) for i in range(0, len(rows), t)]
        body += struct.pack("<Q", len(rows)) + b"".join(leaves)
    header = kd.MAGIC + xxhash.xxh3_128_digest(sig.encode()) + struct.pack(
        "<7Q", room, generation, prefix, length - prefix, 0, 0, len(comps))
    return xxhash.xxh3_128_digest(header + body)


@pytest.mark.parametrize("leaf_bytes", [kd.LEAF_BYTES, 200])
def test_digest_equals_the_documented_definition(monkeypatch: pytest.MonkeyPatch,
                                                 leaf_bytes: int) -> None:
    monkeypatch.setattr(kd, "LEAF_BYTES", leaf_bytes)  # 200: several leaves of 1 row, paths mix
    c = CASES["mha-fp16-p64-leaves"]()
    want = _reference_mha(c.pool, c.row, c.prefix, c.length, ROOM, 3)
    for path in ("auto", "stream", "gather"):
        assert c.digest(generation=3, path=path).value == want


def test_scattered_slots_page_size_one_paths_agree() -> None:
    pool = mp.MHATokenToKVPool(size=300, page_size=1, dtype=torch.bfloat16, head_num=4,
                               head_dim=32, layer_num=2, enable_alt_stream=False, **CPU)
    _randomize(list(pool.k_buffer) + list(pool.v_buffer), 9)
    row = torch.tensor(random.Random(1).sample(range(1, 300), 250), dtype=torch.int32)
    d = {p: kd.digest_request(pool, row, prefix=0, length=250, room=1, path=p)
         for p in ("auto", "stream", "gather")}
    assert d["auto"] == d["stream"] == d["gather"]
    assert d["auto"].value == _reference_mha(pool, row, 0, 250, 1, 0)


def test_planning_is_vectorized_and_counts_pieces_like_the_plan() -> None:
    """Issue 22: at 1M fragmented positions the per-run Python plan took seconds. The piece
    count that chooses stream or gather is computed from the runs without building the plan,
    equal to the plan's own count; a fragmented row is gathered with no plan built, a
    contiguous one streamed; and the digest is the same either way."""
    rnd = random.Random(7)
    for _ in range(200):
        idx = sorted(rnd.sample(range(1, 5000), rnd.randint(1, 400)))
        if rnd.random() < 0.5:  # long consecutive runs too
            idx = sorted(set(idx) | set(range(idx[0], idx[0] + rnd.randint(1, 300))))
        runs = kd._runs(np.asarray(idx, dtype=np.int64))
        assert sum(runs[1].tolist()) == len(idx)
        for t in (1, 3, 64, 2048):
            plan = kd._leaf_plan(runs, t)
            assert kd._pieces(runs[1], t) == sum(len(leaf) for leaf in plan)
            assert [s for leaf in plan for s, n in leaf for s in range(s, s + n)] == idx
    pool = mp.MHATokenToKVPool(size=4200, page_size=1, dtype=torch.bfloat16, head_num=1,
                               head_dim=16, layer_num=1, enable_alt_stream=False, **CPU)
    _randomize(list(pool.k_buffer) + list(pool.v_buffer), 3)
    every_other = torch.arange(2, 4202, 2, dtype=torch.int32)  # 2100 runs of one slot
    plan = kd.plan_request(pool, every_other, prefix=0, length=2100)
    assert plan.streams == [None, None]  # gathered: no per-run plan was built
    contiguous = torch.arange(1, 2101, dtype=torch.int32)
    assert all(s is not None for s in kd.plan_request(pool, contiguous, prefix=0,
                                                      length=2100).streams)
    for row in (every_other, contiguous):
        d = {p: kd.digest_request(pool, row, prefix=0, length=2100, room=5, path=p)
             for p in ("auto", "stream", "gather")}
        assert d["auto"] == d["stream"] == d["gather"]
        assert d["auto"].value == _reference_mha(pool, row, 0, 2100, 5, 0)


def test_upstream_writer_on_owned_slot_changes_digest_tail_does_not() -> None:
    """Through upstream's own ``set_kv_buffer``: the slot of an owned position counts, the slot
    right after the last position (same page) does not."""
    c = CASES["mha-bf16-p16"]()
    base = c.digest()
    last = int(c.row[c.length - 1])
    layer = SimpleNamespace(layer_id=1, k_scale=None, v_scale=None)
    kv = torch.full((1, 2, 16), 3.0, dtype=torch.bfloat16)
    c.pool.set_kv_buffer(layer, torch.tensor([last + 1]), kv, kv)
    assert c.digest() == base
    c.pool.set_kv_buffer(layer, torch.tensor([last]), kv, kv)
    assert c.digest().value != base.value


def test_scrub_zeroes_exactly_the_owned_rows_of_every_component() -> None:
    """A fake transfer's pages are zeroed before it decodes: every owned row of every
    component becomes zero, every other row keeps its bytes."""
    pool = mp.MHATokenToKVPool(size=300, page_size=1, dtype=torch.bfloat16, head_num=4,
                               head_dim=32, layer_num=2, enable_alt_stream=False, **CPU)
    bufs = list(pool.k_buffer) + list(pool.v_buffer)
    _randomize(bufs, 11)
    before = [b.clone() for b in bufs]
    row = torch.tensor(random.Random(2).sample(range(1, 300), 40), dtype=torch.int32)
    owned = row[5:40].to(torch.int64)
    assert kd.scrub_request(pool, row, prefix=5, length=40) == 35 * 4  # 2 layers x K, V
    for b, old in zip(bufs, before, strict=True):
        assert not bool(b[owned].any())
        rest = torch.ones(b.shape[0], dtype=torch.bool)
        rest[owned] = False
        assert torch.equal(b[rest].view(torch.uint8), old[rest].view(torch.uint8))


def test_scrub_refuses_a_layout_it_cannot_address_before_writing_anything() -> None:
    pool = mp.MHATokenToKVPool(size=64, page_size=1, dtype=torch.bfloat16, head_num=1,
                               head_dim=8, layer_num=1, enable_alt_stream=False, **CPU)
    prepared = kd.prepare(pool)
    broken = replace(prepared, components=prepared.components[:1] + (
        replace(prepared.components[1], clear=None),))
    _randomize(list(pool.k_buffer) + list(pool.v_buffer), 3)
    snapshot = pool.k_buffer[0].clone()
    with pytest.raises(kd.UnsupportedLayout, match="cannot zero"):
        kd.scrub_request(broken, torch.arange(1, 9), prefix=0, length=8)
    assert torch.equal(pool.k_buffer[0].view(torch.uint8), snapshot.view(torch.uint8)), \
        "nothing is written before the refusal"


def test_vectorized_5d_digests_each_token_like_its_nhd_row() -> None:
    """The same logical KV in an NHD pool and in a vectorized_5d pool (copied slot by slot
    through upstream's documented shapes, not through the digest's own indexing) has the same
    digest and signature: the digest reads each token's (H, D) row whatever the layout."""
    v5d = _vectorized_5d_pool()
    nhd = mp.MHATokenToKVPool(size=512, page_size=16, dtype=torch.bfloat16, head_num=2,
                              head_dim=32, layer_num=2, enable_alt_stream=False, **CPU)
    _randomize(list(nhd.k_buffer) + list(nhd.v_buffer), seed=21)
    _randomize(list(v5d.k_buffer) + list(v5d.v_buffer), seed=22)  # nothing shared by chance
    row = _locs([4, 7, 1], 16, 40)
    x = int(v5d.v_buffer[0].shape[-1])
    for k5, v5, kn, vn in zip(v5d.k_buffer, v5d.v_buffer, nhd.k_buffer, nhd.v_buffer,
                              strict=True):
        for s in (int(i) for i in row):
            p, o = divmod(s, 16)
            for h in range(2):
                for d in range(32):
                    k5[p, h, d // x, o, d % x] = kn[s, h, d]
                    v5[p, h, o // x, d, o % x] = vn[s, h, d]
    a = kd.digest_request(nhd, row, prefix=0, length=40, room=ROOM, generation=3)
    b = kd.digest_request(v5d, row, prefix=0, length=40, room=ROOM, generation=3)
    assert a == b and kd.verify(a, b).ok
    # one element of one token differs: the layouts' digests differ too
    s = int(row[17])
    v5d.v_buffer[1][s // 16, 1, (s % 16) // x, 5, (s % 16) % x] += 1
    assert kd.digest_request(v5d, row, prefix=0, length=40, room=ROOM, generation=3) != a


def test_vectorized_5d_scrub_zeroes_exactly_the_owned_tokens() -> None:
    pool = _vectorized_5d_pool()
    _randomize(list(pool.k_buffer) + list(pool.v_buffer), seed=8)
    row = _locs([3, 6], 16, 25)
    owned = _v5d_slot_regions(pool, [int(i) for i in row[4:25]])
    kept = _v5d_slot_regions(pool, [int(i) for i in row[:4]] + list(range(6 * 16 + 9, 7 * 16)))
    before = [r.clone() for _, r in kept]
    assert kd.scrub_request(pool, row, prefix=4, length=25) == 21 * 4
    assert all(not bool(r.any()) for _, r in owned)
    assert all(torch.equal(r, b) for (_, r), b in zip(kept, before, strict=True))


def test_hnd_is_refused_because_upstream_pd_does_not_transfer_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """HND (``SGLANG_USE_HND_KVCACHE``) cannot be checked because upstream's PD transfer does
    not serve it: the real pool's ``get_contiguous_buf_infos`` (what PD registers) refuses, and
    the digest refuses with that reason rather than digesting a layout nobody transfers."""
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    pool = mp.MHATokenToKVPool(size=240, page_size=16, dtype=torch.bfloat16, head_num=2,
                               head_dim=16, layer_num=1, enable_alt_stream=False, **CPU)
    assert pool.kv_cache_layout == "hnd" and pool.k_buffer[0].dim() == 4
    with pytest.raises(AssertionError, match="not supported with disagg"):
        pool.get_contiguous_buf_infos()
    with pytest.raises(kd.UnsupportedLayout, match="HND layout.*does not serve it"):
        kd.prepare(pool)


def test_upstream_dsa_tail_payload_raises_for_a_plain_grouped_dsa_pool() -> None:
    """Pinned upstream 0.5.23 bug (found by the KV harness, issue 20 item 7): both PD queues'
    ``_dsa_tail_payload`` (disaggregation/prefill.py:1726, decode.py:1779) pass the KV pool
    itself to ``get_dsa_tail_state_indices``; for a plain ``DSATokenToKVPool`` with the
    compressed index (GLM-5.3-Flash's indexer) ``use_dsa`` is True (MLATokenToKVPool sets
    it), so the function reads ``pool.full_kv_pool`` (disaggregation/utils.py:1270-1271),
    which only ``HybridLinearKVPool`` has: a PD transfer of such a pool raises before its
    tail ring is sent. Given the hybrid shape, the same function gives the ring segments
    whose rows the digest reads (``DsaGeometry.tail_rows``). When this test fails, upstream
    fixed it: drop the adapter in ``pdsafe_testkit.kv.scheduler_glue.Lane.state_indices``."""
    from sglang.srt.disaggregation.utils import get_dsa_tail_state_indices

    pool = _dsa_kpool_pool()
    assert pool.use_dsa and not hasattr(pool, "full_kv_pool")
    with pytest.raises(AttributeError, match="full_kv_pool"):
        get_dsa_tail_state_indices(pool, 2, 535)
    # 535 = 133 * 4 + 3: three tail positions from ring slot 532 % 6 = 4, wrapping (4, 5, 0)
    segments = get_dsa_tail_state_indices(SimpleNamespace(use_dsa=True, full_kv_pool=pool),
                                          2, 535)
    assert segments == [2, 4, 2, 0, 1, 6]
    geo = kd.dsa_geometry(pool)
    assert geo is not None and list(geo.tail_rows(2, 535)) == [2 * 6 + 4, 2 * 6 + 5, 2 * 6]


# --------------------------------------------------------------------------- bindings


def test_every_bound_field_changes_the_digest() -> None:
    c = CASES["mha-bf16-p16"]()
    base = c.digest()
    assert c.digest() == base  # deterministic
    assert c.digest(room=ROOM + 1).value != base.value
    assert c.digest(generation=1).value != base.value
    assert c.digest(length=c.length - 1).value != base.value
    # the same owned rows, reached with another prefix: only the bound prefix differs
    shifted = torch.cat([torch.tensor([16, 17, 18], dtype=torch.int32), c.row])
    d = kd.digest_request(c.pool, shifted, prefix=3, length=c.length + 3, room=ROOM)
    assert d.token_count == base.token_count and d.value != base.value


def test_layout_signature_binds_dtype_and_shape() -> None:
    """Identical bytes in a pool of another dtype or another head split: other signature, other
    digest."""
    def pool_of(dtype: torch.dtype, heads: int, dim: int) -> Any:
        p = mp.MHATokenToKVPool(size=256, page_size=16, dtype=dtype, head_num=heads,
                                head_dim=dim, layer_num=2, enable_alt_stream=False, **CPU)
        _randomize(list(p.k_buffer) + list(p.v_buffer), 11)  # same bytes in all three
        return p
    row = _locs([3, 4], 16, 20)
    ds = [kd.digest_request(pool_of(dt, h, d), row, prefix=0, length=20, room=1)
          for dt, h, d in ((torch.bfloat16, 2, 16), (torch.float16, 2, 16),
                           (torch.bfloat16, 4, 8))]
    assert len({d.signature for d in ds}) == 3 and len({d.value for d in ds}) == 3
    assert not kd.verify(ds[0], ds[1]).ok


# --------------------------------------------------------------------------- verify


def test_verify_has_no_skip_case() -> None:
    c = CASES["mha-bf16-p16"]()
    good = c.digest()
    ok = kd.verify(good, c.digest(), rid="HEALTH_CHECK_123")
    assert ok.ok and ok.outcome is kd.Outcome.OK
    zero_value = replace(good, value=bytes(16))
    zero_sig = replace(good, signature=bytes(16))
    short = replace(good, value=b"\x01")
    other_sig = replace(good, signature=bytes(15) + b"\x07")
    other_value = replace(good, value=bytes(a ^ b for a, b in zip(good.value, bytes(15) + b"\x01",
                                                                  strict=True)))
    for expected, actual, outcome in (
            (None, good, kd.Outcome.MISSING), (zero_value, good, kd.Outcome.MISSING),
            (zero_sig, good, kd.Outcome.MISSING), (short, good, kd.Outcome.MISSING),
            (good, None, kd.Outcome.MISSING), (good, zero_value, kd.Outcome.MISSING),
            (other_sig, good, kd.Outcome.LAYOUT), (other_value, good, kd.Outcome.MISMATCH),
            (replace(good, room=1), good, kd.Outcome.BINDING),
            (replace(good, generation=2), good, kd.Outcome.BINDING)):
        for rid in ("req-1", "HEALTH_CHECK_abc"):  # a health-check-looking rid is no exemption
            v = kd.verify(expected, actual, rid=rid)
            assert not v.ok and v.outcome is outcome, (expected, actual, v)
            assert "KV integrity check failed" in v.message and rid in v.message
    assert kd.verify(other_value, good).message.count(str(ROOM)) == 1


def test_words_roundtrip() -> None:
    d = CASES["mha-bf16-p16"]().digest()
    words = d.to_words()
    assert len(words) == 4 and all(0 <= w < 1 << 64 for w in words)
    back = kd.KvDigest.from_words(words, room=d.room, generation=d.generation, prefix=d.prefix,
                                  token_count=d.token_count)
    assert kd.verify(back, d).ok


# --------------------------------------------------------------------------- fail closed


def test_unknown_layout_and_untracked_transfer_buffer_are_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    class MyPool(mp.MHATokenToKVPool):
        pass

    p = MyPool(size=64, page_size=16, dtype=torch.bfloat16, head_num=2, head_dim=16,
               layer_num=1, enable_alt_stream=False, **CPU)
    with pytest.raises(kd.UnsupportedLayout, match="MyPool"):
        kd.components(p)
    c = CASES["mha-bf16-p16"]()
    extra = torch.zeros(64, dtype=torch.uint8)
    real = c.pool.get_contiguous_buf_infos

    def with_extra() -> tuple[list[int], list[int], list[int]]:
        ptrs, lens, items = real()
        return ptrs + [extra.data_ptr()], lens + [64], items + [64]
    monkeypatch.setattr(c.pool, "get_contiguous_buf_infos", with_extra)
    with pytest.raises(kd.UnsupportedLayout, match="no digested component"):
        c.digest()


def test_missing_inputs_are_errors_not_skips() -> None:
    swa = CASES["swa"]()
    with pytest.raises(ValueError, match="swa_window"):
        swa.digest(swa_window=None)
    hyb = CASES["hybrid-linear-mamba2"]()
    with pytest.raises(ValueError, match="state_indices"):
        hyb.digest(state_indices=[])
    # a window position whose SWA KV was freed (mapped to the padding slot 0)
    swa.pool.full_to_swa_index_mapping[int(swa.row[swa.length - 1])] = 0
    with pytest.raises(ValueError, match="padding slot 0"):
        swa.digest()
    mha = CASES["mha-bf16-p16"]()
    with pytest.raises(ValueError, match="out of range"):
        kd.digest_request(mha.pool, torch.tensor([10**6]), prefix=0, length=1, room=1)


def test_grouped_index_addressing_matches_upstream() -> None:
    """``DsaGeometry``: the tail rows are exactly the ring slots upstream's PD transfer sends
    (``get_dsa_tail_state_indices``, every length over three ring turns), and each position's
    index entry is the one upstream's index page layout gives (entries listed once, in
    order); without the compressed index there is no tail."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.utils import get_dsa_tail_state_indices

    pool = _dsa_kpool_pool(4)
    geo = kd.dsa_geometry(pool)
    assert geo == kd.DsaGeometry(page=256, group=4, compress=True, ring=6)
    stand_in = SimpleNamespace(kpool_use_compress=True, index_kpool=4, tail_extra_slots=2)
    for length in range(1, 3 * 6 * 4):
        got = [int(r) for r in geo.tail_rows(3, length)]
        up = get_dsa_tail_state_indices(stand_in, 3, length)
        want = [] if not up else (
            [3 * 6 + s for s in range(up[1], up[1] + up[2])]
            + [3 * 6 + s for s in range(up[3], up[3] + up[4])])
        assert got == want, (length, got, up)
    locs = np.array([256 * 2 + o for o in range(0, 19)] + [256 * 5 + o for o in range(3, 9)])
    want_entries: list[int] = []
    for loc in locs:
        e = int(loc) // 256 * 64 + int(loc) % 256 // 4
        if not want_entries or want_entries[-1] != e:
            want_entries.append(e)
    assert geo.entries(locs).tolist() == want_entries
    assert kd.dsa_geometry(_dsa_kpool_pool(4, compress=False)).tail_rows(3, 7).size == 0
    assert kd.dsa_geometry(case_dsa().pool) is None  # index_kpool 1: token-addressed


def test_a_grouped_index_needs_the_tail_row_and_scrub_zeroes_it() -> None:
    c = case_dsa_kpool()
    with pytest.raises(ValueError, match="req_pool_idx"):
        kd.digest_request(c.pool, c.row, prefix=c.prefix, length=c.length, room=ROOM)
    base = c.digest()
    n = kd.scrub_request(c.pool, c.row, prefix=c.prefix, length=c.length, tail_row=2)
    assert n > 0
    for name, region in c.owned:
        assert int(region.sum()) == 0, f"{name} not zeroed"
    assert c.digest() != base
