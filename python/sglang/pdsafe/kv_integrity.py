"""The KV digest in the PD servers: the row that carries it, prefill's write, decode's check.

:mod:`sglang.pdsafe.kv_digest` defines the digest (pure functions over a KV pool). This module
wires it into the two legs through thin hooks (the patch that replaces upstream's
``--disaggregation-enable-kv-checksum`` Adler-32 path), and keeps everything the servers need
in one place: whether it is on, the metadata row layout, the waiver for stock prefills, the
verdicts and their counters.

**On by default.** In PD mode both legs run it unless ``SGLANG_PDSAFE_KV_DIGEST=0`` (the
startup report then warns that the ``kv-digest`` protection is off). Upstream's
``--disaggregation-enable-kv-checksum`` keeps it on even then (the flag asks for a check; this
is the check). Both legs publish their setting at pairing (``pair_agreement`` field
``kv_digest``: the scheme, or ``off``): a decode refuses to pair with a prefill that publishes
another value, naming both, so a verifying decode never meets a fork prefill that sends no
digest. A prefill that publishes nothing (stock SGLang, an older fork) is not refused for it
at pairing: its transfers carry no digest and fail one by one (``kv_digest_missing_total``),
unless the stock-peer waiver below applies.

**The carrier** is upstream's own ``MetadataBuffers.kv_checksum`` buffer: one row of 8 x
64 bit per metadata slot (the 64 B RDMA minimum), always the *last* aux buffer, allocated
here whenever the digest is on (upstream allocates it only with its flag). Prefill fills it at
its last chunk, before the aux data is posted; decode reads it when it commits the transfer
(before the slot is freed) and checks it when the request first enters a batch::

    ====  ==============  ============================================================
    slot  field           meaning
    ====  ==============  ============================================================
    0     tag | check     bits 63-40 ``TAG`` ("pdK"), 39-32 ``ROW_VERSION``, 31-0 the
                          low 32 bits of XXH3-64 over the tag word and slots 1-7
                          (0: no digest; positive as int64, Ascend's row dtype)
    1     seal (hi)       bytes 0-7 of the 16-byte seal of the digest (:func:`seal`),
                          big-endian
    2     seal (lo)       bytes 8-15
    3     signature       bytes 0-7 of the 16-byte layout signature digest
    4     room            bootstrap room the digest is bound to
    5     generation      transfer generation (``transfer_generation``; 0: none was sent)
    6     prefix          first position digested (decode's promised prefix length)
    7     token_count     positions digested: ``[prefix, prefix + token_count)``
    ====  ==============  ============================================================

**The seal** (row version 2) is a BLAKE2b-128 of the XXH3-128 digest value, prefill's full
layout signature digest and the bound fields, keyed with the cluster's MAC key
(:func:`control_mac.row_keys`; unkeyed on a leg without one). The XXH3 value alone is a
checksum anyone can compute: a keyless party able to write decode's pages and its metadata row
(one-sided RDMA reaches both) could write KV of its choosing and a row that matches it. Under a
key it cannot: decode recomputes the seal of its own digest under each key it accepts (the
signing key and, during a rotation, the old one) and takes the row only if one matches. A row
sealed under another key fails as a value mismatch. Row version 1 (the unkeyed value of an
earlier release) is "another sglang-pdsafe release", like any unknown version.

Only the seal and the signature carry information decode cannot derive; the bound fields
travel so that a digest for another transfer is reported as such (``BINDING``, both values)
instead of as corrupt KV. The row holds the upper 64 bits of the signature digest: a layout
that differs in them is reported as a layout mismatch; one that differs only in the lower 64
bits still fails, as a value mismatch, because the value hashes prefill's full 128-bit
signature digest in its header (:mod:`kv_digest`).

**Other legs, other buffer lists.** Aux buffers pair up by position and every backend
(Mooncake RDMA and TCP, NIXL, MORI; Ascend through Mooncake) transfers ``min(prefill's,
decode's)`` of them (``CommonKVManager.check_peer_aux_buffer_count`` logs the difference once
per registration). The digest row being the last buffer, a fork prefill that serves a stock
decode (which registers no such buffer; only under the ``decode-protections`` waiver,
:mod:`peer_capability`) sends every other buffer at its place with unchanged content; its
digest is simply not sent. A stock prefill (no such buffer) leaves a fork decode's row as
``clear_slot`` left it: all zero, "no digest".

**Stock prefills during a rolling upgrade** (``peer_policy``): a transfer whose row carries
no digest is committed only from a prefill that paired as a stock peer and only when
``SGLANG_PDSAFE_WAIVE_FOR_STOCK_PEERS`` lists ``kv-digest`` (counted per transfer in
``kv_digest_waived_total``). A row that carries a digest is always verified, and a prefill
that announced a pdsafe wire version never gets the waiver.

**Verdicts** (decode; each a failure except ``ok``): the request is aborted before its first
decode step with HTTP 500 and "KV integrity check failed (request, room, generation): why";
its pages follow upstream's release path for a dropped request (the transfer has completed,
so no writer is live for it). One counter per class:

* ``kv_digest_mismatch_total``: the KV bytes decode holds differ from what prefill digested
  (or upstream's test injector flipped the digest);
* ``kv_digest_missing_total``: no digest (zero row, unknown row tag or version, a decode
  without a row buffer);
* ``kv_digest_invalid_total``: the row fails its check, the layout signatures differ, the
  row is bound to another room, generation or token range, or the backend says this peer's
  digest covers other bytes (heterogeneous sharding, ``should_verify_kv_checksum``);
* ``kv_digest_failed_total``: computing a digest raised (prefill then sends a zero row, which
  decode refuses; decode fails the request).

Nothing depends on the rid: a ``HEALTH_CHECK``-looking rid is verified like any other. The
only requests not verified are upstream's fake transfers (``bootstrap_host`` 2.2.2.2, the
server's own warmup; clients cannot send it, ``client_guard``): no KV travels for them.

Invariant: with the digest on, a transferred request reaches its first decode step only if
decode's own digest of ``[prefix, prefix + count)`` over its pages equals prefill's, bound to
the same room, generation, range and layout, or (explicitly waived, counted) its prefill is a
stock peer that sent no digest at all. Prefill digests with the transfer generation the
room's decode ranks sent and decode with its own reservation's (:mod:`transfer_generation`),
so a row written for another reservation of the same room never verifies (``BINDING``).
"""

