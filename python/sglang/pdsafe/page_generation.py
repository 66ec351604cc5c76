"""Page generations: every KV page (and Mamba slot) of a PD server says whether it was freed.

Upstream 0.5.23's allocators keep a bare free list: a page carries no owner and no generation,
so nothing can tell a page a transfer reserved from the same page freed and handed to another
request meanwhile. In PD mode freed pages are merged and sorted before reuse (``need_sort``),
so reuse is soon and predictable. This module gives every page of every allocator PD uses a
generation, and the transfer paths prove with it that their pages were never recycled under
them.

**The table.** One :class:`GenerationTable` per *leaf* allocator (the one that owns a free
list): one int64 per page id (slot 0, upstream's padding page, included), on the allocator's
own device, so that stamping a free is one ``index_fill_`` on the tensor the free already
carries (no device-to-host copy in upstream's sync-free free path). Every free (upstream's
free funnel: ``TokenToKVPoolAllocator.free``, ``PagedTokenToKVPoolAllocator._release_page_ids``,
``MambaSlotAllocator.free``, and their ``clear()``) calls :meth:`GenerationTable.freed`, which
stamps the freed pages with a new epoch of that table.

**Invariant** (what a snapshot proves). A table's epoch strictly increases with every free
call, and a page's generation is the epoch of its last free since the table was attached (0:
none; ``clear()`` frees every page). So, for the pages a request held when it took a
:func:`snapshot`: a page's generation differs from the snapshot **iff the page was freed at
least once since** (and so possibly reallocated to another request). :func:`changed` names
those pages. Allocating never touches a generation. Frees happen on the scheduler thread,
like every other operation on upstream's free lists (which are not thread safe either).

**Coverage.** The leaves and composites whose every free goes through the funnels above:
:data:`COVERED_LEAVES` and :data:`COVERED_COMPOSITES` (exact classes: a subclass may override
the funnel, so it is covered only once listed here). The SWA allocator is covered through its
two leaves (both sub-pools; the SWA peer of a full page is found with upstream's
``translate_swa_indices_for_transfer``), the Mamba slots through ``HybridReqToTokenPool``'s
``mamba_allocator``. In PD mode :func:`install` (scheduler start) refuses, with an
:class:`UncoveredAllocatorError` naming the class and the remedy, any allocator it does not
cover (HiSparse, page-interleave sharding, the unified pools, a per-request SWA ring, the
decode host-receive path, unknown subclasses): never silently unprotected.

**Checks** (thin hooks; the patch "page generations" calls them):

* decode, when the transfer's pages are reserved (``DecodePreallocQueue._send_kv_metadata``):
  :func:`note_decode_reservation` snapshots the pages (and the request's Mamba slot); at
  commit (``DecodeTransferQueue._commit_transfer_to_req``, before the coverage gate)
  :func:`decode_commit_refusal` answers the refusal (HTTP 500: room, pages) when any of them
  moved, counted in ``page_generation_moved_total``;
* prefill, for every chunk it sends (``_send_kv_chunk``): :func:`note_source_chunk`
  snapshots the chunk's source pages; when the transfer reaches Success
  :func:`prefill_success_refusal` answers the refusal (500) if a source page was freed while
  the transfer read it, counted in ``page_generation_source_moved_total``;
* **no double free**: a page whose generation moved is not the request's any more (another
  request may hold it, or it waits in the free list). :func:`release_scope` (decode's
  ``_release_request``) and :func:`source_release_scope` (prefill's Success release) make the
  request's own release skip exactly those pages (counted in
  ``page_generation_free_skipped_total``), and on prefill also skip the radix-cache insert.

Off: ``SGLANG_PDSAFE_PAGE_GENERATION=0`` (startup warning; nothing attached, upstream's bare
free lists). Not done here: the page generation itself does not travel on the wire (the
tables' epochs, :func:`process_epochs`, seed each reservation's transfer generation, which does:
:mod:`sglang.pdsafe.transfer_generation`), req-slot-indexed state (SWA ring, DSV4 request
state, request rows) carries none, and on a GPU the check reads one flag back per transfer (a
device sync).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from sglang.pdsafe import hook_api, metrics
from sglang.pdsafe.hook_api import guarded
from sglang.pdsafe.protections import Protection, is_pd, pd_mode, register, switch_on

logger = logging.getLogger("sglang.pdsafe.page_generation")

ENV_ENABLE = "SGLANG_PDSAFE_PAGE_GENERATION"
MOVED = "page_generation_moved_total"
SOURCE_MOVED = "page_generation_source_moved_total"
SKIPPED = "page_generation_free_skipped_total"
FAILED = "page_generation_failed_total"
_RESERVATION_ATTR = "_pdsafe_page_generation_reservation"
_SOURCE_ATTR = "_pdsafe_page_generation_source"
_SHOWN_PAGES = 16  # pages named in a refusal message (the count is always complete)

_ALLOC = "sglang.srt.mem_cache.allocator"
#: Leaf allocators: own a free list whose every free goes through the patched funnel.
COVERED_LEAVES: frozenset[str] = frozenset({
    f"{_ALLOC}.token.TokenToKVPoolAllocator",
    f"{_ALLOC}.paged.PagedTokenToKVPoolAllocator",
    # Ascend: overrides free() and alloc_*() only; its free ends in the paged funnel and it
    # inherits clear() (read, not run here: no NPU in CI).
    "sglang.srt.hardware_backend.npu.allocator_npu.NPUPagedTokenToKVPoolAllocator",
    f"{_ALLOC}.mamba.MambaSlotAllocator",
})
#: Composites: no free list of their own; every free lands in a covered leaf.
COVERED_COMPOSITES: frozenset[str] = frozenset({
    f"{_ALLOC}.swa.SWATokenToKVPoolAllocator",
    f"{_ALLOC}.swa.PureSWATokenToKVPoolAllocator",
})
#: Request pools whose ``mamba_allocator`` is a covered leaf (their Mamba slots).
COVERED_MAMBA_POOLS: frozenset[str] = frozenset({
    "sglang.srt.mem_cache.memory_pool.HybridReqToTokenPool",
})

hook_api.require(
    f"{_ALLOC}.base.BaseTokenToKVPoolAllocator", "pdsafe_page_generations",
    why="page generations: the slot the patched free funnel of every KV allocator reads")
hook_api.require(
    f"{_ALLOC}.mamba.MambaSlotAllocator", "pdsafe_page_generations",
    why="page generations: the slot the patched Mamba slot free reads")
hook_api.require(
    f"{_ALLOC}.swa.SWATokenToKVPoolAllocator", "translate_swa_indices_for_transfer(kv_indices)",
    "swa_req_ring",
    why="page generations: the SWA peer of a full page, and the per-request ring it refuses")


def enabled() -> bool:
    """Default on; ``SGLANG_PDSAFE_PAGE_GENERATION=0`` leaves upstream's bare free lists."""
    return switch_on(ENV_ENABLE)


