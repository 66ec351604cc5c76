"""Issue 10's KV-harness bit-flip trials: the KV digest over the REAL Mooncake and NIXL engines.

Each trial is one request moved by the harness (``pdsafe_testkit.kv``): the backend's real
sender and receiver between two processes, real ``MHATokenToKVPool`` s on both sides, sglang's
real ``MetadataBuffers``. Prefill's chunks go through the patched scheduler's own
``SchedulerDisaggregationPrefillMixin.send_kv_chunk``, whose last chunk digests the request's
owned KV into its metadata row (``kv_integrity.prefill_write_row``); the row travels with the
aux data through the engine; decode keeps it at commit (``kv_integrity.capture``) and checks
its own pool against it (``kv_integrity.verify_batch``, what ``_verify_kv_checksums`` runs
when the request first enters a batch). Between the commit and the check a trial may flip ONE
bit of decode's pool (``pages.BitFlip``, test-only, in the harness).

Layout: page size 16, requests of 33-47 tokens (three pages, the last one partial), two layers,
K and V; scattered, random decode and prefill pages; one chunk or chunks of 16 or 32 tokens.
Trials, interleaved in a random order drawn from ``SEED`` (printed in every failure; set
``PDSAFE_BITFLIP_SEED`` to replay another draw):

* ``FLIP_TRIALS``: one random bit of one random owned byte (random layer, K or V, random owned
  position, the last partial page's owned slots included; the first two target the last owned
  slot, K then V) -> decode refuses the request as a digest MISMATCH, every time;
* ``FLIP_TRIALS`` untouched transfers -> verified (no false alarm);
* ``OUTSIDE_TRIALS``: one random bit of a byte decode holds but the request does not own: the
  tail of its last page (slots after the last owned one, which the page-granular transfer
  wrote with prefill's stale tail) or a page of the pool it did not reserve (another request's
  data or poison) -> verified, every time.

Independent of the digest, the harness's own page classifier confirms where each flip landed:
an owned flip turns exactly that row CORRUPT and leaves every other owned row OWN; an outside
flip leaves every owned row OWN (and the byte did change).

What this does not show: a flip in transit (the engine moving corrupt bytes: the flips are
applied in decode's pool after the transfer, which is what the digest compares); a flip in
prefill's pool before the digest (undetectable by construction: prefill digests what it holds);
the metadata row itself corrupted (``test/unit/test_kv_integrity_wiring.py``); the other pool
layouts (scales, MLA, DSA, SWA, Mamba state: ``test/unit/test_kv_digest.py``, in-process); the
servers' abort path and HTTP 500 (``test/pd/test_kv_digest_e2e.py``); a GPU pool; TP > 1.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable

import pytest
from pdsafe_testkit.backends import BACKENDS
from pdsafe_testkit.kv import BitFlip, KVLane, PageKind, TransferResult

SEED = int(os.environ.get("PDSAFE_BITFLIP_SEED", "0x5EED10"), 0)
FLIP_TRIALS = 50  # owned flips, and as many untouched transfers
OUTSIDE_TRIALS = 20  # half in the last page's tail, half in an unreserved page
PAGE_SIZE = 16
PAGES = 3
MIN_TOKENS, MAX_TOKENS = (PAGES - 1) * PAGE_SIZE + 1, PAGES * PAGE_SIZE - 1  # partial last page


def _where(trial: int, kind: str, flip: BitFlip | None, r: TransferResult | None) -> str:
    what = f" flip {flip.describe()}" if flip is not None else ""
    return (f"seed={SEED:#x} (PDSAFE_BITFLIP_SEED) trial {trial} ({kind}){what}: "
            f"{r.describe() if r is not None else ''}")


def _owned_flip(rng: random.Random, lane: KVLane, pages: list[int], n: int,
                forced_kv: int | None) -> BitFlip:
    """A random bit of a random owned byte; ``forced_kv``: the last owned slot of that K/V."""
    row_bytes = lane.pair.token_words * 8
    pos = n - 1 if forced_kv is not None else rng.randrange(n)
    return BitFlip(
        layer=rng.randrange(lane.pair.num_layers),
        kv=forced_kv if forced_kv is not None else rng.randrange(2),
        page=pages[pos // PAGE_SIZE],
        slot=pos % PAGE_SIZE,
        byte=row_bytes - 1 if forced_kv is not None else rng.randrange(row_bytes),
        bit=rng.randrange(8),
    )


def _outside_flip(rng: random.Random, lane: KVLane, pages: list[int], n: int,
                  kind: str) -> BitFlip:
    """A random bit of a byte outside the request's owned rows: its last page's tail, or a
    page it did not reserve."""
    if kind == "tail":
        page, slot = pages[-1], rng.randrange(n % PAGE_SIZE, PAGE_SIZE)
    else:
        page = rng.choice([p for p in range(1, lane.num_pages + 1) if p not in pages])
        slot = rng.randrange(PAGE_SIZE)
    return BitFlip(layer=rng.randrange(lane.pair.num_layers), kv=rng.randrange(2), page=page,
                   slot=slot, byte=rng.randrange(lane.pair.token_words * 8),
                   bit=rng.randrange(8))


def _check_landing(r: TransferResult, flip: BitFlip, owned: bool, where: str) -> None:
    """The harness's own classifier: the byte changed by exactly the bit, and the flip hit
    exactly the owned row it names (``owned``) or no owned row at all."""
    assert r.flips == ((r.flips[0][0], r.flips[0][0] ^ (1 << flip.bit)),), where
    hit = []
    for v in r.flipped_verdicts:
        for b in v.buffers:
            for slot, kind in enumerate(b.kinds):
                is_target = (owned and v.page == flip.page and b.layer == flip.layer
                             and b.kv == "kv"[flip.kv] and slot == flip.slot)
                if kind is not PageKind.OWN:
                    hit.append((v.page, b.layer, b.kv, slot, kind.value))
                    assert is_target and kind is PageKind.CORRUPT, f"{hit}: {where}"
    assert len(hit) == (1 if owned else 0), f"flip landed on {hit}: {where}"


@pytest.mark.parametrize("page_size", [PAGE_SIZE])
@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_digest_detects_every_owned_bit_flip_and_nothing_else(
    kv_lane: KVLane, kv_measure: Callable[[str], None]
) -> None:
    """One bit flipped in any owned byte (K or V, any layer, any owned position including
    the last partial page) after a real transfer fails decode's digest check as a mismatch,
    in every trial; untouched transfers and flips outside the owned range always verify.
    """
    rng = random.Random(SEED)
    tails = OUTSIDE_TRIALS // 2
    kinds = (["flip"] * FLIP_TRIALS + ["clean"] * FLIP_TRIALS
             + ["tail"] * tails + ["other"] * (OUTSIDE_TRIALS - tails))
    rng.shuffle(kinds)
    kv_lane.poison_decode_pages()
    forced = [0, 1]  # the first two owned flips: the last owned slot's last byte, K then V
    counts = {k: 0 for k in ("flip", "clean", "tail", "other")}
    flipped_kv, flipped_layers, last_page_flips = set(), set(), 0
    generations, walls = set(), []
    t0 = time.monotonic()
    for trial, kind in enumerate(kinds):
        n = rng.randrange(MIN_TOKENS, MAX_TOKENS + 1)
        d_pages = rng.sample(range(1, kv_lane.num_pages + 1), PAGES)
        p_pages = rng.sample(range(1, kv_lane.num_pages + 1), PAGES)
        chunk = rng.choice([None, PAGE_SIZE, 2 * PAGE_SIZE])
        flip: BitFlip | None = None
        if kind == "flip":
            flip = _owned_flip(rng, kv_lane, d_pages, n, forced.pop(0) if forced else None)
        elif kind in ("tail", "other"):
            flip = _outside_flip(rng, kv_lane, d_pages, n, kind)
        r = kv_lane.transfer(n, decode_page_indices=d_pages, prefill_page_indices=p_pages,
                             chunk_tokens=chunk, flips=[flip] if flip is not None else [])
        where = _where(trial, kind, flip, r)
        # Preconditions: the engine delivered this room's data and decode commits it.
        if not (r.gate_commits and r.all_own and r.aux_room == r.room):
            pytest.fail(f"precondition: the transfer was not complete: {where}")
        walls.append(r.wall_s)
        generations.add(r.digest_generation)
        if flip is not None:
            _check_landing(r, flip, kind == "flip", where)
        if kind == "flip":
            assert flip is not None
            assert r.digest == "mismatch", f"the flipped bit was not detected: {where}"
            assert r.digest_message.startswith("KV integrity check failed"), where
            assert f"room {r.room}" in r.digest_message, where
            assert f"tokens [0, {n}) differ from what prefill sent" in r.digest_message, where
            flipped_kv.add(flip.kv)
            flipped_layers.add(flip.layer)
            last_page_flips += flip.page == d_pages[-1]
        else:
            assert r.digest == "ok" and not r.digest_message, f"false alarm: {where}"
        counts[kind] += 1
    elapsed = time.monotonic() - t0
    # The draw covered what issue 10 names: K and V, every layer, the last partial page.
    assert flipped_kv == {0, 1} and flipped_layers == set(range(kv_lane.pair.num_layers)), (
        f"seed={SEED:#x}: flips covered kv {flipped_kv}, layers {flipped_layers}")
    assert last_page_flips >= 2, f"seed={SEED:#x}: {last_page_flips} flips in the last page"
    kv_measure(
        f"{kv_lane.backend} KV digest bit flips (seed {SEED:#x}): {counts['flip']} owned flips "
        f"all refused as mismatch ({last_page_flips} in the partial last page), "
        f"{counts['clean']} untouched and {counts['tail']} tail + {counts['other']} "
        f"other-page flips all verified; {len(kinds)} transfers in {elapsed:.1f} s (median "
        f"{statistics.median(walls) * 1e3:.1f} ms), digest generations {sorted(generations)}"
    )