from __future__ import annotations

import hashlib
import logging
import struct
from dataclasses import dataclass, replace
from typing import Any

import torch
import xxhash
from sglang.pdsafe import (
    kv_breaker,
    kv_digest,
    metrics,
    pair_settings,
    peer_policy,
    policy,
    transfer,
)
from sglang.pdsafe.hook_api import require
from sglang.pdsafe.policy import Outcome, hook
from sglang.pdsafe.protections import Protection, is_pd, off_by, register, switch_on
from sglang.pdsafe.transfer import State
from sglang.srt.disaggregation.utils import prepare_abort

logger = logging.getLogger("sglang.pdsafe.kv_integrity")

ENV_ENABLE = "SGLANG_PDSAFE_KV_DIGEST"
PROTECTION = "kv-digest"

ROW_WIDTH = 8
(SLOT_TAG, SLOT_VALUE_HI, SLOT_VALUE_LO, SLOT_SIGNATURE, SLOT_ROOM, SLOT_GENERATION,
 SLOT_PREFIX, SLOT_COUNT) = range(ROW_WIDTH)
#: "pdK": the upper 24 bits of slot 0 (its top bit is 0: positive as int64).
TAG = 0x70644B
#: 2: slots 1-2 carry the keyed seal of the value (:func:`seal`); 1 carried the bare value.
ROW_VERSION = 2
_TAG_WORD = (TAG << 40) | (ROW_VERSION << 32)
_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1

MISMATCH = "kv_digest_mismatch_total"
MISSING = "kv_digest_missing_total"
INVALID = "kv_digest_invalid_total"
FAILED = "kv_digest_failed_total"
WAIVED = "kv_digest_waived_total"
VERIFIED_COUNTER = "kv_digest_verified_total"

#: What a request failed by this check answers (upstream's status for a KV checksum mismatch).
REFUSAL_STATUS = 500
HEAD = "KV integrity check failed"

