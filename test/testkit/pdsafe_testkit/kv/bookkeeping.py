"""The protections' bookkeeping around a harness transfer, as the patched schedulers run it.

Runs in the children only (``scheduler_glue`` builds a :class:`Bookkeeping` per lane when the
pair was started with ``bookkeeping=True``; importing this module imports neither torch nor
sglang). The plain harness drives the real KV manager, sender and receiver and calls the
coverage attestation and the KV digest where the patches do; with bookkeeping on, a lane also
has upstream's real allocator over its pool (``TokenToKVPoolAllocator`` at page size 1, else
``PagedTokenToKVPoolAllocator``, ``need_sort`` as in PD) with page generations installed, and
every transfer runs, where the patched scheduler calls them:

* decode, at pre-allocation: ``coverage.note_reservation_hook`` and
  ``page_generation.note_decode_reservation`` before ``receiver.send_metadata`` (which mints
  the transfer generation); at commit: ``kv_integrity.capture``,
  ``page_generation.decode_commit_refusal`` and ``commit_gate.admit_commit``; the digest
  (``kv_integrity.verify_batch``); at the end the pages go back through the allocator's free
  (``page_generation.freed`` stamps them);
* prefill, per chunk: ``page_generation.note_source_chunk`` before ``sender.send``; at
  Success: ``page_generation.prefill_success_refusal`` and ``page_generation.release_source``
  around the allocator's free;
* the failure path's records, for the same request's pages after it completed (every
  transfer here succeeds, so the records are exercised explicitly): decode's quarantine hold,
  ``quarantine.ready`` on the drain ACK and ``quarantine.released``; prefill's source lease
  (``source_lease.draining`` around upstream's real ``release_kv_cache``, which the lease
  takes over, fenced on the real manager's transfer queues, then ``release_drained`` once
  the fence passed; the request stand-in holds no KV row of its own, so upstream's release
  frees nothing and the pages are freed by the Success path above).

Measurement (``measure_begin`` / ``measure_end``): the hook cost table of the process
(``policy.measure_cost``: every hook call timed, upstream code a hook runs excluded; per hook,
and per hook upstream called, ``policy.hook_cost_outermost``, which partitions the total), the
retained size of the transfer's record (what the protections keep per request while it is in
flight: coverage, page-generation snapshots, digest row, hold), the standing generation
table, the digest planning timed apart (``kv_digest.plan_request`` on the same row), and,
with ``trace_memory``, the peak Python/numpy memory inside each outermost hook call
(``tracemalloc``; torch tensors are not traced, they are counted in the retained size).

Invariants: pages the bookkeeping allocated go back to its allocator exactly once; a page the
caller chose itself (the harness's default pages) is never freed into the allocator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pdsafe_testkit.kv.scheduler_glue import Lane

__all__ = ["Bookkeeping", "LAYOUTS", "record_bytes"]

#: Page layouts ``alloc_pages`` produces: every page next to the last, or every other page
#: (each page a run of its own: the fragmented pool of a busy server).
LAYOUTS = ("contiguous", "fragmented")
#: How long the source lease may take to see its fence passed on idle transfer queues.
LEASE_DRAIN_S = 10.0
#: The digest's planning is timed apart this many times; the fastest run counts.
PLAN_TIMING_RUNS = 3


def _storage_key(t: Any) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def record_bytes(obj: Any, _seen: set[int] | None = None,
                 _storages: set[tuple[int, int]] | None = None) -> int:
    """Bytes a protection record keeps: tensor storages (each once), numpy buffers, and the
    Python objects of pdsafe's dataclasses, containers and scalars, recursively. Upstream
    objects a record points at (a request, a manager, a generation table: standing) are not
    counted."""
    import torch

    seen = set() if _seen is None else _seen
    storages = set() if _storages is None else _storages
    if obj is None or id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        key = _storage_key(obj)
        if key in storages:
            return 0
        storages.add(key)
        return key[1]
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, (int, float, str, bytes, bool, type(None))):
        return sys.getsizeof(obj)
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sys.getsizeof(obj) + sum(record_bytes(x, seen, storages) for x in obj)
    if isinstance(obj, dict):
        return sys.getsizeof(obj) + sum(record_bytes(k, seen, storages)
                                        + record_bytes(v, seen, storages)
                                        for k, v in obj.items())
    module = type(obj).__module__ or ""
    if dataclasses.is_dataclass(obj) and module.startswith("sglang.pdsafe"):
        total = sys.getsizeof(obj)
        for f in dataclasses.fields(obj):
            if f.name in ("table", "req", "tree_cache"):  # standing or upstream's
                continue
            total += record_bytes(getattr(obj, f.name), seen, storages)
        return total
    if module.startswith("sglang.pdsafe") and type(obj).__name__ in ("State", "Outcome",
                                                                        "Evidence"):
        return 0  # enum members are shared
    return sys.getsizeof(obj)


class _MemoryTracer:
    """Peak traced memory inside each outermost hook call (per thread), by hook name."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}
        self._tls = threading.local()
        self._wrapped: dict[str, Callable[..., Any]] = {}

    def _stack(self) -> list[list[int]]:
        st = getattr(self._tls, "stack", None)
        if st is None:
            st = self._tls.stack = []
        return st

    def wrap(self) -> None:
        from sglang.pdsafe import policy

        tracemalloc.start()
        for name, spec in policy.HOOKS.items():
            body = spec.body
            self._wrapped[name] = body
            spec.body = self._traced(name, body)

    def _traced(self, name: str, body: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            stack = self._stack()
            cur, peak = tracemalloc.get_traced_memory()
            if stack:
                stack[-1][1] = max(stack[-1][1], peak)
            frame = [cur, cur]
            stack.append(frame)
            tracemalloc.reset_peak()
            try:
                return body(*args, **kwargs)
            finally:
                stack.pop()
                high = max(tracemalloc.get_traced_memory()[1], frame[1])
                if stack:
                    stack[-1][1] = max(stack[-1][1], high)
                else:
                    self.peaks[name] = max(self.peaks.get(name, 0), high - frame[0])
        return call

    def unwrap(self) -> None:
        from sglang.pdsafe import policy

        for name, body in self._wrapped.items():
            if name in policy.HOOKS:
                policy.HOOKS[name].body = body
        self._wrapped.clear()
        tracemalloc.stop()


@dataclasses.dataclass
class _Measure:
    """One transfer's measurement in this process."""

    trace: _MemoryTracer | None = None
    retained: int = 0
    retained_at: str = ""
    plan_ns: int = 0
    plan_calls: int = 0
    first_send_at: float | None = None
    forward_ns: int = 0
    marks: dict[str, float] = dataclasses.field(default_factory=dict)


class Bookkeeping:
    """One lane's allocator with page generations, and the bookkeeping calls around its
    transfers (see the module doc)."""

    def __init__(self, lane: Lane) -> None:
        import torch
        from sglang.pdsafe import page_generation

        self.lane = lane
        ps = lane.page_size
        size = lane.cfg.num_pages * ps
        if ps == 1:
            from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

            self.allocator: Any = TokenToKVPoolAllocator(size, torch.bfloat16, "cpu",
                                                         lane.pool, need_sort=True)
        else:
            from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

            self.allocator = PagedTokenToKVPoolAllocator(size, ps, torch.bfloat16, "cpu",
                                                         lane.pool, need_sort=True)
        page_generation.install(self.allocator, lane.req_to_token_pool, lane.server_args)
        self.table = page_generation.table_of(self.allocator)
        self.outstanding: dict[int, np.ndarray] = {}  # first page -> pages handed out
        self.holder: Any = None  # the pages that keep a fragmented layout fragmented
        self.measure: _Measure | None = None

    # -- pages
    def alloc_pages(self, num_pages: int, layout: str) -> list[int]:
        """``num_pages`` pages from the allocator, ``layout`` (:data:`LAYOUTS`)."""
        import torch

        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}")
        a, ps = self.allocator, self.lane.page_size
        if layout == "fragmented" and self.holder is None:
            # Take every page, give back every other one: the holder keeps the rest, so
            # every page handed out from now on is a run of its own.
            everything = a.alloc(a.available_size())
            pages = torch.unique(everything // ps)
            keep = pages[pages % 2 == 1]
            a.free(_slots(pages[pages % 2 == 0], ps))
            self.holder = keep
        elif layout == "contiguous" and self.holder is not None:
            a.free(_slots(self.holder, ps))
            self.holder = None
        a.merge_and_sort_free()
        slots = a.alloc(num_pages * ps)
        if slots is None:
            raise RuntimeError(f"the pool has no {num_pages} free pages of {ps}")
        pages = (slots[::ps] // ps).numpy().astype(np.int64)
        self.outstanding[int(pages[0])] = pages
        return pages.tolist()

    def free_pages(self, pages: list[int] | np.ndarray) -> bool:
        """Give ``pages`` back through the allocator's free (upstream's funnel: the page
        generation stamp runs there) if the bookkeeping handed them out; False otherwise."""
        import torch

        arr = np.asarray(pages, dtype=np.int64)
        if arr.size == 0:
            return False
        out = self.outstanding.get(int(arr[0]))
        if out is None or not np.array_equal(out, arr):
            return False
        del self.outstanding[int(arr[0])]
        self.allocator.free(_slots(torch.from_numpy(arr), self.lane.page_size))
        return True

    # -- decode
    def reserve(self, decode_req: Any, pages: list[int], num_tokens: int) -> None:
        """``_send_kv_metadata`` before ``send_metadata``: the coverage reservation and the
        page-generation snapshot (their hooks)."""
        from sglang.pdsafe import coverage, page_generation

        ps = self.lane.page_size
        page_indices = np.asarray(pages, dtype=np.int32)
        coverage.note_reservation_hook(decode_req, page_indices, ps, 0, num_tokens)
        queue = SimpleNamespace(token_to_kv_pool_allocator=self.allocator,
                                req_to_token_pool=self.lane.req_to_token_pool)
        page_generation.note_decode_reservation(queue, decode_req, page_indices, ps)
        self.sample(decode_req.req, "decode reservation")

    def commit(self, decode_req: Any, metadata: Any) -> tuple[str | None, bool]:
        """``_commit_transfer_to_req``: the digest row kept, the page-generation check and
        the commit gate (their hooks). Returns (page-generation refusal, gate passed)."""
        from sglang.pdsafe import commit_gate, kv_integrity, page_generation

        queue = SimpleNamespace(metadata_buffers=metadata,
                                scheduler=SimpleNamespace(
                                    token_to_kv_pool_allocator=self.allocator))
        if self.lane.kv_checksum_computer is not None:
            kv_integrity.capture(queue, decode_req, fake=False)
        self.sample(decode_req.req, "decode commit")
        refusal = page_generation.decode_commit_refusal(queue, decode_req)
        if refusal is not None:
            return refusal, False
        return None, bool(commit_gate.admit_commit(queue, decode_req))

    def quarantine_cycle(self, room: int, rid: str, tokens: int) -> None:
        """The quarantine record of a failed transfer of these pages: held, ready on the
        drain ACK, released (their hooks; the record only counts tokens)."""
        from sglang.pdsafe import quarantine

        mgr, now = self.lane.mgr, time.monotonic()
        key = ("scale-bench", room)
        quarantine.hold(mgr, key, room=room, rid=rid, tokens=tokens,
                        writer=self.lane.bootstrap_addr, now=now, deadline=now + 300.0,
                        writer_since=time.time())
        if not quarantine.ready(mgr, key, drained=True, now=now, deadline=now + 300.0):
            raise RuntimeError("the quarantine did not accept the drain ACK")
        quarantine.released(mgr, key, drained=True, now=time.monotonic())

    # -- prefill
    def note_chunk(self, req: Any, start: int, end: int) -> None:
        """``_send_kv_chunk`` before ``sender.send``: the source-page snapshot (its hook)."""
        from sglang.pdsafe import page_generation

        scheduler = SimpleNamespace(token_to_kv_pool_allocator=self.allocator,
                                    req_to_token_pool=self.lane.req_to_token_pool)
        page_generation.note_source_chunk(scheduler, req, start, end)
        m = self.measure
        if m is not None and m.first_send_at is None:
            m.first_send_at = time.monotonic()

    def success(self, req: Any, pages: list[int]) -> str | None:
        """Success at ``process_disagg_prefill_inflight_queue``: the source-page check and
        the release around the allocator's free (their hooks). Returns the refusal."""
        from sglang.pdsafe import page_generation

        scheduler = SimpleNamespace(token_to_kv_pool_allocator=self.allocator)
        self.sample(req, "prefill success")
        refusal = page_generation.prefill_success_refusal(scheduler, req)
        page_generation.release_source(req, lambda: self.free_pages(pages))
        return refusal

    def lease_cycle(self, room: int, rid: str, tokens: int) -> None:
        """The source lease of a failed transfer of these pages: taken over from upstream's
        real ``release_kv_cache`` (fenced on the manager's real transfer queues), released
        once drained (their hooks; the record only counts pages)."""
        from sglang.pdsafe import source_lease
        from sglang.srt.mem_cache.common import release_kv_cache

        mgr = self.lane.mgr
        req = SimpleNamespace(rid=rid, bootstrap_room=room, bootstrap_host=None,
                              kv=SimpleNamespace(holds_kv=False, is_kv_released=True,
                                                 holds_mamba=False, kv_allocated_len=tokens))
        tree = SimpleNamespace(supports_mamba=lambda: True,
                               token_to_kv_pool_allocator=self.allocator)
        with source_lease.draining(mgr, req):
            release_kv_cache(req, tree, checkpoint=False)
        held = [r for r in source_lease.of(mgr).leases() if r.room == room]
        deadline = time.monotonic() + LEASE_DRAIN_S
        # Wait for the transfer workers to pass the fence before the release pass, so the
        # hook is timed once, not once per poll (a scheduler runs it once per pass anyway).
        while held and not all(r.hold.fence is not None and r.hold.fence.passed
                               for r in held):
            if time.monotonic() > deadline:
                raise RuntimeError("the source lease's fence was never passed")
            time.sleep(0.0005)
        while source_lease.release_drained(mgr) == 0:
            if time.monotonic() > deadline:
                raise RuntimeError("the source lease was never released")
            time.sleep(0.0005)

    # -- measurement
    def sample(self, req: Any, where: str) -> None:
        """Keep the largest retained size of ``req``'s transfer record seen so far."""
        m = self.measure
        if m is None:
            return
        from sglang.pdsafe import transfer

        rec = transfer.of(req)
        size = record_bytes(rec) if rec is not None else 0
        if size > m.retained:
            m.retained, m.retained_at = size, where

    def time_plan(self, num_tokens: int) -> None:
        """The digest's planning (``kv_digest.plan_request``) timed apart, on the request's
        row as the digest just planned it (the row of ``REQ_POOL_IDX``)."""
        m = self.measure
        digester = self.lane.kv_checksum_computer
        if m is None or digester is None:
            return
        from sglang.pdsafe import kv_digest

        from pdsafe_testkit.kv.scheduler_glue import REQ_POOL_IDX

        plan_request = getattr(kv_digest, "plan_request", None)
        if plan_request is None:  # a build before the planning was split off the digest
            return
        row = self.lane.req_to_token_pool.req_to_token[REQ_POOL_IDX]
        # The fastest of a few runs: the planning's own cost, not a scheduler hiccup on a
        # loaded 2-core machine. A hiccup here made the planning look as long as the whole
        # digest hook it is subtracted from, so a small cell reported no hashing at all.
        best = None
        for _ in range(PLAN_TIMING_RUNS):
            t0 = time.perf_counter_ns()
            plan_request(digester.prepared, row, prefix=0, length=num_tokens)
            dt = time.perf_counter_ns() - t0
            best = dt if best is None else min(best, dt)
        m.plan_ns += best or 0
        m.plan_calls += 1

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Times the harness's stand-in for the forward (the pattern write of a chunk)."""
        t0 = time.perf_counter_ns()
        try:
            yield
        finally:
            if self.measure is not None:
                self.measure.forward_ns += time.perf_counter_ns() - t0


def _slots(pages: Any, page_size: int) -> Any:
    """The token slots of ``pages`` (a CPU int64 tensor), in page order."""
    import torch

    pages = pages.to(torch.int64)
    if page_size == 1:
        return pages
    return (pages[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)


_MEASURE_LOCK = threading.Lock()


def _outermost(policy: Any) -> dict[str, tuple[int, int]]:
    """``policy.hook_cost_outermost()``; a build without it (before issue 22's fixes): every
    hook's own table, which counts a nested hook in its caller too."""
    fn = getattr(policy, "hook_cost_outermost", None)
    if fn is not None:
        return dict(fn())
    return {k: v for k, v in policy.hook_cost().items() if k != "*"}


def measure_begin(books: list[Bookkeeping], trace_memory: bool = False) -> None:
    """Start one transfer's measurement in this process (every lane's bookkeeping)."""
    from sglang.pdsafe import policy

    with _MEASURE_LOCK:
        trace = _MemoryTracer() if trace_memory else None
        m = _Measure(trace=trace)
        for b in books:
            b.measure = m
        if trace is not None:
            trace.wrap()
        policy.reset_cost()
        policy.measure_cost(True)


def measure_end(books: list[Bookkeeping]) -> dict[str, Any]:
    """Stop the measurement; what it measured (plain data, see the module doc)."""
    from sglang.pdsafe import policy

    with _MEASURE_LOCK:
        policy.measure_cost(False)
        hooks = {name: [calls, ns] for name, (calls, ns) in policy.hook_cost().items()}
        outermost = {name: [calls, ns]
                     for name, (calls, ns) in _outermost(policy).items()}
        m = books[0].measure if books else None
        for b in books:
            b.measure = None
        if m is None:
            return {"hooks": hooks, "outermost": outermost}
        peaks: dict[str, int] = {}
        if m.trace is not None:
            m.trace.unwrap()
            peaks = dict(m.trace.peaks)
        tables = [b.table for b in books if b.table is not None]
        return {
            "hooks": hooks,
            "outermost": outermost,
            "retained_bytes": m.retained,
            "retained_at": m.retained_at,
            "table_bytes": sum(int(t.gens.numel()) * t.gens.element_size() for t in tables),
            "table_pages": sum(int(t.gens.numel()) for t in tables),
            "digest_plan_ns": m.plan_ns,
            "digest_plan_calls": m.plan_calls,
            "first_send_at": m.first_send_at,
            "forward_ns": m.forward_ns,
            "transient_peak_bytes": peaks,
        }
