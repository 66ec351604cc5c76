"""Test-only fault injection, an sglang plugin; proves that the content oracle sees foreign KV.

This module is part of the test-only distribution ``sglang-pdsafe-testkit`` (``test/testkit``),
never of the product wheel. sglang's plugin loader (``sglang.srt.plugins.load_plugins``, which
runs early in every server process, the scheduler included) calls :func:`register` through the
entry point ``pdsafe_test_faults`` in the group ``sglang.srt.plugins``. ``SGLANG_PLUGINS``, when
set, is sglang's whitelist: the plugin then loads only if that list names ``pdsafe_test_faults``.

Armed only by the environment variable ``SGLANG_PDSAFE_TEST_FAULTS`` (never by a request or a
server flag); the value is comma-separated ``name[:arg]`` items, each one fault. Unarmed,
:func:`register` installs nothing. Armed, it registers the named faults' hooks with
``sglang.srt.plugins.hook_registry.HookRegistry``. Even armed, a fault only touches requests
whose rid (``foreign_kv``) or bootstrap room (``late_write``) is reserved for it, so an armed
test server still serves every other request normally; the one exception is ``wire_version``,
which makes the whole server speak as another release (see below).

``foreign_kv`` hooks (``BEFORE``) the product's decode commit gate,
``sglang.pdsafe.commit_gate.admit_commit(transfer_queue, decode_req)``, so the fault acts right
before the coverage check; the patched scheduler calls the gate through the module attribute,
so it sees the hooked function.

``SGLANG_PDSAFE_TEST_FAULTS=foreign_kv:N`` (N defaults to 16)
    At decode commit, a request whose rid starts with ``pdsafe-fault-source-`` has the KV of
    its last N prompt positions copied aside; a later request whose rid starts with
    ``pdsafe-fault-inject-`` gets that foreign KV written over its own last N prompt positions
    before it decodes: exactly the effect of a transfer that left N positions holding another
    request's KV.

    A request whose rid starts with ``pdsafe-fault-postcheck-`` gets the same foreign KV
    *after* decode's KV digest check passed, right before its first decode step (a ``BEFORE``
    hook of upstream's ``ScheduleBatchDisaggregationDecodeMixin.process_prebuilt``, which
    decode calls after the check, with or without the digest patch): KV that changes after
    the check, which the digest cannot see by design. The oracle's self-test uses it, so that
    the oracle is shown to see foreign content in every tree, while the digest refuses the
    ``pdsafe-fault-inject-`` case.

``SGLANG_PDSAFE_TEST_FAULTS=kv_corrupt`` (a decode-side fault, issue 10's corruption family)
    When a new decode batch is checked (a ``BEFORE`` hook of upstream's
    ``SchedulerDisaggregationDecodeMixin._verify_kv_checksums``, which stock 0.5.23 and the
    fork both call after the transfer and before the batch's first decode step; stock's returns
    at once, the fork's verifies the KV digest), a request whose rid starts with
    ``pdsafe-fault-corrupt-MODE-`` has the bytes prefill wrote into its pages changed:
    ``bit`` one bit of one byte (layer, K or V, owned position, byte and bit drawn from the
    rid), ``lastpage`` one bit in the last owned position (the partial last page's slot),
    ``page`` every byte of one page of owned positions of one layer's K changed (xor 0x5A,
    or set to 0x5A where all are zero), ``layer`` one exponent bit of the first element of
    every owned position of one layer's V flipped. For the
    digest it is the same as bytes changed in flight: decode's pages differ from what prefill
    digested. Each corruption is logged (``TEST FAULT kv_corrupt``) with what it changed.

``SGLANG_PDSAFE_TEST_FAULTS=late_write:SECONDS`` (a prefill-side fault)
    The prefill transfer worker's KV write (Mooncake ``MooncakeKVManager.send_kvcache`` /
    ``send_kvcache_slice``, NIXL ``NixlKVManager.send_kvcache`` / ``send_kvcache_slice`` /
    ``send_kvcache_mixed``: each called after the worker's "room failed or aborted" check, so a
    held write is already past that check) gets an ``AROUND`` hook. A chunk whose bootstrap
    room lies in ``[LATE_ROOM_BASE, LATE_ROOM_BASE + ROOM_RANGE_WIDTH)`` is held SECONDS before
    the original write runs, with a WARNING before and after: exactly a slow transfer that is
    still writing decode's pages after decode aborted the request (the worker's drain
    accounting counts the held chunk, so the prefill's ABORT_ACK follows the write). A chunk
    whose room lies in ``[TRACE_ROOM_BASE, TRACE_ROOM_BASE + ROOM_RANGE_WIDTH)`` is written
    at once; only its destination pages are logged (tests check page reuse with them). Every
    other room is untouched. The room is the ``kv_chunk`` the calling ``transfer_worker``
    frame is processing (the write functions do not take it as an argument).

``SGLANG_PDSAFE_TEST_FAULTS=park_commit:SECONDS`` (a decode-side fault, the abort family)
    Each scheduler step, the decode's transfer queue polls its requests
    (``DecodeTransferQueue._poll_with_metadata_gate``, or ``_poll_with_staging`` with the
    staging buffer; ``pop_transferred`` commits the requests whose poll is Success). An
    ``AROUND`` hook of both turns the Success of a request whose rid starts with
    ``pdsafe-fault-park-`` into Transferring for SECONDS from the first Success it saw: the
    transfer is complete (prefill wrote every page and reported it), the commit waits; the
    scheduler thread never sleeps, every other request is served as usual. Upstream's own
    metadata gate holds a finished transfer the same way while its aux row has not landed.
    Any other poll of a parked request (Failed once it is aborted) passes at once and ends
    the park. Logged: ``parked``, ``released`` (the Success passed on, decode commits now)
    and ``left`` (the park ended with another state, never committed), read back by
    :func:`parse_park_log`. The poll list is rank-local after the ranks' all-reduce, so the
    fault is meant for single-rank decodes (the harness's).

``SGLANG_PDSAFE_TEST_FAULTS=wire_version:VERSION`` (either role: a fork of another release)
    When the plugin loads (early in every server process, before the scheduler builds its KV
    manager), ``sglang.pdsafe.pair_settings.WIRE_VERSION`` is set to VERSION in that process,
    so the server speaks as an sglang-pdsafe release of that wire version everywhere the fork
    reads its own version (each reader looks it up at call time): the pair settings a prefill
    publishes and a decode compares (``pair_agreement.local_settings`` / ``published`` /
    ``compare``), the version a decode announces and the prefills it announces to, and the
    version a prefill requires of a decode (``peer_capability``), and the prefills a decode
    sends the transfer generation to (``transfer_generation.metadata_frames``). VERSION must
    be ``sglang-pdsafe-pair/N`` (N a positive integer) and not this release's own version
    (that would pretend nothing); anything else is a ``ValueError``. Logged once per process
    (``TEST FAULT ARMED``). No hook is registered: only the version changes, so the pair is
    refused exactly as by a real fork of another release (``test/pd/test_mixed_versions.py``).

``SGLANG_PDSAFE_TEST_FAULTS=stale_status`` (a prefill-side fault, issue 9's generations)
    Every decode metadata message passes the prefill's ``pdsafe_refuses_decode`` (patch 0022)
    before the prefill stores it; an ``AFTER`` hook of it, for a bootstrap room in
    ``[STALE_ROOM_BASE, STALE_ROOM_BASE + ROOM_RANGE_WIDTH)`` whose metadata the prefill keeps,
    first sends that decode endpoint (on the prefill's own status channel, in the backend's
    own status format) what an earlier transfer of the same room could still have in flight:
    ``Failed`` without a transfer generation, ``Failed`` and ``Success`` with another generation
    (``STALE_GENERATION_FRAME``). Then the real transfer runs. Logged (``STALE_LOG``) with the
    room and the messages sent. Every other room is untouched.

``SGLANG_PDSAFE_TEST_FAULTS=hook_fail`` (either role: every pdsafe hook, runtime-controlled)
    Every hook's body (``policy.HookSpec.body``, what its guard calls) gets a shim that makes
    it raise, at its entry or after its body ran, while the control file named by
    ``SGLANG_PDSAFE_TEST_FAULT_CONTROL`` arms it; the process reports calls, injections, its
    poison and (schedulers) an allocator audit next to that file. Unarmed, every hook behaves
    as without the plugin. See :mod:`pdsafe_testkit.hook_fail` and
    ``test/pd/test_hook_failures.py``.

``SGLANG_PDSAFE_TEST_FAULTS=free_reserved`` (a decode-side fault: pages freed under a transfer)
    Right before decode's page-generation commit check (a ``BEFORE`` hook of
    ``sglang.pdsafe.page_generation.decode_commit_refusal``, which the patched transfer queue
    calls through the module attribute), a request whose rid starts with
    ``pdsafe-fault-freereserved-`` has the second page of its reservation freed to the
    allocator: exactly an upstream page-lifecycle bug that frees a page while prefill writes
    it. The page's generation moves, so the commit is refused and the release must not free
    that page again. Logged (``TEST FAULT free_reserved``) with the freed token slots.

Only public sglang API is used: the scheduler's ``req_to_token_pool.req_to_token`` table, the
KV pool's ``get_key_buffer``/``get_value_buffer``/``start_layer``/``layer_num``, and the
``HookRegistry`` of the plugin framework; ``late_write`` also reads the calling
``transfer_worker`` frame's ``kv_chunk`` (its room) and the manager's ``request_status`` (logged).
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

logger = logging.getLogger(__name__)

ENV = "SGLANG_PDSAFE_TEST_FAULTS"
PLUGIN_NAME = "pdsafe_test_faults"
SOURCE_PREFIX = "pdsafe-fault-source-"
INJECT_PREFIX = "pdsafe-fault-inject-"
#: Foreign KV written after decode's KV digest check passed (see the module doc).
POSTCHECK_PREFIX = "pdsafe-fault-postcheck-"
#: ``kv_corrupt``: rids ``pdsafe-fault-corrupt-MODE-...`` get their transferred KV changed.
CORRUPT_PREFIX = "pdsafe-fault-corrupt-"
CORRUPT_MODES = ("bit", "lastpage", "page", "layer")
#: Upstream's check of a new decode batch (``kv_corrupt`` changes KV right before it).
CORRUPT_TARGET = ("sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin."
                  "_verify_kv_checksums")
#: Log line of an applied ``kv_corrupt`` change.
CORRUPT_LOG = "TEST FAULT kv_corrupt"
#: The product's decode commit gate (stable name and signature; see commit_gate.py).
TARGET = "sglang.pdsafe.commit_gate.admit_commit"
#: Upstream's first step of a new decode batch, after the KV digest check
#: (``POSTCHECK_PREFIX`` writes right before it).
POSTCHECK_TARGET = ("sglang.srt.disaggregation.decode_schedule_batch_mixin."
                    "ScheduleBatchDisaggregationDecodeMixin.process_prebuilt")
DEFAULT_FOREIGN_KV = 16
#: Fault names ``SGLANG_PDSAFE_TEST_FAULTS`` may name (anything else is refused).
KNOWN_FAULTS = ("foreign_kv", "late_write", "kv_corrupt", "park_commit", "wire_version",
                "stale_status", "hook_fail", "free_reserved")
#: ``free_reserved``: rids ``pdsafe-fault-freereserved-...`` lose a reserved page before commit.
FREE_RESERVED_PREFIX = "pdsafe-fault-freereserved-"
#: The product's page-generation commit check (``free_reserved`` frees a page right before it).
FREE_RESERVED_TARGET = "sglang.pdsafe.page_generation.decode_commit_refusal"
#: Log line of a page ``free_reserved`` freed.
FREE_RESERVED_LOG = "TEST FAULT free_reserved"

#: Bootstrap rooms whose KV writes ``late_write`` holds back (tests pick rooms from here).
LATE_ROOM_BASE = 0x1A7E << 48
#: Bootstrap rooms whose KV writes ``late_write`` only logs (destination pages), never delays.
TRACE_ROOM_BASE = LATE_ROOM_BASE + (1 << 20)
#: Width of each reserved room range.
ROOM_RANGE_WIDTH = 1 << 20
#: The prefill transfer worker's KV write functions ``late_write`` hooks, per backend: each is
#: called by ``transfer_worker`` after its "room failed or aborted" check.
LATE_WRITE_TARGETS = {
    "mooncake": tuple(
        f"sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.{fn}"
        for fn in ("send_kvcache", "send_kvcache_slice")
    ),
    "nixl": tuple(
        f"sglang.srt.disaggregation.nixl.conn.NixlKVManager.{fn}"
        for fn in ("send_kvcache", "send_kvcache_slice", "send_kvcache_mixed")
    ),
}
#: Log line of a held write (``held``), of its late landing (``writing``, ``done``) and of a
#: traced write (``traced``); :func:`parse_late_write_log` reads them back.
LATE_WRITE_LOG = "TEST FAULT late_write"
#: ``park_commit``: rids ``pdsafe-fault-park-...`` wait between their transfer's Success and
#: decode's commit.
PARK_PREFIX = "pdsafe-fault-park-"
#: The decode transfer queue's poll functions ``park_commit`` hooks (``pop_transferred`` calls
#: one of them each step and commits the requests whose poll is Success).
PARK_TARGETS = tuple(
    f"sglang.srt.disaggregation.decode.DecodeTransferQueue.{fn}"
    for fn in ("_poll_with_metadata_gate", "_poll_with_staging")
)
#: Log line of a parked request (``parked``, ``released``, ``left``).
PARK_LOG = "TEST FAULT park_commit"
#: ``wire_version``: the module attribute every reader of the fork's own wire version reads.
WIRE_VERSION_TARGET = "sglang.pdsafe.pair_settings.WIRE_VERSION"
#: What ``wire_version:VERSION`` accepts: a pdsafe PD wire version, ``sglang-pdsafe-pair/N``.
WIRE_VERSION_RE = re.compile(r"sglang-pdsafe-pair/[1-9][0-9]*")


def parse_spec(spec: str) -> dict[str, str]:
    """``SGLANG_PDSAFE_TEST_FAULTS``'s comma-separated ``name[:arg]`` items as ``{name: arg}``.

    An unknown name or a name given twice raises ``ValueError`` (an armed test must not
    silently run unarmed, nor with a fault it did not ask for). Empty items are ignored.
    """
    out: dict[str, str] = {}
    for item in spec.split(","):
        name, _, arg = item.strip().partition(":")
        name = name.strip()
        if not name:
            continue
        if name not in KNOWN_FAULTS:
            raise ValueError(f"{ENV}: unknown test fault {name!r} (known: {KNOWN_FAULTS})")
        if name in out:
            raise ValueError(f"{ENV}: test fault {name!r} named twice")
        out[name] = arg.strip()
    return out


def parse_foreign_kv(spec: str) -> int:
    """Number of positions the ``foreign_kv`` fault overwrites in ``spec`` (0: not armed).

    ``spec`` is the value of ``SGLANG_PDSAFE_TEST_FAULTS``: comma-separated ``name[:arg]`` items.
    A malformed count raises ``ValueError`` (an armed test must not silently run unarmed).
    """
    faults = parse_spec(spec)
    if "foreign_kv" not in faults:
        return 0
    arg = faults["foreign_kv"]
    n = int(arg or DEFAULT_FOREIGN_KV)
    if n <= 0:
        raise ValueError(f"{ENV}: foreign_kv needs a positive count, got {arg!r}")
    return n


def _parse_seconds(spec: str, name: str, example: str) -> float:
    """Seconds of the fault ``name`` in ``spec`` (0.0: not armed): required, finite and
    positive; anything else raises ``ValueError`` naming ``example``."""
    faults = parse_spec(spec)
    if name not in faults:
        return 0.0
    arg = faults[name]
    try:
        seconds = float(arg)
    except ValueError:
        raise ValueError(f"{ENV}: {name} needs seconds, e.g. {example}, got {arg!r}") \
            from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{ENV}: {name} needs a positive finite delay, got {arg!r}")
    return seconds


def parse_late_write(spec: str) -> float:
    """Seconds the ``late_write`` fault holds a write in ``spec`` (0.0: not armed)."""
    return _parse_seconds(spec, "late_write", "late_write:6")


def parse_park_commit(spec: str) -> float:
    """Seconds the ``park_commit`` fault parks a finished transfer in ``spec`` (0.0: not armed)."""
    return _parse_seconds(spec, "park_commit", "park_commit:3")


def parse_wire_version(spec: str) -> str:
    """The wire version the ``wire_version`` fault makes the server speak in ``spec`` ("": not
    armed). VERSION is required, must match ``sglang-pdsafe-pair/N`` (N a positive integer,
    no leading zero) and must differ from this release's own (else the fault would pretend
    nothing); anything else raises ``ValueError``."""
    faults = parse_spec(spec)
    if "wire_version" not in faults:
        return ""
    arg = faults["wire_version"]
    if not WIRE_VERSION_RE.fullmatch(arg):
        raise ValueError(f"{ENV}: wire_version needs a pdsafe wire version "
                         f"sglang-pdsafe-pair/N, e.g. wire_version:sglang-pdsafe-pair/2, "
                         f"got {arg!r}")
    from sglang.pdsafe import pair_settings

    if arg == pair_settings.WIRE_VERSION:
        raise ValueError(f"{ENV}: wire_version:{arg} is this release's own wire version; "
                         f"name another release's (the fault would pretend nothing)")
    return arg


@dataclass
class ForeignKV:
    """The armed ``foreign_kv`` fault: N positions, and the KV captured from the last source.

    Invariant: only requests whose rid starts with ``SOURCE_PREFIX`` (capture) or
    ``INJECT_PREFIX`` (overwrite) are touched; every other request passes unchanged.
    """

    n: int
    snapshot: list[tuple[Any, Any]] | None = field(default=None, repr=False)

    def before_commit(self, transfer_queue: Any, decode_req: Any) -> None:
        """BEFORE hook of ``admit_commit``: apply the fault, keep the gate's arguments."""
        self.on_decode_commit(transfer_queue.scheduler, decode_req.req)

    def before_prebuilt(self, batch: Any, *args: Any, **kwargs: Any) -> None:
        """BEFORE hook of ``process_prebuilt``: write the foreign KV into the batch's requests
        with ``POSTCHECK_PREFIX`` (they passed every check; the next step decodes them)."""
        pools = None
        for req in getattr(batch, "reqs", ()):
            rid = getattr(req, "rid", None)
            if isinstance(rid, str) and rid.startswith(POSTCHECK_PREFIX):
                pools = pools or SimpleNamespace(
                    token_to_kv_pool_allocator=batch.token_to_kv_pool_allocator,
                    req_to_token_pool=batch.req_to_token_pool)
                self._overwrite(pools, req, rid)

    def _overwrite(self, scheduler: Any, req: Any, rid: str) -> None:
        """Write the captured foreign KV over ``req``'s last N prompt positions."""
        if self.snapshot is None:
            logger.warning("TEST FAULT: no foreign KV captured yet for %s", rid)
            return
        pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
        locs = _prompt_locs(scheduler, req, self.n)
        for (k, v), i in zip(self.snapshot, _layers(pool), strict=True):
            m = min(len(locs), k.shape[0])
            pool.get_key_buffer(i)[locs[-m:]] = k[-m:]
            pool.get_value_buffer(i)[locs[-m:]] = v[-m:]
        logger.warning("TEST FAULT: wrote foreign KV into %d positions of %s", len(locs), rid)

    def on_decode_commit(self, scheduler: Any, req: Any) -> None:
        """Apply the fault to ``req`` right before its transferred KV is committed."""
        rid = getattr(req, "rid", None)
        if not isinstance(rid, str):
            return
        if rid.startswith(SOURCE_PREFIX):
            pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
            locs = _prompt_locs(scheduler, req, self.n)
            self.snapshot = [
                (pool.get_key_buffer(i)[locs].clone(), pool.get_value_buffer(i)[locs].clone())
                for i in _layers(pool)
            ]
            logger.warning("TEST FAULT: captured KV of %d positions from %s", len(locs), rid)
        elif rid.startswith(INJECT_PREFIX):
            self._overwrite(scheduler, req, rid)


