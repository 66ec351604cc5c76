"""What one KV harness transfer observed: poll states, per-side outcomes, the transfer result.

Plain data, built in the parent from what the children answer (pickled dicts and page
verdicts). Invariant: imports neither torch nor sglang.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from pdsafe_testkit.kv.pages import PageKind, PageVerdict

__all__ = [
    "KVPOLL_BOOTSTRAPPING",
    "KVPOLL_FAILED",
    "KVPOLL_NAMES",
    "KVPOLL_SUCCESS",
    "KVPOLL_TERMINAL",
    "AbortAt",
    "SideOutcome",
    "TransferResult",
    "side_outcome",
]

#: ``sglang.srt.disaggregation.base.conn.KVPoll`` values (the parent never imports sglang).
KVPOLL_NAMES: dict[int, str] = {
    0: "Failed",
    1: "Bootstrapping",
    2: "WaitingForInput",
    3: "Transferring",
    4: "Success",
}
KVPOLL_FAILED, KVPOLL_BOOTSTRAPPING, KVPOLL_SUCCESS = 0, 1, 4
KVPOLL_TERMINAL = frozenset({KVPOLL_FAILED, KVPOLL_SUCCESS})


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
    #: sglang-pdsafe's KV digest check (``sglang.pdsafe.kv_integrity``) of a transfer decode
    #: commits: ``ok``, ``mismatch``, ``missing``, ``invalid``, ``failed``,
    #: ``hook_api_mismatch`` (the counter it moved), ``not_committed`` (not checked: decode
    #: does not commit it) or ``off`` (the digest is off on decode); its
    #: refusal message; the transfer generation the digest was bound to.
    digest: str = "off"
    digest_message: str = ""
    digest_generation: int | None = None
    #: The test-only bit flips applied in decode's pool after commit, before the check:
    #: (byte before, byte after) each; and the page verdicts re-read after them.
    flips: tuple[tuple[int, int], ...] = ()
    flipped_verdicts: tuple[PageVerdict, ...] = ()
    #: ``transfer(classify=False)``: no per-page verdicts; the decode rows (every layer, K
    #: and V) that hold exactly this request's data, and how many there are to hold it.
    own_rows: int | None = None
    rows_expected: int | None = None
    #: ``transfer(measure=True)`` on a pair with bookkeeping: per side (``prefill``,
    #: ``decode``), what the protections' bookkeeping cost (``bookkeeping.measure_end``).
    cost: dict[str, Any] | None = None
    #: Bookkeeping: prefill's page-generation refusal at Success (None: it stood).
    source_refusal: str | None = None

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
        """Every page OWN (or, without verdicts, every row counted own)."""
        if not self.verdicts and self.own_rows is not None:
            return self.own_rows == self.rows_expected
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
            f" aux_room={self.aux_room} gate={self.gate} digest={self.digest}"
            f"{f' ({self.digest_message})' if self.digest_message else ''}"
            f" wall={self.wall_s * 1e3:.1f}ms pages: {pages}"
        )



def side_outcome(d: dict[str, Any]) -> SideOutcome:
    """A ``SideOutcome`` from the dict a child answers (``Lane.outcome``)."""
    return SideOutcome(
        state=d["state"],
        terminal_at=d.get("terminal_at"),
        failure_reason=d.get("failure_reason"),
        trace=tuple((s, float(t)) for s, t in d.get("trace", ())),
    )
