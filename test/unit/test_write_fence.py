"""Writers stop before writing (patch 0020, ``sglang.pdsafe.write_fence``): each backend's real
prefill transfer worker drops a chunk of an aborted room without posting it, and counts it.

Mooncake and NIXL run their real ``transfer_worker`` loop on a manager carrying only the state
that loop reads (their constructors start a transfer engine); the posting functions are replaced
by recorders, so "nothing posted" is observed, not assumed. MORI cannot run here (ROCm/RDMA), so
its real ``_should_skip_transfer`` runs with the ``mori`` package stubbed for import.

What this does not show: that a chunk already being posted when the abort arrives is fenced (no
transport can recall a one-sided write; the decode quarantine waits for its drain ACK).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import numpy as np
import pytest
from sglang.pdsafe import metrics, write_fence

ROOM = 4242


def _chunk(room: int) -> Any:
    from sglang.srt.disaggregation.mooncake.conn import TransferKVChunk

    return TransferKVChunk(room=room, prefill_kv_indices=np.arange(4, dtype=np.int32),
                           index_slice=slice(0, 4), is_last_chunk=True, prefill_aux_index=0,
                           state_indices=None)


def _worker_manager(cls: type, status: Any) -> tuple[Any, list[str]]:
    """A prefill manager of ``cls`` whose room ROOM has ``status`` (None: cleared); every
    posting path records into the returned list instead of writing."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    m = object.__new__(cls)
    posted: list[str] = []
    m.request_status = {} if status is None else {ROOM: getattr(KVPoll, status)}
    m.enable_trace = False
    m.enable_staging = False
    m.enable_deferred_decode_kv_release = False
    m._staging_outstanding = defaultdict(int)
    m.transfer_infos = {ROOM: {}}
    m.session_lock = threading.Lock()
    m.failed_sessions = set()
    for name in ("send_kvcache", "send_kvcache_slice", "send_kvcache_staged", "send_aux",
                 "_send_kvcache_generic", "send_kvcache_dcp"):
        setattr(m, name, lambda *a, _n=name, **k: posted.append(_n) or 0)
    return m, posted


def _run_worker(m: Any, chunks: list[Any]) -> None:
    """Run the real transfer_worker until it has taken every chunk (a None sentinel stops the
    Mooncake loop; NIXL has none, so its loop runs in a daemon thread that we wait on)."""
    from sglang.srt.disaggregation.common.utils import FastQueue

    q = FastQueue()
    for c in chunks:
        q.put(c)
    q.put(None)
    kwargs = {"executor": None} if "executor" in m.transfer_worker.__code__.co_varnames else {}
    t = threading.Thread(target=m.transfer_worker, args=(q,), kwargs=kwargs, daemon=True)
    t.start()
    t.join(timeout=5.0)


@pytest.mark.parametrize("status", ["Failed", None])
@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_worker_drops_a_chunk_of_an_aborted_or_cleared_room(backend: str, status: Any) -> None:
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager

    cls = {"mooncake": MooncakeKVManager, "nixl": NixlKVManager}[backend]
    m, posted = _worker_manager(cls, status)
    before = metrics.value(write_fence.DISCARDED)
    _run_worker(m, [_chunk(ROOM), _chunk(ROOM)])
    assert posted == [], f"{backend} posted a write for an aborted room: {posted}"
    assert metrics.value(write_fence.DISCARDED) == before + 2, (
        f"{backend}: the two dropped chunks were not counted")


def test_mori_skip_is_counted() -> None:
    from pdsafe_testkit.backends import import_mori_manager
    from sglang.srt.disaggregation.base.conn import KVPoll

    MoriKVManager = import_mori_manager()
    m = object.__new__(MoriKVManager)
    m.request_status = {ROOM: KVPoll.Transferring, ROOM + 1: KVPoll.Failed}
    before = metrics.value(write_fence.DISCARDED)
    assert m._should_skip_transfer(ROOM) is False
    assert metrics.value(write_fence.DISCARDED) == before
    assert m._should_skip_transfer(ROOM + 1) is True
    assert m._should_skip_transfer(ROOM + 2) is True  # cleared
    assert metrics.value(write_fence.DISCARDED) == before + 2
