"""Token-exact coverage attestation between prefill and decode (issue #3, items 4, 5 and 8).

Upstream decode commits a finished transfer after checking only the bootstrap room. Prefill,
however, writes KV for *its* view of the prompt: when the two servers shape a prompt
differently (``--allow-auto-truncate`` with different KV capacities or ``--context-length``, a
different chat template or tokenizer setting, a re-bootstrap length), prefill writes fewer (or
more, or other) positions than decode reserved, and decode then reads pages nobody wrote for
this request: another tenant's KV, served with HTTP 200.

This module closes that hole with an attestation that travels in the metadata row prefill
already transfers for every request (upstream's ``MetadataBuffers.bootstrap_room``, one row of
8 x 64 bit per request of which upstream uses only slot 0). Prefill fills the spare slots at its
last chunk; decode checks them against its own reservation before commit:

====  ===================  ==============================================================
slot  field                meaning
====  ===================  ==============================================================
0     room                 bootstrap room (upstream writes and checks it)
1     magic                ``MAGIC_VERSION``: "pdsafe" + layout version (0 = no attestation)
2     token_digest         blake2b of (room, token ids ``[0, first + count)``) bound to the
                           transfer generation and to the slot's aux rows: the per-transfer
                           binding value, see :func:`token_digest`, :func:`aux_digest` and
                           :func:`bind_transfer`
3     first_token_idx      first position prefill wrote (decode's promised prefix length)
4     token_count          positions prefill wrote: ``[first, first + count)``
5     page_count           pages prefill wrote into decode's reservation
6     page_size            prefill's page size
7     crc                  blake2b of slots 0..6
====  ===================  ==============================================================

Why the existing row and not a new metadata buffer: a new buffer changes the positional aux
buffer list of every backend (Mooncake, NIXL, MORI, Ascend pair buffers by position and stop
at the shorter list, see ``check_peer_aux_buffer_count``), whereas slots of an existing row
are transferred by all of them unchanged, in the same write as the room, so decode's readiness
gate (room != 0) also proves that the attestation landed. A prefill without this module leaves
the slots zero: decode then refuses the transfer ("no attestation") instead of guessing.

Invariants:

* Decode commits a transferred request only if the attestation equals its reservation in
  every field (room, token digest, first token, token count, page count, page size) and the
  row's crc is valid; otherwise the request is aborted with HTTP 500 (``REFUSAL_STATUS``)
  naming both sides' counts,
  ``coverage_mismatch_total`` (or ``coverage_attestation_invalid_total``) is incremented, it
  never decodes, and its pages are freed by the normal failed-commit path.
* The pure functions here (``build_*``, ``encode``, ``decode``, ``verify``) never touch torch
  or a server; the ``*_hook`` functions are the thin glue the patches call.

What the token digest proves and what it does not: it binds the attestation to the exact token
sequence prefill computed KV from (same tokens in the same order, for this room), so a
divergence that keeps the length (a template that differs in one word) is caught as well as one
that changes it. It is *derived* by both sides (decode recomputes it from its own tokens), so
on its own it would not distinguish two transfers of the same room with the same tokens (a
client reusing a room for an identical prompt, or a late row from an earlier attempt of the
same room and prompt). Slot 2 therefore carries it bound to the transfer generation
(:func:`bind_transfer`; :mod:`sglang.pdsafe.transfer_generation`): decode mints a new one
for every reservation and sends it with the metadata, prefill binds the one its decode ranks
sent (``CommonKVSender.pdsafe_transfer_generation``), decode the one it sent
(``CommonKVReceiver.pdsafe_transfer_generation``), so a row written for another reservation of
the room is a ``token_digest`` mismatch. Where no generation travels (a backend without it,
MORI; an earlier prefix of the series) both sides bind 0: the row is then only as fresh as the
room. It also attests what prefill *claims* to have written, not the bytes in the pages (that
is the KV digest's job, whose row binds the generation too).

**Keyed** (layout 3). With a cluster key (:mod:`sglang.pdsafe.control_mac`), slot 2 is a
keyed BLAKE2b under the signing MAC key; decode accepts a row under any key it accepts (a
rotation in progress). Someone who can write decode's metadata memory but holds no key cannot
make a row decode accepts, even knowing the generation (which travels in clear).

**Aux data** (layout 3). The other rows of the request's metadata slot travel in the same aux
transfer: the first output token (``output_ids``), the cached-token counts, the first token's
logprobs and top logprobs, the sampling mask, EAGLE's top-k and hidden states (which seed
speculation) and the DSA top-k indices (:data:`AUX_FIELDS`). Slot 2 also binds a digest of
all of them, whole rows, in the order the transfer registers them (:func:`aux_digest`):
prefill hashes its rows after upstream's ``set_buf``, decode hashes the rows it received, so
a decode never takes a first token, a logprob or a speculation seed from a row that is not the
one prefill wrote for this transfer (a late write of an earlier transfer of the slot, a row
nobody wrote). Every buffer the transfer registers (``MetadataBuffers.get_buf_infos``) must be
one of :data:`AUX_FIELDS` or one of the two rows that carry their own checks (this row and the
KV digest row); a buffer upstream adds that nobody classified fails the check closed
(:class:`UnboundAuxBuffer`: the request is refused, never served with an unchecked field).
"""

