"""Prefill source pages are held until their transfer drained (``sglang.pdsafe.source_lease``).

Two layers:

* the state machine and the fence alone;
* upstream's real, patched code on objects built without their heavy constructors: a real KV
  pool, allocator, request-to-token pool and (disabled) radix tree; a real ``Req`` holding ten
  KV slots; a real ``CommonKVSender`` on a real ``MooncakeKVManager`` whose real
  ``transfer_worker`` runs in a thread on a real ``FastQueue``; the scheduler's real
  ``process_disagg_prefill_inflight_queue`` / ``handle_inflight_transfer_failure`` /
  ``_retire_aborted_prefill_result`` / ``is_fully_idle`` and upstream's ``release_kv_cache``.
  A chunk is held "in flight" by the worker's real early-send wait (``wait_event``), with more
  chunks queued behind it; the allocator's free slots are read, not assumed.

Also the fence through NIXL's and MORI's real worker loops, and the off switch's startup report.

What this does not show: a real RDMA read racing a reuse (no transport here), TP > 1 (the
all-reduce is replaced by what the other rank would answer), a GPU pool.
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections import defaultdict
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock, patch

import numpy as np
import pytest
import torch
from sglang.pdsafe import metrics, room_guard, source_lease, transfer
from sglang.pdsafe.source_lease import Fence
from sglang.pdsafe.transfer import IllegalTransition, State, Transfer

ROOM = 0x50_0C_E0_01
TOTAL = 64
TOKENS = 10
WAIT_S = 10.0


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in (source_lease.ENV_ENABLE, source_lease.ENV_ALARM, room_guard.ENV_ENABLE,
                source_lease.UPSTREAM_DEFERRED_ENV):
        monkeypatch.delenv(var, raising=False)
    from pdsafe_testkit.pd_context import published_pd_context

    with published_pd_context("prefill"), \
            patch("sglang.srt.disaggregation.prefill.get_parallel",
                  return_value=SimpleNamespace(tp_rank=0, pp_rank=0)):
        yield


def _counts() -> dict[str, float]:
    return {n: metrics.value(n) for n in (source_lease.RELEASED, source_lease.FAILED,
                                          source_lease.OVERDUE, source_lease.POISONED)}


def _delta(before: dict[str, float]) -> dict[str, float]:
    return {n: metrics.value(n) - v for n, v in before.items() if metrics.value(n) != v}


# --------------------------------------------------------------------------- state machine


def test_a_lease_is_its_records_held_state():
    """A lease is the request's transfer record: REFUSED -> HELD -> RELEASED, or LEAKED (held
    for good); nothing frees it without being held first, nothing leaves LEAKED."""
    rec = Transfer(seq=1, leg="prefill", room=1, rid="r")
    with pytest.raises(IllegalTransition):
        rec.advance(State.HELD)  # a live transfer is refused (failed, aborted) first
    rec.advance(State.SENT)
    rec.refuse()
    rec.advance(State.HELD)
    with pytest.raises(IllegalTransition):
        rec.advance(State.REFUSED)  # a hold is never undone
    rec.advance(State.RELEASED)
    for to in State:
        with pytest.raises(IllegalTransition):
            rec.advance(to)  # terminal
    leaked = Transfer(seq=2, leg="prefill", room=1, rid="r")
    leaked.refuse()
    leaked.advance(State.HELD)
    leaked.advance(State.LEAKED)
    with pytest.raises(IllegalTransition):
        leaked.advance(State.RELEASED)  # a lease held for good is never freed


def test_fence_passes_only_once_every_queue_reached_it():
    f = Fence(7)
    f.reach()  # a worker may reach it before the manager reports the fan-out
    assert not f.passed
    f.expect(3)
    assert not f.passed
    f.reach()
    assert not f.passed
    f.reach()
    assert f.passed
    assert source_lease.fence_reached(f) and not source_lease.fence_reached(object())


def test_alarm_env_is_validated(monkeypatch):
    assert source_lease.alarm_after_s() == source_lease.DEFAULT_ALARM_S
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv(source_lease.ENV_ALARM, bad)
        with pytest.raises(ValueError, match=source_lease.ENV_ALARM):
            source_lease.alarm_after_s()


# --------------------------------------------------------------------------- real upstream code


class _Blocker:
    """An early-send ``wait_event``: the real worker blocks in ``synchronize()`` with the chunk
    dequeued and counted, i.e. in flight."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()

    def synchronize(self) -> None:
        self.entered.set()
        assert self.go.wait(WAIT_S), "test never released the in-flight chunk"


