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
:func:`snapshot`, which records only the table's epoch at that moment (every generation was at
most that epoch then; no per-page copy: 4 bytes per page, the page ids): a page's generation
is above the snapshot's epoch **iff the page was freed at least once since** (and so possibly
reallocated to another request). :func:`changed` names those pages. Allocating never touches
a generation. Frees happen on the scheduler thread, like every other operation on upstream's
free lists (which are not thread safe either).

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
  request may hold it, or it waits in the free list). :func:`release_request` (decode's
  ``_release_request``) and :func:`release_source` (prefill's Success release) run upstream's
  release of the request with exactly those pages skipped (counted in
  ``page_generation_free_skipped_total``), and on prefill also skip the radix-cache insert.

State: what a transfer snapshotted lives in its :class:`~sglang.pdsafe.transfer.Transfer`
record (``record.pages``: a :class:`Reservation` on decode, a :class:`SourceRecord` on
prefill), nowhere else.

Failure policy (:mod:`sglang.pdsafe.policy`): a snapshot or check that cannot run refuses its
transfer at once (the room fails through upstream's own failure path; at commit and Success,
500); a release that cannot run **holds** the request's row for good (its pages are never
freed, rather than possibly freed twice; accounted to the server, counted in
``rows_held_for_good_total``); a free whose filtering fails frees none of its pages and poisons
the server (the table can no longer prove which pages a request owns).

Off: ``SGLANG_PDSAFE_PAGE_GENERATION=0`` (startup warning; nothing attached, upstream's bare
free lists). Not done here: the page generation itself does not travel on the wire (the
tables' epochs, :func:`process_epochs`, seed each reservation's transfer generation, which does:
:mod:`sglang.pdsafe.transfer_generation`), req-slot-indexed state (SWA ring, DSV4 request
state, request rows) carries none, and on a GPU the check reads one flag back per transfer (a
device sync).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from sglang.pdsafe import hook_api, metrics, policy, transfer
from sglang.pdsafe.policy import Outcome, hook, returns
from sglang.pdsafe.protections import Protection, off_by, pd_mode, register, switch_on
from sglang.pdsafe.transfer import State

logger = logging.getLogger("sglang.pdsafe.page_generation")

ENV_ENABLE = "SGLANG_PDSAFE_PAGE_GENERATION"
MOVED = "page_generation_moved_total"
SOURCE_MOVED = "page_generation_source_moved_total"
SKIPPED = "page_generation_free_skipped_total"
FAILED = "page_generation_failed_total"
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
hook_api.require(
    "sglang.srt.managers.schedule_batch.Req", "detach_kv()",
    why="a release that could not run holds the request's KV record and leaves the request "
        "an empty one, so no later upstream path frees the held pages")


def enabled() -> bool:
    """Default on; ``SGLANG_PDSAFE_PAGE_GENERATION=0`` leaves upstream's bare free lists."""
    return switch_on(ENV_ENABLE)


register(Protection(
    name="page-generation",
    guards="every KV page and Mamba slot of a PD server carries a generation that moves on "
           "each free; decode refuses (500) a transfer whose reserved pages were freed before "
           "commit, prefill one whose source pages were freed before Success, and neither "
           "frees such pages a second time",
    switched_off=off_by(ENV_ENABLE),
))


class UncoveredAllocatorError(RuntimeError):
    """A PD server's allocator is not covered by page generations (the server refuses to
    start)."""


