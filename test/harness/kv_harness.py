"""A model-free KV transfer harness: the REAL sglang Mooncake/NIXL managers in two OS processes.

A prefill process and a decode process (``multiprocessing`` "spawn" context) each publish a
real ``ServerArgs`` (``--device cpu``, transfer backend X) and build the backend's real KV
manager (``get_kv_class(TransferBackend.X, KVClassType.MANAGER)``) over plain CPU torch tensors
standing in for the KV pool, plus sglang's real ``MetadataBuffers`` as the aux buffers. The
prefill process also runs the backend's real bootstrap server. Transfers use the real sender
and receiver classes, driven the way ``disaggregation/prefill.py`` and ``decode.py`` drive
them (``init`` / ``send_metadata`` / ``send`` / ``poll`` / ``abort`` / ``clear``), but without a
scheduler and without a model: the prefill "forward" writes a known pattern into its pages.

Usage::

    from harness.kv_harness import AbortAt, KVPair, PageKind

    with KVPair("mooncake", page_size=(1, 16, 64), num_pages=64) as pair:
        lane = pair.lane(16)                       # or pair.transfer(...) for the first lane
        r = lane.transfer(57, chunk_tokens=32)     # one request, 4 decode pages
        assert r.committed and r.all_own
        r = lane.transfer(64, prefill_tokens=40)   # coverage gap: tail pages keep old bytes
        r = lane.transfer(64, abort=AbortAt.DECODE_BEFORE_SEND)
        r.prefill_terminal_after_abort_s           # how long prefill took to see Failed

A *lane* is one page size: both processes host one per page size of the pair, each with its own
published ``ServerArgs``, bootstrap server (prefill), KV manager, pools and aux buffers (the
process's Mooncake engine is shared, as in sglang). Lanes avoid a process pair per page size:
importing sglang dominates the cost of a pair (~7-10 s per process on an idle 2-core machine).
``ServerArgs.model_path`` points at a weight-less stub (``config.json`` only): publishing
resolves the HF config, but no weights or tokenizer are ever loaded.

Page-content encoding (the oracle)
----------------------------------
Every pool buffer is an int64 tensor of shape ``[(num_pages + 1) * page_size, token_words]``
(one buffer per layer for K and one for V, in MHA order: all K layers, then all V layers).
Page ``p`` is rows ``[p * page_size, (p + 1) * page_size)``; page 0 is sglang's reserved
padding page and is never handed out. Every token row is self-describing:

* word 0: tag = ``magic << 16 | layer << 1 | kv`` (magic says DATA, POISON or STALE),
* word 1: owner: the bootstrap room (DATA), the decode page (POISON), the prefill page (STALE),
* word 2: position: the token index within the request (DATA), the row within the page (else),
* words 3..: check words, a 64-bit mix of (tag, owner, position, word index).

So a decode page can always be classified (``classify_pages``) as this request's data at the
right position (OWN), another request's data with its room decoded (FOREIGN), never written
(POISON: the decode pool is pre-filled with it), prefill memory that no prefill step wrote
(STALE_SOURCE, e.g. the tail of a partially filled last prefill page), misplaced own data, a
mixture, or garbage.

Invariants
----------
* Both children pin every transport to loopback (``SGLANG_HOST_IP=127.0.0.1``,
  ``UCX_NET_DEVICES=lo``, ``MOONCAKE_PROTOCOL=tcp``, bootstrap host 127.0.0.1); ports come
  from the OS.
* The parent process never imports torch or sglang; only the children do.
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
import enum
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from harness.loopback import reserve_port as free_port
from harness.loopback import transport_pins

__all__ = [
    "BACKENDS",
    "KVPOLL_NAMES",
    "AbortAt",
    "BufferVerdict",
    "HarnessError",
    "KVLane",
    "KVPair",
    "PageKind",
    "PageVerdict",
    "SideOutcome",
    "TransferResult",
    "classify_pages",
    "encode_rows",
    "fill_data_pages",
    "fill_poison_pages",
    "fill_stale_pages",
    "free_port",
    "loopback_env",
    "request_token_ids",
    "write_stub_model_config",
]

BACKENDS: tuple[str, ...] = ("mooncake", "nixl")

#: ``sglang.srt.disaggregation.base.conn.KVPoll`` values (the parent never imports sglang).
KVPOLL_NAMES: dict[int, str] = {
    0: "Failed",
    1: "Bootstrapping",
    2: "WaitingForInput",
    3: "Transferring",
    4: "Success",
}
_FAILED, _BOOTSTRAPPING, _SUCCESS = 0, 1, 4
_TERMINAL = frozenset({_FAILED, _SUCCESS})

#: Seconds between two polls of a sender/receiver (the scheduler polls once per loop).
POLL_INTERVAL_S = 0.0005


class HarnessError(RuntimeError):
    """The harness itself failed (a child died, timed out or raised); carries the log tails."""


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------


def loopback_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment variables that pin every transport of a child to loopback.

    Returned as a delta (not a copy of ``os.environ``); the child applies it to its own
    environment before importing sglang.
    """
    env = {**transport_pins(), "OMP_NUM_THREADS": "1"}
    if extra:
        env.update(extra)
    return env


def write_stub_model_config(directory: Path, num_layers: int) -> Path:
    """A weight-less model directory (``config.json`` only) for ``ServerArgs.model_path``.

    ``ServerArgs.resolve_once`` reads the HF config; no weights or tokenizer are ever loaded.
    """
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "vocab_size": 256,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


# --------------------------------------------------------------------------------------------
# Page-content encoding and classification (pure numpy: usable in any process)
# --------------------------------------------------------------------------------------------

MAGIC_DATA = 0xDA7A5EED01
MAGIC_POISON = 0x0B150B1502
MAGIC_STALE = 0x57A1E5A7E3
_HEADER_WORDS = 3
MIN_TOKEN_WORDS = 4

_U64 = np.uint64
_MIX_C = (
    _U64(0x9E3779B97F4A7C15),
    _U64(0xC2B2AE3D27D4EB4F),
    _U64(0x165667B19E3779F9),
    _U64(0xD6E8FEB86659FD93),
)


