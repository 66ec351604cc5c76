"""Scheduler glue of the KV harness: the real KV classes driven as sglang's schedulers do.

Runs in the children only (``child.Side`` builds one lane per page size). A *lane* is one page
size: a published ``ServerArgs`` (``--device cpu``, transfer backend X), the backend's real KV
manager (``get_kv_class(TransferBackend.X, KVClassType.MANAGER)``) over plain CPU torch tensors
standing in for the KV pool, sglang's real ``MetadataBuffers`` as the aux buffers and, on
prefill, the backend's real bootstrap server. Transfers use the real sender and receiver
classes, driven the way ``disaggregation/prefill.py`` and ``decode.py`` drive them (``init`` /
``send_metadata`` / ``send`` / ``poll`` / ``abort`` / ``clear``), without a scheduler and
without a model: the prefill "forward" writes a known pattern (``pages``) into its pages. The
coverage attestation and commit gate (``sglang.pdsafe.coverage``) run exactly where the patched
schedulers call them (patches 0004, 0014).

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
from typing import Any

import numpy as np

from pdsafe_testkit.kv.child import ChildConfig
from pdsafe_testkit.kv.pages import (
    classify_pages,
    fill_data_pages,
    fill_poison_pages,
    fill_stale_pages,
    request_token_ids,
)
from pdsafe_testkit.kv.results import (
    KVPOLL_BOOTSTRAPPING,
    KVPOLL_FAILED,
    KVPOLL_NAMES,
    KVPOLL_SUCCESS,
    KVPOLL_TERMINAL,
)

__all__ = ["POLL_INTERVAL_S", "DecodeLane", "Lane", "PrefillLane", "poll_until"]

#: Seconds between two polls of a sender/receiver (the scheduler polls once per loop).
POLL_INTERVAL_S = 0.0005


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

    def __init__(self, cfg: ChildConfig, page_size: int, bootstrap_port: int) -> None:
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
class SendPlan:
    sender: Any
    aux_index: int | None = None
    pages: list[int] = field(default_factory=list)
    segments: list[tuple[int, int]] = field(default_factory=list)
    next_segment: int = 0
    trace: list[tuple[str, float]] = field(default_factory=list)


class PrefillLane(Lane):
    """Prefill lane: bootstrap server + manager in PREFILL mode + one sender per room."""

    def _before_manager(self) -> None:
        # The bootstrap server (started by the prefill's HTTP side in sglang) must listen
        # before the manager registers to it.
        server_cls = self.get_kv_class(self.backend, self.KVClassType.BOOTSTRAP_SERVER)
        self.bootstrap_server = server_cls(host="127.0.0.1", port=self.bootstrap_port)
        self.plans: dict[int, SendPlan] = {}

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
        if state == KVPOLL_SUCCESS:
            sender.clear()
        else:
            if state != KVPOLL_FAILED:
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
class RecvState:
    receiver: Any
    pages: list[int]
    aux_index: int | None = None
    trace: list[tuple[str, float]] = field(default_factory=list)


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
        fill_poison_pages(self.buffers, self.layer_kv, targets, self.page_size)

    def cmd_recv_open(self, room: int, pages: list[int]) -> dict[str, Any]:
        """Receiver creation, ``init`` and ``send_metadata`` (the pre-allocation step)."""
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
        receiver.send_metadata(
            np.asarray(pages, dtype=np.int32), st.aux_index, [], decode_prefix_len=0
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
        # The patched scheduler's decode side (patch 0013): the reservation noted
        # when the page indices went out, checked by the commit gate before commit.
        from sglang.pdsafe import coverage

        decode_req = SimpleNamespace(
            req=SimpleNamespace(rid=f"kv-harness-{room}", bootstrap_room=room, output_ids=[],
                                origin_input_ids=request_token_ids(room, num_tokens)),
            metadata_buffer_index=st.aux_index)
        coverage.note_reservation_hook(decode_req, st.pages, self.page_size, 0, num_tokens)
        gate = coverage.check_commit_hook(SimpleNamespace(metadata_buffers=self.metadata),
                                          decode_req)
        state = int(receiver.poll())
        reason = self._failure_reason(room)
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
        return {
            "state": KVPOLL_NAMES[state],
            "failure_reason": reason,
            "aux_room": aux_room,
            "gate": gate.outcome.value,
            "gate_message": gate.message,
            "verdicts": verdicts,
        }