from __future__ import annotations

import enum
import hashlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from http import HTTPStatus
from typing import Any

import numpy as np
import torch
from sglang.pdsafe import metrics, peer_policy, policy, transfer
from sglang.pdsafe.policy import hook
from sglang.pdsafe.protections import Protection, register
from sglang.pdsafe.transfer import State
from sglang.srt.disaggregation.utils import prepare_abort

logger = logging.getLogger(__name__)

#: "pdsafe" in ASCII, then a 16-bit layout version (2: slot 2 bound to the transfer
#: generation; 3: and to the slot's aux rows). Positive as int64 (Ascend's row dtype).
MAGIC_VERSION = 0x7064_7361_6665_0003
#: The metadata-slot rows decode reads, bound into slot 2 (upstream 0.5.23's
#: ``MetadataBuffers`` fields; absent ones, such as the sampling mask when it is off, are None
#: there and skipped).
AUX_FIELDS = ("output_ids", "cached_tokens", "output_token_logprobs_val",
              "output_token_logprobs_idx", "output_top_logprobs_val", "output_top_logprobs_idx",
              "output_token_sampling_mask_len", "output_token_sampling_mask_idx",
              "output_token_sampling_logprobs", "output_topk_p", "output_topk_index",
              "output_hidden_states", "output_dsa_topk_indices")
#: Registered rows that carry their own check: this attestation, and the KV digest row.
SELF_CHECKED_FIELDS = ("bootstrap_room", "kv_checksum")
ROW_WIDTH = 8
SLOT_ROOM, SLOT_MAGIC, SLOT_DIGEST, SLOT_FIRST, SLOT_COUNT, SLOT_PAGES, SLOT_PAGE_SIZE, SLOT_CRC = (
    range(ROW_WIDTH)
)
_U64 = (1 << 64) - 1

#: HTTP status of a refused transfer: 500, like upstream's bootstrap-room mismatch (the servers,
#: not the client, disagree). Operators should know that the SMG PD router retries any 5xx from
#: decode (5 attempts by default, each re-running prefill) and counts it against both workers'
#: circuit breakers (10 failures in 120 s open them for 60 s); no 5xx avoids that there.
REFUSAL_STATUS = HTTPStatus.INTERNAL_SERVER_ERROR

#: ``enforce`` (default): refuse mismatching transfers. ``log``: count and log them but commit
#: anyway (only for a rolling upgrade from an unpatched prefill; logs a warning at startup).
ENV_MODE = "SGLANG_PDSAFE_COVERAGE"

OPERATOR_HINT = (
    "Prefill and decode shaped this prompt differently. Give both servers the same "
    "prompt-shaping settings: --context-length, --max-total-tokens together with "
    "--allow-auto-truncate (auto-truncation cuts at each server's own limit; send prompts "
    "within the smaller limit or disable it), --chat-template, tokenizer settings, "
    "--page-size."
)