policy.answers(UncoveredAllocatorError)


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

    def __init__(self, name: str, num_pages: int, device: Any, role: str = "kv") -> None:
        self.name = name
        self.role = role  # "kv"/"full", "swa" or "mamba": which pool a held page counts in
        self.epoch = 0
        self.loose_held = 0  # pages of a failed free kept out of the free list (accounted)
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
        release (all of them, unless a release scope skips some). Never raises into the free
        (:func:`stamp_free`, a hook whose failure frees none of the ids and poisons)."""
        return stamp_free(self, page_ids)

    def cleared(self, num_pages: int) -> None:
        """Upstream's ``clear()`` (also after a resize): every page is free again
        (:func:`stamp_clear`, a hook whose failure breaks the table and poisons)."""
        return stamp_clear(self, num_pages)

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
        """The generations of ``pages`` (int64 ids on the table's device) now.
        ``index_select``: about four times faster than advanced indexing on the CPU (a
        million-page check, issue 22), the same on a device."""
        return torch.index_select(self.gens, 0, pages)


def table_of(leaf: Any) -> GenerationTable | None:
    """The table attached to ``leaf`` (None: not attached)."""
    table = getattr(leaf, "pdsafe_page_generations", None)
    return table if isinstance(table, GenerationTable) else None


def _free_failed(failure: policy.Failure) -> tuple[torch.Tensor, ...]:
    """A free whose stamp or filtering failed: the table is broken (every later check on it
    refuses; the server is poisoned). The free goes on without the pages an open release
    scope skips (filtered again on the host); if even that fails, none of its pages is freed
    (kept out of the free list, counted), never one the request no longer owns."""
    table, page_ids = failure.args[0], failure.args[1]
    table.broken = True
    try:
        skip = set() if table.skip is None else {int(p) for p in table.skip.tolist()}
        return tuple(ids if not skip else ids[torch.tensor(
            [int(p) not in skip for p in ids.tolist()], dtype=torch.bool, device=ids.device)]
            for ids in page_ids)
    except Exception:  # noqa: BLE001 - a second failure: keep every page of this free
        with contextlib.suppress(Exception):
            table.loose_held += sum(int(ids.numel()) for ids in page_ids)
        logger.critical("pdsafe page generation: a free of %s could not be filtered; its "
                        "pages are kept out of the free list for good", table.name)
        return ()


@hook("page_generation.freed", outcome=Outcome.POISON, counter=FAILED,
      on_failure=_free_failed,
      effect="the server is poisoned and the table broken; the free goes on without the "
             "pages an open release scope skips (never a second free)")
def stamp_free(table: GenerationTable, page_ids: tuple[torch.Tensor, ...]
               ) -> tuple[torch.Tensor, ...]:
    """Stamp ``page_ids`` (one free call) with a new epoch of ``table``; returns the ids to
    release (without the ones an open release scope skips)."""
    table.epoch += 1
    if table.skip is not None:
        page_ids = tuple(table._without_skipped(ids) for ids in page_ids)
    gens_np = table._np
    for ids in page_ids:
        if gens_np is not None and ids.device.type == "cpu":
            gens_np[ids.numpy()] = table.epoch
        else:
            table.gens.index_fill_(0, table._index(ids), table.epoch)
    return page_ids


def _clear_failed(failure: policy.Failure) -> None:
    """A clear whose stamp failed: the table can no longer prove anything (broken: every
    later check on it refuses) and the server is poisoned; the clear itself is upstream's."""
    failure.args[0].broken = True


@hook("page_generation.cleared", outcome=Outcome.POISON, counter=FAILED,
      on_failure=_clear_failed,
      effect="the table is broken (every later transfer checked against it is refused) and "
             "the server poisoned; upstream's clear goes on")
def stamp_clear(table: GenerationTable, num_pages: int) -> None:
    """Stamp every page of ``table`` with a new epoch (upstream's ``clear()``, also after a
    resize)."""
    table.epoch += 1
    if num_pages > table.gens.numel():
        table._set(torch.zeros(int(num_pages), dtype=torch.int64, device=table.gens.device))
    table.gens.fill_(table.epoch)


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


@hook("page_generation.install", outcome=Outcome.POISON, counter=FAILED,
      on_failure=policy.reraise_at_startup, effect="the scheduler refuses to start")
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
                                    _num_pages(part.leaf), part.leaf.device, role=part.role)
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
    """One table's part of a snapshot. No per-page generations are copied: every page's
    generation was at most the table's epoch when the snapshot was taken (a free stamps the
    table's next epoch), so a page moved since iff its generation is above ``epoch`` now."""

    table: GenerationTable
    pages: torch.Tensor   # leaf page ids (table device)
    epoch: int            # the table's epoch when the snapshot was taken
    owner: torch.Tensor | None  # CPU: position in the snapshot's page list of each entry
    #                             (None: the identity, entry i is page i)


@dataclass(frozen=True)
class Snapshot:
    """Generations of ``pages`` (the caller's page ids) and their SWA peers, when taken."""

    pages: torch.Tensor | None    # CPU, as given (None: taken on the device only)
    taken: tuple[_Taken, ...]


_I32_MAX = (1 << 31) - 1