#: ``record.digest`` after the check passed (a retracted request that resumes from decode's
#: own backup re-enters a batch without a new transfer; nothing new came from prefill).
VERIFIED = "verified"

require("sglang.srt.disaggregation.base.conn.BaseKVManager",
        "should_verify_kv_checksum(bootstrap_addr)",
        why="decode fails (does not skip) a transfer whose backend says the prefill's digest "
            "covers other bytes than this rank's KV (kv-digest)")


def enabled(args: Any = None) -> bool:
    """Whether the digest runs on this leg (PD mode is the caller's business): on unless
    ``SGLANG_PDSAFE_KV_DIGEST=0``; upstream's ``--disaggregation-enable-kv-checksum`` in
    ``args`` (server args or the published ``disagg`` namespace) keeps it on regardless."""
    return switch_on(ENV_ENABLE) or bool(getattr(args, "disaggregation_enable_kv_checksum", False))


@hook("kv_integrity.carrier_enabled", outcome=Outcome.POISON, counter=FAILED,
      on_failure=policy.reraise_at_startup, effect="the scheduler refuses to start")
def carrier_enabled(disagg: Any) -> bool:
    """Whether this PD leg allocates the digest row (``MetadataBuffers(kv_checksum_enabled)``):
    in PD mode whenever :func:`enabled`. Fails closed: a mode that cannot be read raises."""
    return is_pd(disagg) and enabled(disagg)


def advertised(args: Any = None) -> str:
    """What this leg publishes at pairing (``pair_agreement`` field ``kv_digest``)."""
    if not enabled(args):
        return "off"
    return kv_digest.SCHEME


pair_settings.advertise("kv_digest", advertised)

register(Protection(
    name=PROTECTION,
    guards="decode verifies every transferred request's KV against prefill's digest of "
           "exactly its token range (XXH3-128, bound to room, generation, range and layout) "
           "before its first decode step; a missing or zero digest, a health-check rid or "
           "another layout is a failure, never a skip",
    switched_off=lambda args: None if enabled(args) else off_by(ENV_ENABLE)(args),
))


# --------------------------------------------------------------------------- the row


def _check32(slots: list[int]) -> int:
    raw = struct.pack("<8Q", _TAG_WORD, *[int(v) & _U64 for v in slots])
    return xxhash.xxh3_64_intdigest(raw) & _U32


def seal(d: Any, key: bytes = b"") -> bytes:
    """The 16 bytes slots 1-2 carry for the :class:`kv_digest.KvDigest` ``d``: BLAKE2b-128 of
    its value, its full signature digest and its bound fields, keyed with ``key`` (the cluster
    MAC key; empty: unkeyed). Without the key nobody can produce the seal of bytes they chose,
    and a seal binds exactly one (value, layout, room, generation, range)."""
    for v in (d.room, d.generation, d.prefix, d.token_count):
        if not 0 <= int(v) <= _U64:
            raise ValueError(f"KV digest row field out of range: {v}")
    h = hashlib.blake2b(digest_size=16, key=bytes(key)[:64])
    h.update(b"pdsafe-kvd-row2")
    h.update(bytes(d.value))
    h.update(bytes(d.signature))
    h.update(struct.pack("<4Q", int(d.room), int(d.generation), int(d.prefix),
                         int(d.token_count)))
    return h.digest()


def _row_keys() -> tuple[bytes, ...]:
    from sglang.pdsafe import control_mac  # control_mac's imports reach this module

    return control_mac.row_keys()


def encode_row(d: Any, key: bytes = b"") -> list[int]:
    """The 8-slot row (unsigned 64-bit words) for the :class:`kv_digest.KvDigest` ``d``,
    its value sealed with ``key`` (:func:`seal`)."""
    sealed = seal(d, key)
    v_hi, v_lo = int.from_bytes(sealed[:8], "big"), int.from_bytes(sealed[8:], "big")
    s_hi = int.from_bytes(bytes(d.signature)[:8], "big")
    body = [v_hi, v_lo, s_hi, d.room, d.generation, d.prefix, d.token_count]
    for v in body[3:]:
        if not 0 <= int(v) <= _U64:
            raise ValueError(f"KV digest row field out of range: {v}")
    return [_TAG_WORD | _check32(body)] + [int(v) & _U64 for v in body]