def _chunk(room: int = ROOM, wait_event: Any = None, last: bool = False) -> Any:
    from sglang.srt.disaggregation.common.utils import TransferKVChunk

    return TransferKVChunk(room=room, prefill_kv_indices=np.arange(4, dtype=np.int32),
                           index_slice=slice(0, 4), is_last_chunk=last,
                           prefill_aux_index=0 if last else None, state_indices=None,
                           wait_event=wait_event)


def _manager(cls_name: str = "mooncake") -> Any:
    """A prefill KV manager carrying the state its sender, worker and drain accounting use
    (its constructor starts a transfer engine); its transfer queue has no worker yet."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.utils import FastQueue
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.disaggregation.utils import DisaggregationMode

    assert cls_name == "mooncake"
    m = object.__new__(MooncakeKVManager)
    m.disaggregation_mode = DisaggregationMode.PREFILL
    m.request_status = {ROOM: KVPoll.Transferring}
    m.transfer_infos = {ROOM: {}}
    m.req_to_decode_prefix_len = {}
    m.failure_records = {}
    m.failure_lock = threading.Lock()
    m.deferred_bootstrap = None
    m.enable_trace = False
    m.enable_staging = False
    m._staging_ctx = None
    m.enable_deferred_decode_kv_release = True
    m._staging_outstanding = defaultdict(int)
    m._deferred_ack_targets = {}
    m._deferred_ack_poisoned_rooms = set()
    m.session_lock = threading.Lock()
    m.failed_sessions = set()
    m.transfer_queues = [FastQueue()]
    m.kv_item_lens_sum = m.state_item_lens_sum = 0
    m._kv_replica_factor = 1
    m.is_dummy_cp_rank = False
    m.reports_transfer_latency = False
    return m


def _start_worker(m: Any) -> threading.Thread:
    t = threading.Thread(target=m.transfer_worker, args=(m.transfer_queues[0],),
                         kwargs={"executor": None}, daemon=True)
    t.start()
    return t


def _stop_worker(m: Any, t: threading.Thread) -> None:
    m.transfer_queues[0].put(None)  # upstream's teardown sentinel
    t.join(WAIT_S)


def _wait(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


class _Pools:
    """A real KV pool, allocator, request-to-token pool and a (disabled) radix tree."""

    def __init__(self) -> None:
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache

        pool = MHATokenToKVPool(size=TOTAL, page_size=1, dtype=torch.float32, head_num=1,
                                head_dim=4, layer_num=1, device="cpu", enable_memory_saver=False,
                                enable_alt_stream=False)
        self.alloc = TokenToKVPoolAllocator(TOTAL, torch.float32, "cpu", pool, need_sort=False)
        self.rtt = ReqToTokenPool(size=4, max_context_len=32, device="cpu",
                                  enable_memory_saver=False)
        self.tree = RadixCache(CacheInitParams(disable=True, req_to_token_pool=self.rtt,
                                               token_to_kv_pool_allocator=self.alloc,
                                               page_size=1))

    def free(self) -> int:
        return int(self.alloc.available_size())

    def request(self, m: Any, rid: str = "victim", room: int = ROOM) -> Any:
        """A real Req holding TOKENS KV slots, with a real sender of ``room`` on ``m``."""
        from sglang.srt.disaggregation.common.conn import CommonKVSender, KVTransferMetric
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.observability.trace import TraceNullContext
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(rid, "", array("q", range(TOKENS)), SamplingParams())
        req.bootstrap_room = room
        (row,) = self.rtt.alloc([req])
        self.rtt.req_to_token[row, :TOKENS] = self.alloc.alloc(TOKENS).to(torch.int32)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = TOKENS
        sender = CommonKVSender.__new__(CommonKVSender)
        sender.kv_mgr, sender.bootstrap_room, sender.conclude_state = m, room, None
        sender.trace_ctx = TraceNullContext()
        sender._owns_bootstrap_room = True
        sender._transfer_metric = KVTransferMetric()
        sender._transfer_num_kv_indices = sender._transfer_num_state_indices = 0
        sender._transfer_start_time = None
        req.disagg_kv_sender = sender
        return req


class _Scheduler:
    """The prefill scheduler state the patched inflight queue, failure and abort paths read;
    the methods are upstream's."""

    def __init__(self, m: Any, pools: _Pools) -> None:
        from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin as P
        from sglang.srt.disaggregation.utils import DisaggregationMode, ReqToMetadataIdxAllocator
        from sglang.srt.managers.scheduler import Scheduler

        for name in ("process_disagg_prefill_inflight_queue", "handle_inflight_transfer_failure",
                     "_retire_aborted_prefill_result", "clear_pending_chunk_send"):
            setattr(self, name, getattr(P, name).__get__(self))
        for name in ("_release_aborted_request", "is_fully_idle", "process_pending_chunked_abort"):
            setattr(self, name, getattr(Scheduler, name).__get__(self))
        self._pending_chunked_abort_req = None
        self.send_abort_output = MagicMock()
        self.scheduler_stage_metrics = None
        self.disaggregation_mode = DisaggregationMode.PREFILL
        self.disagg_prefill_inflight_queue: list[Any] = []
        self.disagg_prefill_bootstrap_queue = SimpleNamespace(kv_manager=m, queue=[])
        self.disagg_prefill_pending_chunk_rids: set[str] = set()
        self.attn_tp_cpu_group = self.attn_cp_cpu_group = None
        self.tree_cache = pools.tree
        self.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(4)
        self.metrics_reporter = SimpleNamespace(enable_metrics=False)
        self.output_streamer = MagicMock()
        # what is_fully_idle reads besides the PD queues
        self.running_batch = SimpleNamespace(is_empty=lambda: True)
        self.chunked_req = self.last_batch = None
        self.dllm_manager = SimpleNamespace(any_staging_reqs=lambda: False)
        self.enable_overlap = False
        self._pp_microbatches_drained = lambda: True
        self.waiting_queue: list[Any] = []
        self.grammar_manager = SimpleNamespace(grammar_queue=[])
        self.enable_hisparse = self.enable_hierarchical_cache = self.enable_lmcache = False

    def run(self) -> list[Any]:
        """One pass of the patched inflight queue (single rank: the all-reduce is identity)."""
        import sglang.srt.disaggregation.utils as utils

        with patch.object(utils, "all_reduce_flags", side_effect=lambda flags, **_: flags):
            return self.process_disagg_prefill_inflight_queue()


