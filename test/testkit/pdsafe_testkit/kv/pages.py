"""Page-content encoding and classification of the KV harness (pure numpy, any process).

Every pool buffer is an int64 tensor of shape ``[(num_pages + 1) * page_size, token_words]``
(one buffer per layer for K and one for V, in MHA order: all K layers, then all V layers).
Page ``p`` is rows ``[p * page_size, (p + 1) * page_size)``; page 0 is sglang's reserved
padding page and is never handed out. Every token row is self-describing:

* word 0: tag = ``magic << 16 | layer << 1 | kv`` (magic says DATA, POISON or STALE),
* word 1: owner: the bootstrap room (DATA), the decode page (POISON), the prefill page (STALE),
* word 2: position: the token index within the request (DATA), the row within the page (else),
* words 3..: check words, a 64-bit mix of (tag, owner, position, word index).

So a decode page can always be classified (``classify_pages``) as this request's data at the
right position (OWN), another request's data with its room decoded (FOREIGN), never written
(POISON: the decode pool is pre-filled with it), prefill memory that no prefill step wrote
(STALE_SOURCE, e.g. the tail of a partially filled last prefill page), misplaced own data, a
mixture, or garbage.

Invariant: this module imports neither torch nor sglang; it works on numpy arrays and on any
object with a ``numpy()`` view (CPU torch tensors in the children).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "MAGIC_DATA",
    "MAGIC_POISON",
    "MAGIC_STALE",
    "MIN_TOKEN_WORDS",
    "BitFlip",
    "BufferVerdict",
    "PageKind",
    "PageVerdict",
    "apply_bit_flip",
    "classify_pages",
    "count_own_rows",
    "encode_rows",
    "fill_data_pages",
    "fill_poison_pages",
    "fill_stale_pages",
    "request_token_ids",
    "token_rows",
]

MAGIC_DATA = 0xDA7A5EED01
MAGIC_POISON = 0x0B150B1502
MAGIC_STALE = 0x57A1E5A7E3
_HEADER_WORDS = 3
MIN_TOKEN_WORDS = 4

_U64 = np.uint64
_MIX_C = (
    _U64(0x9E3779B97F4A7C15),
    _U64(0xC2B2AE3D27D4EB4F),
    _U64(0x165667B19E3779F9),
    _U64(0xD6E8FEB86659FD93),
)


def request_token_ids(room: int, num_tokens: int) -> list[int]:
    """The prompt of the request in ``room`` as both sides hold it (prefill a prefix of it when
    it prefills fewer tokens). Feeds the coverage attestation the scheduler hooks compute."""
    rng = np.random.default_rng(int(room) & ((1 << 64) - 1))  # vectorized: 1M-token prompts
    return rng.integers(4, 512, size=num_tokens, dtype=np.int64).tolist()


def _mix64(tag: np.ndarray, owner: np.ndarray, pos: np.ndarray, word: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer over a linear combination; all uint64, wrapping arithmetic."""
    with np.errstate(over="ignore"):
        x = tag * _MIX_C[0] + owner * _MIX_C[1] + pos * _MIX_C[2] + word * _MIX_C[3]
        x = x ^ (x >> _U64(30))
        x = x * _U64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> _U64(27))
        x = x * _U64(0x94D049BB133111EB)
        return x ^ (x >> _U64(31))


def _tag(magic: int, layer: int, kv: int) -> int:
    if not 0 <= layer < (1 << 15):
        raise ValueError(f"layer {layer} out of range")
    return (magic << 16) | (layer << 1) | (kv & 1)


def encode_rows(
    magic: int, layer: int, kv: int, owner: np.ndarray, pos: np.ndarray, token_words: int
) -> np.ndarray:
    """Token rows (uint64 ``[n, token_words]``) for the given owners and positions.

    ``owner`` and ``pos`` are broadcast to the same length ``n``.
    """
    if token_words < MIN_TOKEN_WORDS:
        raise ValueError(f"token_words must be >= {MIN_TOKEN_WORDS}")
    owner_u, pos_u = np.broadcast_arrays(
        np.asarray(owner, dtype=np.uint64), np.asarray(pos, dtype=np.uint64)
    )
    n = owner_u.shape[0]
    rows = np.empty((n, token_words), dtype=np.uint64)
    tag = _U64(_tag(magic, layer, kv))
    rows[:, 0] = tag
    rows[:, 1] = owner_u
    rows[:, 2] = pos_u
    words = np.arange(_HEADER_WORDS, token_words, dtype=np.uint64)[None, :]
    rows[:, _HEADER_WORDS:] = _mix64(tag, owner_u[:, None], pos_u[:, None], words)
    return rows


