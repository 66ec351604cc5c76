"""The KV digest's Triton path (sglang.pdsafe.kv_digest_triton) is bit-identical to the CPU path.

Every leaf digest the Triton kernels compute is compared with ``xxhash.xxh3_128_digest`` of the
same bytes (the CPU path's hash), for every short-input length 0..240 and for long inputs around
each of XXH3's internal boundaries (stripe 64, block 1024, the partial block, the last stripe,
the 64 KiB leaf), on random, all-zero and all-0xFF data, at aligned and unaligned offsets, for
each loop width (``blocks``). Then a whole :func:`kv_digest.digest_request` on the Triton path
against the CPU paths: over plain tensors (any venv: several components, odd row sizes, a row
larger than a leaf, a custom gather, several kernel launches) and over a real sglang
``MHATokenToKVPool`` (page 16, a partial last page; needs sglang, skipped without it).

Where they run: on a CUDA/HIP device when there is one; on a CPU in Triton's interpreter when
``TRITON_INTERPRET=1`` is set (scripts/triton-digest-check.sh: a venv with torch, triton and
xxhash but no sglang; or the main venv, which has triton, for the real-pool test:
``TRITON_INTERPRET=1 .venv/bin/python -m pytest test/gpu/test_kv_digest_triton.py``); skipped
otherwise (and when triton is not importable).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

pytest.importorskip("triton")

from sglang.pdsafe import kv_digest as kd  # noqa: E402  (after the triton skip)
from sglang.pdsafe import kv_digest_triton as kdt  # noqa: E402

if kdt.interpreting():
    DEVICE = torch.device("cpu")
elif kdt.available("cuda"):
    DEVICE = torch.device("cuda")
else:
    pytest.skip("no CUDA/HIP device, and TRITON_INTERPRET=1 was not set before the import",
                allow_module_level=True)

ROOM = 0x5EED_0010


def _data(n: int, kind: str, seed: int = 0) -> np.ndarray:
    if kind == "zero":
        return np.zeros(n, dtype=np.uint8)
    if kind == "ff":
        return np.full(n, 0xFF, dtype=np.uint8)
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _check(data: np.ndarray, offsets: list[int], lengths: list[int], **kw: Any) -> None:
    """Triton digests of the ranges equal xxhash's; on failure, names every bad (off, len)."""
    buf = torch.from_numpy(data).to(DEVICE)
    got = kdt.xxh3_128_leaves(buf, offsets, lengths, **kw)
    want = [xxhash.xxh3_128_digest(data[o:o + n].tobytes()) for o, n in zip(offsets, lengths,
                                                                            strict=True)]
    bad = [(o, n, g.hex(), w.hex()) for o, n, g, w in zip(offsets, lengths, got, want,
                                                           strict=True) if g != w]
    assert len(got) == len(want)
    assert bad == [], f"{len(bad)} of {len(want)} digests differ (off, len, triton, xxhash)"


# --------------------------------------------------------------------------- leaf level


@pytest.mark.parametrize("kind", ["random", "zero", "ff"])
def test_every_short_length_matches_xxhash(kind: str) -> None:
    """0..240 bytes: the 0, 1-3, 4-8, 9-16, 17-128 and 129-240 paths, each boundary included
    (random data: every length up to 40, then every 16-byte round count at three phases)."""
    if kind == "random":
        lengths = sorted({*range(0, 41), *range(41, 241, 7), *range(48, 241, 16),
                          *range(63, 241, 32), 128, 129, 159, 160, 161, 239, 240})
    else:
        lengths = [0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 32, 33, 64, 65, 96, 97, 127, 128,
                   129, 159, 160, 161, 191, 192, 193, 224, 239, 240]
    data = _data(kdt.SHORT_MAX + 8, kind, seed=1)
    _check(data, [3] * len(lengths), lengths)  # an odd offset: every read is unaligned


LONG = [241, 242, 255, 256, 257, 319, 320, 321, 511, 512, 513, 1000, 1023, 1024, 1025,
        1087, 1088, 1089, 2047, 2048, 2049, 3073, 4096, 5000, 8191, 16387]


@pytest.mark.parametrize("offset", [0, 8, 1, 5])
def test_long_lengths_match_xxhash(offset: int) -> None:
    """241..16 KiB around stripe (64) and block (1024) boundaries; aligned offsets read int64
    words, unaligned ones assemble them from bytes."""
    data = _data(offset + max(LONG), "random", seed=2)
    _check(data, [offset] * len(LONG), LONG)


