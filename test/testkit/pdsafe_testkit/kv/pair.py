"""The parent side of the KV harness: ``KVPair`` (two processes) and its ``KVLane`` s.

A model-free KV transfer harness: the REAL sglang Mooncake/NIXL managers in two OS processes.
A prefill process and a decode process (``multiprocessing`` "spawn" context) each build one
lane per page size (``scheduler_glue``); ``KVLane.transfer`` drives one request through them
and returns a ``TransferResult`` with the decode pages classified (``pages``).

Usage::

    from pdsafe_testkit.kv import AbortAt, KVPair, PageKind

    with KVPair("mooncake", page_size=(1, 16, 64), num_pages=64) as pair:
        lane = pair.lane(16)                       # or pair.transfer(...) for the first lane
        r = lane.transfer(57, chunk_tokens=32)     # one request, 4 decode pages
        assert r.committed and r.all_own
        r = lane.transfer(64, prefill_tokens=40)   # coverage gap: tail pages keep old bytes
        r = lane.transfer(64, abort=AbortAt.DECODE_BEFORE_SEND)
        r.prefill_terminal_after_abort_s           # how long prefill took to see Failed

Lanes avoid a process pair per page size: importing sglang dominates the cost of a pair (~7-10 s
per process on an idle 2-core machine). ``ServerArgs.model_path`` points at a weight-less stub
(``config.json`` only): publishing resolves the HF config, but no weights or tokenizer are
ever loaded.

Invariants
----------
* Both children pin every transport to loopback (``SGLANG_HOST_IP=127.0.0.1``,
  ``UCX_NET_DEVICES=lo``, ``MOONCAKE_PROTOCOL=tcp``, bootstrap host 127.0.0.1); ports come
  from the harness's port band (``loopback.reserve_port``).
* The parent process never imports torch or sglang; only the children do
  (``test/unit/test_kv_harness_imports.py`` checks it).
* A started ``KVPair`` always ends with both children gone: ``close()`` (also on a failed
  start, and from ``__exit__``) asks them to exit, then terminates and kills them; children
  also die with their parent (``PR_SET_PDEATHSIG`` and a parent watchdog). Children's stdout
  and stderr go to log files whose tails are attached to every ``HarnessError``.
* ``transfer`` leaves no per-room state behind on either side (sender/receiver ``clear`` or
  ``failure_exception``, metadata slot freed), so a pair can run any number of transfers.
* Decode pages are never cleaned between transfers (as in sglang: freed pages keep their
  bytes); ``poison_decode_pages`` re-poisons them on request.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdsafe_testkit.backends import BACKENDS
from pdsafe_testkit.kv.child import ChildConfig, kv_child_env, write_stub_model_config
from pdsafe_testkit.kv.layouts import POOL_KINDS, RowCopy
from pdsafe_testkit.kv.pages import MIN_TOKEN_WORDS, BitFlip
from pdsafe_testkit.kv.results import AbortAt, TransferResult, side_outcome
from pdsafe_testkit.kv.rpc import Child, HarnessError, gather
from pdsafe_testkit.loopback import reserve_port

__all__ = ["KVLane", "KVPair"]


class KVPair:
    """A prefill and a decode process running backend ``backend``'s real KV classes.

    Use as a context manager (``with KVPair("nixl", page_size=16, num_pages=64) as pair``).
    ``page_size`` may be a sequence: the two processes then host one independent *lane* per
    page size (its own published ``ServerArgs``, bootstrap server, manager, pools and aux
    buffers; one Mooncake engine per process is shared, as in sglang), which is much cheaper
    than a process pair per page size. ``pair.lane(ps)`` selects one; ``pair.transfer`` and
    ``pair.poison_decode_pages`` act on the first.

    Usable pages are ``1..num_pages`` on both sides (page 0 is sglang's padding page).

    Invariants: transfers are sequential (one in flight per pair); rooms are unique per pair
    unless the caller passes its own; a ``HarnessError`` leaves the pair unusable (``broken``)
    and the children are still stopped by ``close``, which is idempotent.
    """

    def __init__(
        self,
        backend: str,
        page_size: int | Sequence[int] = 16,
        num_pages: int = 64,
        *,
        num_layers: int = 2,
        token_words: int = 8,
        aux_slots: int = 32,
        startup_timeout: float = 300.0,
        env: dict[str, str] | None = None,
        log_dir: str | Path | None = None,
        log_level: str = "WARNING",
        seed: int | None = None,
        warmup: bool = True,
        bookkeeping: bool = False,
        pool_kind: str | Sequence[str] = "mha",
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}")
        page_sizes = (page_size,) if isinstance(page_size, int) else tuple(page_size)
        if not page_sizes or len(set(page_sizes)) != len(page_sizes) or min(page_sizes) < 1:
            raise ValueError("page sizes must be distinct and >= 1")
        if num_pages < 1 or num_layers < 1:
            raise ValueError("num_pages and num_layers must be >= 1")
        if token_words < MIN_TOKEN_WORDS:
            raise ValueError(f"token_words must be >= {MIN_TOKEN_WORDS}")
        kinds = ((pool_kind,) * len(page_sizes) if isinstance(pool_kind, str)
                 else tuple(pool_kind))
        if len(kinds) != len(page_sizes) or not set(kinds) <= set(POOL_KINDS):
            raise ValueError(f"pool_kind: one of {POOL_KINDS}, or one per page size")
        if bookkeeping and set(kinds) != {"mha"}:
            raise ValueError("bookkeeping=True needs MHA lanes")
        self.backend = backend
        self.page_sizes = page_sizes
        #: Each lane's pool class (``layouts.POOL_KINDS``), aligned with ``page_sizes``.
        self.pool_kinds = kinds
        self.num_pages = num_pages
        self.num_layers = num_layers
        self.token_words = token_words
        self.aux_slots = aux_slots
        self.startup_timeout = startup_timeout
        # The harness's decode lanes create receivers without the decode scheduler's pairing
        # step (pair_agreement.ensure_prefill_info, which learns the prefill's wire version), so
        # they never announce a pdsafe wire version and a fork prefill would refuse them as a
        # stock decode (peer_capability). The harness tests the transfer itself, not the
        # capability exchange (test/pd/test_mixed_versions.py and test_peer_capability.py do):
        # its prefill serves them under the decode-protections waiver, unless the caller says
        # otherwise.
        self.env = kv_child_env({"SGLANG_PDSAFE_WAIVE_FOR_STOCK_PEERS": "decode-protections",
                                 **(env or {})})
        self.log_level = log_level
        self._own_log_dir = log_dir is None
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="kv-harness-"))
        self._rng = random.Random(seed)
        self._used_rooms: set[int] = set()
        self.prefill: Child | None = None
        self.decode: Child | None = None
        self.bootstrap_ports: tuple[int, ...] = ()
        self.broken: str | None = None
        self.warmup = warmup
        self.bookkeeping = bookkeeping
        self.warmup_results: list[TransferResult] = []
        self.startup_s: float | None = None  # launch -> ready (incl. warm-up)
        self.child_init: dict[str, dict[str, Any]] = {}
        self._t_launch = 0.0

    @property
    def page_size(self) -> int:
        """The first lane's page size."""
        return self.page_sizes[0]

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> KVPair:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _config(self, role: str) -> ChildConfig:
        return ChildConfig(
            role=role,
            backend=self.backend,
            page_sizes=self.page_sizes,
            bootstrap_ports=self.bootstrap_ports,
            num_pages=self.num_pages,
            num_layers=self.num_layers,
            token_words=self.token_words,
            aux_slots=self.aux_slots,
            http_port=reserve_port(),
            env=self.env,
            parent_pid=os.getpid(),
            log_level=self.log_level,
            model_dir=str(self.log_dir / "stub-model"),
            bookkeeping=self.bookkeeping,
            pool_kinds=() if set(self.pool_kinds) == {"mha"} else self.pool_kinds,
        )

    def start(self) -> None:
        """``launch()`` then ``wait_ready()``."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Spawn both children without waiting (several pairs can start concurrently)."""
        if self.prefill is not None:
            raise HarnessError("pair already launched")
        self._t_launch = time.monotonic()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        write_stub_model_config(self.log_dir / "stub-model", self.num_layers)
        self.bootstrap_ports = tuple(reserve_port() for _ in self.page_sizes)
        try:
            self.prefill = Child(self._config("prefill"), self.log_dir / "prefill.log")
            self.decode = Child(self._config("decode"), self.log_dir / "decode.log")
        except BaseException as e:
            self.broken = f"launch failed: {e}".splitlines()[0]
            self.close()
            raise

    def wait_ready(self) -> None:
        """Wait until every lane's managers exist, decode sees prefill, and warm-up passed.

        Idempotent. The warm-up runs one small transfer per lane (NIXL connects to its peer
        on the first transfer, ~1 s) and must succeed with every page OWN; then every decode
        page is re-poisoned, so tests start from a known state.
        """
        if self.startup_s is not None:
            return
        if self.broken is not None:
            raise HarnessError(f"pair is broken: {self.broken}")
        if self.prefill is None:
            self.launch()
        assert self.prefill is not None and self.decode is not None
        try:
            p_info, d_info = gather(
                (self.prefill, self.startup_timeout), (self.decode, self.startup_timeout)
            )
            self.child_init = {"prefill": p_info, "decode": d_info}
            for ps in self.page_sizes:
                self.decode.call("connect", self.startup_timeout, lane=ps, timeout=60.0)
            if self.warmup:
                for ps in self.page_sizes:
                    lane = self.lane(ps)
                    r = lane.transfer(ps + 1 if ps > 1 else 2, timeout=60.0)
                    self.warmup_results.append(r)
                    if not (r.committed and r.all_own):
                        raise HarnessError(f"warm-up transfer failed: {r.describe()}")
                    lane.poison_decode_pages()
        except BaseException as e:
            self.broken = self.broken or f"startup failed: {e}".splitlines()[0]
            self.close()
            raise
        self.startup_s = time.monotonic() - self._t_launch

    def begin_close(self) -> None:
        """Ask both children to exit without waiting (to close several pairs in parallel)."""
        for child in (self.decode, self.prefill):
            if child is not None:
                child.request_stop()

    def close(self) -> None:
        """Stop both children (always; idempotent); logs are kept only after a failure."""
        self.begin_close()
        for child in (self.decode, self.prefill):
            if child is not None:
                child.stop()
        if self._own_log_dir and self.broken is None:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def logs(self) -> str:
        """Tails of both children's logs (stdout + stderr)."""
        parts = []
        for child in (self.prefill, self.decode):
            if child is not None:
                parts.append(f"--- {child.cfg.role} log ({child.log_path}) ---\n{child.log_tail()}")
        return "\n".join(parts)

    def child_pids(self) -> list[int]:
        return [c.proc.pid for c in (self.prefill, self.decode) if c is not None and c.proc.pid]

    def alive(self) -> bool:
        return (
            all(c is not None and c.proc.is_alive() for c in (self.prefill, self.decode))
            and self.broken is None
        )

    # -- lanes ------------------------------------------------------------------------------

    def lane(self, page_size: int | None = None) -> KVLane:
        """The lane of ``page_size`` (the first lane when None)."""
        ps = self.page_size if page_size is None else page_size
        if ps not in self.page_sizes:
            raise ValueError(f"no lane for page_size {ps}; lanes: {self.page_sizes}")
        return KVLane(self, ps)

    def transfer(self, num_tokens: int, **kwargs: Any) -> TransferResult:
        """``self.lane().transfer(...)``: see ``KVLane.transfer``."""
        return self.lane().transfer(num_tokens, **kwargs)

    def poison_decode_pages(self, pages: Sequence[int] | None = None) -> None:
        self.lane().poison_decode_pages(pages)

    def new_room(self) -> int:
        """A fresh random bootstrap room (63-bit like sglang's), unique within this pair."""
        while True:
            room = self._rng.randrange(1, 2**63)
            if room not in self._used_rooms:
                self._used_rooms.add(room)
                return room

    def _children(self) -> tuple[Child, Child]:
        if self.broken is not None:
            raise HarnessError(f"pair is broken: {self.broken}")
        if self.prefill is None or self.decode is None:
            raise HarnessError("pair not started")
        return self.prefill, self.decode


@dataclass(frozen=True)
class KVLane:
    """One page size of a ``KVPair``: where transfers happen."""

    pair: KVPair
    page_size: int

    @property
    def backend(self) -> str:
        return self.pair.backend

    @property
    def num_pages(self) -> int:
        return self.pair.num_pages

    @property
    def pool_kind(self) -> str:
        """This lane's pool class (``layouts.POOL_KINDS``)."""
        return self.pair.pool_kinds[self.pair.page_sizes.index(self.page_size)]

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def poison_decode_pages(self, pages: Sequence[int] | None = None) -> None:
        """Re-fill decode pages (all usable pages when None) with the POISON pattern."""
        self.pair._children()[1].call(
            "poison", 60.0, lane=self.page_size, pages=None if pages is None else list(pages)
        )

    def alloc_pages(self, num_pages: int, layout: str = "contiguous"
                    ) -> tuple[list[int], list[int]]:
        """(decode pages, prefill pages) from each side's allocator (a pair started with
        ``bookkeeping=True``), laid out as ``layout`` (``bookkeeping.LAYOUTS``); a transfer
        given them frees them at its end."""
        prefill, decode = self.pair._children()
        d = decode.call("alloc_pages", 120.0, lane=self.page_size, num_pages=num_pages,
                        layout=layout)
        p = prefill.call("alloc_pages", 120.0, lane=self.page_size, num_pages=num_pages,
                         layout=layout)
        return d, p

    def _check_pages(self, pages: Iterable[int], needed: int, what: str) -> list[int]:
        out = [int(p) for p in pages]
        if len(out) != needed:
            raise ValueError(f"{what}: {needed} pages needed, {len(out)} given")
        if len(set(out)) != len(out) or not all(1 <= p <= self.num_pages for p in out):
            raise ValueError(f"{what}: pages must be distinct and in 1..{self.num_pages}")
        return out

    def transfer(
        self,
        num_tokens: int,
        *,
        room: int | None = None,
        prefill_tokens: int | None = None,
        decode_page_indices: Sequence[int] | None = None,
        prefill_page_indices: Sequence[int] | None = None,
        chunk_tokens: int | None = None,
        abort: AbortAt | str = AbortAt.NONE,
        timeout: float = 30.0,
        abort_observe_timeout: float | None = None,
        abort_ack_timeout: float = 5.0,
        flips: Sequence[BitFlip | RowCopy] = (),
        classify: bool = True,
        measure: bool = False,
        trace_memory: bool = False,
    ) -> TransferResult:
        """Run one request's KV transfer end to end and classify the decode pages.

        Decode reserves ``ceil(num_tokens / page_size)`` pages (default ``1..n``) and
        publishes them; prefill prefills ``prefill_tokens`` (default ``num_tokens``) tokens
        into its pages (default ``1..m``), in chunks of ``chunk_tokens`` (default one chunk),
        and sends them. ``prefill_tokens < num_tokens`` models the coverage gap.

        ``timeout`` bounds each wait for a terminal state; ``abort_observe_timeout`` (default
        ``timeout``) bounds the wait of the side that did NOT abort. A side that is still not
        terminal then is reported with its last state and ``terminal_at=None``, and is
        retired (``abort()`` + ``failure_exception()``, as its own timeout would).

        Decode then runs the KV digest check of a transfer it commits (``digest``):
        ``flips`` (test-only corruption, any bytes of decode's pool) are applied after the
        commit, before that check; ``flipped_verdicts`` classify the pages after them.

        ``classify`` False: no per-page verdicts, ``own_rows`` counts the request's rows
        instead (for a million pages). ``measure`` (a pair with ``bookkeeping=True``): both
        sides measure what the protections' bookkeeping cost for this transfer
        (``result.cost``; ``trace_memory`` also traces the peak memory inside every hook,
        which slows the hooks down: time and memory are measured in separate transfers).
        """
        prefill, decode = self.pair._children()
        lane = self.page_size
        abort = AbortAt(abort)
        prefill_tokens = num_tokens if prefill_tokens is None else prefill_tokens
        if num_tokens < 1 or prefill_tokens < 1:
            raise ValueError("num_tokens and prefill_tokens must be >= 1")
        d_need, p_need = self.pages_for(num_tokens), self.pages_for(prefill_tokens)
        d_pages = self._check_pages(
            decode_page_indices if decode_page_indices is not None else range(1, d_need + 1),
            d_need,
            "decode_page_indices",
        )
        p_pages = self._check_pages(
            prefill_page_indices if prefill_page_indices is not None else range(1, p_need + 1),
            p_need,
            "prefill_page_indices",
        )
        if room is None:
            room = self.pair.new_room()
        observe = timeout if abort_observe_timeout is None else abort_observe_timeout
        margin = 60.0

        abort_at: float | None = None
        ack_at: float | None = None
        d_out: dict[str, Any] = {}
        p_out: dict[str, Any] = {}
        d_fin: dict[str, Any] = {}
        p_fin: dict[str, Any] = {}
        chunks = 0
        started = time.monotonic()
        cost: dict[str, Any] | None = None
        if measure:
            for child in (prefill, decode):
                child.call("measure_begin", margin, lane=lane, trace_memory=trace_memory)
        try:
            try:
                prefill.call("send_open", margin, lane=lane, room=room)
                decode.call("recv_open", margin, lane=lane, room=room, pages=d_pages,
                            num_tokens=num_tokens)
                ready = prefill.call(
                    "send_wait_ready", timeout + margin, lane=lane, room=room, timeout=timeout
                )
                if ready["state"] != "WaitingForInput":
                    # Bootstrap never completed: report what each side sees, nothing sent.
                    p_out = ready
                    d_out = decode.call(
                        "recv_wait_terminal", margin, lane=lane, room=room, timeout=1.0
                    )
                else:
                    chunks = prefill.call(
                        "send_prepare",
                        margin,
                        lane=lane,
                        room=room,
                        prefill_tokens=prefill_tokens,
                        pages=p_pages,
                        chunk_tokens=chunk_tokens,
                    )
                    d_out, p_out, abort_at, ack_at = self._run(
                        abort, room, chunks, timeout, observe, abort_ack_timeout, margin
                    )
            finally:
                # Retire both sides even when the run above failed, so rooms never leak.
                if prefill.pending is None and decode.pending is None:
                    d_fin = decode.call(
                        "recv_finish", margin, lane=lane, room=room, num_tokens=num_tokens,
                        flips=list(flips), classify=classify,
                    )
                    p_fin = prefill.call("send_finish", margin, lane=lane, room=room)
                    if measure:
                        cost = {"prefill": prefill.call("measure_end", margin, lane=lane),
                                "decode": decode.call("measure_end", margin, lane=lane)}
        except HarnessError as e:
            self.pair.broken = str(e).splitlines()[0]
            raise
        finished = time.monotonic()
        # A side's failure reason is what its failure_exception() raised, for a Failed side.
        d_side = side_outcome(
            {
                **d_out,
                "failure_reason": d_fin["failure_reason"] if d_out["state"] == "Failed" else None,
            }
        )
        p_side = side_outcome(
            {
                **p_out,
                "failure_reason": p_fin["failure_reason"] if p_out["state"] == "Failed" else None,
                "trace": p_fin["trace"],
            }
        )
        ends = [t for t in (d_side.terminal_at, p_side.terminal_at) if t is not None]
        return TransferResult(
            backend=self.backend,
            page_size=self.page_size,
            room=room,
            num_tokens=num_tokens,
            prefill_tokens=prefill_tokens,
            decode_pages=tuple(d_pages),
            prefill_pages=tuple(p_pages),
            chunks=chunks,
            abort=abort,
            started_at=started,
            abort_at=abort_at,
            decode=d_side,
            prefill=p_side,
            wall_s=(max(ends) if len(ends) == 2 else finished) - started,
            aux_room=d_fin["aux_room"],
            decode_abort_ack_at=ack_at,
            verdicts=tuple(d_fin["verdicts"]),
            gate=d_fin["gate"],
            gate_message=d_fin["gate_message"],
            digest=d_fin["digest"],
            digest_message=d_fin["digest_message"],
            digest_generation=d_fin["digest_generation"],
            flips=tuple(tuple(f) for f in d_fin["flips"]),
            flipped_verdicts=tuple(d_fin["flipped_verdicts"]),
            own_rows=d_fin.get("own_rows"),
            rows_expected=None if classify else num_tokens * 2 * self.pair.num_layers,
            cost=cost,
            source_refusal=p_fin.get("source_refusal"),
        )

    def _run(
        self,
        abort: AbortAt,
        room: int,
        chunks: int,
        timeout: float,
        observe: float,
        ack_timeout: float,
        margin: float,
    ) -> tuple[dict[str, Any], dict[str, Any], float | None, float | None]:
        """The send/receive phase; returns (decode out, prefill out, abort time, ack time)."""
        prefill, decode = self.pair._children()
        lane = self.page_size
        if abort is AbortAt.NONE:
            prefill.submit("send_run", lane=lane, room=room, wait_timeout=timeout)
            decode.submit("recv_wait_terminal", lane=lane, room=room, timeout=timeout)
            p_out, d_out = gather((prefill, timeout + margin), (decode, timeout + margin))
            return d_out, p_out, None, None

        if abort in (AbortAt.DECODE_AFTER_FIRST_CHUNK, AbortAt.PREFILL_AFTER_FIRST_CHUNK):
            if chunks < 2:
                raise ValueError(f"{abort.value} needs >= 2 chunks (set chunk_tokens)")
            prefill.call("send_run", margin, lane=lane, room=room, max_chunks=1)

        if abort.side == "decode":
            abort_at = decode.call("recv_abort", margin, lane=lane, room=room)
            # Prefill keeps polling (mid-transfer it also keeps sending its remaining chunks,
            # as the scheduler does) until it sees a terminal state.
            if abort is AbortAt.DECODE_BEFORE_SEND:
                prefill.submit("send_wait_terminal", lane=lane, room=room, timeout=observe)
            else:
                prefill.submit("send_run", lane=lane, room=room, wait_timeout=observe)
            decode.submit("recv_wait_terminal", lane=lane, room=room, timeout=timeout)
            p_out, d_out = gather((prefill, observe + margin), (decode, timeout + margin))
            ack_at = decode.call(
                "recv_wait_abort_ack",
                ack_timeout + margin,
                lane=lane,
                room=room,
                timeout=ack_timeout,
            )
            if abort is AbortAt.DECODE_BEFORE_SEND:
                # The scheduler sends after its forward whatever the abort: the chunks must
                # be dropped (the verdicts then show that no decode page was written).
                prefill.call("send_run", margin, lane=lane, room=room)
            return d_out, p_out, abort_at, ack_at

        # Prefill-side abort: the sender is aborted (and retired later); decode is not told.
        abort_at = prefill.call("send_abort", margin, lane=lane, room=room)
        prefill.submit("send_wait_terminal", lane=lane, room=room, timeout=timeout)
        decode.submit("recv_wait_terminal", lane=lane, room=room, timeout=observe)
        p_out, d_out = gather((prefill, timeout + margin), (decode, observe + margin))
        return d_out, p_out, abort_at, None


@contextlib.contextmanager
def launched(pairs: dict[str, KVPair]) -> Iterator[dict[str, KVPair]]:
    """Launch every pair of ``pairs`` (not waiting for readiness; a pair that fails to launch
    is left for the fixture that waits on it to report), yield them, then close them all and
    check that none of their children survived: a test module or package of KV-harness
    tests leaves no process behind."""
    for pair in pairs.values():
        try:
            pair.launch()
        except HarnessError:
            pass  # reported by the fixture that waits for this pair
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
