"""KV content digests for PD transfers (issue 10: the algorithm, the layout and the CPU path).

Upstream's ``--disaggregation-enable-kv-checksum`` (Adler-32, CUDA only) is off by default,
page-granular (the stale tail of a request's last page is never looked at), passes when the
digest is missing or zero, and skips any client whose rid starts with ``HEALTH_CHECK``. This
module defines the digest that replaces it, as pure functions over a real sglang KV pool: the
prefill computes it over the pages it is about to send, the decode over the pages it received,
and :func:`verify` compares the two with no skip case at all. Wiring it into the servers (the
patches, the metadata slot that carries it, the refusal) is not part of this module yet.

**What is digested.** Exactly the token range the request owns, ``[prefix, length)`` of its
``req_to_token`` row (the KV locations of its positions), token-granular: the partial last page
contributes only the slots of owned positions, another request's slots and the unowned tail
of a page never enter the digest. Of every component that decode reads:

==========================  ==========  ===========================================  =======
pool (exact class)          component   rows (one per index)                         space
==========================  ==========  ===========================================  =======
MHATokenToKVPool (NHD)      ``k``       ``k_buffer[l][loc]`` (head, head_dim)        token
                            ``v``       ``v_buffer[l][loc]``                         token
MHATokenToKVPoolFP4         + ``k_scale``, ``v_scale``: ``*_scale_buffer[l][loc]``   token
MHATokenToKVPoolMXFP8       + ``k_scale``, ``v_scale``: flat ``[loc]``, or for the   token
                            interleaved layout (page 128) ``[p, :, o % 32, o // 32, :]``
                            with ``p, o = divmod(loc, page_size)``
MHATokenToKOnlyPool         ``k``       ``k_buffer[l][loc]``                         token
MLATokenToKVPool            ``kv``      ``kv_buffer[l][loc]`` (1, kv_cache_dim)      token
MLATokenToKVPoolFP4         + ``kv_scale``: ``kv_scale_buffer[l][loc]``              token
DSATokenToKVPool            MLA's ``kv`` + ``index``: the indexer key bytes then     token
                            its scale bytes of slot ``o`` of page ``p`` of
                            ``index_k_with_scale_buffer[l]`` (index_kpool 1)
DSATokenToKVPool,           MLA's ``kv`` + ``index.k<K>``: entry ``e`` of the        index
index_kpool K > 1           page's ``page // K`` entries (K positions share one;
                            each entry once, in position order; ``DsaGeometry``)
                            + with the compressed index ``tail_k``, ``tail_score``:  tail
                            the request's tail-ring rows of its last
                            ``length % K`` positions
                            (``get_compress_tail_buffers(l)``)
SWAKVPool                   ``full.*`` of the full sub-pool                          token
                            ``swa.*`` of the SWA sub-pool, positions                 swa
                            ``[max(prefix, length - window), length)`` at
                            ``translate_loc_from_full_to_swa(loc)``
HybridLinearKVPool          ``full.*`` of its full-attention sub-pool (MHA, MLA,     token
                            DSA) + ``mamba.conv<i>``, ``mamba.temporal``:            state
                            ``mamba_cache.conv[i][l][slot]``, ``temporal[l][slot]``
                            for each of the request's state slots
==========================  ==========  ===========================================  =======

Any other pool class, layout or buffer raises :class:`UnsupportedLayout` (fail closed: a digest
never silently leaves out a component). As a cross-check, every buffer that the transfer
registers (``get_contiguous_buf_infos``, ``get_state_buf_infos``, ``get_kv_scale_buf_infos``)
must be the storage of a digested component, or the pool is refused.

**Byte stream, order and the digest.** The bytes of one row are the row's elements in C order
(``row_shape`` in the signature), each in the machine's byte order (little-endian on every
platform sglang runs on; the byte order is part of the signature). For each component, in the
order of the table, then by layer in the pool's own layer order (the model layer ids, each
recorded in the signature, ascending in every pool above), the component's *stream* is the
concatenation of its rows in position order (state slots in the order given). The stream is
cut into leaves of ``T = max(1, LEAF_BYTES // row_bytes)`` rows (the last leaf may be shorter;
an empty stream has no leaves), and::

    leaf   = XXH3-128(leaf bytes)                                   16 bytes, canonical
    header = MAGIC (16 bytes) || signature digest (16 bytes)
             || u64 room, generation, prefix, token_count, swa_window, state slots, components
    value  = XXH3-128(header || for each component: u64 rows || its leaves' digests)

all integers little-endian u64; a value of 16 zero bytes is replaced by ``00..01`` so that
zero can only mean "no digest". The result is :class:`KvDigest`: the 16-byte value, the
16-byte layout signature digest and, in clear for the messages, the bound fields.

**Paths, all bit-identical.** The definition only needs (a) the gathered rows of each
component, (b) fixed leaves of whole rows and (c) XXH3-128. The CPU path hashes the leaves with
the ``xxhash`` package (already an upstream sglang dependency), either straight from the pool's
memory (rows of a leaf that sit in consecutive slots, zero-copy) or from a gather (on any torch
device: rows gathered there, copied to the host). The device path (``path="triton"``, and what
``auto`` takes when every component lives on one CUDA/HIP device and Triton can run there,
unless ``SGLANG_PDSAFE_KV_DIGEST_TRITON=0``) gathers the same rows on the device with the same
``gather`` functions, and :mod:`sglang.pdsafe.kv_digest_triton` hashes every leaf there, one
Triton program per leaf (XXH3-128 ported to 64-bit Triton arithmetic, short-input paths
included); only the 16-byte leaf digests come back, the short root hash runs here. All paths
give the same bytes, which the tests check (``test/unit/test_kv_digest.py``: stream vs gather;
``test/gpu/test_kv_digest_triton.py``: Triton vs ``xxhash``, in Triton's interpreter on a CPU).
A row larger than 64 KiB (e.g. a Mamba temporal state slot) is one leaf on its own; splitting
it would be a new scheme version.

Invariants:

* The digest is a function of the owned rows' bytes, the component order and row layout (the
  signature), and the bound fields only; a byte outside the owned range never changes it.
* :func:`verify` has no skip case: a missing or zero digest, a signature mismatch, a bound
  field that differs and a value that differs are failures; nothing depends on the rid.

What it proves and what it does not: equal digests mean that decode's owned rows hold the
bytes prefill digested for this room, generation, range and layout, except with probability
about 2^-128 per comparison (two different leaf inputs collide under XXH3-128, or two different
leaf lists under the root hash): a single flipped bit anywhere in a digested row changes its
leaf's input, so it is caught with that probability (XXH3 is not a CRC: the detection of one
bit is probabilistic, not guaranteed by construction, but a 2^-128 miss is far below the
hardware's own error rates). XXH3 is not a cryptographic hash or a MAC: it detects corruption,
stale pages and foreign KV, not a party that can write chosen bytes into both the pages and the
digest. It says nothing about what the KV *means* (that prefill computed it from the right
tokens is the coverage attestation's job, :mod:`sglang.pdsafe.coverage`), nor about bytes
written after decode verified. The digest is per rank over that rank's shard: prefill and
decode must shard the same way (heterogeneous TP/PP between the legs is not covered: refused at
pairing, ``pair_agreement.sharding_mismatches``).
"""

