"""Scheduler glue of the KV harness: the real KV classes driven as sglang's schedulers do.

Runs in the children only (``child.Side`` builds one lane per page size). A *lane* is one page
size: a published ``ServerArgs`` (``--device cpu``, transfer backend X), the backend's real KV
manager (``get_kv_class(TransferBackend.X, KVClassType.MANAGER)``) over sglang's real
``MHATokenToKVPool`` on the CPU (or, by ``pool_kind``, its real MLA, DSA, grouped DSA,
hybrid-linear + Mamba2 or SWA pool: ``layouts.POOL_KINDS``, with their state components
registered by ``setup_state_kv_args`` and sent with upstream's own payloads; or an MHA / MLA
target pool with a separate speculative-decoding draft pool registered after it, as the PD
queues register ``draft_token_to_kv_pool``),
sglang's real ``MetadataBuffers`` as the aux buffers and, on
prefill, the backend's real bootstrap server. Transfers use the real sender and receiver
classes, driven the way ``disaggregation/prefill.py`` and ``decode.py`` drive them (``init`` /
``send_metadata`` / ``send`` / ``poll`` / ``abort`` / ``clear``), without a scheduler and
without a model: the prefill "forward" writes a known pattern (``pages``) into its pages. The
coverage attestation and commit gate (``sglang.pdsafe.coverage``) run exactly where the patched
schedulers call them (patches 0004, 0014), and so does the KV digest (patch 0021): prefill's
chunks go through the patched ``send_kv_chunk`` itself (its last chunk writes the digest row,
``kv_integrity.prefill_write_row``); decode keeps the row at commit (``kv_integrity.capture``)
and checks it (``kv_integrity.verify_batch``) in ``cmd_recv_finish``, optionally after a
test-only bit flip in its pool (``pages.BitFlip``).

Each ``cmd_*`` method is one command of the parent (``rpc``); answers are plain data.

Invariants: importing this module imports neither torch nor sglang (the lanes import them when
built); a lane's pool buffers, ``MetadataBuffers`` and ``KVArgs`` stay referenced for the life
of the process (the manager registered their addresses with the transfer engine); retiring a
room (``cmd_send_finish`` / ``cmd_recv_finish``) leaves no per-room state behind.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np

from pdsafe_testkit.kv import layouts
from pdsafe_testkit.kv.child import ChildConfig
from pdsafe_testkit.kv.layouts import POOL_KINDS, Component, RowCopy
from pdsafe_testkit.kv.pages import (
    MAGIC_POISON,
    MAGIC_STALE,
    BitFlip,
    apply_bit_flip,
    classify_pages,
    count_own_rows,
    fill_data_pages,
    fill_poison_pages,
    fill_stale_pages,
    request_token_ids,
    token_rows,
)
from pdsafe_testkit.kv.results import (
    KVPOLL_BOOTSTRAPPING,
    KVPOLL_FAILED,
    KVPOLL_NAMES,
    KVPOLL_SUCCESS,
    KVPOLL_TERMINAL,
)

if TYPE_CHECKING:  # imported when a lane is built with bookkeeping (in the child)
    from pdsafe_testkit.kv.bookkeeping import Bookkeeping

__all__ = ["POLL_INTERVAL_S", "DecodeLane", "Lane", "PrefillLane", "poll_until"]

#: Seconds between two polls of a sender/receiver (the scheduler polls once per loop).
POLL_INTERVAL_S = 0.0005
#: The ``req_to_token`` row of the request in flight (row 0 is the pool's padding row);
#: also its ``dsa-kpool`` tail ring row (the pool has ``KPOOL_MAX_RUNNING_REQUESTS + 1``).
REQ_POOL_IDX = 1
KPOOL_MAX_RUNNING_REQUESTS = 4
#: ``hybrid`` lanes: the model's layers (full attention 1 and 3, Mamba2 0 and 2), the Mamba
#: pool's slots, and the request's state slot on each leg (different on purpose: the state
#: travels by each leg's own ``req_index_to_mamba_index_mapping``).
HYBRID_LAYERS = 4
HYBRID_FULL_LAYERS = [1, 3]
HYBRID_MAMBA_LAYERS = [0, 2]
HYBRID_MAMBA_SLOTS = 8
HYBRID_STATE_SLOT = {"prefill": 2, "decode": 5}
#: ``swa`` lanes: the same layer split (sliding-window layers 0 and 2, full 1 and 3).
SWA_LAYERS = [0, 2]
#: The counters ``kv_integrity.verify_batch`` moves, and the digest outcome each names.
_DIGEST_COUNTERS: dict[str, str] = {
    "kv_digest_verified_total": "ok",
    "kv_digest_mismatch_total": "mismatch",
    "kv_digest_missing_total": "missing",
    "kv_digest_invalid_total": "invalid",
    "kv_digest_failed_total": "failed",
    "hook_api_mismatch_total": "hook_api_mismatch",
}


def poll_until(
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


_MOONCAKE_ENGINE_READY = False


class Lane:
    """Everything of one page size: a published ServerArgs, pool, aux buffers, manager.

    Invariants: the pool buffers, the ``MetadataBuffers`` and the ``KVArgs`` stay referenced
    for the life of the process (the manager registered their addresses with the engine).
    """

    def __init__(self, cfg: ChildConfig, page_size: int, bootstrap_port: int,
                 pool_kind: str = "mha") -> None:
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

        if pool_kind not in POOL_KINDS:
            raise ValueError(f"pool kind {pool_kind!r} is not one of {POOL_KINDS}")
        if pool_kind != "mha" and getattr(cfg, "bookkeeping", False):
            raise ValueError("bookkeeping lanes are MHA only")
        self.cfg = cfg
        self.page_size = page_size
        self.pool_kind = pool_kind
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

        from sglang.pdsafe import kv_integrity
        from sglang.srt.disaggregation.utils import (
            build_kv_layer_ids,
            get_kv_transfer_buf_infos,
            get_pd_kv_layout,
            is_mla_backend,
            setup_state_kv_args,
        )
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        rows = (cfg.num_pages + 1) * page_size
        #: Non-MHA kinds: the pool's bytes per (component, layer) (``layouts``); MHA: none.
        self.components: list[Component] = []
        #: The speculative-decoding draft pool the transfer carries next to ``pool`` (the
        #: queues' ``draft_token_to_kv_pool``): draft kinds only, else None.
        self.draft_pool: Any = None
        if pool_kind == "mha":
            # The KV pool: sglang's real MHATokenToKVPool on the CPU (NHD, one KV head of
            # ``token_words * 4`` bf16 = ``token_words`` 64-bit words per token row),
            # registered for the transfer the way the scheduler registers it
            # (get_kv_transfer_buf_infos: all K layers, then all V layers). ``buffers`` are
            # int64 views of the same memory, one per (layer, K/V), where ``pages`` writes
            # and reads its self-describing rows.
            self.pool = MHATokenToKVPool(
                size=cfg.num_pages * page_size,
                page_size=page_size,
                dtype=torch.bfloat16,
                head_num=1,
                head_dim=cfg.token_words * 4,
                layer_num=cfg.num_layers,
                device="cpu",
                enable_memory_saver=False,
                enable_alt_stream=False,
            )
            self.layer_kv: list[tuple[int, int]] = [
                (layer, kv) for kv in (0, 1) for layer in range(cfg.num_layers)
            ]
            self.buffers = [
                (self.pool.k_buffer if kv == 0 else self.pool.v_buffer)[layer]
                .view(torch.uint8)
                .reshape(rows, cfg.token_words * 8)
                .view(torch.int64)
                for layer, kv in self.layer_kv
            ]
            kv_ptrs, kv_lens, kv_item_lens = get_kv_transfer_buf_infos(self.pool)
            if kv_ptrs != [b.data_ptr() for b in self.buffers]:
                raise RuntimeError("the pool registers its buffers in an unexpected order")
            self.item_len = page_size * cfg.token_words * 8
            if set(kv_item_lens) != {self.item_len}:
                raise RuntimeError(f"unexpected KV item lengths {kv_item_lens}")
        else:
            self.layer_kv, self.buffers = [], []
            self.pool, self.components = self._layout_pool(cfg, page_size)
            kv_ptrs, kv_lens, kv_item_lens = get_kv_transfer_buf_infos(self.pool)
        # The draft pool's buffers appended after the target's, as both PD queues do
        # (prefill.py ``_init_kv_manager``, decode.py ``_init_kv_manager``: the draft's
        # ``get_contiguous_buf_infos()``, counted in ``num_draft_entries``).
        num_draft_entries = 0
        if self.draft_pool is not None:
            draft_ptrs, draft_lens, draft_item_lens = self.draft_pool.get_contiguous_buf_infos()
            kv_ptrs = kv_ptrs + draft_ptrs
            kv_lens = kv_lens + draft_lens
            kv_item_lens = kv_item_lens + draft_item_lens
            num_draft_entries = len(draft_ptrs)
        # One request row (index 1; row 0 is the padding row): position -> KV slot of the
        # request being digested (the harness runs one transfer at a time per lane). A
        # hybrid lane's is the HybridReqToTokenPool that owns its Mamba pool (built with it).
        hybrid_rtp = getattr(self, "_hybrid_rtp", None)
        self.req_to_token_pool = hybrid_rtp if hybrid_rtp is not None else ReqToTokenPool(
            size=1, max_context_len=rows, device="cpu", enable_memory_saver=False
        )
        # The KV digest (issue 10) as the patched PD queues set it up: on by default in PD
        # mode (SGLANG_PDSAFE_KV_DIGEST=0 turns it off); the row carrier is the last aux
        # buffer, allocated whenever the digest is on (``kv_integrity.carrier_enabled``).
        # Draft kinds: the draft pool too, as the queues pass ``draft_token_to_kv_pool``.
        self.kv_checksum_computer = kv_integrity.leg_digester(self.pool, self.server_args,
                                                              self.draft_pool)
        self.metadata = MetadataBuffers(
            cfg.aux_slots,
            hidden_size=16,
            hidden_states_dtype=torch.float32,
            max_sampling_mask_tokens=self.server_args.sampling_mask_max_tokens,
            kv_checksum_enabled=kv_integrity.carrier_enabled(self.server_args),
        )
        self.aux_alloc = ReqToMetadataIdxAllocator(cfg.aux_slots)

        kv_args = get_kv_class(self.backend, KVClassType.KVARGS)()
        kv_args.engine_rank = 0
        kv_args.pp_rank = 0
        kv_args.system_dp_rank = None
        kv_args.rust_http_port = None
        kv_args.kv_cache_dtype_str = "auto"
        kv_args.kv_layout = None if pool_kind == "mha" else get_pd_kv_layout(self.pool)
        kv_args.prefill_start_layer = 0 if pool_kind == "mha" else self.pool.start_layer
        kv_args.prefill_end_layer = (
            cfg.num_layers if pool_kind == "mha" else getattr(self.pool, "end_layer", None))
        kv_args.kv_data_ptrs = kv_ptrs
        kv_args.kv_data_lens = kv_lens
        kv_args.kv_item_lens = kv_item_lens
        kv_args.num_draft_entries = num_draft_entries
        # Positional pairing, as build_kv_layer_ids gives for MHA (and for MLA/DSA: asked;
        # with the draft pool and its entries as the queues pass them).
        kv_args.kv_layer_ids = [] if pool_kind == "mha" else build_kv_layer_ids(
            token_to_kv_pool=self.pool, draft_token_to_kv_pool=self.draft_pool,
            num_draft_entries=num_draft_entries,
            num_hidden_layers=(HYBRID_LAYERS if pool_kind in ("hybrid", "swa")
                               else cfg.num_layers))
        if self.backend == TransferBackend.NIXL:
            kv_args.kv_data_mem_kinds = ["DRAM"] * len(kv_ptrs)
        self.is_mla_backend = is_mla_backend(self.pool)
        if not self.is_mla_backend:  # as the prefill queue: no head counts for MLA pools
            kv_args.kv_head_num = 1
            kv_args.total_kv_head_num = 1
        kv_args.page_size = page_size
        kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = (
            self.metadata.get_buf_infos()
        )
        kv_args.ib_device = None
        kv_args.gpu_id = 0
        if pool_kind == "mha":
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
        else:
            # Upstream's own registration of the pool's state components (DSA: the indexer
            # buffers as StateType.DSA, paged like the KV), as both PD queues call it.
            setup_state_kv_args(kv_args, self.pool, self.draft_pool, cfg.num_layers,
                                req_to_token_pool=self.req_to_token_pool)
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
        self.mgr = manager_cls(kv_args, self.mode, self.server_args, self.is_mla_backend)
        # Bookkeeping (``ChildConfig.bookkeeping``): upstream's allocator with page
        # generations, and every protection hook a patched scheduler runs around a transfer
        # (``pdsafe_testkit.kv.bookkeeping``); None: the plain harness.
        self.book: Bookkeeping | None = None
        if getattr(cfg, "bookkeeping", False):
            from pdsafe_testkit.kv.bookkeeping import Bookkeeping

            self.book = Bookkeeping(self)

    def _layout_pool(self, cfg: ChildConfig, page_size: int) -> tuple[Any, list[Component]]:
        """A real upstream MLA or DSA pool on the CPU, small, and its components' views.

        MLA: ``MLATokenToKVPool`` (bf16, ``kv_lora_rank`` 32 + rope 16: 96 bytes a slot and
        layer). DSA: ``DSATokenToKVPool`` with the same latent/rope, ``index_head_dim`` 128
        (upstream asserts it), ``index_kpool`` 1; upstream requires 64-token pages. The
        views (``layouts.Component``) alias the pool's memory: ``kv`` is
        ``kv_buffer[layer]`` as ``[pages, page_size, 96]``; DSA's ``index_k`` and
        ``index_scale`` split each ``index_k_with_scale_buffer[layer]`` page row into its
        key bytes ``[pages, page_size, 128]`` and scale bytes ``[pages, page_size, 4]``
        (the layout ``kv_digest._dsa_components`` reads).
        """
        import torch
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, MLATokenToKVPool

        lora, rope = layouts.KV_LORA_RANK, layouts.QK_ROPE_HEAD_DIM
        common = {"size": cfg.num_pages * page_size, "page_size": page_size,
                  "dtype": torch.bfloat16, "kv_lora_rank": lora, "qk_rope_head_dim": rope,
                  "layer_num": cfg.num_layers, "device": "cpu", "enable_memory_saver": False}
        if self.pool_kind == "hybrid":
            return self._hybrid_pool(cfg, page_size)
        if self.pool_kind == "swa":
            return self._swa_pool(cfg, page_size)
        if self.pool_kind in ("mha-draft", "mla-draft"):
            return self._draft_pools(cfg, page_size, common)
        group = layouts.KPOOL_GROUP if self.pool_kind == "dsa-kpool" else 1
        if self.pool_kind == "mla":
            pool: Any = MLATokenToKVPool(**common)
        else:
            if page_size != 64 * group:
                raise ValueError(f"{self.pool_kind} needs {64 * group}-token pages, "
                                 f"not {page_size}")
            kpool: dict[str, Any] = {} if group == 1 else {
                "index_kpool": group, "index_kpool_compress": True,
                "tail_extra_slots": layouts.KPOOL_TAIL_EXTRA,
                "max_running_requests": KPOOL_MAX_RUNNING_REQUESTS}
            pool = DSATokenToKVPool(**common, index_head_dim=layouts.INDEX_HEAD_DIM,
                                    kv_cache_dim=lora + rope, **kpool)
        comps: list[Component] = []
        for layer in range(cfg.num_layers):
            kv = pool.kv_buffer[layer].view(torch.uint8)
            comps.append(Component("kv", layer, kv.numpy().reshape(
                kv.shape[0] // page_size, page_size, -1)))
            if self.pool_kind in ("dsa", "dsa-kpool"):
                buf = pool.index_k_with_scale_buffer[layer].numpy()
                dim = int(pool.index_head_dim)
                scale = dim // int(pool.quant_block_size) * 4
                entries = page_size // group
                if buf.shape[1] != entries * (dim + scale):
                    raise RuntimeError(f"unexpected DSA index page row of {buf.shape[1]} bytes")
                comps.append(Component("index_k", layer, buf[:, : entries * dim].reshape(
                    buf.shape[0], entries, dim), group=group))
                comps.append(Component("index_scale", layer, buf[:, entries * dim:].reshape(
                    buf.shape[0], entries, scale), group=group))
            if self.pool_kind == "dsa-kpool":
                for name, t in zip(("tail_k", "tail_score"),
                                   pool.get_compress_tail_buffers(layer), strict=True):
                    if t.shape[1] != layouts.KPOOL_RING:
                        raise RuntimeError(f"unexpected DSA tail ring of {t.shape[1]} rows")
                    comps.append(Component(name, layer, t.view(torch.uint8).numpy(),
                                           group=group, tail=True))
        self._check_views(comps)
        return pool, comps

    def _hybrid_pool(self, cfg: ChildConfig, page_size: int) -> tuple[Any, list[Component]]:
        """A real ``HybridLinearKVPool`` on the CPU and its components' views.

        Its Mamba2 ``MambaPool`` is the one upstream's ``HybridReqToTokenPool`` builds (kept as
        ``_hybrid_rtp``: the lane's request pool), whose ``req_index_to_mamba_index_mapping``
        gives the request its state slot (``HYBRID_STATE_SLOT`` of this leg, as its
        allocator would). Components: ``k`` / ``v`` of each full-attention layer (the full
        sub-pool's ``k_buffer`` / ``v_buffer`` as ``[pages, page_size, 32]``; layer = index
        in the full pool), ``conv0`` / ``temporal`` of each Mamba layer
        (``mamba_cache.conv[0][i]`` / ``temporal[i]`` as ``[slots, 1, bytes]``)."""
        import torch
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
        from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool

        shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=64, n_groups=1,
                                        num_heads=4, head_dim=16, state_size=8, conv_kernel=4)
        rtp = HybridReqToTokenPool(
            size=1, mamba_size=HYBRID_MAMBA_SLOTS, mamba_spec_state_size=0,
            max_context_len=(cfg.num_pages + 1) * page_size, device="cpu",
            enable_memory_saver=False,
            cache_params=Mamba2CacheParams(shape=shape, layers=HYBRID_MAMBA_LAYERS),
            mamba_layer_ids=HYBRID_MAMBA_LAYERS, enable_mamba_extra_buffer=False)
        rtp.req_index_to_mamba_index_mapping[REQ_POOL_IDX] = HYBRID_STATE_SLOT[cfg.role]
        self._hybrid_rtp = rtp
        pool = HybridLinearKVPool(
            size=cfg.num_pages * page_size, dtype=torch.bfloat16, page_size=page_size,
            head_num=1, head_dim=layouts.HYBRID_HEAD_BYTES // 2,
            full_attention_layer_ids=HYBRID_FULL_LAYERS, device="cpu",
            mamba_pool=rtp.mamba_pool)
        comps: list[Component] = []
        full = pool.full_kv_pool
        for name, bufs in (("k", full.k_buffer), ("v", full.v_buffer)):
            for layer, b in enumerate(bufs):
                u8 = b.view(torch.uint8)
                comps.append(Component(name, layer, u8.numpy().reshape(
                    u8.shape[0] // page_size, page_size, -1)))
        cache = rtp.mamba_pool.mamba_cache
        if len(cache.conv) != 1:
            raise RuntimeError(f"expected one Mamba2 conv state, not {len(cache.conv)}")
        for name, t in (("conv0", cache.conv[0]), ("temporal", cache.temporal)):
            for layer in range(t.shape[0]):
                u8 = t[layer].view(torch.uint8)
                comps.append(Component(name, layer, u8.numpy().reshape(u8.shape[0], 1, -1),
                                       state=True))
        self._check_views(comps)
        return pool, comps

    def _swa_pool(self, cfg: ChildConfig, page_size: int) -> tuple[Any, list[Component]]:
        """A real ``SWAKVPool`` on the CPU, upstream's ``SWATokenToKVPoolAllocator`` over it
        (``swa_allocator``: its full-to-SWA mapping, set for the request's positions by
        ``set_request_row`` with ``set_full_to_swa_mapping``; full page ``p`` maps to SWA
        page ``layouts.swa_page(p)``), and the components' views: ``k`` / ``v`` of the
        full sub-pool, ``swa_k`` / ``swa_v`` of the SWA sub-pool (``[pages, page_size,
        32]``; layer = index in the sub-pool; ``window`` = ``layouts.SWA_WINDOW``)."""
        import torch
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        size = cfg.num_pages * page_size
        pool = SWAKVPool(size=size, size_swa=size, page_size=page_size, dtype=torch.bfloat16,
                         head_num=1, head_dim=layouts.HYBRID_HEAD_BYTES // 2,
                         swa_attention_layer_ids=SWA_LAYERS,
                         full_attention_layer_ids=HYBRID_FULL_LAYERS, enable_alt_stream=False,
                         device="cpu", enable_memory_saver=False)
        self.swa_allocator = SWATokenToKVPoolAllocator(
            size=size, size_swa=size, page_size=page_size, dtype=torch.bfloat16,
            device="cpu", kvcache=pool, need_sort=False)
        comps: list[Component] = []
        for prefix, sub, window in (("", pool.full_kv_pool, 0),
                                    ("swa_", pool.swa_kv_pool, layouts.SWA_WINDOW)):
            for name, bufs in (("k", sub.k_buffer), ("v", sub.v_buffer)):
                for layer, b in enumerate(bufs):
                    u8 = b.view(torch.uint8)
                    comps.append(Component(prefix + name, layer, u8.numpy().reshape(
                        u8.shape[0] // page_size, page_size, -1), window=window))
        self._check_views(comps)
        return pool, comps

    def _draft_pools(self, cfg: ChildConfig, page_size: int,
                     mla: dict[str, Any]) -> tuple[Any, list[Component]]:
        """A real target pool and a real, separate draft pool of the same class on the CPU
        (``draft_pool``), as a speculative-decoding server builds them: the target with
        ``cfg.num_layers`` layers, the draft with ``layouts.DRAFT_LAYERS`` (EAGLE's draft
        worker, MTP's NextN layer: its own pool, same size and page size, layers from 0).
        ``mha-draft``: ``MHATokenToKVPool`` (1 head of 16 bf16); ``mla-draft``:
        ``MLATokenToKVPool`` (``mla``: latent 32 + rope 16 bf16). Components: the target's
        ``k`` / ``v`` (``kv``), then the draft's ``draft_k`` / ``draft_v`` (``draft_kv``),
        each layer's buffer as ``[pages, page_size, bytes]``."""
        import torch
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

        def build(layers: int) -> Any:
            if self.pool_kind == "mla-draft":
                return MLATokenToKVPool(**{**mla, "layer_num": layers})
            return MHATokenToKVPool(
                size=cfg.num_pages * page_size, page_size=page_size, dtype=torch.bfloat16,
                head_num=1, head_dim=layouts.HYBRID_HEAD_BYTES // 2, layer_num=layers,
                device="cpu", enable_memory_saver=False, enable_alt_stream=False)

        pool = build(cfg.num_layers)
        self.draft_pool = build(layouts.DRAFT_LAYERS)
        comps: list[Component] = []
        for prefix, p in (("", pool), ("draft_", self.draft_pool)):
            named = ((("kv", p.kv_buffer),) if self.pool_kind == "mla-draft"
                     else (("k", p.k_buffer), ("v", p.v_buffer)))
            for name, bufs in named:
                for layer, b in enumerate(bufs):
                    u8 = b.view(torch.uint8)
                    comps.append(Component(prefix + name, layer, u8.numpy().reshape(
                        u8.shape[0] // page_size, page_size, -1)))
        self._check_views(comps)
        return pool, comps

    @property
    def sliding_window_size(self) -> int | None:
        """The scheduler's ``sliding_window_size`` (swa lanes), else None."""
        return layouts.SWA_WINDOW if self.pool_kind == "swa" else None

    def _check_views(self, comps: list[Component]) -> None:
        """Every component a writable view of the pool, as wide as ``layouts.REGIONS``."""
        widths: dict[str, int] = {}
        for name, _, _, stop in layouts.REGIONS[self.pool_kind]:
            widths[name] = max(widths.get(name, 0), stop)
        for c in comps:  # views, never copies: the transfer reads and writes the pool
            if c.array.base is None or not c.array.flags.writeable:
                raise RuntimeError(f"component {c.name} is not a view of the pool")
            if c.array.shape[2] != widths[c.name]:
                raise RuntimeError(f"component {c.name}: {c.array.shape[2]} bytes a slot, "
                                   f"layouts.REGIONS says {widths[c.name]}")

    @property
    def state_slot(self) -> int | None:
        """This leg's state slot of the request in flight (hybrid lanes), else None."""
        return HYBRID_STATE_SLOT[self.cfg.role] if self.pool_kind == "hybrid" else None

    # -- the pool's bytes: MHA through ``pages``' rows, other kinds through ``layouts`` ----

    def fill_pool(self, pages: Any, magic: int) -> None:
        """Every slot of ``pages`` with the POISON or STALE pattern (``pages``' magics)."""
        if self.pool_kind == "mha":
            fill = fill_poison_pages if magic == MAGIC_POISON else fill_stale_pages
            fill(self.buffers, self.layer_kv, pages, self.page_size)
        else:
            layouts.fill_pattern(self.components, list(pages), self.page_size, magic)

    def fill_data(self, pages: list[int], room: int, start: int, end: int) -> None:
        """The prefill "forward" of request tokens ``[start, end)``."""
        if self.pool_kind == "mha":
            fill_data_pages(self.buffers, self.layer_kv, pages, self.page_size, room, start,
                            end)
        else:
            layouts.fill_data(self.components, pages, self.page_size, room, start, end,
                              tail_row=REQ_POOL_IDX, state_slot=self.state_slot)

    def classify(self, pages: list[int], room: int, num_tokens: int) -> list[Any]:
        """Per-page verdicts of the request's slots (``pages.classify_pages``)."""
        if self.pool_kind == "mha":
            return classify_pages(self.buffers, self.layer_kv, page_size=self.page_size,
                                  pages=pages, room=room, num_tokens=num_tokens)
        return layouts.classify_components(self.components, page_size=self.page_size,
                                           pages=pages, room=room, num_tokens=num_tokens,
                                           tail_row=REQ_POOL_IDX, state_slot=self.state_slot)

    def corrupt(self, what: BitFlip | RowCopy) -> tuple[int, int]:
        """Apply one test-only corruption of the pool; (a byte before, after)."""
        if self.pool_kind == "mha":
            if not isinstance(what, BitFlip) or what.component:
                raise ValueError(f"an MHA lane takes K/V bit flips only, not {what}")
            return apply_bit_flip(self.buffers, self.layer_kv, self.page_size, what)
        return layouts.apply_corruption(self.components, self.page_size, what)

    def state_indices(self, num_tokens: int) -> list[Any]:
        """The last chunk's / the metadata's state indices, one per ``kv_args.state_types``,
        by upstream's payload for each type, as both queues build it: ``_dsa_pages_payload``
        (the request's pages from ``req_to_token`` via ``suffix_page_indices``, prefix 0),
        ``_dsa_tail_payload`` (``get_dsa_tail_state_indices`` of the pool, the request's
        row, its length; see the upstream bug below), ``_mamba_payload`` (the request's
        translated Mamba slot), ``_swa_payload`` (:meth:`_swa_payload`). Reads row
        ``REQ_POOL_IDX``: set it first. Empty without state types (MHA, MLA)."""
        from sglang.srt.disaggregation.base.conn import StateType
        from sglang.srt.disaggregation.utils import get_dsa_tail_state_indices
        from sglang.srt.mem_cache.common import suffix_page_indices

        out: list[Any] = []
        for st in self.kv_args.state_types:
            if st == StateType.DSA:
                out.append(suffix_page_indices(self.req_to_token_pool.req_to_token,
                                               REQ_POOL_IDX, 0, num_tokens, self.page_size))
            elif st == StateType.DSA_TAIL:
                # Upstream's function, on this lane's real pool. Not called with the pool
                # itself as both queues do: for a plain DSATokenToKVPool (``use_dsa`` is
                # True, inherited from MLATokenToKVPool) it reads ``pool.full_kv_pool``,
                # which only a hybrid pool has, and raises AttributeError
                # (disaggregation/utils.py:1270-1271, 0.5.23; reached from prefill.py:1726
                # and decode.py:1779). The hybrid shape it expects is given instead; the
                # failure itself is pinned in test/unit/test_kv_digest.py.
                as_hybrid = SimpleNamespace(use_dsa=True, full_kv_pool=self.pool)
                out.append(get_dsa_tail_state_indices(as_hybrid, REQ_POOL_IDX, num_tokens))
            elif st == StateType.SWA:
                out.append(self._swa_payload(num_tokens))
            elif st == StateType.MAMBA:
                rtp = self.req_to_token_pool
                out.append([rtp.translate_mamba_indices(
                    rtp.req_index_to_mamba_index_mapping[REQ_POOL_IDX]).cpu().numpy()])
            else:
                raise NotImplementedError(f"state type {st} is not driven by the harness")
        return out

    def _swa_payload(self, num_tokens: int) -> Any:
        """Both queues' ``_swa_payload`` (no request window, no prefix): the SWA pages of
        the window's positions from the page-aligned window start, translated by the
        allocator (``translate_swa_indices_for_transfer``)."""
        from sglang.srt.mem_cache.common import kv_to_page_indices, page_align_floor

        start = page_align_floor(max(0, num_tokens - layouts.SWA_WINDOW), self.page_size)
        full = self.req_to_token_pool.req_to_token[REQ_POOL_IDX, start:num_tokens]
        return kv_to_page_indices(self.swa_allocator.translate_swa_indices_for_transfer(full),
                                  self.page_size)

    def _before_manager(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def set_request_row(self, pages: list[int], num_tokens: int) -> None:
        """Fill row ``REQ_POOL_IDX`` of ``req_to_token`` for a request whose positions
        ``[0, num_tokens)`` sit in ``pages`` (position ``t``: slot ``pages[t // ps] * ps +
        t % ps``), as the scheduler's allocator would have."""
        import torch

        slots = token_rows(pages, self.page_size, 0, num_tokens)
        self.req_to_token_pool.req_to_token[REQ_POOL_IDX, :num_tokens] = torch.from_numpy(
            slots).to(self.req_to_token_pool.req_to_token.dtype)
        if self.pool_kind == "swa":  # what the allocator's alloc sets for these positions
            swa = [layouts.swa_page(p, self.cfg.num_pages) for p in pages]
            self.swa_allocator.set_full_to_swa_mapping(
                torch.from_numpy(slots), torch.from_numpy(token_rows(swa, self.page_size, 0,
                                                                     num_tokens)))

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

    def _book(self) -> Bookkeeping:
        if self.book is None:
            raise RuntimeError("this pair was started without bookkeeping=True")
        return self.book

    def cmd_alloc_pages(self, num_pages: int, layout: str = "contiguous") -> list[int]:
        """``num_pages`` pages from the bookkeeping's allocator (``bookkeeping.LAYOUTS``)."""
        return self._book().alloc_pages(num_pages, layout)

    def cmd_measure_begin(self, trace_memory: bool = False) -> None:
        """Start measuring the next transfer's bookkeeping in this process."""
        from pdsafe_testkit.kv.bookkeeping import measure_begin

        measure_begin([self._book()], trace_memory=trace_memory)

    def cmd_measure_end(self) -> dict[str, Any]:
        """What the bookkeeping cost since ``measure_begin`` (``bookkeeping.measure_end``)."""
        from pdsafe_testkit.kv.bookkeeping import measure_end

        return measure_end([self._book()])


@dataclass
class SendPlan:
    sender: Any
    aux_index: int | None = None
    pages: list[int] = field(default_factory=list)
    segments: list[tuple[int, int]] = field(default_factory=list)
    next_segment: int = 0
    trace: list[tuple[str, float]] = field(default_factory=list)
    req: Any = None  # the request stand-in, kept from the first chunk to the retirement
    prefill_tokens: int = 0


class PrefillLane(Lane):
    """Prefill lane: bootstrap server + manager in PREFILL mode + one sender per room."""

    def _before_manager(self) -> None:
        # The bootstrap server (started by the prefill's HTTP side in sglang) must listen
        # before the manager registers to it.
        server_cls = self.get_kv_class(self.backend, self.KVClassType.BOOTSTRAP_SERVER)
        self.bootstrap_server = server_cls(host="127.0.0.1", port=self.bootstrap_port)
        self.plans: dict[int, SendPlan] = {}
        self._chunk: tuple[SendPlan, int, int] | None = None  # the chunk being sent

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
        self.plans[room] = SendPlan(sender=sender)

    def cmd_send_wait_ready(self, room: int, timeout: float) -> dict[str, Any]:
        """Poll until decode's metadata arrived (WaitingForInput) or a terminal state."""
        plan = self.plans[room]
        state, at, trace = poll_until(
            plan.sender.poll, timeout, lambda s: s != KVPOLL_BOOTSTRAPPING
        )
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
        plan.prefill_tokens = prefill_tokens
        self.fill_pool(pages, MAGIC_STALE)
        if self.book is not None:  # every chunk's source-page snapshot reads the row
            self.set_request_row(plan.pages, prefill_tokens)
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

        Each chunk's DATA rows are written (the "forward"), then the chunk goes through the
        patched scheduler's own ``SchedulerDisaggregationPrefillMixin.send_kv_chunk`` with
        this lane as its scheduler: at the last chunk it digests the request's KV into its
        metadata row (``kv_integrity.prefill_write_row``, patch 0021), then calls
        :meth:`_send_kv_chunk` (``set_buf``, the coverage attestation, ``sender.send``).
        """
        from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

        plan = self.plans[room]
        sent = 0
        while plan.next_segment < len(plan.segments) and (max_chunks is None or sent < max_chunks):
            start, end = plan.segments[plan.next_segment]
            last = plan.next_segment == len(plan.segments) - 1
            if self.book is not None:
                with self.book.forward():
                    self.fill_data(plan.pages, room, start, end)
            else:
                self.fill_data(plan.pages, room, start, end)
            if plan.req is None:  # one request object from the first chunk on
                plan.req = SimpleNamespace(
                    rid=f"kv-harness-{room}",
                    bootstrap_room=room,
                    metadata_buffer_index=plan.aux_index,
                    disagg_decode_prefix_len=0,
                    kv=SimpleNamespace(req_pool_idx=REQ_POOL_IDX),
                    disagg_kv_sender=plan.sender,
                )
            req = plan.req
            req.origin_input_ids = request_token_ids(room, end)
            req.extend_end = end
            if last:
                self.set_request_row(plan.pages, end)
            self._chunk = (plan, start, end)
            try:
                SchedulerDisaggregationPrefillMixin.send_kv_chunk(
                    self, req, last_chunk=last, end_idx=end
                )
            finally:
                self._chunk = None
            plan.next_segment += 1
            sent += 1
        result: dict[str, Any] = {"sent": sent, "remaining": len(plan.segments) - plan.next_segment}
        if wait_timeout is not None:
            result.update(self.cmd_send_wait_terminal(room, wait_timeout))
        return result

    @property
    def disagg_metadata_buffers(self) -> Any:
        """The scheduler attribute ``prefill_write_row`` writes the digest row into."""
        return self.metadata

    def _send_kv_chunk(
        self, req: Any, last_chunk: bool = False, end_idx: int | None = None
    ) -> None:
        """The scheduler's ``_send_kv_chunk`` for the chunk ``cmd_send_run`` is sending.

        Last chunk: the metadata row (``set_buf``: first output id, bootstrap_room), then
        what the patched scheduler does after ``set_buf`` (patch 0014): attest exactly the
        positions ``[0, end)`` this prefill wrote. Then ``sender.send`` of the chunk's pages.
        """
        if self._chunk is None:
            raise RuntimeError("_send_kv_chunk outside cmd_send_run")
        plan, start, end = self._chunk
        ps = self.page_size
        if last_chunk:
            idx = plan.aux_index
            self.metadata.output_ids[idx][0] = req.bootstrap_room % 32000
            self.metadata.bootstrap_room[idx, 0] = req.bootstrap_room
            from sglang.pdsafe import coverage

            coverage.attest_prefill_hook(self.metadata, req, end, ps)
        page_indices = np.asarray(plan.pages[start // ps : -(-end // ps)], dtype=np.int64)
        if self.book is not None:  # patch 0024: the chunk's source pages snapshotted
            self.book.note_chunk(req, start, end)
        # The last chunk carries one state index list per state type (none for MHA/MLA:
        # ``[]``, as the scheduler passes then; DSA: the indexer pages); others ``None``.
        state = self.state_indices(end) if last_chunk else None
        plan.sender.send(page_indices, state, num_kv_tokens=end - start)

    def cmd_send_wait_terminal(self, room: int, timeout: float) -> dict[str, Any]:
        plan = self.plans[room]
        state, at, trace = poll_until(plan.sender.poll, timeout, lambda s: s in KVPOLL_TERMINAL)
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
        source_refusal = None
        if state == KVPOLL_SUCCESS:
            if self.book is not None and plan.req is not None:
                self.book.time_plan(plan.prefill_tokens)
                source_refusal = self.book.success(plan.req, plan.pages)
            sender.clear()
            if self.book is not None and plan.req is not None:
                self.book.lease_cycle(room, plan.req.rid, plan.prefill_tokens)
        else:
            if self.book is not None:
                self.book.free_pages(plan.pages)
            if state != KVPOLL_FAILED:
                sender.abort()
            try:
                sender.failure_exception()
            except Exception as e:  # KVTransferError
                reason = str(e)
        if plan.aux_index is not None:
            self.metadata.clear_slot(plan.aux_index)
            self.aux_alloc.free(plan.aux_index)
        return {"state": KVPOLL_NAMES[state], "failure_reason": reason, "trace": plan.trace,
                "source_refusal": source_refusal}


@dataclass
class RecvState:
    receiver: Any
    pages: list[int]
    aux_index: int | None = None
    trace: list[tuple[str, float]] = field(default_factory=list)
    decode_req: Any = None  # bookkeeping: the request stand-in, from the reservation on


class DecodeLane(Lane):
    """Decode lane: manager in DECODE mode + one receiver per room."""

    def _before_manager(self) -> None:
        self.recvs: dict[int, RecvState] = {}
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
        self.fill_pool(targets, MAGIC_POISON)

    def _decode_req(self, room: int, num_tokens: int, receiver: Any,
                    aux_index: int | None) -> Any:
        """The ``DecodeRequest`` stand-in the patched decode hooks read."""
        return SimpleNamespace(
            req=SimpleNamespace(rid=f"kv-harness-{room}", bootstrap_room=room, output_ids=[],
                                origin_input_ids=request_token_ids(room, num_tokens),
                                return_logprob=False, finished_reason=None,
                                kv=SimpleNamespace(req_pool_idx=REQ_POOL_IDX,
                                                   cache_protected_len=0)),
            metadata_buffer_index=aux_index, kv_receiver=receiver)

    def cmd_recv_open(self, room: int, pages: list[int],
                      num_tokens: int | None = None) -> dict[str, Any]:
        """Receiver creation, ``init`` and ``send_metadata`` (the pre-allocation step).

        With bookkeeping, what ``_send_kv_metadata`` runs before ``send_metadata``: the
        coverage reservation of ``num_tokens`` (default: the pages' capacity) and the
        page-generation snapshot."""
        if room in self.recvs:
            raise ValueError(f"room {room} already open on decode")
        receiver_cls = self.get_kv_class(self.backend, self.KVClassType.RECEIVER)
        receiver = receiver_cls(
            mgr=self.mgr, bootstrap_addr=self.bootstrap_addr, bootstrap_room=room
        )
        st = RecvState(receiver=receiver, pages=list(pages))
        self.recvs[room] = st
        receiver.init(0)  # prefill dp_size is 1: _resolve_prefill_dp_rank gives 0
        st.aux_index = self.aux_alloc.alloc()
        if st.aux_index is None:
            raise RuntimeError("decode metadata slots exhausted")
        if self.book is not None:
            tokens = len(pages) * self.page_size if num_tokens is None else int(num_tokens)
            st.decode_req = self._decode_req(room, tokens, receiver, st.aux_index)
            self.book.reserve(st.decode_req, list(pages), tokens)
        state: list[Any] = []
        if self.kv_args.state_types:  # decode's own state payloads read its request row
            self.set_request_row(list(pages), len(pages) * self.page_size if num_tokens is None
                                 else int(num_tokens))
            state = self.state_indices(len(pages) * self.page_size if num_tokens is None
                                       else int(num_tokens))
        receiver.send_metadata(
            np.asarray(pages, dtype=np.int32), st.aux_index, state, decode_prefix_len=0
        )
        state = int(receiver.poll())
        st.trace.append((KVPOLL_NAMES[state], time.monotonic()))
        return self._outcome(room, state, None, st.trace)

    def cmd_recv_wait_terminal(self, room: int, timeout: float) -> dict[str, Any]:
        st = self.recvs[room]
        state, at, trace = poll_until(st.receiver.poll, timeout, lambda s: s in KVPOLL_TERMINAL)
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

    def cmd_recv_finish(
        self, room: int, num_tokens: int, flips: list[BitFlip | RowCopy] | None = None,
        classify: bool = True,
    ) -> dict[str, Any]:
        """Classify the request's pages and read its aux row, then retire the receiver.

        Not terminal: ``abort()`` first (as the waiting timeout does). Failed:
        ``failure_exception()``. Always clears deferred-abort state and frees the slot.

        A transfer decode commits (Success and the commit gate passed) then goes through the
        KV digest as the patched decode does (patch 0021): ``kv_integrity.capture`` keeps
        prefill's row at commit, before the slot is freed; then ``flips`` (test-only
        corruption of decode's pool, after the transfer) are applied and the pages classified
        again; then ``kv_integrity.verify_batch``, what ``_verify_kv_checksums`` runs when the
        request first enters a batch, checks it (see :meth:`_digest_check`).

        ``classify`` False: no per-page verdicts (a million pages); ``own_rows`` counts the
        rows that hold exactly this request's data instead (``pages.count_own_rows``).
        With bookkeeping, the commit runs the patched decode's hooks (``Bookkeeping.commit``:
        digest row kept, page generations checked, the commit gate), the pages go back
        through the allocator, and the quarantine record of a failed transfer of them is
        held and released (``Bookkeeping.quarantine_cycle``).
        """
        st = self.recvs.pop(room)
        receiver = st.receiver
        verdicts: list[Any] = []
        own_rows = None
        if classify:
            verdicts = self.classify(st.pages, room, num_tokens)
        elif self.pool_kind != "mha":
            raise NotImplementedError("classify=False counts MHA rows only")
        else:
            own_rows = count_own_rows(self.buffers, self.layer_kv, page_size=self.page_size,
                                      pages=st.pages, room=room, num_tokens=num_tokens)
        aux_room = int(self.metadata.bootstrap_room[st.aux_index, 0].item())
        # The patched scheduler's decode side (patch 0013): the reservation noted
        # when the page indices went out, checked by the commit gate before commit.
        from sglang.pdsafe import coverage

        state = int(receiver.poll())
        reason = self._failure_reason(room)
        if self.book is not None and st.decode_req is not None:
            decode_req = st.decode_req
            refusal, passed = (self.book.commit(decode_req, self.metadata)
                               if state == KVPOLL_SUCCESS else (None, False))
            gate = coverage.check_commit_hook(SimpleNamespace(metadata_buffers=self.metadata),
                                              decode_req) if not passed else None
            gate_value = "ok" if passed else gate.outcome.value
            gate_message = refusal or ("" if passed else gate.message)
        else:
            decode_req = self._decode_req(room, num_tokens, receiver, st.aux_index)
            coverage.note_reservation_hook(decode_req, st.pages, self.page_size, 0, num_tokens)
            gate = coverage.check_commit_hook(SimpleNamespace(metadata_buffers=self.metadata),
                                              decode_req)
            gate_value, gate_message = gate.outcome.value, gate.message
        committed = state == KVPOLL_SUCCESS and gate_value == "ok"
        digest = self._digest_check(decode_req, st.pages, num_tokens, committed, flips or [],
                                    captured=self.book is not None and committed)
        if self.book is not None:
            self._book_release(decode_req, st.pages, num_tokens, committed)
        if state == KVPOLL_SUCCESS:
            receiver.clear()
        else:
            if state != KVPOLL_FAILED:
                receiver.abort()
            try:
                receiver.failure_exception()
            except Exception as e:  # KVTransferError
                reason = str(e)
        self.mgr.clear_deferred_abort_state(room)
        self.metadata.clear_slot(st.aux_index)
        self.aux_alloc.free(st.aux_index)
        if self.book is not None and committed:
            self.book.quarantine_cycle(room, decode_req.req.rid, num_tokens)
        return {
            "state": KVPOLL_NAMES[state],
            "failure_reason": reason,
            "aux_room": aux_room,
            "gate": gate_value,
            "gate_message": gate_message,
            "verdicts": verdicts,
            "own_rows": own_rows,
            **digest,
        }

    def _book_release(self, decode_req: Any, pages: list[int], num_tokens: int,
                      committed: bool) -> None:
        """Bookkeeping: the digest's planning timed apart, then the pages go back: a
        committed request's through the allocator's free at its end, a refused one's
        through ``page_generation.release_request`` (as ``_release_request``)."""
        assert self.book is not None
        book = self.book
        if committed:
            book.time_plan(num_tokens)
            book.free_pages(pages)
        else:
            from sglang.pdsafe import page_generation

            page_generation.release_request(decode_req, lambda: book.free_pages(pages))

    def _digest_check(
        self,
        decode_req: Any,
        pages: list[int],
        num_tokens: int,
        committed: bool,
        flips: list[BitFlip | RowCopy],
        captured: bool = False,
    ) -> dict[str, Any]:
        """The decode leg of the KV digest for one request, by the fork's own functions.

        ``kv_integrity.capture`` (``_commit_transfer_to_req``), then the ``flips``, then
        ``kv_integrity.verify_batch`` with this lane as the scheduler (its
        ``req_to_token_pool`` row of the request, the real manager as the prealloc queue's
        ``kv_manager``). The outcome is named by the counter the check moved (``ok`` for
        ``kv_digest_verified_total``); ``off`` when the digest is off on this leg,
        ``not_committed`` when decode would not commit (nothing is checked then, as in the
        scheduler). Flips are applied only to a committed transfer.
        """
        if self.kv_checksum_computer is None:
            return {"digest": "off", "digest_message": "", "digest_generation": None,
                    "flips": [], "flipped_verdicts": []}
        if not committed:
            return {"digest": "not_committed", "digest_message": "", "digest_generation": None,
                    "flips": [], "flipped_verdicts": []}
        from sglang.pdsafe import kv_integrity, metrics

        if not captured:  # the bookkeeping's commit kept the row already
            kv_integrity.capture(SimpleNamespace(metadata_buffers=self.metadata), decode_req,
                                 fake=False)
        generation = int(decode_req.kv_receiver.pdsafe_transfer_generation())
        applied = [self.corrupt(f) for f in flips]
        flipped_verdicts = (
            self.classify(pages, decode_req.req.bootstrap_room, num_tokens) if flips else []
        )
        self.set_request_row(pages, num_tokens)
        before = {name: metrics.value(name) for name in _DIGEST_COUNTERS}
        scheduler = SimpleNamespace(
            req_to_token_pool=self.req_to_token_pool,
            sliding_window_size=self.sliding_window_size,
            disagg_decode_prealloc_queue=SimpleNamespace(kv_manager=self.mgr),
        )
        refused = kv_integrity.verify_batch(scheduler, [decode_req.req],
                                            self.kv_checksum_computer)
        moved = [name for name in _DIGEST_COUNTERS if metrics.value(name) != before[name]]
        if len(moved) != 1:
            raise RuntimeError(f"the digest check moved counters {moved}, expected one")
        outcome = _DIGEST_COUNTERS[moved[0]]
        if (outcome == "ok") != (not refused):
            raise RuntimeError(f"digest outcome {outcome} but refused={dict(refused)}")
        return {"digest": outcome, "digest_message": refused.get(0, ""),
                "digest_generation": generation, "flips": applied,
                "flipped_verdicts": flipped_verdicts}