FAILED = "coverage_check_failed_total"


def mode() -> str:
    """The configured mode (``enforce`` unless ``SGLANG_PDSAFE_COVERAGE=log``)."""
    value = os.environ.get(ENV_MODE, "enforce").strip().lower()
    return "log" if value == "log" else "enforce"


register(Protection(
    name="coverage-attestation",
    guards="decode commits a transfer only if prefill attests exactly the token range, "
           "tokens and pages decode reserved (no decode over pages nobody wrote)",
    switched_off=lambda _args: None if mode() == "enforce" else f"{ENV_MODE}=log",
))


# --------------------------------------------------------------------------- pure functions


@dataclass(frozen=True)
class Coverage:
    """One side's account of a request's transferred positions ``[first, first + count)``."""

    room: int
    token_digest: int
    first_token_idx: int
    token_count: int
    page_count: int
    page_size: int

    @property
    def end_token_idx(self) -> int:
        return self.first_token_idx + self.token_count


def _h63(*parts: Any) -> int:
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(p)
    return int.from_bytes(h.digest(), "little") >> 1  # fits int64 and uint64 rows


def token_digest(room: int, token_ids: Sequence[int]) -> int:
    """Digest of (room, token ids): the per-transfer binding value both sides derive.

    Covers the whole prefix ``[0, end)``, not only the written positions: the KV at a position
    depends on every token before it.
    """
    arr = np.asarray(token_ids, dtype=np.int64)
    # The array's own buffer (no bytes copy of a million-token prompt).
    return _h63(b"pdsafe-cov1", (int(room) & _U64).to_bytes(8, "little"),
                np.ascontiguousarray(arr))


def bind_transfer(digest: int, generation: int, aux: int, key: bytes = b"") -> int:
    """Slot 2's value: the token digest bound to the transfer's generation (0: none travels)
    and to the digest of the slot's aux rows (:func:`aux_digest`), keyed with the cluster's
    MAC key when one is configured (``key``; empty: unkeyed), so that only a holder of the key
    can produce a row decode accepts."""
    h = hashlib.blake2b(digest_size=8, key=bytes(key)[:64])
    for part in (b"pdsafe-cov3", (int(digest) & _U64).to_bytes(8, "little"),
                 (int(generation) & _U64).to_bytes(8, "little"),
                 (int(aux) & _U64).to_bytes(8, "little")):
        h.update(part)
    return int.from_bytes(h.digest(), "little") >> 1


def _row_keys() -> tuple[bytes, ...]:
    """The cluster's MAC keys (signing key first); ``(b"",)`` on an unkeyed leg
    (:func:`control_mac.row_keys`, imported here: control_mac imports this module's users)."""
    from sglang.pdsafe import control_mac

    return control_mac.row_keys()


class UnboundAuxBuffer(RuntimeError):
    """The transfer registers a metadata buffer that is neither an aux field this module binds
    nor a self-checked row: a field decode might read unchecked."""


def aux_rows(metadata_buffers: Any, index: int) -> list[tuple[str, torch.Tensor]]:
    """The slot's aux rows, ``(field, row)``, in the order the transfer registers the buffers
    (``get_buf_infos``). Raises :class:`UnboundAuxBuffer` when a registered buffer is none of
    :data:`AUX_FIELDS` and :data:`SELF_CHECKED_FIELDS`."""
    by_ptr: dict[int, str] = {}
    for name in AUX_FIELDS + SELF_CHECKED_FIELDS:
        t = getattr(metadata_buffers, name, None)
        if isinstance(t, torch.Tensor):
            by_ptr[t.data_ptr()] = name
    ptrs, _, _ = metadata_buffers.get_buf_infos()
    unknown = [i for i, p in enumerate(ptrs) if p not in by_ptr]
    if unknown:
        raise UnboundAuxBuffer(
            "the KV transfer registers metadata buffer(s) "
            f"{_name_buffers(metadata_buffers, unknown)} of {len(ptrs)} that sglang-pdsafe "
            "neither binds into the coverage row nor checks otherwise (an upstream field this "
            "release does not know): refusing rather than letting decode read it unchecked; "
            "run an sglang-pdsafe release made for this upstream")
    names = [by_ptr[p] for p in ptrs]
    return [(n, getattr(metadata_buffers, n)[index]) for n in names if n in AUX_FIELDS]