def _as_u64(buf: Any) -> np.ndarray:
    """A writable uint64 numpy view of a 2-D int64/uint64 torch tensor or numpy array."""
    arr = buf.numpy() if hasattr(buf, "numpy") and not isinstance(buf, np.ndarray) else buf
    arr = np.asarray(arr)
    if arr.dtype not in (np.int64, np.uint64) or arr.ndim != 2:
        raise TypeError(f"pool buffers must be 2-D int64/uint64, got {arr.dtype} {arr.shape}")
    return arr.view(np.uint64)


def _page_rows(page: int, page_size: int, start: int = 0, stop: int | None = None) -> slice:
    stop = page_size if stop is None else stop
    return slice(page * page_size + start, page * page_size + stop)


#: Rows encoded per step by the fill functions (bounds their temporary memory: a
#: million-token request is filled in steps, not in one array of every row).
_FILL_STEP_ROWS = 1 << 16


def _fill_rows(arr: np.ndarray, rows: np.ndarray, magic: int, layer: int, kv: int,
               owner: np.ndarray, pos: np.ndarray) -> None:
    """``arr[rows[i]] = encode_rows(magic, layer, kv, owner[i], pos[i])``, in bounded steps
    (vectorized: no Python loop over pages or rows)."""
    for a in range(0, rows.size, _FILL_STEP_ROWS):
        b = a + _FILL_STEP_ROWS
        arr[rows[a:b]] = encode_rows(magic, layer, kv, owner[a:b], pos[a:b], arr.shape[1])