@pytest.mark.parametrize("blocks", kdt.BLOCK_CHOICES)
def test_full_leaves_match_xxhash_for_every_loop_width(blocks: int) -> None:
    """64 KiB leaves (the digest's full leaf) and neighbours, for every blocks-per-step: the
    number of full blocks (63, 64) is not a multiple of every width."""
    lengths = [65536, 65535, 65537, 64 * 1024 - 64, 7 * 1024 + 1]
    data = _data(sum(lengths) + 8, "random", seed=3)
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).tolist()
    _check(data, offsets, lengths, blocks=blocks)


@pytest.mark.parametrize("kind", ["zero", "ff"])
def test_constant_data_long(kind: str) -> None:
    lengths = [241, 1024, 1025, 4096, 65536]
    _check(_data(65536, kind), [0] * len(lengths), lengths)


def test_many_leaves_in_one_launch_with_mixed_lengths() -> None:
    """Short, aligned-long and unaligned-long leaves in one call land at their own index."""
    rng = np.random.default_rng(4)
    lengths = rng.choice([0, 5, 17, 200, 240, 241, 777, 1024, 3000], size=24).tolist()
    offsets = rng.integers(0, 4000, size=24).tolist()
    _check(_data(8000, "random", seed=5), offsets, lengths)


@pytest.mark.parametrize("row_bytes,rows", [(2048, 75), (6, 25000), (100, 1311), (1, 300),
                                            (65536 + 8, 2)])
def test_leaf_digests_equal_the_cpu_leaves(row_bytes: int, rows: int) -> None:
    """``leaf_digests`` cuts rows into leaves of ``kv_digest.leaf_rows`` rows like the CPU path:
    several full leaves and a shorter last one (1-byte rows: one short leaf; 64 KiB + 8 rows:
    one row per leaf)."""
    arr = _data(rows * row_bytes, "random", seed=row_bytes).reshape(rows, row_bytes)
    t = kd.leaf_rows(row_bytes)
    want = [xxhash.xxh3_128_digest(arr[k:k + t].tobytes()) for k in range(0, rows, t)]
    got = kdt.leaf_digests(torch.from_numpy(arr).to(DEVICE), t)
    assert got == want


def test_a_leaf_outside_the_buffer_is_refused() -> None:
    buf = torch.zeros(100, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="outside"):
        kdt.xxh3_128_leaves(buf, [50], [51])
    with pytest.raises(ValueError, match="blocks"):
        kdt.xxh3_128_leaves(buf, [0], [10], blocks=3)
    assert kdt.xxh3_128_leaves(buf, [], []) == []


# --------------------------------------------------------------------------- the dispatch


