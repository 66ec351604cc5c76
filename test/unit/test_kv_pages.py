"""The page-content oracle of ``pdsafe_testkit.kv.pages`` on plain numpy pools (no processes).

Invariant: ``classify_pages`` tells apart, per page and per layer's K/V, this request's data at
the right place (OWN), another room's data with that room decoded (FOREIGN), never-written
decode memory (POISON), unwritten prefill memory (STALE_SOURCE), own data at the wrong place
(MISPLACED), damaged rows (CORRUPT) and mixtures (MIXED); rows past the request are ignored.
"""

from __future__ import annotations

import numpy as np
import pytest
from pdsafe_testkit.kv.pages import (
    BitFlip,
    PageKind,
    apply_bit_flip,
    classify_pages,
    count_own_rows,
    encode_rows,
    fill_data_pages,
    fill_poison_pages,
    fill_stale_pages,
)

PS = 4
NUM_PAGES = 8
LAYER_KV = [(0, 0), (1, 0), (0, 1), (1, 1)]  # K0 K1 V0 V1, the pool order
ROOM_A = 2**63 - 12345  # rooms are 63-bit
ROOM_B = 7


def _pool() -> list[np.ndarray]:
    bufs = [np.zeros(((NUM_PAGES + 1) * PS, 8), dtype=np.int64) for _ in LAYER_KV]
    fill_poison_pages(bufs, LAYER_KV, range(1, NUM_PAGES + 1), PS)
    return bufs


def _classify(bufs: list[np.ndarray], pages: list[int], room: int, n: int) -> list:
    return classify_pages(bufs, LAYER_KV, page_size=PS, pages=pages, room=room, num_tokens=n)


def test_own_foreign_poison() -> None:
    bufs = _pool()
    fill_data_pages(bufs, LAYER_KV, [3, 1], PS, ROOM_A, 0, 2 * PS)
    own = _classify(bufs, [3, 1], ROOM_A, 2 * PS)
    assert [v.kind for v in own] == [PageKind.OWN, PageKind.OWN]
    assert all(v.rooms == (ROOM_A,) and len(v.buffers) == 4 for v in own)
    foreign = _classify(bufs, [3, 1, 5], ROOM_B, 3 * PS)
    assert [v.kind for v in foreign] == [PageKind.FOREIGN, PageKind.FOREIGN, PageKind.POISON]
    assert foreign[0].foreign_rooms(ROOM_B) == (ROOM_A,)


def test_misplaced_positions_and_layers() -> None:
    bufs = _pool()
    fill_data_pages(bufs, LAYER_KV, [1, 2], PS, ROOM_A, 0, 2 * PS)
    # pages swapped: right room, wrong token positions
    assert {v.kind for v in _classify(bufs, [2, 1], ROOM_A, 2 * PS)} == {PageKind.MISPLACED}
    # layer 0's K landed in layer 1's K
    bufs[1][:] = bufs[0]
    v = _classify(bufs, [1, 2], ROOM_A, 2 * PS)[0]
    assert v.kind is PageKind.MIXED
    assert [b.kind for b in v.buffers] == [
        PageKind.OWN,
        PageKind.MISPLACED,
        PageKind.OWN,
        PageKind.OWN,
    ]


def test_partial_page_stale_and_ignored_tail() -> None:
    bufs = _pool()
    fill_stale_pages(bufs, LAYER_KV, [4], PS)
    fill_data_pages(bufs, LAYER_KV, [4], PS, ROOM_A, 0, 1)  # one token of four written
    v = _classify(bufs, [4], ROOM_A, PS)[0]
    assert v.kind is PageKind.MIXED
    assert v.buffers[0].kinds == (PageKind.OWN,) + (PageKind.STALE_SOURCE,) * (PS - 1)
    # the same page as the last page of a 1-token request: rows past the request are ignored
    assert _classify(bufs, [4], ROOM_A, 1)[0].kind is PageKind.OWN


def test_corrupt_row_and_bad_arguments() -> None:
    bufs = _pool()
    fill_data_pages(bufs, LAYER_KV, [6], PS, ROOM_A, 0, PS)
    bufs[2][6 * PS + 1, 5] ^= 1  # one bit of one check word of V0, row 1
    v = _classify(bufs, [6], ROOM_A, PS)[0]
    assert v.buffers[2].kinds[1] is PageKind.CORRUPT and v.kind is PageKind.MIXED
    with pytest.raises(ValueError):
        _classify(bufs, [6], ROOM_A, PS + 1)


