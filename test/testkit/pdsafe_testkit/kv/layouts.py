"""Slot byte patterns of the KV harness for the MLA and DSA pool kinds (pure numpy).

The MHA lanes keep ``pages``' self-describing 64-bit rows. A lane of another pool kind
(``POOL_KINDS``) sees its pool as *components*, each one ``[pages, page_size, width]`` uint8
array (a view of the real pool's memory) of one layer:

* ``kv``: MLA's ``kv_buffer[layer]`` row of a slot (the latent ``kv_lora_rank`` part, then
  the rope part), both kinds;
* ``index_k`` / ``index_scale`` (DSA only): the slot's indexer key bytes and scale bytes in
  upstream's ``index_k_with_scale_buffer[layer]`` page row (all key bytes of the page, then
  all scale bytes: slot ``o`` of page ``p`` is ``buf[p, o * dim:(o + 1) * dim]`` and
  ``buf[p, page * dim + o * s:page * dim + (o + 1) * s]``). For ``dsa-kpool``
  (``index_kpool`` K = 4) the same split holds *entries*: a page row has ``page // K``
  entries, and position ``t`` of the page is entry ``t // K`` (``Component.group``);
* ``tail_k`` / ``tail_score`` (``dsa-kpool`` only, the compressed index): one layer's
  ``get_compress_tail_buffers(layer)`` as ``[requests, ring, width]``; the request's row
  (its ``req_pool_idx``) holds its last ``length % K`` positions at ring slot
  ``t % ring`` (``Component.tail``; upstream's ``get_dsa_tail_state_indices``);
* ``draft_k`` / ``draft_v`` / ``draft_kv`` (``mha-draft`` / ``mla-draft`` only): the
  speculative-decoding draft pool's rows of a slot, addressed like the target's (the draft
  KV shares the target's token indices), for the draft's ``DRAFT_LAYERS`` layers.

Every slot of a component is filled with a pattern derived from (magic, component, layer,
owner, position) by ``pages``' 64-bit mix: DATA (owner = the bootstrap room, position = the
token index, or for an entry the group index ``t // K``: the prefill "forward"), POISON
(owner = the decode page, or tail row, position = the slot in it) and STALE (owner = the
prefill page, or tail row). Unlike ``pages``' rows the bytes carry no
header, so a slot is classified by comparing it with the patterns it may hold: OWN (this
request's data at this position), POISON, STALE_SOURCE, or CORRUPT (anything else: a flipped
bit, another request's row, another slot's row).

Invariant: this module imports neither torch nor sglang; the children pass numpy views.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdsafe_testkit.kv.pages import (
    MAGIC_DATA,
    MAGIC_POISON,
    MAGIC_STALE,
    BitFlip,
    BufferVerdict,
    PageKind,
    PageVerdict,
    _merge,
    _mix64,
)

__all__ = [
    "COMPONENTS",
    "DRAFT_LAYERS",
    "INDEX_HEAD_DIM",
    "INDEX_SCALE_BYTES",
    "KPOOL_GROUP",
    "KPOOL_RING",
    "KPOOL_TAIL_BYTES",
    "KPOOL_TAIL_EXTRA",
    "KV_LORA_RANK",
    "POOL_KINDS",
    "QK_ROPE_HEAD_DIM",
    "REGIONS",
    "SPACES",
    "Component",
    "RowCopy",
    "SWA_WINDOW",
    "address",
    "component_layers",
    "apply_corruption",
    "classify_components",
    "fill_data",
    "fill_pattern",
    "swa_page",
    "tail_positions",
    "window_positions",
]

#: The pool kinds a lane can build: sglang's MHATokenToKVPool (default), MLATokenToKVPool,
#: DSATokenToKVPool (index_kpool 1; 64-token pages, as upstream requires on CUDA/CPU), and
#: ``dsa-kpool``: DSATokenToKVPool with index_kpool 4, the compressed index and a tail ring
#: of 4 + 2 rows (GLM-5.3-Flash's indexer; 256-token pages, one 64-entry index page each).
#: ``hybrid``: HybridLinearKVPool (MHA full-attention layers 1 and 3, bf16 head 16) over
#: the real Mamba2 ``MambaPool`` of a ``HybridReqToTokenPool`` (layers 0 and 2).
#: ``swa``: SWAKVPool (MHA full-attention layers 1 and 3, sliding-window layers 0 and 2,
#: bf16 head 16; window ``SWA_WINDOW``) with upstream's SWATokenToKVPoolAllocator mapping.
#: ``mha-draft``: an MHATokenToKVPool target (bf16 head 16) with a separate MHATokenToKVPool
#: draft of ``DRAFT_LAYERS`` layers (EAGLE's draft worker); ``mla-draft``: an
#: MLATokenToKVPool target with an MLATokenToKVPool draft of ``DRAFT_LAYERS`` layers
#: (DeepSeek/GLM MTP). Both pools registered for the transfer, the draft's entries last.
POOL_KINDS: tuple[str, ...] = ("mha", "mla", "dsa", "dsa-kpool", "hybrid", "swa",
                               "mha-draft", "mla-draft")
#: The components of each non-MHA kind, in the order a lane lists them per layer.
COMPONENTS: dict[str, tuple[str, ...]] = {
    "mla": ("kv",),
    "dsa": ("kv", "index_k", "index_scale"),
    "dsa-kpool": ("kv", "index_k", "index_scale", "tail_k", "tail_score"),
    "hybrid": ("k", "v", "conv0", "temporal"),
    "swa": ("k", "v", "swa_k", "swa_v"),
    "mha-draft": ("k", "v", "draft_k", "draft_v"),
    "mla-draft": ("kv", "draft_kv"),
}
#: The draft pool's layers (``mha-draft``, ``mla-draft``): fewer than the target's, as
#: EAGLE's one-layer draft model and MTP's one NextN layer.
DRAFT_LAYERS = 1
#: ``dsa-kpool``: positions per index entry (``index_kpool``), extra tail-ring rows
#: (``tail_extra_slots``), the ring (their sum) and the tail rows' width (128 bf16).
KPOOL_GROUP = 4
KPOOL_TAIL_EXTRA = 2
KPOOL_RING = KPOOL_GROUP + KPOOL_TAIL_EXTRA
#: The small upstream dimensions the lanes build: MLA's latent and rope head (bf16), DSA's
#: indexer head (upstream asserts 128) and its scale bytes (one fp32 per 128-wide block).
KV_LORA_RANK = 32
QK_ROPE_HEAD_DIM = 16
INDEX_HEAD_DIM = 128
INDEX_SCALE_BYTES = 4
#: The byte regions of a slot decode reads, per kind: (component, region, start, stop).
REGIONS: dict[str, tuple[tuple[str, str, int, int], ...]] = {
    "mla": (("kv", "latent", 0, 2 * KV_LORA_RANK),
            ("kv", "rope", 2 * KV_LORA_RANK, 2 * (KV_LORA_RANK + QK_ROPE_HEAD_DIM))),
}
REGIONS["dsa"] = REGIONS["mla"] + (("index_k", "key", 0, INDEX_HEAD_DIM),
                                   ("index_scale", "scale", 0, INDEX_SCALE_BYTES))
#: ``dsa-kpool``'s tail rows: ``tail_k`` and ``tail_score``, each ``INDEX_HEAD_DIM`` bf16.
KPOOL_TAIL_BYTES = 2 * INDEX_HEAD_DIM
REGIONS["dsa-kpool"] = REGIONS["dsa"] + (("tail_k", "row", 0, KPOOL_TAIL_BYTES),
                                         ("tail_score", "row", 0, KPOOL_TAIL_BYTES))
#: ``hybrid``: the full pool's K/V head (1 x 16 bf16) and one Mamba2 state slot's conv
#: (80 x 3 bf16) and temporal (4 x 16 x 8 fp32) bytes (``Mamba2StateShape.create`` with
#: intermediate 64, 1 group, 4 heads of 16, state 8, kernel 4).
HYBRID_HEAD_BYTES = 32
HYBRID_CONV_BYTES = 80 * 3 * 2
HYBRID_TEMPORAL_BYTES = 4 * 16 * 8 * 4
REGIONS["hybrid"] = (("k", "row", 0, HYBRID_HEAD_BYTES), ("v", "row", 0, HYBRID_HEAD_BYTES),
                     ("conv0", "state", 0, HYBRID_CONV_BYTES),
                     ("temporal", "state", 0, HYBRID_TEMPORAL_BYTES))
REGIONS["swa"] = (("k", "row", 0, HYBRID_HEAD_BYTES), ("v", "row", 0, HYBRID_HEAD_BYTES),
                  ("swa_k", "row", 0, HYBRID_HEAD_BYTES),
                  ("swa_v", "row", 0, HYBRID_HEAD_BYTES))
#: The draft kinds: the target's regions, then the draft's (same geometry, own bytes).
REGIONS["mha-draft"] = REGIONS["swa"][:2] + (("draft_k", "row", 0, HYBRID_HEAD_BYTES),
                                            ("draft_v", "row", 0, HYBRID_HEAD_BYTES))
REGIONS["mla-draft"] = REGIONS["mla"] + tuple(("draft_kv", region, lo, hi)
                                              for _, region, lo, hi in REGIONS["mla"])
#: ``swa``: the sliding window (positions ``[length - SWA_WINDOW, length)`` are owned in
#: the SWA sub-pool).
SWA_WINDOW = 30
#: How each component of a kind addresses a position (``Component.group`` / ``.tail``):
#: ``token`` (one slot per position), ``entry`` (one per ``KPOOL_GROUP`` positions),
#: ``tail`` (a ring slot of the request's tail row, the last ``length % K`` positions),
#: ``state`` (the request's state slot: one row for the whole request), ``swa`` (position
#: ``t``'s slot in the SWA sub-pool: ``swa_page(page)``, same offset; owned in the window).
SPACES: dict[str, dict[str, str]] = {
    "mla": {"kv": "token"},
    "dsa": {"kv": "token", "index_k": "token", "index_scale": "token"},
    "dsa-kpool": {"kv": "token", "index_k": "entry", "index_scale": "entry",
                  "tail_k": "tail", "tail_score": "tail"},
    "hybrid": {"k": "token", "v": "token", "conv0": "state", "temporal": "state"},
    "swa": {"k": "token", "v": "token", "swa_k": "swa", "swa_v": "swa"},
    "mha-draft": {"k": "token", "v": "token", "draft_k": "token", "draft_v": "token"},
    "mla-draft": {"kv": "token", "draft_kv": "token"},
}
_COMPONENT_IDS = {"kv": 0, "index_k": 1, "index_scale": 2, "tail_k": 3, "tail_score": 4,
                  "k": 5, "v": 6, "conv0": 7, "temporal": 8, "swa_k": 9, "swa_v": 10,
                  "draft_k": 11, "draft_v": 12, "draft_kv": 13}
_U64 = np.uint64


@dataclass(frozen=True)
class Component:
    """One layer's bytes of one component: ``array[page, slot]`` is a slot's ``width`` bytes.

    Invariant: ``array`` is a writable view of the pool's memory (never a copy).
    """

    name: str
    layer: int
    array: np.ndarray  # uint8 [pages, page_size // group, width]; tail: [rows, ring, width]
    #: Positions per slot: 1 (a token slot) or ``index_kpool`` (an index entry, or the
    #: group whose trailing positions a tail ring holds).
    group: int = 1
    #: A tail ring (``array[row, t % ring]``) rather than a paged component.
    tail: bool = False
    #: A request state slot (``array[slot, 0]``, one row a request; ``[slots, 1, width]``).
    state: bool = False
    #: A sliding-window sub-pool: position ``t`` of full page ``p`` sits at
    #: ``array[swa_page(p, pages), t % page_size]``; owned in the last ``window`` positions.
    window: int = 0


@dataclass(frozen=True)
class RowCopy:
    """Test-only corruption: the bytes of slot (``src_page``, ``src_slot``) of component
    ``component`` of layer ``layer`` copied over slot (``page``, ``slot``) of the same
    component and layer (a foreign row: another request's, or another position's)."""

    component: str
    layer: int
    src_page: int
    src_slot: int
    page: int
    slot: int

    def describe(self) -> str:
        return (f"{self.component}@layer{self.layer} page {self.src_page} slot {self.src_slot}"
                f" -> page {self.page} slot {self.slot}")


def _pattern(magic: int, comp: str, layer: int, owner: np.ndarray, pos: np.ndarray,
             width: int) -> np.ndarray:
    """uint8 ``[n, width]``: the pattern bytes of ``n`` slots (owner/pos broadcast)."""
    tag = _U64((magic << 16) | (layer << 4) | _COMPONENT_IDS[comp])
    owner_u, pos_u = np.broadcast_arrays(np.asarray(owner, dtype=np.uint64),
                                         np.asarray(pos, dtype=np.uint64))
    words = np.arange(-(-width // 8), dtype=np.uint64)[None, :]
    mixed = _mix64(tag, owner_u[:, None], pos_u[:, None], words)
    return np.ascontiguousarray(mixed).view(np.uint8)[:, :width]


def tail_positions(num_tokens: int, group: int) -> range:
    """The positions a request of ``num_tokens`` keeps in its tail ring (the last
    ``num_tokens % group`` ones; none for ``group`` 1)."""
    n = num_tokens % group if group > 1 else 0
    return range(num_tokens - n, num_tokens)


def swa_page(page: int, num_pages: int) -> int:
    """The SWA page the lanes map full page ``page`` (of ``1..num_pages``) to: reversed, so
    that a digest reading the SWA pool at the full location reads the wrong page."""
    return num_pages + 1 - page


def window_positions(num_tokens: int, window: int) -> range:
    """The positions a sliding-window layer owns: the last ``window`` (all when fewer)."""
    return range(max(0, num_tokens - window), num_tokens)


def address(kind: str, comp: str, pages: Sequence[int], page_size: int, pos: int,
            tail_row: int, state_slot: int = -1, num_pages: int = 0) -> tuple[int, int]:
    """The parent's side of the components' addressing: (page, tail row or state slot; slot)
    of request position ``pos`` in component ``comp`` of a ``kind`` lane (``SPACES``)."""
    space = SPACES[kind][comp]
    if space == "state":
        return state_slot, 0
    if space == "swa":
        return swa_page(pages[pos // page_size], num_pages), pos % page_size
    if space == "tail":
        return tail_row, pos % KPOOL_RING
    group = KPOOL_GROUP if space == "entry" else 1
    return int(pages[pos // page_size]), (pos % page_size) // group


def component_layers(comp: str, num_layers: int) -> int:
    """The layers a lane has of component ``comp``: the draft pool's ``DRAFT_LAYERS`` for a
    draft component, else the target's ``num_layers``."""
    return DRAFT_LAYERS if comp.startswith("draft_") else num_layers


