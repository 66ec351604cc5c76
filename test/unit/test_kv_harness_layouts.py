"""The slot-pattern oracle of ``pdsafe_testkit.kv.layouts`` on plain numpy components.

Invariant: ``classify_components`` tells apart, per page, component and layer, this request's
bytes at the right position (OWN), never-written decode memory (POISON), unwritten prefill
memory (STALE_SOURCE) and anything else (CORRUPT: a flipped bit, a row copied from another
request or position); slots past the request are ignored; corruptions touch exactly the slot
and component they name. The same holds for the grouped-index entries, the tail ring, the
state slot and the sliding-window sub-pool of the ``dsa-kpool`` / ``hybrid`` / ``swa`` kinds,
where only the positions each of them owns are classified.
"""

from __future__ import annotations

import numpy as np
import pytest
from pdsafe_testkit.kv.layouts import (
    REGIONS,
    Component,
    RowCopy,
    address,
    apply_corruption,
    classify_components,
    fill_data,
    fill_pattern,
)
from pdsafe_testkit.kv.pages import MAGIC_POISON, MAGIC_STALE, BitFlip, PageKind

PS = 4
NUM_PAGES = 6
ROOM_A, ROOM_B = 2**63 - 99, 5


def _comps() -> list[Component]:
    widths = {"kv": 96, "index_k": 128, "index_scale": 4}
    return [Component(name, layer, np.zeros((NUM_PAGES + 1, PS, w), dtype=np.uint8))
            for layer in (0, 1) for name, w in widths.items()]


def _kinds(verdicts: list, comp: str, layer: int) -> list[list[PageKind]]:
    return [list(b.kinds) for v in verdicts for b in v.buffers
            if b.kv == comp and b.layer == layer]