def test_bit_flip_changes_exactly_one_bit_of_the_named_row() -> None:
    """``apply_bit_flip`` (the KV harness's test-only corruption) flips the named bit of the
    named byte of the named (layer, K/V, page, slot) row and nothing else; every header and
    check word is covered, so the flipped row classifies CORRUPT; out-of-range flips raise."""
    for byte in (0, 7, 8, 15, 16, 63):  # tag, owner, position and a check word
        bufs = _pool()
        fill_data_pages(bufs, LAYER_KV, [5, 2], PS, ROOM_A, 0, PS + 2)
        before = [b.copy() for b in bufs]
        flip = BitFlip(layer=1, kv=1, page=2, slot=1, byte=byte, bit=byte % 8)
        old, new = apply_bit_flip(bufs, LAYER_KV, PS, flip)
        assert old ^ new == 1 << flip.bit
        diff = [(i, *map(int, np.argwhere(b != a)[0])) for i, (b, a) in
                enumerate(zip(bufs, before, strict=True)) if (b != a).any()]
        assert diff == [(3, 2 * PS + 1, byte // 8)]  # V1 is the 4th buffer; one word
        assert int(np.count_nonzero(bufs[3].view(np.uint8) != before[3].view(np.uint8))) == 1
        verdicts = _classify(bufs, [5, 2], ROOM_A, PS + 2)
        assert verdicts[0].kind is PageKind.OWN
        assert verdicts[1].buffers[3].kinds == (PageKind.OWN, PageKind.CORRUPT)
        assert all(b.kind is PageKind.OWN for b in verdicts[1].buffers[:3])
    bufs = _pool()
    for bad in (BitFlip(0, 0, 1, PS, 0, 0), BitFlip(0, 0, 1, 0, 64, 0),
                BitFlip(0, 0, 1, 0, 0, 8), BitFlip(2, 0, 1, 0, 0, 0),
                BitFlip(0, 0, NUM_PAGES + 1, 0, 0, 0)):
        with pytest.raises(ValueError):
            apply_bit_flip(bufs, LAYER_KV, PS, bad)


def test_vectorized_fills_match_the_row_encoding_and_count_own_rows() -> None:
    """The fills write one vectorized step per range (issue 22: a million pages), row by row
    what ``encode_rows`` defines; ``count_own_rows`` (no per-page verdicts) agrees with
    ``classify_pages`` on partial, foreign, misplaced and unwritten pages."""
    bufs = _pool()
    for buf, (layer, kv) in zip(bufs, LAYER_KV, strict=True):
        want = encode_rows(0x0B150B1502, layer, kv, np.full(PS, 5), np.arange(PS), 8)
        assert (buf[5 * PS:6 * PS].view(np.uint64) == want).all()
    fill_stale_pages(bufs, LAYER_KV, [2], PS)
    fill_data_pages(bufs, LAYER_KV, [6, 2, 7], PS, ROOM_A, 1, 2 * PS + 3)  # partial ends
    for buf, (layer, kv) in zip(bufs, LAYER_KV, strict=True):
        rows = buf.view(np.uint64)
        assert (rows[7 * PS + 2] == encode_rows(0xDA7A5EED01, layer, kv, np.array([ROOM_A]),
                                                np.array([2 * PS + 2]), 8)[0]).all()
        assert rows[6 * PS, 1] == 6  # token 0 was not written: still page 6's poison
    n = 2 * PS + 3

    def counted(pages: list[int], room: int) -> int:
        return count_own_rows(bufs, LAYER_KV, page_size=PS, pages=pages, room=room,
                              num_tokens=n)

    assert counted([6, 2, 7], ROOM_A) == (n - 1) * len(LAYER_KV)  # all but token 0
    assert counted([6, 2, 7], ROOM_B) == 0
    assert counted([2, 6, 7], ROOM_A) == 3 * len(LAYER_KV)  # only page 7's rows in place
    fill_data_pages(bufs, LAYER_KV, [6, 2, 7], PS, ROOM_A, 0, 1)
    assert counted([6, 2, 7], ROOM_A) == n * len(LAYER_KV)
    assert all(v.kind is PageKind.OWN for v in _classify(bufs, [6, 2, 7], ROOM_A, n))