@dataclass(frozen=True)
class RowDigest:
    """What a valid row says: prefill's sealed value (:func:`seal`), the upper half of its
    signature, the bounds."""

    value: bytes
    signature_hi: bytes
    room: int
    generation: int
    prefix: int
    token_count: int


class RowError(ValueError):
    """A row without a usable digest; ``reason`` is ``missing`` or ``invalid``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def decode_row(words: Any) -> RowDigest:
    """Parse a transferred row (any integer dtype); raise :class:`RowError` if it carries no
    valid digest."""
    if words is None:
        raise RowError("missing", "this decode has no KV digest row buffer")
    vals = [int(v) & _U64 for v in words]
    if len(vals) < ROW_WIDTH:
        raise RowError("missing", f"the KV digest row has {len(vals)} slots, need {ROW_WIDTH}")
    tag = vals[SLOT_TAG]
    if tag == 0:
        raise RowError("missing", "prefill sent no KV digest (the row is all zero: a prefill "
                                  "without the digest, or one whose digest failed)")
    if tag >> 32 != _TAG_WORD >> 32:
        raise RowError("missing", f"the KV digest row has an unknown tag/version "
                                  f"{tag >> 32:#x} (expected {_TAG_WORD >> 32:#x}): another "
                                  "sglang-pdsafe release")
    if tag & _U32 != _check32(vals[1:ROW_WIDTH]):
        raise RowError("invalid", "the KV digest row fails its check (corrupt metadata row)")
    value = vals[SLOT_VALUE_HI].to_bytes(8, "big") + vals[SLOT_VALUE_LO].to_bytes(8, "big")
    return RowDigest(value=value, signature_hi=vals[SLOT_SIGNATURE].to_bytes(8, "big"),
                     room=vals[SLOT_ROOM], generation=vals[SLOT_GENERATION],
                     prefix=vals[SLOT_PREFIX], token_count=vals[SLOT_COUNT])


def write_row(buf: Any, index: int, words: list[int]) -> None:
    """Store ``words`` (unsigned) into row ``index`` of the tensor ``buf`` (uint64, or int64
    on Ascend: two's complement)."""
    if buf.dtype == torch.int64:
        words = [w - (1 << 64) if w >= (1 << 63) else w for w in words]
    buf[index] = torch.tensor(words, dtype=buf.dtype, device=buf.device)


# --------------------------------------------------------------------------- digesting


class Digester:
    """One leg's digest state: its KV pool, prepared once (components, signature)."""

    def __init__(self, pool: Any, draft_pool: Any = None) -> None:
        self.prepared = kv_digest.prepare(pool, draft_pool)
        self.spaces = {c.space for c in self.prepared.components}

    def digest(self, scheduler: Any, req: Any, *, prefix: int, length: int, room: int,
               generation: int = 0) -> Any:
        """``req``'s digest of ``[prefix, length)`` over this leg's pool, from the scheduler's
        ``req_to_token`` row of the request (and its state slots, its sliding window)."""
        Space, digest_request = kv_digest.Space, kv_digest.digest_request
        rtp = scheduler.req_to_token_pool
        pool_idx = req.kv.req_pool_idx
        kwargs: dict[str, Any] = {}
        if Space.STATE in self.spaces:
            slots = rtp.req_index_to_mamba_index_mapping[pool_idx]
            translate = getattr(rtp, "translate_mamba_indices", None)
            kwargs["state_indices"] = translate(slots) if translate is not None else slots
        if Space.SWA in self.spaces:
            kwargs["swa_window"] = (getattr(scheduler, "sliding_window_size", None)
                                    or getattr(self.prepared.pool, "sliding_window", None))
        if Space.TAIL in self.spaces:
            kwargs["tail_row"] = int(pool_idx)  # the request's DSA tail ring (its pool row)
        return digest_request(self.prepared, rtp.req_to_token[pool_idx], prefix=prefix,
                              length=length, room=room, generation=generation, **kwargs)

    def scrub(self, scheduler: Any, req: Any, *, prefix: int, length: int) -> int:
        """Zero ``req``'s ``[prefix, length)`` (and its state slots) in this leg's pool."""
        rtp = scheduler.req_to_token_pool
        pool_idx = req.kv.req_pool_idx
        states: Any = ()
        if kv_digest.Space.STATE in self.spaces:
            slots = rtp.req_index_to_mamba_index_mapping[pool_idx]
            translate = getattr(rtp, "translate_mamba_indices", None)
            states = translate(slots) if translate is not None else slots
        return kv_digest.scrub_request(self.prepared, rtp.req_to_token[pool_idx],
                                       prefix=prefix, length=length, state_indices=states,
                                       tail_row=int(pool_idx))


@hook("kv_integrity.leg_digester", outcome=Outcome.POISON, counter=FAILED,
      on_failure=policy.reraise_at_startup, effect="the scheduler refuses to start")
def leg_digester(pool: Any, disagg: Any, draft_pool: Any = None) -> Digester | None:
    """Init hook of both PD queues: this leg's :class:`Digester` (over its KV pool and, when
    the leg runs speculative decoding, the draft pool the transfer carries with it), or None
    when the digest is off (explicitly: the startup report warns). A pool layout the digest
    cannot cover completely refuses the server's start (naming the layout and the switch),
    rather than serving transfers that every decode would refuse."""
    if not carrier_enabled(disagg):
        return None
    kv_breaker.breaker()  # a malformed SGLANG_PDSAFE_KV_MISMATCH_BREAKER refuses the start
    try:
        return Digester(pool, draft_pool)
    except kv_digest.UnsupportedLayout as e:
        raise policy.StartupRefusedError(
            f"sglang-pdsafe: the KV digest cannot cover this server's KV pool ({e}). Every "
            f"transfer would be refused. Start both PD legs with {ENV_ENABLE}=0 to serve this "
            "layout without the KV integrity check (logged as a warning at startup).") from e


def _rid(req: Any) -> str:
    return str(getattr(req, "rid", "?"))


def _prefill_generation(req: Any) -> int:
    """The transfer generation the room's decode ranks sent (0: none, a stock decode or a
    fake transfer); raises when they disagree (the row is then zeroed)."""
    sender = getattr(req, "disagg_kv_sender", None)
    if sender is None or not hasattr(sender, "pdsafe_transfer_generation"):
        return 0  # the fake-transfer path (server warmup) and backends without it
    return int(sender.pdsafe_transfer_generation())


def _row_failed(failure: policy.Failure) -> bool:
    """The digest could not be written: the row is zeroed (decode would refuse it) and the
    room fails now (the decode told Failed), instead of waiting for the decode's check."""
    scheduler, req = failure.args[0], failure.args[1]
    buf = getattr(getattr(scheduler, "disagg_metadata_buffers", None), "kv_checksum", None)
    index = getattr(req, "metadata_buffer_index", -1)
    if buf is not None and index is not None and index >= 0:
        buf[index] = 0
    sender = getattr(req, "disagg_kv_sender", None)
    transfer.fail_room(getattr(sender, "kv_mgr", None), getattr(req, "bootstrap_room", None),
                       failure.refusal(500, "the KV transfer (prefill could not digest its "
                                            "KV)"))
    return False


def _req_key(scheduler: Any, req: Any, *_: Any, **__: Any) -> Any:
    return ("room", getattr(req, "bootstrap_room", None), _rid(req))


@hook("kv_integrity.prefill_write_row", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_row_failed, key=_req_key,
      effect="the row is zeroed and the room fails at once (500; the decode told Failed)")
def prefill_write_row(scheduler: Any, req: Any, digester: Digester,
                      end_idx: int | None) -> bool:
    """Prefill, at the request's last chunk, before the chunk (and the aux data) is sent:
    digest ``[req.disagg_decode_prefix_len, end_idx)`` into the request's row, bound to the
    generation the room's decode ranks sent. Every request, whatever its rid. Returns whether
    a digest was written."""
    buf = scheduler.disagg_metadata_buffers.kv_checksum
    index = req.metadata_buffer_index
    if end_idx is None:  # upstream's default end of the last chunk
        end_idx = min(req.extend_end, len(req.origin_input_ids))
    prefix = int(getattr(req, "disagg_decode_prefix_len", 0) or 0)
    d = digester.digest(scheduler, req, prefix=prefix, length=int(end_idx),
                        room=int(req.bootstrap_room or 0),
                        generation=_prefill_generation(req))
    write_row(buf, index, encode_row(d, _row_keys()[0]))
    return True


# --------------------------------------------------------------------------- decode


@dataclass(frozen=True)
class Expected:
    """Decode's record of a committed transfer, kept on the request until it is checked."""

    words: tuple[int, ...] | None  # the transferred row; None: no row buffer here
    prefix: int
    length: int
    fake: bool
    stock_waiver: bool
    bootstrap_addr: str
    generation: int = 0  # the reservation's transfer generation (transfer_generation)


def _scrub_fake_transfer(scheduler: Any, req: Any, rec: transfer.Transfer) -> None:
    """Upstream's fake transfer (``bootstrap_host`` 2.2.2.2, or no host on the fake backend)
    moves no KV: decode would decode over whatever its reserved pages held, another
    request's KV. Zero them first (the positions decode did not take from its own prefix
    cache), so such a request decodes over zeros: its answer is meaningless, never someone
    else's. Counted: every request served this way (the server's own warmups and health
    checks too; a client can send it only through an entry point that bypasses the HTTP
    layer's client guard, or to a server started on the fake backend under the waiver)."""
    digester = getattr(scheduler, "kv_checksum_computer", None)
    if not isinstance(digester, Digester):
        raise RuntimeError("no KV digester on this decode: the fake transfer's pages cannot "
                           "be zeroed")
    prefix, length = _range(rec, req)
    digester.scrub(scheduler, req, prefix=prefix, length=length)
    metrics.inc("fake_transfer_served_total")


def _range(rec: transfer.Transfer | None, req: Any) -> tuple[int, int]:
    """The token range decode reserved and prefill attested (coverage), else upstream's."""
    res = rec.coverage if rec is not None else None
    if res is not None:
        return res.first_token_idx, res.end_token_idx
    return int(req.kv.cache_protected_len), len(req.origin_input_ids)


def _capture_failed(failure: policy.Failure) -> None:
    """The digest row could not be kept (or a fake transfer's pages could not be zeroed):
    the request is aborted now (500), before it is committed; its pages go back through
    upstream's failed-commit path."""
    req = failure.args[1].req
    refusal = failure.refusal(500, "the request (decode could not keep prefill's KV digest "
                                   "row)")
    prepare_abort(req, refusal.reason, status_code=refusal.status)


@hook("kv_integrity.capture", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_capture_failed,
      key=lambda q, decode_req, **_: ("room", decode_req.req.bootstrap_room,
                                      _rid(decode_req.req)),
      effect="the request is aborted at commit (500), never decoded unchecked")
def capture(transfer_queue: Any, decode_req: Any, *, fake: bool) -> None:
    """Decode, at commit (``_commit_transfer_to_req``), before the metadata slot is freed:
    keep prefill's row and the range to check in the transfer's record; a fake transfer's
    pages are zeroed instead (:func:`_scrub_fake_transfer`)."""
    req = decode_req.req
    receiver = getattr(decode_req, "kv_receiver", None)
    rec = transfer.of(req)
    if rec is None:  # a fake transfer (server warmup) or a stand-in: a detached record
        rec = transfer.attach(req, transfer.leg(receiver.kv_mgr).open(None, _rid(req)))
    buf = transfer_queue.metadata_buffers.kv_checksum
    words = (None if buf is None
             else tuple(int(v) for v in buf[decode_req.metadata_buffer_index].tolist()))
    if fake:
        _scrub_fake_transfer(transfer_queue.scheduler, req, rec)
    prefix, length = (0, 0) if fake else _range(rec, req)
    rec.digest = Expected(
        words=words, prefix=prefix, length=length, fake=fake,
        stock_waiver=not fake and peer_policy.digest_waivable(decode_req),
        bootstrap_addr=str(getattr(receiver, "bootstrap_addr", "") or ""),
        generation=int(rec.generation if rec.generation_sent else 0))


@dataclass(frozen=True)
class Check:
    """One request's result: ``counter`` None when it may decode."""

    counter: str | None
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.counter is None


_OK = Check(None)


def _fail(counter: str, req: Any, why: str, room: Any = None,
          generation: int | None = None) -> Check:
    room = getattr(req, "bootstrap_room", None) if room is None else room
    generation = _expected_generation(req) if generation is None else generation
    return Check(counter, f"{HEAD} (request {_rid(req)}, room {room}, generation "
                          f"{generation}): {why}")


def check_request(scheduler: Any, req: Any, digester: Digester, *, kv_manager: Any = None,
                  inject: bool = False) -> Check:
    """Decode, when ``req`` first enters a batch: its own digest over its pages against the
    row prefill sent (see the module doc for every verdict). ``inject`` (upstream's test
    knob) flips decode's digest, so the request fails as a mismatch."""
    rec = transfer.of(req)
    exp = rec.digest if rec is not None else None
    if exp == VERIFIED:
        return _OK  # resumed from decode's own backup: no transfer since its check
    if not isinstance(exp, Expected):
        return _fail(FAILED, req, "decode kept no KV digest record at commit; the KV cannot "
                                  "be checked, so it is not used")
    if exp.fake:
        _verified(rec, count=False)
        return _OK  # server warmup: no KV was transferred (clients cannot ask for this)
    try:
        row = decode_row(exp.words)
    except RowError as e:
        if e.reason == "missing" and exp.stock_waiver:
            metrics.inc(WAIVED)
            _verified(rec, count=False)
            return _OK
        return _fail(MISSING if e.reason == "missing" else INVALID, req, f"{e}; the KV cannot "
                     "be checked, so it is not used (a stock prefill during an upgrade: see "
                     "SGLANG_PDSAFE_WAIVE_FOR_STOCK_PEERS, kv-digest)")
    if kv_manager is not None and exp.bootstrap_addr and \
            not kv_manager.should_verify_kv_checksum(exp.bootstrap_addr):
        return _fail(INVALID, req, f"the transfer backend says the digest of prefill "
                                   f"{exp.bootstrap_addr} covers other bytes than this rank's "
                                   "KV (another TP/PP/DCP sharding); it cannot be checked. "
                                   f"Shard both legs alike, or run both with {ENV_ENABLE}=0",
                     row.room, row.generation)
    actual = digester.digest(scheduler, req, prefix=exp.prefix, length=exp.length,
                             room=int(req.bootstrap_room or 0), generation=exp.generation)
    if inject:
        actual = replace(actual, value=actual.value[:-1] + bytes([actual.value[-1] ^ 1]))
    expected = kv_digest.KvDigest(
        room=row.room, generation=row.generation, prefix=row.prefix,
        token_count=row.token_count, value=row.value,
        # The row has the upper 64 bits; the seal binds prefill's full signature digest.
        signature=row.signature_hi + actual.signature[8:])
    keys = _row_keys()
    seals = [seal(actual, k) for k in keys]  # any accepted key (a rotation), else the signer's
    actual = replace(actual, value=row.value if row.value in seals else seals[0])
    verdict = kv_digest.verify(expected, actual, rid=_rid(req))
    if verdict.ok:
        _verified(rec, count=True)
        return _OK
    counter = {kv_digest.Outcome.MISMATCH: MISMATCH,
               kv_digest.Outcome.MISSING: MISSING}.get(verdict.outcome, INVALID)
    message = verdict.message
    if verdict.outcome is kv_digest.Outcome.MISMATCH and keys != (b"",):
        message += (" (or the row was not sealed with a cluster key this decode accepts: "
                    "both legs need the same SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN, or "
                    "--api-key)")
    if verdict.outcome is kv_digest.Outcome.LAYOUT:
        message += (f" (signature {row.signature_hi.hex()} vs {actual.signature[:8].hex()}; "
                    f"decode's layout: {actual.signature_text})")
    return Check(counter, message)


def _verified(rec: transfer.Transfer, *, count: bool) -> None:
    """The record's KV was checked (or needs none): it may decode."""
    rec.digest = VERIFIED
    if rec.state is State.VERIFIED:
        rec.advance(State.COMMITTED)
    if count:
        metrics.inc(VERIFIED_COUNTER)


class Refused(dict):
    """:func:`verify_batch`'s result: ``{index: message}`` of the requests that must not
    decode, and ``mismatch``, the indices whose KV differs from prefill's digest."""

    def __init__(self) -> None:
        super().__init__()
        self.mismatch: set[int] = set()


#: The per-request flags the TP ranks agree on (MAX): 0 decode, 1 refuse, 2 refuse (mismatch).
DECODE, REFUSE, REFUSE_MISMATCH = 0, 1, 2


def _refuse_batch(failure: policy.Failure) -> Refused:
    """The check could not run: every request of the batch is refused (500)."""
    reqs = failure.args[1]
    out = Refused()
    message = failure.refusal(500, "the request (decode could not check its KV digest)").reason
    for i in range(len(reqs)):
        out[i] = message
    return out


def _batch_key(scheduler: Any, reqs: list[Any], *_: Any, **__: Any) -> Any:
    return ("batch", tuple(_rid(r) for r in reqs))


@hook("kv_integrity.verify_batch", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_refuse_batch, key=_batch_key,
      effect="every request of the batch is refused (500) before its first decode step")
def verify_batch(scheduler: Any, reqs: list[Any], digester: Digester, *,
                 inject: Any = None) -> Refused:
    """Decode's ``_verify_kv_checksums``: check every request of a new prebuilt batch; returns
    ``{index: message}`` of the ones that must not decode (each counted and logged here; the
    caller agrees on the set across TP ranks, :func:`flags` and :func:`agreed`, and fails
    them). ``inject``: upstream's test injector, a callable drawn once per checked request."""
    kv_manager = getattr(getattr(scheduler, "disagg_decode_prealloc_queue", None), "kv_manager",
                         None)
    failed = Refused()
    for i, req in enumerate(reqs):
        rec = transfer.of(req)
        exp = rec.digest if rec is not None else None
        flip = (isinstance(exp, Expected) and not exp.fake and inject is not None
                and bool(inject()))
        check = check_request(scheduler, req, digester, kv_manager=kv_manager, inject=flip)
        if not check.ok:
            metrics.inc(check.counter)
            failed[i] = check.message
            if rec is not None:
                rec.refuse(policy.Refusal(REFUSAL_STATUS, check.message, check.counter))
            if check.counter == MISMATCH:
                failed.mismatch.add(i)
    return failed


@hook("kv_integrity.flags", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=lambda failure: [REFUSE] * int(failure.args[1]),
      effect="every request of the batch is flagged refused")
def flags(refused: dict[int, str], n: int) -> list[int]:
    """The flags of ``n`` requests for the TP ranks' MAX agreement (see ``DECODE``...)."""
    mismatch = getattr(refused, "mismatch", set())
    return [REFUSE_MISMATCH if i in mismatch else REFUSE if i in refused else DECODE
            for i in range(n)]


def _breaker_failed(failure: policy.Failure) -> None:
    """The breaker could not count: with a breaker configured the server is poisoned (it
    can no longer promise to stop after N mismatches); without one nothing is lost."""
    if kv_breaker.breaker() is not None:
        policy.poison(f"the KV mismatch breaker could not count ({failure.exc})",
                      by=failure.spec.name)


@hook("kv_integrity.agreed", outcome=Outcome.POISON, counter=FAILED,
      on_failure=_breaker_failed,
      effect="with a mismatch breaker configured the server is poisoned (the requests are "
             "refused regardless)")
def agreed(agreed_flags: list[int]) -> None:
    """After the TP ranks agreed (MAX) on the refused set: count its mismatches in the
    breaker (:mod:`kv_breaker`), the same on every rank."""
    kv_breaker.note_mismatches(sum(1 for f in agreed_flags if f == REFUSE_MISMATCH))


@hook("kv_integrity.peer_rank_message", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=lambda failure: (f"{HEAD}: another TP rank of this decode refused this "
                                  "request's KV (see that rank's log)"),
      effect="the request is refused with a generic message")
def peer_rank_message(req: Any) -> str:
    """The failure of a request that another TP rank of this decode found corrupt."""
    return (f"{HEAD} (request {_rid(req)}, room {getattr(req, 'bootstrap_room', None)}, "
            f"generation {_expected_generation(req)}): another TP rank of this decode "
            "found its KV shard differs from what prefill sent (see that rank's log)")


def _expected_generation(req: Any) -> int:
    rec = transfer.of(req)
    exp = rec.digest if rec is not None else None
    return exp.generation if isinstance(exp, Expected) else 0