def _plain_prepared(seed: int = 7) -> tuple[kd.Prepared, torch.Tensor]:
    """A Prepared 'pool' of plain tensors on DEVICE: MHA-like K/V rows (4 KiB: 16 per leaf),
    6-byte scale rows (not 8-aligned), a custom gather (page arithmetic) and a state component
    whose rows are larger than a leaf (one row per leaf). Returns it and the K buffer."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        size = torch.empty((), dtype=dtype).element_size()
        u8 = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8,
                           generator=g)
        return u8.view(dtype).to(DEVICE)

    slots, page = 160, 16
    k = rand(slots, 8, 256, dtype=torch.bfloat16)
    comps = [kd._row_component("k", 0, kd.Space.TOKEN, k),
             kd._row_component("v", 0, kd.Space.TOKEN, rand(slots, 8, 256, dtype=torch.bfloat16)),
             kd._row_component("k_scale", 0, kd.Space.TOKEN, rand(slots, 3, dtype=torch.float16))]
    paged = rand(slots // page, 5, page)  # slot o of page p is paged[p, :, o]

    def pick(idx: torch.Tensor) -> torch.Tensor:
        return paged[idx // page, :, idx % page]

    comps.append(kd._custom_component("paged", 0, kd.Space.TOKEN, paged, (5,), slots, pick))
    comps.append(kd._row_component("state", 0, kd.Space.STATE, rand(6, 65536 + 8)))
    assert all(c.device.type == DEVICE.type for c in comps)
    sig = kd.Signature("plain-test", xxhash.xxh3_128_digest(b"plain-test"))
    return kd.Prepared(pool=None, components=tuple(comps), signature=sig), k


def test_digest_request_triton_equals_gather_on_plain_tensors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    prep, k = _plain_prepared()
    row = torch.tensor(list(range(16, 30)) + list(range(96, 103)), dtype=torch.int64)
    args = {"prefix": 3, "length": len(row), "room": ROOM, "generation": 5,
            "state_indices": [4, 1]}
    ref = kd.digest_request(prep, row, path="gather", **args)
    assert kd.digest_request(prep, row, path="triton", **args) == ref
    # Small launches: components split into several chunks and several kernel launches.
    monkeypatch.setattr(kd, "DEVICE_BATCH_BYTES", 40_000)
    assert kd.digest_request(prep, row, path="triton", **args) == ref
    # One flipped bit in an owned K row changes it, alike on both paths.
    k.view(torch.uint8)[int(row[5]), 3, 100] ^= 0x10
    flipped = kd.digest_request(prep, row, path="triton", **args)
    assert flipped != ref
    assert flipped == kd.digest_request(prep, row, path="gather", **args)


def test_auto_takes_the_device_path_only_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU pools never take the Triton path on ``auto`` (even under the interpreter); CUDA
    components do when Triton is available there, unless SGLANG_PDSAFE_KV_DIGEST_TRITON=0."""
    cpu = kd.Component("k", 0, kd.Space.TOKEN, "uint8", (4,), 4, 8, gather=lambda i: i)
    cuda = kd.Component("k", 0, kd.Space.TOKEN, "uint8", (4,), 4, 8, gather=lambda i: i,
                        device=torch.device("cuda", 0))
    monkeypatch.setattr(kdt, "available", lambda device: True)
    monkeypatch.delenv("SGLANG_PDSAFE_KV_DIGEST_TRITON", raising=False)
    assert not kd._device_path([cpu])
    assert not kd._device_path([cpu, cuda])
    assert kd._device_path([cuda, cuda])
    monkeypatch.setenv("SGLANG_PDSAFE_KV_DIGEST_TRITON", "0")
    assert not kd._device_path([cuda])
    monkeypatch.setenv("SGLANG_PDSAFE_KV_DIGEST_TRITON", "1")
    monkeypatch.setattr(kdt, "available", lambda device: False)
    assert not kd._device_path([cuda])


# --------------------------------------------------------------------------- a real pool


def test_digest_request_on_a_real_mha_pool_page16_partial_last_page() -> None:
    """A real ``MHATokenToKVPool`` (bf16, 8 heads x 128: 2 KiB rows, 32 rows per leaf), page
    16, a request of 75 tokens (4 pages + 11 slots of a fifth) after a 7-token prefix, on
    scattered pages: the Triton path equals the CPU gather and stream paths (and ``auto``)."""
    mp = pytest.importorskip("sglang.srt.mem_cache.memory_pool")
    page = 16
    pool = mp.MHATokenToKVPool(size=512, page_size=page, dtype=torch.bfloat16, head_num=8,
                               head_dim=128, layer_num=2, device=str(DEVICE),
                               enable_memory_saver=False, enable_alt_stream=False)
    g = torch.Generator().manual_seed(16)
    for t in [*pool.k_buffer, *pool.v_buffer]:
        u8 = t.view(torch.uint8)
        u8.copy_(torch.randint(0, 256, u8.shape, dtype=torch.uint8, generator=g).to(t.device))
    pages = [9, 3, 17, 4, 22]
    row = torch.tensor([p * page + o for p in pages for o in range(page)][:75], dtype=torch.int32)
    assert (int(row[-1]) + 1) % page != 0  # the last page is partial
    prep = kd.prepare(pool)
    args = {"prefix": 7, "length": 75, "room": ROOM, "generation": 3}
    ref = kd.digest_request(prep, row, path="gather", **args)
    got = kd.digest_request(prep, row, path="triton", **args)
    assert got == ref and got.signature_text == ref.signature_text
    assert kd.digest_request(prep, row, path="auto", **args) == ref
    if DEVICE.type == "cpu":
        assert kd.digest_request(prep, row, path="stream", **args) == ref
    assert kd.verify(ref, got).ok
    # A flipped bit in the last owned slot of the partial page: both paths see it, alike.
    pool.v_buffer[1].view(torch.uint8)[int(row[74]), 0, 5] ^= 0x01
    flipped = kd.digest_request(prep, row, path="triton", **args)
    assert flipped != ref
    assert flipped == kd.digest_request(prep, row, path="gather", **args)


def test_environment_is_what_the_module_docstring_says() -> None:
    """Interpreter mode only with TRITON_INTERPRET=1, and then on CPU tensors only."""
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    assert kdt.interpreting() == interp
    assert kdt.available("cpu") == interp
