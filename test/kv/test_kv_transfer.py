"""KV transfers through the REAL sglang Mooncake and NIXL classes, without a model.

Each test drives one request (or a series) through ``pdsafe_testkit.kv``: decode publishes the
pages it reserved, prefill writes a room-specific pattern into its own pages and sends them, and
the decode pages are classified afterwards (OWN / FOREIGN(room) / POISON / STALE_SOURCE / ...).

Invariants checked here:

* a complete transfer puts this room's data, at the right position, into every reserved decode
  page, for every layer's K and V, and decode commits it (Success, aux room matches) and
  verifies it against prefill's KV digest (``test_kv_digest_bitflip.py``: the corruptions);
* page reuse never lets another room's data survive in a page a complete transfer covered;
* a coverage gap (prefill sends fewer tokens than decode reserved) leaves the tail unwritten;
  the transport still reports Success (stock 0.5.23, characterised in (3a)), so decode must not
  commit it: sglang-pdsafe's commit gate refuses it from prefill's coverage attestation, which
  the harness runs exactly where the patched scheduler does (patches 0004, 0014);
* aborts reach the other side: a decode abort fails prefill within a bound (measured), and a
  prefill abort fails decode within ``PEER_OBSERVE_S`` (patch 0015; stock 0.5.23 never tells
  the peer, which then holds its pages for the 300 s waiting timeout).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import pytest
from pdsafe_testkit.backends import BACKENDS
from pdsafe_testkit.kv import AbortAt, KVLane, PageKind, TransferResult

PAGE_SIZES = [1, 16, 64]

# Request lengths per page size: several pages, the last one partial (except page size 1).
TOKENS = {1: 13, 16: 57, 64: 225}

# Generous backstops, not the discriminator (a noisy 2-core machine): on loopback an abort
# reaches the other side in about a millisecond. What tells the cases apart is the state and the
# reason each side reports (Failed, with the aborting side's reason), not the time.
ABORT_TO_TERMINAL_BOUND_S = 10.0
# How long the non-aborting side is watched (stock sglang never tells it: it stays
# WaitingForInput for its 300 s timeout).
PEER_OBSERVE_S = 10.0


def _assert_all_own(r: TransferResult) -> None:
    """Committed, and every reserved page holds this room's data in every layer's K and V."""
    assert r.decode_state == "Success" and r.prefill_state == "Success", r.describe()
    assert r.aux_room == r.room, r.describe()
    # Positive control of the commit gate: a complete transfer is attested and admitted.
    assert r.gate == "ok" and r.gate_commits, f"{r.gate_message}\n{r.describe()}"
    # ... and of the KV digest (patch 0021): decode's own digest equals prefill's.
    assert r.digest == "ok", f"{r.digest_message}\n{r.describe()}"
    assert len(r.verdicts) == -(-r.num_tokens // r.page_size), r.describe()
    for v in r.verdicts:
        layers = sorted((b.layer, b.kv) for b in v.buffers)
        assert layers == sorted((layer, kv) for layer in range(2) for kv in "kv"), v
        for b in v.buffers:
            assert b.kind is PageKind.OWN and b.rooms == (r.room,), (
                f"page {v.position}@{v.page} layer {b.layer} {b.kv}: {b.kind.value} "
                f"{b.rooms} tokens={b.kinds}\n{r.describe()}"
            )
        assert v.kind is PageKind.OWN, r.describe()


@pytest.mark.parametrize("chunked", [False, True], ids=["one_chunk", "chunked"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_full_transfer_every_page_is_own(kv_lane: KVLane, chunked: bool) -> None:
    """(1) Scattered, non-contiguous decode and prefill pages; every page OWN, layer by layer."""
    ps = kv_lane.page_size
    n = TOKENS[ps]
    pages = kv_lane.pages_for(n)
    kv_lane.poison_decode_pages()
    r = kv_lane.transfer(
        n,
        decode_page_indices=list(range(kv_lane.num_pages, kv_lane.num_pages - pages, -1)),
        prefill_page_indices=list(range(1, 2 * pages, 2)),
        chunk_tokens=2 * ps if chunked else None,
    )
    assert r.chunks == (-(-n // (2 * ps)) if chunked else 1)
    _assert_all_own(r)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_page_reuse_sequential_transfers(kv_lane: KVLane) -> None:
    """(2) Eight requests of varying length reuse the same decode pages; each is fully OWN.

    No page of a complete transfer may show a previous room (FOREIGN) or poison.
    """
    ps = kv_lane.page_size
    base = [7, 3, 11, 5, 2, 13, 17, 19]  # the reused decode pages, in a fixed scattered order
    kv_lane.poison_decode_pages(base)
    rooms = []
    for i, n_pages in enumerate([6, 2, 8, 5, 3, 7, 1, 4]):
        n = n_pages * ps - (i % 3 if ps > 2 else 0)
        r = kv_lane.transfer(
            n,
            decode_page_indices=base[:n_pages],
            prefill_page_indices=[20 + (i + j) % 40 for j in range(n_pages)],
            chunk_tokens=3 * ps if i % 2 else None,
        )
        _assert_all_own(r)
        assert not any(v.foreign_rooms(r.room) for v in r.verdicts), r.describe()
        rooms.append(r.room)
    assert len(set(rooms)) == len(rooms)


def _gap_transfer(kv_lane: KVLane, tail: str) -> tuple[TransferResult, int | None]:
    """A full transfer of room A, then room B with prefill_tokens < num_tokens, same pages.

    ``tail="poison"`` re-poisons the pages before B; ``"previous_room"`` leaves A's data.
    Returns (B's result, room A or None).
    """
    ps = kv_lane.page_size
    n = 4 * ps
    pages = [9, 4, 12, 6]
    first = kv_lane.transfer(n, decode_page_indices=pages)
    try:
        _assert_all_own(first)
    except AssertionError as e:  # a precondition: never an expected (xfail) failure
        pytest.fail(f"precondition: the full transfer of room A failed: {e}")
    if tail == "poison":
        kv_lane.poison_decode_pages(pages)
    prefill_tokens = 2 * ps + ps // 2 if ps > 1 else 2
    r = kv_lane.transfer(n, prefill_tokens=prefill_tokens, decode_page_indices=pages)
    return r, (first.room if tail == "previous_room" else None)


@pytest.mark.parametrize("tail", ["poison", "previous_room"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_coverage_gap_leaves_tail_unwritten(kv_lane: KVLane, tail: str) -> None:
    """(3a) The gap is real and exactly where expected (independent of decode's verdict).

    Pages prefill covered fully are OWN; the partially covered page holds B's tokens, then
    prefill memory no forward wrote (STALE_SOURCE); pages prefill never sent still hold what
    they held before: poison, or room A's data (FOREIGN, room A decoded).
    """
    r, room_a = _gap_transfer(kv_lane, tail)
    ps = kv_lane.page_size
    full, rest = divmod(r.prefill_tokens, ps)
    sent = full + (1 if rest else 0)
    for v in r.verdicts:
        if v.position < full:
            assert v.kind is PageKind.OWN, r.describe()
        elif v.position < sent:
            assert v.kind is PageKind.MIXED, r.describe()
            expected = (PageKind.OWN,) * rest + (PageKind.STALE_SOURCE,) * (ps - rest)
            assert all(b.kinds == expected for b in v.buffers), r.describe()
        elif tail == "poison":
            assert v.kind is PageKind.POISON, r.describe()
        else:
            assert v.kind is PageKind.FOREIGN and v.rooms == (room_a,), r.describe()


@pytest.mark.parametrize("tail", ["poison", "previous_room"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_coverage_gap_decode_must_not_succeed(kv_lane: KVLane, tail: str) -> None:
    """(3b) SAFE expectation: decode never commits while a reserved page is not OWN.

    The transport reports Success for both sides and decode's aux row carries the right room
    (what stock 0.5.23 checks before committing: ``r.committed``), yet the tail pages are poison
    or the previous room's data. The commit gate must refuse: prefill attested fewer tokens
    than decode reserved, and the refusal names both counts.
    """
    r, _ = _gap_transfer(kv_lane, tail)
    if not (r.decode.terminal and r.prefill.terminal):
        pytest.fail(f"a side never reached a terminal state: {r.describe()}")
    not_own = [
        f"{v.position}@{v.page}:{v.kind.value}" for v in r.verdicts if v.kind is not PageKind.OWN
    ]
    assert not_own, f"precondition: the gap left no unwritten page: {r.describe()}"
    assert not r.gate_commits, (
        f"decode would commit with unwritten pages {not_own} (gate {r.gate}): {r.describe()}"
    )
    assert r.gate == "mismatch", f"{r.gate}: {r.gate_message}"
    assert (f"prefill wrote tokens [0, {r.prefill_tokens}) = {r.prefill_tokens} tokens"
            in r.gate_message), r.gate_message
    assert f"decode reserved tokens [0, {r.num_tokens}) = {r.num_tokens} tokens" in (
        r.gate_message), r.gate_message


@pytest.mark.parametrize("page_size", [16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_abort_before_send_fails_prefill(
    kv_lane: KVLane, kv_measure: Callable[[str], None]
) -> None:
    """(4) Decode aborts after publishing its pages, before prefill sends: prefill must reach
    Failed within a generous bound (measured: the report quotes the numbers), and the chunks
    prefill then sends anyway (as its scheduler would) must be dropped: no page written.
    """
    pages = [30, 31, 32, 33]
    after_abort, acks = [], []
    for _ in range(5):
        kv_lane.poison_decode_pages(pages)
        r = kv_lane.transfer(
            64,
            decode_page_indices=pages,
            chunk_tokens=16,
            abort=AbortAt.DECODE_BEFORE_SEND,
            timeout=30.0,
            abort_observe_timeout=ABORT_TO_TERMINAL_BOUND_S,
        )
        assert r.decode_state == "Failed", r.describe()
        assert r.prefill_state == "Failed", r.describe()
        t = r.prefill_terminal_after_abort_s
        assert t is not None and 0 <= t < ABORT_TO_TERMINAL_BOUND_S, r.describe()
        assert all(v.kind is PageKind.POISON for v in r.verdicts), r.describe()
        after_abort.append(t)
        if r.decode_abort_ack_after_abort_s is not None:
            acks.append(r.decode_abort_ack_after_abort_s)
    kv_measure(
        f"{kv_lane.backend} decode abort -> prefill terminal (Failed): "
        f"min {min(after_abort) * 1e3:.2f} / median {statistics.median(after_abort) * 1e3:.2f}"
        f" / max {max(after_abort) * 1e3:.2f} ms over {len(after_abort)}; drained ABORT_ACK at "
        + (f"median {statistics.median(acks) * 1e3:.2f} ms" if acks else "never (disabled?)")
    )


@pytest.mark.parametrize("page_size", [16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_abort_before_send_reaches_decode(
    kv_lane: KVLane, kv_measure: Callable[[str], None]
) -> None:
    """After prefill aborts (before sending), decode reaches Failed within ``PEER_OBSERVE_S``
    (peer release, patch 0015). Observed on stock 0.5.23: decode stays WaitingForInput.
    """
    r = kv_lane.transfer(
        64,
        decode_page_indices=[40, 41, 42, 43],
        abort=AbortAt.PREFILL_BEFORE_SEND,
        timeout=30.0,
        abort_observe_timeout=PEER_OBSERVE_S,
    )
    if r.prefill_state != "Failed":
        pytest.fail(f"precondition: prefill did not fail after its own abort: {r.describe()}")
    t = r.decode_terminal_after_abort_s
    kv_measure(
        f"{kv_lane.backend} prefill abort -> decode terminal: "
        + (
            f"{t * 1e3:.2f} ms ({r.decode_state})"
            if t is not None
            else f"not within {PEER_OBSERVE_S:.0f} s (decode still {r.decode_state})"
        )
    )
    assert t is not None and r.decode_state == "Failed", r.describe()
    # Decode failed because prefill told it (peer release), and says so: not a timeout.
    assert "prefill" in (r.decode.failure_reason or ""), r.describe()
