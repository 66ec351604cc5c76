"""Slot byte patterns of the KV harness for the MLA and DSA pool kinds (pure numpy).

The MHA lanes keep ``pages``' self-describing 64-bit rows. A lane of another pool kind
(``POOL_KINDS``) sees its pool as *components*, each one ``[pages, page_size, width]`` uint8
array (a view of the real pool's memory) of one layer:

* ``kv``: MLA's ``kv_buffer[layer]`` row of a slot (the latent ``kv_lora_rank`` part, then
  the rope part), both kinds;
* ``index_k`` / ``index_scale`` (DSA only): the slot's indexer key bytes and scale bytes in
  upstream's ``index_k_with_scale_buffer[layer]`` page row (all key bytes of the page, then
  all scale bytes: slot ``o`` of page ``p`` is ``buf[p, o * dim:(o + 1) * dim]`` and
  ``buf[p, page * dim + o * s:page * dim + (o + 1) * s]``).

Every slot of a component is filled with a pattern derived from (magic, component, layer,
owner, position) by ``pages``' 64-bit mix: DATA (owner = the bootstrap room, position = the
token index: the prefill "forward"), POISON (owner = the decode page, position = the slot in
the page) and STALE (owner = the prefill page). Unlike ``pages``' rows the bytes carry no
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
    "INDEX_HEAD_DIM",
    "INDEX_SCALE_BYTES",
    "KV_LORA_RANK",
    "POOL_KINDS",
    "QK_ROPE_HEAD_DIM",
    "REGIONS",
    "Component",
    "RowCopy",
    "apply_corruption",
    "classify_components",
    "fill_data",
    "fill_pattern",
]

#: The pool kinds a lane can build: sglang's MHATokenToKVPool (default), MLATokenToKVPool,
#: DSATokenToKVPool (index_kpool 1; 64-token pages, as upstream requires on CUDA/CPU).
POOL_KINDS: tuple[str, ...] = ("mha", "mla", "dsa")
#: The components of each non-MHA kind, in the order a lane lists them per layer.
COMPONENTS: dict[str, tuple[str, ...]] = {
    "mla": ("kv",),
    "dsa": ("kv", "index_k", "index_scale"),
}
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
_COMPONENT_IDS = {"kv": 0, "index_k": 1, "index_scale": 2}
_U64 = np.uint64


@dataclass(frozen=True)
class Component:
    """One layer's bytes of one component: ``array[page, slot]`` is a slot's ``width`` bytes.

    Invariant: ``array`` is a writable view of the pool's memory (never a copy).
    """

    name: str
    layer: int
    array: np.ndarray  # uint8 [pages, page_size, width]


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


def _slots(pages: Sequence[int], page_size: int, start: int, stop: int
           ) -> tuple[np.ndarray, np.ndarray]:
    """(page, slot in page) of request tokens ``[start, stop)`` held by ``pages``."""
    t = np.arange(start, stop, dtype=np.int64)
    return np.asarray(pages, dtype=np.int64)[t // page_size], t % page_size


def fill_pattern(comps: Sequence[Component], pages: Sequence[int], page_size: int,
                 magic: int) -> None:
    """Every slot of ``pages``: POISON/STALE pattern (owner = page, position = slot)."""
    p = np.repeat(np.asarray(list(pages), dtype=np.int64), page_size)
    o = np.tile(np.arange(page_size, dtype=np.int64), len(p) // page_size if page_size else 0)
    for c in comps:
        c.array[p, o] = _pattern(magic, c.name, c.layer, p, o, c.array.shape[2])


def fill_data(comps: Sequence[Component], pages: Sequence[int], page_size: int, room: int,
              start: int, stop: int) -> None:
    """The prefill "forward": ``room``'s DATA bytes into the owned slots of tokens
    ``[start, stop)`` of every component (other slots untouched)."""
    if stop <= start:
        return
    p, o = _slots(pages, page_size, start, stop)
    pos = np.arange(start, stop, dtype=np.uint64)
    for c in comps:
        c.array[p, o] = _pattern(MAGIC_DATA, c.name, c.layer, np.uint64(room), pos,
                                 c.array.shape[2])


def classify_components(comps: Sequence[Component], *, page_size: int, pages: Sequence[int],
                        room: int, num_tokens: int) -> list[PageVerdict]:
    """``pages.classify_pages`` for components: one ``BufferVerdict`` per component and layer
    (``kv`` holds the component name), one kind per owned slot."""
    verdicts: list[PageVerdict] = []
    for position, page in enumerate(pages):
        tokens = max(0, min(page_size, num_tokens - position * page_size))
        o = np.arange(tokens, dtype=np.int64)
        pos = np.arange(position * page_size, position * page_size + tokens, dtype=np.uint64)
        bvs: list[BufferVerdict] = []
        for c in comps:
            width = c.array.shape[2]
            got = c.array[int(page), :tokens]
            candidates = (
                (PageKind.OWN, _pattern(MAGIC_DATA, c.name, c.layer, np.uint64(room), pos,
                                        width)),
                (PageKind.POISON, _pattern(MAGIC_POISON, c.name, c.layer, np.uint64(page), o,
                                           width)),
            )
            kinds = [PageKind.CORRUPT] * tokens
            for kind, want in candidates:
                for i in np.flatnonzero(np.all(got == want, axis=1)):
                    kinds[int(i)] = kind
            for i, k in enumerate(kinds):  # stale rows of any prefill page (owner unknown)
                if k is PageKind.CORRUPT and _is_stale(c, got[i], i):
                    kinds[i] = PageKind.STALE_SOURCE
            bvs.append(BufferVerdict(layer=c.layer, kv=c.name,
                                     kind=_merge(kinds) if kinds else PageKind.OWN,
                                     rooms=(room,) if PageKind.OWN in kinds else (),
                                     kinds=tuple(kinds)))
        verdicts.append(PageVerdict(position=position, page=int(page), tokens=tokens,
                                    kind=_merge(b.kind for b in bvs),
                                    rooms=tuple(sorted({r for b in bvs for r in b.rooms})),
                                    buffers=tuple(bvs)))
    return verdicts


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

    ``BitFlip.component`` names the component (its ``byte`` indexes the slot's bytes of that
    component); a ``RowCopy`` returns the first byte that differs (or byte 0's value twice
    when the rows were equal). Raises ``ValueError`` outside the component (never wraps).
    """
    if isinstance(what, RowCopy):
        c = _component(comps, what.component, what.layer)
        for p, o in ((what.src_page, what.src_slot), (what.page, what.slot)):
            if not (0 <= o < page_size and 0 <= p < c.array.shape[0]):
                raise ValueError(f"row copy out of range: {what.describe()}")
        before = c.array[what.page, what.slot].copy()
        c.array[what.page, what.slot] = c.array[what.src_page, what.src_slot]
        diff = np.flatnonzero(before != c.array[what.page, what.slot])
        i = int(diff[0]) if diff.size else 0
        return int(before[i]), int(c.array[what.page, what.slot, i])
    c = _component(comps, what.component, what.layer)
    width = c.array.shape[2]
    if not (0 <= what.slot < page_size and 0 <= what.page < c.array.shape[0]
            and 0 <= what.byte < width and 0 <= what.bit < 8):
        raise ValueError(f"flip out of range: {what.describe()} ({width} bytes a slot)")
    before = int(c.array[what.page, what.slot, what.byte])
    c.array[what.page, what.slot, what.byte] = before ^ (1 << what.bit)
    return before, int(c.array[what.page, what.slot, what.byte])