def _fail_room(m: Any, room: int = ROOM) -> None:
    """The backend concludes the room Failed (a worker's send failure or decode's ABORT)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    m.record_failure(room, "decode aborted the transfer")
    m.update_status(room, KVPoll.Failed)


@pytest.fixture
def setup() -> Iterator[tuple[Any, _Pools, _Scheduler]]:
    m, pools = _manager(), _Pools()
    yield m, pools, _Scheduler(m, pools)


def _in_flight_failure(m: Any, pools: _Pools, sched: _Scheduler):
    """A transfer whose first chunk is in flight in the real worker and two more are queued,
    then fails; returns (req, worker, blocker)."""
    req = pools.request(m)
    sched.disagg_prefill_inflight_queue.append(req)
    worker = _start_worker(m)
    blocker = _Blocker()
    m.transfer_queues[0].put(_chunk(wait_event=blocker))
    assert blocker.entered.wait(WAIT_S)
    m.transfer_queues[0].put(_chunk())
    m.transfer_queues[0].put(_chunk(last=True))
    _fail_room(m)
    return req, worker, blocker


def test_failed_transfer_keeps_its_pages_until_the_workers_drained_then_frees_once(setup):
    m, pools, sched = setup
    req, worker, blocker = _in_flight_failure(m, pools, sched)
    before = _counts()
    assert pools.free() == TOTAL - TOKENS
    done = sched.run()  # upstream frees here: poll Failed -> handle_inflight_transfer_failure
    assert done == [req] and sched.disagg_prefill_inflight_queue == []
    sched.output_streamer.stream_output.assert_called()  # the client is answered at once
    assert pools.free() == TOTAL - TOKENS, "pages freed while a worker may still read them"
    assert req.kv.holds_kv
    assert metrics.value("source_pages_held") == TOKENS
    # Held pages are in use, not leaked: the server may count as idle, and its idle memory
    # check counts the held row (transfer.held_rows, read by the patched pool observer).
    assert sched.is_fully_idle() and req.kv in transfer.held_rows()
    for _ in range(3):
        sched.run()  # the chunk is still in flight and two are queued before the fence
        assert pools.free() == TOTAL - TOKENS
    blocker.go.set()  # the worker finishes (drops) the in-flight chunk, then the queued ones
    (lease,) = source_lease.of(m).leases()
    _wait(lambda: lease.hold.fence.passed, "the fence")
    sched.run()
    assert pools.free() == TOTAL and not req.kv.holds_kv
    assert _delta(before) == {source_lease.RELEASED: 1}
    assert sched.is_fully_idle() and metrics.value("source_pages_held") == 0
    assert req.kv not in transfer.held_rows()
    for _ in range(2):  # no double free: nothing more to free, nothing fails
        sched.run()
    assert pools.free() == TOTAL and _delta(before) == {source_lease.RELEASED: 1}
    _stop_worker(m, worker)


def test_abort_of_an_inflight_request_is_held_the_same_way(setup):
    """``abort_request`` on an in-flight request aborts its sender; the next pass polls
    Failed and reaches the same release (upstream's path)."""
    m, pools, sched = setup
    req = pools.request(m)
    sched.disagg_prefill_inflight_queue.append(req)
    m.transfer_queues[0].put(_chunk())  # queued, no worker yet
    req.disagg_kv_sender.abort()
    sched.run()
    assert pools.free() == TOTAL - TOKENS
    worker = _start_worker(m)
    _wait(lambda: source_lease.of(m).leases()[0].hold.fence.passed, "the fence")
    sched.run()
    assert pools.free() == TOTAL
    _stop_worker(m, worker)


def test_retired_aborted_result_is_held_until_drained(setup):
    m, pools, sched = setup
    req = pools.request(m)
    m.transfer_queues[0].put(_chunk())  # an earlier chunk of the aborted request, still queued
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req.finished_reason = FINISH_ABORT("aborted")
    assert sched._retire_aborted_prefill_result(req) is True
    assert pools.free() == TOTAL - TOKENS
    worker = _start_worker(m)
    _wait(lambda: source_lease.of(m).leases()[0].hold.fence.passed, "the fence")
    sched.run()
    assert pools.free() == TOTAL and not req.kv.holds_kv
    _stop_worker(m, worker)


def test_chunked_prefill_aborted_between_chunks_is_held_until_drained(setup):
    """``abort_request`` on the request being chunk-prefilled: ``process_pending_chunked_abort``
    aborts its sender and frees its KV while its earlier chunks may still be queued."""
    m, pools, sched = setup
    req = pools.request(m)
    m.transfer_queues[0].put(_chunk())  # the first chunk's KV, sent, still queued
    sched.chunked_req = sched._pending_chunked_abort_req = req
    sched.process_pending_chunked_abort()
    assert sched.chunked_req is None and sched.send_abort_output.called
    assert pools.free() == TOTAL - TOKENS
    worker = _start_worker(m)
    _wait(lambda: source_lease.of(m).leases()[0].hold.fence.passed, "the fence")
    sched.run()
    assert pools.free() == TOTAL and not req.kv.holds_kv
    _stop_worker(m, worker)


def test_clean_success_frees_at_once(setup):
    from sglang.srt.disaggregation.base.conn import KVPoll

    m, pools, sched = setup
    req = pools.request(m)
    sched.disagg_prefill_inflight_queue.append(req)
    m.update_status(ROOM, KVPoll.Success)
    before = _counts()
    assert sched.run() == [req]
    assert pools.free() == TOTAL and not req.kv.holds_kv
    assert len(source_lease.of(m)) == 0 and _delta(before) == {}
    assert sched.is_fully_idle()


def test_a_rank_that_has_not_drained_keeps_the_pages_on_every_rank(setup):
    m, pools, sched = setup
    req = pools.request(m)
    sched.disagg_prefill_inflight_queue.append(req)
    _fail_room(m)
    sched.run()
    worker = _start_worker(m)
    _wait(lambda: source_lease.of(m).leases()[0].hold.fence.passed, "the fence")
    groups = (object(), None)  # attention TP group of two ranks; CP of one
    other_rank = [0]  # the other TP rank's worker has not drained yet

    def all_reduce(flags, group, op):
        assert group is groups[0]
        return [min(f, o) for f, o in zip(flags, other_rank, strict=True)]

    import sglang.srt.disaggregation.utils as utils

    with patch.object(utils, "all_reduce_flags", side_effect=all_reduce):
        assert source_lease.release_drained(m, groups) == 0
        assert pools.free() == TOTAL - TOKENS
        other_rank[0] = 1
        assert source_lease.release_drained(m, groups) == 1
    assert pools.free() == TOTAL and not req.kv.holds_kv
    _stop_worker(m, worker)


def test_a_room_the_backend_cannot_prove_settled_is_never_released(setup, monkeypatch):
    monkeypatch.setenv(source_lease.ENV_ALARM, "0.05")
    m, pools, sched = setup
    req, worker, blocker = _in_flight_failure(m, pools, sched)
    before = _counts()
    sched.run()
    m.poison_deferred_ack_room(ROOM)  # e.g. a Mooncake batch that timed out still running
    blocker.go.set()
    _wait(lambda: source_lease.of(m).leases()[0].hold.fence.passed, "the fence")
    time.sleep(0.1)
    for _ in range(3):
        sched.run()
    assert pools.free() == TOTAL - TOKENS and req.kv.holds_kv
    assert _delta(before) == {source_lease.POISONED: 1, source_lease.OVERDUE: 1}
    (held,) = source_lease.of(m).leases()
    assert held.state is State.HELD and held.hold.overdue and held.hold.poisoned
    _stop_worker(m, worker)


def test_the_room_stays_live_while_held(setup):
    m, pools, sched = setup
    req = pools.request(m)
    room_guard.live_rooms(m).claim(ROOM, req.rid)  # the creation path's claim
    sched.disagg_prefill_inflight_queue.append(req)
    _fail_room(m)
    sched.run()  # the sender's clear() released the room; the lease keeps it live
    queue = SimpleNamespace(kv_manager=m)
    newcomer = SimpleNamespace(rid="next", bootstrap_room=ROOM, bootstrap_host="10.0.0.1")
    refusal = room_guard.door(queue, newcomer)
    assert refusal is not None and refusal.status == 409
    worker = _start_worker(m)
    _wait(lambda: source_lease.of(m).leases()[0].hold.fence.passed, "the fence")
    sched.run()
    assert pools.free() == TOTAL and room_guard.door(queue, newcomer) is None
    _stop_worker(m, worker)


def test_a_raising_hook_keeps_the_pages_held_and_counts(setup, monkeypatch, caplog):
    m, pools, sched = setup
    req = pools.request(m)
    sched.disagg_prefill_inflight_queue.append(req)
    _fail_room(m)
    monkeypatch.setattr(type(m), "pdsafe_fence_transfer_workers",
                        MagicMock(side_effect=RuntimeError("queue gone")), raising=True)
    before = _counts()
    with caplog.at_level(logging.ERROR, logger="sglang.pdsafe.source_lease"):
        sched.run()
    assert "keeps its KV pages for good" in caplog.text
    assert pools.free() == TOTAL - TOKENS and req.kv.holds_kv
    assert _delta(before) == {source_lease.FAILED: 1, "rows_held_for_good_total": 1} \
        if "rows_held_for_good_total" in _delta(before) else _delta(before)
    assert metrics.value(source_lease.FAILED) - before[source_lease.FAILED] == 1
    worker = _start_worker(m)
    for _ in range(3):
        sched.run()
    assert pools.free() == TOTAL - TOKENS
    (rec,) = source_lease.of(m).records()
    assert rec.state is State.LEAKED and not source_lease.of(m).leases()
    # held for good, yet the server counts as idle: the row is accounted as held
    assert sched.is_fully_idle() and req.kv in transfer.held_rows()
    _stop_worker(m, worker)


def test_a_raising_drain_check_keeps_the_pages_held_and_counts(setup, monkeypatch):
    m, pools, sched = setup
    req = pools.request(m)
    sched.disagg_prefill_inflight_queue.append(req)
    _fail_room(m)
    sched.run()
    worker = _start_worker(m)
    _wait(lambda: source_lease.of(m).leases()[0].hold.fence.passed, "the fence")
    monkeypatch.setattr(type(m), "pdsafe_room_in_flight",
                        MagicMock(side_effect=RuntimeError("boom")), raising=True)
    before = _counts()
    sched.run()
    sched.run()
    assert pools.free() == TOTAL - TOKENS and _delta(before) == {source_lease.FAILED: 1}
    _stop_worker(m, worker)


def test_off_switch_restores_upstream_and_is_reported(setup, monkeypatch, caplog):
    from sglang.pdsafe import protections, startup

    monkeypatch.setenv(source_lease.ENV_ENABLE, "0")
    m, pools, sched = setup
    req, worker, blocker = _in_flight_failure(m, pools, sched)
    sched.run()
    assert pools.free() == TOTAL, "off: upstream frees at once, even with a chunk in flight"
    assert len(source_lease.of(m)) == 0
    blocker.go.set()
    _stop_worker(m, worker)
    with caplog.at_level(logging.INFO, logger="sglang.pdsafe"):
        status = startup.report(SimpleNamespace(disaggregation_mode="prefill"))
    assert status["prefill-source-lease"] is False
    assert "'prefill-source-lease' is OFF (SGLANG_PDSAFE_SOURCE_LEASE=0, set by the operator)" \
        in caplog.text
    monkeypatch.delenv(source_lease.ENV_ENABLE)
    assert protections.status(SimpleNamespace(disaggregation_mode="prefill"))[
        "prefill-source-lease"]


# --------------------------------------------------------------------------- other workers


class _OrderFence(Fence):
    """Records how many items its queue had handed out when the worker reached it."""

    def __init__(self) -> None:
        super().__init__(ROOM)
        self.queue: Any = None
        self.taken_before: int | None = None

    def reach(self) -> None:
        self.taken_before = self.queue.taken
        super().reach()


class _Drained(BaseException):
    """Raised by :func:`_finite_queue` once its items are taken (ends a worker loop)."""


def _finite_queue(items: list[Any]) -> Any:
    """A real ``FastQueue`` whose ``get`` raises :class:`_Drained` once the items are taken:
    NIXL's worker loop has no stop sentinel, so it runs in the test's thread until then."""
    from sglang.srt.disaggregation.common.utils import FastQueue

    class _Finite(FastQueue):
        def __init__(self) -> None:
            super().__init__()
            self.left = self.taken = 0

        def put(self, item: Any) -> None:
            self.left += 1
            super().put(item)

        def get(self) -> Any:
            if self.left == 0:
                raise _Drained
            self.left -= 1
            self.taken += 1
            return super().get()

    q = _Finite()
    for item in items:
        q.put(item)
        if isinstance(item, _OrderFence):
            item.queue = q
    return q


def test_nixl_worker_reaches_the_fence_after_the_chunks_queued_before_it():
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager

    m = object.__new__(NixlKVManager)
    m.request_status = {}  # cleared: every chunk is dropped
    m._staging_outstanding = defaultdict(int)
    m.enable_deferred_decode_kv_release = False
    fence = _OrderFence()
    q = _finite_queue([_chunk(), _chunk(), fence, _chunk()])
    with pytest.raises(_Drained):
        m.transfer_worker(q)  # the loop skips the fence and goes on with the next chunk
    assert fence.taken_before == 3 and q.taken == 4  # dequeued after both earlier chunks
    fence.expect(1)
    assert fence.passed


def test_mori_worker_reaches_the_fence_after_the_chunks_queued_before_it():
    from pdsafe_testkit.backends import import_mori_manager

    MoriKVManager = import_mori_manager()
    m = object.__new__(MoriKVManager)
    m.request_status = {}
    m.enable_deferred_decode_kv_release = False
    fence = _OrderFence()
    q = _finite_queue([_chunk(), fence, _chunk(), None])
    m._transfer_worker(q)  # upstream's None sentinel stops it
    assert fence.taken_before == 2 and q.taken == 4
    fence.expect(1)
    assert fence.passed


def test_fence_fan_out_is_every_transfer_queue():
    from sglang.srt.disaggregation.common.conn import CommonKVManager
    from sglang.srt.disaggregation.common.utils import FastQueue

    m = object.__new__(CommonKVManager)
    m.transfer_queues = [FastQueue() for _ in range(3)]
    f = Fence(ROOM)
    assert m.pdsafe_fence_transfer_workers(f) == 3
    assert all(q.get() is f for q in m.transfer_queues)
    mori = object.__new__(CommonKVManager)
    mori._transfer_queues = [FastQueue(), FastQueue()]  # MORI's shards
    assert mori.pdsafe_fence_transfer_workers(f) == 2
    m._staging_outstanding = defaultdict(int, {ROOM: 1})
    m._deferred_ack_poisoned_rooms = {ROOM + 1}
    assert m.pdsafe_room_in_flight(ROOM) == (1, False)
    assert m.pdsafe_room_in_flight(ROOM + 1) == (0, True)


def _failing(tmp_path: Any, hook: str) -> Any:
    """The test-only ``hook_fail`` shim with ``hook`` failing at its entry (every call)."""
    from pdsafe_testkit.hook_fail import Control, HookFail

    hf = HookFail(tmp_path / "control.json", "unit")
    hf.install([hook], poller=False)
    Control(seq=1, armed={hook: "entry"}).write(hf.control_path)
    hf.poll()
    return hf


def test_a_failing_deferred_hook_holds_only_what_a_lease_would_have_taken(setup, tmp_path):
    """``source_lease.deferred`` failing at its entry (hook-failure suite, 2026-12-07): a
    request no release of a failed transfer armed (a clean success) is freed by upstream as
    before; a failed transfer's pages are held for good, once, never freed. Holding every
    released request instead left finished decode rows outside upstream's accounting (its
    pool check stopped the decode: a page both free and in use)."""
    from sglang.pdsafe import policy
    from sglang.srt.disaggregation.base.conn import KVPoll

    m, pools, sched = setup
    hf = _failing(tmp_path, "source_lease.deferred")
    try:
        clean = pools.request(m)
        sched.disagg_prefill_inflight_queue.append(clean)
        m.update_status(ROOM, KVPoll.Success)
        assert sched.run() == [clean]
        assert pools.free() == TOTAL and not clean.kv.holds_kv, "a clean success was held"
        assert clean.kv not in transfer.held_rows()

        m.request_status.pop(ROOM, None)
        failed = pools.request(m)
        sched.disagg_prefill_inflight_queue.append(failed)
        _fail_room(m)
        held0 = metrics.value("rows_held_for_good_total")
        sched.run()
        for _ in range(2):
            sched.run()
        assert pools.free() == TOTAL - TOKENS and failed.kv.holds_kv
        assert failed.kv in transfer.held_rows()
        assert metrics.value("rows_held_for_good_total") == held0 + 1, "held more than once"
        assert hf.injected.get("source_lease.deferred", 0) >= 2
    finally:
        hf.uninstall()
        policy.reset_for_tests()