def test_own_poison_stale_and_ignored_tail() -> None:
    comps = _comps()
    fill_pattern(comps, range(1, NUM_PAGES + 1), PS, MAGIC_POISON)
    pages = [5, 2, 3]
    fill_data(comps, pages, PS, ROOM_A, 0, 6)  # tokens 0-5; 6, 7, 8 never written
    fill_pattern([c for c in comps if c.name == "index_k"], [3], PS, MAGIC_STALE)
    v = classify_components(comps, page_size=PS, pages=pages, room=ROOM_A, num_tokens=9)
    assert [x.tokens for x in v] == [4, 4, 1]
    assert _kinds(v, "kv", 1) == [[PageKind.OWN] * 4, [PageKind.OWN] * 2 + [PageKind.POISON] * 2,
                                  [PageKind.POISON]]
    assert _kinds(v, "index_k", 0)[2] == [PageKind.STALE_SOURCE]
    assert v[0].kind is PageKind.OWN and v[1].kind is PageKind.MIXED
    fill_data(comps, pages, PS, ROOM_A, 6, 9)  # chunked: the rest, same bytes as in one go
    whole = _comps()
    fill_data(whole, pages, PS, ROOM_A, 0, 9)
    t = np.arange(9)
    p, o = np.asarray(pages)[t // PS], t % PS
    for a, b in zip(comps, whole, strict=True):
        assert np.array_equal(a.array[p, o], b.array[p, o])
    v = classify_components(comps, page_size=PS, pages=pages, room=ROOM_A, num_tokens=9)
    assert all(x.kind is PageKind.OWN for x in v)  # slots 1-3 of page 3 are not the request's


@pytest.mark.parametrize(("comp", "region", "lo", "hi"), REGIONS["dsa"])
def test_flip_and_row_copy_land_on_exactly_one_slot(comp: str, region: str, lo: int,
                                                    hi: int) -> None:
    comps = _comps()
    fill_data(comps, [1, 2], PS, ROOM_B, 0, 2 * PS)  # another request, pages 1-2
    pages = [4, 6]
    fill_data(comps, pages, PS, ROOM_A, 0, 7)
    before = [c.array.copy() for c in comps]
    old, new = apply_corruption(comps, PS, BitFlip(layer=1, kv=0, page=6, slot=2, byte=hi - 1,
                                                   bit=7, component=comp))
    assert new == old ^ 0x80
    changed = [(c.name, c.layer) for c, b in zip(comps, before, strict=True)
               if not np.array_equal(c.array, b)]
    assert changed == [(comp, 1)]
    v = classify_components(comps, page_size=PS, pages=pages, room=ROOM_A, num_tokens=7)
    assert _kinds(v, comp, 1)[1] == [PageKind.OWN, PageKind.OWN, PageKind.CORRUPT]
    assert sum(k is not PageKind.OWN for b in (x.buffers for x in v) for y in b
               for k in y.kinds) == 1
    comps = _comps()
    fill_data(comps, [1, 2], PS, ROOM_B, 0, 2 * PS)
    fill_data(comps, pages, PS, ROOM_A, 0, 7)
    old, new = apply_corruption(comps, PS, RowCopy(comp, 0, 1, 1, 4, 1))  # ROOM_B's row
    assert old != new
    v = classify_components(comps, page_size=PS, pages=pages, room=ROOM_A, num_tokens=7)
    assert _kinds(v, comp, 0)[0] == [PageKind.OWN, PageKind.CORRUPT, PageKind.OWN,
                                     PageKind.OWN]
    width = next(c.array.shape[2] for c in comps if c.name == comp)
    with pytest.raises(ValueError):  # never wraps into the next slot
        apply_corruption(comps, PS, BitFlip(layer=0, kv=0, page=1, slot=0, byte=width, bit=0,
                                            component=comp))


def _spaced(kind: str, ps: int) -> list[Component]:
    """Small numpy components of ``kind`` shaped as the lanes shape them."""
    shapes = {"token": (NUM_PAGES + 1, ps), "entry": (NUM_PAGES + 1, ps // 4), "tail": (5, 6),
              "state": (9, 1), "swa": (NUM_PAGES + 1, ps)}
    from pdsafe_testkit.kv.layouts import SPACES

    out = []
    for layer in (0, 1):
        for name, space in SPACES[kind].items():
            out.append(Component(name, layer, np.zeros((*shapes[space], 8), dtype=np.uint8),
                                 group=4 if space in ("entry", "tail") else 1,
                                 tail=space == "tail", state=space == "state",
                                 window=6 if space == "swa" else 0))
    return out


@pytest.mark.parametrize("kind", ["dsa-kpool", "hybrid", "swa"])
def test_grouped_tail_state_and_window_components(kind: str) -> None:
    """Chunked fills equal one fill and classify OWN; a flip at each component's address of
    an owned position turns exactly that verdict slot CORRUPT; a flip at an unowned one (a
    pre-window SWA row, a tail-ring slot of an older position) changes no verdict."""
    ps, pages, n = 8, [5, 2, 3], 8 + 8 + 7  # 23 % 4 = 3 in the ring; window 6: 17..22
    kw = {"tail_row": 1, "state_slot": 4}
    comps = _spaced(kind, ps)
    fill_pattern(comps, range(1, NUM_PAGES + 1), ps, MAGIC_POISON)
    fill_data(comps, pages, ps, ROOM_A, 0, 16, **kw)
    fill_data(comps, pages, ps, ROOM_A, 16, n, **kw)
    v = classify_components(comps, page_size=ps, pages=pages, room=ROOM_A, num_tokens=n, **kw)
    assert all(x.kind is PageKind.OWN for x in v), v
    for c in comps:
        pos = n - 1
        page, slot = address(kind, c.name, pages, ps, pos, 1, 4, NUM_PAGES)
        flip = BitFlip(layer=c.layer, kv=0, page=page, slot=slot, byte=0, bit=0,
                       component=c.name)
        apply_corruption(comps, ps, flip)
        v = classify_components(comps, page_size=ps, pages=pages, room=ROOM_A, num_tokens=n,
                                **kw)
        bad = [(b.kv, b.layer, x.page) for x in v for b in x.buffers
               if any(k is PageKind.CORRUPT for k in b.kinds)]
        assert bad == [(c.name, c.layer, page)], (c.name, bad)
        apply_corruption(comps, ps, flip)
    unowned = {"tail_k": 19, "swa_k": 3}  # an older ring position; a pre-window position
    for c in comps:
        if c.name in unowned:
            page, slot = address(kind, c.name, pages, ps, unowned[c.name], 1, 4, NUM_PAGES)
            apply_corruption(comps, ps, BitFlip(layer=c.layer, kv=0, page=page, slot=slot,
                                                byte=0, bit=0, component=c.name))
    v = classify_components(comps, page_size=ps, pages=pages, room=ROOM_A, num_tokens=n, **kw)
    assert all(x.kind is PageKind.OWN for x in v)