def request_token_ids(room: int, num_tokens: int) -> list[int]:
    """The prompt of the request in ``room`` as both sides hold it (prefill a prefix of it when
    it prefills fewer tokens). Feeds the coverage attestation the scheduler hooks compute."""
    rng = random.Random(room)
    return [rng.randrange(4, 512) for _ in range(num_tokens)]


def _mix64(tag: np.ndarray, owner: np.ndarray, pos: np.ndarray, word: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer over a linear combination; all uint64, wrapping arithmetic."""
    with np.errstate(over="ignore"):
        x = tag * _MIX_C[0] + owner * _MIX_C[1] + pos * _MIX_C[2] + word * _MIX_C[3]
        x = x ^ (x >> _U64(30))
        x = x * _U64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> _U64(27))
        x = x * _U64(0x94D049BB133111EB)
        return x ^ (x >> _U64(31))


def _tag(magic: int, layer: int, kv: int) -> int:
    if not 0 <= layer < (1 << 15):
        raise ValueError(f"layer {layer} out of range")
    return (magic << 16) | (layer << 1) | (kv & 1)


def encode_rows(
    magic: int, layer: int, kv: int, owner: np.ndarray, pos: np.ndarray, token_words: int
) -> np.ndarray:
    """Token rows (uint64 ``[n, token_words]``) for the given owners and positions.

    ``owner`` and ``pos`` are broadcast to the same length ``n``.
    """
    if token_words < MIN_TOKEN_WORDS:
        raise ValueError(f"token_words must be >= {MIN_TOKEN_WORDS}")
    owner_u, pos_u = np.broadcast_arrays(
        np.asarray(owner, dtype=np.uint64), np.asarray(pos, dtype=np.uint64)
    )
    n = owner_u.shape[0]
    rows = np.empty((n, token_words), dtype=np.uint64)
    tag = _U64(_tag(magic, layer, kv))
    rows[:, 0] = tag
    rows[:, 1] = owner_u
    rows[:, 2] = pos_u
    words = np.arange(_HEADER_WORDS, token_words, dtype=np.uint64)[None, :]
    rows[:, _HEADER_WORDS:] = _mix64(tag, owner_u[:, None], pos_u[:, None], words)
    return rows


def _as_u64(buf: Any) -> np.ndarray:
    """A writable uint64 numpy view of a 2-D int64/uint64 torch tensor or numpy array."""
    arr = buf.numpy() if hasattr(buf, "numpy") and not isinstance(buf, np.ndarray) else buf
    arr = np.asarray(arr)
    if arr.dtype not in (np.int64, np.uint64) or arr.ndim != 2:
        raise TypeError(f"pool buffers must be 2-D int64/uint64, got {arr.dtype} {arr.shape}")
    return arr.view(np.uint64)


def _page_rows(page: int, page_size: int, start: int = 0, stop: int | None = None) -> slice:
    stop = page_size if stop is None else stop
    return slice(page * page_size + start, page * page_size + stop)


def fill_poison_pages(
    buffers: Sequence[Any],
    layer_kv: Sequence[tuple[int, int]],
    pages: Iterable[int],
    page_size: int,
) -> None:
    """Write the POISON pattern (owner = the page itself) into every row of ``pages``."""
    for buf, (layer, kv) in zip(buffers, layer_kv, strict=True):
        arr = _as_u64(buf)
        for page in pages:
            arr[_page_rows(page, page_size)] = encode_rows(
                MAGIC_POISON,
                layer,
                kv,
                np.full(page_size, page),
                np.arange(page_size),
                arr.shape[1],
            )


def fill_stale_pages(
    buffers: Sequence[Any],
    layer_kv: Sequence[tuple[int, int]],
    pages: Iterable[int],
    page_size: int,
) -> None:
    """Write the STALE pattern (prefill memory no prefill step wrote) into ``pages``."""
    for buf, (layer, kv) in zip(buffers, layer_kv, strict=True):
        arr = _as_u64(buf)
        for page in pages:
            arr[_page_rows(page, page_size)] = encode_rows(
                MAGIC_STALE,
                layer,
                kv,
                np.full(page_size, page),
                np.arange(page_size),
                arr.shape[1],
            )


def fill_data_pages(
    buffers: Sequence[Any],
    layer_kv: Sequence[tuple[int, int]],
    pages: Sequence[int],
    page_size: int,
    room: int,
    token_start: int,
    token_stop: int,
) -> None:
    """Write ``room``'s DATA rows for request tokens ``[token_start, token_stop)``.

    ``pages[i]`` holds request tokens ``[i * page_size, (i + 1) * page_size)``; rows of those
    pages outside the token range are left untouched.
    """
    for buf, (layer, kv) in zip(buffers, layer_kv, strict=True):
        arr = _as_u64(buf)
        tok = token_start
        while tok < token_stop:
            pos_in_req = tok // page_size
            row0 = tok % page_size
            row1 = min(page_size, row0 + (token_stop - tok))
            positions = np.arange(tok, tok + (row1 - row0))
            arr[_page_rows(pages[pos_in_req], page_size, row0, row1)] = encode_rows(
                MAGIC_DATA,
                layer,
                kv,
                np.full(len(positions), room, dtype=np.uint64),
                positions,
                arr.shape[1],
            )
            tok += row1 - row0


class PageKind(str, enum.Enum):
    """What a decode page (or one layer's K/V of it) holds. Only the request's tokens count."""

    OWN = "own"  #: this request's data, right position, right layer and K/V
    FOREIGN = "foreign"  #: another request's data (its room is decoded into ``rooms``)
    POISON = "poison"  #: never written since the decode pool was (re)poisoned
    STALE_SOURCE = "stale_source"  #: prefill memory that no prefill step wrote
    MISPLACED = "misplaced"  #: this request's data at the wrong position/layer/K-V
    CORRUPT = "corrupt"  #: no valid pattern (torn or foreign bytes)
    MIXED = "mixed"  #: rows of different kinds


@dataclass(frozen=True)
class BufferVerdict:
    """One layer's K or V rows of one page: ``kinds`` has one entry per significant token."""

    layer: int
    kv: str  #: "k" or "v"
    kind: PageKind
    rooms: tuple[int, ...]  #: distinct rooms whose DATA rows were seen (own included)
    kinds: tuple[PageKind, ...]


@dataclass(frozen=True)
class PageVerdict:
    """Classification of one decode page reserved for a request.

    Invariants: ``kind`` is the common kind of every buffer verdict, or MIXED;
    ``rooms`` is the union of the buffers' rooms; ``tokens`` is the number of request tokens
    the page holds (``page_size`` except possibly for the last page).
    """

    position: int  #: page index within the request
    page: int  #: decode page index
    tokens: int
    kind: PageKind
    rooms: tuple[int, ...]
    buffers: tuple[BufferVerdict, ...]

    def foreign_rooms(self, own_room: int) -> tuple[int, ...]:
        return tuple(r for r in self.rooms if r != own_room)


def _classify_rows(
    rows: np.ndarray, layer: int, kv: int, room: int, first_pos: int
) -> tuple[list[PageKind], set[int]]:
    tag = rows[:, 0]
    owner = rows[:, 1]
    pos = rows[:, 2]
    magic = tag >> _U64(16)
    words = np.arange(_HEADER_WORDS, rows.shape[1], dtype=np.uint64)[None, :]
    valid = np.all(
        rows[:, _HEADER_WORDS:] == _mix64(tag[:, None], owner[:, None], pos[:, None], words),
        axis=1,
    )
    own_tag = _U64(_tag(MAGIC_DATA, layer, kv))
    kinds: list[PageKind] = []
    rooms: set[int] = set()
    for i in range(rows.shape[0]):
        m = int(magic[i])
        if not valid[i]:
            kinds.append(PageKind.CORRUPT)
        elif m == MAGIC_DATA:
            r = int(owner[i])
            rooms.add(r)
            if r != room:
                kinds.append(PageKind.FOREIGN)
            elif tag[i] == own_tag and int(pos[i]) == first_pos + i:
                kinds.append(PageKind.OWN)
            else:
                kinds.append(PageKind.MISPLACED)
        elif m == MAGIC_POISON:
            kinds.append(PageKind.POISON)
        elif m == MAGIC_STALE:
            kinds.append(PageKind.STALE_SOURCE)
        else:
            kinds.append(PageKind.CORRUPT)
    return kinds, rooms


def _merge(kinds: Iterable[PageKind]) -> PageKind:
    distinct = set(kinds)
    return distinct.pop() if len(distinct) == 1 else PageKind.MIXED


def classify_pages(
    buffers: Sequence[Any],
    layer_kv: Sequence[tuple[int, int]],
    *,
    page_size: int,
    pages: Sequence[int],
    room: int,
    num_tokens: int,
) -> list[PageVerdict]:
    """Classify the decode pages reserved for request ``room`` of ``num_tokens`` tokens.

    ``buffers[i]`` is the pool buffer of ``layer_kv[i] = (layer, kv)`` (kv 0 = K, 1 = V);
    ``pages[j]`` is the decode page that should hold request tokens
    ``[j * page_size, min((j + 1) * page_size, num_tokens))``. Rows past ``num_tokens`` in the
    last page are not part of the request and are ignored.
    """
    if len(pages) * page_size < num_tokens:
        raise ValueError(f"{len(pages)} pages of {page_size} cannot hold {num_tokens} tokens")
    arrays = [_as_u64(b) for b in buffers]
    verdicts: list[PageVerdict] = []
    for position, page in enumerate(pages):
        tokens = max(0, min(page_size, num_tokens - position * page_size))
        bvs: list[BufferVerdict] = []
        for arr, (layer, kv) in zip(arrays, layer_kv, strict=True):
            rows = arr[_page_rows(page, page_size, 0, tokens)]
            kinds, rooms = _classify_rows(rows, layer, kv, room, position * page_size)
            bvs.append(
                BufferVerdict(
                    layer=layer,
                    kv="kv"[kv],
                    kind=_merge(kinds) if kinds else PageKind.OWN,
                    rooms=tuple(sorted(rooms)),
                    kinds=tuple(kinds),
                )
            )
        verdicts.append(
            PageVerdict(
                position=position,
                page=int(page),
                tokens=tokens,
                kind=_merge(b.kind for b in bvs),
                rooms=tuple(sorted({r for b in bvs for r in b.rooms})),
                buffers=tuple(bvs),
            )
        )
    return verdicts


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


class AbortAt(str, enum.Enum):
    """Where ``KVPair.transfer`` aborts the transfer, and from which side.

    ``*_BEFORE_SEND``: after decode published its pages and prefill saw WaitingForInput and
    ran ``sender.init``, before the first ``sender.send``. ``*_AFTER_FIRST_CHUNK``: after the
    first of several chunks was handed to ``sender.send`` (needs ``chunk_tokens``).
    Decode aborts with ``receiver.abort()`` (what the decode scheduler does on an abort);
    prefill with ``sender.abort()`` then ``failure_exception()`` (the prefill scheduler's
    abort path).
    """

    NONE = "none"
    DECODE_BEFORE_SEND = "decode_before_send"
    PREFILL_BEFORE_SEND = "prefill_before_send"
    DECODE_AFTER_FIRST_CHUNK = "decode_after_first_chunk"
    PREFILL_AFTER_FIRST_CHUNK = "prefill_after_first_chunk"

    @property
    def side(self) -> str | None:
        return None if self is AbortAt.NONE else self.value.split("_", 1)[0]


@dataclass(frozen=True)
class SideOutcome:
    """What one side observed for one room.

    ``state`` is the last polled state (terminal, or the state when the wait timed out);
    ``terminal_at`` is the monotonic time of the first terminal poll (None: never terminal
    within the wait); ``failure_reason`` is the text of the ``KVTransferError`` that
    ``failure_exception()`` raised for a Failed side (what the scheduler logs), else None;
    ``trace`` lists ``(state name, monotonic time)`` at every observed state change.
    Monotonic clocks are system-wide on Linux: times of both sides and the parent compare.
    """

    state: str
    terminal_at: float | None
    failure_reason: str | None
    trace: tuple[tuple[str, float], ...]

    @property
    def terminal(self) -> bool:
        return self.terminal_at is not None


@dataclass(frozen=True)
class TransferResult:
    """Outcome of one ``KVPair.transfer``.

    ``verdicts`` classify the decode pages reserved for the request, read after both sides
    settled (reached a terminal state or their wait timed out). ``aux_room`` is the
    ``bootstrap_room`` decode read from its metadata slot, the only thing stock decode checks
    before committing. ``wall_s`` runs from the sender's creation until both sides were
    terminal (or until ``transfer`` gave up on one). Times ``*_at`` are ``time.monotonic()``.
    """

    backend: str
    page_size: int
    room: int
    num_tokens: int
    prefill_tokens: int
    decode_pages: tuple[int, ...]
    prefill_pages: tuple[int, ...]
    chunks: int
    abort: AbortAt
    started_at: float
    abort_at: float | None
    decode: SideOutcome
    prefill: SideOutcome
    wall_s: float
    aux_room: int | None
    decode_abort_ack_at: float | None
    verdicts: tuple[PageVerdict, ...]
    #: sglang-pdsafe's commit gate on decode's metadata row (``sglang.pdsafe.coverage``):
    #: ``ok``, ``mismatch``, ``missing`` or ``corrupt``; and its refusal message.
    gate: str = "missing"
    gate_message: str = ""

    @property
    def decode_state(self) -> str:
        return self.decode.state

    @property
    def prefill_state(self) -> str:
        return self.prefill.state

    @property
    def kinds(self) -> list[PageKind]:
        return [v.kind for v in self.verdicts]

    @property
    def all_own(self) -> bool:
        return all(v.kind is PageKind.OWN for v in self.verdicts)

    @property
    def committed(self) -> bool:
        """Stock decode would commit: Success and the aux room matches."""
        return self.decode.state == "Success" and self.aux_room == self.room

    @property
    def gate_commits(self) -> bool:
        """sglang-pdsafe decode commits: Success and the coverage attestation matches."""
        return self.decode.state == "Success" and self.gate == "ok"

    def _after_abort(self, t: float | None) -> float | None:
        if t is None or self.abort_at is None:
            return None
        return t - self.abort_at

    @property
    def decode_terminal_after_abort_s(self) -> float | None:
        return self._after_abort(self.decode.terminal_at)

    @property
    def prefill_terminal_after_abort_s(self) -> float | None:
        return self._after_abort(self.prefill.terminal_at)

    @property
    def decode_abort_ack_after_abort_s(self) -> float | None:
        return self._after_abort(self.decode_abort_ack_at)

    def describe(self) -> str:
        """A one-line summary (states, reasons, aux room, page verdicts) for messages."""
        pages = " ".join(
            f"{v.position}@{v.page}:{v.kind.value}"
            + (f"{list(v.foreign_rooms(self.room))}" if v.foreign_rooms(self.room) else "")
            for v in self.verdicts
        )
        return (
            f"[{self.backend} ps={self.page_size} room={self.room} tokens={self.num_tokens} "
            f"prefill_tokens={self.prefill_tokens} chunks={self.chunks} abort={self.abort.value}]"
            f" decode={self.decode.state} ({self.decode.failure_reason})"
            f" prefill={self.prefill.state} ({self.prefill.failure_reason})"
            f" aux_room={self.aux_room} wall={self.wall_s * 1e3:.1f}ms pages: {pages}"
        )


# --------------------------------------------------------------------------------------------
# Child processes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ChildConfig:
    role: str  # "prefill" | "decode"
    backend: str
    page_sizes: tuple[int, ...]  # one lane per page size
    bootstrap_ports: tuple[int, ...]  # one bootstrap server per lane (prefill hosts them)
    num_pages: int
    num_layers: int
    token_words: int
    aux_slots: int
    http_port: int
    env: dict[str, str]
    parent_pid: int
    log_level: str
    model_dir: str


def _set_pdeathsig() -> None:
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _watch_parent(parent_pid: int) -> None:
    def loop() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(3)

    threading.Thread(target=loop, name="kv-harness-parent-watch", daemon=True).start()


def _child_main(
    cfg: _ChildConfig, conn: multiprocessing.connection.Connection, log_path: str
) -> None:
    """Entry point of a child: redirect output, build the side, then serve commands forever.

    Replies ``("ok", value)`` or ``("err", traceback text)``; ``shutdown`` replies and then
    ``os._exit(0)`` (backend threads are not joinable).
    """
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    _set_pdeathsig()
    _watch_parent(cfg.parent_pid)
    os.environ.update(cfg.env)
    logging.basicConfig(
        level=cfg.log_level,
        format=f"%(asctime)s {cfg.role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        side = _Side(cfg)
        conn.send(("ok", side.ready_info()))
    except BaseException:
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            conn.send(("err", tb))
        os._exit(2)
    while True:
        try:
            cmd, kwargs = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        if cmd == "shutdown":
            with contextlib.suppress(Exception):
                side.shutdown()
            with contextlib.suppress(Exception):
                conn.send(("ok", None))
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        try:
            lane = side.lanes[kwargs.pop("lane")]
            result = getattr(lane, f"cmd_{cmd}")(**kwargs)
            conn.send(("ok", result))
        except BaseException:
            tb = traceback.format_exc()
            print(f"command {cmd} failed:\n{tb}", file=sys.stderr, flush=True)
            conn.send(("err", tb))


def _poll_until(
    poll: Callable[[], int], timeout: float, stop: Callable[[int], bool]
) -> tuple[int, float | None, list[tuple[str, float]]]:
    """Poll until ``stop(state)`` or timeout; returns (last state, time stop held, trace)."""
    trace: list[tuple[str, float]] = []
    deadline = time.monotonic() + timeout
    last: int | None = None
    while True:
        state = int(poll())
        now = time.monotonic()
        if state != last:
            trace.append((KVPOLL_NAMES.get(state, str(state)), now))
            last = state
        if stop(state):
            return state, now, trace
        if now >= deadline:
            return state, None, trace
        time.sleep(POLL_INTERVAL_S)


class _Side:
    """One child process: a lane per page size, built one after the other."""

    def __init__(self, cfg: _ChildConfig) -> None:
        t0 = time.monotonic()
        import sglang.srt.disaggregation.utils  # noqa: F401  (the heavy import, timed apart)
        import sglang.srt.server_args  # noqa: F401
        import torch

        torch.set_num_threads(1)
        self.cfg = cfg

        self.import_s = time.monotonic() - t0
        self.lane_s: dict[int, float] = {}
        self.lanes: dict[int, _Lane] = {}
        for page_size, port in zip(cfg.page_sizes, cfg.bootstrap_ports, strict=True):
            t1 = time.monotonic()
            lane_cls = _PrefillLane if cfg.role == "prefill" else _DecodeLane
            self.lanes[page_size] = lane_cls(cfg, page_size, port)
            self.lane_s[page_size] = time.monotonic() - t1

    def ready_info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "import_s": self.import_s, "lane_s": self.lane_s}

    def shutdown(self) -> None:
        for lane in self.lanes.values():
            with contextlib.suppress(Exception):
                lane.shutdown()


_MOONCAKE_ENGINE_READY = False


class _Lane:
    """Everything of one page size: a published ServerArgs, pool, aux buffers, manager.

    Invariants: the pool buffers, the ``MetadataBuffers`` and the ``KVArgs`` stay referenced
    for the life of the process (the manager registered their addresses with the engine).
    """

    def __init__(self, cfg: _ChildConfig, page_size: int, bootstrap_port: int) -> None:
        import torch
        from sglang.srt.disaggregation.utils import (
            DisaggregationMode,
            KVClassType,
            MetadataBuffers,
            ReqToMetadataIdxAllocator,
            TransferBackend,
            get_kv_class,
        )
        from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
        from sglang.srt.server_args import ServerArgs

        self.cfg = cfg
        self.page_size = page_size
        self.get_kv_class = get_kv_class
        self.KVClassType = KVClassType
        self.backend = TransferBackend(cfg.backend)
        self.mode = DisaggregationMode(cfg.role)
        self.bootstrap_port = bootstrap_port
        self.bootstrap_addr = f"127.0.0.1:{bootstrap_port}"
        self.server_args = ServerArgs(
            model_path=cfg.model_dir,
            skip_tokenizer_init=True,
            device="cpu",
            host="127.0.0.1",
            port=cfg.http_port,
            page_size=page_size,
            disaggregation_mode=cfg.role,
            disaggregation_transfer_backend=cfg.backend,
            disaggregation_bootstrap_port=bootstrap_port,
        )
        # Last publish wins: the manager reads the bootstrap port from the published config
        # only in its constructor; nothing else published differs between lanes.
        publish(self.server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
        # No torch.distributed here: there is no pipeline group to build (pp_size is 1).
        get_parallel().override_permanently(pp_group=None)

        # KV "pool": MHA layout, all K layers then all V layers (get_contiguous_buf_infos).
        rows = (cfg.num_pages + 1) * page_size
        self.layer_kv: list[tuple[int, int]] = [
            (layer, kv) for kv in (0, 1) for layer in range(cfg.num_layers)
        ]
        self.buffers = [
            torch.zeros((rows, cfg.token_words), dtype=torch.int64) for _ in self.layer_kv
        ]
        self.item_len = page_size * cfg.token_words * 8
        self.metadata = MetadataBuffers(
            cfg.aux_slots,
            hidden_size=16,
            hidden_states_dtype=torch.float32,
            max_sampling_mask_tokens=self.server_args.sampling_mask_max_tokens,
        )
        self.aux_alloc = ReqToMetadataIdxAllocator(cfg.aux_slots)

        kv_args = get_kv_class(self.backend, KVClassType.KVARGS)()
        kv_args.engine_rank = 0
        kv_args.pp_rank = 0
        kv_args.system_dp_rank = None
        kv_args.rust_http_port = None
        kv_args.kv_cache_dtype_str = "auto"
        kv_args.kv_layout = None
        kv_args.prefill_start_layer = 0
        kv_args.prefill_end_layer = cfg.num_layers
        kv_args.kv_data_ptrs = [b.data_ptr() for b in self.buffers]
        kv_args.kv_data_lens = [b.nbytes for b in self.buffers]
        kv_args.kv_item_lens = [self.item_len for _ in self.buffers]
        kv_args.num_draft_entries = 0
        kv_args.kv_layer_ids = []  # positional pairing, as build_kv_layer_ids gives for MHA
        if self.backend == TransferBackend.NIXL:
            kv_args.kv_data_mem_kinds = ["DRAM"] * len(self.buffers)
        kv_args.kv_head_num = 1
        kv_args.total_kv_head_num = 1
        kv_args.page_size = page_size
        kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = (
            self.metadata.get_buf_infos()
        )
        kv_args.ib_device = None
        kv_args.gpu_id = 0
        # setup_state_kv_args for a plain MHA pool: no state components.
        kv_args.state_types = []
        kv_args.state_data_ptrs = []
        kv_args.state_data_lens = []
        kv_args.state_item_lens = []
        kv_args.state_dim_per_tensor = []
        kv_args.state_slice_outer_counts = []
        kv_args.state_layer_ids = []
        kv_args.is_hybrid_mla_backend = False
        kv_args.state_conv_shard_groups = []
        kv_args.swa_kv_cache_layout = None
        kv_args.mla_compression_ratios = None
        self.kv_args = kv_args

        global _MOONCAKE_ENGINE_READY
        if self.backend == TransferBackend.MOONCAKE and not _MOONCAKE_ENGINE_READY:
            # What the scheduler does before building its KV manager (one engine/process).
            from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
                maybe_init_shared_mooncake_transfer_engine,
            )

            maybe_init_shared_mooncake_transfer_engine(gpu_id=0)
            _MOONCAKE_ENGINE_READY = True
        self._before_manager()
        manager_cls = get_kv_class(self.backend, KVClassType.MANAGER)
        self.mgr = manager_cls(kv_args, self.mode, self.server_args, False)

    def _before_manager(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def _failure_reason(self, room: int) -> str | None:
        with self.mgr.failure_lock:
            return self.mgr.failure_records.get(room)

    def _outcome(
        self, room: int, state: int, at: float | None, trace: list[tuple[str, float]]
    ) -> dict[str, Any]:
        return {
            "state": KVPOLL_NAMES.get(state, str(state)),
            "terminal_at": at,
            "failure_reason": self._failure_reason(room),
            "trace": list(trace),
        }

    def cmd_ping(self) -> float:
        return time.monotonic()


@dataclass
class _SendPlan:
    sender: Any
    aux_index: int | None = None
    pages: list[int] = field(default_factory=list)
    segments: list[tuple[int, int]] = field(default_factory=list)
    next_segment: int = 0
    trace: list[tuple[str, float]] = field(default_factory=list)


class _PrefillLane(_Lane):
    """Prefill lane: bootstrap server + manager in PREFILL mode + one sender per room."""

    def _before_manager(self) -> None:
        # The bootstrap server (started by the prefill's HTTP side in sglang) must listen
        # before the manager registers to it.
        server_cls = self.get_kv_class(self.backend, self.KVClassType.BOOTSTRAP_SERVER)
        self.bootstrap_server = server_cls(host="127.0.0.1", port=self.bootstrap_port)
        self.plans: dict[int, _SendPlan] = {}

    def shutdown(self) -> None:
        # Stop the server loop without close()'s 2 s thread join: the process exits next.
        loop = getattr(self.bootstrap_server, "_loop", None)
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(loop.stop)

    def cmd_send_open(self, room: int) -> None:
        """A request arrives at prefill: create its real sender (Bootstrapping)."""
        if room in self.plans:
            raise ValueError(f"room {room} already open on prefill")
        sender_cls = self.get_kv_class(self.backend, self.KVClassType.SENDER)
        sender = sender_cls(
            mgr=self.mgr,
            bootstrap_addr=self.bootstrap_addr,
            bootstrap_room=room,
            req_has_disagg_prefill_dp_rank=False,
        )
        self.plans[room] = _SendPlan(sender=sender)

    def cmd_send_wait_ready(self, room: int, timeout: float) -> dict[str, Any]:
        """Poll until decode's metadata arrived (WaitingForInput) or a terminal state."""
        plan = self.plans[room]
        state, at, trace = _poll_until(plan.sender.poll, timeout, lambda s: s != _BOOTSTRAPPING)
        plan.trace.extend(trace)
        return self._outcome(room, state, at, plan.trace)

    def cmd_send_prepare(
        self, room: int, prefill_tokens: int, pages: list[int], chunk_tokens: int | None
    ) -> int:
        """``finalize_bootstrap``: metadata slot + ``sender.init(num_pages, aux_index)``.

        Also fills the request's prefill pages with STALE rows (memory no forward wrote yet)
        and plans the chunk segments the way ``_send_kv_chunk`` cuts them (non-last chunks end
        on a page boundary). Returns the number of chunks.
        """
        ps = self.page_size
        num_pages = -(-prefill_tokens // ps)
        if len(pages) != num_pages:
            raise ValueError(f"{prefill_tokens} tokens need {num_pages} prefill pages")
        plan = self.plans[room]
        plan.aux_index = self.aux_alloc.alloc()
        if plan.aux_index is None:
            raise RuntimeError("prefill metadata slots exhausted")
        plan.pages = list(pages)
        fill_stale_pages(self.buffers, self.layer_kv, pages, ps)
        step = chunk_tokens or prefill_tokens
        segments: list[tuple[int, int]] = []
        start = 0
        while start < prefill_tokens:
            end = min(start + step, prefill_tokens)
            if end < prefill_tokens:
                end -= end % ps
                if end <= start:
                    raise ValueError("chunk_tokens must be >= page_size")
            segments.append((start, end))
            start = end
        plan.segments = segments
        plan.sender.init(num_pages, plan.aux_index)
        return len(segments)

    def cmd_send_run(
        self, room: int, max_chunks: int | None = None, wait_timeout: float | None = None
    ) -> dict[str, Any]:
        """Forward + ``send`` up to ``max_chunks`` chunks, then optionally poll to terminal.

        Each chunk's DATA rows are written right before its ``sender.send``; the last chunk
        also writes the metadata row first (``set_buf``: first output id, bootstrap_room).
        """
        plan = self.plans[room]
        ps = self.page_size
        sent = 0
        while plan.next_segment < len(plan.segments) and (max_chunks is None or sent < max_chunks):
            start, end = plan.segments[plan.next_segment]
            last = plan.next_segment == len(plan.segments) - 1
            fill_data_pages(self.buffers, self.layer_kv, plan.pages, ps, room, start, end)
            if last:
                idx = plan.aux_index
                self.metadata.output_ids[idx][0] = room % 32000
                self.metadata.bootstrap_room[idx, 0] = room
                # What the patched scheduler does after set_buf (patch 0014): attest exactly
                # the positions [0, end) this prefill wrote.
                from sglang.pdsafe import coverage

                coverage.attest_prefill_hook(
                    self.metadata,
                    SimpleNamespace(bootstrap_room=room, metadata_buffer_index=idx,
                                    origin_input_ids=request_token_ids(room, end),
                                    disagg_decode_prefix_len=0),
                    end, ps)
            page_indices = np.asarray(plan.pages[start // ps : -(-end // ps)], dtype=np.int64)
            # The scheduler passes state_indices=[] on the last chunk (no state types here).
            plan.sender.send(page_indices, [] if last else None, num_kv_tokens=end - start)
            plan.next_segment += 1
            sent += 1
        result: dict[str, Any] = {"sent": sent, "remaining": len(plan.segments) - plan.next_segment}
        if wait_timeout is not None:
            result.update(self.cmd_send_wait_terminal(room, wait_timeout))
        return result

    def cmd_send_wait_terminal(self, room: int, timeout: float) -> dict[str, Any]:
        plan = self.plans[room]
        state, at, trace = _poll_until(plan.sender.poll, timeout, lambda s: s in _TERMINAL)
        plan.trace.extend(trace)
        return self._outcome(room, state, at, plan.trace)

    def cmd_send_abort(self, room: int) -> float:
        """The prefill scheduler's abort path: ``sender.abort()``; returns when it ran."""
        t = time.monotonic()
        self.plans[room].sender.abort()
        return t

    def cmd_send_finish(self, room: int) -> dict[str, Any]:
        """Retire the request as the scheduler does; never leaves room state behind.

        Success: ``sender.clear()``. Failed: ``failure_exception()`` (which clears). Not
        terminal: ``abort()`` then ``failure_exception()``. Frees the metadata slot.
        """
        plan = self.plans.pop(room)
        sender = plan.sender
        state = int(sender.poll())
        reason = self._failure_reason(room)
        if state == _SUCCESS:
            sender.clear()
        else:
            if state != _FAILED:
                sender.abort()
            try:
                sender.failure_exception()
            except Exception as e:  # KVTransferError
                reason = str(e)
        if plan.aux_index is not None:
            self.metadata.clear_slot(plan.aux_index)
            self.aux_alloc.free(plan.aux_index)
        return {"state": KVPOLL_NAMES[state], "failure_reason": reason, "trace": plan.trace}


@dataclass
class _RecvState:
    receiver: Any
    pages: list[int]
    aux_index: int | None = None
    trace: list[tuple[str, float]] = field(default_factory=list)


class _DecodeLane(_Lane):
    """Decode lane: manager in DECODE mode + one receiver per room."""

    def _before_manager(self) -> None:
        self.recvs: dict[int, _RecvState] = {}
        self.cmd_poison(None)

    def cmd_connect(self, timeout: float) -> float:
        """``try_ensure_parallel_info`` until the prefill registered; returns seconds taken."""
        t0 = time.monotonic()
        while not self.mgr.try_ensure_parallel_info(self.bootstrap_addr):
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"prefill never registered at {self.bootstrap_addr}")
            time.sleep(0.05)
        return time.monotonic() - t0

    def cmd_poison(self, pages: list[int] | None) -> None:
        """Re-poison decode pages (all usable pages when None)."""
        targets = range(1, self.cfg.num_pages + 1) if pages is None else pages
        fill_poison_pages(self.buffers, self.layer_kv, targets, self.page_size)

    def cmd_recv_open(self, room: int, pages: list[int]) -> dict[str, Any]:
        """Receiver creation, ``init`` and ``send_metadata`` (the pre-allocation step)."""
        if room in self.recvs:
            raise ValueError(f"room {room} already open on decode")
        receiver_cls = self.get_kv_class(self.backend, self.KVClassType.RECEIVER)
        receiver = receiver_cls(
            mgr=self.mgr, bootstrap_addr=self.bootstrap_addr, bootstrap_room=room
        )
        st = _RecvState(receiver=receiver, pages=list(pages))
        self.recvs[room] = st
        receiver.init(0)  # prefill dp_size is 1: _resolve_prefill_dp_rank gives 0
        st.aux_index = self.aux_alloc.alloc()
        if st.aux_index is None:
            raise RuntimeError("decode metadata slots exhausted")
        receiver.send_metadata(
            np.asarray(pages, dtype=np.int32), st.aux_index, [], decode_prefix_len=0
        )
        state = int(receiver.poll())
        st.trace.append((KVPOLL_NAMES[state], time.monotonic()))
        return self._outcome(room, state, None, st.trace)

    def cmd_recv_wait_terminal(self, room: int, timeout: float) -> dict[str, Any]:
        st = self.recvs[room]
        state, at, trace = _poll_until(st.receiver.poll, timeout, lambda s: s in _TERMINAL)
        st.trace.extend(trace)
        return self._outcome(room, state, at, st.trace)

    def cmd_recv_abort(self, room: int) -> float:
        """The decode scheduler's abort: ``receiver.abort()`` (ABORT to every prefill rank)."""
        t = time.monotonic()
        self.recvs[room].receiver.abort()
        return t

    def cmd_recv_wait_abort_ack(self, room: int, timeout: float) -> float | None:
        """Time the drained ABORT_ACK arrived (deferred KV release), None if it did not."""
        st = self.recvs[room]
        if not self.mgr.enable_deferred_decode_kv_release:
            return None
        required = getattr(st.receiver, "required_prefill_response_num", 1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.mgr.is_abort_release_safe(room, required):
                return time.monotonic()
            time.sleep(POLL_INTERVAL_S)
        return None

    def cmd_recv_finish(self, room: int, num_tokens: int) -> dict[str, Any]:
        """Classify the request's pages and read its aux row, then retire the receiver.

        Not terminal: ``abort()`` first (as the waiting timeout does). Failed:
        ``failure_exception()``. Always clears deferred-abort state and frees the slot.
        """
        st = self.recvs.pop(room)
        receiver = st.receiver
        verdicts = classify_pages(
            self.buffers,
            self.layer_kv,
            page_size=self.page_size,
            pages=st.pages,
            room=room,
            num_tokens=num_tokens,
        )
        aux_room = int(self.metadata.bootstrap_room[st.aux_index, 0].item())
        # The patched scheduler's decode side (patches 0004 + 0014): the reservation noted
        # when the page indices went out, checked by the commit gate before commit.
        from sglang.pdsafe import coverage

        decode_req = SimpleNamespace(
            req=SimpleNamespace(rid=f"kv-harness-{room}", bootstrap_room=room, output_ids=[],
                                origin_input_ids=request_token_ids(room, num_tokens)),
            metadata_buffer_index=st.aux_index)
        coverage.note_reservation_hook(object(), decode_req, st.pages, self.page_size, 0)
        gate = coverage.check_commit_hook(SimpleNamespace(metadata_buffers=self.metadata),
                                          decode_req)
        state = int(receiver.poll())
        reason = self._failure_reason(room)
        if state == _SUCCESS:
            receiver.clear()
        else:
            if state != _FAILED:
                receiver.abort()
            try:
                receiver.failure_exception()
            except Exception as e:  # KVTransferError
                reason = str(e)
        self.mgr.clear_deferred_abort_state(room)
        self.metadata.clear_slot(st.aux_index)
        self.aux_alloc.free(st.aux_index)
        return {
            "state": KVPOLL_NAMES[state],
            "failure_reason": reason,
            "aux_room": aux_room,
            "gate": gate.outcome.value,
            "gate_message": gate.message,
            "verdicts": verdicts,
        }


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------


class _Child:
    """One spawned child and its command pipe; at most one command in flight."""

    def __init__(self, cfg: _ChildConfig, log_path: Path) -> None:
        self.cfg = cfg
        self.log_path = log_path
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=_child_main,
            args=(cfg, child_conn, str(log_path)),
            name=f"kv-harness-{cfg.role}",
            daemon=True,
        )
        self.proc.start()
        child_conn.close()
        self.pending: str | None = "startup"

    def log_tail(self, max_chars: int = 6000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"<no log: {e}>"
        return text[-max_chars:]

    def submit(self, cmd: str, **kwargs: Any) -> None:
        if self.pending is not None:
            raise HarnessError(f"{self.cfg.role}: {cmd} submitted while {self.pending} pending")
        if not self.proc.is_alive():
            raise HarnessError(
                f"{self.cfg.role} child is dead (exit {self.proc.exitcode}); cannot run {cmd}\n"
                f"--- {self.cfg.role} log ---\n{self.log_tail()}"
            )
        try:
            self.conn.send((cmd, kwargs))
        except OSError as e:
            raise HarnessError(f"{self.cfg.role} pipe broke sending {cmd}: {e}") from e
        self.pending = cmd

    def result(self, timeout: float) -> Any:
        cmd = self.pending
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.05):
            if not self.proc.is_alive():
                raise HarnessError(
                    f"{self.cfg.role} child died (exit {self.proc.exitcode}) during {cmd}\n"
                    f"--- {self.cfg.role} log ---\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise HarnessError(
                    f"{self.cfg.role} child did not answer {cmd} within {timeout:.0f}s\n"
                    f"--- {self.cfg.role} log ---\n{self.log_tail()}"
                )
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError) as e:
            raise HarnessError(
                f"{self.cfg.role} pipe broke during {cmd}: {e}\n{self.log_tail()}"
            ) from e
        self.pending = None
        if status != "ok":
            raise HarnessError(f"{self.cfg.role} command {cmd} raised:\n{value}")
        return value

    def call(self, cmd: str, wait: float, /, **kwargs: Any) -> Any:
        """Run ``cmd`` in the child; ``wait`` bounds the parent's wait for the answer."""
        self.submit(cmd, **kwargs)
        return self.result(wait)

    def request_stop(self) -> None:
        """Ask an idle, live child to exit (no wait); ``stop`` finishes the job."""
        if self.proc.is_alive() and self.pending is None:
            try:
                self.conn.send(("shutdown", {}))
                self.pending = "shutdown"
            except OSError:
                pass

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful ``shutdown`` when idle, else (or on no answer) terminate, then kill."""
        self.request_stop()
        if self.pending == "shutdown":
            with contextlib.suppress(Exception):
                if self.conn.poll(timeout):
                    self.conn.recv()
            self.proc.join(timeout=timeout)
        for kill in (self.proc.terminate, self.proc.kill):
            if self.proc.is_alive():
                kill()
                self.proc.join(timeout=5)
        self.pending = "stopped"
        with contextlib.suppress(Exception):
            self.conn.close()


def _gather(*pairs: tuple[_Child, float]) -> list[Any]:
    """Results of in-flight commands of several children (all collected, first error raised)."""
    results: list[Any] = []
    error: BaseException | None = None
    for child, timeout in pairs:
        try:
            results.append(child.result(timeout))
        except BaseException as e:  # keep draining the others
            results.append(None)
            error = error or e
    if error is not None:
        raise error
    return results


def _outcome(d: dict[str, Any]) -> SideOutcome:
    return SideOutcome(
        state=d["state"],
        terminal_at=d.get("terminal_at"),
        failure_reason=d.get("failure_reason"),
        trace=tuple((s, float(t)) for s, t in d.get("trace", ())),
    )


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
        self.backend = backend
        self.page_sizes = page_sizes
        self.num_pages = num_pages
        self.num_layers = num_layers
        self.token_words = token_words
        self.aux_slots = aux_slots
        self.startup_timeout = startup_timeout
        self.env = loopback_env(env)
        self.log_level = log_level
        self._own_log_dir = log_dir is None
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="kv-harness-"))
        self._rng = random.Random(seed)
        self._used_rooms: set[int] = set()
        self.prefill: _Child | None = None
        self.decode: _Child | None = None
        self.bootstrap_ports: tuple[int, ...] = ()
        self.broken: str | None = None
        self.warmup = warmup
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

    def _config(self, role: str) -> _ChildConfig:
        return _ChildConfig(
            role=role,
            backend=self.backend,
            page_sizes=self.page_sizes,
            bootstrap_ports=self.bootstrap_ports,
            num_pages=self.num_pages,
            num_layers=self.num_layers,
            token_words=self.token_words,
            aux_slots=self.aux_slots,
            http_port=free_port(),
            env=self.env,
            parent_pid=os.getpid(),
            log_level=self.log_level,
            model_dir=str(self.log_dir / "stub-model"),
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
        self.bootstrap_ports = tuple(free_port() for _ in self.page_sizes)
        try:
            self.prefill = _Child(self._config("prefill"), self.log_dir / "prefill.log")
            self.decode = _Child(self._config("decode"), self.log_dir / "decode.log")
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
            p_info, d_info = _gather(
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

    def _children(self) -> tuple[_Child, _Child]:
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

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def poison_decode_pages(self, pages: Sequence[int] | None = None) -> None:
        """Re-fill decode pages (all usable pages when None) with the POISON pattern."""
        self.pair._children()[1].call(
            "poison", 60.0, lane=self.page_size, pages=None if pages is None else list(pages)
        )

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
        try:
            try:
                prefill.call("send_open", margin, lane=lane, room=room)
                decode.call("recv_open", margin, lane=lane, room=room, pages=d_pages)
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
                        "recv_finish", margin, lane=lane, room=room, num_tokens=num_tokens
                    )
                    p_fin = prefill.call("send_finish", margin, lane=lane, room=room)
        except HarnessError as e:
            self.pair.broken = str(e).splitlines()[0]
            raise
        finished = time.monotonic()
        # A side's failure reason is what its failure_exception() raised, for a Failed side.
        d_side = _outcome(
            {
                **d_out,
                "failure_reason": d_fin["failure_reason"] if d_out["state"] == "Failed" else None,
            }
        )
        p_side = _outcome(
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
            p_out, d_out = _gather((prefill, timeout + margin), (decode, timeout + margin))
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
            p_out, d_out = _gather((prefill, observe + margin), (decode, timeout + margin))
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
        p_out, d_out = _gather((prefill, timeout + margin), (decode, observe + margin))
        return d_out, p_out, abort_at, None