from __future__ import annotations

import enum
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash
from sglang.pdsafe import kv_layouts

SCHEME = "pdsafe-kvdigest/1"
#: 16 bytes that open every header: scheme and version.
MAGIC = b"pdsafe-kvdigst01"
#: Target leaf size; a leaf is ``max(1, LEAF_BYTES // row_bytes)`` whole rows.
LEAF_BYTES = 64 * 1024
DIGEST_SIZE = 16
_U64 = (1 << 64) - 1
_ZERO = bytes(DIGEST_SIZE)
_ONE = bytes(DIGEST_SIZE - 1) + b"\x01"
#: Bytes gathered per step on the gather path: bounded memory for long contexts, and small
#: enough that the hash reads the gathered rows from cache.
_GATHER_STEP_BYTES = 1024 * 1024

assert len(MAGIC) == 16


class UnsupportedLayout(ValueError):
    """The pool's layout is not one this module can digest completely; never digest it."""


class Space(enum.Enum):
    """Which index addresses a component's rows."""

    TOKEN = "token"  # the full pool's KV location of a position (a req_to_token value)
    SWA = "swa"  # the SWA pool's location of a window position (translated full location)
    STATE = "state"  # a request state slot (Mamba / linear attention)
    INDEX = "index"  # a DSA index entry shared by index_kpool positions (index_kpool > 1)
    TAIL = "tail"  # a row of a request's DSA tail ring (index_kpool compress)


@dataclass(frozen=True)
class Component:
    """One digested buffer of one layer.

    ``gather(idx, out=None)`` returns the rows at the int64 indices ``idx`` as a contiguous
    uint8 tensor ``[len(idx), row_bytes]`` on the pool's device (into ``out`` when it can).
    ``rows`` is the same data as a zero-copy uint8 ``[slots, row_bytes]`` view when the pool
    stores rows contiguously on the CPU (the zero-copy path hashes slices of it), else None.
    ``storage_ptr`` is the ``data_ptr`` of the buffer the transfer registers for it (the
    cross-check), ``slots`` its number of rows, ``device`` where its rows live.
    """

    name: str
    layer: int
    space: Space
    dtype: str
    row_shape: tuple[int, ...]
    row_bytes: int
    slots: int
    gather: Callable[..., torch.Tensor] = field(repr=False, compare=False)
    rows: torch.Tensor | None = field(default=None, repr=False, compare=False)
    storage_ptr: int = field(default=0, repr=False, compare=False)
    device: torch.device = field(default=torch.device("cpu"), repr=False, compare=False)
    #: ``clear(idx)`` zeroes the rows at ``idx`` (None: this layout has no such write yet).
    clear: Callable[[torch.Tensor], None] | None = field(default=None, repr=False,
                                                         compare=False)

    def describe(self) -> str:
        shape = "x".join(str(d) for d in self.row_shape) or "scalar"
        return f"{self.name}@{self.layer}:{self.dtype}:{shape}:{self.space.value}"


@dataclass(frozen=True)
class Signature:
    """The layout signature: ``text`` (for messages) and its 16-byte XXH3-128 ``digest``."""

    text: str
    digest: bytes


@dataclass(frozen=True)
class KvDigest:
    """What one side computed: the value and signature (16 bytes each) and the bound fields.

    Only ``value`` and ``signature`` need to travel: the receiver knows the bound fields of
    its own request, and they are hashed into ``value``.
    """

    room: int
    generation: int
    prefix: int
    token_count: int
    signature: bytes
    value: bytes
    signature_text: str = field(default="", compare=False)

    def to_words(self) -> list[int]:
        """``value`` then ``signature`` as four unsigned 64-bit words (for a metadata row)."""
        raw = self.value + self.signature
        return [int.from_bytes(raw[i:i + 8], "big") for i in range(0, 32, 8)]

    @staticmethod
    def from_words(words: Sequence[int], *, room: int, generation: int, prefix: int,
                   token_count: int) -> KvDigest:
        """The inverse of :meth:`to_words`; the bound fields are the receiver's own."""
        if len(words) != 4:
            raise ValueError(f"a KV digest is 4 words, got {len(words)}")
        raw = b"".join((int(w) & _U64).to_bytes(8, "big") for w in words)
        return KvDigest(room=room, generation=generation, prefix=prefix,
                        token_count=token_count, signature=raw[16:], value=raw[:16])


# --------------------------------------------------------------------------- components


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _as_bytes_dtype(t: torch.Tensor) -> torch.Tensor:
    # 1-byte float types (fp8, e8m0) lack CPU indexing kernels; their bytes are the same.
    if t.element_size() == 1 and t.dtype != torch.uint8:
        return t.view(torch.uint8)
    return t


