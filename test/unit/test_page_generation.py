"""Page generations (``sglang.pdsafe.page_generation``): every free moves the freed pages'
generation, in every allocator PD uses, and the transfer paths prove with it that their pages
were never recycled under them.

Three layers, all on upstream's real, patched classes (no servers):

* the tables on the real allocators: ``TokenToKVPoolAllocator`` (page 1),
  ``PagedTokenToKVPoolAllocator`` (pages of 16 and 64), ``SWATokenToKVPoolAllocator`` (both
  sub-pools, pages of 1 and 16), ``PureSWATokenToKVPoolAllocator`` and the Mamba
  ``MambaSlotAllocator``, over real KV pools; every free path (``free``, ``free_page_ids``,
  ``free_segment``, free groups, ``free_swa``/``free_full``, ``clear``/``resize``) against an
  independent account of which pages it frees; allocating moves nothing;
* startup: an allocator, request pool or decode mode it does not cover refuses the start in PD
  mode (upstream's real ``PageInterleavePoolAllocator`` among them); the off switch;
* the checks through upstream's real code: decode's ``_send_kv_metadata`` (reservation),
  ``pop_transferred`` with the real ``_commit_transfer_to_req`` and ``_release_request`` /
  ``release_kv_cache`` on a real ``Req``, request pool and (disabled) radix tree; prefill's
  real ``_send_kv_chunk`` and ``process_disagg_prefill_inflight_queue`` at Success. A
  reservation whose pages were freed and given to another request before commit is refused
  (500, room and pages named, counted) and its release does not free them again (the other
  request keeps them); an untouched transfer passes.

What this does not show: a GPU table (the same code, device-side), real servers and transfer
backends, TP > 1 (ranks free in lockstep, so they agree), the NPU allocator (covered by
reading: its free ends in the paged funnel).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Iterator
from http import HTTPStatus
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock, patch

import numpy as np
import pytest
import torch
from sglang.pdsafe import metrics, page_generation, policy, protections, transfer
from sglang.pdsafe.page_generation import GenerationTable, UncoveredAllocatorError

ROOM = 0x9E_0000_0042
PD = SimpleNamespace(disaggregation_mode="decode", disaggregation_decode_host_receive_threshold=1)
PREFILL = SimpleNamespace(disaggregation_mode="prefill")


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(page_generation.ENV_ENABLE, raising=False)
    yield


def _counts() -> dict[str, float]:
    return {n: metrics.value(n) for n in (page_generation.MOVED, page_generation.SOURCE_MOVED,
                                          page_generation.SKIPPED, page_generation.FAILED)}


def _drop_held(row: object) -> None:
    """Forget the held rows of ``row`` (what a held-for-good test leaves behind)."""
    for key, h in transfer.held_items():
        if h.row is row:
            transfer.drop_row(key)


def _delta(before: dict[str, float]) -> dict[str, float]:
    return {n: metrics.value(n) - v for n, v in before.items() if metrics.value(n) != v}


# =========================================================================== real allocators


def _mha(size: int, ps: int) -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(size=size, page_size=ps, dtype=torch.float32, head_num=1,
                            head_dim=4, layer_num=1, device="cpu", enable_memory_saver=False,
                            enable_alt_stream=False)


def _swa_pool(size: int, size_swa: int, ps: int, full_layers: tuple[int, ...] = (1,)) -> Any:
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    return SWAKVPool(size=size, size_swa=size_swa, page_size=ps, dtype=torch.float32,
                     head_num=1, head_dim=4, swa_attention_layer_ids=[0],
                     full_attention_layer_ids=list(full_layers), device="cpu")


def _token(ps: int = 1) -> Any:
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    return TokenToKVPoolAllocator(256, torch.float32, "cpu", _mha(256, 1), need_sort=True)


def _paged(ps: int) -> Any:
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    size = 32 * ps
    return PagedTokenToKVPoolAllocator(size, ps, torch.float32, "cpu", _mha(size, ps),
                                       need_sort=True)


def _swa(ps: int) -> Any:
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    pool = _swa_pool(32 * ps, 24 * ps, ps)
    a = SWATokenToKVPoolAllocator(32 * ps, 24 * ps, page_size=ps, dtype=torch.float32,
                                  device="cpu", kvcache=pool, need_sort=True)
    pool.register_mapping(a.full_to_swa_index_mapping)
    return a


def _pure_swa(ps: int = 1) -> Any:
    from sglang.srt.mem_cache.allocator.swa import PureSWATokenToKVPoolAllocator

    return PureSWATokenToKVPoolAllocator(64, page_size=1, dtype=torch.float32, device="cpu",
                                         kvcache=_swa_pool(64, 64, 1), need_sort=True)


def _mamba(ps: int = 1) -> Any:
    from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator

    return MambaSlotAllocator(32, "cpu")


def _alloc(a: Any, n_pages: int) -> torch.Tensor:
    """``n_pages`` pages' worth of token slots (slots, for Mamba) through upstream's own
    allocation API for that class."""
    ps = getattr(a, "page_size", 1)
    if ps > 1 and type(a).__name__ == "SWATokenToKVPoolAllocator":
        n = n_pages * ps  # SWA pages are allocated through alloc_extend at page_size > 1
        out = a.alloc_extend(torch.tensor([0]), torch.tensor([0]), torch.tensor([n]),
                             torch.tensor([n]), torch.tensor([-1]), n)
    else:
        out = a.alloc(n_pages * ps)
    assert out is not None and out.numel() == n_pages * ps
    return out


CASES: dict[str, tuple[Callable[[int], Any], int]] = {
    "token-1": (_token, 1),
    "paged-16": (_paged, 16),
    "paged-64": (_paged, 64),
    "swa-1": (_swa, 1),
    "swa-16": (_swa, 16),
    "pure-swa-1": (_pure_swa, 1),
    "mamba-slots": (_mamba, 1),
}


def _tables(a: Any) -> dict[str, GenerationTable]:
    """Every table under ``a``, by the leaf's role (read from the allocator's own fields)."""
    if hasattr(a, "full_attn_allocator"):
        if a.full_attn_allocator is a.swa_attn_allocator:
            return {"swa": a.swa_attn_allocator.pdsafe_page_generations}
        return {"full": a.full_attn_allocator.pdsafe_page_generations,
                "swa": a.swa_attn_allocator.pdsafe_page_generations}
    return {"kv": a.pdsafe_page_generations}


def _installed(name: str) -> tuple[Any, int]:
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    build, ps = CASES[name]
    a = build(ps)
    if name == "mamba-slots":  # Mamba slots come with the request pool of hybrid models
        pool = HybridReqToTokenPool.__new__(HybridReqToTokenPool)
        pool.mamba_allocator = a
        names = page_generation.install(_token(), pool, PD)
        assert any(n.startswith("mamba") for n in names)
    else:
        names = page_generation.install(a, SimpleNamespace(), PD)
        assert len(names) == len(_tables(a))
    assert all(isinstance(t, GenerationTable) for t in _tables(a).values())
    return a, ps


def _expected(a: Any, ids: torch.Tensor, *, swa_side: bool = True,
              full_side: bool = True) -> dict[str, set[int]]:
    """Independently of the module: the leaf pages a free of token slots ``ids`` releases,
    per table (the SWA peers read from upstream's mapping before the free)."""
    ps = getattr(a, "page_size", 1)
    tables = _tables(a)
    if set(tables) == {"full", "swa"}:
        peers = a.full_to_swa_index_mapping[ids]
        return {"full": {int(p) for p in (ids // ps).tolist()} if full_side else set(),
                "swa": {int(p) for p in (peers[peers > 0] // ps).tolist()} if swa_side
                else set()}
    (role,) = tables
    return {role: {int(p) for p in (ids // ps).tolist()}}


def _moved_since(a: Any, before: dict[str, torch.Tensor]) -> dict[str, set[int]]:
    return {role: {int(p) for p in (t.gens[: before[role].numel()] != before[role])
                   .nonzero().reshape(-1).tolist()}
            for role, t in _tables(a).items()}


def _gens(a: Any) -> dict[str, torch.Tensor]:
    return {role: t.gens.clone() for role, t in _tables(a).items()}


@pytest.mark.parametrize("name", list(CASES))
def test_free_moves_exactly_the_freed_pages_and_alloc_moves_none(name):
    a, ps = _installed(name)
    before = _gens(a)
    held = _alloc(a, 6)
    assert _moved_since(a, before) == {r: set() for r in before}, "an alloc moved a generation"
    other = _alloc(a, 3)
    before = _gens(a)
    victim = held[: 2 * ps]  # two of the six pages
    expected = _expected(a, victim)
    a.free(victim)
    assert _moved_since(a, before) == expected
    assert all(expected.values()), expected  # something was freed on every side
    before = _gens(a)
    expected = _expected(a, other)
    a.free(other)
    assert _moved_since(a, before) == expected


@pytest.mark.parametrize("ps", [16, 64])
def test_paged_free_page_ids_segment_and_group(ps):
    a, _ = _installed(f"paged-{ps}")
    held = _alloc(a, 8)
    (t,) = _tables(a).values()
    before = t.gens.clone()
    a.free_page_ids(held[:ps] // ps)
    assert _moved_since(a, {"kv": before})["kv"] == {int(held[0]) // ps}
    before = t.gens.clone()
    a.free_segment(held[ps: 3 * ps], start_pos=ps)
    assert _moved_since(a, {"kv": before})["kv"] == {int(held[ps]) // ps,
                                                     int(held[2 * ps]) // ps}
    before = t.gens.clone()
    a.free_group_begin()
    a.free(held[3 * ps: 5 * ps])
    assert _moved_since(a, {"kv": before})["kv"] == set(), "a deferred free moved a page early"
    a.free_group_end()
    assert _moved_since(a, {"kv": before})["kv"] == {int(held[3 * ps]) // ps,
                                                     int(held[4 * ps]) // ps}


@pytest.mark.parametrize("ps", [1, 16])
def test_swa_sides_move_separately(ps):
    a, _ = _installed(f"swa-{ps}")
    held = _alloc(a, 4)
    pages = torch.unique(held // ps)
    snap = page_generation.snapshot(a, pages)
    before = _gens(a)
    victim = held[:ps]
    expected_swa = _expected(a, victim)["swa"]
    a.free_swa(victim)  # upstream's out-of-window release: the SWA peer only
    assert _moved_since(a, before) == {"full": set(), "swa": expected_swa}
    # the full page whose SWA peer was freed counts as moved (and only it)
    assert page_generation.changed(a, pages, snap) == [int(victim[0]) // ps]
    before = _gens(a)
    a.free_full(victim)
    assert _moved_since(a, before) == {"full": {int(victim[0]) // ps}, "swa": set()}


@pytest.mark.parametrize("name", list(CASES))
def test_clear_and_resize_move_every_generation(name):
    a, ps = _installed(name)
    held = _alloc(a, 2)
    snaps = {r: t.gens.clone() for r, t in _tables(a).items()}
    assert held.numel()
    a.clear()
    for role, t in _tables(a).items():
        assert bool((t.gens != snaps[role]).all()), f"{role}: a page kept its generation"
    if name.startswith("paged"):
        from types import SimpleNamespace as NS

        old = t.gens.numel()
        a.resize(NS(max_total_num_tokens=a.size * 2))
        assert t.gens.numel() == a.num_pages + 1 > old  # resize grows the table


@pytest.mark.parametrize("name", ["token-1", "paged-16", "swa-16", "pure-swa-1"])
def test_snapshot_changed_names_exactly_the_recycled_pages(name):
    a, ps = _installed(name)
    held = _alloc(a, 5)
    pages = torch.unique(held // ps)
    snap = page_generation.snapshot(a, pages.numpy())
    assert page_generation.changed(a, pages, snap) == []
    victim = held[2 * ps: 3 * ps]
    a.free(victim)
    for leaf in {id(x): x for x in (getattr(a, "full_attn_allocator", a),
                                    getattr(a, "swa_attn_allocator", a))}.values():
        leaf.merge_and_sort_free()  # PD's need_sort: freed pages join the sorted free list
    again = _alloc(a, 1)  # the freed page goes to "another request"
    assert page_generation.changed(a, pages, snap) == [int(victim[0]) // ps]
    assert again.numel() == ps
    with pytest.raises(ValueError):
        page_generation.changed(a, pages[:2], snap)


@pytest.mark.parametrize("name", ["token-1", "paged-16"])
def test_snapshot_keeps_the_page_ids_only(name):
    """A snapshot copies no per-page generation (issue 22: it kept 24 bytes per page, over
    the 16 bytes per token budget at page size 1): it keeps its own copy of the page ids (4
    bytes each) and the table's epoch; a page freed *before* it was taken is not moved, one
    freed after is, however many frees happened in between."""
    a, ps = _installed(name)
    early = _alloc(a, 2)
    held = _alloc(a, 6)
    a.free(early[:ps])  # freed before the snapshot: its generation is old news
    pages = torch.unique(held // ps)
    snap = page_generation.snapshot(a, pages.numpy())
    (taken,) = snap.taken
    assert taken.owner is None and isinstance(taken.epoch, int)
    assert taken.pages.untyped_storage().nbytes() == 4 * pages.numel()
    assert taken.pages.data_ptr() != pages.data_ptr()  # its own copy, not the caller's
    assert page_generation.changed(a, pages, snap) == []
    for _ in range(3):  # frees of pages the snapshot does not hold move nothing of it
        a.free(early[ps:])
        early = _alloc(a, 1)
    assert page_generation.changed(a, pages, snap) == []
    a.free(held[4 * ps: 5 * ps])
    assert page_generation.changed(a, pages, snap) == [int(held[4 * ps]) // ps]


def test_mamba_slot_snapshot():
    slots, _ = _installed("mamba-slots")
    held = slots.alloc(3)
    snap = page_generation.snapshot(slots, held)
    slots.free(held[1:2])
    assert page_generation.changed(slots, held, snap) == [int(held[1])]


def test_skipped_pages_are_not_released_a_second_time():
    a, ps = _installed("paged-16")
    held = _alloc(a, 4)
    (t,) = _tables(a).values()
    victim = held[:ps]
    a.free(victim)
    a.merge_and_sort_free()
    free_before = a.available_size()
    before = _counts()
    with page_generation._skipping([(t, victim[:1] // ps)]):
        a.free(held)  # the stale owner's release: its first page is not its own any more
    assert a.available_size() - free_before == 3 * ps
    assert _delta(before) == {page_generation.SKIPPED: 1}
    assert t.skip is None
    assert len(torch.unique(a.get_all_free_pages())) == len(a.get_all_free_pages())


def test_a_failed_stamp_never_breaks_the_free_and_fails_every_later_check_closed():
    a, ps = _installed("paged-16")
    held = _alloc(a, 3)
    (t,) = _tables(a).values()
    snap = page_generation.snapshot(a, torch.unique(held // ps))

    class Failing:
        def __setitem__(self, key, value):
            raise RuntimeError("stamp failed")

    free_before = a.available_size()
    before = _counts()
    with patch.object(t, "_np", Failing()):
        a.free(held[:ps])  # upstream's free goes on
    assert a.available_size() - free_before == ps
    assert t.broken and _delta(before) == {page_generation.FAILED: 1}
    with pytest.raises(page_generation.BrokenTableError):
        page_generation.changed(a, torch.unique(held // ps), snap)
    # a decode transfer checked against it is refused (fail closed)
    kv = SimpleNamespace(holds_kv=True)
    dreq = SimpleNamespace(req=SimpleNamespace(rid="r", bootstrap_room=ROOM, kv=kv,
                                               detach_kv=lambda: kv))
    transfer.record_for(dreq.req).pages = page_generation.Reservation(room=ROOM, rid="r",
                                                                     kv=snap)
    queue = SimpleNamespace(scheduler=SimpleNamespace(token_to_kv_pool_allocator=a))
    assert page_generation.decode_commit_refusal(queue, dreq) == page_generation.CHECK_FAILED
    # the table can no longer prove page ownership: the server stops admitting PD requests
    assert policy.poisoned() is not None and "page_generation.freed" in policy.poisoned().reason
    # and the request's release cannot tell its own pages from moved ones: nothing is freed,
    # the row is held for good (accounted as in use), never a possible double free
    released = []
    page_generation.release_request(dreq, lambda: released.append(t.skip))
    assert released == [] and kv in transfer.held_rows()
    _drop_held(kv)


# =========================================================================== startup


def test_not_pd_attaches_nothing():
    a = _paged(16)
    assert page_generation.install(a, SimpleNamespace(),
                                   SimpleNamespace(disaggregation_mode="null")) == []
    assert a.pdsafe_page_generations is None


def test_uncovered_allocators_refuse_the_start_in_pd_mode():
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    interleave = PageInterleavePoolAllocator.__new__(PageInterleavePoolAllocator)
    with pytest.raises(UncoveredAllocatorError) as e:
        page_generation.install(interleave, SimpleNamespace(), PREFILL)
    msg = str(e.value)
    assert "PageInterleavePoolAllocator" in msg and f"{page_generation.ENV_ENABLE}=0" in msg
    assert "Remedy" in msg

    class MyPaged(PagedTokenToKVPoolAllocator):  # a subclass may override the free funnel
        pass

    mine = MyPaged(512, 16, torch.float32, "cpu", _mha(512, 16), need_sort=True)
    with pytest.raises(UncoveredAllocatorError, match="MyPaged"):
        page_generation.install(mine, SimpleNamespace(), PD)
    assert mine.pdsafe_page_generations is None  # nothing half-attached
    with pytest.raises(UncoveredAllocatorError, match="Mamba slot allocator"):
        page_generation.install(_paged(16), SimpleNamespace(mamba_allocator=object()), PD)
    host = SimpleNamespace(disaggregation_mode="decode",
                           disaggregation_decode_host_receive_threshold=0.5)
    with pytest.raises(UncoveredAllocatorError, match="host receive"):
        page_generation.install(_paged(16), SimpleNamespace(), host)
    with pytest.raises(protections.PDModeUnknownError):
        page_generation.install(_paged(16), SimpleNamespace(), SimpleNamespace())


def test_swa_ring_is_not_covered():
    a = _swa(1)
    with patch.object(type(a), "swa_req_ring", property(lambda self: True)), \
            pytest.raises(UncoveredAllocatorError, match="per-request SWA ring"):
        page_generation.install(a, SimpleNamespace(), PD)


def test_off_switch_warns_attaches_nothing_and_reports_off(monkeypatch, caplog):
    monkeypatch.setenv(page_generation.ENV_ENABLE, "0")
    a = _paged(16)
    with caplog.at_level(logging.WARNING, logger="sglang.pdsafe.page_generation"):
        assert page_generation.install(a, SimpleNamespace(), PD) == []
    assert a.pdsafe_page_generations is None
    assert f"{page_generation.ENV_ENABLE}=0" in caplog.text
    assert protections.status(PD)["page-generation"] is False
    monkeypatch.delenv(page_generation.ENV_ENABLE)
    assert protections.status(PD)["page-generation"] is True
    assert "page-generation" not in protections.status(
        SimpleNamespace(disaggregation_mode="null"))  # not a co-located server's protection


def test_named_upstream_api_is_declared_and_present():
    from sglang.pdsafe import hook_api

    mine = [r for r in hook_api.requirements() if r.declared_by == page_generation.__name__]
    assert {r.target.rpartition(".")[2] for r in mine} >= {"BaseTokenToKVPoolAllocator",
                                                           "MambaSlotAllocator"}
    assert hook_api.missing(mine) == []


# =========================================================================== decode


PAGE = 16
TOKENS = 40  # three pages, the last one partial
DECODE_IDX = 3


class _Decode:
    """Decode's prealloc and transfer queues around one request, on real pools: a real
    paged allocator, request-to-token pool, disabled radix tree and metadata buffers."""

    def __init__(self) -> None:
        from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue
        from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache

        self.alloc = _paged(PAGE)
        self.rtt = ReqToTokenPool(size=4, max_context_len=128, device="cpu",
                                  enable_memory_saver=False)
        assert page_generation.install(self.alloc, self.rtt, PD)
        self.tree = RadixCache(CacheInitParams(disable=True, req_to_token_pool=self.rtt,
                                               token_to_kv_pool_allocator=self.alloc,
                                               page_size=PAGE))
        self.buffers = MetadataBuffers(8, hidden_size=16, hidden_states_dtype=torch.float32,
                                       max_sampling_mask_tokens=4)
        self.meta_alloc = ReqToMetadataIdxAllocator(8)
        self.streamed = MagicMock()
        self.scheduler = SimpleNamespace(
            kv_checksum_computer=None, token_to_kv_pool_allocator=self.alloc,
            enable_decode_hicache=False, enable_hisparse=False,
            output_streamer=SimpleNamespace(stream_output=self.streamed),
            metrics_reporter=SimpleNamespace(enable_metrics=False))
        tq = DecodeTransferQueue.__new__(DecodeTransferQueue)
        tq.queue, tq.scheduler, tq.tree_cache = [], self.scheduler, self.tree
        tq.metadata_buffers, tq.req_to_metadata_buffer_idx_allocator = self.buffers, \
            self.meta_alloc
        tq.enable_staging = tq.enable_host_receive = False
        tq.gloo_group, tq.tp_rank = None, 0
        tq._deferred_releases = []
        self.tq = tq
        pq = DecodePreallocQueue.__new__(DecodePreallocQueue)
        pq.token_to_kv_pool_allocator, pq.req_to_token_pool = self.alloc, self.rtt
        pq.req_to_metadata_buffer_idx_allocator = self.meta_alloc
        pq.transfer_queue, pq._num_published_destinations = tq, 0
        self.pq = pq

    def request(self, rid: str, room: int) -> Any:
        """A real Req holding TOKENS slots of pages from the real allocator."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(rid, "", array("q", range(TOKENS)), SamplingParams())
        req.bootstrap_room = room
        (row,) = self.rtt.alloc([req])
        n = -(-TOKENS // PAGE) * PAGE
        self.rtt.req_to_token[row, :n] = self.alloc.alloc(n).to(torch.int32)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = TOKENS
        return req

    def reserve(self, req: Any) -> Any:
        """Upstream's real ``_send_kv_metadata`` for ``req`` (the page indices sent)."""
        from sglang.srt.disaggregation.decode import DecodeRequest

        # A manager without transfer generations (they have their own tests).
        receiver = SimpleNamespace(send_metadata=MagicMock(), clear=MagicMock(),
                                   kv_mgr=SimpleNamespace(pdsafe_transfer_generation_wired=False))
        dreq = DecodeRequest(req=req, kv_receiver=receiver)
        kv = self.rtt.req_to_token[req.kv.req_pool_idx, :TOKENS]
        self.pq._send_kv_metadata(dreq, kv, PAGE, None, decode_prefix_len=0)
        receiver.send_metadata.assert_called_once()
        return dreq

    def pages(self, req: Any) -> list[int]:
        row = self.rtt.req_to_token[req.kv.req_pool_idx, :TOKENS]
        return sorted({int(p) for p in (row // PAGE).tolist()})

    def transferred(self, dreq: Any) -> list[Any]:
        """The transfer polls Success: upstream's real ``pop_transferred`` commits it (up to
        the coverage gate, stubbed to admit) or refuses and releases it."""
        import sglang.srt.disaggregation.decode as decode_mod
        from sglang.pdsafe import commit_gate
        from sglang.srt.disaggregation.base.conn import KVPoll

        self.buffers.bootstrap_room[dreq.metadata_buffer_index, 0] = dreq.req.bootstrap_room
        self.tq.queue = [dreq]
        with patch.object(type(self.tq), "_poll_with_metadata_gate",
                          lambda q: [KVPoll.Success]), \
                patch.object(decode_mod, "all_reduce_flags",
                             side_effect=lambda flags, **_: flags), \
                patch.object(commit_gate, "admit_commit", return_value=True), \
                patch.object(type(self.tq), "_commit_hicache_local_restore_to_req",
                             side_effect=_Stop):
            try:
                return self.tq.pop_transferred()
            except _Stop:
                return ["committed"]


class _Stop(Exception):
    """Past the checks of the commit: what follows needs a whole scheduler."""


@pytest.fixture
def decode() -> Iterator[_Decode]:
    from pdsafe_testkit.pd_context import published_pd_context

    with published_pd_context("decode"):
        yield _Decode()


def test_untouched_decode_transfer_commits(decode):
    req = decode.request("ok", ROOM)
    dreq = decode.reserve(req)
    before = _counts()
    assert decode.transferred(dreq) == ["committed"]  # past the generation check and the gate
    assert req.finished_reason is None
    assert _delta(before) == {}


def test_recycled_decode_pages_refuse_the_commit_and_are_not_freed_twice(decode):
    victim = decode.request("victim", ROOM)
    dreq = decode.reserve(victim)
    pages = decode.pages(victim)
    # an upstream page-lifecycle bug frees two of the victim's pages under the transfer ...
    recycled = decode.rtt.req_to_token[victim.kv.req_pool_idx, PAGE: 3 * PAGE]
    decode.alloc.free(recycled)
    # ... and a new request gets them (the allocator hands out every free page)
    decode.alloc.merge_and_sort_free()
    other = decode.request("other", ROOM + 1)
    other_pages = decode.pages(other)
    stolen = sorted(set(other_pages) & set(pages))
    assert stolen == sorted({int(p) for p in (recycled // PAGE).tolist()}), "not reused"
    free_before = decode.alloc.available_size()
    before = _counts()

    assert decode.transferred(dreq) == []  # refused, not committed

    fr = victim.finished_reason
    assert fr is not None and fr.status_code == HTTPStatus.INTERNAL_SERVER_ERROR
    assert str(ROOM) in fr.message and "victim" in fr.message
    for p in stolen:
        assert str(p) in fr.message
    decode.streamed.assert_called_once_with([victim], False)
    assert _delta(before) == {page_generation.MOVED: 1, page_generation.SKIPPED: len(stolen)}
    # released: only the page still its own went back; the other request keeps its pages
    free_pages = set(decode.alloc.get_all_free_pages().tolist())
    assert not set(other_pages) & free_pages, "a page of the other request was freed"
    assert set(pages) - set(stolen) <= free_pages
    assert decode.alloc.available_size() - free_before == (len(pages) - len(stolen)) * PAGE
    assert victim.kv.is_kv_released
    free_list = decode.alloc.get_all_free_pages()
    assert len(torch.unique(free_list)) == len(free_list), "double free"


def test_failed_transfer_release_skips_recycled_pages(decode):
    """A transfer that fails (not committed) is released by the same ``_release_request``:
    pages freed under it are not freed again either."""
    victim = decode.request("victim", ROOM)
    dreq = decode.reserve(victim)
    recycled = decode.rtt.req_to_token[victim.kv.req_pool_idx, :PAGE]
    decode.alloc.free(recycled)
    decode.alloc.merge_and_sort_free()
    other = decode.request("other", ROOM + 1)
    before = _counts()
    decode.tq._release_request(dreq)
    assert set(decode.pages(other)).isdisjoint(set(decode.alloc.get_all_free_pages().tolist()))
    assert _delta(before) == {page_generation.MOVED: 1, page_generation.SKIPPED: 1}


def test_failed_release_holds_the_row_detached_and_accounts_each_page_once(decode):
    """``page_generation.release_request`` failing (HOLD): nothing is freed, the request is
    left an empty KV record (no later upstream path can free the held pages), and the held
    row's accounting leaves out the page freed under the transfer, so the pool adds up as
    upstream's strict idle memory check counts it (the hook-failure suite's finding of
    2026-12-02: the check found a page both free and held and killed the decode scheduler)."""
    from sglang.pdsafe import transfer
    from sglang.srt.managers.scheduler_components.pool_stats_observer import kv_private_tokens

    victim = decode.request("victim", ROOM)
    dreq = decode.reserve(victim)
    reserved = decode.pages(victim)
    moved = int(decode.rtt.req_to_token[victim.kv.req_pool_idx, 0]) // PAGE
    decode.alloc.free(decode.rtt.req_to_token[victim.kv.req_pool_idx, :PAGE])  # moved
    decode.alloc.merge_and_sort_free()
    free_before = decode.alloc.available_size()
    held_before = len(transfer.held_rows())
    before = _counts()
    with patch.object(page_generation, "_moved_detail", side_effect=RuntimeError("boom")):
        decode.tq._release_request(dreq)
    assert decode.alloc.available_size() == free_before, "a held release freed pages"
    assert not victim.kv.holds_kv and victim.kv.kv_allocated_len == 0, "row not detached"
    rows = transfer.held_rows()
    assert len(rows) == held_before + 1
    held = rows[-1]
    # three pages reserved, one freed under the transfer: two are the row's, counted once
    assert kv_private_tokens(held, PAGE) == 2 * PAGE
    (kept,) = [h.pages for h in transfer.held() if h.row is held]
    assert sorted(kept.tolist()) == sorted(set(reserved) - {moved})
    assert decode.alloc.available_size() + kv_private_tokens(held, PAGE) == \
        decode.alloc.size, "the pool does not add up"
    assert _delta(before) == {page_generation.FAILED: 1}
    _drop_held(held)


def test_decode_without_a_reservation_is_refused(decode):
    req = decode.request("r", ROOM)
    dreq = decode.reserve(req)
    transfer.of(req).pages = None  # as if the snapshot had been lost
    assert decode.transferred(dreq) == []
    assert req.finished_reason.status_code == HTTPStatus.INTERNAL_SERVER_ERROR
    assert "no page generations" in req.finished_reason.message


def test_decode_off_switch_commits_without_checking(decode, monkeypatch):
    req = decode.request("r", ROOM)
    dreq = decode.reserve(req)
    decode.alloc.free(decode.rtt.req_to_token[req.kv.req_pool_idx, :PAGE])
    monkeypatch.setenv(page_generation.ENV_ENABLE, "0")
    assert decode.transferred(dreq) == ["committed"]


def test_decode_commit_check_failure_refuses(decode):
    req = decode.request("r", ROOM)
    dreq = decode.reserve(req)
    before = _counts()
    with patch.object(page_generation, "_moved_detail", side_effect=RuntimeError("boom")):
        assert page_generation.decode_commit_refusal(decode.tq, dreq) == \
            page_generation.CHECK_FAILED
    assert _delta(before) == {page_generation.FAILED: 1}


# =========================================================================== prefill


class _Sender:
    """A prefill sender that records what it is given and polls ``state``."""

    def __init__(self) -> None:
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.common.conn import KVTransferMetric

        self.state = KVPoll.Transferring
        self.sent: list[np.ndarray] = []
        self.kv_mgr = SimpleNamespace(is_dummy_cp_rank=False,
                                      enable_all_cp_ranks_for_transfer=False)
        self.metric = KVTransferMetric()
        self.cleared = False

    def poll(self):
        return self.state

    def get_max_transfer_tokens(self):
        return None

    def should_send_kv_chunk(self, n, last):
        return True

    def send(self, page_indices, state_indices=None, **kw):
        self.sent.append(np.asarray(page_indices))

    def clear(self):
        self.cleared = True

    def get_transfer_metric(self):
        return self.metric


class _Prefill:
    """The prefill scheduler state upstream's ``_send_kv_chunk`` and inflight queue read."""

    def __init__(self) -> None:
        from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin as P
        from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache

        for name in ("_send_kv_chunk", "process_disagg_prefill_inflight_queue"):
            setattr(self, name, getattr(P, name).__get__(self))
        self.token_to_kv_pool_allocator = _paged(PAGE)
        self.req_to_token_pool = ReqToTokenPool(size=4, max_context_len=128, device="cpu",
                                                enable_memory_saver=False)
        assert page_generation.install(self.token_to_kv_pool_allocator, self.req_to_token_pool,
                                       PREFILL)
        self.tree_cache = RadixCache(CacheInitParams(
            disable=True, req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator, page_size=PAGE))
        self.enable_staging = False
        self.scheduler_stage_metrics = None
        self.disagg_prefill_pending_chunk_rids: set[str] = set()
        self.disagg_prefill_inflight_queue: list[Any] = []
        self.disagg_prefill_bootstrap_queue = SimpleNamespace(kv_manager=None, queue=[])
        self.attn_tp_cpu_group = self.attn_cp_cpu_group = None
        self.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(4)
        self.output_streamer = MagicMock()
        self.metrics_reporter = SimpleNamespace(enable_metrics=False)

    def request(self, rid: str = "src") -> Any:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(rid, "", array("q", range(TOKENS)), SamplingParams())
        req.bootstrap_room = ROOM
        (row,) = self.req_to_token_pool.alloc([req])
        n = -(-TOKENS // PAGE) * PAGE
        self.req_to_token_pool.req_to_token[row, :n] = \
            self.token_to_kv_pool_allocator.alloc(n).to(torch.int32)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = TOKENS
        req.extend_end = TOKENS
        req.start_send_idx = 0
        req.disagg_decode_prefix_len = 0
        req.disagg_kv_sender = _Sender()
        req.metadata_buffer_index = self.req_to_metadata_buffer_idx_allocator.alloc()
        return req

    def send_chunks(self, req: Any) -> None:
        """Two chunks through upstream's real ``_send_kv_chunk`` (not the last: no aux)."""
        self._send_kv_chunk(req, last_chunk=False, end_idx=PAGE)
        self._send_kv_chunk(req, last_chunk=False, end_idx=3 * PAGE)
        assert [list(s) for s in req.disagg_kv_sender.sent] == [
            [p] for p in self.pages(req)[:1]] + [self.pages(req)[1:3]]

    def pages(self, req: Any) -> list[int]:
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :TOKENS]
        return [int(p) for p in (row[::PAGE] // PAGE).tolist()]

    def success(self, req: Any) -> list[Any]:
        import sglang.srt.disaggregation.utils as utils
        from sglang.srt.disaggregation.base.conn import KVPoll

        req.disagg_kv_sender.state = KVPoll.Success
        self.disagg_prefill_inflight_queue = [req]
        with patch.object(utils, "all_reduce_flags", side_effect=lambda flags, **_: flags):
            return self.process_disagg_prefill_inflight_queue()


@pytest.fixture
def prefill() -> Iterator[_Prefill]:
    from pdsafe_testkit.pd_context import published_pd_context

    with published_pd_context("prefill"), \
            patch("sglang.srt.disaggregation.prefill.get_parallel",
                  return_value=SimpleNamespace(tp_rank=0, pp_rank=0)):
        yield _Prefill()


def test_untouched_prefill_transfer_succeeds(prefill):
    req = prefill.request()
    prefill.send_chunks(req)
    free_before = prefill.token_to_kv_pool_allocator.available_size()
    before = _counts()
    assert prefill.success(req) == [req]
    assert type(req.finished_reason).__name__ == "FINISH_LENGTH"  # upstream's Success
    assert prefill.token_to_kv_pool_allocator.available_size() - free_before == 3 * PAGE
    assert _delta(before) == {}


def test_source_page_freed_during_the_transfer_fails_success(prefill):
    alloc = prefill.token_to_kv_pool_allocator
    req = prefill.request()
    prefill.send_chunks(req)
    pages = prefill.pages(req)
    # a source page of the first chunk is freed while the transfer reads it, and reused
    alloc.free(prefill.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :PAGE])
    alloc.merge_and_sort_free()
    other = prefill.request("other")
    assert pages[0] in prefill.pages(other)
    before = _counts()
    assert prefill.success(req) == [req]
    fr = req.finished_reason
    assert type(fr).__name__ == "FINISH_ABORT"
    assert fr.status_code == HTTPStatus.INTERNAL_SERVER_ERROR
    assert str(pages[0]) in fr.message and str(ROOM) in fr.message
    assert _delta(before) == {page_generation.SOURCE_MOVED: 1, page_generation.SKIPPED: 1}
    free_pages = set(alloc.get_all_free_pages().tolist())
    assert not set(prefill.pages(other)) & free_pages, "the other request's page was freed"
    assert set(pages[1:]) <= free_pages


def test_rows_held_for_good_stay_held_when_a_request_object_id_is_reused(monkeypatch):
    """Each request whose release fails keeps its row held, even when a later request object
    gets the id of an earlier, collected one (CPython reuses the memory; simulated here by one
    id for every object this module asks about): the held-row table mints its keys. Keyed by
    ``id(req)``, the later hold replaced the earlier one and dropped that row from the
    accounting, and upstream's strict idle check stopped the scheduler ("req_to_token_pool
    memory leak detected", the hook-failure suite's ``page_generation.release_source`` mid
    case, 2026-12-07)."""
    monkeypatch.setattr(page_generation, "id", lambda obj: 4242, raising=False)
    rows: list[SimpleNamespace] = []
    for i in range(3):
        kv = SimpleNamespace(holds_kv=True)
        req = SimpleNamespace(rid=f"reuse-{i}", bootstrap_room=ROOM, kv=kv,
                              detach_kv=lambda kv=kv: kv)
        with patch.object(page_generation, "_record", side_effect=RuntimeError("injected")):
            page_generation.release_request(SimpleNamespace(req=req), lambda: None)
        rows.append(kv)
    try:
        held = transfer.held_rows()
        lost = [r for r in rows if not any(r is h for h in held)]
        assert not lost, f"{len(lost)} of {len(rows)} rows held for good left the accounting"
    finally:
        for r in rows:
            _drop_held(r)
