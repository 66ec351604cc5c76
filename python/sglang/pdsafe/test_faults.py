"""Test-only fault injection, used to prove that the content oracle sees foreign KV.

Armed only by the environment variable ``SGLANG_PDSAFE_TEST_FAULTS`` (never by a request or a
server flag), and even then it only touches requests whose rid carries one of the prefixes
below, so an armed test server still serves every other request normally.

``SGLANG_PDSAFE_TEST_FAULTS=foreign_kv:N``
    At decode commit, a request whose rid starts with ``pdsafe-fault-source-`` has the KV of
    its last N prompt positions copied aside; a later request whose rid starts with
    ``pdsafe-fault-inject-`` gets that foreign KV written over its own last N prompt positions
    before it decodes: exactly the effect of a transfer that left N positions holding another
    request's KV.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

ENV = "SGLANG_PDSAFE_TEST_FAULTS"
SOURCE_PREFIX = "pdsafe-fault-source-"
INJECT_PREFIX = "pdsafe-fault-inject-"

_snapshot: list[tuple[Any, Any]] | None = None
_warned = False


def armed_foreign_kv() -> int:
    """Number of positions the foreign_kv fault overwrites (0 when not armed)."""
    global _warned
    spec = os.environ.get(ENV, "")
    for item in spec.split(","):
        name, _, arg = item.strip().partition(":")
        if name == "foreign_kv":
            if not _warned:
                logger.warning(
                    "TEST FAULT ARMED (%s=%s): requests with rid prefix %r will get foreign KV. "
                    "Never set this outside tests.", ENV, spec, INJECT_PREFIX,
                )
                _warned = True
            return int(arg or 16)
    return 0


def _prompt_locs(scheduler: Any, req: Any, n: int) -> Any:
    prompt_len = len(req.origin_input_ids)
    row = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    return row[max(prompt_len - n, 0):prompt_len].to(dtype=row.dtype).long()


def _layers(pool: Any) -> range:
    start = getattr(pool, "start_layer", 0) or 0
    return range(start, start + pool.layer_num)


def on_decode_commit(scheduler: Any, req: Any) -> None:
    """Apply an armed fault to ``req`` right before its transferred KV is committed."""
    global _snapshot
    n = armed_foreign_kv()
    if not n or not isinstance(getattr(req, "rid", None), str):
        return
    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    if req.rid.startswith(SOURCE_PREFIX):
        locs = _prompt_locs(scheduler, req, n)
        _snapshot = [
            (pool.get_key_buffer(i)[locs].clone(), pool.get_value_buffer(i)[locs].clone())
            for i in _layers(pool)
        ]
        logger.warning("TEST FAULT: captured KV of %d positions from %s", len(locs), req.rid)
    elif req.rid.startswith(INJECT_PREFIX) and _snapshot is not None:
        locs = _prompt_locs(scheduler, req, n)
        for (k, v), i in zip(_snapshot, _layers(pool), strict=True):
            m = min(len(locs), k.shape[0])
            pool.get_key_buffer(i)[locs[-m:]] = k[-m:]
            pool.get_value_buffer(i)[locs[-m:]] = v[-m:]
        logger.warning("TEST FAULT: wrote foreign KV into %d positions of %s", len(locs), req.rid)
