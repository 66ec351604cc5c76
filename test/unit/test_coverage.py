"""Unit tests of the token-exact coverage attestation (sglang.pdsafe.coverage), no servers.

The pure functions are tested directly; the hooks are driven through upstream's real
``MetadataBuffers`` and the real TCP aux codec (``AuxDataCodec``), so the row that travels is
exactly what a Mooncake/NIXL transfer of the existing ``bootstrap_room`` buffer carries.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from types import SimpleNamespace

import pytest
import torch
from sglang.pdsafe import coverage as cov
from sglang.pdsafe import metrics, policy, transfer

ROOM = 0x1234_5678_9ABC
TOKENS = list(range(10, 115))  # 105 tokens


def _res(tokens=TOKENS, first=0, page_size=16, room=ROOM, pages=None) -> cov.Coverage:
    return cov.build_coverage(room, tokens, first, len(tokens), page_size, page_count=pages)


# --------------------------------------------------------------------------- pure functions


def test_row_roundtrip_fits_int64_and_upstream_room_slot():
    c = _res()
    row = cov.encode(c)
    assert len(row) == cov.ROW_WIDTH == 8
    assert row[cov.SLOT_ROOM] == ROOM  # slot 0 stays upstream's bootstrap_room
    assert all(0 <= v < (1 << 63) for v in row[1:])
    assert cov.decode(row) == c
    assert cov.verify(row, c).ok


def test_partial_last_page_divergence_is_caught():
    """Page 16: prefill wrote 100 tokens, decode reserved 105: same 7 pages, other tokens."""
    decode_side = _res(TOKENS)
    prefill_side = _res(TOKENS[:100])
    assert prefill_side.page_count == decode_side.page_count == 7
    v = cov.verify(cov.encode(prefill_side), decode_side, rid="r1")
    assert v.outcome is cov.Outcome.MISMATCH
    assert "token_count" in v.differs and "page_count" not in v.differs
    assert v.counter == "coverage_mismatch_total"
    # The message names both counts and what the operator should do.
    assert "100 tokens" in v.message and "105 tokens" in v.message
    assert "--context-length" in v.message and "--allow-auto-truncate" in v.message
    assert "r1" in v.message


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_every_single_token_shortfall_is_caught(page_size):
    decode_side = _res(TOKENS, page_size=page_size)
    for n in range(len(TOKENS) - page_size - 1, len(TOKENS)):
        v = cov.verify(cov.encode(_res(TOKENS[:n], page_size=page_size)), decode_side)
        assert v.outcome is cov.Outcome.MISMATCH, n


def test_prefill_longer_than_reservation_is_caught():
    v = cov.verify(cov.encode(_res(TOKENS + [7, 8])), _res(TOKENS))
    assert not v.ok and "token_count" in v.differs


def test_same_length_other_tokens_only_digest_differs():
    other = TOKENS[:-1] + [TOKENS[-1] + 1]  # e.g. a template that differs in one word
    v = cov.verify(cov.encode(_res(other)), _res(TOKENS))
    assert v.differs == ("token_digest",)
    assert "chat template" in v.message


def test_digest_covers_the_prefix_not_only_written_positions():
    # With a decode-side cached prefix, prefill writes [64, 105) only; a different token in
    # the prefix still changes the KV of every written position.
    a = _res(TOKENS, first=64)
    b = _res([0] + TOKENS[1:], first=64)
    assert a.token_count == b.token_count == 41
    assert cov.verify(cov.encode(b), a).differs == ("token_digest",)


def test_room_page_size_first_token_differences():
    base = _res()
    assert cov.verify(cov.encode(_res(room=ROOM + 1)), base).differs[0] == "room"
    assert "page_size" in cov.verify(cov.encode(_res(page_size=64)), base).differs
    assert "first_token_idx" in cov.verify(cov.encode(_res(first=16)), base).differs
    assert cov.verify(cov.encode(_res(pages=8)), base).differs == ("page_count",)


def test_missing_and_corrupt_rows_are_refused():
    res = _res()
    unpatched = [ROOM, 0, 0, 0, 0, 0, 0, 0]  # what a prefill without pdsafe leaves
    v = cov.verify(unpatched, res, rid="r2")
    assert v.outcome is cov.Outcome.MISSING and not v.ok
    assert v.counter == "coverage_attestation_invalid_total"
    assert "no coverage attestation" in v.message and "105 tokens" in v.message
    row = cov.encode(_res(TOKENS[:100]))
    row[cov.SLOT_COUNT] = 105  # forge the count without fixing the crc
    assert cov.verify(row, res).outcome is cov.Outcome.CORRUPT


def test_signed_row_reads_are_normalised():
    """Ascend keeps the row as int64: a room >= 2**63 reads back negative."""
    big_room = (1 << 63) + 5
    c = _res(room=big_room)
    signed = [v - (1 << 64) if v >= (1 << 63) else v for v in cov.encode(c)]
    assert signed[0] < 0
    assert cov.verify(signed, c).ok


def test_decode_token_ids_on_rebootstrap():
    """The patch passes DecodePreallocQueue._rebootstrap_prefill_len(req): the prompt, or
    prompt + outputs while a re-bootstrap is in progress."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    req = SimpleNamespace(origin_input_ids=[1, 2, 3], output_ids=[4, 5])
    assert cov.decode_token_ids(req, DecodePreallocQueue._rebootstrap_prefill_len(req)) \
        == [1, 2, 3]
    req.pd_rebootstrap_in_progress = True
    assert cov.decode_token_ids(req, DecodePreallocQueue._rebootstrap_prefill_len(req)) \
        == [1, 2, 3, 4, 5]