def _as_pages(page_indices: Any) -> torch.Tensor:
    """The page ids as a CPU tensor of the snapshot's own (never the caller's memory): int32
    when every id fits, as the page ids of any pool below 2**31 pages do (a snapshot keeps 4
    bytes per page: issue 22, 16 bytes per token at most at page size 1), else int64."""
    if isinstance(page_indices, torch.Tensor):
        arr = page_indices.detach().reshape(-1).cpu().numpy()
    else:
        arr = np.asarray(page_indices).reshape(-1)
    if arr.size == 0:
        return torch.zeros(0, dtype=torch.int32)
    fits = arr.dtype.kind in "iu" and int(arr.min()) >= 0 and int(arr.max()) <= _I32_MAX
    return torch.from_numpy(np.array(arr, dtype=np.int32 if fits else np.int64))


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
        owner: torch.Tensor | None = None
        leaf_pages = pages
        if part.peer:
            ps = int(allocator.page_size)
            locs = allocator.translate_swa_indices_for_transfer(
                pages.to(table.gens.device, torch.int64) * ps).to("cpu", torch.int64)
            mapped = locs > 0  # 0: no SWA peer (outside the window), -1: none
            owner = torch.arange(pages.numel(), dtype=torch.int64)[mapped]
            leaf_pages = locs[mapped] // ps
        taken.append(_Taken(table, leaf_pages.to(table.gens.device), table.epoch, owner))
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
        mask = (t.table.current(t.pages) > t.epoch).to("cpu")
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
        owners = mask.nonzero().reshape(-1) if t.owner is None else t.owner[mask]
        hit.update(int(i) for i in owners.tolist())
    return sorted(int(pages[i]) for i in hit)


def _moved_detail(snap: Snapshot) -> list[tuple[GenerationTable, torch.Tensor]]:
    """Per table, the leaf pages that moved (the ones a release must not free again)."""
    return [(t.table, t.pages[mask.to(t.pages.device)].to(torch.int64))
            for t, mask in _moved_parts(snap)]


def _describe(detail: list[tuple[GenerationTable, torch.Tensor]]) -> str:
    parts = []
    for table, pages in detail:
        ids = sorted(int(p) for p in pages.tolist())
        more = f" and {len(ids) - _SHOWN_PAGES} more" if len(ids) > _SHOWN_PAGES else ""
        parts.append(f"{table.name}: {len(ids)} page(s) {ids[:_SHOWN_PAGES]}{more}")
    return "; ".join(parts)


@contextlib.contextmanager
def _skipping(detail: list[tuple[GenerationTable, torch.Tensor]]) -> Iterator[None]:
    """While open, the tables in ``detail`` do not release their listed pages. Arming
    raises into the release hook (whose failure holds the whole row), never frees."""
    armed = []
    try:
        for table, pages in detail:
            if pages.numel():
                table.skip = pages if table.skip is None else torch.cat((table.skip, pages))
                armed.append(table)
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
    page_size: int = 1  # tokens per page id of ``kv``


def _record(req: Any) -> transfer.Transfer | None:
    return transfer.of(req)


def _mamba_snapshot(req_to_token_pool: Any, req: Any) -> Snapshot | None:
    mamba = getattr(req_to_token_pool, "mamba_allocator", None)
    if mamba is None or table_of(mamba) is None:
        return None
    slot = req_to_token_pool.req_index_to_mamba_index_mapping[req.kv.req_pool_idx]
    return snapshot(mamba, slot.reshape(-1))


def _room_key(*args: Any, **_: Any) -> Any:
    """Failure key: the bootstrap room of the request the hook is about."""
    for a in args:
        req = getattr(a, "req", a)
        room = getattr(req, "bootstrap_room", None)
        if room is not None:
            return ("room", room, str(getattr(req, "rid", "")))
    return None


def _fail_decode_room(failure: policy.Failure) -> None:
    """Refuse the transfer now: its room fails through upstream's path (its prefill told)."""
    decode_req = failure.args[1]
    refusal = failure.refusal(500, "the KV transfer (its reserved pages could not be "
                                   "snapshotted)")
    receiver = getattr(decode_req, "kv_receiver", None)
    transfer.fail_room(getattr(receiver, "kv_mgr", None), decode_req.req.bootstrap_room,
                       refusal)


@hook("page_generation.note_decode_reservation", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_fail_decode_room, key=_room_key,
      effect="the room fails at once (500, the prefill told); commit would refuse it too")