def _name_buffers(metadata_buffers: Any, positions: Sequence[int]) -> str:
    """``#i (name)`` for each registered buffer position, named by the ``MetadataBuffers``
    attribute whose storage it is (``?`` when none is)."""
    ptrs, _, _ = metadata_buffers.get_buf_infos()
    names = {v.data_ptr(): k for k, v in vars(metadata_buffers).items()
             if isinstance(v, torch.Tensor)}
    return ", ".join(f"#{i} ({names.get(ptrs[i], '?')})" for i in positions)


@hook("coverage.check_aux_buffers", outcome=policy.Outcome.POISON, counter=FAILED,
      on_failure=policy.reraise_at_startup, effect="the scheduler refuses to start")
def check_aux_buffers(metadata_buffers: Any) -> None:
    """Scheduler init of both PD legs, once the metadata buffers exist: every buffer the
    transfer registers is an aux field bound into the coverage row or a self-checked row.
    Otherwise the start is refused, naming the buffers, instead of every transfer being
    refused at commit (:class:`UnboundAuxBuffer` there too)."""
    try:
        aux_rows(metadata_buffers, 0)
    except UnboundAuxBuffer as e:
        raise policy.StartupRefusedError(
            f"sglang-pdsafe: this PD server refuses to start: {e}. No request could be "
            "transferred with it (the coverage check refuses each one).") from e


def aux_digest(rows: Sequence[tuple[str, torch.Tensor]]) -> int:
    """Digest of a slot's aux rows: each field's name, byte length and bytes, in order."""
    h = hashlib.blake2b(digest_size=8, person=b"pdsafe-aux1")
    for name, row in rows:
        raw = row.detach().contiguous().cpu().view(torch.uint8).numpy()
        h.update(name.encode("ascii"))
        h.update(int(raw.nbytes).to_bytes(8, "little"))
        h.update(raw)
    return int.from_bytes(h.digest(), "little") >> 1