def test_protection_registered_and_log_mode(monkeypatch, caplog):
    from sglang.pdsafe import protections

    args = SimpleNamespace(disaggregation_mode="decode")
    assert protections.status(args)["coverage-attestation"] is True
    monkeypatch.setenv(cov.ENV_MODE, "log")
    from sglang.pdsafe import startup

    with caplog.at_level(logging.WARNING, logger="sglang.pdsafe"):
        assert startup.report(args)["coverage-attestation"] is False
    assert any("coverage-attestation" in r.getMessage() and "OFF" in r.getMessage()
               for r in caplog.records)


# --------------------------------------------------------------------------- hooks, real buffers


def _buffers():
    from sglang.srt.disaggregation.utils import MetadataBuffers

    return MetadataBuffers(8, hidden_size=16, hidden_states_dtype=torch.float32,
                           max_sampling_mask_tokens=4)


def _transfer_row(src, dst, src_idx: int, dst_idx: int) -> None:
    """Move every aux buffer row exactly like Mooncake's TCP aux path does."""
    from sglang.srt.disaggregation.common.utils import AuxDataCodec

    ptrs, _, item_lens = src.get_buf_infos()
    kv_args = SimpleNamespace()
    kv_args.aux_data_ptrs, _, kv_args.aux_item_lens = dst.get_buf_infos()
    assert len(ptrs) == len(kv_args.aux_data_ptrs)  # no new buffer: counts unchanged
    for i, (p, n) in enumerate(zip(ptrs, item_lens, strict=True)):
        data = AuxDataCodec.serialize_data_from_buffer(p + n * src_idx, n)
        AuxDataCodec.deserialize_data_to_buffer(kv_args, i, dst_idx, data)


class _Queue:
    def __init__(self, buffers) -> None:
        self.metadata_buffers = buffers

    @staticmethod
    def _rebootstrap_prefill_len(req):
        return len(req.origin_input_ids)


def _prefill_req(tokens, idx=2, room=ROOM):
    return SimpleNamespace(bootstrap_room=room, origin_input_ids=list(tokens),
                           metadata_buffer_index=idx, disagg_decode_prefix_len=0)


def _decode_req(tokens, idx=5, room=ROOM):
    req = SimpleNamespace(rid="decode-rid", bootstrap_room=room, bootstrap_host="127.0.0.1",
                          origin_input_ids=list(tokens), output_ids=[], return_logprob=False,
                          finished_reason=None)
    return SimpleNamespace(req=req, metadata_buffer_index=idx)


