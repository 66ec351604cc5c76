"""Which device KV pool classes of upstream 0.5.23 the KV digest covers, and which it refuses.

The digest (:mod:`sglang.pdsafe.kv_digest`) must read every byte a decode will use; a pool whose
layout it does not know is refused (the PD server does not start) rather than digested in part.
Before this table the digest dispatched on a handful of exact classes and refused everything else
with one generic message, so an operator could not tell a layout nobody had looked at from one
known to be out of reach, and a class upstream added went unnoticed.

**The table.** :data:`CLASSES` names every subclass of upstream's ``KVCache`` (device pools; the
host pools of HiCache are not transferred and not listed) by ``module:QualName``, with either the
layout the digest reads it as (:data:`LAYOUTS`) or the reason it is refused. Dispatch is on the
exact class: a subclass may change the layout (Ascend's NPU pools do), so it is covered only once
somebody classified it here. A class missing from the table is refused with a message that says
so (:func:`verdict`). ``test/unit/test_kv_layouts.py`` scans the installed upstream's source for
every ``KVCache`` subclass and fails when one is missing here, so a new upstream class cannot go
unclassified; ``docs/kv-support.md`` is this table, checked against it by the same test.

What it proves and what it does not: a covered class is one whose components the digest reads
(tested on the real classes in ``test/unit/test_kv_digest.py``); a refused one starts no PD
server with the digest on. It says nothing about the transfer's aux data or the draft pool of
speculative decoding, which the digest does not cover yet (docs/kv-support.md says so).
"""

from __future__ import annotations

#: The layouts the digest reads (``kv_digest._attention_components`` and ``components``).
LAYOUTS = frozenset({"mha", "k-only", "mla", "dsa", "swa", "hybrid-linear"})

_NPU = ("an Ascend NPU pool: its buffers are laid out for torch_npu's kernels and the digest "
        "has not been checked against them on Ascend hardware")
_DSV4 = "DeepSeek-V4's compressed KV and indexer layout is not digested yet"
_HISPARSE = ("HiSparse moves pages between device and host while decoding; its layout is not "
             "digested yet")
_MINIMAX = "MiniMax's sparse / NVFP4 index layout is not digested yet"
_UNIFIED = "the unified memory pool (--enable-unified-memory) is not digested yet"
_DRAFT = ("the unified draft pool of speculative decoding (draft and target KV in one unified "
          "allocation, transferred by physical ids) is not digested yet; a separate draft pool "
          "of a covered layout is")
_INTERLEAVE = "the page-interleaved layout is not digested yet"

