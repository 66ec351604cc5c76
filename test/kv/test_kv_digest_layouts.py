"""Issue 20 item 7: the KV digest on REAL MLA and DSA pools, over the REAL Mooncake and NIXL.

Each trial is one request moved by the KV harness (``pdsafe_testkit.kv``) between two processes
whose lanes build sglang's real ``MLATokenToKVPool`` (page size 16) or ``DSATokenToKVPool``
(``index_kpool`` 1, page size 64, as upstream requires) on the CPU, small (latent 32, rope 16,
bf16; DSA indexer head 128 + 4 scale bytes), registered for the transfer the way the PD queues
register them (``get_kv_transfer_buf_infos``, ``is_mla_backend`` to the manager,
``build_kv_layer_ids``, ``setup_state_kv_args``: for DSA the indexer buffers are the
``StateType.DSA`` state, sent with the last chunk's ``suffix_page_indices``). Prefill's
"forward" fills the request's owned slots of every component with bytes derived from (room,
position) (``pdsafe_testkit.kv.layouts``); the patched ``send_kv_chunk`` digests them
(``kv_integrity.prefill_write_row``), decode keeps the row at commit and checks its own pool
against it (``kv_integrity.verify_batch``). Between the commit and the check a trial may corrupt
decode's pool (test-only, in the harness). One harness pair per backend hosts both lanes.

What it shows, per backend and pool kind (requests of three pages, the last one partial;
scattered pages; one chunk or page-sized chunks):

* untouched transfers verify (the ``kv_digest_verified_total`` counter moved: outcome ``ok``);
* one bit flipped in the latent part and in the rope part of the slot's ``kv_buffer`` row and,
  for DSA, in the slot's indexer key bytes and in its indexer scale bytes (the
  ``index_k_with_scale_buffer`` page row), is refused as a digest MISMATCH; one flip per region
  in the last owned slot of the partial last page, one in a random owned slot;
* a foreign row copied over an owned slot of one component (another request's row still in
  decode's pool, per component; another position's row of the same request) is refused;
* a flip in bytes the request does not own (a page it did not reserve, the tail of its last
  page) still verifies;
* the harness's classifier confirms where each corruption landed (exactly the targeted owned
  slot of the targeted component turns CORRUPT, or no owned slot changes).

It found a bug of the fork's own: NIXL sent the DSA indexer state of CPU pools with
``_send_kvcache_generic``'s default ``VRAM`` memory kind, which the DRAM registration of patch
0003 does not hold (UCX answered ``NIXL_ERR_NOT_FOUND``, nothing was committed); 0003 now
passes the pool's memory kind to every state send, and the NIXL + DSA cases below run.

What it does not show: a GPU pool; the FP4/FP8 MLA variants, ``index_kpool`` > 1 or the
compressed DSA tail (``test/unit/test_kv_digest.py``, in-process); a flip in transit or in
prefill's pool; TP > 1; the servers' refusal path (``test/pd``).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator

import pytest
from pdsafe_testkit.backends import BACKENDS
from pdsafe_testkit.kv import BitFlip, HarnessError, KVLane, KVPair, PageKind, TransferResult
from pdsafe_testkit.kv.layouts import REGIONS, RowCopy

SEED = int(os.environ.get("PDSAFE_LAYOUTS_SEED", "0x1A7051"), 0)
PAGE_SIZE = {"mla": 16, "dsa": 64}
PAGES = 3
NUM_PAGES = 16
NUM_LAYERS = 2
#: (backend, kind) pairs run by the digest tests.
CASES = [(b, k) for b in BACKENDS for k in ("mla", "dsa")]
_CASE_IDS = [f"{b}-{k}" for b, k in CASES]


@pytest.fixture(scope="module")
def layout_pairs(request: pytest.FixtureRequest) -> Iterator[dict[str, KVPair]]:
    """One launched (not yet ready) pair per backend this module's selected tests use, each
    with an MLA lane (page 16) and a DSA lane (page 64); all closed, children gone, at the
    end. No warm-up (each test's first transfer is its own)."""
    needed = {item.callspec.params["backend"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")
              and "backend" in item.callspec.params}
    pairs: dict[str, KVPair] = {}
    for backend in [b for b in BACKENDS if b in needed]:
        pair = KVPair(backend, page_size=(PAGE_SIZE["mla"], PAGE_SIZE["dsa"]),
                      pool_kind=("mla", "dsa"), num_pages=NUM_PAGES, num_layers=NUM_LAYERS,
                      seed=SEED, warmup=False)
        pairs[backend] = pair
        try:
            pair.launch()
        except HarnessError:
            pass  # reported by the lane fixture of that backend
    try:
        yield pairs
    finally:
        pids = [pid for pair in pairs.values() for pid in pair.child_pids()]
        for pair in pairs.values():
            pair.begin_close()
        for pair in pairs.values():
            pair.close()
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        assert not alive, f"KV harness children survived close(): {alive}"


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
    """Random requests on one lane: three scattered pages, the last one partial."""

    def __init__(self, lane: KVLane, name: str) -> None:
        self.lane = lane
        self.ps = lane.page_size
        self.rng = random.Random(f"{SEED}:{lane.backend}:{lane.pool_kind}:{name}")
        self.count = 0
        self.t0 = time.monotonic()

    def pages(self, exclude: tuple[int, ...] = ()) -> list[int]:
        return self.rng.sample([p for p in range(1, NUM_PAGES + 1) if p not in exclude], PAGES)

    def tokens(self) -> int:
        return self.rng.randrange((PAGES - 1) * self.ps + 1, PAGES * self.ps)

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
    """Untouched transfers of real MLA/DSA pools verify on decode (no false alarm)."""
    t = Trials(lane, "clean")
    lane.poison_decode_pages()
    for _ in range(3):
        r, where = t.run(t.tokens(), t.pages(), [], "untouched")
        assert r.digest == "ok" and not r.digest_message, f"false alarm: {where}"
    kv_measure(f"layouts untouched {t.summary()}, all verified")


@pytest.mark.parametrize(("backend", "kind"), CASES, ids=_CASE_IDS)
def test_bit_flip_in_each_component_is_refused(lane: KVLane,
                                               kv_measure: Callable[[str], None]) -> None:
    """One bit flipped after the transfer in any region decode reads (MLA latent, MLA rope;
    DSA also indexer key, indexer scale) of an owned slot is refused as a mismatch."""
    t = Trials(lane, "flip")
    for comp, region, lo, hi in REGIONS[lane.pool_kind]:
        for last in (True, False):  # the partial last page's last owned slot, then random
            n, d_pages = t.tokens(), t.pages()
            pos = n - 1 if last else t.rng.randrange(n)
            flip = BitFlip(layer=t.rng.randrange(NUM_LAYERS), kv=0, page=d_pages[pos // t.ps],
                           slot=pos % t.ps, byte=hi - 1 if last else t.rng.randrange(lo, hi),
                           bit=t.rng.randrange(8), component=comp)
            r, where = t.run(n, d_pages, [flip], f"{comp}.{region} flip")
            _landed(r, (comp, flip.layer, flip.page, flip.slot), where)
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
        pos = t.rng.randrange(n)
        src = t.rng.randrange(n0)  # a donor position: its slot holds the donor's data
        copy = RowCopy(comp, t.rng.randrange(NUM_LAYERS), pages0[src // t.ps], src % t.ps,
                       d_pages[pos // t.ps], pos % t.ps)
        r, where = t.run(n, d_pages, [copy], "foreign-request row")
        _landed(r, (comp, copy.layer, copy.page, copy.slot), where)
        _refused(r, n, where)
    n, d_pages = t.tokens(), t.pages()  # another position of the same request, kv row
    pos, src = t.rng.sample(range(n), 2)
    copy = RowCopy("kv", t.rng.randrange(NUM_LAYERS), d_pages[src // t.ps], src % t.ps,
                   d_pages[pos // t.ps], pos % t.ps)
    r, where = t.run(n, d_pages, [copy], "own other-position row")
    _landed(r, ("kv", copy.layer, copy.page, copy.slot), where)
    _refused(r, n, where)
    kv_measure(f"layouts foreign rows {t.summary()}, all refused as mismatch")


@pytest.mark.parametrize(("backend", "kind"), CASES, ids=_CASE_IDS)
def test_flip_outside_owned_slots_verifies(lane: KVLane,
                                           kv_measure: Callable[[str], None]) -> None:
    """A flip in bytes the request does not own (a page it did not reserve, the tail of its
    last page after its last token) changes the byte but still verifies, in every region."""
    t = Trials(lane, "outside")
    for comp, region, lo, hi in REGIONS[lane.pool_kind]:
        for outside in ("unreserved", "tail"):
            n, d_pages = t.tokens(), t.pages()
            if outside == "tail":
                page, slot = d_pages[-1], t.rng.randrange(n % t.ps, t.ps)
            else:
                page = t.rng.choice([p for p in range(1, NUM_PAGES + 1) if p not in d_pages])
                slot = t.rng.randrange(t.ps)
            flip = BitFlip(layer=t.rng.randrange(NUM_LAYERS), kv=0, page=page, slot=slot,
                           byte=t.rng.randrange(lo, hi), bit=t.rng.randrange(8),
                           component=comp)
            r, where = t.run(n, d_pages, [flip], f"{comp}.{region} {outside} flip")
            _landed(r, None, where)
            assert r.digest == "ok" and not r.digest_message, f"false alarm: {where}"
    kv_measure(f"layouts outside flips {t.summary()}, all verified")
