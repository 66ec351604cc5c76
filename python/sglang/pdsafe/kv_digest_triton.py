"""The KV digest's leaf hashes on the device: XXH3-128 in Triton, bit-identical to ``xxhash``.

:mod:`sglang.pdsafe.kv_digest` cuts each component's gathered rows into leaves and hashes every
leaf with XXH3-128 (default secret, seed 0: ``xxhash.xxh3_128_digest``). This module computes
the same leaf digests for bytes that sit on a GPU, one Triton program per leaf, so a CUDA or
ROCm server digests its KV at device bandwidth instead of copying it to the host first. It
implements only XXH3-128 over byte ranges; which bytes form a leaf is :mod:`kv_digest`'s
definition (its device path gathers the rows on the device with its own index arithmetic and
hands the gathered buffer here).

**The port.** XXH3-128 of ``n`` bytes (xxHash 0.8's frozen output; the names below are the
reference implementation's):

* ``n > 240`` (every full leaf: leaves are about 64 KiB): ``_xxh3_long_kernel``. Eight 64-bit
  accumulators; each 1 KiB block is 16 stripes x 8 lanes, ``acc[i] += lo32(d ^ k) * hi32(d ^ k)``
  and ``acc[i ^ 1] += d`` for every stripe, which are sums, so a block is one [16, 8] tile
  reduced over its stripes (``BLOCKS`` blocks per loop step, reduced at once); the scramble
  between blocks is the only sequential step. Then the partial block, the last stripe (the
  final 64 bytes, at any alignment), and the two ``mergeAccs`` with the 64x64->128 multiply.
* ``n <= 240`` (the last leaf of a short component, tiny rows): ``_xxh3_short_kernel`` with the
  ``0``, ``1-3``, ``4-8``, ``9-16``, ``17-128`` and ``129-240`` paths, scalar code.

All arithmetic is unsigned 64-bit with wrap-around (adds, xors, shifts and the low 64 bits of
products, which Triton lowers to native 64-bit instructions). The 64x64->128 product of
``mult64to128`` (``mul128_fold64``, ``mergeAccs``, the short paths) is built from four
32x32->64 partial products exactly as xxHash's portable code does; no 128-bit type is needed.

**Input layout.** One contiguous uint8 buffer on the device and, per leaf, its byte offset and
length (:func:`xxh3_128_leaves`), or ``[rows, row_bytes]`` rows cut into leaves of ``leaf_rows``
rows (:func:`leaf_digests`, the last leaf shorter); :func:`plan_leaves` + :func:`run_plan` split
the same call into its host part (checks, index tensors) and its asynchronous launches (the
benchmark times the launches alone). Words are read little-endian: through an
int64 view where the leaf starts 8-byte aligned (``ALIGNED``), else assembled from bytes (same
value, slower); the last stripe and the short paths always read bytes.

**Which device.** :func:`available`: a CUDA/HIP device with Triton importable, or a CPU device
when Triton's interpreter is on (``TRITON_INTERPRET=1`` set before this module is imported: the
kernels then run with numpy on CPU tensors; that is how the tests check bit-identity on a
machine without a GPU, slowly). Importing this module never fails: without Triton,
:func:`available` is False and nothing else may be called.

Invariant: for every buffer, offset and length, ``xxh3_128_leaves`` returns exactly
``xxhash.xxh3_128_digest(bytes(buf[off:off + len]))`` (the canonical 16 bytes: high 64 bits
big-endian, then low 64 bits big-endian), whatever the alignment and ``blocks``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

try:  # Triton is optional: a CPU-only install digests with the xxhash package.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

#: XXH3's default secret (xxHash's ``XXH3_kSecret``, 192 bytes, "taken from FARSH").
SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
assert len(SECRET) == 192

#: Leaves of at most this many bytes take the short-input paths (XXH3_MIDSIZE_MAX).
SHORT_MAX = 240
#: Default 1 KiB blocks per step of the long kernel's loop (more loads in flight per program).
DEFAULT_BLOCKS = 4
BLOCK_CHOICES = (1, 2, 4, 8)


def interpreting() -> bool:
    """True when the kernels run in Triton's interpreter (numpy on CPU tensors)."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_xxh3_long_kernel, InterpretedFunction)