register(Protection(
    name="page-generation",
    guards="every KV page and Mamba slot of a PD server carries a generation that moves on "
           "each free; decode refuses (500) a transfer whose reserved pages were freed before "
           "commit, prefill one whose source pages were freed before Success, and neither "
           "frees such pages a second time",
    is_active=lambda server_args: is_pd(server_args) and enabled(),
    disabled_by=f"{ENV_ENABLE}=0",
))


class UncoveredAllocatorError(RuntimeError):
    """A PD server's allocator is not covered by page generations (the server refuses to
    start)."""


def _qualname(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


# =========================================================================== the table


class GenerationTable:
    """The page generations of one leaf allocator (see the module's invariant).

    ``gens[p]`` is the epoch of page ``p``'s last free since the table was attached (0:
    none); ``epoch`` strictly increases with every :meth:`freed` / :meth:`cleared` call.
    While a release scope is open, :meth:`freed` leaves out the pages in ``skip`` (pages a
    request still references but no longer owns): they are neither stamped nor released.
    """

    def __init__(self, name: str, num_pages: int, device: Any) -> None:
        self.name = name
        self.epoch = 0
        self.skip: torch.Tensor | None = None
        self.broken = False  # a stamp failed: no snapshot on this table proves anything
        self._set(torch.zeros(max(int(num_pages), 1), dtype=torch.int64, device=device))

    def _set(self, gens: torch.Tensor) -> None:
        self.gens = gens
        # On the CPU the stamp goes through a numpy view of the same memory (about half the
        # dispatch cost of index_fill_); on a device, index_fill_ on the device (no sync).
        self._np = gens.numpy() if gens.device.type == "cpu" else None

    def _index(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype != torch.int64:
            ids = ids.to(torch.int64)
        if ids.device != self.gens.device:
            ids = ids.to(self.gens.device)
        return ids

    def freed(self, *page_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Upstream's free funnel: stamp ``page_ids`` with a new epoch; returns the ids to
        release (all of them, unless a release scope skips some). Never raises into the
        free: a failure marks the table broken (every later check on it refuses, fail closed)
        and releases the ids as upstream would."""
        self.epoch += 1
        try:
            if self.skip is not None:
                page_ids = tuple(self._without_skipped(ids) for ids in page_ids)
            gens_np = self._np
            for ids in page_ids:
                if gens_np is not None and ids.device.type == "cpu":
                    gens_np[ids.numpy()] = self.epoch
                else:
                    self.gens.index_fill_(0, self._index(ids), self.epoch)
        except Exception as e:  # noqa: BLE001 - the free itself must go on
            metrics.inc(FAILED)
            if not self.broken:
                logger.error("pdsafe page generation: stamping a free in %s failed (%s: %s); "
                             "the table is broken: every transfer checked against it from now "
                             "on is refused.", self.name, type(e).__name__, e, exc_info=True)
            self.broken = True
        return page_ids

    def cleared(self, num_pages: int) -> None:
        """Upstream's ``clear()`` (also after a resize): every page is free again."""
        self.epoch += 1
        if num_pages > self.gens.numel():
            self._set(torch.zeros(int(num_pages), dtype=torch.int64, device=self.gens.device))
        self.gens.fill_(self.epoch)

    def _without_skipped(self, ids: torch.Tensor) -> torch.Tensor:
        skip = self.skip
        if skip is None or ids.numel() == 0:
            return ids
        hit = torch.isin(self._index(ids), skip)
        n = int(hit.sum().item())
        if n == 0:
            return ids
        metrics.inc(SKIPPED, n)
        logger.error("pdsafe page generation: %d page(s) of %s not freed a second time: they "
                     "were freed while a transfer held them and are not the releasing "
                     "request's any more.", n, self.name)
        return ids[~hit.to(ids.device)]

    def current(self, pages: torch.Tensor) -> torch.Tensor:
        return self.gens[pages]


def table_of(leaf: Any) -> GenerationTable | None:
    """The table attached to ``leaf`` (None: not attached)."""
    table = getattr(leaf, "pdsafe_page_generations", None)
    return table if isinstance(table, GenerationTable) else None


# =========================================================================== coverage


@dataclass(frozen=True)
class _Part:
    """How one leaf's pages relate to the page ids a caller snapshots on a composite."""

    role: str        # "kv", "full", "swa", "mamba"
    leaf: Any
    peer: bool       # True: the leaf page is the SWA peer of the caller's (full) page


def _parts(allocator: Any) -> list[_Part]:
    """The leaves of a covered allocator; raises :class:`UncoveredAllocatorError` otherwise."""
    name = _qualname(allocator)
    if name in COVERED_LEAVES:
        return [_Part("mamba" if name.endswith("MambaSlotAllocator") else "kv", allocator,
                      False)]
    if name in COVERED_COMPOSITES:
        if allocator.swa_req_ring:
            raise UncoveredAllocatorError(
                f"{name} with a per-request SWA ring: its SWA side is indexed by request slot, "
                "not by allocator page, and carries no generation")
        full, swa = allocator.full_attn_allocator, allocator.swa_attn_allocator
        for leaf in (full, swa):
            if _qualname(leaf) not in COVERED_LEAVES:
                raise UncoveredAllocatorError(f"{name} over the sub-pool allocator "
                                              f"{_qualname(leaf)}")
        if full is swa:  # the pure-SWA allocator: one pool
            return [_Part("swa", swa, False)]
        return [_Part("full", full, False), _Part("swa", swa, True)]
    raise UncoveredAllocatorError(name)


def _num_pages(leaf: Any) -> int:
    """Page ids of ``leaf`` run over ``[0, n)`` (0 is upstream's padding page)."""
    if getattr(leaf, "page_size", 1) > 1:
        return int(leaf.num_pages) + 1
    return int(leaf.size) + 1


def uncovered(allocator: Any, req_to_token_pool: Any, server_args: Any) -> list[str]:
    """What a PD server's pools have that page generations do not cover (empty: all)."""
    problems: list[str] = []
    try:
        _parts(allocator)
    except UncoveredAllocatorError as e:
        problems.append(f"KV allocator {e}")
    mamba = getattr(req_to_token_pool, "mamba_allocator", None)
    if mamba is not None:
        pool = _qualname(req_to_token_pool)
        if pool not in COVERED_MAMBA_POOLS or _qualname(mamba) not in COVERED_LEAVES:
            problems.append(f"request pool {pool} with Mamba slot allocator {_qualname(mamba)}")
    threshold = getattr(server_args, "disaggregation_decode_host_receive_threshold", 1)
    if pd_mode(server_args) == "decode" and threshold is not None and float(threshold) < 1:
        problems.append("decode host receive (--disaggregation-decode-host-receive-threshold "
                        f"{threshold} < 1): transfers land in the host pool, whose allocator "
                        "carries no generation")
    return problems


def install(allocator: Any, req_to_token_pool: Any, server_args: Any) -> list[str]:
    """Scheduler start: attach a table to every leaf of a PD server's pools.

    Not PD: nothing. Off: a warning, nothing attached. An uncovered pool: raises
    :class:`UncoveredAllocatorError` (the server refuses to start). Idempotent. Returns the
    names of the tables attached (or found attached).
    """
    mode = pd_mode(server_args)  # fail closed: an unknown mode raises
    if mode == "null":
        return []
    if not enabled():
        logger.warning("pdsafe: %s=0: KV pages carry no generation; a page freed under a "
                       "transfer (and reused by another request) is not detected, and the "
                       "request's release frees it a second time.", ENV_ENABLE)
        return []
    problems = uncovered(allocator, req_to_token_pool, server_args)
    if problems:
        covered = sorted(n.rpartition(".")[2] for n in COVERED_LEAVES | COVERED_COMPOSITES)
        raise UncoveredAllocatorError(
            f"pdsafe page generations: this PD {mode} server uses what they do not cover: "
            + "; ".join(problems) + ". A page freed and reused under a transfer could not be "
            "detected there. Covered: " + ", ".join(covered) + " (Mamba slots of "
            "HybridReqToTokenPool). Remedy: run this PD leg with a covered KV layout, or start "
            f"it with {ENV_ENABLE}=0 to run without this protection (unsafe; logged at "
            "startup).")
    parts = _parts(allocator)
    mamba = getattr(req_to_token_pool, "mamba_allocator", None)
    if mamba is not None:
        parts.append(_Part("mamba", mamba, False))
    names = []
    for part in parts:
        table = table_of(part.leaf)
        if table is None:
            table = GenerationTable(f"{part.role} pool ({_qualname(part.leaf).rpartition('.')[2]})",
                                    _num_pages(part.leaf), part.leaf.device)
            part.leaf.pdsafe_page_generations = table
        names.append(table.name)
        if all(t is not table for t in _PROCESS_TABLES):
            _PROCESS_TABLES.append(table)
    logger.info("pdsafe page generations attached (%s): %s", mode, ", ".join(names))
    return names


#: The tables :func:`install` attached in this process (one PD scheduler per process).
_PROCESS_TABLES: list[GenerationTable] = []


def process_epochs() -> tuple[int, ...]:
    """The current epochs of every generation table this process attached (empty when page
    generations are off or not installed). Host integers, no device read: every free moves
    them, and the ranks of a TP group, which free in lockstep, read the same ones
    (``transfer_generation`` derives a reservation's generation from them)."""
    if not enabled():
        return ()
    return tuple(t.epoch for t in _PROCESS_TABLES)


def installed(allocator: Any) -> bool:
    """Whether every leaf of ``allocator`` carries a table (False for anything uncovered)."""
    try:
        return all(table_of(p.leaf) is not None for p in _parts(allocator))
    except (UncoveredAllocatorError, AttributeError):
        return False


# =========================================================================== snapshots


@dataclass(frozen=True)
class _Taken:
    table: GenerationTable
    pages: torch.Tensor   # leaf page ids (table device)
    gens: torch.Tensor    # their generations when the snapshot was taken
    owner: torch.Tensor   # CPU: position in the snapshot's page list of each entry


@dataclass(frozen=True)
class Snapshot:
    """Generations of ``pages`` (the caller's page ids) and their SWA peers, when taken."""

    pages: torch.Tensor | None    # CPU int64, as given (None: taken on the device only)
    taken: tuple[_Taken, ...]


def _as_pages(page_indices: Any) -> torch.Tensor:
    if isinstance(page_indices, torch.Tensor):
        return page_indices.detach().reshape(-1).to("cpu", torch.int64)
    return torch.as_tensor(np.asarray(page_indices), dtype=torch.int64).reshape(-1)


def snapshot(allocator: Any, page_indices: Any) -> Snapshot:
    """The generations of ``page_indices`` (page ids of ``allocator``: of its full pool for
    an SWA allocator, whose SWA peers are included) now. ``allocator`` must be installed."""
    pages = _as_pages(page_indices)
    taken = []
    for part in _parts(allocator):
        table = table_of(part.leaf)
        if table is None:
            raise UncoveredAllocatorError(f"{_qualname(part.leaf)} carries no generation table "
                                          "(page generations not installed)")
        owner = torch.arange(pages.numel(), dtype=torch.int64)
        leaf_pages = pages
        if part.peer:
            ps = int(allocator.page_size)
            locs = allocator.translate_swa_indices_for_transfer(
                pages.to(table.gens.device) * ps).to("cpu", torch.int64)
            mapped = locs > 0  # 0: no SWA peer (outside the window), -1: none
            owner, leaf_pages = owner[mapped], locs[mapped] // ps
        dev_pages = leaf_pages.to(table.gens.device)
        taken.append(_Taken(table, dev_pages, table.current(dev_pages).clone(), owner))
    return Snapshot(pages, tuple(taken))


class BrokenTableError(RuntimeError):
    """A table that missed a free cannot prove that a page was not freed."""


def _moved_parts(snap: Snapshot) -> list[tuple[_Taken, torch.Tensor]]:
    """Per part, the mask (CPU) of entries whose generation moved since ``snap``; raises
    :class:`BrokenTableError` when a table missed a free (nothing is proven then)."""
    out = []
    for t in snap.taken:
        if t.table.broken:
            raise BrokenTableError(f"the generation table of {t.table.name} missed a free")
        if t.pages.numel() == 0:
            continue
        mask = (t.table.current(t.pages) != t.gens).to("cpu")
        if bool(mask.any()):
            out.append((t, mask))
    return out


def changed(allocator: Any, page_indices: Any, snap: Snapshot) -> list[int]:
    """The pages of ``page_indices`` whose generation moved since ``snap`` (sorted): a page
    counts when it or (SWA) its peer was freed at least once since the snapshot."""
    pages = _as_pages(page_indices)
    if snap.pages is None or not torch.equal(pages, snap.pages):
        raise ValueError(f"changed(): {pages.numel()} pages given, the snapshot holds "
                         f"{snap.pages.numel()} other ones")
    hit: set[int] = set()
    for t, mask in _moved_parts(snap):
        hit.update(int(i) for i in t.owner[mask].tolist())
    return sorted(int(pages[i]) for i in hit)


def _moved_detail(snap: Snapshot) -> list[tuple[GenerationTable, torch.Tensor]]:
    """Per table, the leaf pages that moved (the ones a release must not free again)."""
    return [(t.table, t.pages[mask.to(t.pages.device)]) for t, mask in _moved_parts(snap)]


def _describe(detail: list[tuple[GenerationTable, torch.Tensor]]) -> str:
    parts = []
    for table, pages in detail:
        ids = sorted(int(p) for p in pages.tolist())
        more = f" and {len(ids) - _SHOWN_PAGES} more" if len(ids) > _SHOWN_PAGES else ""
        parts.append(f"{table.name}: {len(ids)} page(s) {ids[:_SHOWN_PAGES]}{more}")
    return "; ".join(parts)


@contextlib.contextmanager
def _skipping(detail: list[tuple[GenerationTable, torch.Tensor]]) -> Iterator[None]:
    """While open, the tables in ``detail`` do not release their listed pages."""
    armed = []
    try:
        for table, pages in detail:
            if pages.numel():
                table.skip = pages if table.skip is None else torch.cat((table.skip, pages))
                armed.append(table)
    except Exception as e:  # noqa: BLE001 - never raise into upstream's release
        metrics.inc(FAILED)
        logger.error("pdsafe page generation: arming the release scope failed (%s: %s)",
                     type(e).__name__, e, exc_info=True)
    try:
        yield
    finally:
        for table in armed:
            table.skip = None


# =========================================================================== decode hooks


@dataclass
class Reservation:
    """What decode reserved for one transfer: its pages and Mamba slot, snapshotted."""

    room: Any
    rid: str
    kv: Snapshot
    mamba: Snapshot | None = None
    moved: list[tuple[GenerationTable, torch.Tensor]] = field(default_factory=list)


def _reservation(decode_req: Any) -> Reservation | None:
    res = getattr(decode_req, _RESERVATION_ATTR, None)
    return res if isinstance(res, Reservation) else None


def _mamba_snapshot(req_to_token_pool: Any, req: Any) -> Snapshot | None:
    mamba = getattr(req_to_token_pool, "mamba_allocator", None)
    if mamba is None or table_of(mamba) is None:
        return None
    slot = req_to_token_pool.req_index_to_mamba_index_mapping[req.kv.req_pool_idx]
    return snapshot(mamba, slot.reshape(-1))


@guarded("page_generation.note_decode_reservation", FAILED, default=None)
def note_decode_reservation(queue: Any, decode_req: Any, page_indices: Sequence[int],
                            page_size: int, destination: Any = None) -> None:
    """``DecodePreallocQueue._send_kv_metadata``, before the page indices go to prefill:
    snapshot the generations of the pages (and Mamba slot) this transfer writes.

    A failure here is counted and leaves no reservation; :func:`decode_commit_refusal` then
    refuses the transfer (nothing proves its pages)."""
    allocator = getattr(queue, "token_to_kv_pool_allocator", None)
    if not enabled() or not installed(allocator):
        return
    if getattr(destination, "value", destination) == "host":
        return  # the host pool is not covered; install() refuses host receive in PD
    if int(page_size) != int(allocator.page_size):
        raise ValueError(f"transfer page size {page_size} is not the allocator's "
                         f"{allocator.page_size}; the pages cannot be snapshotted")
    req = decode_req.req
    setattr(decode_req, _RESERVATION_ATTR, Reservation(
        room=req.bootstrap_room, rid=str(req.rid), kv=snapshot(allocator, page_indices),
        mamba=_mamba_snapshot(queue.req_to_token_pool, req)))


#: The refusal when the check itself failed: fail closed (the transfer is not committed).
CHECK_FAILED = ("pdsafe page generation: this decode could not check whether the pages of "
                "this transfer stayed reserved, and refused it. Retry; operators: see the "
                "server log (ERROR 'page_generation.decode_commit_refusal') and "
                f"{metrics.PREFIX}{FAILED}.")


@guarded("page_generation.decode_commit_refusal", FAILED, default=CHECK_FAILED)
def decode_commit_refusal(transfer_queue: Any, decode_req: Any) -> str | None:
    """``DecodeTransferQueue._commit_transfer_to_req``, before the coverage gate: None when
    every page (and the Mamba slot) this transfer reserved still has its generation, else
    the refusal message (the caller aborts the request with 500 and does not commit it).

    The ranks of a TP group free in lockstep, so they agree without an all-reduce (as for
    upstream's room check)."""
    allocator = getattr(transfer_queue.scheduler, "token_to_kv_pool_allocator", None)
    if not enabled() or not installed(allocator):
        return None
    res = _reservation(decode_req)
    req = decode_req.req
    if res is None:
        metrics.inc(FAILED)
        return (f"pdsafe page generation: KV transfer refused for request {req.rid} "
                f"(bootstrap_room={req.bootstrap_room}): decode recorded no page generations "
                "for its reservation, so nothing proves its pages stayed reserved; the "
                "request was not decoded. This is an sglang-pdsafe bug: please report it.")
    detail = _moved_detail(res.kv) + (_moved_detail(res.mamba) if res.mamba else [])
    if not detail:
        delattr(decode_req, _RESERVATION_ATTR)  # committed: nothing is held any more
        return None
    res.moved = detail
    metrics.inc(MOVED)
    msg = (f"pdsafe page generation: KV transfer refused for request {res.rid} "
           f"(bootstrap_room={res.room}): pages decode reserved for it were freed, and may "
           f"have been given to another request, while prefill was writing them ("
           f"{_describe(detail)}). The request was not decoded and does not free those pages "
           "again. This is a bug in the server's page lifecycle: please report it with this "
           "log.")
    logger.error(msg)
    return msg


def release_scope(transfer_queue: Any, decode_req: Any) -> contextlib.AbstractContextManager:
    """``DecodeTransferQueue._release_request``, around upstream's ``release_kv_cache``: pages
    of this transfer freed since the reservation (refused at commit, or found now on a failed
    transfer) are not freed again. Never raises into upstream."""
    try:
        res = _reservation(decode_req)
        if res is None or not enabled():
            return contextlib.nullcontext()
        detail = res.moved or (_moved_detail(res.kv)
                               + (_moved_detail(res.mamba) if res.mamba else []))
        delattr(decode_req, _RESERVATION_ATTR)
        if not detail:
            return contextlib.nullcontext()
        if not res.moved:  # a failed transfer: not refused at commit, but the pages moved
            metrics.inc(MOVED)
            logger.error("pdsafe page generation: request %s (bootstrap_room=%s) is released "
                         "after its transfer failed, and pages reserved for it were freed "
                         "meanwhile (%s); they are not freed again.", res.rid, res.room,
                         _describe(detail))
        return _skipping(detail)
    except Exception as e:  # noqa: BLE001 - never raise into upstream's release
        metrics.inc(FAILED)
        logger.error("pdsafe page generation: release scope failed (%s: %s); upstream "
                     "releases every page of the request.", type(e).__name__, e, exc_info=True)
        return contextlib.nullcontext()


# =========================================================================== prefill hooks


@dataclass
class SourceRecord:
    """The source pages a prefill sender was given, chunk by chunk, snapshotted."""

    sender_id: int
    snaps: list[Snapshot] = field(default_factory=list)
    moved: list[tuple[GenerationTable, torch.Tensor]] = field(default_factory=list)


def _source_record(req: Any) -> SourceRecord | None:
    record = getattr(req, _SOURCE_ATTR, None)
    return record if isinstance(record, SourceRecord) else None


@guarded("page_generation.note_source_chunk", FAILED, default=None)
def note_source_chunk(scheduler: Any, req: Any, start_idx: int, end_idx: int) -> None:
    """``_send_kv_chunk``, before the chunk's pages go to the transfer workers: snapshot the
    generations of the source pages of ``[start_idx, end_idx)`` (device-side gather: no
    device-to-host copy on the scheduling path)."""
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    if not enabled() or not installed(allocator) or end_idx <= start_idx:
        return
    ps = int(allocator.page_size)
    locs = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start_idx:end_idx]
    head = (ps - start_idx % ps) % ps  # tokens before the first page boundary in the range
    pages = locs[head::ps] // ps  # one token per page: no unique() (a device sync)
    if head:
        pages = torch.cat((locs[:1] // ps, pages))
    record = _source_record(req)
    sender_id = id(req.disagg_kv_sender)
    if record is None or record.sender_id != sender_id:  # a new sender starts a new record
        record = SourceRecord(sender_id)
        setattr(req, _SOURCE_ATTR, record)
    record.snaps.append(_snapshot_device(allocator, pages))


def _snapshot_device(allocator: Any, pages: torch.Tensor) -> Snapshot:
    """:func:`snapshot` for page ids already on the device (no copy to the CPU); SWA peers
    are not read here (prefill sends its SWA window as state, at the last chunk)."""
    part = _parts(allocator)[0]
    table = table_of(part.leaf)
    if table is None:
        raise UncoveredAllocatorError(f"{_qualname(part.leaf)} carries no generation table")
    dev_pages = table._index(pages.reshape(-1))
    owner = torch.arange(dev_pages.numel(), dtype=torch.int64)
    return Snapshot(None, (_Taken(table, dev_pages, table.current(dev_pages).clone(), owner),))


@guarded("page_generation.prefill_success_refusal", FAILED, default=None)
def prefill_success_refusal(scheduler: Any, req: Any) -> str | None:
    """``process_disagg_prefill_inflight_queue``, when the transfer polls Success: None when
    every source page sent still has its generation, else the refusal (the caller aborts the
    request with 500; :func:`source_release_scope` then neither caches nor frees the moved
    pages). A failure of this check is counted and lets upstream's Success stand: the
    decode's KV digest still checks the bytes."""
    record = _source_record(req)
    if record is None or not enabled():
        return None
    detail: list[tuple[GenerationTable, torch.Tensor]] = []
    for snap in record.snaps:
        detail += _moved_detail(snap)
    if not detail:
        return None
    record.moved = detail
    metrics.inc(SOURCE_MOVED)
    msg = (f"pdsafe page generation: request {req.rid} (bootstrap_room={req.bootstrap_room}) "
           f"failed: prefill source pages of its KV transfer were freed while the transfer "
           f"was reading them ({_describe(detail)}); the decode may have received another "
           "request's KV (its KV digest check refuses it if so). Those pages are neither "
           "cached nor freed again. This is a bug in the server's page lifecycle: please "
           "report it with this log.")
    logger.error(msg)
    return msg


def source_release_scope(req: Any) -> contextlib.AbstractContextManager:
    """Prefill's Success release (``release_kv_cache``): moved source pages are not inserted
    into the radix cache nor freed again; the record ends. Never raises into upstream."""
    try:
        record = _source_record(req)
        if record is None:
            return contextlib.nullcontext()
        delattr(req, _SOURCE_ATTR)
        if not record.moved:
            return contextlib.nullcontext()
        req.skip_radix_cache_insert = True  # the row holds pages that are not the request's
        return _skipping(record.moved)
    except Exception as e:  # noqa: BLE001 - never raise into upstream's release
        metrics.inc(FAILED)
        logger.error("pdsafe page generation: source release scope failed (%s: %s)",
                     type(e).__name__, e, exc_info=True)
        return contextlib.nullcontext()