def note_decode_reservation(queue: Any, decode_req: Any, page_indices: Sequence[int],
                            page_size: int, destination: Any = None) -> None:
    """``DecodePreallocQueue._send_kv_metadata``, before the page indices go to prefill:
    snapshot the generations of the pages (and Mamba slot) this transfer writes, into its
    record."""
    allocator = getattr(queue, "token_to_kv_pool_allocator", None)
    if not enabled() or not installed(allocator):
        return
    if getattr(destination, "value", destination) == "host":
        return  # the host pool is not covered; install() refuses host receive in PD
    if int(page_size) != int(allocator.page_size):
        raise ValueError(f"transfer page size {page_size} is not the allocator's "
                         f"{allocator.page_size}; the pages cannot be snapshotted")
    req = decode_req.req
    rec = transfer.open_for(decode_req.kv_receiver.kv_mgr, req)
    rec.pages = Reservation(room=req.bootstrap_room, rid=str(req.rid),
                            kv=snapshot(allocator, page_indices),
                            mamba=_mamba_snapshot(queue.req_to_token_pool, req),
                            page_size=int(page_size))


#: The refusal when the check itself failed: fail closed (the transfer is not committed).
CHECK_FAILED = ("pdsafe page generation: this decode could not check whether the pages of "
                "this transfer stayed reserved, and refused it. Retry; operators: see the "
                "server log (ERROR 'page_generation.decode_commit_refusal') and "
                f"{metrics.PREFIX}{FAILED}.")


@hook("page_generation.decode_commit_refusal", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=returns(CHECK_FAILED), key=_room_key,
      effect="500 at commit; the request is not decoded")
def decode_commit_refusal(transfer_queue: Any, decode_req: Any) -> str | None:
    """``DecodeTransferQueue._commit_transfer_to_req``, before the coverage gate: None when
    every page (and the Mamba slot) this transfer reserved still has its generation, else
    the refusal message (the caller aborts the request with 500 and does not commit it).

    The ranks of a TP group free in lockstep, so they agree without an all-reduce (as for
    upstream's room check)."""
    req = decode_req.req
    rec = _record(req)
    if rec is not None and rec.state is State.SENT:
        rec.advance(State.WRITTEN)  # the backend reported the transfer done
    allocator = getattr(transfer_queue.scheduler, "token_to_kv_pool_allocator", None)
    if not enabled() or not installed(allocator):
        return None
    res = rec.pages if rec is not None and isinstance(rec.pages, Reservation) else None
    if res is None:
        metrics.inc(FAILED)
        return (f"pdsafe page generation: KV transfer refused for request {req.rid} "
                f"(bootstrap_room={req.bootstrap_room}): decode recorded no page generations "
                "for its reservation, so nothing proves its pages stayed reserved; the "
                "request was not decoded. This is an sglang-pdsafe bug: please report it.")
    detail = _moved_detail(res.kv) + (_moved_detail(res.mamba) if res.mamba else [])
    if not detail:
        rec.pages = None  # committed: nothing is held any more
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


def _still_owned(kv: Any, res: Reservation | None) -> tuple[Any, torch.Tensor | None]:
    """What a held row still owns: the accounting copy of ``kv`` less the KV pages (and the
    Mamba slot) that moved since the reservation (freed under the transfer: free now, or
    another request's), so upstream's idle memory check counts each page once; and the page
    ids it keeps when some moved (None: all of the row's). Raises when they cannot be read
    (a broken table)."""
    if res is None:
        return kv, None
    snaps = [res.kv] + ([res.mamba] if res.mamba is not None else [])
    moved = [(t, mask) for snap in snaps for t, mask in _moved_parts(snap)]
    kv_moved = [(t, mask) for t, mask in moved if t.table.role in ("kv", "full")]
    mamba_moved = any(t.table.role == "mamba" for t, _ in moved)
    if not kv_moved and not mamba_moved:
        return kv, None
    n = sum(int(mask.sum()) for _, mask in kv_moved)
    changes: dict[str, Any] = {"kv_allocated_len": max(
        kv.cache_protected_len, kv.kv_allocated_len - n * res.page_size)}
    if mamba_moved:
        changes["mamba_pool_idx"] = None
    kept = None
    if len(kv_moved) == 1 and kv_moved[0][0].owner is None and res.kv.pages is not None:
        kept = res.kv.pages[~kv_moved[0][1]].to(torch.int64)
    return dataclasses.replace(kv, **changes), kept