def _roundtrip(prefill_tokens, decode_tokens, page_size=16):
    pbuf, dbuf = _buffers(), _buffers()
    preq = _prefill_req(prefill_tokens)
    pbuf.bootstrap_room[preq.metadata_buffer_index, 0] = preq.bootstrap_room  # upstream set_buf
    cov.attest_prefill_hook(pbuf, preq, len(prefill_tokens), page_size)
    dq = _Queue(dbuf)
    dreq = _decode_req(decode_tokens)
    pages = list(range(cov.pages_for(0, len(decode_tokens), page_size)))
    cov.note_reservation_hook(dreq, pages, page_size, 0, len(decode_tokens))
    _transfer_row(pbuf, dbuf, preq.metadata_buffer_index, dreq.metadata_buffer_index)
    return dq, dreq


def test_attestation_travels_in_the_existing_room_row():
    dq, dreq = _roundtrip(TOKENS, TOKENS)
    assert cov.check_commit_hook(dq, dreq).ok
    assert cov.admit(dq, dreq) is True and dreq.req.finished_reason is None
    # upstream's clear_slot (slot freed) leaves no attestation for the next owner
    dq.metadata_buffers.clear_slot(dreq.metadata_buffer_index)
    assert cov.check_commit_hook(dq, dreq).outcome is cov.Outcome.MISSING


def test_admit_aborts_with_500_and_counts(monkeypatch):
    monkeypatch.delenv(cov.ENV_MODE, raising=False)
    dq, dreq = _roundtrip(TOKENS[:100], TOKENS)
    before = metrics.value("coverage_mismatch_total")
    assert cov.admit(dq, dreq) is False
    fr = dreq.req.finished_reason
    assert fr.status_code == HTTPStatus.INTERNAL_SERVER_ERROR
    assert "100 tokens" in fr.message and "105 tokens" in fr.message
    assert metrics.value("coverage_mismatch_total") == before + 1


def test_admit_without_reservation_fails_closed():
    dq, dreq = _roundtrip(TOKENS, TOKENS)
    transfer.of(dreq.req).coverage = None
    before = metrics.value("coverage_attestation_invalid_total")
    assert cov.admit(dq, dreq) is False
    assert metrics.value("coverage_attestation_invalid_total") == before + 1


def test_log_mode_counts_but_commits(monkeypatch):
    monkeypatch.setenv(cov.ENV_MODE, "log")
    dq, dreq = _roundtrip(TOKENS[:100], TOKENS)
    before = metrics.value("coverage_mismatch_total")
    assert cov.admit(dq, dreq) is True and dreq.req.finished_reason is None
    assert metrics.value("coverage_mismatch_total") == before + 1


def test_gate_itself_never_skips_a_fake_bootstrap_host():
    """The fake-transfer skip lives at the patched call site (upstream's _is_fake_transfer,
    server warmup only; clients cannot send the fake host, see client_guard). The gate itself
    refuses what it cannot verify, whatever the request's bootstrap host says."""
    from sglang.pdsafe.client_guard import FAKE_BOOTSTRAP_HOST

    dq, dreq = _roundtrip(TOKENS[:100], TOKENS)
    dreq.req.bootstrap_host = FAKE_BOOTSTRAP_HOST
    assert cov.admit(dq, dreq) is False


# --------------------------------------------------------------------------- aux rows (layout 3)


def _full_buffers(monkeypatch):
    """Real ``MetadataBuffers`` with every optional aux field on: the sampling mask, EAGLE's
    hidden states and top-k, the DSA top-k indices, the KV digest row."""
    from sglang.srt.disaggregation.utils import MetadataBuffers

    monkeypatch.setenv("SGLANG_ENABLE_DISAGG_SAMPLING_MASK", "1")
    return MetadataBuffers(8, hidden_size=16, hidden_states_dtype=torch.float32,
                           max_sampling_mask_tokens=4, output_dsa_topk_indices_dim=6,
                           kv_checksum_enabled=True)


def _present_aux(buffers) -> list[str]:
    return [n for n in cov.AUX_FIELDS if isinstance(getattr(buffers, n, None), torch.Tensor)]


