"""The KV digest wired into the PD servers (``sglang.pdsafe.kv_integrity``), no servers.

Through upstream's real, patched code on objects built without their heavy constructors:
prefill's ``SchedulerDisaggregationPrefillMixin.send_kv_chunk`` writes the digest row of a real
``MHATokenToKVPool`` into a real ``MetadataBuffers``; the transfer is reproduced byte for byte
(every aux row through upstream's TCP aux codec, every sent page copied page-granular into
*other* pages of a second pool, the way a backend writes them); decode's
``DecodeTransferQueue._commit_transfer_to_req`` keeps the row and
``SchedulerDisaggregationDecodeMixin._verify_kv_checksums`` checks it, failing a request with
upstream's own abort path (``_handle_kv_checksum_mismatch``: 500, streamed, pages released).

Also: the fork prefill's extra aux buffer against a stock decode through upstream's real
``MooncakeKVManager.send_aux_tcp`` (every other buffer arrives at its place), the stock-peer
waiver, upstream's mismatch injector, the off switch and the pairing field.

What this does not show: real servers and backends moving the bytes (Mooncake/NIXL end to end),
a GPU pool, TP > 1 (the all-reduce of the drop set is the identity here).
"""

from __future__ import annotations

import ctypes
import logging
import random
from http import HTTPStatus
from types import SimpleNamespace
from unittest.mock import MagicMock, patch

import pytest
import torch
from sglang.pdsafe import (
    bootstrap_auth,
    control_mac,
    coverage,
    kv_digest,
    kv_integrity,
    metrics,
    pair_agreement,
    peer_policy,
    transfer,
)
from sglang.srt.mem_cache import memory_pool as mp

ROOM = 0x5EED_0000_1234
PAGE = 16
TOKENS = 37  # three pages, the last one partial
PREFILL_PAGES = (5, 2, 9)
DECODE_PAGES = (3, 7, 1)
POOL_IDX = 1
PREFILL_IDX, DECODE_IDX = 2, 5
INJECT_ENV = "SGLANG_TEST_DISAGG_KV_CHECKSUM_MISMATCH_PROB"


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for var in (kv_integrity.ENV_ENABLE, peer_policy.ENV_WAIVE, INJECT_ENV, coverage.ENV_MODE,
                pair_agreement.ENV_ENABLE, pair_agreement.ENV_SKIP, bootstrap_auth.ENV_TOKEN,
                control_mac.ENV_ENABLE):
        monkeypatch.delenv(var, raising=False)


def _disagg(mode: str = "prefill", flag: bool = False) -> SimpleNamespace:
    return SimpleNamespace(disaggregation_mode=mode, disaggregation_enable_kv_checksum=flag)


def _pool(seed: int, dtype: torch.dtype = torch.bfloat16) -> mp.MHATokenToKVPool:
    pool = mp.MHATokenToKVPool(size=512, page_size=PAGE, dtype=dtype, head_num=2, head_dim=16,
                               layer_num=2, enable_alt_stream=False, device="cpu",
                               enable_memory_saver=False)
    g = torch.Generator().manual_seed(seed)
    for t in list(pool.k_buffer) + list(pool.v_buffer):
        u8 = t.view(torch.uint8)
        u8.copy_(torch.randint(0, 256, u8.shape, dtype=torch.uint8, generator=g))
    return pool


def _buffers(mode: str, enabled: bool = True):
    from sglang.srt.disaggregation.utils import MetadataBuffers

    on = kv_integrity.carrier_enabled(_disagg(mode)) if enabled else False
    return MetadataBuffers(8, hidden_size=16, hidden_states_dtype=torch.float32,
                           max_sampling_mask_tokens=4, kv_checksum_enabled=on)


def _req_to_token(pages: tuple[int, ...]):
    rtp = mp.ReqToTokenPool(size=4, max_context_len=128, device="cpu", enable_memory_saver=False)
    locs = [p * PAGE + o for p in pages for o in range(PAGE)][:TOKENS]
    rtp.req_to_token[POOL_IDX, :TOKENS] = torch.tensor(locs, dtype=torch.int32)
    return rtp


# --------------------------------------------------------------------------- prefill