def available(device: torch.device | str) -> bool:
    """Whether leaf digests for tensors on ``device`` can come from this module.

    A CUDA/HIP device (ROCm torch reports ``cuda`` too) with Triton importable and compiled
    kernels; a CPU device only under Triton's interpreter (tests).
    """
    if triton is None:
        return False
    dev = torch.device(device)
    if interpreting():
        return dev.type == "cpu"
    return dev.type == "cuda" and torch.cuda.is_available()


def disabled_by_env() -> bool:
    """``SGLANG_PDSAFE_KV_DIGEST_TRITON=0`` keeps digests on the host path (same values)."""
    return os.environ.get("SGLANG_PDSAFE_KV_DIGEST_TRITON", "1").strip().lower() in (
        "0", "false", "no", "off")


if triton is not None:
    _M32 = tl.constexpr(0xFFFFFFFF)
    _M64 = tl.constexpr(0xFFFFFFFFFFFFFFFF)
    _P32_1 = tl.constexpr(0x9E3779B1)
    _P32_2 = tl.constexpr(0x85EBCA77)
    _P32_3 = tl.constexpr(0xC2B2AE3D)
    _P64_1 = tl.constexpr(0x9E3779B185EBCA87)
    _P64_2 = tl.constexpr(0xC2B2AE3D27D4EB4F)
    _P64_3 = tl.constexpr(0x165667B19E3779F9)
    _P64_4 = tl.constexpr(0x85EBCA77C2B2AE63)
    _P64_5 = tl.constexpr(0x27D4EB2F165667C5)
    _PMX1 = tl.constexpr(0x165667919E3779F9)
    _PMX2 = tl.constexpr(0x9FB21C651E98DF25)

    # ------------------------------------------------------------------ 64-bit helpers

    @triton.jit
    def _mul128(a, b):
        """(low, high) 64-bit halves of the 128-bit product a * b, from 32-bit halves."""
        a_lo = a & _M32
        a_hi = a >> 32
        b_lo = b & _M32
        b_hi = b >> 32
        lo_lo = a_lo * b_lo
        hi_lo = a_hi * b_lo
        lo_hi = a_lo * b_hi
        hi_hi = a_hi * b_hi
        cross = (lo_lo >> 32) + (hi_lo & _M32) + lo_hi  # < 2^64: never overflows
        upper = (hi_lo >> 32) + (cross >> 32) + hi_hi
        lower = (cross << 32) | (lo_lo & _M32)
        return lower, upper

    @triton.jit
    def _fold(a, b):
        """XXH3_mul128_fold64: low ^ high of the 128-bit product."""
        lo, hi = _mul128(a, b)
        return lo ^ hi

    @triton.jit
    def _avalanche(h):
        """XXH3_avalanche."""
        h = h ^ (h >> 37)
        h = h * _PMX1
        return h ^ (h >> 32)

    @triton.jit
    def _avalanche64(h):
        """XXH64_avalanche."""
        h = h ^ (h >> 33)
        h = h * _P64_2
        h = h ^ (h >> 29)
        h = h * _P64_3
        return h ^ (h >> 32)

    @triton.jit
    def _swap64(x):
        """Byte swap of a 64-bit word."""
        return (((x << 56) & 0xFF00000000000000) | ((x << 40) & 0x00FF000000000000)
                | ((x << 24) & 0x0000FF0000000000) | ((x << 8) & 0x000000FF00000000)
                | ((x >> 8) & 0x00000000FF000000) | ((x >> 24) & 0x0000000000FF0000)
                | ((x >> 40) & 0x000000000000FF00) | ((x >> 56) & 0x00000000000000FF))

    @triton.jit
    def _neg(x):
        """0 - x modulo 2^64."""
        return (x ^ _M64) + 1

    @triton.jit
    def _rd64(ptr, off):
        """Little-endian u64 at byte ``ptr + off`` (scalar ``off``), at any alignment."""
        k = tl.arange(0, 8)
        b = tl.load(ptr + off + k).to(tl.uint64)
        return tl.sum(b << (k.to(tl.uint64) * 8), axis=0)

    @triton.jit
    def _rd32(ptr, off):
        """Little-endian u32 at byte ``ptr + off`` (scalar), widened to u64."""
        k = tl.arange(0, 4)
        b = tl.load(ptr + off + k).to(tl.uint64)
        return tl.sum(b << (k.to(tl.uint64) * 8), axis=0)

    @triton.jit
    def _rd64_vec(ptr, off):
        """Little-endian u64s at the byte offsets ``off`` (a 1-D tensor), any alignment."""
        k = tl.arange(0, 8)
        b = tl.load(ptr + off[:, None] + k[None, :]).to(tl.uint64)
        return tl.sum(b << (k.to(tl.uint64) * 8)[None, :], axis=1)

    @triton.jit
    def _rd64_tile(ptr, off, mask):
        """Little-endian u64s at the byte offsets ``off`` (2-D), 0 where ``mask`` is false."""
        k = tl.arange(0, 8)
        b = tl.load(ptr + off[:, :, None] + k[None, None, :], mask=mask[:, :, None], other=0)
        return tl.sum(b.to(tl.uint64) << (k.to(tl.uint64) * 8)[None, None, :], axis=2)

    @triton.jit
    def _swap_lanes(v, j):
        """``out[..., i] = v[..., i ^ 1]`` for a [B, 8] tensor ``v`` (``j`` = arange(8))."""
        perm = (j[:, None] ^ 1) == j[None, :]  # perm[i, k]: k == i ^ 1
        zero = tl.zeros_like(v)
        return tl.sum(tl.where(perm[None, :, :], v[:, None, :], zero[:, None, :]), axis=2)

    # ------------------------------------------------------------------ long input (> 240)

    @triton.jit
    def _xxh3_long_kernel(src_ptr, words_ptr, secret_ptr, off_ptr, len_ptr, dst_ptr, out_ptr,
                          ALIGNED: tl.constexpr, BLOCKS: tl.constexpr):
        """One program per leaf of more than 240 bytes (XXH3_hashLong_128b, default secret).

        ``src_ptr``: the bytes; ``words_ptr``: the same memory as int64 words (read when
        ``ALIGNED``: every leaf offset of this launch is a multiple of 8 and the buffer is 8-byte
        aligned). Leaf ``pid`` is ``[off, off + n)``; its digest goes to ``out[dst]`` as
        (high, low) 64-bit words.
        """
        pid = tl.program_id(0)
        off = tl.load(off_ptr + pid)
        n = tl.load(len_ptr + pid)
        dst = tl.load(dst_ptr + pid)
        nu = n.to(tl.uint64)
        j = tl.arange(0, 8)
        r = tl.arange(0, BLOCKS * 16)  # (block in step, stripe) rows of one loop step
        stripe = r % 16
        every = (r[:, None] >= 0) & (j[None, :] < 8)  # all-true [R, 8]
        # Stripe s of a block uses the secret at 8 * s; lane i reads 8 bytes at 8 * (s + i).
        key = _rd64_tile(secret_ptr, (stripe[:, None] + j[None, :]) * 8, every)
        scr = _rd64_vec(secret_ptr, 128 + j * 8)  # the scramble key: secret[192 - 64:]
        acc = tl.zeros([8], dtype=tl.uint64)  # XXH3_INIT_ACC
        acc = tl.where(j == 0, _P32_3, acc)
        acc = tl.where(j == 1, _P64_1, acc)
        acc = tl.where(j == 2, _P64_2, acc)
        acc = tl.where(j == 3, _P64_3, acc)
        acc = tl.where(j == 4, _P64_4, acc)
        acc = tl.where(j == 5, _P32_2, acc)
        acc = tl.where(j == 6, _P64_5, acc)
        acc = tl.where(j == 7, _P32_1, acc)
        bsel = tl.arange(0, BLOCKS)

        nb = (n - 1) // 1024  # full blocks, each followed by a scramble
        for b0 in range(0, nb, BLOCKS):
            blk = b0 + r // 16
            valid = (blk < nb)[:, None] & (j[None, :] < 8)
            wofs = blk[:, None] * 128 + stripe[:, None] * 8 + j[None, :]  # word in the leaf
            if ALIGNED:
                d = tl.load(words_ptr + off // 8 + wofs, mask=valid, other=0)
                d = d.to(tl.uint64, bitcast=True)
            else:
                d = _rd64_tile(src_ptr, off + wofs * 8, valid)
            dk = d ^ key
            prod = (dk & _M32) * (dk >> 32)
            # Per block: sum over its 16 stripes of the products (lane i) and data (lane i ^ 1).
            psum = tl.sum(tl.reshape(prod, [BLOCKS, 16, 8]), axis=1)
            dsum = tl.sum(tl.reshape(d, [BLOCKS, 16, 8]), axis=1)
            per_block = psum + _swap_lanes(dsum, j)
            for k in tl.static_range(BLOCKS):
                add = tl.sum(tl.where(bsel[:, None] == k, per_block, tl.zeros_like(per_block)),
                             axis=0)
                new = acc + add
                new = ((new ^ (new >> 47)) ^ scr) * _P32_1
                acc = tl.where(b0 + k < nb, new, acc)

        # The last, partial block: its whole stripes except the final one (the last stripe
        # below covers the final 1..64 bytes, overlapping when n is a multiple of 64).
        ns = ((n - 1) - nb * 1024) // 64
        s = tl.arange(0, 16)
        live = (s < ns)[:, None] & (j[None, :] < 8)
        wofs = nb * 128 + s[:, None] * 8 + j[None, :]
        if ALIGNED:
            d = tl.load(words_ptr + off // 8 + wofs, mask=live, other=0).to(tl.uint64,
                                                                              bitcast=True)
        else:
            d = _rd64_tile(src_ptr, off + wofs * 8, live)
        key16 = _rd64_tile(secret_ptr, (s[:, None] + j[None, :]) * 8,
                           (s[:, None] >= 0) & (j[None, :] < 8))
        dk = d ^ key16
        prod = tl.where(live, (dk & _M32) * (dk >> 32), tl.zeros_like(dk))
        acc += tl.sum(prod, axis=0) + tl.sum(_swap_lanes(tl.sum(d, axis=0)[None, :], j), axis=0)

        # The last stripe: bytes [n - 64, n), secret at 192 - 64 - 7.
        d = _rd64_vec(src_ptr + off + n - 64, j * 8)
        dk = d ^ _rd64_vec(secret_ptr, 121 + j * 8)
        acc += (dk & _M32) * (dk >> 32) + tl.sum(_swap_lanes(d[None, :], j), axis=0)

        # mergeAccs: low from secret + 11 and len * P64_1; high from secret + 117 and
        # ~(len * P64_2). Pairs (acc[2i], acc[2i + 1]) are folded and summed.
        i4 = tl.arange(0, 4)
        even = j[None, :] == 2 * i4[:, None]
        odd = j[None, :] == 2 * i4[:, None] + 1
        zero = tl.zeros([4, 8], dtype=tl.uint64)
        x = acc ^ _rd64_vec(secret_ptr, 11 + j * 8)
        lo = tl.sum(_fold(tl.sum(tl.where(even, x[None, :], zero), axis=1),
                          tl.sum(tl.where(odd, x[None, :], zero), axis=1)), axis=0)
        lo = _avalanche(lo + nu * _P64_1)
        x = acc ^ _rd64_vec(secret_ptr, 117 + j * 8)
        hi = tl.sum(_fold(tl.sum(tl.where(even, x[None, :], zero), axis=1),
                          tl.sum(tl.where(odd, x[None, :], zero), axis=1)), axis=0)
        hi = _avalanche(hi + ((nu * _P64_2) ^ _M64))
        tl.store(out_ptr + dst * 2, hi.to(tl.int64, bitcast=True))
        tl.store(out_ptr + dst * 2 + 1, lo.to(tl.int64, bitcast=True))

    # ------------------------------------------------------------------ short input (<= 240)

    @triton.jit
    def _mix32b(acc_lo, acc_hi, p1, p2, sec):
        """XXH128_mix32B (seed 0)."""
        a1 = _rd64(p1, 0)
        a2 = _rd64(p1, 8)
        b1 = _rd64(p2, 0)
        b2 = _rd64(p2, 8)
        acc_lo = acc_lo + _fold(a1 ^ _rd64(sec, 0), a2 ^ _rd64(sec, 8))
        acc_lo = acc_lo ^ (b1 + b2)
        acc_hi = acc_hi + _fold(b1 ^ _rd64(sec, 16), b2 ^ _rd64(sec, 24))
        acc_hi = acc_hi ^ (a1 + a2)
        return acc_lo, acc_hi

    @triton.jit
    def _finish_mid(acc_lo, acc_hi, nu):
        """The common end of the 17-128 and 129-240 paths: (low, high)."""
        lo = _avalanche(acc_lo + acc_hi)
        hi = acc_lo * _P64_1 + acc_hi * _P64_4 + nu * _P64_2
        return lo, _neg(_avalanche(hi))

    @triton.jit
    def _len_129to240(p, sec, n, nu):
        acc_lo = nu * _P64_1
        acc_hi = nu * 0
        for i in tl.static_range(4):
            acc_lo, acc_hi = _mix32b(acc_lo, acc_hi, p + 32 * i, p + 32 * i + 16, sec + 32 * i)
        acc_lo = _avalanche(acc_lo)
        acc_hi = _avalanche(acc_hi)
        for i in range(4, n // 32):  # XXH3_MIDSIZE_STARTOFFSET = 3
            acc_lo, acc_hi = _mix32b(acc_lo, acc_hi, p + 32 * i, p + 32 * i + 16,
                                     sec + 3 + 32 * (i - 4))
        # The last 32 bytes, halves swapped; secret at 136 - 17 - 16.
        acc_lo, acc_hi = _mix32b(acc_lo, acc_hi, p + n - 16, p + n - 32, sec + 103)
        return _finish_mid(acc_lo, acc_hi, nu)

    @triton.jit
    def _len_17to128(p, sec, n, nu):
        acc_lo = nu * _P64_1
        acc_hi = nu * 0
        rounds = (n - 1) // 32 + 1
        for r in range(0, rounds):
            i = rounds - 1 - r  # i = 3, 2, 1, 0 for the longest inputs
            acc_lo, acc_hi = _mix32b(acc_lo, acc_hi, p + 16 * i, p + n - 16 * (i + 1),
                                     sec + 32 * i)
        return _finish_mid(acc_lo, acc_hi, nu)

    @triton.jit
    def _len_9to16(p, sec, n, nu):
        bitflipl = _rd64(sec, 32) ^ _rd64(sec, 40)
        bitfliph = _rd64(sec, 48) ^ _rd64(sec, 56)
        in_lo = _rd64(p, 0)
        in_hi = _rd64(p, n - 8)
        m_lo, m_hi = _mul128(in_lo ^ in_hi ^ bitflipl, nu * 0 + _P64_1)
        m_lo = m_lo + ((nu - 1) << 54)
        in_hi = in_hi ^ bitfliph
        m_hi = m_hi + in_hi + (in_hi & _M32) * (_P32_2 - 1)
        m_lo = m_lo ^ _swap64(m_hi)
        h_lo, h_hi = _mul128(m_lo, nu * 0 + _P64_2)
        h_hi = h_hi + m_hi * _P64_2
        return _avalanche(h_lo), _avalanche(h_hi)

    @triton.jit
    def _len_4to8(p, sec, n, nu):
        in64 = _rd32(p, 0) + (_rd32(p, n - 4) << 32)
        keyed = in64 ^ (_rd64(sec, 16) ^ _rd64(sec, 24))
        m_lo, m_hi = _mul128(keyed, _P64_1 + (nu << 2))
        m_hi = m_hi + (m_lo << 1)
        m_lo = m_lo ^ (m_hi >> 3)
        m_lo = m_lo ^ (m_lo >> 35)
        m_lo = m_lo * _PMX2
        m_lo = m_lo ^ (m_lo >> 28)
        return m_lo, _avalanche(m_hi)

    @triton.jit
    def _len_1to3(p, sec, n, nu):
        c1 = tl.load(p).to(tl.uint64)
        c2 = tl.load(p + (n >> 1)).to(tl.uint64)
        c3 = tl.load(p + n - 1).to(tl.uint64)
        cl = (c1 << 16) | (c2 << 24) | c3 | (nu << 8)  # a u32 value
        sw = ((cl & 0xFF) << 24) | ((cl & 0xFF00) << 8) | ((cl >> 8) & 0xFF00) | (cl >> 24)
        ch = ((sw << 13) | (sw >> 19)) & _M32  # rotl32(swap32(cl), 13)
        lo = _avalanche64(cl ^ (_rd32(sec, 0) ^ _rd32(sec, 4)))
        hi = _avalanche64(ch ^ (_rd32(sec, 8) ^ _rd32(sec, 12)))
        return lo, hi

    @triton.jit
    def _xxh3_short_kernel(src_ptr, secret_ptr, off_ptr, len_ptr, dst_ptr, out_ptr):
        """One program per leaf of at most 240 bytes (XXH3's short-input paths, seed 0)."""
        pid = tl.program_id(0)
        off = tl.load(off_ptr + pid)
        n = tl.load(len_ptr + pid)
        dst = tl.load(dst_ptr + pid)
        nu = n.to(tl.uint64)
        p = src_ptr + off
        if n > 128:
            lo, hi = _len_129to240(p, secret_ptr, n, nu)
        elif n > 16:
            lo, hi = _len_17to128(p, secret_ptr, n, nu)
        elif n > 8:
            lo, hi = _len_9to16(p, secret_ptr, n, nu)
        elif n >= 4:
            lo, hi = _len_4to8(p, secret_ptr, n, nu)
        elif n > 0:
            lo, hi = _len_1to3(p, secret_ptr, n, nu)
        else:
            lo = _avalanche64(_rd64(secret_ptr, 64) ^ _rd64(secret_ptr, 72))
            hi = _avalanche64(_rd64(secret_ptr, 80) ^ _rd64(secret_ptr, 88))
        tl.store(out_ptr + dst * 2, hi.to(tl.int64, bitcast=True))
        tl.store(out_ptr + dst * 2 + 1, lo.to(tl.int64, bitcast=True))


# --------------------------------------------------------------------------- host side

_SECRETS: dict[str, torch.Tensor] = {}


def _secret(device: torch.device) -> torch.Tensor:
    key = str(device)
    t = _SECRETS.get(key)
    if t is None:
        t = _SECRETS[key] = torch.frombuffer(bytearray(SECRET), dtype=torch.uint8).to(device)
    return t


def _words_view(buf: torch.Tensor) -> torch.Tensor | None:
    """``buf``'s whole 8-byte words as int64, or None when the buffer is not 8-byte aligned."""
    if buf.data_ptr() % 8 or buf.numel() < 8:
        return None
    try:
        return buf[: buf.numel() // 8 * 8].view(torch.int64)
    except RuntimeError:
        return None


@dataclass(frozen=True)
class LeafPlan:
    """Validated leaves of one buffer, split by kernel: per group (``short``, ``aligned``,
    ``bytes``) the device tensors of offsets, lengths and output rows. Reusable for the same
    buffer (address and size) with :func:`run_plan`."""

    count: int
    numel: int
    data_ptr: int
    groups: tuple[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor], ...]


def plan_leaves(buf: torch.Tensor, offsets: Sequence[int] | np.ndarray,
                lengths: Sequence[int] | np.ndarray) -> LeafPlan:
    """Check the byte ranges ``[off, off + n)`` against ``buf`` and group them by kernel.

    ``buf``: a contiguous 1-D uint8 tensor on a device where :func:`available` is true. Ranges
    may have any alignment and length and may overlap; one outside ``buf`` is refused here (the
    kernels do not check bounds).
    """
    if triton is None:
        raise RuntimeError("triton is not importable: use the xxhash package")
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError("buf must be a contiguous 1-D uint8 tensor")
    off = np.asarray(offsets, dtype=np.int64).reshape(-1)
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if off.shape != lens.shape:
        raise ValueError("offsets and lengths differ in length")
    count = int(off.size)
    if count and (int(off.min()) < 0 or int(lens.min()) < 0
                  or int((off + lens).max()) > buf.numel()):
        raise ValueError("a leaf lies outside the buffer")
    idx = np.arange(count, dtype=np.int64)
    short = lens <= SHORT_MAX
    aligned = ((~short) & (off % 8 == 0) if _words_view(buf) is not None
               else np.zeros(count, dtype=bool))
    groups = []
    for name, sel in (("short", short), ("aligned", aligned), ("bytes", ~short & ~aligned)):
        if sel.any():
            groups.append((name, *(torch.from_numpy(np.ascontiguousarray(a[sel])).to(buf.device)
                                   for a in (off, lens, idx))))
    return LeafPlan(count, buf.numel(), buf.data_ptr(), tuple(groups))


def run_plan(buf: torch.Tensor, plan: LeafPlan, *, blocks: int = DEFAULT_BLOCKS,
             num_warps: int = 4) -> torch.Tensor:
    """Launch the kernels of ``plan`` on ``buf``; returns ``[count, 2]`` int64 on the device,
    row ``k`` = (high, low) 64-bit halves of leaf ``k``'s XXH3-128 (asynchronous on CUDA).

    ``blocks``: 1 KiB blocks per loop step of the long kernel (1, 2, 4 or 8; same result).
    """
    if blocks not in BLOCK_CHOICES:
        raise ValueError(f"blocks must be one of {BLOCK_CHOICES}, got {blocks}")
    if (buf.numel(), buf.data_ptr()) != (plan.numel, plan.data_ptr):
        raise ValueError("the plan was made for another buffer")
    dev = buf.device
    out = torch.empty((plan.count, 2), dtype=torch.int64, device=dev)
    secret = _secret(dev)
    for name, o, n, d in plan.groups:
        grid = (int(o.numel()),)
        if name == "short":
            _xxh3_short_kernel[grid](buf, secret, o, n, d, out, num_warps=1)
        else:
            words = _words_view(buf) if name == "aligned" else buf
            _xxh3_long_kernel[grid](buf, words, secret, o, n, d, out,
                                    ALIGNED=name == "aligned", BLOCKS=blocks,
                                    num_warps=num_warps)
    return out


def digests_to_bytes(out: torch.Tensor) -> list[bytes]:
    """:func:`run_plan`'s (high, low) words as canonical 16-byte digests (big-endian halves)."""
    raw = out.cpu().numpy().view(np.uint64).astype(">u8").tobytes()
    return [raw[k:k + 16] for k in range(0, len(raw), 16)]


def xxh3_128_leaves(buf: torch.Tensor, offsets: Sequence[int] | np.ndarray,
                    lengths: Sequence[int] | np.ndarray, *,
                    blocks: int = DEFAULT_BLOCKS, num_warps: int = 4) -> list[bytes]:
    """``xxhash.xxh3_128_digest(buf[off:off + n])`` for every (off, n), computed on the device.

    ``buf``, ``offsets``, ``lengths``: as :func:`plan_leaves`; ``blocks``, ``num_warps``: as
    :func:`run_plan` (they change the speed, never the result). Returns the canonical 16-byte
    digests, in order.
    """
    plan = plan_leaves(buf, offsets, lengths)
    if plan.count == 0:
        return []
    return digests_to_bytes(run_plan(buf, plan, blocks=blocks, num_warps=num_warps))


def leaf_digests(rows_u8: torch.Tensor, leaf_rows: int, **kw: int) -> list[bytes]:
    """The leaf digests of ``rows_u8`` (``[rows, row_bytes]`` uint8, contiguous) cut into
    leaves of ``leaf_rows`` whole rows, the last one shorter: what
    ``kv_digest``'s CPU path computes with ``xxhash`` for one gathered stream."""
    if rows_u8.dim() != 2 or leaf_rows < 1:
        raise ValueError("rows_u8 must be [rows, row_bytes] and leaf_rows >= 1")
    rows, row_bytes = int(rows_u8.shape[0]), int(rows_u8.shape[1])
    starts = np.arange(0, rows, leaf_rows, dtype=np.int64)
    counts = np.minimum(leaf_rows, rows - starts)
    return xxh3_128_leaves(rows_u8.reshape(-1), starts * row_bytes, counts * row_bytes, **kw)
