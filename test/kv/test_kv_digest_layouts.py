"""Issue 20 item 7: the KV digest on REAL MLA, DSA, grouped-DSA, hybrid and SWA pools, and on a
real draft pool next to a real target pool, over the REAL Mooncake and NIXL.

Each trial is one request moved by the KV harness (``pdsafe_testkit.kv``) between two processes
whose lanes build, on the CPU and small, one real sglang pool per kind
(``pdsafe_testkit.kv.layouts``):

* ``mla``: ``MLATokenToKVPool`` (page 16; latent 32, rope 16, bf16);
* ``dsa``: ``DSATokenToKVPool`` (``index_kpool`` 1, page 64 as upstream requires; indexer head
  128 + 4 scale bytes): the indexer buffers are the ``StateType.DSA`` state, sent with the
  last chunk's ``suffix_page_indices``;
* ``dsa-kpool``: GLM-5.3-Flash's indexer, ``DSATokenToKVPool(index_kpool=4,
  index_kpool_compress=True, tail_extra_slots=2, max_running_requests=4)``, page 256: one
  64-entry index page per KV page (4 positions share an entry) as ``StateType.DSA``, and the
  compressed tail ring (6 rows per request) as ``StateType.DSA_TAIL`` with upstream's
  ``get_dsa_tail_state_indices`` payload (``[req_pool_idx, start, first_n, 0, second_n,
  ring]``); every request ends mid-group, so its last 1-3 positions live in the ring;
* ``hybrid``: ``HybridLinearKVPool`` (full-attention layers 1, 3: MHA head 16 bf16, page 32)
  over the real Mamba2 ``MambaPool`` of upstream's ``HybridReqToTokenPool`` (layers 0, 2), the
  state sent as ``StateType.MAMBA`` with upstream's ``_mamba_payload`` (the request's
  translated slot from ``req_index_to_mamba_index_mapping``; slot 2 on prefill, 5 on decode);
* ``swa``: ``SWAKVPool`` (full layers 1, 3; sliding-window layers 0, 2; page 24, window 30)
  with upstream's ``SWATokenToKVPoolAllocator`` mapping full to SWA slots (full page ``p`` to
  SWA page ``17 - p``), the window's SWA pages sent as ``StateType.SWA`` with upstream's
  ``_swa_payload`` (page-aligned window start, ``translate_swa_indices_for_transfer``);
* ``mha-draft`` (EAGLE's shape): an ``MHATokenToKVPool`` target (2 layers, 1 head of 16
  bf16, page 8) and a separate ``MHATokenToKVPool`` draft of 1 layer (as the draft worker
  builds its own pool: same size and page size, layers from 0);
* ``mla-draft`` (DeepSeek/GLM MTP's shape): an ``MLATokenToKVPool`` target (2 layers, page
  40) and a separate ``MLATokenToKVPool`` draft of 1 layer (the NextN layer).

All are registered for the transfer the way the PD queues register them
(``get_kv_transfer_buf_infos``, ``is_mla_backend`` to the manager, ``build_kv_layer_ids``,
``setup_state_kv_args``); the draft kinds as both queues' ``_init_kv_manager`` register
``draft_token_to_kv_pool`` (its ``get_contiguous_buf_infos()`` appended to ``kv_data_ptrs``,
``num_draft_entries``, the draft pool passed to ``build_kv_layer_ids`` and
``setup_state_kv_args``), and each leg's digester is given the draft pool as the queues give
it (``kv_integrity.leg_digester(pool, disagg, draft_token_to_kv_pool)``: components
``draft.*`` after the target's). The draft KV shares the target's token indices: the same
pages carry both. Prefill's "forward" fills the request's owned slots of every
component with bytes derived from (room, position) (``layouts``); the patched
``send_kv_chunk`` digests them (``kv_integrity.prefill_write_row``), decode keeps the row at
commit and checks its own pool against it (``kv_integrity.verify_batch``, with the scheduler's
``sliding_window_size``). Between the commit and the check a trial may corrupt decode's pool
(test-only, in the harness). One harness pair per backend hosts all seven lanes.

What it shows, per backend and pool kind (requests of three pages, the last one partial;
scattered pages; one chunk or page-sized chunks):

* untouched transfers verify (the ``kv_digest_verified_total`` counter moved: outcome ``ok``),
  and every owned slot of every component (index entries, tail ring rows, the state slot, the
  window's SWA rows, every draft layer's rows included) holds exactly the request's bytes
  on decode;
* one bit flipped after the transfer in each region decode reads is refused as a digest
  MISMATCH: the MLA latent and rope parts; DSA's indexer key and scale bytes of the slot (of
  the slot's *entry* for ``dsa-kpool``); ``dsa-kpool``'s ``tail_k`` and ``tail_score`` rows of
  the request's ring; the hybrid's full K and V rows and the request's Mamba2 ``conv`` and
  ``temporal`` state (decode's slot); the SWA pool's full K/V rows and the SWA K/V rows of
  window positions; the target's and the draft pool's K and V rows (``mha-draft``), latent
  and rope parts (``mla-draft``). One flip per region at the last owned position (the
  partial last page, the partial last group's entry, the last ring row of a tail that wraps
  the ring: slots 4, 5, 0), one at a random owned position;
* a foreign row copied over an owned slot of one component is refused: another request's row
  still in decode's pool (for the tail ring and the Mamba state, whose row/slot every trial
  reuses: another request's ring row / state slot, never written by these transfers; for
  the draft kinds, in each target and each draft component), and another position's row of
  the same request (the first target component);
* a flip in bytes the request does not own still verifies: a page it did not reserve (another
  request's tail-ring row, another state slot, an unreserved SWA page), the tail of its last
  page (the entries after its last group; ring slots of older positions; the state slot
  *prefill* used, on decode; an SWA row of a position before the window);
* the harness's classifier confirms where each corruption landed (exactly the targeted owned
  slot of the targeted component turns CORRUPT, or no owned slot changes).

The draft cases can fail: with ``kv_digest.prepare`` made to ignore the draft pool (on both
legs), the draft flips and the foreign draft rows verified and these tests failed ("the
corruption was not detected"), while the target's flips before them were still refused; with
the lanes not registering the draft's buffers for the transfer (digest unchanged), decode's
draft rows stayed poison and the untouched transfers failed (digest mismatch, pages MIXED).

It found a bug of the fork's own: NIXL sent the DSA indexer state of CPU pools with
``_send_kvcache_generic``'s default ``VRAM`` memory kind, which the DRAM registration of patch
0003 does not hold (UCX answered ``NIXL_ERR_NOT_FOUND``, nothing was committed); 0003 now
passes the pool's memory kind to every state send, and the NIXL + DSA cases below run.

What it does not show: a GPU pool; the FP4/FP8 MLA variants, an MLA or DSA full pool inside
the hybrid / SWA pools (``test/unit/test_kv_digest.py``, in-process), prefill and decode at
different ``req_pool_idx`` (both legs use row 1; the Mamba slots do differ), a draft pool
whose geometry differs from the target's (other heads, a DSA draft, a hybrid-SWA MTP draft
block; ``test/unit/test_kv_digest_draft.py`` has the grouped DSA draft in-process), a leg
with a draft pool paired with one without (``test/unit/test_kv_digest_draft.py``: their
signatures differ), a cached
decode prefix (``decode_prefix_len`` is 0); a flip in transit or in prefill's pool; TP > 1;
the servers' refusal path (``test/pd``).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator

import pytest
from pdsafe_testkit.backends import BACKENDS
from pdsafe_testkit.kv import BitFlip, HarnessError, KVLane, KVPair, PageKind, TransferResult
from pdsafe_testkit.kv.layouts import (
    KPOOL_GROUP,
    KPOOL_RING,
    REGIONS,
    SPACES,
    SWA_WINDOW,
    RowCopy,
    address,
    component_layers,
    swa_page,
    tail_positions,
    window_positions,
)
from pdsafe_testkit.kv.pair import launched
from pdsafe_testkit.kv.scheduler_glue import (
    HYBRID_MAMBA_SLOTS,
    HYBRID_STATE_SLOT,
    KPOOL_MAX_RUNNING_REQUESTS,
    REQ_POOL_IDX,
)

SEED = int(os.environ.get("PDSAFE_LAYOUTS_SEED", "0x1A7051"), 0)
PAGE_SIZE = {"mla": 16, "dsa": 64, "dsa-kpool": 256, "hybrid": 32, "swa": 24,
             "mha-draft": 8, "mla-draft": 40}
KINDS = tuple(PAGE_SIZE)
PAGES = 3
NUM_PAGES = 16
NUM_LAYERS = 2
#: The tail ring row of the request in flight (both legs), and another request's row (never
#: written by these transfers).
TAIL_ROW = REQ_POOL_IDX
OTHER_TAIL_ROW = 3
assert OTHER_TAIL_ROW != TAIL_ROW and OTHER_TAIL_ROW <= KPOOL_MAX_RUNNING_REQUESTS
#: Hybrid lanes: decode's state slot of the request, and a slot no transfer writes.
STATE_SLOT = HYBRID_STATE_SLOT["decode"]
OTHER_STATE_SLOT = 7
assert OTHER_STATE_SLOT not in HYBRID_STATE_SLOT.values()
assert OTHER_STATE_SLOT <= HYBRID_MAMBA_SLOTS
#: (backend, kind) pairs run by the digest tests.
CASES = [(b, k) for b in BACKENDS for k in KINDS]
_CASE_IDS = [f"{b}-{k}" for b, k in CASES]


@pytest.fixture(scope="module")
def layout_pairs(request: pytest.FixtureRequest) -> Iterator[dict[str, KVPair]]:
    """One launched (not yet ready) pair per backend this module's selected tests use, each
    with one lane per kind (``PAGE_SIZE``: MLA 16, DSA 64, grouped DSA 256, hybrid 32, SWA
    24, MHA + draft 8, MLA + draft 40); all closed, children gone, at the end. No warm-up
    (each test's first transfer is its own)."""
    needed = {item.callspec.params["backend"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")
              and "backend" in item.callspec.params}
    pairs = {backend: KVPair(backend, page_size=tuple(PAGE_SIZE[k] for k in KINDS),
                             pool_kind=KINDS, num_pages=NUM_PAGES, num_layers=NUM_LAYERS,
                             seed=SEED, warmup=False)
             for backend in BACKENDS if backend in needed}
    with launched(pairs):
        yield pairs


@pytest.fixture
def lane(layout_pairs: dict[str, KVPair], backend: str, kind: str) -> KVLane:
    """The ``kind`` lane of the ready pair of ``backend``."""
    pair = layout_pairs[backend]
    try:
        pair.wait_ready()
    except HarnessError as e:
        pytest.fail(f"{backend} layout pair unusable: {e}\n{pair.logs()}", pytrace=False)
    out = pair.lane(PAGE_SIZE[kind])
    assert out.pool_kind == kind
    return out


class Trials:
    """Random requests on one lane: three scattered pages, the last one partial (for the
    grouped DSA index: ending mid-group, so the tail ring holds 1-3 positions, with at least
    one unowned index entry after the last owned one)."""

    def __init__(self, lane: KVLane, name: str) -> None:
        self.lane = lane
        self.kind = lane.pool_kind
        self.ps = lane.page_size
        self.rng = random.Random(f"{SEED}:{lane.backend}:{lane.pool_kind}:{name}")
        self.count = 0
        self.t0 = time.monotonic()

    def pages(self, exclude: tuple[int, ...] = ()) -> list[int]:
        return self.rng.sample([p for p in range(1, NUM_PAGES + 1) if p not in exclude], PAGES)

    def tokens(self, wrap: bool = False) -> int:
        """A request length; ``wrap``: one whose tail wraps the ring (slots 4, 5, 0)."""
        while True:
            n = self.rng.randrange((PAGES - 1) * self.ps + 1, PAGES * self.ps)
            if self.kind != "dsa-kpool" or (
                    n % KPOOL_GROUP and -(-(n % self.ps) // KPOOL_GROUP) < self.ps // KPOOL_GROUP
                    and (not wrap or (n % KPOOL_GROUP == 3
                                      and (n - 3) % KPOOL_RING == KPOOL_RING - 2))):
                return n

    def owned_pos(self, comp: str, n: int, last: bool) -> int:
        """An owned position of ``comp`` (a tail ring holds only the tail positions, an SWA
        sub-pool the window's)."""
        space = SPACES[self.kind][comp]
        span = (tail_positions(n, KPOOL_GROUP) if space == "tail" else
                window_positions(n, SWA_WINDOW) if space == "swa" else range(n))
        return span[-1] if last else self.rng.choice(span)

    def where(self, comp: str, d_pages: list[int], pos: int) -> tuple[int, int]:
        """(page or tail row, slot) of position ``pos`` in ``comp`` (``layouts.address``)."""
        return address(self.kind, comp, d_pages, self.ps, pos, TAIL_ROW, STATE_SLOT, NUM_PAGES)

    def target(self, comp: str, layer: int, d_pages: list[int], n: int,
               pos: int) -> tuple[str, int, int, int]:
        """Where the classifier reports position ``pos`` of ``comp``: (component, layer,
        page, slot), the slot of a tail ring being the index among the tail positions, of an
        SWA page the index among its window positions."""
        page, slot = self.where(comp, d_pages, pos)
        if SPACES[self.kind][comp] == "tail":
            slot = pos - tail_positions(n, KPOOL_GROUP).start
        elif SPACES[self.kind][comp] == "swa":
            slot = pos - max(window_positions(n, SWA_WINDOW).start, pos - pos % self.ps)
        return comp, layer, page, slot

    def layer(self, comp: str) -> int:
        """A random layer of ``comp`` (a draft component: of the draft pool's layers)."""
        return self.rng.randrange(component_layers(comp, NUM_LAYERS))

    def slots(self, comp: str) -> int:
        """Slots a page (a tail row) of ``comp`` has."""
        space = SPACES[self.kind][comp]
        return {"token": self.ps, "entry": self.ps // KPOOL_GROUP, "tail": KPOOL_RING,
                "state": 1, "swa": self.ps}[space]

    def run(self, n: int, d_pages: list[int], flips: list[BitFlip | RowCopy],
            what: str) -> tuple[TransferResult, str]:
        """One transfer; fails the test unless decode committed exactly this room's data."""
        r = self.lane.transfer(n, decode_page_indices=d_pages, prefill_page_indices=self.pages(),
                               chunk_tokens=self.rng.choice([None, self.ps]), flips=flips)
        self.count += 1
        where = (f"seed={SEED:#x} (PDSAFE_LAYOUTS_SEED) {self.lane.pool_kind} {what} "
                 f"{' '.join(f.describe() for f in flips)}: {r.describe()}")
        if not (r.gate_commits and r.all_own and r.aux_room == r.room):
            pytest.fail(f"precondition: the transfer was not complete: {where}")
        return r, where

    def summary(self) -> str:
        return (f"{self.lane.backend} {self.lane.pool_kind}: {self.count} transfers in "
                f"{time.monotonic() - self.t0:.1f}s")


def _landed(r: TransferResult, target: tuple[str, int, int, int] | None, where: str) -> None:
    """The classifier after the corruption: exactly ``target`` (component, layer, page, slot)
    is no longer OWN (it is CORRUPT), or, ``target`` None, every owned slot is still OWN."""
    assert r.flips and r.flips[0][0] != r.flips[0][1], f"no byte changed: {where}"
    hit = [(b.kv, b.layer, v.page, slot, kind.value)
           for v in r.flipped_verdicts for b in v.buffers
           for slot, kind in enumerate(b.kinds) if kind is not PageKind.OWN]
    want = [] if target is None else [(*target, PageKind.CORRUPT.value)]
    assert hit == want, f"corruption landed on {hit}, expected {want}: {where}"


def _refused(r: TransferResult, n: int, where: str) -> None:
    assert r.digest == "mismatch", f"the corruption was not detected: {where}"
    assert r.digest_message.startswith("KV integrity check failed"), where
    assert f"room {r.room}" in r.digest_message, where
    assert f"tokens [0, {n}) differ from what prefill sent" in r.digest_message, where


@pytest.mark.parametrize(("backend", "kind"), CASES, ids=_CASE_IDS)
def test_untouched_transfers_verify(lane: KVLane, kv_measure: Callable[[str], None]) -> None:
    """Untouched transfers of each real pool kind verify on decode (no false alarm)."""
    t = Trials(lane, "clean")
    lane.poison_decode_pages()
    for _ in range(3):
        r, where = t.run(t.tokens(), t.pages(), [], "untouched")
        assert r.digest == "ok" and not r.digest_message, f"false alarm: {where}"
    kv_measure(f"layouts untouched {t.summary()}, all verified")


@pytest.mark.parametrize(("backend", "kind"), CASES, ids=_CASE_IDS)
def test_bit_flip_in_each_component_is_refused(lane: KVLane,
                                               kv_measure: Callable[[str], None]) -> None:
    """One bit flipped after the transfer in any region decode reads (``layouts.REGIONS``:
    MLA latent, rope; DSA indexer key, scale; the grouped index's entry, tail ring rows; the
    hybrid's K, V, Mamba2 conv and temporal state; SWA's full and window K, V; the target's
    and the draft pool's K, V or latent, rope) of an owned slot, entry, ring row or state
    slot is refused as a mismatch."""
    t = Trials(lane, "flip")
    for comp, region, lo, hi in REGIONS[lane.pool_kind]:
        for last in (True, False):  # the partial last page's last owned slot, then random
            n, d_pages = t.tokens(wrap=last and SPACES[t.kind][comp] == "tail"), t.pages()
            pos = t.owned_pos(comp, n, last)
            page, slot = t.where(comp, d_pages, pos)
            flip = BitFlip(layer=t.layer(comp), kv=0, page=page, slot=slot,
                           byte=hi - 1 if last else t.rng.randrange(lo, hi),
                           bit=t.rng.randrange(8), component=comp)
            r, where = t.run(n, d_pages, [flip], f"{comp}.{region} flip (position {pos})")
            _landed(r, t.target(comp, flip.layer, d_pages, n, pos), where)
            _refused(r, n, where)
    kv_measure(f"layouts owned flips {t.summary()}, all refused as mismatch")


@pytest.mark.parametrize(("backend", "kind"), CASES, ids=_CASE_IDS)
def test_foreign_row_is_refused(lane: KVLane, kv_measure: Callable[[str], None]) -> None:
    """Another request's row (still in decode's pool), copied over an owned slot of one
    component, is refused; so is another position's row of the same request."""
    t = Trials(lane, "foreign")
    n0, pages0 = t.tokens(), t.pages()
    r0, where0 = t.run(n0, pages0, [], "donor")
    assert r0.digest == "ok", f"false alarm: {where0}"
    comps = list(dict.fromkeys(c for c, _, _, _ in REGIONS[lane.pool_kind]))
    for comp in comps:  # a row of the donor request (its pages are not reserved again)
        n, d_pages = t.tokens(), t.pages(exclude=tuple(pages0))
        pos = t.owned_pos(comp, n, last=False)
        page, slot = t.where(comp, d_pages, pos)
        if SPACES[t.kind][comp] == "tail":
            # The donor's ring row is this request's too (one request at a time, one pool
            # row): another request's row is one these transfers never wrote.
            src_page, src_slot, what = OTHER_TAIL_ROW, t.rng.randrange(KPOOL_RING), "row"
        elif SPACES[t.kind][comp] == "state":  # likewise: another request's state slot
            src_page, src_slot, what = OTHER_STATE_SLOT, 0, "state slot"
        elif SPACES[t.kind][comp] == "swa":  # a donor window position (sent to decode)
            src_page, src_slot = t.where(comp, pages0, t.owned_pos(comp, n0, last=False))
            what = "request row"
        else:
            src = t.rng.randrange(n0)  # a donor position: its slot holds the donor's data
            src_page, src_slot = t.where(comp, pages0, src)
            what = "request row"
        copy = RowCopy(comp, t.layer(comp), src_page, src_slot, page, slot)
        r, where = t.run(n, d_pages, [copy], f"foreign-{what} (position {pos})")
        _landed(r, t.target(comp, copy.layer, d_pages, n, pos), where)
        _refused(r, n, where)
    n, d_pages = t.tokens(), t.pages()  # another position of the same request, KV row
    pos, src = t.rng.sample(range(n), 2)
    copy = RowCopy(comps[0], t.rng.randrange(NUM_LAYERS), d_pages[src // t.ps], src % t.ps,
                   d_pages[pos // t.ps], pos % t.ps)
    r, where = t.run(n, d_pages, [copy], "own other-position row")
    _landed(r, (comps[0], copy.layer, copy.page, copy.slot), where)
    _refused(r, n, where)
    kv_measure(f"layouts foreign rows {t.summary()}, all refused as mismatch")


@pytest.mark.parametrize(("backend", "kind"), CASES, ids=_CASE_IDS)
def test_flip_outside_owned_slots_verifies(lane: KVLane,
                                           kv_measure: Callable[[str], None]) -> None:
    """A flip in bytes the request does not own (a page it did not reserve, the tail of its
    last page after its last token; another request's tail ring row, a ring slot of an older
    position; another state slot, the one prefill used; an unreserved SWA page, a position
    before the window) changes the byte but still verifies, in every region."""
    t = Trials(lane, "outside")
    for comp, region, lo, hi in REGIONS[lane.pool_kind]:
        ring = SPACES[t.kind][comp] == "tail"
        for outside in ("unreserved", "tail"):
            n, d_pages = t.tokens(), t.pages()
            if SPACES[t.kind][comp] == "state":  # another slot; the slot prefill used
                page = OTHER_STATE_SLOT if outside == "unreserved" else HYBRID_STATE_SLOT[
                    "prefill"]
                slot = 0
            elif SPACES[t.kind][comp] == "swa":  # an unreserved SWA page; before the window
                if outside == "unreserved":
                    page = swa_page(t.rng.choice([p for p in range(1, NUM_PAGES + 1)
                                                  if p not in d_pages]), NUM_PAGES)
                    slot = t.rng.randrange(t.ps)
                else:
                    page, slot = t.where(comp, d_pages, t.rng.randrange(n - SWA_WINDOW))
            elif outside == "tail" and ring:  # a ring slot of its row it does not own now
                owned = {t.where(comp, d_pages, p)[1] for p in tail_positions(n, KPOOL_GROUP)}
                page = TAIL_ROW
                slot = t.rng.choice([o for o in range(KPOOL_RING) if o not in owned])
            elif outside == "tail":  # after the last owned slot (entry) of the last page
                page, last = t.where(comp, d_pages, n - 1)
                slot = t.rng.randrange(last + 1, t.slots(comp))
            elif ring:  # another request's tail row
                page, slot = OTHER_TAIL_ROW, t.rng.randrange(KPOOL_RING)
            else:
                page = t.rng.choice([p for p in range(1, NUM_PAGES + 1) if p not in d_pages])
                slot = t.rng.randrange(t.slots(comp))
            flip = BitFlip(layer=t.layer(comp), kv=0, page=page, slot=slot,
                           byte=t.rng.randrange(lo, hi), bit=t.rng.randrange(8),
                           component=comp)
            r, where = t.run(n, d_pages, [flip], f"{comp}.{region} {outside} flip")
            _landed(r, None, where)
            assert r.digest == "ok" and not r.digest_message, f"false alarm: {where}"
    kv_measure(f"layouts outside flips {t.summary()}, all verified")