class _Prefill:
    """The prefill scheduler's state that ``send_kv_chunk`` uses; the transfer itself
    (``_send_kv_chunk``) is recorded: the row it would post and upstream's ``set_buf`` room."""

    def __init__(self, pool, digester) -> None:
        from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

        self.send_kv_chunk = SchedulerDisaggregationPrefillMixin.send_kv_chunk.__get__(self)
        self.pool = pool
        self.kv_checksum_computer = digester
        self.disagg_metadata_buffers = _buffers("prefill")
        self.req_to_token_pool = _req_to_token(PREFILL_PAGES)
        self.sent: list[tuple[bool, int | None, list[int]]] = []

    def _send_kv_chunk(self, req, last_chunk=False, end_idx=None):
        buf = self.disagg_metadata_buffers
        buf.bootstrap_room[req.metadata_buffer_index, 0] = req.bootstrap_room  # upstream set_buf
        coverage.attest_prefill_hook(buf, req, end_idx if end_idx is not None else TOKENS, PAGE)
        self.sent.append((last_chunk, end_idx,
                          buf.kv_checksum[req.metadata_buffer_index].tolist()))


def _prefill_req(prefix: int = 0, rid: str = "req-1", room: int = ROOM):
    return SimpleNamespace(rid=rid, bootstrap_room=room, metadata_buffer_index=PREFILL_IDX,
                           disagg_decode_prefix_len=prefix, origin_input_ids=list(range(TOKENS)),
                           extend_end=TOKENS, kv=SimpleNamespace(req_pool_idx=POOL_IDX))


def _prefill(prefix: int = 0, rid: str = "req-1", seed: int = 1) -> tuple[_Prefill, object]:
    pool = _pool(seed)
    p = _Prefill(pool, kv_integrity.leg_digester(pool, _disagg("prefill")))
    req = _prefill_req(prefix, rid)
    p.send_kv_chunk(req, last_chunk=False, end_idx=PAGE)  # an earlier chunk: no digest yet
    assert p.disagg_metadata_buffers.kv_checksum[PREFILL_IDX].tolist() == [0] * 8
    p.send_kv_chunk(req, last_chunk=True)
    return p, req


# --------------------------------------------------------------------------- the transfer


def _copy_pages(src_pool, dst_pool, prefix: int) -> None:
    """Page-granular writes of every sent page into decode's pages (what the backends do)."""
    src_ptrs, _, item_lens = src_pool.get_contiguous_buf_infos()
    dst_ptrs, _, dst_lens = dst_pool.get_contiguous_buf_infos()
    assert item_lens == dst_lens
    first = prefix // PAGE
    for sp, dp, n in zip(src_ptrs, dst_ptrs, item_lens, strict=True):
        for s_page, d_page in list(zip(PREFILL_PAGES, DECODE_PAGES, strict=True))[first:]:
            ctypes.memmove(dp + d_page * n, sp + s_page * n, n)


def _copy_aux(src, dst, src_idx: int = PREFILL_IDX, dst_idx: int = DECODE_IDX) -> None:
    """Every aux row through upstream's TCP aux codec, stopping at the shorter list."""
    from sglang.srt.disaggregation.common.utils import AuxDataCodec

    ptrs, _, item_lens = src.get_buf_infos()
    kv_args = SimpleNamespace()
    kv_args.aux_data_ptrs, _, kv_args.aux_item_lens = dst.get_buf_infos()
    for i in range(min(len(ptrs), len(kv_args.aux_data_ptrs))):
        data = AuxDataCodec.serialize_data_from_buffer(ptrs[i] + item_lens[i] * src_idx,
                                                       item_lens[i])
        AuxDataCodec.deserialize_data_to_buffer(kv_args, i, dst_idx, data)


# --------------------------------------------------------------------------- decode


class _Batch:
    def __init__(self, reqs) -> None:
        self.reqs = list(reqs)
        self.kept: list[int] | None = None

    def filter_batch(self, keep_indices=None):
        self.kept = list(keep_indices)
        self.reqs = [self.reqs[i] for i in keep_indices]