def _whole_page_rows(pages: Iterable[int], page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(row index, owner page) of every row of ``pages``, in page order."""
    p = np.fromiter((int(x) for x in pages), dtype=np.int64)
    rows = (p[:, None] * page_size + np.arange(page_size, dtype=np.int64)[None, :]).reshape(-1)
    return rows, np.repeat(p, page_size)


def _fill_pages(buffers: Sequence[Any], layer_kv: Sequence[tuple[int, int]],
                pages: Iterable[int], page_size: int, magic: int) -> None:
    rows, owner = _whole_page_rows(pages, page_size)
    pos = rows - (rows // page_size) * page_size  # the row within its page
    for buf, (layer, kv) in zip(buffers, layer_kv, strict=True):
        _fill_rows(_as_u64(buf), rows, magic, layer, kv, owner, pos)


def fill_poison_pages(
    buffers: Sequence[Any],
    layer_kv: Sequence[tuple[int, int]],
    pages: Iterable[int],
    page_size: int,
) -> None:
    """Write the POISON pattern (owner = the page itself) into every row of ``pages``."""
    _fill_pages(buffers, layer_kv, pages, page_size, MAGIC_POISON)


def fill_stale_pages(
    buffers: Sequence[Any],
    layer_kv: Sequence[tuple[int, int]],
    pages: Iterable[int],
    page_size: int,
) -> None:
    """Write the STALE pattern (prefill memory no prefill step wrote) into ``pages``."""
    _fill_pages(buffers, layer_kv, pages, page_size, MAGIC_STALE)


def token_rows(pages: Sequence[int], page_size: int, token_start: int,
               token_stop: int) -> np.ndarray:
    """The pool row of each request token ``[token_start, token_stop)`` when ``pages[i]``
    holds request tokens ``[i * page_size, (i + 1) * page_size)`` (int64, vectorized)."""
    t = np.arange(token_start, token_stop, dtype=np.int64)
    p = np.asarray(pages, dtype=np.int64)
    return p[t // page_size] * page_size + t % page_size


def fill_data_pages(
    buffers: Sequence[Any],
    layer_kv: Sequence[tuple[int, int]],
    pages: Sequence[int],
    page_size: int,
    room: int,
    token_start: int,
    token_stop: int,
) -> None:
    """Write ``room``'s DATA rows for request tokens ``[token_start, token_stop)``.

    ``pages[i]`` holds request tokens ``[i * page_size, (i + 1) * page_size)``; rows of those
    pages outside the token range are left untouched.
    """
    if token_stop <= token_start:
        return
    rows = token_rows(pages, page_size, token_start, token_stop)
    positions = np.arange(token_start, token_stop, dtype=np.uint64)
    owner = np.full(rows.size, room, dtype=np.uint64)
    for buf, (layer, kv) in zip(buffers, layer_kv, strict=True):
        _fill_rows(_as_u64(buf), rows, MAGIC_DATA, layer, kv, owner, positions)


def count_own_rows(
    buffers: Sequence[Any],
    layer_kv: Sequence[tuple[int, int]],
    *,
    page_size: int,
    pages: Sequence[int],
    room: int,
    num_tokens: int,
) -> int:
    """How many of the request's token rows (every buffer: ``num_tokens`` per layer and
    K/V) hold exactly this request's DATA at the right position and layer: the vectorized
    summary of :func:`classify_pages` for requests too large for per-page verdicts (equal
    to ``num_tokens * len(buffers)`` iff every page would be classified OWN)."""
    own = 0
    for buf, (layer, kv) in zip(buffers, layer_kv, strict=True):
        arr = _as_u64(buf)
        for a in range(0, num_tokens, _FILL_STEP_ROWS):
            b = min(num_tokens, a + _FILL_STEP_ROWS)
            rows = token_rows(pages, page_size, a, b)
            want = encode_rows(MAGIC_DATA, layer, kv, np.full(b - a, room, dtype=np.uint64),
                               np.arange(a, b, dtype=np.uint64), arr.shape[1])
            own += int(np.all(arr[rows] == want, axis=1).sum())
    return own


@dataclass(frozen=True)
class BitFlip:
    """One bit of a pool row (test-only corruption): bit ``bit`` (0 = least significant) of
    byte ``byte`` of the token row in slot ``slot`` of page ``page``, in layer ``layer``'s K
    (``kv`` 0) or V (``kv`` 1) buffer. Bytes are the row's bytes in memory order (what the
    transfer moves and the KV digest hashes), ``token_words * 8`` of them.

    ``component`` (lanes of another pool kind, ``layouts``): the component whose slot bytes
    ``byte`` indexes (``kv`` is then ignored); empty for the MHA K/V rows."""

    layer: int
    kv: int
    page: int
    slot: int
    byte: int
    bit: int
    component: str = ""

    def describe(self) -> str:
        what = self.component or "KV"[self.kv]
        return (f"{what}@layer{self.layer} page {self.page} slot {self.slot} "
                f"byte {self.byte} bit {self.bit}")


def apply_bit_flip(
    buffers: Sequence[Any],
    layer_kv: Sequence[tuple[int, int]],
    page_size: int,
    flip: BitFlip,
) -> tuple[int, int]:
    """Flip ``flip``'s bit in place; returns the byte's value before and after.

    ``buffers[i]`` is the pool buffer of ``layer_kv[i]`` (as in :func:`classify_pages`).
    Raises ``ValueError`` for a flip outside the buffers (never wraps into another row).
    """
    try:
        arr = _as_u64(buffers[list(layer_kv).index((flip.layer, flip.kv))])
    except ValueError as e:
        raise ValueError(f"no buffer for layer {flip.layer} kv {flip.kv}") from e
    row_bytes = arr.shape[1] * 8
    row = flip.page * page_size + flip.slot
    if not (0 <= flip.slot < page_size and 0 <= row < arr.shape[0]
            and 0 <= flip.byte < row_bytes and 0 <= flip.bit < 8):
        raise ValueError(f"flip out of range: {flip.describe()} (page size {page_size}, "
                         f"{arr.shape[0]} rows of {row_bytes} bytes)")
    raw = arr[row].view(np.uint8)
    before = int(raw[flip.byte])
    raw[flip.byte] = before ^ (1 << flip.bit)
    return before, int(raw[flip.byte])


class PageKind(str, enum.Enum):
    """What a decode page (or one layer's K/V of it) holds. Only the request's tokens count."""

    OWN = "own"  #: this request's data, right position, right layer and K/V
    FOREIGN = "foreign"  #: another request's data (its room is decoded into ``rooms``)
    POISON = "poison"  #: never written since the decode pool was (re)poisoned
    STALE_SOURCE = "stale_source"  #: prefill memory that no prefill step wrote
    MISPLACED = "misplaced"  #: this request's data at the wrong position/layer/K-V
    CORRUPT = "corrupt"  #: no valid pattern (torn or foreign bytes)
    MIXED = "mixed"  #: rows of different kinds


@dataclass(frozen=True)
class BufferVerdict:
    """One layer's K or V rows of one page: ``kinds`` has one entry per significant token."""

    layer: int
    kv: str  #: "k" or "v"
    kind: PageKind
    rooms: tuple[int, ...]  #: distinct rooms whose DATA rows were seen (own included)
    kinds: tuple[PageKind, ...]


@dataclass(frozen=True)
class PageVerdict:
    """Classification of one decode page reserved for a request.

    Invariants: ``kind`` is the common kind of every buffer verdict, or MIXED;
    ``rooms`` is the union of the buffers' rooms; ``tokens`` is the number of request tokens
    the page holds (``page_size`` except possibly for the last page).
    """

    position: int  #: page index within the request
    page: int  #: decode page index
    tokens: int
    kind: PageKind
    rooms: tuple[int, ...]
    buffers: tuple[BufferVerdict, ...]

    def foreign_rooms(self, own_room: int) -> tuple[int, ...]:
        return tuple(r for r in self.rooms if r != own_room)


def _classify_rows(
    rows: np.ndarray, layer: int, kv: int, room: int, first_pos: int
) -> tuple[list[PageKind], set[int]]:
    tag = rows[:, 0]
    owner = rows[:, 1]
    pos = rows[:, 2]
    magic = tag >> _U64(16)
    words = np.arange(_HEADER_WORDS, rows.shape[1], dtype=np.uint64)[None, :]
    valid = np.all(
        rows[:, _HEADER_WORDS:] == _mix64(tag[:, None], owner[:, None], pos[:, None], words),
        axis=1,
    )
    own_tag = _U64(_tag(MAGIC_DATA, layer, kv))
    kinds: list[PageKind] = []
    rooms: set[int] = set()
    for i in range(rows.shape[0]):
        m = int(magic[i])
        if not valid[i]:
            kinds.append(PageKind.CORRUPT)
        elif m == MAGIC_DATA:
            r = int(owner[i])
            rooms.add(r)
            if r != room:
                kinds.append(PageKind.FOREIGN)
            elif tag[i] == own_tag and int(pos[i]) == first_pos + i:
                kinds.append(PageKind.OWN)
            else:
                kinds.append(PageKind.MISPLACED)
        elif m == MAGIC_POISON:
            kinds.append(PageKind.POISON)
        elif m == MAGIC_STALE:
            kinds.append(PageKind.STALE_SOURCE)
        else:
            kinds.append(PageKind.CORRUPT)
    return kinds, rooms


def _merge(kinds: Iterable[PageKind]) -> PageKind:
    distinct = set(kinds)
    return distinct.pop() if len(distinct) == 1 else PageKind.MIXED


def classify_pages(
    buffers: Sequence[Any],
    layer_kv: Sequence[tuple[int, int]],
    *,
    page_size: int,
    pages: Sequence[int],
    room: int,
    num_tokens: int,
) -> list[PageVerdict]:
    """Classify the decode pages reserved for request ``room`` of ``num_tokens`` tokens.

    ``buffers[i]`` is the pool buffer of ``layer_kv[i] = (layer, kv)`` (kv 0 = K, 1 = V);
    ``pages[j]`` is the decode page that should hold request tokens
    ``[j * page_size, min((j + 1) * page_size, num_tokens))``. Rows past ``num_tokens`` in the
    last page are not part of the request and are ignored.
    """
    if len(pages) * page_size < num_tokens:
        raise ValueError(f"{len(pages)} pages of {page_size} cannot hold {num_tokens} tokens")
    arrays = [_as_u64(b) for b in buffers]
    verdicts: list[PageVerdict] = []
    for position, page in enumerate(pages):
        tokens = max(0, min(page_size, num_tokens - position * page_size))
        bvs: list[BufferVerdict] = []
        for arr, (layer, kv) in zip(arrays, layer_kv, strict=True):
            rows = arr[_page_rows(page, page_size, 0, tokens)]
            kinds, rooms = _classify_rows(rows, layer, kv, room, position * page_size)
            bvs.append(
                BufferVerdict(
                    layer=layer,
                    kv="kv"[kv],
                    kind=_merge(kinds) if kinds else PageKind.OWN,
                    rooms=tuple(sorted(rooms)),
                    kinds=tuple(kinds),
                )
            )
        verdicts.append(
            PageVerdict(
                position=position,
                page=int(page),
                tokens=tokens,
                kind=_merge(b.kind for b in bvs),
                rooms=tuple(sorted({r for b in bvs for r in b.rooms})),
                buffers=tuple(bvs),
            )
        )
    return verdicts