@dataclass
class KvCorrupt:
    """The armed ``kv_corrupt`` fault: change transferred KV bytes of ``CORRUPT_PREFIX`` rids.

    Invariant: only requests whose rid starts with ``CORRUPT_PREFIX`` followed by a known mode
    are touched, and only inside their own transferred range ``[cache_protected_len,
    prompt length)`` (never another request's slots); the change is deterministic in the rid.
    """

    def before_check(self, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
        """BEFORE hook of ``_verify_kv_checksums``: corrupt the batch's fault requests."""
        for req in getattr(batch, "reqs", ()):
            self.corrupt(scheduler, req)

    def corrupt(self, scheduler: Any, req: Any) -> None:
        """Change ``req``'s transferred KV if its rid asks for it (see the class doc)."""
        rid = getattr(req, "rid", None)
        if not isinstance(rid, str) or not rid.startswith(CORRUPT_PREFIX):
            return
        mode = rid[len(CORRUPT_PREFIX):].split("-", 1)[0]
        if mode not in CORRUPT_MODES:
            logger.warning("%s: unknown mode %r in rid %s; untouched", CORRUPT_LOG, mode, rid)
            return
        import random as _random

        import torch

        rng = _random.Random(rid)
        pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
        prompt_len = len(req.origin_input_ids)
        first = int(getattr(req.kv, "cache_protected_len", 0) or 0)
        row = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        locs = row[first:prompt_len].long()
        layers = list(_layers(pool))
        layer = rng.choice(layers)
        page = max(1, int(getattr(pool, "page_size", 1) or 1))
        if mode in ("bit", "lastpage"):
            pos = len(locs) - 1 if mode == "lastpage" else rng.randrange(len(locs))
            which = rng.choice("KV")
            buf = (pool.get_key_buffer if which == "K" else pool.get_value_buffer)(layer)
            raw = buf[int(locs[pos])].view(torch.uint8).view(-1)
            byte, bit = rng.randrange(raw.numel()), rng.randrange(8)
            raw[byte] ^= 1 << bit
            what = (f"flipped bit {bit} of byte {byte} of {which} at layer {layer}, owned "
                    f"position {first + pos} (slot {int(locs[pos])})")
        elif mode == "page":
            start = rng.randrange(0, len(locs), page) if len(locs) > page else 0
            sel = locs[start:start + page]
            buf = pool.get_key_buffer(layer)
            raw = buf[sel].view(torch.uint8)
            buf[sel] = (raw ^ 0x5A).view(buf.dtype) if raw.any() else \
                torch.full_like(raw, 0x5A).view(buf.dtype)
            what = (f"changed every byte of K at layer {layer}, owned positions "
                    f"{first + start}..{first + start + len(sel) - 1}")
        else:  # layer
            buf = pool.get_value_buffer(layer)
            raw = buf[locs].view(torch.uint8)
            top = buf.element_size() - 1  # the first element's most significant byte
            raw.view(len(locs), -1)[:, top] ^= 0x40  # an exponent bit (bf16/fp16/fp32)
            buf[locs] = raw.view(buf.dtype)
            what = (f"flipped bit 6 of byte {top} (an exponent bit of the first element) of V "
                    f"in every owned position at layer {layer}")
        logger.warning("%s: rid %s, mode %s: %s", CORRUPT_LOG, rid, mode, what)


def _prompt_locs(scheduler: Any, req: Any, n: int) -> Any:
    """KV locations of the last ``n`` prompt positions of ``req`` (a long tensor)."""
    prompt_len = len(req.origin_input_ids)
    row = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    return row[max(prompt_len - n, 0):prompt_len].long()


def _layers(pool: Any) -> range:
    """The layer ids this KV pool holds (``start_layer`` .. ``start_layer + layer_num``)."""
    start = getattr(pool, "start_layer", 0) or 0
    return range(start, start + pool.layer_num)


def late_room(i: int) -> int:
    """The ``i``-th bootstrap room whose KV writes ``late_write`` holds back."""
    if not 0 <= i < ROOM_RANGE_WIDTH:
        raise ValueError(f"late room index {i} outside 0..{ROOM_RANGE_WIDTH - 1}")
    return LATE_ROOM_BASE + i


def traced_room(i: int) -> int:
    """The ``i``-th bootstrap room whose KV writes ``late_write`` logs but never delays."""
    if not 0 <= i < ROOM_RANGE_WIDTH:
        raise ValueError(f"traced room index {i} outside 0..{ROOM_RANGE_WIDTH - 1}")
    return TRACE_ROOM_BASE + i


def is_late_room(room: object) -> bool:
    """Whether ``late_write`` holds back the KV writes of bootstrap room ``room``."""
    return isinstance(room, int) and LATE_ROOM_BASE <= room < LATE_ROOM_BASE + ROOM_RANGE_WIDTH


def is_traced_room(room: object) -> bool:
    """Whether ``late_write`` logs (without delay) the KV writes of bootstrap room ``room``."""
    return isinstance(room, int) and TRACE_ROOM_BASE <= room < TRACE_ROOM_BASE + ROOM_RANGE_WIDTH


def page_runs(indices: Iterable[int]) -> str:
    """Decode page ids as sorted ``a-b`` runs, e.g. ``"1-40,52-60"`` (``""`` for none)."""
    ids = sorted({int(i) for i in indices})
    runs: list[str] = []
    start = prev = None
    for i in ids:
        if prev is not None and i == prev + 1:
            prev = i
            continue
        if start is not None:
            runs.append(f"{start}-{prev}")
        start = prev = i
    if start is not None:
        runs.append(f"{start}-{prev}")
    return ",".join(runs)


def parse_page_runs(text: str) -> set[int]:
    """Inverse of :func:`page_runs`."""
    out: set[int] = set()
    for run in filter(None, text.split(",")):
        a, _, b = run.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


_LOG_RE = re.compile(
    LATE_WRITE_LOG + r" (?P<event>held|writing|done|traced): room (?P<room>\d+),"
    r" decode pages \[(?P<pages>[0-9,\-]*)\], status (?P<status>\w+), at (?P<t>[0-9.]+)"
)


@dataclass(frozen=True)
class LateWriteEvent:
    """One ``late_write`` log line: what happened to which room's write, into which pages."""

    event: str  # held | writing | done | traced
    room: int
    pages: frozenset[int]
    status: str  # the room's KVPoll status on the prefill when the line was logged
    at: float  # wall-clock time (time.time()) of the line


def parse_late_write_log(text: str) -> list[LateWriteEvent]:
    """Every ``late_write`` event in a server log, in log order."""
    return [
        LateWriteEvent(m["event"], int(m["room"]), frozenset(parse_page_runs(m["pages"])),
                       m["status"], float(m["t"]))
        for m in _LOG_RE.finditer(text)
    ]


#: ``stale_status``: decode metadata for a room in this range makes the prefill send that decode
#: three status messages of an earlier transfer of the room first (see the module doc).
STALE_ROOM_BASE = 0x57A1 << 48
#: The prefill's check every decode metadata goes through before it is stored (patch 0022):
#: the same call with and without the transfer-generation patch (0025).
STALE_TARGET = ("sglang.srt.disaggregation.common.conn.CommonKVManager."
                "pdsafe_refuses_decode")
#: Log line of the stale messages ``stale_status`` sent.
STALE_LOG = "TEST FAULT stale_status"
#: The generation frame of an earlier reservation (never a live one: generations are 63-bit
#: hashes, and this frame is sent before the real transfer's messages).
STALE_GENERATION_FRAME = b"PDSAFE_GEN1:1"


def stale_room(i: int) -> int:
    """The ``i``-th bootstrap room ``stale_status`` answers with stale messages first."""
    return STALE_ROOM_BASE + (i % ROOM_RANGE_WIDTH)


def is_stale_room(room: object) -> bool:
    return isinstance(room, int) and STALE_ROOM_BASE <= room < STALE_ROOM_BASE + ROOM_RANGE_WIDTH


def _ascii(value: Any) -> str:
    return value.decode("ascii") if isinstance(value, (bytes, bytearray)) else str(value)


class StaleStatus:
    """``stale_status`` (see the module doc): the stale messages, sent before the transfer."""

    def after_refusal_check(self, refused: Any, kv_mgr: Any, room: Any, identity: Any,
                            endpoint: Any, dst_port: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            if not refused and is_stale_room(int(room)):
                self.send(kv_mgr, int(room), _ascii(endpoint), int(_ascii(dst_port)))
        except Exception:  # a test fault must never break the prefill's bootstrap thread
            logger.exception("%s: could not send the stale messages", STALE_LOG)
        return refused

    @staticmethod
    def messages(kv_mgr: Any, room: int) -> list[tuple[str, list[bytes]]]:
        """(name, frames) of the stale messages for ``room``, in ``kv_mgr``'s status format."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        out = []
        for name, status, frame in (("Failed, no generation", KVPoll.Failed, None),
                                    ("Failed, another generation", KVPoll.Failed,
                                     STALE_GENERATION_FRAME),
                                    ("Success, another generation", KVPoll.Success,
                                     STALE_GENERATION_FRAME)):
            reason = f"{STALE_LOG}: a stale {name} of an earlier transfer of room {room}"
            parts = kv_mgr._encode_kv_status_message(
                bootstrap_room=room, status=status, failure_reason=reason)
            if not kv_mgr.kv_status_msg_carries_reason:
                parts.append(reason.encode("utf-8"))
            out.append((name, parts + ([frame] if frame else [])))
        return out

    def send(self, kv_mgr: Any, room: int, endpoint: str, port: int) -> None:
        from sglang.srt.utils.network import NetworkAddress

        na = NetworkAddress(endpoint, port)
        names = []
        for name, parts in self.messages(kv_mgr, room):
            kv_mgr._send_multipart_locked(na.to_tcp(), parts, is_ipv6=na.is_ipv6)
            names.append(name)
        logger.warning("%s: room %s: sent %d stale status messages to %s:%s before its "
                       "transfer (%s)", STALE_LOG, room, len(names), endpoint, port,
                       "; ".join(names))


def _worker_room() -> int | None:
    """Bootstrap room of the chunk the calling ``transfer_worker`` frame is writing (or None)."""
    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return None
        if frame.f_code.co_name == "transfer_worker":
            chunk = frame.f_locals.get("kv_chunk")
            room = getattr(chunk, "room", None)
            return room if isinstance(room, int) else None
        frame = frame.f_back
    return None


#: sglang's ``KVPoll`` values (plain ints upstream) by name, for the log.
_KVPOLL_NAMES = {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring",
                 4: "Success"}


def _status_name(manager: Any, room: int) -> str:
    """The room's ``KVPoll`` status on this manager by name; ``cleared`` once the prefill
    dropped the room (its sender was cleared, e.g. after an abort)."""
    status = getattr(manager, "request_status", {}).get(room)
    if status is None:
        return "cleared"
    return _KVPOLL_NAMES.get(int(status), str(status))


@dataclass
class LateWrite:
    """The armed ``late_write`` fault: hold each KV write of a late room ``seconds`` long.

    Invariant: only chunks whose room :func:`is_late_room` are delayed; chunks of traced
    rooms are written at once and only logged; every other write passes untouched.
    """

    seconds: float
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)

    def around_write(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """AROUND hook of a transfer worker's KV write function."""
        room = _worker_room()
        if not (is_late_room(room) or is_traced_room(room)):
            return original(*args, **kwargs)
        assert room is not None
        return self.on_write(room, original, args, kwargs)

    def on_write(self, room: int, original: Callable[..., Any], args: tuple,
                 kwargs: dict[str, Any]) -> Any:
        """Apply the fault to one write of ``room`` (a late or traced room)."""
        manager = args[0] if args else None
        try:
            dst = inspect.signature(original).bind(*args, **kwargs).arguments.get(
                "dst_kv_indices")
        except TypeError:
            dst = None
        pages = page_runs(dst.tolist() if hasattr(dst, "tolist") else (dst or ()))
        name = getattr(original, "__qualname__", repr(original))

        def log(event: str, what: str) -> None:
            logger.warning("%s %s: room %d, decode pages [%s], status %s, at %.3f; %s (%s)",
                           LATE_WRITE_LOG, event, room, pages, _status_name(manager, room),
                           time.time(), what, name)

        if not is_late_room(room):
            log("traced", "written now, not delayed")
            return original(*args, **kwargs)
        log("held", f"holding this write for {self.seconds:.1f} s")
        self.sleep(self.seconds)
        log("writing", f"writing now, {self.seconds:.1f} s late")
        result = original(*args, **kwargs)
        log("done", f"late write returned {result if isinstance(result, int) else 'a handle'}")
        return result


#: ``KVPoll`` values ``park_commit`` reads and writes (plain ints upstream).
_POLL_SUCCESS, _POLL_TRANSFERRING = 4, 3

_PARK_RE = re.compile(
    PARK_LOG + r" (?P<event>parked|released|left): rid (?P<rid>\S+), poll (?P<status>\w+), "
    r"after (?P<after>[0-9.]+) s, at (?P<t>[0-9.]+)"
)


@dataclass(frozen=True)
class ParkEvent:
    """One ``park_commit`` log line: a request parked, released to its commit, or gone."""

    event: str  # parked | released | left
    rid: str
    status: str  # the poll the hook saw (by KVPoll name)
    after: float  # seconds since the request was parked
    at: float  # wall-clock time (time.time()) of the line


def parse_park_log(text: str) -> list[ParkEvent]:
    """Every ``park_commit`` event in a server log, in log order."""
    return [ParkEvent(m["event"], m["rid"], m["status"], float(m["after"]), float(m["t"]))
            for m in _PARK_RE.finditer(text)]


@dataclass
class ParkCommit:
    """The armed ``park_commit`` fault: hold a ``PARK_PREFIX`` request between its transfer's
    Success and decode's commit for ``seconds``, without blocking the scheduler.

    Invariant: only polls of requests whose rid starts with ``PARK_PREFIX`` change, only from
    Success to Transferring, and only within ``seconds`` of the first Success the hook saw for
    that rid (once per rid); every other poll passes unchanged (other rids, a parked request's
    Failed after an abort, a released request's later polls). The hook never sleeps.
    """

    seconds: float
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    #: rid -> clock() when the hook first saw its Success (while parked).
    parked: dict[str, float] = field(default_factory=dict)
    #: rids whose park is over (released or left): never parked again.
    done: set[str] = field(default_factory=set)

    def around_poll(self, original: Callable[..., Any], transfer_queue: Any, *args: Any,
                    **kwargs: Any) -> Any:
        """AROUND hook of the transfer queue's poll: park the Success of fault requests."""
        polls = original(transfer_queue, *args, **kwargs)
        reqs = list(getattr(transfer_queue, "queue", ()) or ())
        rids = [getattr(getattr(dr, "req", None), "rid", None) for dr in reqs]
        if not any(isinstance(r, str) and r.startswith(PARK_PREFIX) for r in rids):
            return polls
        out = list(polls)
        for i, rid in enumerate(rids[: len(out)]):
            if isinstance(rid, str) and rid.startswith(PARK_PREFIX):
                out[i] = self.on_poll(rid, int(out[i]))
        return out

    def on_poll(self, rid: str, poll: int) -> int:
        """The poll decode sees for fault request ``rid`` whose real poll is ``poll``."""
        if rid in self.done:
            return poll
        now = self.clock()
        since = self.parked.get(rid)
        if poll != _POLL_SUCCESS:
            if since is not None:  # the park ends without a commit (e.g. Failed: aborted)
                self._end(rid, "left", poll, now - since)
            return poll
        if since is None:
            self.parked[rid] = now
            self._log("parked", rid, poll, 0.0)
            return _POLL_TRANSFERRING
        if now - since < self.seconds:
            return _POLL_TRANSFERRING
        self._end(rid, "released", poll, now - since)
        return poll

    def _end(self, rid: str, event: str, poll: int, after: float) -> None:
        self.parked.pop(rid, None)
        self.done.add(rid)
        self._log(event, rid, poll, after)

    def _log(self, event: str, rid: str, poll: int, after: float) -> None:
        what = {"parked": f"transfer done, commit held {self.seconds:g} s",
                "released": "committing now", "left": "never committed"}[event]
        logger.warning("%s %s: rid %s, poll %s, after %.3f s, at %.3f; %s", PARK_LOG, event,
                       rid, _KVPOLL_NAMES.get(poll, str(poll)), after, time.time(), what)


class FreeReserved:
    """The armed ``free_reserved`` fault: free one reserved page of a fault request before its
    commit check.

    Invariant: only requests whose rid starts with ``FREE_RESERVED_PREFIX`` are touched, once
    each, and only a page of their own reservation (the second page of their row)."""

    def __init__(self) -> None:
        self.done: set[str] = set()

    def before_commit_check(self, transfer_queue: Any, decode_req: Any, *args: Any,
                            **kwargs: Any) -> None:
        req = decode_req.req
        rid = getattr(req, "rid", None)
        if not isinstance(rid, str) or not rid.startswith(FREE_RESERVED_PREFIX) \
                or rid in self.done:
            return
        self.done.add(rid)
        scheduler = transfer_queue.scheduler
        alloc = scheduler.token_to_kv_pool_allocator
        page = max(1, int(getattr(alloc, "page_size", 1) or 1))
        row = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        slots = row[page:2 * page].clone()
        alloc.free(slots)
        logger.warning("%s: rid %s: freed token slots %s (its second page) under its transfer",
                       FREE_RESERVED_LOG, rid, page_runs(slots.tolist()))


#: The armed faults of this process (None until :func:`register` armed them).
armed: ForeignKV | None = None
armed_late_write: LateWrite | None = None
armed_corrupt: KvCorrupt | None = None
armed_park: ParkCommit | None = None
#: ``wire_version``: (this release's wire version, the one the process now speaks), once armed.
armed_wire_version: tuple[str, str] | None = None
armed_stale: StaleStatus | None = None
armed_hook_fail: Any = None  # pdsafe_testkit.hook_fail.HookFail, once armed
armed_free_reserved: FreeReserved | None = None


def register() -> None:
    """sglang plugin entry point: arm the faults named in ``SGLANG_PDSAFE_TEST_FAULTS``.

    Inert (registers no hook, logs nothing) when the variable is unset or empty. A malformed
    value raises ``ValueError`` (sglang's loader logs it: the server runs unarmed and says so).
    Idempotent within a process: a second call registers nothing more.
    """
    global armed, armed_late_write, armed_corrupt, armed_park, armed_wire_version, armed_stale
    global armed_hook_fail, armed_free_reserved
    spec = os.environ.get(ENV, "")
    if not spec.strip() or armed is not None or armed_late_write is not None \
            or armed_corrupt is not None or armed_park is not None \
            or armed_wire_version is not None or armed_stale is not None \
            or armed_hook_fail is not None or armed_free_reserved is not None:
        return
    n = parse_foreign_kv(spec)
    seconds = parse_late_write(spec)
    corrupt = "kv_corrupt" in parse_spec(spec)
    park = parse_park_commit(spec)
    wire_version = parse_wire_version(spec)
    stale = "stale_status" in parse_spec(spec)
    hook_fail = "hook_fail" in parse_spec(spec)
    free_reserved = "free_reserved" in parse_spec(spec)
    if not n and not seconds and not corrupt and not park and not wire_version and not stale \
            and not hook_fail and not free_reserved:
        logger.warning("%s=%r names no known test fault; nothing armed", ENV, spec)
        return
    if wire_version:
        from sglang.pdsafe import pair_agreement, pair_settings

        armed_wire_version = (pair_settings.WIRE_VERSION, wire_version)
        pair_settings.WIRE_VERSION = wire_version
        pair_agreement.WIRE_VERSION = wire_version  # the re-export, for readers of it
        logger.warning(
            "TEST FAULT ARMED (%s=%s, plugin %s, pid %d): this process speaks pdsafe wire "
            "version %s instead of this release's %s (%s): it publishes, announces and requires "
            "that version, as a fork of another release. Never install sglang-pdsafe-testkit "
            "or set this outside tests.",
            ENV, spec, PLUGIN_NAME, os.getpid(), wire_version, armed_wire_version[0],
            WIRE_VERSION_TARGET,
        )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if hook_fail:
        _arm_hook_fail(spec)
    if free_reserved:
        armed_free_reserved = FreeReserved()
        HookRegistry.register(FREE_RESERVED_TARGET, armed_free_reserved.before_commit_check,
                              HookType.BEFORE)
        logger.warning(
            "TEST FAULT ARMED (%s=%s, plugin %s, pid %d): before decode's page-generation "
            "commit check (%s), requests with rid prefix %r lose the second page of their "
            "reservation to the allocator. Never install sglang-pdsafe-testkit or set this "
            "outside tests.", ENV, spec, PLUGIN_NAME, os.getpid(), FREE_RESERVED_TARGET,
            FREE_RESERVED_PREFIX,
        )
    if n:
        armed = ForeignKV(n)
        HookRegistry.register(TARGET, armed.before_commit, HookType.BEFORE)
        HookRegistry.register(POSTCHECK_TARGET, armed.before_prebuilt, HookType.BEFORE)
        logger.warning(
            "TEST FAULT ARMED (%s=%s, plugin %s, pid %d): at decode commit (%s), requests with "
            "rid prefix %r get the KV of the last %d prompt positions of the last request with "
            "rid prefix %r. Never install sglang-pdsafe-testkit or set this outside tests.",
            ENV, spec, PLUGIN_NAME, os.getpid(), TARGET, INJECT_PREFIX, n, SOURCE_PREFIX,
        )
    if stale:
        armed_stale = StaleStatus()
        HookRegistry.register(STALE_TARGET, armed_stale.after_refusal_check, HookType.AFTER)
        logger.warning(
            "TEST FAULT ARMED (%s=%s, plugin %s, pid %d): decode metadata for bootstrap rooms "
            "%d..%d (%s) makes this prefill send the decode stale status messages of an earlier "
            "transfer of the room first. Never install sglang-pdsafe-testkit or set this "
            "outside tests.", ENV, spec, PLUGIN_NAME, os.getpid(), STALE_ROOM_BASE,
            STALE_ROOM_BASE + ROOM_RANGE_WIDTH - 1, STALE_TARGET,
        )
    if corrupt:
        armed_corrupt = KvCorrupt()
        HookRegistry.register(CORRUPT_TARGET, armed_corrupt.before_check, HookType.BEFORE)
        logger.warning(
            "TEST FAULT ARMED (%s=%s, plugin %s, pid %d): before a new decode batch is checked "
            "(%s), requests with rid prefix %r get their transferred KV bytes changed (modes "
            "%s). Never install sglang-pdsafe-testkit or set this outside tests.",
            ENV, spec, PLUGIN_NAME, os.getpid(), CORRUPT_TARGET, CORRUPT_PREFIX, CORRUPT_MODES,
        )
    if park:
        armed_park = ParkCommit(park)
        for target in PARK_TARGETS:
            HookRegistry.register(target, armed_park.around_poll, HookType.AROUND)
        logger.warning(
            "TEST FAULT ARMED (%s=%s, plugin %s, pid %d): the decode transfer queue's polls "
            "(%s) hold the finished transfer of requests with rid prefix %r %.1f s before "
            "decode commits it. Never install sglang-pdsafe-testkit or set this outside tests.",
            ENV, spec, PLUGIN_NAME, os.getpid(), ", ".join(PARK_TARGETS), PARK_PREFIX, park,
        )
    if seconds:
        armed_late_write = LateWrite(seconds)
        targets = [t for ts in LATE_WRITE_TARGETS.values() for t in ts]
        for target in targets:
            HookRegistry.register(target, armed_late_write.around_write, HookType.AROUND)
        logger.warning(
            "TEST FAULT ARMED (%s=%s, plugin %s, pid %d): the prefill transfer worker's KV "
            "writes (%s) of bootstrap rooms %d..%d land %.1f s late; writes of rooms %d..%d are "
            "logged. Never install sglang-pdsafe-testkit or set this outside tests.",
            ENV, spec, PLUGIN_NAME, os.getpid(), ", ".join(targets), LATE_ROOM_BASE,
            LATE_ROOM_BASE + ROOM_RANGE_WIDTH - 1, seconds, TRACE_ROOM_BASE,
            TRACE_ROOM_BASE + ROOM_RANGE_WIDTH - 1,
        )


def _arm_hook_fail(spec: str) -> None:
    """Arm ``hook_fail`` in this process: shim every hook, audit the allocator each quiet
    scheduler pass (see :mod:`pdsafe_testkit.hook_fail`)."""
    global armed_hook_fail
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from pdsafe_testkit import hook_fail

    armed_hook_fail = hook_fail.from_env()
    n = armed_hook_fail.install()
    HookRegistry.register(hook_fail.AUDIT_TARGET, armed_hook_fail.before_idle, HookType.BEFORE)
    logger.warning(
        "TEST FAULT ARMED (%s=%s, plugin %s, pid %d): the %d pdsafe hooks fail on demand "
        "(control file %s); the scheduler audits its KV allocator when quiet (%s). Never "
        "install sglang-pdsafe-testkit or set this outside tests.", ENV, spec, PLUGIN_NAME,
        os.getpid(), n, armed_hook_fail.control_path, hook_fail.AUDIT_TARGET,
    )