class _Decode:
    """Decode's transfer queue and scheduler state around one transferred request."""

    def __init__(self, pool, prefix: int, rid: str = "req-1", host: str = "127.0.0.1",
                 room: int = ROOM, with_row: bool = True) -> None:
        from sglang.srt.disaggregation.common.conn import CommonKVManager
        from sglang.srt.disaggregation.decode import (
            DecodeTransferQueue,
            SchedulerDisaggregationDecodeMixin,
        )

        self.pool = pool
        self.digester = kv_integrity.leg_digester(pool, _disagg("decode"))
        self.buffers = _buffers("decode", enabled=with_row)
        self.queue = DecodeTransferQueue.__new__(DecodeTransferQueue)
        self.queue.metadata_buffers = self.buffers
        self.kv_manager = CommonKVManager.__new__(CommonKVManager)
        self.sched = SimpleNamespace(
            kv_checksum_computer=self.digester,
            disagg_decode_prealloc_queue=SimpleNamespace(
                kv_manager=self.kv_manager, kv_checksum_mismatch_injector=random.Random(0)),
            req_to_token_pool=_req_to_token(DECODE_PAGES), attn_tp_cpu_group=None,
            output_streamer=SimpleNamespace(stream_output=MagicMock()), tree_cache=object(),
            metrics_reporter=SimpleNamespace(enable_metrics=True),
            metrics_collector=SimpleNamespace(increment_transfer_failed_reqs=MagicMock()))
        self.queue.scheduler = self.sched
        mixin = SchedulerDisaggregationDecodeMixin
        self.sched._verify_kv_checksums = mixin._verify_kv_checksums.__get__(self.sched)
        self.sched._handle_kv_checksum_mismatch = \
            mixin._handle_kv_checksum_mismatch.__get__(self.sched)
        req = SimpleNamespace(rid=rid, bootstrap_room=room, bootstrap_host=host,
                              bootstrap_port=8998, origin_input_ids=list(range(TOKENS)),
                              output_ids=[], return_logprob=False, finished_reason=None,
                              kv=SimpleNamespace(req_pool_idx=POOL_IDX,
                                                 cache_protected_len=prefix))
        receiver = SimpleNamespace(kv_mgr=self.kv_manager, bootstrap_addr="127.0.0.1:8998",
                                   clear=lambda: None)
        self.receiver = receiver
        self.dreq = SimpleNamespace(req=req, metadata_buffer_index=DECODE_IDX,
                                    kv_receiver=receiver)
        n_pages = -(-(TOKENS - prefix) // PAGE)
        coverage.note_reservation_hook(self.dreq, list(DECODE_PAGES[-n_pages:]), PAGE, prefix,
                                       TOKENS)

    @property
    def req(self):
        return self.dreq.req

    def commit(self) -> None:
        """Upstream's commit up to the pdsafe commit gate, or for a fake transfer (which the
        gate skips) up to the HiCache restore after it: stopped there, since what follows
        needs a whole scheduler. Upstream's room check before the gate must pass."""
        import sglang.srt.disaggregation.decode as decode_mod
        from sglang.pdsafe import commit_gate

        class Stop(Exception):
            pass

        self.dreq.kv_receiver = self.receiver  # the stopped commit clears it
        gate = MagicMock(return_value=False)
        q = decode_mod.DecodeTransferQueue
        with patch.object(commit_gate, "admit_commit", gate), \
                patch.object(q, "_commit_hicache_local_restore_to_req", side_effect=Stop), \
                patch.object(decode_mod, "prepare_abort") as abort:
            try:
                q._commit_transfer_to_req(self.queue, self.dreq)
            except Stop:
                assert not gate.called  # only a fake transfer passes the gate unasked
        assert not abort.called, "upstream's room check refused the transfer"

    def verify(self, reqs=None) -> tuple[_Batch, MagicMock]:
        """The new prebuilt batch's check (``_verify_kv_checksums``, as patched)."""
        import sglang.srt.disaggregation.decode as decode_mod

        batch = _Batch(reqs if reqs is not None else [self.req])
        with patch.object(decode_mod, "all_reduce_flags", side_effect=lambda f, *a, **k: f), \
                patch.object(decode_mod, "release_kv_cache") as release:
            self.sched._verify_kv_checksums(batch)
        return batch, release


def _transfer(prefix: int = 0, rid: str = "req-1", decode_pool=None, **kw) -> _Decode:
    p, _ = _prefill(prefix, rid)
    d = _Decode(decode_pool if decode_pool is not None else _pool(99), prefix, rid, **kw)
    _copy_pages(p.pool, d.pool, prefix)
    _copy_aux(p.disagg_metadata_buffers, d.buffers)
    d.commit()
    return d


def _counts() -> dict[str, float]:
    return {n: metrics.value(n) for n in (kv_integrity.MISMATCH, kv_integrity.MISSING,
                                          kv_integrity.INVALID, kv_integrity.FAILED,
                                          kv_integrity.WAIVED)}


def _delta(before: dict[str, float]) -> dict[str, float]:
    return {n: v - before[n] for n, v in _counts().items() if v != before[n]}


def _assert_passed(d: _Decode, batch: _Batch, release: MagicMock) -> None:
    assert d.req.finished_reason is None, d.req.finished_reason
    assert batch.kept is None and batch.reqs == [d.req]
    assert not release.called


def _assert_failed(d: _Decode, batch: _Batch, release: MagicMock, *texts: str) -> str:
    fr = d.req.finished_reason
    assert fr is not None, "the request was not failed"
    assert fr.status_code == HTTPStatus.INTERNAL_SERVER_ERROR
    assert fr.message.startswith(kv_integrity.HEAD), fr.message
    assert str(d.req.bootstrap_room) in fr.message and d.req.rid in fr.message
    for t in texts:
        assert t in fr.message, (t, fr.message)
    assert batch.kept == [] and batch.reqs == []  # dropped before its first decode step
    release.assert_called_once_with(d.req, d.sched.tree_cache, checkpoint=False)
    d.sched.output_streamer.stream_output.assert_called_once_with([d.req], False)
    d.sched.metrics_collector.increment_transfer_failed_reqs.assert_called_once()
    return fr.message


def _owned_bytes(d: _Decode, prefix: int) -> list[torch.Tensor]:
    """uint8 views of every owned slot of every K and V buffer in decode's pool, located from
    the pool's own buffers and decode's pages (independently of the module)."""
    locs = [p * PAGE + o for p in DECODE_PAGES for o in range(PAGE)][prefix:TOKENS]
    bufs = list(d.pool.k_buffer) + list(d.pool.v_buffer)
    return [b.view(torch.uint8)[loc].reshape(-1) for b in bufs for loc in locs]


# --------------------------------------------------------------------------- the row


def test_row_roundtrip_check_word_and_int64_storage():
    p, req = _prefill()
    words = p.disagg_metadata_buffers.kv_checksum[PREFILL_IDX].tolist()
    row = kv_integrity.decode_row(words)
    assert (row.room, row.generation, row.prefix, row.token_count) == (ROOM, 0, 0, TOKENS)
    assert words[kv_integrity.SLOT_TAG] >> 40 == kv_integrity.TAG
    assert 0 < words[kv_integrity.SLOT_TAG] < (1 << 63)  # positive as int64 (Ascend)
    full = kv_integrity.Digester(p.pool).digest(p, req, prefix=0, length=TOKENS, room=ROOM)
    assert row.value == kv_integrity.seal(full) and row.signature_hi == full.signature[:8]
    assert row.value != full.value  # sealed, not the bare XXH3 value
    as_i64 = torch.zeros((1, 8), dtype=torch.int64)
    kv_integrity.write_row(as_i64, 0, words)
    assert kv_integrity.decode_row(as_i64[0].tolist()) == row
    for slot in range(1, 8):  # any changed slot fails the row's check
        bad = list(words)
        bad[slot] ^= 1 << 17
        with pytest.raises(kv_integrity.RowError) as e:
            kv_integrity.decode_row(bad)
        assert e.value.reason == "invalid"
    for bad, reason in (([0] * 8, "missing"), (None, "missing"),
                        ([words[0] ^ (1 << 33)] + words[1:], "missing")):  # another version
        with pytest.raises(kv_integrity.RowError) as e:
            kv_integrity.decode_row(bad)
        assert e.value.reason == reason


def test_prefill_digests_every_request_before_the_send_health_checks_included():
    p, req = _prefill(rid="HEALTH_CHECK_1234")
    (_, _, early), (last, end, at_send) = p.sent
    assert early == [0] * 8 and last is True and end is None  # upstream's default end
    assert at_send != [0] * 8  # written before the chunk (and its aux row) is posted
    assert kv_integrity.decode_row(at_send).token_count == TOKENS


def test_prefill_failure_sends_no_digest_and_counts(caplog):
    p, req = _prefill()
    req.kv = SimpleNamespace(req_pool_idx=99)  # no such req_to_token row
    before = _counts()
    with caplog.at_level(logging.ERROR):
        p.send_kv_chunk(req, last_chunk=True)
    assert p.sent[-1][2] == [0] * 8
    assert _delta(before) == {kv_integrity.FAILED: 1}
    # the failure policy: counted once, logged naming the hook, the room failed at once
    assert any("kv_integrity.prefill_write_row failed" in r.getMessage()
               and "the room fails at once" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- decode verdicts


@pytest.mark.parametrize("prefix", [0, PAGE])
def test_an_intact_transfer_verifies_and_a_resumed_request_is_not_rechecked(prefix):
    d = _transfer(prefix)
    before = _counts()
    batch, release = d.verify()
    _assert_passed(d, batch, release)
    assert _delta(before) == {}
    # Retracted later and resumed from decode's own backup: its own tokens now fill the last
    # page; no transfer happened since the check, so none is checked again.
    _owned_bytes(d, prefix)[-1][0] ^= 0xFF
    batch, release = d.verify()
    _assert_passed(d, batch, release)


@pytest.mark.parametrize("prefix", [0, PAGE])
def test_one_flipped_bit_in_any_transferred_page_fails_the_request_with_500(prefix):
    rng = random.Random(prefix + 7)
    for trial in range(12):
        d = _transfer(prefix)
        owned = _owned_bytes(d, prefix)
        target = owned[-1] if trial == 0 else rng.choice(owned)  # trial 0: last partial page
        target[rng.randrange(target.numel())] ^= 1 << rng.randrange(8)
        before = _counts()
        batch, release = d.verify()
        _assert_failed(d, batch, release, "differ from what prefill sent")
        assert _delta(before) == {kv_integrity.MISMATCH: 1}


def test_bytes_outside_the_owned_range_never_fail_it():
    d = _transfer(prefix=PAGE)
    last = DECODE_PAGES[-1]
    for b in list(d.pool.k_buffer) + list(d.pool.v_buffer):
        u8 = b.view(torch.uint8)
        u8[last * PAGE + TOKENS % PAGE:(last + 1) * PAGE] ^= 0x5A  # the last page's tail
        u8[DECODE_PAGES[0] * PAGE:(DECODE_PAGES[0] + 1) * PAGE] ^= 0x5A  # decode's own prefix
    batch, release = d.verify()
    _assert_passed(d, batch, release)


def test_a_zero_row_is_a_failure_not_a_skip():
    d = _Decode(_pool(99), 0)
    p, _ = _prefill()
    _copy_pages(p.pool, d.pool, 0)
    _copy_aux(p.disagg_metadata_buffers, d.buffers)
    d.buffers.kv_checksum[DECODE_IDX] = 0  # what a prefill without the digest leaves
    d.commit()
    before = _counts()
    batch, release = d.verify()
    _assert_failed(d, batch, release, "no KV digest")
    assert _delta(before) == {kv_integrity.MISSING: 1}


def test_a_health_check_rid_is_verified_like_any_other():
    d = _transfer(rid="HEALTH_CHECK_abc")
    batch, release = d.verify()
    _assert_passed(d, batch, release)  # checked (a row was sent and matched), not skipped
    d = _transfer(rid="HEALTH_CHECK_abc")
    _owned_bytes(d, 0)[3][1] ^= 0x10
    before = _counts()
    batch, release = d.verify()
    _assert_failed(d, batch, release)
    assert _delta(before) == {kv_integrity.MISMATCH: 1}


def test_another_layout_is_a_failure_not_a_skip():
    """fp16 on decode, bf16 on prefill: the same bytes per row and the same bytes copied."""
    d = _transfer(decode_pool=_pool(99, dtype=torch.float16))
    before = _counts()
    batch, release = d.verify()
    msg = _assert_failed(d, batch, release, "different KV layouts")
    assert "float16" in msg
    assert _delta(before) == {kv_integrity.INVALID: 1}


def _rewrite_row(d: _Decode, slot: int, value: int) -> None:
    """Change one slot of the transferred row and re-seal it (a well-formed row for another
    transfer), then commit again."""
    words = d.buffers.kv_checksum[DECODE_IDX].tolist()
    words[slot] = value
    body = words[1:]
    words[0] = (words[0] & ~0xFFFFFFFF) | kv_integrity._check32(body)
    kv_integrity.write_row(d.buffers.kv_checksum, DECODE_IDX, words)
    d.commit()


def test_a_digest_bound_to_another_transfer_is_refused_naming_the_field():
    d = _transfer()
    _rewrite_row(d, kv_integrity.SLOT_ROOM, ROOM + 1)
    before = _counts()
    batch, release = d.verify()
    _assert_failed(d, batch, release, "another transfer", f"room {ROOM + 1} vs {ROOM}")
    assert _delta(before) == {kv_integrity.INVALID: 1}


def test_a_corrupt_row_is_refused():
    d = _transfer()
    d.buffers.kv_checksum[DECODE_IDX, kv_integrity.SLOT_VALUE_LO] ^= 1
    d.commit()
    before = _counts()
    batch, release = d.verify()
    _assert_failed(d, batch, release, "fails its check")
    assert _delta(before) == {kv_integrity.INVALID: 1}


def _with_key(monkeypatch, key: str | None) -> None:
    if key is None:
        monkeypatch.delenv(bootstrap_auth.ENV_TOKEN, raising=False)
    else:
        monkeypatch.setenv(bootstrap_auth.ENV_TOKEN, key)


def _forge(d: _Decode, key: bytes) -> None:
    """What a keyless party that can write decode's pages and its metadata row does (one-sided
    RDMA reaches both): KV of its choosing in the pages, and a row for exactly those bytes
    (XXH3 is public), sealed under ``key``, its guess."""
    _owned_bytes(d, 0)[0][0] ^= 0x40
    chosen = d.digester.digest(d.sched, d.req, prefix=0, length=TOKENS, room=ROOM)
    kv_integrity.write_row(d.buffers.kv_checksum, DECODE_IDX,
                           kv_integrity.encode_row(chosen, key))
    d.commit()


def test_the_row_is_sealed_with_the_cluster_key(monkeypatch):
    """Unkeyed, the row is a checksum: whoever writes the pages can write a matching row (the
    forged transfer verifies). With a cluster key, a row sealed under any other key (or none)
    fails as a mismatch naming the key; a decode accepting both keys of a rotation takes the
    prefill's; a decode holding only another key refuses an honest row."""
    d = _transfer()
    _forge(d, b"")
    batch, release = d.verify()
    _assert_passed(d, batch, release)  # what the key closes
    a, b = "cluster-key-a" * 3, "cluster-key-b" * 3
    _with_key(monkeypatch, a)
    d = _transfer()
    batch, release = d.verify()
    _assert_passed(d, batch, release)
    for guess in (b"", b"cluster-key-a", b"a guessed key"):
        d = _transfer()
        _forge(d, guess)
        before = _counts()
        batch, release = d.verify()
        _assert_failed(d, batch, release, "differ from what prefill sent", "cluster key")
        assert _delta(before) == {kv_integrity.MISMATCH: 1}
    d = _transfer()  # sealed under a
    _with_key(monkeypatch, f"{b},{a}")  # rotation: signs with b, accepts a too
    batch, release = d.verify()
    _assert_passed(d, batch, release)
    d = _transfer()  # sealed under b
    _with_key(monkeypatch, a)
    batch, release = d.verify()
    _assert_failed(d, batch, release, "cluster key")


def test_a_peer_the_backend_cannot_compare_is_a_failure_not_a_skip():
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    d = _transfer()
    before = _counts()
    with patch.object(CommonKVManager, "should_verify_kv_checksum", return_value=False):
        batch, release = d.verify()
    _assert_failed(d, batch, release, "covers other bytes")
    assert _delta(before) == {kv_integrity.INVALID: 1}


def test_upstreams_injector_still_fails_the_request(monkeypatch):
    monkeypatch.setenv(INJECT_ENV, "1.0")
    d = _transfer()
    before = _counts()
    batch, release = d.verify()
    _assert_failed(d, batch, release)
    assert _delta(before) == {kv_integrity.MISMATCH: 1}


def test_a_batch_drops_only_the_corrupt_request():
    d = _transfer()
    good = d.req
    bad = SimpleNamespace(**{**{k: v for k, v in vars(good).items() if k != transfer.REQ_HANDLE},
                             "rid": "bad", "finished_reason": None})
    d.dreq.req = bad  # a second transfer into the same pages, whose digest value differs
    _rewrite_row(d, kv_integrity.SLOT_VALUE_HI, 12345)
    before = _counts()
    batch, release = d.verify([good, bad])
    assert batch.kept == [0] and batch.reqs == [good] and good.finished_reason is None
    assert bad.finished_reason.status_code == HTTPStatus.INTERNAL_SERVER_ERROR
    release.assert_called_once_with(bad, d.sched.tree_cache, checkpoint=False)
    assert _delta(before) == {kv_integrity.MISMATCH: 1}


def test_fake_transfers_are_not_checked_but_a_missing_record_fails():
    from sglang.pdsafe.client_guard import FAKE_BOOTSTRAP_HOST

    d = _Decode(_pool(99), 0, host=FAKE_BOOTSTRAP_HOST)  # server warmup: nothing transferred
    locs = d.sched.req_to_token_pool.req_to_token[POOL_IDX, :TOKENS].to(torch.int64)
    owned = [t[locs] for t in list(d.pool.k_buffer) + list(d.pool.v_buffer)]
    assert all(bool(o.any()) for o in owned), "the pages hold an earlier request's bytes"
    served = metrics.value("fake_transfer_served_total")
    d.commit()
    # No KV moved: the pages decode reserved are zeroed before the request decodes, so it
    # never decodes over what an earlier request left there (counted).
    assert all(not bool(t[locs].any()) for t in list(d.pool.k_buffer) + list(d.pool.v_buffer))
    assert metrics.value("fake_transfer_served_total") == served + 1
    before = _counts()
    batch, release = d.verify()
    _assert_passed(d, batch, release)
    assert _delta(before) == {}
    d = _transfer()
    transfer.of(d.req).digest = None  # reached a batch without decode's commit hook
    batch, release = d.verify()
    _assert_failed(d, batch, release, "no KV digest record")


# --------------------------------------------------------------------------- mixed versions


def _stock_transfer(kv_mgr_stock: bool):
    """A stock prefill (no digest row) to a fork decode: the row stays as clear_slot left it."""
    p, _ = _prefill()
    stock = _buffers("prefill", enabled=False)
    assert stock.kv_checksum is None
    stock.bootstrap_room[PREFILL_IDX] = p.disagg_metadata_buffers.bootstrap_room[PREFILL_IDX]
    d = _Decode(_pool(99), 0)
    _copy_pages(p.pool, d.pool, 0)
    _copy_aux(stock, d.buffers)
    assert d.buffers.kv_checksum[DECODE_IDX].tolist() == [0] * 8
    if kv_mgr_stock:
        peer_policy.stock_peers(d.kv_manager).add(d.dreq.kv_receiver.bootstrap_addr)
    d.commit()
    return d


def test_stock_prefill_is_refused_unless_kv_digest_is_waived_for_it(monkeypatch):
    monkeypatch.setenv(peer_policy.ENV_WAIVE, "pair-agreement,coverage-attestation")
    d = _stock_transfer(kv_mgr_stock=True)
    batch, release = d.verify()
    _assert_failed(d, batch, release, "SGLANG_PDSAFE_WAIVE_FOR_STOCK_PEERS")
    monkeypatch.setenv(peer_policy.ENV_WAIVE, "pair-agreement,coverage-attestation,kv-digest")
    d = _stock_transfer(kv_mgr_stock=False)  # a pdsafe peer never gets the waiver
    batch, release = d.verify()
    _assert_failed(d, batch, release)
    d = _stock_transfer(kv_mgr_stock=True)
    before = _counts()
    batch, release = d.verify()
    _assert_passed(d, batch, release)
    assert _delta(before) == {kv_integrity.WAIVED: 1}


def test_a_fork_prefill_serves_a_stock_decode_every_other_buffer_in_place():
    """Through upstream's real Mooncake ``send_aux_tcp`` (stops at the shorter list)."""
    from sglang.srt.disaggregation.common.utils import AuxDataCodec
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    p, req = _prefill()
    fork = p.disagg_metadata_buffers
    fork.output_ids[PREFILL_IDX, 0] = 4242
    stock_decode = _buffers("decode", enabled=False)
    src = SimpleNamespace()
    src.aux_data_ptrs, _, src.aux_item_lens = fork.get_buf_infos()
    dst = SimpleNamespace()
    dst.aux_data_ptrs, _, dst.aux_item_lens = stock_decode.get_buf_infos()
    assert len(src.aux_data_ptrs) == len(dst.aux_data_ptrs) + 1
    assert src.aux_data_ptrs[-1] == fork.kv_checksum.data_ptr()  # the extra buffer is last

    def deliver(remote, dst_port, room, buffer_index, aux_index, data):
        AuxDataCodec.deserialize_data_to_buffer(dst, buffer_index, aux_index, data)

    mgr = SimpleNamespace(kv_args=src, send_aux_data_to_endpoint=deliver)
    info = SimpleNamespace(endpoint="127.0.0.1", dst_port=1, room=ROOM, dst_aux_index=DECODE_IDX)
    MooncakeKVManager.send_aux_tcp(mgr, info, PREFILL_IDX, dst.aux_data_ptrs)
    assert stock_decode.output_ids[DECODE_IDX, 0] == 4242
    assert stock_decode.bootstrap_room[DECODE_IDX].tolist() == \
        fork.bootstrap_room[PREFILL_IDX].tolist()  # room + coverage attestation, unchanged


# --------------------------------------------------------------------------- switches


def test_on_by_default_off_only_explicitly_and_upstreams_flag_keeps_it_on(monkeypatch, caplog):
    from sglang.pdsafe import protections, startup

    args = _disagg("decode")
    assert kv_integrity.carrier_enabled(args) and protections.status(args)["kv-digest"]
    assert kv_integrity.advertised(args) == kv_digest.SCHEME
    assert not kv_integrity.carrier_enabled(_disagg("null"))
    monkeypatch.setenv(kv_integrity.ENV_ENABLE, "0")
    assert not kv_integrity.carrier_enabled(args) and kv_integrity.advertised(args) == "off"
    assert kv_integrity.leg_digester(_pool(1), args) is None
    assert _buffers("decode").kv_checksum is None
    with caplog.at_level(logging.WARNING, logger="sglang.pdsafe"):
        assert startup.report(args)["kv-digest"] is False
    assert any("'kv-digest' is OFF" in r.getMessage() for r in caplog.records)
    assert kv_integrity.carrier_enabled(_disagg("decode", flag=True))
    # Off: upstream's _verify_kv_checksums does nothing (no digester), by the operator's choice.
    d = _Decode(_pool(99), 0)
    assert d.digester is None
    batch, release = d.verify()
    _assert_passed(d, batch, release)


def test_a_layout_the_digest_cannot_cover_refuses_to_start():
    class SubclassedPool(mp.MHATokenToKVPool):  # any class the digest does not know
        pass

    pool = SubclassedPool(size=64, page_size=PAGE, dtype=torch.bfloat16, head_num=2,
                          head_dim=16, layer_num=1, enable_alt_stream=False, device="cpu",
                          enable_memory_saver=False)
    with pytest.raises(RuntimeError, match=kv_integrity.ENV_ENABLE) as e:
        kv_integrity.leg_digester(pool, _disagg("prefill"))
    assert "SubclassedPool" in str(e.value)


def test_pairing_refuses_a_fork_prefill_with_the_digest_off_naming_the_setting():
    from .test_pair_agreement import settings

    mine = settings(kv_digest=kv_digest.SCHEME)
    found = pair_agreement.compare(settings(kv_digest="off"), mine)
    assert found == [pair_agreement.Mismatch("kv_digest", "off", kv_digest.SCHEME)]
    assert kv_integrity.ENV_ENABLE in pair_agreement.refusal_message("p:1", found)
    assert pair_agreement.compare(settings(), mine) == []  # published nothing: per transfer


# --------------------------------------------------------------------------- the breaker

def test_an_intact_transfer_counts_as_verified():
    d = _transfer()
    n = metrics.value(kv_integrity.VERIFIED_COUNTER)
    batch, release = d.verify()
    _assert_passed(d, batch, release)
    assert metrics.value(kv_integrity.VERIFIED_COUNTER) == n + 1


def test_agreed_mismatches_open_the_breaker_and_the_door_closes(monkeypatch):
    """SGLANG_PDSAFE_KV_MISMATCH_BREAKER=2/60 through the real patched check: the first
    mismatch is a 500 and serving goes on; the second opens the breaker (CRITICAL, counted
    once), the decode's door then refuses every new request with 503 and the reason, and
    /health reports it. A missing digest (a configuration problem) is not counted."""
    from sglang.pdsafe import kv_breaker, quarantine

    monkeypatch.setenv(kv_breaker.ENV, "2/60")
    kv_breaker.reset_for_tests()
    monkeypatch.setattr(kv_breaker, "reset_for_tests", kv_breaker.reset_for_tests)
    try:
        queue = SimpleNamespace(kv_manager=SimpleNamespace(),
                                token_to_kv_pool_allocator=SimpleNamespace(size=100))
        opened = metrics.value("kv_breaker_opened_total")

        d = _transfer()  # a zero row: missing, not a mismatch
        for word in range(kv_integrity.ROW_WIDTH):
            _rewrite_row(d, word, 0)
        d.verify()
        assert d.req.finished_reason is not None and quarantine.door(queue) is None

        for n in range(2):
            d = _transfer()
            _owned_bytes(d, 0)[3][1] ^= 0x10
            batch, release = d.verify()
            _assert_failed(d, batch, release, "differ from what prefill sent")
            if n == 0:
                assert quarantine.door(queue) is None, "one mismatch must not stop serving"
        assert metrics.value("kv_breaker_opened_total") == opened + 1
        refused = metrics.value("kv_breaker_refused_total")
        r = quarantine.door(queue)
        assert r is not None and r.status == 503 and kv_breaker.MARKER in r.message
        assert "restart" in r.message and kv_breaker.ENV in r.message
        assert metrics.value("kv_breaker_refused_total") == refused + 1
        assert quarantine.health_refusal([SimpleNamespace(detail=r.message)]) == r.message
        assert quarantine.door(queue, reentry=True) is None  # admitted requests finish
    finally:
        monkeypatch.delenv(kv_breaker.ENV)
        kv_breaker.reset_for_tests()
    assert quarantine.door(queue) is None


def test_a_malformed_breaker_setting_refuses_the_start(monkeypatch):
    from sglang.pdsafe import kv_breaker

    monkeypatch.setenv(kv_breaker.ENV, "three per minute")
    kv_breaker.reset_for_tests()
    try:
        with pytest.raises(ValueError, match=kv_breaker.ENV):
            kv_integrity.leg_digester(_pool(1), _disagg("decode"))
    finally:
        monkeypatch.delenv(kv_breaker.ENV)
        kv_breaker.reset_for_tests()