def _row_component(name: str, layer: int, space: Space, t: torch.Tensor) -> Component:
    """A buffer whose dim 0 is the slot: row ``s`` is ``t[s]`` in C order."""
    row_shape = tuple(int(d) for d in t.shape[1:])
    row_bytes = int(np.prod(row_shape, dtype=np.int64)) * t.element_size()
    dtype = _dtype_name(t)
    slots = int(t.shape[0])
    ptr = t.data_ptr()
    src = _as_bytes_dtype(t)
    if src.is_contiguous() and row_bytes > 0 and src.device.type == "cpu":
        flat = src.view(torch.uint8).reshape(slots, row_bytes)
        rows = flat
        flat_np = flat.numpy()

        def gather(idx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
            # numpy's take copies whole rows (torch's CPU index_select was about ten times
            # slower on scattered rows: 0.45 s for a fragmented 1M-token request, issue 22).
            # The indices were range-checked before any row is read (``plan_request``).
            i = idx.to("cpu", torch.int64).numpy()
            if out is not None and out.device.type == "cpu":
                o = out[: i.size]
                np.take(flat_np, i, axis=0, out=o.numpy(), mode="clip")
                return o
            return torch.from_numpy(np.take(flat_np, i, axis=0, mode="clip"))
    elif src.is_contiguous() and row_bytes > 0:
        flat = src.view(torch.uint8).reshape(slots, row_bytes)
        rows = None

        def gather(idx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
            idx = idx.to(flat.device)
            if out is not None and out.device == flat.device:
                return torch.index_select(flat, 0, idx, out=out[: idx.numel()])
            return flat.index_select(0, idx)
    else:
        rows = None

        def gather(idx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
            g = src.index_select(0, idx.to(src.device)).contiguous()
            return g.view(torch.uint8).reshape(int(idx.numel()), row_bytes)

    def clear(idx: torch.Tensor) -> None:
        t.index_fill_(0, idx.to(t.device), 0)

    return Component(name, layer, space, dtype, row_shape, row_bytes, slots, gather, rows, ptr,
                     t.device, clear)


def _custom_component(name: str, layer: int, space: Space, base: torch.Tensor,
                      row_shape: tuple[int, ...], slots: int,
                      pick: Callable[[torch.Tensor], torch.Tensor],
                      clear: Callable[[torch.Tensor], None] | None = None) -> Component:
    """A buffer whose rows need index arithmetic: ``pick(idx)`` returns ``[n, *row_shape]``
    (``clear(idx)``, where given, zeroes the same rows)."""
    row_bytes = int(np.prod(row_shape, dtype=np.int64)) * base.element_size()
    device = base.device

    def gather(idx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        g = pick(idx.to(device)).contiguous()
        return g.view(torch.uint8).reshape(int(idx.numel()), row_bytes)

    wipe = None if clear is None else (lambda idx: clear(idx.to(device)))
    return Component(name, layer, space, _dtype_name(base), row_shape, row_bytes, slots, gather,
                     None, base.data_ptr(), device, wipe)


def _vectorized_5d_components(pool: Any, prefix: str, space: Space,
                              layer_ids: list[int]) -> list[Component]:
    """ROCm AITER's ``vectorized_5d`` MHA layout (upstream's ``_create_buffers_normal``):
    K ``(pages, H, Dk // X, page, X)``, V ``(pages, H, page // X, Dv, X)``, ``X`` elements per
    16-byte vector. The row of token slot ``s`` (page ``s // page``, offset ``o = s % page``)
    is K ``[p, :, :, o, :]`` and V ``[p, :, o // X, :, o % X]``, both read as ``(H, D)`` in
    head-dim order: the same bytes, order and row shape as the NHD row of the same token, so
    the digest of a request does not depend on which of the two layouts holds it (a pair whose
    legs differ in layout is refused by the digest: the transfer copies pages verbatim)."""
    page = int(pool.page_size)
    x = int(pool.k_buffer[0].shape[-1])  # X is the buffers' last dim (V's too)
    out: list[Component] = []
    for lid, buf in zip(layer_ids, pool.k_buffer, strict=True):
        heads, dk = int(buf.shape[1]), int(buf.shape[2]) * x

        def pick_k(idx: torch.Tensor, buf: torch.Tensor = buf, h: int = heads,
                   d: int = dk) -> torch.Tensor:
            # Whole page blocks first (contiguous copies), token-major, then the tokens: about
            # ten times faster on the CPU than indexing (page, offset) pairs directly.
            pages, where = torch.unique(idx // page, return_inverse=True)
            blk = buf.index_select(0, pages).permute(0, 3, 1, 2, 4).reshape(-1, h, d)
            return blk.index_select(0, where * page + idx % page)

        def clear_k(idx: torch.Tensor, buf: torch.Tensor = buf) -> None:
            buf[idx // page, :, :, idx % page, :] = 0

        out.append(_custom_component(prefix + "k", lid, space, buf, (heads, dk),
                                     int(buf.shape[0]) * page, pick_k, clear_k))
    for lid, buf in zip(layer_ids, pool.v_buffer, strict=True):
        heads, dv = int(buf.shape[1]), int(buf.shape[3])

        def pick_v(idx: torch.Tensor, buf: torch.Tensor = buf, h: int = heads,
                   d: int = dv) -> torch.Tensor:
            pages, where = torch.unique(idx // page, return_inverse=True)
            # (pages, H, page // X, Dv, X) -> (pages, page // X, X, H, Dv): token-major rows.
            blk = buf.index_select(0, pages).permute(0, 2, 4, 1, 3).reshape(-1, h, d)
            return blk.index_select(0, where * page + idx % page)

        def clear_v(idx: torch.Tensor, buf: torch.Tensor = buf) -> None:
            o = idx % page
            buf[idx // page, :, o // x, :, o % x] = 0

        out.append(_custom_component(prefix + "v", lid, space, buf, (heads, dv),
                                     int(buf.shape[0]) * page, pick_v, clear_v))
    return out


def _layer_ids(pool: Any) -> list[int]:
    ids = getattr(pool, "model_layer_ids", None)
    if ids is not None:
        return [int(i) for i in ids]
    start = int(getattr(pool, "start_layer", 0) or 0)
    return list(range(start, start + int(pool.layer_num)))


def _mha_components(pool: Any, prefix: str, space: Space, layer_ids: list[int]) -> list[Component]:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolMXFP8

    layout = "hnd" if getattr(pool, "use_hnd", False) else getattr(pool, "kv_cache_layout",
                                                                       "nhd")
    if layout == "hnd":
        raise UnsupportedLayout(
            f"{type(pool).__name__} with the HND layout (SGLANG_USE_HND_KVCACHE): upstream "
            "0.5.23's PD transfer does not serve it (its get_contiguous_buf_infos asserts the "
            "NHD slot-row layout), so there is no transfer to check; unset "
            "SGLANG_USE_HND_KVCACHE on PD servers")
    if layout not in ("nhd", "vectorized_5d"):
        raise UnsupportedLayout(
            f"{type(pool).__name__} with layout {layout!r}: only the NHD slot-row and the "
            "AITER vectorized_5d layouts are digested")
    for attr in ("native_k_scale_buffer", "native_v_scale_buffer"):
        if getattr(pool, attr, None) is not None:
            raise UnsupportedLayout(f"{type(pool).__name__}.{attr}: layout not digested yet")
    if layout == "vectorized_5d":
        if getattr(pool, "k_scale_buffer", None) is not None:
            raise UnsupportedLayout(
                f"{type(pool).__name__} with the vectorized_5d layout and per-token scale "
                "buffers: layout not digested yet")
        return _vectorized_5d_components(pool, prefix, space, layer_ids)
    out: list[Component] = []
    for name in ("k", "v"):
        for lid, buf in zip(layer_ids, getattr(pool, f"{name}_buffer"), strict=True):
            out.append(_row_component(prefix + name, lid, space, buf))
    if getattr(pool, "k_scale_buffer", None) is None:
        return out
    interleaved = isinstance(pool, MHATokenToKVPoolMXFP8) and pool.mxfp8_sf_interleaved
    page = int(pool.page_size)
    for name in ("k", "v"):
        scales = getattr(pool, f"{name}_scale_buffer")
        for lid, buf, data in zip(layer_ids, scales, getattr(pool, f"{name}_buffer"), strict=True):
            if interleaved:
                # (pages, head, 32, page // 32, sf): slot o of a page is [o % 32, o // 32].
                ub = buf.view(torch.uint8)
                blk = int(ub.shape[2])

                def pick(idx: torch.Tensor, ub: torch.Tensor = ub, blk: int = blk) -> torch.Tensor:
                    p, o = idx // page, idx % page
                    return ub[p, :, o % blk, o // blk, :]

                out.append(_custom_component(
                    prefix + name + "_scale", lid, space, buf,
                    (int(ub.shape[1]), int(ub.shape[4])), int(ub.shape[0]) * page, pick))
            elif buf.shape[0] == data.shape[0]:
                out.append(_row_component(prefix + name + "_scale", lid, space, buf))
            else:
                raise UnsupportedLayout(
                    f"{type(pool).__name__}.{name}_scale_buffer of shape {tuple(buf.shape)} is "
                    "not one row per slot: layout not digested yet")
    return out


def _konly_components(pool: Any, prefix: str, space: Space,
                      layer_ids: list[int]) -> list[Component]:
    return [_row_component(prefix + "k", lid, space, buf)
            for lid, buf in zip(layer_ids, pool.k_buffer, strict=True)]


def _mla_components(pool: Any, prefix: str, space: Space, layer_ids: list[int]) -> list[Component]:
    out = [_row_component(prefix + "kv", lid, space, buf)
           for lid, buf in zip(layer_ids, pool.kv_buffer, strict=True)]
    if getattr(pool, "kv_scale_buffer", None) is not None:
        out += [_row_component(prefix + "kv_scale", lid, space, buf)
                for lid, buf in zip(layer_ids, pool.kv_scale_buffer, strict=True)]
    return out


@dataclass(frozen=True)
class DsaGeometry:
    """How a DSA pool with ``index_kpool`` K > 1 addresses its index and tail rows.

    A KV page of ``page`` positions has one index page of ``page // K`` entries: position
    slot ``loc`` is entry ``(loc // page) * (page // K) + (loc % page) // K`` (K consecutive
    positions of a page share one entry). With the compressed index (``compress``), the
    trailing ``length % K`` positions of a request live in its tail ring instead, ``ring``
    rows per request: row ``req_pool_idx * ring + (length - n + i) % ring`` for ``i < n``
    (upstream's ``get_dsa_tail_state_indices``, which the PD transfer sends)."""

    page: int
    group: int
    compress: bool
    ring: int

    def entries(self, locs: np.ndarray) -> np.ndarray:
        """The index entries of the positions at KV slots ``locs`` (in order), each once."""
        locs = locs.astype(np.int64, copy=False)
        ent = (locs // self.page) * (self.page // self.group) + (locs % self.page) // self.group
        if ent.size == 0:
            return ent
        keep = np.empty(ent.size, dtype=bool)
        keep[0] = True
        np.not_equal(ent[1:], ent[:-1], out=keep[1:])
        return ent[keep]

    def tail_rows(self, req_pool_idx: int | None, length: int) -> np.ndarray:
        """The tail-ring rows of a request of ``length`` positions (empty without compress)."""
        n = int(length) % self.group if self.compress else 0
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        if req_pool_idx is None:
            raise ValueError("a DSA pool with the compressed index needs the request's "
                             "req_pool_idx (its tail ring row)")
        start = (int(length) - n) % self.ring
        return int(req_pool_idx) * self.ring + (start + np.arange(n, dtype=np.int64)) % self.ring


def dsa_geometry(pool: Any) -> DsaGeometry | None:
    """The :class:`DsaGeometry` of ``pool``'s DSA index (the pool itself, or the full-attention
    sub-pool of a hybrid pool) when its ``index_kpool`` > 1; None otherwise."""
    dsa = pool
    if not (kv_layouts.verdict(type(pool))[0] == "dsa"):
        dsa = getattr(pool, "full_kv_pool", None)
        if dsa is None or kv_layouts.verdict(type(dsa))[0] != "dsa":
            return None
    group = int(dsa.index_kpool)
    if group <= 1:
        return None
    compress = bool(getattr(dsa, "kpool_use_compress", False))
    ring = group + int(getattr(dsa, "tail_extra_slots", 0) or 0)
    return DsaGeometry(int(dsa.page_size), group, compress, ring)


def _dsa_components(pool: Any, prefix: str, space: Space, layer_ids: list[int]) -> list[Component]:
    from sglang.srt.mem_cache import index_key_cache

    group, page = int(pool.index_kpool), int(pool.page_size)
    entries = int(pool.index_page_size)
    if (group < 1 or entries * group != page
            or getattr(index_key_cache, "_use_aiter_preshuffle", False)
            or (group > 1 and space is not Space.TOKEN)):
        raise UnsupportedLayout(
            f"{type(pool).__name__} with index_kpool={group}, index page {entries} of page "
            f"{page} (or the AITER preshuffled index, or a grouped index in a sub-pool this "
            "module does not address by token): not digested")
    out = _mla_components(pool, prefix, space, layer_ids)
    dim = int(pool.index_head_dim)
    scale_bytes = dim // int(pool.quant_block_size) * 4
    index_space = space if group == 1 else Space.INDEX
    name = prefix + ("index" if group == 1 else f"index.k{group}")
    for lid, buf in zip(layer_ids, pool.index_k_with_scale_buffer, strict=True):
        if buf.shape[0] == 0:  # a layer that reuses the previous top-k has no index keys
            continue
        # One page row: its entries' key bytes (entries x dim), then their scale bytes.
        keys = buf[:, : entries * dim].view(buf.shape[0], entries, dim)
        scales = buf[:, entries * dim:].view(buf.shape[0], entries, scale_bytes)

        def pick(idx: torch.Tensor, keys: torch.Tensor = keys,
                 scales: torch.Tensor = scales) -> torch.Tensor:
            p, o = idx // entries, idx % entries
            return torch.cat([keys[p, o], scales[p, o]], dim=1)

        def clear(idx: torch.Tensor, keys: torch.Tensor = keys,
                  scales: torch.Tensor = scales) -> None:
            p, o = idx // entries, idx % entries
            keys[p, o] = 0
            scales[p, o] = 0

        out.append(_custom_component(name, lid, index_space, buf, (dim + scale_bytes,),
                                     int(buf.shape[0]) * entries, pick, clear))
    if group > 1 and getattr(pool, "kpool_use_compress", False):
        for lid in layer_ids:
            tail_k, tail_score = pool.get_compress_tail_buffers(lid)
            for part, t in (("tail_k", tail_k), ("tail_score", tail_score)):
                if t.shape[0] == 0:  # a layer without index keys has no tail either
                    continue
                out.append(_row_component(prefix + part, lid, Space.TAIL,
                                          t.reshape(-1, t.shape[-1])))
    return out


def _attention_components(pool: Any, prefix: str, space: Space,
                          layer_ids: list[int] | None = None) -> list[Component]:
    ids = _layer_ids(pool) if layer_ids is None else layer_ids
    layout = _layout(pool, ("mha", "k-only", "mla", "dsa"))
    if layout == "mha":
        return _mha_components(pool, prefix, space, ids)
    if layout == "k-only":
        return _konly_components(pool, prefix, space, ids)
    if layout == "mla":
        return _mla_components(pool, prefix, space, ids)
    return _dsa_components(pool, prefix, space, ids)


def _layout(pool: Any, allowed: Sequence[str]) -> str:
    """The layout of ``pool``'s exact class (:mod:`sglang.pdsafe.kv_layouts`) if it is one of
    ``allowed``; else :class:`UnsupportedLayout` naming the class and why it is refused."""
    cls = type(pool)
    layout, why = kv_layouts.verdict(cls)
    if layout is None:
        raise UnsupportedLayout(
            f"KV pool {cls.__module__}.{cls.__qualname__} is refused: {why}; refusing rather "
            "than digesting part of the KV (docs/kv-support.md)")
    if layout not in allowed:
        raise UnsupportedLayout(
            f"KV pool {cls.__module__}.{cls.__qualname__} ({layout}) cannot be a sub-pool here; "
            "refusing rather than digesting part of the KV (docs/kv-support.md)")
    return layout


def _mamba_components(mamba_pool: Any) -> list[Component]:
    if getattr(mamba_pool, "_slot_siblings", ()):
        raise UnsupportedLayout("Mamba pool with slot-sibling states: layout not digested yet")
    cache = mamba_pool.mamba_cache
    layer_ids = [int(i) for i in mamba_pool.mamba_layer_ids]
    out: list[Component] = []
    for i, conv in enumerate(cache.conv):
        if conv.numel() == 0:
            continue
        out += [_row_component(f"mamba.conv{i}", lid, Space.STATE, conv[li])
                for li, lid in enumerate(layer_ids)]
    if cache.temporal is not None and cache.temporal.numel() > 0:
        out += [_row_component("mamba.temporal", lid, Space.STATE, cache.temporal[li])
                for li, lid in enumerate(layer_ids)]
    return out


def components(pool: Any) -> list[Component]:
    """Every component decode reads from ``pool``, in digest order (module docstring)."""
    layout = _layout(pool, ("mha", "k-only", "mla", "dsa", "swa", "hybrid-linear"))
    if layout == "swa":
        full_ids = sorted((loc, g) for g, (loc, swa) in pool.layers_mapping.items() if not swa)
        swa_ids = sorted((loc, g) for g, (loc, swa) in pool.layers_mapping.items() if swa)
        comps = _attention_components(pool.full_kv_pool, "full.", Space.TOKEN,
                                      [g for _, g in full_ids])
        comps += _attention_components(pool.swa_kv_pool, "swa.", Space.SWA,
                                       [g for _, g in swa_ids])
    elif layout == "hybrid-linear":
        full_ids = sorted((loc, g) for g, loc in pool.full_attention_layer_id_mapping.items())
        comps = _attention_components(pool.full_kv_pool, "full.", Space.TOKEN,
                                      [g for _, g in full_ids])
        comps += _mamba_components(pool.mamba_pool)
    else:
        comps = _attention_components(pool, "", Space.TOKEN)
    _check_covers_transfer(pool, comps)
    return comps


def draft_components(draft_pool: Any, target: DsaGeometry | None = None) -> list[Component]:
    """Every component of a speculative-decoding draft pool (EAGLE, MTP) that the PD transfer
    writes next to the target pool (upstream appends its buffers to ``kv_data_ptrs``, the last
    ``num_draft_entries``). The draft KV shares the target's token indices, so its rows are
    addressed by the same ``req_to_token`` row; a draft pool of a layout the digest does not
    cover, or with a registered buffer no component covers, is refused like a target pool. A
    draft DSA pool with ``index_kpool`` > 1 is covered when its grouping equals the target's
    (``target``, the target pool's :class:`DsaGeometry`): same entries, same tail rows."""
    comps = _attention_components(draft_pool, "draft.", Space.TOKEN)
    mine = dsa_geometry(draft_pool)
    if mine is not None and mine != target:
        # Its index entries and tail rows are addressed like the target's (same positions,
        # same req_pool_idx); a grouping of its own would need an index map of its own.
        raise UnsupportedLayout(
            f"a draft DSA pool whose index grouping ({mine}) differs from the target pool's "
            f"({target}) is not digested")
    _check_covers_transfer(draft_pool, comps)
    return comps


def _transfer_buffers(pool: Any) -> list[tuple[str, int]]:
    """(source, data_ptr) of every non-empty buffer the PD transfer registers for ``pool``."""
    out: list[tuple[str, int]] = []
    for meth in ("get_contiguous_buf_infos", "get_state_buf_infos", "get_kv_scale_buf_infos",
                 "get_swa_kv_scale_buf_infos", "get_compress_tail_buf_infos"):
        fn = getattr(pool, meth, None)
        if fn is None:
            continue
        try:
            ptrs, lens, _ = fn()
        except (NotImplementedError, AttributeError, TypeError):
            continue  # the pool has no such buffers (upstream's base methods raise or miss)
        out += [(meth, int(p)) for p, n in zip(ptrs, lens, strict=True) if int(n) > 0]
    return out


def _check_covers_transfer(pool: Any, comps: Sequence[Component]) -> None:
    covered = {c.storage_ptr for c in comps}
    missing = [(m, p) for m, p in _transfer_buffers(pool) if p not in covered]
    if missing:
        raise UnsupportedLayout(
            f"{type(pool).__name__}: the transfer registers {len(missing)} buffer(s) that no "
            f"digested component covers (first: {missing[0][0]} ptr {missing[0][1]:#x}); "
            "refusing rather than digesting part of the KV")


def layout_signature(pool: Any, comps: Sequence[Component] | None = None,
                     draft_pool: Any = None) -> Signature:
    """The signature of ``pool``'s digested layout (see the module docstring), and of the
    draft pool's when one is transferred with it (a leg with a draft pool and one without never
    share a signature: the decode refuses such a transfer as invalid)."""
    if comps is None:
        comps = components(pool) + ([] if draft_pool is None
                                    else draft_components(draft_pool, dsa_geometry(pool)))
    parts = [SCHEME, f"leaf={LEAF_BYTES}", f"byteorder={sys.byteorder}",
             f"pool={type(pool).__name__}"] + (
        [] if draft_pool is None else [f"draft={type(draft_pool).__name__}"]) + [
        c.describe() for c in comps]
    text = ";".join(parts)
    return Signature(text=text, digest=xxhash.xxh3_128_digest(text.encode()))


@dataclass(frozen=True)
class Prepared:
    """A pool with its components and signature worked out once (:func:`prepare`)."""

    pool: Any
    components: tuple[Component, ...]
    signature: Signature
    dsa: DsaGeometry | None = None  # the grouped DSA index's addressing (index_kpool > 1)


def prepare(pool: Any, draft_pool: Any = None) -> Prepared:
    """Work out ``pool``'s components and signature once (about 1-2 ms for 64 components),
    with the speculative-decoding ``draft_pool``'s after them when the transfer carries one.

    A server does this when its KV pool is built and passes the result to
    :func:`digest_request`; prepare again if the pool's buffers are ever reallocated.
    """
    comps = components(pool)
    if draft_pool is not None:
        comps += draft_components(draft_pool, dsa_geometry(pool))
    return Prepared(pool, tuple(comps), layout_signature(pool, comps, draft_pool),
                    dsa_geometry(pool))


# --------------------------------------------------------------------------- scrub


def _grouped_indices(prepared: Prepared, row: torch.Tensor, prefix: int, length: int,
                     tail_row: int | None) -> dict[Space, torch.Tensor]:
    """The INDEX and TAIL indices of a request's ``[prefix, length)`` when the pool has a
    grouped DSA index (:class:`DsaGeometry`); empty otherwise."""
    geo = prepared.dsa
    if geo is None:
        return {}
    locs = row[prefix:length].to("cpu", torch.int64).numpy()
    return {Space.INDEX: torch.from_numpy(geo.entries(locs)),
            Space.TAIL: torch.from_numpy(geo.tail_rows(tail_row, length))}


def scrub_request(pool: Any | Prepared, req_to_token_row: Any, *, prefix: int, length: int,
                  state_indices: Sequence[int] | torch.Tensor = (),
                  tail_row: int | None = None) -> int:
    """Zero every row of the request's ``[prefix, length)`` (and its state slots) in every
    component decode reads: a request whose KV nobody transferred (upstream's fake transfer)
    then decodes over zeros, never over what an earlier request left in those pages. Returns
    the number of rows zeroed. A component whose rows it cannot address raises
    :class:`UnsupportedLayout` before anything is written (the caller refuses the request).
    ``tail_row``: the request's ``req_pool_idx`` (a grouped DSA index with a tail ring)."""
    prepared = pool if isinstance(pool, Prepared) else prepare(pool)
    prefix, length = int(prefix), int(length)
    row = torch.as_tensor(req_to_token_row).reshape(-1)
    idx = {Space.TOKEN: _index_tensor(row[prefix:length]),
           Space.STATE: _index_tensor(state_indices),
           **_grouped_indices(prepared, row, prefix, length, tail_row)}
    for c in prepared.components:
        if c.clear is None or c.space not in idx:
            raise UnsupportedLayout(f"cannot zero {c.describe()} (no row write for this "
                                    "layout)")
        n = int(idx[c.space].numel())
        if n and not (0 <= int(idx[c.space].min()) and int(idx[c.space].max()) < c.slots):
            raise ValueError(f"{c.describe()}: index out of range [0, {c.slots})")
    done = 0
    for c in prepared.components:
        if idx[c.space].numel():
            c.clear(idx[c.space])
            done += int(idx[c.space].numel())
    return done


# --------------------------------------------------------------------------- digest


def leaf_rows(row_bytes: int) -> int:
    """Rows per leaf for rows of ``row_bytes`` bytes."""
    return max(1, LEAF_BYTES // max(int(row_bytes), 1))


def _breaks(idx: np.ndarray) -> np.ndarray:
    """``breaks[i]``: slot ``i + 1`` does not follow slot ``i`` (a new run starts there)."""
    return np.diff(idx) != 1


def _runs(idx: np.ndarray, breaks: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Maximal runs of consecutive slots, in order: (first slot of each, its rows), as int64
    arrays (vectorized: a fragmented row has as many runs as positions)."""
    if idx.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    brk = _breaks(idx) if breaks is None else breaks
    starts = np.concatenate(([0], np.flatnonzero(brk) + 1))
    lens = np.diff(np.append(starts, idx.size))
    return idx[starts].astype(np.int64), lens.astype(np.int64)


def _pieces(lens: np.ndarray, rows_per_leaf: int) -> int:
    """How many (leaf, run) pieces :func:`_leaf_plan` would cut runs of ``lens`` rows into
    (a run spans every leaf its rows fall in), computed without building the plan."""
    if lens.size == 0:
        return 0
    first = np.cumsum(lens) - lens  # stream position of each run's first row
    t = int(rows_per_leaf)
    return int(((first + lens - 1) // t - first // t + 1).sum())


def _stream_plan(idx: np.ndarray, t: int, path: str, breaks: dict[Space, np.ndarray],
                 runs: dict[Space, tuple[np.ndarray, np.ndarray]],
                 space: Space) -> list[list[tuple[int, int]]] | None:
    """The zero-copy plan of ``idx`` in leaves of ``t`` rows, or None when ``auto`` gathers
    it instead (more than four pieces per leaf: a fragmented row). Vectorized; the run
    arrays are built only when the run count allows streaming (memoized per space)."""
    if space not in breaks:
        breaks[space] = _breaks(idx)
    limit = 4 * (-(-idx.size // t))
    if path == "auto" and int(np.count_nonzero(breaks[space])) + 1 > limit:
        return None  # at least one piece per run: too many to stream
    if space not in runs:
        runs[space] = _runs(idx, breaks[space])
    if path == "auto" and _pieces(runs[space][1], t) > limit:
        return None
    return _leaf_plan(runs[space], t)


def _leaf_plan(runs: tuple[np.ndarray, np.ndarray],
               rows_per_leaf: int) -> list[list[tuple[int, int]]]:
    """Split the runs at leaf boundaries: per leaf, its (first slot, rows) pieces. Built only
    for the zero-copy stream path, which is taken only when the pieces are few (at most four
    per leaf), so this loop is bounded by the leaves, not by the positions."""
    plan: list[list[tuple[int, int]]] = []
    cur: list[tuple[int, int]] = []
    room = rows_per_leaf
    for slot, n in zip(runs[0].tolist(), runs[1].tolist(), strict=True):
        while n > 0:
            take = min(n, room)
            cur.append((slot, take))
            slot, n, room = slot + take, n - take, room - take
            if room == 0:
                plan.append(cur)
                cur, room = [], rows_per_leaf
    if cur:
        plan.append(cur)
    return plan


def _leaves_stream(rows: np.ndarray, plan: Sequence[Sequence[tuple[int, int]]]) -> list[bytes]:
    out = []
    one_shot = xxhash.xxh3_128_digest
    for pieces in plan:
        if len(pieces) == 1:
            s, n = pieces[0]
            out.append(one_shot(rows[s:s + n]))
        else:
            h = xxhash.xxh3_128()
            for s, n in pieces:
                h.update(rows[s:s + n])
            out.append(h.digest())
    return out


def _leaves_gather(comp: Component, idx: torch.Tensor, rows_per_leaf: int,
                   scratch: dict[int, torch.Tensor]) -> list[bytes]:
    out: list[bytes] = []
    n = int(idx.numel())
    step = max(1, _GATHER_STEP_BYTES // max(comp.row_bytes * rows_per_leaf, 1)) * rows_per_leaf
    buf = scratch.get(comp.row_bytes)
    if buf is None or buf.shape[0] < min(step, n):
        buf = scratch[comp.row_bytes] = torch.empty((min(step, n), comp.row_bytes),
                                                    dtype=torch.uint8)
    one_shot = xxhash.xxh3_128_digest
    for a in range(0, n, step):
        g = comp.gather(idx[a:a + step], out=buf)
        if g.device.type != "cpu":
            g = g.cpu()
        arr = g.numpy()
        out += [one_shot(arr[k:k + rows_per_leaf]) for k in range(0, arr.shape[0], rows_per_leaf)]
    return out


# --------------------------------------------------------------------------- device path
#
# Same leaves, same bytes, hashed on the GPU: the rows are gathered on the device by each
# component's own ``gather`` (the index arithmetic of the CPU gather path) into one device
# buffer, whole leaves per component, and :mod:`sglang.pdsafe.kv_digest_triton` hashes every
# leaf of the buffer in one launch (its XXH3-128 is bit-identical to ``xxhash``, which its tests
# check), so the digest does not depend on the path. Only the 16-byte leaf digests come back to
# the host; the root hash stays here. Triton is imported lazily: this module works without it.

#: Bytes of gathered rows per kernel launch (whole leaves; one leaf bigger than this, a row
#: of more than 64 MiB, goes alone). Bounds the transient device memory of a digest.
DEVICE_BATCH_BYTES = 64 * 1024 * 1024


def _device_path(comps: Sequence[Component]) -> bool:
    """``auto``'s choice: the Triton path when every component lives on one CUDA/HIP device,
    Triton can run there, and ``SGLANG_PDSAFE_KV_DIGEST_TRITON=0`` is not set (that switch only
    moves the hashing to the host: the digest is the same)."""
    if not comps or any(c.device.type != "cuda" for c in comps):
        return False
    if len({c.device for c in comps}) != 1:
        return False
    from sglang.pdsafe import kv_digest_triton

    return not kv_digest_triton.disabled_by_env() and kv_digest_triton.available(comps[0].device)


def _leaves_device(comps: Sequence[Component],
                   idx_by_space: dict[Space, torch.Tensor]) -> list[list[bytes]]:
    """Per component (in order), its leaf digests, computed on the components' device."""
    from sglang.pdsafe import kv_digest_triton

    devices = {c.device for c in comps}
    if len(devices) != 1 or not kv_digest_triton.available(comps[0].device):
        raise ValueError(f"the Triton path cannot run on {sorted(map(str, devices))} "
                         "(needs one CUDA/HIP device with Triton, or Triton's interpreter on CPU)")
    device = comps[0].device
    idx_dev = {s: t.to(device) for s, t in idx_by_space.items()}
    out: list[list[bytes]] = [[] for _ in comps]
    # A chunk: (component, first row, rows), whole leaves, at an 8-aligned buffer offset.
    chunks: list[tuple[int, int, int]] = []
    size = 0

    def flush() -> None:
        nonlocal size
        if not chunks:
            return
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        offsets: list[int] = []
        lengths: list[int] = []
        owners: list[int] = []
        pos = 0
        for ci, a, rows in chunks:
            c = comps[ci]
            rb, t = c.row_bytes, leaf_rows(c.row_bytes)
            view = buf[pos:pos + rows * rb].view(rows, rb)
            g = c.gather(idx_dev[c.space][a:a + rows], out=view)
            if g.data_ptr() != view.data_ptr():
                view.copy_(g)
            for k in range(0, rows, t):
                offsets.append(pos + k * rb)
                lengths.append(min(t, rows - k) * rb)
                owners.append(ci)
            pos += -(-rows * rb // 8) * 8
        for ci, d in zip(owners, kv_digest_triton.xxh3_128_leaves(buf, offsets, lengths),
                         strict=True):
            out[ci].append(d)
        chunks.clear()
        size = 0

    for ci, c in enumerate(comps):
        n = int(idx_dev[c.space].numel())
        t = leaf_rows(c.row_bytes)
        step = max(1, DEVICE_BATCH_BYTES // (t * c.row_bytes)) * t
        for a in range(0, n, step):
            rows = min(step, n - a)
            need = -(-rows * c.row_bytes // 8) * 8
            if chunks and size + need > DEVICE_BATCH_BYTES:
                flush()
            chunks.append((ci, a, rows))
            size += need
    flush()
    return out


def _index_tensor(values: Any) -> torch.Tensor:
    """int64 indices on the CPU (each component's gather moves them to its device)."""
    return torch.as_tensor(values).to(device="cpu", dtype=torch.int64).reshape(-1)


def _check_range(comp: Component, lo: int, hi: int, what: str) -> None:
    if lo < 0 or hi >= comp.slots:
        raise ValueError(f"{what} index out of range for {comp.describe()}: [{lo}, {hi}] "
                         f"not within [0, {comp.slots})")


@dataclass
class RequestPlan:
    """What :func:`digest_request` reads for one request, worked out before any row is hashed
    (:func:`plan_request`): the indices of every space, checked against every component, and
    per component how its rows are read (a stream plan of zero-copy pieces per leaf, or None:
    gathered). Vectorized: no step here loops over positions or runs in Python (the stream
    plan is built only when it has at most four pieces per leaf)."""

    prefix: int
    length: int
    window: int
    n_state: int
    idx: dict[Space, torch.Tensor]
    streams: list[list[list[tuple[int, int]]] | None]  # per component (None: gather)
    on_device: bool


def plan_request(pool: Any | Prepared, req_to_token_row: Any, *, prefix: int, length: int,
                 state_indices: Sequence[int] | torch.Tensor = (),
                 swa_window: int | None = None, path: str = "auto",
                 tail_row: int | None = None) -> RequestPlan:
    """The :class:`RequestPlan` of the request's owned KV ``[prefix, length)`` (arguments as
    :func:`digest_request`, which calls it); raises before any row is read when an index is
    out of range or maps to the padding slot."""
    if path not in ("auto", "stream", "gather", "triton"):
        raise ValueError(f"unknown path {path!r}")
    prefix, length = int(prefix), int(length)
    if not 0 <= prefix <= length:
        raise ValueError(f"need 0 <= prefix <= length, got [{prefix}, {length})")
    prepared = pool if isinstance(pool, Prepared) else prepare(pool)
    pool, comps = prepared.pool, prepared.components
    row = torch.as_tensor(req_to_token_row).reshape(-1)
    if row.numel() < length:
        raise ValueError(f"req_to_token row has {row.numel()} entries, need {length}")
    spaces = {c.space for c in comps}
    window = 0
    idx_by_space: dict[Space, torch.Tensor] = {}
    if Space.TOKEN in spaces:
        idx_by_space[Space.TOKEN] = _index_tensor(row[prefix:length])
    if Space.SWA in spaces:
        if not swa_window or int(swa_window) <= 0:
            raise ValueError("an SWA pool needs swa_window (the sliding window in tokens)")
        window = int(swa_window)
        start = max(prefix, length - window)
        mapping = pool.full_to_swa_index_mapping
        if mapping is None:
            raise ValueError("SWA pool without a full-to-SWA mapping (register_mapping)")
        full = row[start:length].to(device=mapping.device, dtype=torch.int64)
        idx_by_space[Space.SWA] = _index_tensor(pool.translate_loc_from_full_to_swa(full))
    n_state = 0
    if Space.STATE in spaces:
        st = _index_tensor(state_indices)
        if st.numel() == 0:
            raise ValueError("a pool with request state needs state_indices (its state slots)")
        idx_by_space[Space.STATE] = st
        n_state = int(st.numel())
    if spaces & {Space.INDEX, Space.TAIL}:
        idx_by_space.update(_grouped_indices(prepared, row, prefix, length, tail_row))

    np_idx = {s: t.numpy() for s, t in idx_by_space.items()}
    bounds = {s: (int(a.min()), int(a.max())) if a.size else (0, -1) for s, a in np_idx.items()}
    # Every index is checked before any row is read (on a GPU an out-of-range gather is a
    # device fault, not an exception).
    for c in comps:
        if idx_by_space[c.space].numel() == 0:
            continue
        lo, hi = bounds[c.space]
        _check_range(c, lo, hi, c.space.value)
        if lo == 0 and c.space in (Space.TOKEN, Space.SWA, Space.INDEX):
            # Slot 0 is every pool's padding slot (dummy writes land there); a position that
            # points at it has no KV of its own (an SWA position whose window KV was freed).
            raise ValueError(f"a position of [{prefix}, {length}) maps to the padding slot 0 "
                             f"of {c.describe()}: it has no KV to digest")
    on_device = path == "triton" or (path == "auto" and _device_path(comps))
    streams: list[list[list[tuple[int, int]]] | None] = [None] * len(comps)
    if not on_device:
        breaks: dict[Space, np.ndarray] = {}
        runs: dict[Space, tuple[np.ndarray, np.ndarray]] = {}
        plans: dict[tuple[Space, int], list[list[tuple[int, int]]] | None] = {}
        for ci, c in enumerate(comps):
            n = int(idx_by_space[c.space].numel())
            if n == 0:
                continue
            if path == "stream" and c.rows is None:
                raise ValueError(f"{c.describe()} has no zero-copy rows (not CPU or not "
                                 "contiguous)")
            if c.rows is None or path == "gather":
                continue
            t = leaf_rows(c.row_bytes)
            key = (c.space, t)
            if key not in plans:
                plans[key] = _stream_plan(np_idx[c.space], t, path, breaks, runs, c.space)
            streams[ci] = plans[key]
    return RequestPlan(prefix, length, window, n_state, idx_by_space, streams, on_device)


def digest_request(pool: Any | Prepared, req_to_token_row: Any, *, prefix: int, length: int,
                   room: int, generation: int = 0, state_indices: Sequence[int] | torch.Tensor = (),
                   swa_window: int | None = None, path: str = "auto",
                   tail_row: int | None = None) -> KvDigest:
    """The digest of the request's owned KV ``[prefix, length)`` in ``pool``.

    ``req_to_token_row``: the request's row of ``req_to_token`` (position -> KV location; at
    least ``length`` entries), the same call on prefill (before sending) and on decode (over
    its own row, after receiving). ``state_indices``: the request's state slots (Mamba pools;
    required there). ``swa_window``: the sliding window in tokens (SWA pools; required there).
    ``tail_row``: the request's ``req_pool_idx`` (required for a grouped DSA index with a
    compressed tail ring, :class:`DsaGeometry`). ``path``: ``auto``, ``stream`` (zero-copy from
    the pool, CPU tensors only), ``gather`` or ``triton`` (leaves hashed on the device by
    :mod:`kv_digest_triton`; ``auto`` takes it for pools on a CUDA/HIP device, see
    :func:`_device_path`); all give the same digest. ``pool``
    may be a :class:`Prepared` pool (no per-call setup). Planning (:func:`plan_request`), then
    hashing (:func:`digest_planned`).
    """
    prepared = pool if isinstance(pool, Prepared) else prepare(pool)
    plan = plan_request(prepared, req_to_token_row, prefix=prefix, length=length,
                        state_indices=state_indices, swa_window=swa_window, path=path,
                        tail_row=tail_row)
    return digest_planned(prepared, plan, room=room, generation=generation)


def digest_planned(prepared: Prepared, plan: RequestPlan, *, room: int,
                   generation: int = 0) -> KvDigest:
    """Hash the rows :func:`plan_request` planned (the second half of :func:`digest_request`)."""
    comps, sig = prepared.components, prepared.signature
    idx_by_space = plan.idx
    device_leaves = _leaves_device(comps, idx_by_space) if plan.on_device else None
    scratch: dict[int, torch.Tensor] = {}
    h = xxhash.xxh3_128()
    h.update(MAGIC + sig.digest)
    h.update(struct.pack("<7Q", int(room) & _U64, int(generation) & _U64, plan.prefix,
                         plan.length - plan.prefix, plan.window, plan.n_state, len(comps)))
    for ci, c in enumerate(comps):
        idx = idx_by_space[c.space]
        n = int(idx.numel())
        h.update(struct.pack("<Q", n))
        if n == 0:
            continue
        if device_leaves is not None:
            h.update(b"".join(device_leaves[ci]))
            continue
        stream = plan.streams[ci]
        leaves = (_leaves_stream(c.rows.numpy(), stream) if stream is not None
                  else _leaves_gather(c, idx, leaf_rows(c.row_bytes), scratch))
        h.update(b"".join(leaves))
    value = h.digest()
    if value == _ZERO:
        value = _ONE
    return KvDigest(room=int(room) & _U64, generation=int(generation) & _U64,
                    prefix=plan.prefix, token_count=plan.length - plan.prefix,
                    signature=sig.digest, value=value, signature_text=sig.text)


# --------------------------------------------------------------------------- verify


class Outcome(enum.Enum):
    OK = "ok"
    MISSING = "missing"  # no digest, or a zero one
    LAYOUT = "layout"  # the layout signatures differ
    BINDING = "binding"  # room, generation, prefix or token count differ
    MISMATCH = "mismatch"  # the KV bytes differ


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    message: str = ""
    differs: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


_BOUND = ("room", "generation", "prefix", "token_count")


def _absent(d: KvDigest | None) -> str | None:
    if d is None:
        return "no digest"
    if len(d.value) != DIGEST_SIZE or len(d.signature) != DIGEST_SIZE:
        return "a malformed digest"
    if d.value == _ZERO or d.signature == _ZERO:
        return "a zero digest"
    return None


def verify(expected: KvDigest | None, actual: KvDigest | None, rid: str = "?") -> Verdict:
    """Compare prefill's digest (``expected``) with decode's own (``actual``).

    Every case but equality fails: a missing, zero or malformed digest on either side, a
    different layout signature, a different bound field, a different value. ``rid`` only
    names the request in the message; nothing depends on it.
    """
    head = "KV integrity check failed"
    ref = actual if actual is not None else expected
    where = (f"request {rid}, room {ref.room}, generation {ref.generation}" if ref is not None
             else f"request {rid}")
    for side, d in (("prefill", expected), ("decode", actual)):
        why = _absent(d)
        if why is not None:
            return Verdict(Outcome.MISSING, f"{head} ({where}): {side} produced {why}; the KV "
                                            "cannot be checked, so it is not used")
    assert expected is not None and actual is not None
    if expected.signature != actual.signature:
        detail = ""
        if expected.signature_text and actual.signature_text:
            detail = f": prefill {expected.signature_text!r}, decode {actual.signature_text!r}"
        return Verdict(Outcome.LAYOUT, f"{head} ({where}): prefill and decode digest different "
                                       f"KV layouts{detail}", ("signature",))
    differs = tuple(f for f in _BOUND if getattr(expected, f) != getattr(actual, f))
    if differs:
        both = ", ".join(f"{f} {getattr(expected, f)} vs {getattr(actual, f)}" for f in differs)
        return Verdict(Outcome.BINDING, f"{head} ({where}): the digest is for another transfer "
                                        f"({both}, prefill vs decode)", differs)
    if expected.value != actual.value:
        return Verdict(Outcome.MISMATCH, f"{head} ({where}): tokens [{actual.prefix}, "
                                         f"{actual.prefix + actual.token_count}) differ from "
                                         "what prefill sent", ("value",))
    return Verdict(Outcome.OK)