#: ``module:QualName`` (module relative to ``sglang.srt``) -> a layout of :data:`LAYOUTS`, or
#: ``"refused: <reason>"``.
CLASSES: dict[str, str] = {
    "mem_cache.memory_pool:MHATokenToKVPool": "mha",
    "mem_cache.memory_pool:MHATokenToKVPoolFP4": "mha",
    "mem_cache.memory_pool:MHATokenToKVPoolMXFP8": "mha",
    "mem_cache.memory_pool:MHATokenToKOnlyPool": "k-only",
    "mem_cache.memory_pool:MLATokenToKVPool": "mla",
    "mem_cache.memory_pool:MLATokenToKVPoolFP4": "mla",
    "mem_cache.memory_pool:DSATokenToKVPool": "dsa",
    "mem_cache.swa_memory_pool:SWAKVPool": "swa",
    "mem_cache.memory_pool:HybridLinearKVPool": "hybrid-linear",
    "mem_cache.memory_pool:PageMajorMHATokenToKVPool":
        "refused: upstream 0.5.23 cannot build it (its _create_buffers raises; ServerArgs "
        "rejects the page-major layout) nor transfer it (get_contiguous_buf_infos raises)",
    "mem_cache.memory_pool:NoOpMHATokenToKVPool":
        "refused: a no-op pool holds no KV, so there is nothing a PD transfer could carry",
    "mem_cache.memory_pool:MiniMaxSparseKVPool": f"refused: {_MINIMAX}",
    "mem_cache.minimax_m3_nvfp4_pool:MiniMaxM3Nvfp4IndexKPool": f"refused: {_MINIMAX}",
    "mem_cache.minimax_m3_nvfp4_pool:MiniMaxM3Nvfp4KVPool": f"refused: {_MINIMAX}",
    "mem_cache.minimax_m3_nvfp4_pool:MiniMaxM3Nvfp4MainKVPool": f"refused: {_MINIMAX}",
    "mem_cache.base_swa_memory_pool:BaseSWAKVPool":
        "refused: an abstract base class (upstream builds its subclasses)",
    "mem_cache.deepseek_v4_memory_pool:DeepSeekV4IndexerPool": f"refused: {_DSV4}",
    "mem_cache.deepseek_v4_memory_pool:DeepSeekV4SingleKVPool": f"refused: {_DSV4}",
    "mem_cache.deepseek_v4_memory_pool:DeepSeekV4TokenToKVPool": f"refused: {_DSV4}",
    "mem_cache.deepseek_v4_memory_pool:DeepSeekV4UniformFP8KVPool": f"refused: {_DSV4}",
    "mem_cache.deepseek_v4_memory_pool:HiSparseC4DevicePool": f"refused: {_HISPARSE}",
    "mem_cache.hisparse_memory_pool:HiSparseDSATokenToKVPool": f"refused: {_HISPARSE}",
    "mem_cache.hisparse_memory_pool:HiSparseMHAMainPool": f"refused: {_HISPARSE}",
    "mem_cache.dsa_cache_layer_split:LayerSplitDSATokenToKVPool":
        "refused: the layer-split DSA cache of a context-parallel prefill (each shard holds "
        "some layers) is not digested yet",
    "mem_cache.page_interleave_pool:PageInterleaveDSATokenToKVPool": f"refused: {_INTERLEAVE}",
    "mem_cache.page_interleave_pool:PageInterleaveMHATokenToKVPool": f"refused: {_INTERLEAVE}",
    "mem_cache.page_interleave_pool:PageInterleaveMLATokenToKVPool": f"refused: {_INTERLEAVE}",
    "mem_cache.qsa_kv_pool:QSATokenToKVPool": "refused: the QSA layout is not digested yet",
    "mem_cache.unified_draft_pool:UnifiedDraftKVPool": f"refused: {_DRAFT}",
    "mem_cache.unified_draft_pool:UnifiedDraftSWAKVPool": f"refused: {_DRAFT}",
    "mem_cache.unified_memory_pool:UnifiedHybridLinearKVPool": f"refused: {_UNIFIED}",
    "mem_cache.unified_memory_pool:UnifiedMHATokenToKVPool": f"refused: {_UNIFIED}",
    "mem_cache.unified_memory_pool:UnifiedMLATokenToKVPool": f"refused: {_UNIFIED}",
    "mem_cache.unified_memory_pool:UnifiedSWAKVPool": f"refused: {_UNIFIED}",
    "hardware_backend.npu.memory_pool_npu:NPUMHATokenToKVPool": f"refused: {_NPU}",
    "hardware_backend.npu.memory_pool_npu:NPUMHATokenToKOnlyPool": f"refused: {_NPU}",
    "hardware_backend.npu.memory_pool_npu:NPUMLATokenToKVPool": f"refused: {_NPU}",
    "hardware_backend.npu.memory_pool_npu:NPUMiniMaxSparseKVPool": f"refused: {_NPU}",
    "hardware_backend.npu.dsv4.dsv4_memory_pool:DSV4NPUTokenToKVPool": f"refused: {_NPU}",
    "hardware_backend.npu.dsv4.dsv4_memory_pool:NPUDeepSeekV4IndexerPool": f"refused: {_NPU}",
    "hardware_backend.npu.dsv4.dsv4_memory_pool:NPUDeepSeekV4SingleKVPool": f"refused: {_NPU}",
    "hardware_backend.mlx.model_runner_stub:_DummyKVCache":
        "refused: MLX's stand-in cache (MLX serves no PD transfer)",
}

_SRT = "sglang.srt."


def key_of(cls: type) -> str:
    """``module:QualName`` of ``cls``, its module relative to ``sglang.srt``."""
    module = cls.__module__
    return f"{module.removeprefix(_SRT)}:{cls.__qualname__}"


def verdict(cls: type) -> tuple[str | None, str]:
    """(the layout the digest reads ``cls`` as, "") or (None, why it is refused)."""
    entry = CLASSES.get(key_of(cls))
    if entry is None:
        return None, (f"KV pool class {cls.__module__}.{cls.__qualname__} is not classified "
                      f"(sglang.pdsafe.kv_layouts): nobody has checked whether the KV digest "
                      f"covers its layout")
    if entry in LAYOUTS:
        return entry, ""
    return None, entry.removeprefix("refused: ")