def pages_for(first_token_idx: int, token_count: int, page_size: int) -> int:
    """Pages holding positions ``[first, first + count)`` (``first`` is page aligned)."""
    if token_count <= 0:
        return 0
    return -(-token_count // max(page_size, 1))


def build_coverage(room: int | None, token_ids: Sequence[int], first_token_idx: int,
                   end_token_idx: int, page_size: int, page_count: int | None = None) -> Coverage:
    """The coverage of positions ``[first, end)`` computed from ``token_ids[:end]``."""
    room = int(room or 0) & _U64
    first = int(first_token_idx)
    end = int(end_token_idx)
    count = max(end - first, 0)
    pages = pages_for(first, count, page_size) if page_count is None else int(page_count)
    # No copy of the token list unless it is longer than the prefix (a 1M-token prompt).
    ids = token_ids if len(token_ids) <= end else token_ids[:max(end, 0)]
    return Coverage(room=room, token_digest=token_digest(room, ids),
                    first_token_idx=first, token_count=count, page_count=pages,
                    page_size=int(page_size))


def _crc(values: Sequence[int]) -> int:
    return _h63(b"pdsafe-row1", b"".join((int(v) & _U64).to_bytes(8, "little") for v in values))


def encode(cov: Coverage) -> list[int]:
    """The 8-slot metadata row for ``cov`` (slot 0 = room, as upstream writes it)."""
    row = [cov.room, MAGIC_VERSION, cov.token_digest, cov.first_token_idx, cov.token_count,
           cov.page_count, cov.page_size]
    for v in row[1:]:
        if not 0 <= v < (1 << 63):
            raise ValueError(f"coverage field out of int64 range: {v}")
    return row + [_crc(row)]


class RowError(ValueError):
    """A metadata row without a valid attestation; ``reason`` is ``missing`` or ``corrupt``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def decode(row: Sequence[int]) -> Coverage:
    """Parse a metadata row; raise :class:`RowError` if it carries no valid attestation."""
    vals = [int(v) & _U64 for v in row]
    if len(vals) < ROW_WIDTH:
        raise RowError("missing", f"metadata row has {len(vals)} slots, need {ROW_WIDTH}")
    if vals[SLOT_MAGIC] != MAGIC_VERSION:
        what = ("none (all zero)" if vals[SLOT_MAGIC] == 0
                else f"unknown tag {vals[SLOT_MAGIC]:#x}")
        raise RowError("missing", f"prefill sent no coverage attestation ({what}); "
                                  "it runs without sglang-pdsafe or another version of it")
    if vals[SLOT_CRC] != _crc(vals[:SLOT_CRC]):
        raise RowError("corrupt", "coverage attestation row fails its checksum")
    return Coverage(room=vals[SLOT_ROOM], token_digest=vals[SLOT_DIGEST],
                    first_token_idx=vals[SLOT_FIRST], token_count=vals[SLOT_COUNT],
                    page_count=vals[SLOT_PAGES], page_size=vals[SLOT_PAGE_SIZE])


class Outcome(enum.Enum):
    OK = "ok"
    MISSING = "missing"      # no attestation in the row (unpatched or other-version prefill)
    CORRUPT = "corrupt"      # attestation present but its checksum fails
    MISMATCH = "mismatch"    # valid attestation that differs from decode's reservation


@dataclass(frozen=True)
class Verdict:
    """Result of checking one transfer. ``differs`` names the fields that differ."""

    outcome: Outcome
    message: str = ""
    differs: tuple[str, ...] = ()
    attested: Coverage | None = None

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK

    @property
    def counter(self) -> str:
        return ("coverage_mismatch_total" if self.outcome is Outcome.MISMATCH
                else "coverage_attestation_invalid_total")


_FIELDS = ("room", "token_digest", "first_token_idx", "token_count", "page_count", "page_size")


def _describe(c: Coverage) -> str:
    return (f"tokens [{c.first_token_idx}, {c.end_token_idx}) = {c.token_count} tokens in "
            f"{c.page_count} pages of {c.page_size}")


def verify(row: Sequence[int], reservation: Coverage, rid: str = "?") -> Verdict:
    """Compare the transferred row with decode's own reservation (see module invariants)."""
    try:
        att = decode(row)
    except RowError as e:
        outcome = Outcome.MISSING if e.reason == "missing" else Outcome.CORRUPT
        return Verdict(outcome, (
            f"KV transfer refused for request {rid} (bootstrap_room={reservation.room}): {e}. "
            f"Decode reserved {_describe(reservation)} and cannot tell what prefill wrote, so "
            "the request was not decoded. Run the same sglang-pdsafe version on prefill and "
            f"decode (for a rolling upgrade only: {ENV_MODE}=log on decode)."))
    differs = tuple(f for f in _FIELDS if getattr(att, f) != getattr(reservation, f))
    if not differs:
        return Verdict(Outcome.OK, attested=att)
    extra = ""
    if differs == ("token_digest",):
        extra = (" Same length, but prefill computed the KV from other tokens than decode holds "
                 "(chat template or tokenizer differs), or the row was written for another "
                 "transfer of this bootstrap room (another transfer generation), or the "
                 "slot's aux data (first token, logprobs, speculation state) is not what "
                 "prefill wrote for this transfer.")
    return Verdict(Outcome.MISMATCH, (
        f"KV coverage mismatch for request {rid} (bootstrap_room={reservation.room}): prefill "
        f"wrote {_describe(att)}, decode reserved {_describe(reservation)} "
        f"(differs: {', '.join(differs)}).{extra} The request was not decoded. "
        + OPERATOR_HINT), differs, att)


# --------------------------------------------------------------------------- hooks (glue)


def decode_token_ids(req: Any, reserved_len: int) -> Sequence[int]:
    """Tokens decode reserved KV for: the first ``reserved_len`` of prompt + outputs (the
    prompt alone, or prompt and outputs on a re-bootstrap; upstream computes the length)."""
    ids = req.origin_input_ids
    if reserved_len > len(ids):
        ids = list(ids) + list(req.output_ids)
    # Read only: the prompt itself when it is exactly the reservation (no 1M-token copy).
    return ids if len(ids) <= reserved_len else ids[:reserved_len]


def _decode_key(decode_req: Any, *_: Any, **__: Any) -> Any:
    req = decode_req.req
    return ("room", getattr(req, "bootstrap_room", None), str(getattr(req, "rid", "")))


def _reservation_failed(failure: policy.Failure) -> None:
    """The reservation could not be recorded: the room fails now (the prefill told)."""
    decode_req = failure.args[0]
    receiver = getattr(decode_req, "kv_receiver", None)
    transfer.fail_room(getattr(receiver, "kv_mgr", None), decode_req.req.bootstrap_room,
                       failure.refusal(500, "the KV transfer (decode could not record its "
                                            "reservation)"))


@hook("coverage.note_reservation_hook", outcome=policy.Outcome.REFUSE, counter=FAILED,
      on_failure=_reservation_failed, key=_decode_key,
      effect="the room fails at once (500, the prefill told); commit would refuse it too")
def note_reservation_hook(decode_req: Any, page_indices: Sequence[int], page_size: int,
                          decode_prefix_len: int | None, reserved_len: int) -> None:
    """Decode, right before its metadata goes to prefill: record what it reserved in the
    transfer's record.

    ``reserved_len`` is the token count decode reserved KV for
    (``DecodePreallocQueue._rebootstrap_prefill_len``, passed by the patch).
    """
    req = decode_req.req
    ids = decode_token_ids(req, int(reserved_len))
    cov = build_coverage(req.bootstrap_room, ids, int(decode_prefix_len or 0), len(ids),
                         int(page_size), page_count=len(page_indices))
    receiver = getattr(decode_req, "kv_receiver", None)
    transfer.record_for(req, getattr(receiver, "kv_mgr", None)).coverage = cov


def reservation_of(decode_req: Any) -> Coverage | None:
    """The reservation :func:`note_reservation_hook` recorded for ``decode_req`` (None)."""
    rec = transfer.of(decode_req.req)
    return rec.coverage if rec is not None else None


def _prefill_generation(req: Any) -> int:
    """The transfer generation the room's decode ranks sent (0: none travels; a split, which
    the digest row refuses and counts, binds 0 too: decode then refuses this row as well)."""
    sender = getattr(req, "disagg_kv_sender", None)
    get = getattr(sender, "pdsafe_transfer_generation", None)
    if get is None:
        return 0
    try:
        return int(get())
    except Exception:  # noqa: BLE001 - GenerationSplitError: counted by the digest row
        return 0


def _decode_generation(decode_req: Any) -> int:
    """The transfer generation decode sent with the reservation's metadata (0: none)."""
    rec = transfer.of(decode_req.req)
    return rec.generation if rec is not None and rec.generation_sent else 0


def _attest_failed(failure: policy.Failure) -> None:
    """The attestation could not be written: the room fails now (the decode told Failed);
    its row stays without an attestation (decode would refuse it too)."""
    req = failure.args[1]
    sender = getattr(req, "disagg_kv_sender", None)
    transfer.fail_room(getattr(sender, "kv_mgr", None), getattr(req, "bootstrap_room", None),
                       failure.refusal(500, "the KV transfer (prefill could not attest what it "
                                            "wrote)"))


@hook("coverage.attest_prefill_hook", outcome=policy.Outcome.REFUSE, counter=FAILED,
      on_failure=_attest_failed,
      key=lambda buffers, req, *a, **k: ("room", getattr(req, "bootstrap_room", None),
                                         str(getattr(req, "rid", ""))),
      effect="the room fails at once (500; the decode told Failed)")
def attest_prefill_hook(metadata_buffers: Any, req: Any, end_idx: int, page_size: int) -> None:
    """Prefill, at its last chunk, after upstream's ``set_buf``: write the attestation row
    (slot 2 bound to the generation the room's decode ranks sent and to the slot's aux rows,
    as ``set_buf`` left them)."""
    first = int(getattr(req, "disagg_decode_prefix_len", 0) or 0)
    cov = build_coverage(req.bootstrap_room, req.origin_input_ids, first, int(end_idx),
                         int(page_size))
    aux = aux_digest(aux_rows(metadata_buffers, req.metadata_buffer_index))
    cov = replace(cov, token_digest=bind_transfer(cov.token_digest, _prefill_generation(req),
                                                  aux, _row_keys()[0]))
    buf = metadata_buffers.bootstrap_room
    row = encode(cov)
    buf[req.metadata_buffer_index, 1:ROW_WIDTH] = torch.tensor(
        row[1:], dtype=buf.dtype, device=buf.device)


def check_commit_hook(transfer_queue: Any, decode_req: Any) -> Verdict:
    """Decode, before commit: verify the transferred row against the recorded reservation,
    bound to the generation decode sent and to the aux rows it received (a stale or foreign
    first token, logprob or speculation seed is a ``token_digest`` mismatch)."""
    req = decode_req.req
    reservation = reservation_of(decode_req)
    rid = getattr(req, "rid", "?")
    if reservation is None:
        return Verdict(Outcome.MISSING, (
            f"KV transfer refused for request {rid} (bootstrap_room={req.bootstrap_room}): "
            "decode recorded no reservation for it, so its coverage cannot be checked; the "
            "request was not decoded. This is an sglang-pdsafe bug: please report it."))
    buffers, index = transfer_queue.metadata_buffers, decode_req.metadata_buffer_index
    generation = _decode_generation(decode_req)
    aux = aux_digest(aux_rows(buffers, index))
    row = buffers.bootstrap_room[index].tolist()
    first: Verdict | None = None
    for key in _row_keys():  # any accepted key (a rotation); else the signing key's verdict
        v = verify(row, replace(reservation, token_digest=bind_transfer(
            reservation.token_digest, generation, aux, key)), rid)
        if v.ok:
            return v
        first = first or v
    assert first is not None  # _row_keys() is never empty
    return first


def admit(transfer_queue: Any, decode_req: Any) -> bool:
    """Run the coverage check for one finished transfer; abort the request on failure.

    Returns False when the request must not decode (it is then already aborted with
    ``REFUSAL_STATUS`` through upstream's ``prepare_abort``, like the bootstrap-room mismatch);
    on True the transfer's record is VERIFIED (the KV digest follows at the first step).
    """
    req = decode_req.req
    rec = transfer.of(req)
    # The patch does not call the gate for a fake transfer (server warmup; clients cannot
    # request one, see client_guard): every request that reaches here carries real KV.
    verdict = check_commit_hook(transfer_queue, decode_req)
    if verdict.ok or _waived(decode_req, verdict):
        _verified(rec)
        return True
    metrics.inc(verdict.counter)
    if mode() == "log":
        logger.error("%s [%s=log: committed anyway]", verdict.message, ENV_MODE)
        _verified(rec)
        return True
    logger.error(verdict.message)
    prepare_abort(req, verdict.message, status_code=REFUSAL_STATUS)
    if rec is not None:
        rec.refuse(policy.Refusal(int(REFUSAL_STATUS), verdict.message, verdict.counter))
    return False


def _waived(decode_req: Any, verdict: Verdict) -> bool:
    """A stock prefill during a rolling upgrade, with the operator's explicit waiver
    (``SGLANG_PDSAFE_WAIVE_FOR_STOCK_PEERS``; logged per prefill, counted per transfer)."""
    return (verdict.outcome is Outcome.MISSING and verdict.attested is None
            and reservation_of(decode_req) is not None
            and peer_policy.coverage_waived(decode_req))


def _verified(rec: transfer.Transfer | None) -> None:
    if rec is not None and rec.state in (State.SENT, State.WRITTEN):
        if rec.state is State.SENT:
            rec.advance(State.WRITTEN)
        rec.advance(State.VERIFIED)