def _hold_row(failure: policy.Failure) -> None:
    """A release that could not run: the request's row (pages, request slot) is held for
    good instead of released with pages it may no longer own (a possible double free);
    accounted to the server, counted.

    The row is detached from the request (upstream's ``Req.detach_kv``, which leaves it an
    empty record): no later upstream path can free the held pages behind the hold. Pages the
    reservation's snapshot shows moved (freed under the transfer) are not the row's: they are
    left out of the held row's accounting, so upstream's idle memory check (strict by default:
    a mismatch kills the scheduler) counts each page once. When not even that can be read,
    the whole row is held and the server is poisoned: its accounting cannot be trusted."""
    req = getattr(failure.args[0], "req", failure.args[0])
    rec = transfer.of(req)
    res = rec.pages if rec is not None and isinstance(rec.pages, Reservation) else None
    if rec is not None:
        rec.pages = None
        if rec.is_open:
            rec.refuse()
        if rec.state in (State.REFUSED, State.HELD):
            rec.advance(State.LEAKED, why=f"the {failure.spec.name} hook failed")
    kv = req.detach_kv()
    try:
        held, pages = _still_owned(kv, res)
    except Exception as e:  # noqa: BLE001 - the hold stands; the accounting is unknown
        held, pages = kv, None
        policy.poison(f"request {getattr(req, 'rid', '?')} is held after its release failed, "
                      f"and which of its pages moved cannot be read ({type(e).__name__}: {e}); "
                      "this server's page accounting can no longer be trusted",
                      by=failure.spec.name)
    transfer.hold_row(held, pages)
    metrics.inc("rows_held_for_good_total")
    logger.error("pdsafe page generation: request %s (bootstrap_room=%s) keeps its KV row "
                 "for good: its release could not check which pages are still its own, and a "
                 "page freed twice would hand another request's KV around. Restart the server "
                 "to reclaim it.", getattr(req, "rid", "?"), getattr(req, "bootstrap_room", "?"))


@hook("page_generation.release_request", outcome=Outcome.HOLD, counter=FAILED,
      on_failure=_hold_row, key=_room_key,
      effect="upstream's release does not run: the request's row is held for good "
             "(accounted), never freed twice")
def release_request(decode_req: Any, release: Any) -> None:
    """``DecodeTransferQueue._release_request``: run upstream's ``release()`` of the request
    with the pages of this transfer freed since the reservation (refused at commit, or found
    now on a failed transfer) skipped: they are not the request's any more."""
    req = decode_req.req
    rec = _record(req)
    res = rec.pages if rec is not None and isinstance(rec.pages, Reservation) else None
    detail: list[tuple[GenerationTable, torch.Tensor]] = []
    if res is not None and enabled():
        detail = res.moved or (_moved_detail(res.kv)
                               + (_moved_detail(res.mamba) if res.mamba else []))
        rec.pages = None
        if detail and not res.moved:  # a failed transfer: not refused at commit, pages moved
            metrics.inc(MOVED)
            logger.error("pdsafe page generation: request %s (bootstrap_room=%s) is released "
                         "after its transfer failed, and pages reserved for it were freed "
                         "meanwhile (%s); they are not freed again.", res.rid, res.room,
                         _describe(detail))
    with _skipping(detail):
        _upstream(release)
    if rec is not None:  # a transfer released without being decoded ends here
        if rec.is_open:
            rec.refuse()
        if rec.state is State.REFUSED:
            rec.advance(State.RELEASED, why="released by upstream after its refusal")


def _upstream(release: Any) -> None:
    """Run upstream's release; its own exception is upstream's, not this hook's failure."""
    try:
        policy.run_upstream(release)  # upstream's work: not charged to the hook's cost
    except Exception as e:  # noqa: BLE001 - handed back to upstream unchanged
        raise policy.UpstreamRaised(e) from e


# =========================================================================== prefill hooks


@dataclass
class SourceRecord:
    """The source pages a prefill sender was given, chunk by chunk, snapshotted."""

    sender_id: int
    snaps: list[Snapshot] = field(default_factory=list)
    moved: list[tuple[GenerationTable, torch.Tensor]] = field(default_factory=list)


def _fail_prefill_room(failure: policy.Failure) -> None:
    """Refuse the transfer now: the prefill room fails (the decode told Failed)."""
    req = failure.args[1]
    refusal = failure.refusal(500, "the KV transfer (its source pages could not be "
                                   "snapshotted)")
    sender = getattr(req, "disagg_kv_sender", None)
    transfer.fail_room(getattr(sender, "kv_mgr", None), getattr(req, "bootstrap_room", None),
                       refusal)