def fill_pattern(comps: Sequence[Component], pages: Sequence[int], page_size: int,
                 magic: int) -> None:
    """Every slot of ``pages``: POISON/STALE pattern (owner = page, position = slot); a tail
    ring's or state component's every row, whatever ``pages`` (owner = row, position =
    slot)."""
    for c in comps:
        rows = (range(c.array.shape[0]) if c.tail or c.state else
                [swa_page(p, c.array.shape[0] - 1) for p in pages] if c.window else list(pages))
        slots = c.array.shape[1]
        p = np.repeat(np.asarray(list(rows), dtype=np.int64), slots)
        o = np.tile(np.arange(slots, dtype=np.int64), len(p) // slots if slots else 0)
        c.array[p, o] = _pattern(magic, c.name, c.layer, p, o, c.array.shape[2])


def fill_data(comps: Sequence[Component], pages: Sequence[int], page_size: int, room: int,
              start: int, stop: int, tail_row: int | None = None,
              state_slot: int | None = None) -> None:
    """The prefill "forward": ``room``'s DATA bytes into the owned slots of tokens
    ``[start, stop)`` of every component (other slots untouched): an entry component the
    entries of the groups those tokens touch (position = group index), a tail ring the
    positions of ``tail_positions(stop)`` in ``[start, stop)`` at row ``tail_row``, a state
    component the request's state after ``stop`` tokens (position = ``stop``) at
    ``state_slot`` (each chunk overwrites it), an SWA component every position's row at
    ``swa_page`` (the model writes them all; only the window is owned)."""
    if stop <= start:
        return
    for c in comps:
        width = c.array.shape[2]
        if c.state:
            if state_slot is None:
                raise ValueError(f"{c.name} is a state component: give the state slot")
            c.array[state_slot, 0] = _pattern(MAGIC_DATA, c.name, c.layer, np.uint64(room),
                                              np.full(1, stop, np.uint64), width)[0]
            continue
        if c.tail:
            ts = [t for t in tail_positions(stop, c.group) if t >= start]
            if not ts:
                continue
            if tail_row is None:
                raise ValueError(f"{c.name} is a tail ring: give the request's tail row")
            t_arr = np.asarray(ts, dtype=np.int64)
            c.array[tail_row, t_arr % c.array.shape[1]] = _pattern(
                MAGIC_DATA, c.name, c.layer, np.uint64(room), t_arr.astype(np.uint64), width)
            continue
        g = np.arange(start // c.group, -(-stop // c.group), dtype=np.int64)
        first = g * c.group
        p = np.asarray(pages, dtype=np.int64)[first // page_size]
        if c.window:  # the model writes every position's SWA row (the window is read)
            p = c.array.shape[0] - p  # swa_page(p, pages), element-wise
        o = first % page_size // c.group
        c.array[p, o] = _pattern(MAGIC_DATA, c.name, c.layer, np.uint64(room),
                                 g.astype(np.uint64), width)


def classify_components(comps: Sequence[Component], *, page_size: int, pages: Sequence[int],
                        room: int, num_tokens: int, tail_row: int | None = None,
                        state_slot: int | None = None) -> list[PageVerdict]:
    """``pages.classify_pages`` for components: one ``BufferVerdict`` per component and layer
    (``kv`` holds the component name), one kind per owned slot (an entry component: per
    owned entry). Tail rings: one more ``PageVerdict`` (``position`` = ``len(pages)``,
    ``page`` = ``tail_row``) with one kind per tail position, in position order, when the
    request keeps any (``tail_positions``). State components: one more (``page`` =
    ``state_slot``, one kind: OWN when it holds the state after ``num_tokens``). SWA
    components: one more per request page holding window positions (``page`` = its SWA
    page, one kind per window position of it, in order)."""
    verdicts: list[PageVerdict] = []
    paged = [c for c in comps if not (c.tail or c.state or c.window)]
    for position, page in enumerate(pages):
        tokens = max(0, min(page_size, num_tokens - position * page_size))
        bvs: list[BufferVerdict] = []
        for c in paged:
            n = -(-tokens // c.group)
            o = np.arange(n, dtype=np.int64)
            pos = np.arange(position * page_size // c.group,
                            position * page_size // c.group + n, dtype=np.uint64)
            bvs.append(_verdict(c, c.array[int(page), :n], room, pos,
                                (np.uint64(page), o), o))
        verdicts.append(_page_verdict(position, int(page), tokens, bvs))
    tails = [c for c in comps if c.tail]
    if tails:
        ts = np.asarray(list(tail_positions(num_tokens, tails[0].group)), dtype=np.int64)
        if ts.size:
            if tail_row is None:
                raise ValueError("tail ring components: give the request's tail row")
            bvs = []
            for c in tails:
                o = ts % c.array.shape[1]
                bvs.append(_verdict(c, c.array[tail_row, o], room, ts.astype(np.uint64),
                                    (np.uint64(tail_row), o), o))
            verdicts.append(_page_verdict(len(pages), tail_row, int(ts.size), bvs))
    windowed = [c for c in comps if c.window]
    if windowed:
        win = window_positions(num_tokens, windowed[0].window)
        for position, page in enumerate(pages):
            lo = max(win.start, position * page_size)
            hi = min(num_tokens, (position + 1) * page_size)
            if lo >= hi:
                continue
            o = np.arange(lo - position * page_size, hi - position * page_size, dtype=np.int64)
            sp = swa_page(page, windowed[0].array.shape[0] - 1)
            bvs = [_verdict(c, c.array[sp, o], room, np.arange(lo, hi, dtype=np.uint64),
                            (np.uint64(sp), o), o) for c in windowed]
            verdicts.append(_page_verdict(len(verdicts), sp, hi - lo, bvs))
    states = [c for c in comps if c.state]
    if states:
        if state_slot is None:
            raise ValueError("state components: give the request's state slot")
        zero = np.zeros(1, dtype=np.int64)
        bvs = [_verdict(c, c.array[state_slot, :1], room, np.full(1, num_tokens, np.uint64),
                        (np.uint64(state_slot), zero), zero) for c in states]
        verdicts.append(_page_verdict(len(pages), state_slot, 1, bvs))
    return verdicts


def _verdict(c: Component, got: np.ndarray, room: int, pos: np.ndarray,
             poison: tuple[np.ndarray, np.ndarray], slots: np.ndarray) -> BufferVerdict:
    """The kinds of the rows ``got`` of ``c`` (positions ``pos``; POISON owner and slots;
    their ``slots`` for the STALE test)."""
    width = c.array.shape[2]
    candidates = (
        (PageKind.OWN, _pattern(MAGIC_DATA, c.name, c.layer, np.uint64(room), pos, width)),
        (PageKind.POISON, _pattern(MAGIC_POISON, c.name, c.layer, *poison, width)),
    )
    kinds = [PageKind.CORRUPT] * len(got)
    for kind, want in candidates:
        for i in np.flatnonzero(np.all(got == want, axis=1)):
            kinds[int(i)] = kind
    for i, k in enumerate(kinds):  # stale rows of any prefill page (owner unknown)
        if k is PageKind.CORRUPT and _is_stale(c, got[i], int(slots[i])):
            kinds[i] = PageKind.STALE_SOURCE
    return BufferVerdict(layer=c.layer, kv=c.name,
                         kind=_merge(kinds) if kinds else PageKind.OWN,
                         rooms=(room,) if PageKind.OWN in kinds else (), kinds=tuple(kinds))


def _page_verdict(position: int, page: int, tokens: int,
                  bvs: list[BufferVerdict]) -> PageVerdict:
    return PageVerdict(position=position, page=page, tokens=tokens,
                       kind=_merge(b.kind for b in bvs),
                       rooms=tuple(sorted({r for b in bvs for r in b.rooms})),
                       buffers=tuple(bvs))


def _is_stale(c: Component, row: np.ndarray, slot: int) -> bool:
    """Whether ``row`` is the STALE pattern of slot ``slot`` of some page of ``c``'s pool
    (a page-granular transfer keeps a slot's offset within its page)."""
    pages = np.arange(c.array.shape[0], dtype=np.int64)
    want = _pattern(MAGIC_STALE, c.name, c.layer, pages, np.int64(slot), c.array.shape[2])
    return bool(np.any(np.all(want == row[None, :], axis=1)))


def _component(comps: Sequence[Component], name: str, layer: int) -> Component:
    for c in comps:
        if c.name == name and c.layer == layer:
            return c
    raise ValueError(f"no component {name} of layer {layer}")


def apply_corruption(comps: Sequence[Component], page_size: int,
                     what: BitFlip | RowCopy) -> tuple[int, int]:
    """Apply one test-only corruption in place; returns (a byte before, after).

    ``page`` / ``slot`` address the component's own rows (``locate``): a page's token slot,
    a page's index entry, or a tail ring's (row, ring slot); ``page_size`` is unused.

    ``BitFlip.component`` names the component (its ``byte`` indexes the slot's bytes of that
    component); a ``RowCopy`` returns the first byte that differs (or byte 0's value twice
    when the rows were equal). Raises ``ValueError`` outside the component (never wraps).
    """
    if isinstance(what, RowCopy):
        c = _component(comps, what.component, what.layer)
        for p, o in ((what.src_page, what.src_slot), (what.page, what.slot)):
            if not (0 <= o < c.array.shape[1] and 0 <= p < c.array.shape[0]):
                raise ValueError(f"row copy out of range: {what.describe()}")
        before = c.array[what.page, what.slot].copy()
        c.array[what.page, what.slot] = c.array[what.src_page, what.src_slot]
        diff = np.flatnonzero(before != c.array[what.page, what.slot])
        i = int(diff[0]) if diff.size else 0
        return int(before[i]), int(c.array[what.page, what.slot, i])
    c = _component(comps, what.component, what.layer)
    width = c.array.shape[2]
    if not (0 <= what.slot < c.array.shape[1] and 0 <= what.page < c.array.shape[0]
            and 0 <= what.byte < width and 0 <= what.bit < 8):
        raise ValueError(f"flip out of range: {what.describe()} ({width} bytes a slot)")
    before = int(c.array[what.page, what.slot, what.byte])
    c.array[what.page, what.slot, what.byte] = before ^ (1 << what.bit)
    return before, int(c.array[what.page, what.slot, what.byte])
