"""Patch 0033: the queue that owns the metadata buffers on each PD leg refuses the server's
start when the transfer registers a buffer the coverage row does not bind
(``sglang.pdsafe.coverage.check_aux_buffers``; issue 20 item 1: no silent skip).

Upstream's own ``PrefillBootstrapQueue.__init__`` and ``DecodePreallocQueue.__init__`` run on
stand-ins for what they only pass on; the check itself is the real one, on upstream's real
``MetadataBuffers`` (every optional field on) and on a subclass that registers one more buffer,
as a newer upstream would. Without 0033 the queue never asks, so such a server would start
healthy and refuse every transfer at commit (``test/unit/test_coverage.py``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.pdsafe import coverage as cov
from sglang.pdsafe import policy


def _full_buffers(monkeypatch):
    """Real ``MetadataBuffers`` with every optional aux field on."""
    from sglang.srt.disaggregation.utils import MetadataBuffers

    monkeypatch.setenv("SGLANG_ENABLE_DISAGG_SAMPLING_MASK", "1")
    return MetadataBuffers(8, hidden_size=16, hidden_states_dtype=torch.float32,
                           max_sampling_mask_tokens=4, output_dsa_topk_indices_dim=6,
                           kv_checksum_enabled=True)


class _Reached(Exception):
    """The queue's init called the check and the check passed."""


@pytest.mark.parametrize("leg", ["prefill", "decode"])
def test_the_pd_queue_refuses_to_start_with_a_buffer_nobody_classified(monkeypatch, leg):
    """Patch 0033: upstream's own init of the queue that owns the metadata buffers on each
    PD leg (``PrefillBootstrapQueue``, ``DecodePreallocQueue``) refuses the start when they
    register an unclassified buffer, naming it; upstream's own buffers pass the check."""
    import sglang.srt.disaggregation.decode as decode_mod
    import sglang.srt.disaggregation.prefill as prefill_mod
    from sglang.srt.disaggregation.utils import MetadataBuffers

    class Newer(MetadataBuffers):
        def get_buf_infos(self):
            ptrs, lens, items = super().get_buf_infos()
            self.output_new_field = torch.zeros((4,), dtype=torch.int32)
            t = self.output_new_field
            return ptrs + [t.data_ptr()], lens + [t.nbytes], items + [t.nbytes]

    mod, cls = ((prefill_mod, prefill_mod.PrefillBootstrapQueue) if leg == "prefill"
                else (decode_mod, decode_mod.DecodePreallocQueue))
    monkeypatch.setattr(mod, "get_parallel", lambda: SimpleNamespace())
    kv = dict(token_to_kv_pool=None) if leg == "prefill" else dict(
        req_to_token_pool=None,
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: None))
    check = cov.check_aux_buffers
    passed: list[object] = []

    def spy(buffers):
        check(buffers)
        passed.append(buffers)
        raise _Reached

    def init(buffers):
        queue = cls.__new__(cls)
        try:
            cls.__init__(queue, **kv, draft_token_to_kv_pool=None, metadata_buffers=buffers,
                         **{k: None for k in ("req_to_metadata_buffer_idx_allocator", "gpu_id",
                                              "bootstrap_port", "max_total_num_tokens",
                                              "scheduler", "transfer_backend")},
                         **(dict(scheduler_stage_metrics=None) if leg == "prefill" else dict(
                             transfer_queue=None, tree_cache=None, num_reserved_decode_tokens=0)))
        except AttributeError as e:  # past the check's place, into what the stand-ins lack
            raise AssertionError(f"{cls.__name__}.__init__ went on without checking the "
                                 f"metadata buffers ({e})") from e

    own = _full_buffers(monkeypatch)
    monkeypatch.setattr(cov, "check_aux_buffers", spy)
    with pytest.raises(_Reached):
        init(own)
    assert passed == [own]
    monkeypatch.setattr(cov, "check_aux_buffers", check)
    newer = Newer(8, hidden_size=16, hidden_states_dtype=torch.float32,
                  max_sampling_mask_tokens=4)
    with pytest.raises(policy.StartupRefusedError, match=r"#\d+ \(output_new_field\)"):
        init(newer)