@hook("page_generation.note_source_chunk", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_fail_prefill_room, key=_room_key,
      effect="the room fails at once (500; the decode told Failed)")
def note_source_chunk(scheduler: Any, req: Any, start_idx: int, end_idx: int) -> None:
    """``_send_kv_chunk``, before the chunk's pages go to the transfer workers: snapshot the
    generations of the source pages of ``[start_idx, end_idx)`` (device-side gather: no
    device-to-host copy on the scheduling path), into the request's record."""
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    if not enabled() or not installed(allocator) or end_idx <= start_idx:
        return
    ps = int(allocator.page_size)
    locs = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start_idx:end_idx]
    head = (ps - start_idx % ps) % ps  # tokens before the first page boundary in the range
    pages = locs[head::ps]  # one token per page: no unique() (a device sync)
    # Page 1: the slots are the pages (no division of a million ids), copied: the snapshot
    # must not see the request row, which the next request of its slot rewrites.
    pages = pages // ps if ps > 1 else pages.clone()
    if head:
        pages = torch.cat((locs[:1] // ps, pages))
    sender = req.disagg_kv_sender
    rec = transfer.open_for(sender.kv_mgr, req)
    record = rec.pages if isinstance(rec.pages, SourceRecord) else None
    if record is None or record.sender_id != id(sender):  # a new sender starts a new record
        record = rec.pages = SourceRecord(id(sender))
    record.snaps.append(_snapshot_device(allocator, pages))
    rec.reach(State.SENT)


def _snapshot_device(allocator: Any, pages: torch.Tensor) -> Snapshot:
    """:func:`snapshot` for page ids already on the device (no copy to the CPU); SWA peers
    are not read here (prefill sends its SWA window as state, at the last chunk)."""
    part = _parts(allocator)[0]
    table = table_of(part.leaf)
    if table is None:
        raise UncoveredAllocatorError(f"{_qualname(part.leaf)} carries no generation table")
    ids = pages.reshape(-1)  # int32 as upstream's rows hold them: 4 bytes per page kept
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.to(torch.int64)
    return Snapshot(None, (_Taken(table, ids.to(table.gens.device), table.epoch, None),))


#: The refusal when the Success check itself failed (fail closed: the request fails).
SOURCE_CHECK_FAILED = ("pdsafe page generation: this prefill could not check whether the "
                       "source pages of this transfer stayed its own while they were read, "
                       "and failed the request. Retry; operators: see the server log (ERROR "
                       "'page_generation.prefill_success_refusal') and "
                       f"{metrics.PREFIX}{FAILED}.")


@hook("page_generation.prefill_success_refusal", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=returns(SOURCE_CHECK_FAILED), key=_room_key,
      effect="500 at Success: the request fails (the decode's digest checks the bytes too)")
def prefill_success_refusal(scheduler: Any, req: Any) -> str | None:
    """``process_disagg_prefill_inflight_queue``, when the transfer polls Success: None when
    every source page sent still has its generation, else the refusal (the caller aborts the
    request with 500; :func:`release_source` then neither caches nor frees the moved
    pages)."""
    rec = _record(req)
    if rec is not None and rec.state is State.SENT:
        rec.advance(State.WRITTEN)
    record = rec.pages if rec is not None and isinstance(rec.pages, SourceRecord) else None
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


@hook("page_generation.release_source", outcome=Outcome.HOLD, counter=FAILED,
      on_failure=_hold_row, key=_room_key,
      effect="upstream's release does not run: the request's row is held for good "
             "(accounted), never freed twice")
def release_source(req: Any, release: Any) -> None:
    """Prefill's Success release (``release_kv_cache``): run upstream's ``release()`` with
    moved source pages neither inserted into the radix cache nor freed again; the record's
    source snapshots end (COMMITTED when the Success stood)."""
    rec = _record(req)
    record = rec.pages if rec is not None and isinstance(rec.pages, SourceRecord) else None
    if record is None:
        _upstream(release)
        return
    rec.pages = None
    if not record.moved:
        _upstream(release)
        if rec.state is State.WRITTEN:
            rec.advance(State.COMMITTED)
        return
    req.skip_radix_cache_insert = True  # the row holds pages that are not the request's
    rec.refuse()
    with _skipping(record.moved):
        _upstream(release)
    rec.advance(State.RELEASED, why="Success refused; its moved pages skipped")