def _randomize_slot(buffers, idx: int, seed: int) -> None:
    """What ``set_buf`` (and earlier owners of the slot) leave in its aux rows."""
    g = torch.Generator().manual_seed(seed)
    for name in _present_aux(buffers):
        row = getattr(buffers, name)[idx].view(torch.uint8)
        row.copy_(torch.randint(0, 256, row.shape, dtype=torch.uint8, generator=g))


def _aux_roundtrip(monkeypatch, seed: int = 1):
    pbuf, dbuf = _full_buffers(monkeypatch), _full_buffers(monkeypatch)
    preq = _prefill_req(TOKENS)
    _randomize_slot(pbuf, preq.metadata_buffer_index, seed)
    _randomize_slot(dbuf, 5, seed + 100)  # an earlier owner's rows on decode
    pbuf.bootstrap_room[preq.metadata_buffer_index, 0] = preq.bootstrap_room
    cov.attest_prefill_hook(pbuf, preq, len(TOKENS), 16)
    dreq = _decode_req(TOKENS)
    cov.note_reservation_hook(dreq, list(range(cov.pages_for(0, len(TOKENS), 16))), 16, 0,
                              len(TOKENS))
    _transfer_row(pbuf, dbuf, preq.metadata_buffer_index, dreq.metadata_buffer_index)
    return pbuf, _Queue(dbuf), dreq


def test_every_metadata_field_upstream_builds_is_classified(monkeypatch):
    """Every tensor of upstream's ``MetadataBuffers`` (all options on) is an aux field bound
    into the coverage row or one of the two self-checked rows; fails when upstream adds one
    nobody classified (the hook would then refuse every transfer, see below)."""
    buffers = _full_buffers(monkeypatch)
    tensors = {n for n, v in vars(buffers).items() if isinstance(v, torch.Tensor)}
    assert tensors <= set(cov.AUX_FIELDS) | set(cov.SELF_CHECKED_FIELDS), \
        tensors - set(cov.AUX_FIELDS) - set(cov.SELF_CHECKED_FIELDS)
    ptrs, _, _ = buffers.get_buf_infos()
    assert len(ptrs) == len(tensors)  # every tensor is registered for the transfer
    assert {n for n, _ in cov.aux_rows(buffers, 0)} == tensors - set(cov.SELF_CHECKED_FIELDS)


def test_one_byte_of_any_aux_row_refuses_the_commit(monkeypatch):
    """A byte of the first output token, the cached counts, a logprob, the sampling mask,
    EAGLE's top-k or hidden states or the DSA top-k indices that is not what prefill wrote for
    this transfer (a late write of an earlier transfer of the slot): a ``token_digest``
    mismatch, refused at commit; the untouched rows verify."""
    _, dq, dreq = _aux_roundtrip(monkeypatch)
    assert cov.check_commit_hook(dq, dreq).ok
    fields = _present_aux(dq.metadata_buffers)
    assert {"output_ids", "output_hidden_states", "output_topk_p", "output_dsa_topk_indices",
            "output_token_sampling_mask_idx"} <= set(fields)
    for name in fields:
        row = getattr(dq.metadata_buffers, name)[dreq.metadata_buffer_index].view(torch.uint8)
        for pos in (0, row.numel() - 1):
            row[pos] ^= 0x10
            v = cov.check_commit_hook(dq, dreq)
            row[pos] ^= 0x10
            assert v.outcome is cov.Outcome.MISMATCH and v.differs == ("token_digest",), name
            assert "aux data" in v.message
    assert cov.check_commit_hook(dq, dreq).ok


def test_a_foreign_first_token_is_refused_and_counted(monkeypatch):
    """Decode's slot holds another request's aux rows (its first token, hidden states) under
    this transfer's own coverage row: refused (500) and counted, never decoded."""
    pbuf, dq, dreq = _aux_roundtrip(monkeypatch)
    other = _full_buffers(monkeypatch)
    _randomize_slot(other, 3, seed=77)
    for name in ("output_ids", "output_hidden_states"):
        getattr(dq.metadata_buffers, name)[dreq.metadata_buffer_index] = \
            getattr(other, name)[3]
    before = metrics.value("coverage_mismatch_total")
    assert cov.admit(dq, dreq) is False
    assert dreq.req.finished_reason.status_code == HTTPStatus.INTERNAL_SERVER_ERROR
    assert metrics.value("coverage_mismatch_total") == before + 1


