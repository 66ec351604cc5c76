"""Patch 0021 as a PD server is configured: the KV digest is on by default on both legs.

``test_kv_integrity_wiring.py`` hands its stand-in schedulers a digester itself; without patch
0021 upstream's code then calls that digester the way it calls its own CUDA checksum and fails
on the stand-ins (an ``AttributeError``, not the protection's assertion: docs/ablation.md's
rule). Here each leg gets its KV checker the way a server gets it: from the real
``PrefillBootstrapQueue.__init__`` / ``DecodePreallocQueue.__init__`` of the installed (patched)
upstream, with the default server arguments (no ``--disaggregation-enable-kv-checksum``, no
``SGLANG_PDSAFE_KV_DIGEST``). Everything else is ``test_kv_integrity_wiring``'s transfer:
upstream's real ``send_kv_chunk``, the aux rows through upstream's TCP aux codec, pages copied
page-granular into other pages of a second pool, upstream's ``_commit_transfer_to_req`` and
``_verify_kv_checksums``.

With 0021 both inits build the pdsafe digester, a flipped bit in decode's copy fails the
request with 500 before its first decode step, and an intact transfer is counted verified.
Without it (the ablation row ``kv-digest-unit``) upstream's inits leave the checksum off (its
flag's default), the corrupted transfer is decoded, and these tests fail on their own
assertions: "the request was not failed", "not counted as verified".

Only the queue inits' KV managers are stand-ins (``_init_kv_manager``: no transfer engine).
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch
from pdsafe_testkit.pd_context import published_pd_context
from sglang.pdsafe import kv_integrity, metrics

from . import test_kv_integrity_wiring as w
from .test_kv_integrity_wiring import _env  # noqa: F401  (autouse: no digest switches set)

POOL_TOKENS = 512


def _parallel() -> SimpleNamespace:
    return SimpleNamespace(tp_rank=0, pp_rank=0, pp_size=1, attn_tp_rank=0,
                           attn_tp_group=SimpleNamespace(cpu_group=None))


def _scheduler(pool) -> SimpleNamespace:
    return SimpleNamespace(
        tp_worker=SimpleNamespace(
            model_runner=SimpleNamespace(effective_logical_max_total_num_tokens=POOL_TOKENS,
                                         swa_max_total_num_tokens=POOL_TOKENS),
            is_hybrid_swa=False),
        kv_shard_widening=1, random_seed=0,
        token_to_kv_pool_allocator=SimpleNamespace(page_size=w.PAGE, get_kvcache=lambda: pool),
        kv_checksum_computer="unset by the queue init")


def server_kv_checker(mode: str, pool) -> object:
    """``scheduler.kv_checksum_computer`` after the real queue init of a ``mode`` server with
    default arguments: the pdsafe digester with 0021, upstream's default (None) without."""
    import sglang.srt.disaggregation.decode as decode_mod
    import sglang.srt.disaggregation.prefill as prefill_mod

    sched = _scheduler(pool)
    manager = SimpleNamespace(kv_args=SimpleNamespace())
    buffers = w._buffers(mode)  # upstream's real MetadataBuffers (the init checks them, 0033)
    with published_pd_context(mode), \
            patch.object(prefill_mod, "get_parallel", _parallel), \
            patch.object(decode_mod, "get_parallel", _parallel):
        if mode == "prefill":
            q = prefill_mod.PrefillBootstrapQueue
            with patch.object(q, "_init_kv_manager", return_value=manager):
                q(token_to_kv_pool=pool, draft_token_to_kv_pool=None,
                  req_to_metadata_buffer_idx_allocator=None, metadata_buffers=buffers, gpu_id=0,
                  bootstrap_port=0, max_total_num_tokens=POOL_TOKENS, scheduler=sched,
                  scheduler_stage_metrics=None, transfer_backend=None)
        else:
            q = decode_mod.DecodePreallocQueue
            with patch.object(q, "_init_kv_manager", return_value=manager):
                q(req_to_token_pool=None,
                  token_to_kv_pool_allocator=sched.token_to_kv_pool_allocator,
                  draft_token_to_kv_pool=None, req_to_metadata_buffer_idx_allocator=None,
                  metadata_buffers=buffers, scheduler=sched, transfer_queue=None, tree_cache=None,
                  gpu_id=0, bootstrap_port=0, max_total_num_tokens=POOL_TOKENS,
                  num_reserved_decode_tokens=0, transfer_backend=None)
    assert sched.kv_checksum_computer != "unset by the queue init", "the init set nothing"
    return sched.kv_checksum_computer


def _transfer(rid: str = "req-1") -> tuple[w._Prefill, w._Decode]:
    """One request moved as configured: prefill digests (or not) at its last chunk, decode
    commits; the KV checkers are the ones each leg's init built."""
    pool = w._pool(1)
    p = w._Prefill(pool, server_kv_checker("prefill", pool))
    p.send_kv_chunk(w._prefill_req(0, rid), last_chunk=True)
    d = w._Decode(w._pool(99), 0, rid)
    d.digester = d.sched.kv_checksum_computer = server_kv_checker("decode", d.pool)
    w._copy_pages(p.pool, d.pool, 0)
    w._copy_aux(p.disagg_metadata_buffers, d.buffers)
    d.commit()
    return p, d


def test_both_legs_digest_by_default():
    for mode in ("prefill", "decode"):
        checker = server_kv_checker(mode, w._pool(3))
        assert isinstance(checker, kv_integrity.Digester), (
            f"a {mode} server in the default configuration checks no KV digest "
            f"(its queue init built {checker!r}): its transfers are decoded unverified")


@pytest.mark.parametrize("rid", ["req-1", "HEALTH_CHECK_from_a_client"])
def test_an_intact_transfer_is_verified(rid):
    before = metrics.value(kv_integrity.VERIFIED_COUNTER)
    _, d = _transfer(rid)
    batch, release = d.verify()
    w._assert_passed(d, batch, release)
    assert metrics.value(kv_integrity.VERIFIED_COUNTER) == before + 1, (
        f"an intact transfer ({rid}) was not counted as verified: nothing checked its KV")


def test_a_flipped_bit_fails_the_request_before_its_first_decode_step():
    _, d = _transfer()
    owned = w._owned_bytes(d, 0)
    victim = owned[len(owned) // 2]
    victim[0] ^= torch.tensor(1, dtype=torch.uint8)
    batch, release = d.verify()
    w._assert_failed(d, batch, release, "differ")