def test_a_registered_buffer_nobody_classified_fails_closed(monkeypatch):
    """Upstream registers one more metadata buffer: neither leg attests or commits around it;
    the commit gate refuses (500, counted), prefill's attestation hook fails the room."""
    from sglang.pdsafe import commit_gate
    from sglang.srt.disaggregation.utils import MetadataBuffers

    class Newer(MetadataBuffers):
        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k)
            self.output_new_field = torch.zeros((8, 4), dtype=torch.int32)

        def get_buf_infos(self):
            ptrs, lens, items = super().get_buf_infos()
            t = self.output_new_field
            return ptrs + [t.data_ptr()], lens + [t.nbytes], items + [t[0].nbytes]

    buffers = Newer(8, hidden_size=16, hidden_states_dtype=torch.float32,
                    max_sampling_mask_tokens=4)
    with pytest.raises(cov.UnboundAuxBuffer, match="neither binds"):
        cov.aux_rows(buffers, 0)
    # The scheduler's init refuses such a server before it serves anything, naming the buffer.
    n = len(buffers.get_buf_infos()[0])
    with pytest.raises(policy.StartupRefusedError,
                       match=rf"refuses to start: .* buffer\(s\) #{n - 1} \(output_new_field\) "
                             rf"of {n} "):
        cov.check_aux_buffers(buffers)
    cov.check_aux_buffers(_full_buffers(monkeypatch))  # upstream's own: every field classified
    monkeypatch.delenv("SGLANG_ENABLE_DISAGG_SAMPLING_MASK")
    cov.check_aux_buffers(MetadataBuffers(8, hidden_size=16, hidden_states_dtype=torch.float32,
                                          max_sampling_mask_tokens=0))
    _, dq, dreq = _aux_roundtrip(monkeypatch)
    dq.metadata_buffers = buffers
    before = metrics.value(cov.FAILED)
    assert commit_gate.admit_commit(dq, dreq) is False
    assert dreq.req.finished_reason.status_code == HTTPStatus.INTERNAL_SERVER_ERROR
    assert metrics.value(cov.FAILED) == before + 1


def _with_key(monkeypatch, key):
    from sglang.pdsafe import bootstrap_auth

    if key is None:
        monkeypatch.delenv(bootstrap_auth.ENV_TOKEN, raising=False)
    else:
        monkeypatch.setenv(bootstrap_auth.ENV_TOKEN, key)


def test_the_row_is_keyed_with_the_cluster_key(monkeypatch):
    """With a cluster key, slot 2 is keyed: a row written under another key (someone who can
    write decode's metadata memory and knows the generation, but holds no key) is refused; a
    decode accepting both keys of a rotation takes the prefill's; unkeyed legs still pair."""
    from sglang.pdsafe import control_mac

    monkeypatch.delenv(control_mac.ENV_ENABLE, raising=False)
    a, b = "cluster-key-a" * 3, "cluster-key-b" * 3
    _with_key(monkeypatch, a)  # the prefill attests under key a
    _, dq, dreq = _aux_roundtrip(monkeypatch)
    assert cov.check_commit_hook(dq, dreq).ok
    _with_key(monkeypatch, b)  # a decode holding only key b
    v = cov.check_commit_hook(dq, dreq)
    assert v.outcome is cov.Outcome.MISMATCH and v.differs == ("token_digest",)
    _with_key(monkeypatch, f"{b},{a}")  # rotation: signs with b, accepts a too
    assert cov.check_commit_hook(dq, dreq).ok
    _with_key(monkeypatch, None)  # an unkeyed decode cannot check a keyed row either
    assert not cov.check_commit_hook(dq, dreq).ok
    _, dq, dreq = _aux_roundtrip(monkeypatch)  # both unkeyed
    assert cov.check_commit_hook(dq, dreq).ok
