"""Test-only fault injection, an sglang plugin; proves that the content oracle sees foreign KV.

This module is part of the test-only distribution ``sglang-pdsafe-testkit`` (``test/testkit``),
never of the product wheel. sglang's plugin loader (``sglang.srt.plugins.load_plugins``, which
runs early in every server process, the scheduler included) calls :func:`register` through the
entry point ``pdsafe_test_faults`` in the group ``sglang.srt.plugins``. ``SGLANG_PLUGINS``, when
set, is sglang's whitelist: the plugin then loads only if that list names ``pdsafe_test_faults``.

Armed only by the environment variable ``SGLANG_PDSAFE_TEST_FAULTS`` (never by a request or a
server flag). Unarmed, :func:`register` installs nothing. Armed, it registers a ``BEFORE`` hook
(``sglang.srt.plugins.hook_registry.HookRegistry``) on the product's decode commit gate,
``sglang.pdsafe.commit_gate.admit_commit(transfer_queue, decode_req)``, so the fault acts right
before the coverage check; the patched scheduler calls the gate through the module attribute,
so it sees the hooked function. Even armed, the fault only touches requests whose rid carries
one of the prefixes below, so an armed test server still serves every other request normally.

``SGLANG_PDSAFE_TEST_FAULTS=foreign_kv:N`` (N defaults to 16)
    At decode commit, a request whose rid starts with ``pdsafe-fault-source-`` has the KV of
    its last N prompt positions copied aside; a later request whose rid starts with
    ``pdsafe-fault-inject-`` gets that foreign KV written over its own last N prompt positions
    before it decodes: exactly the effect of a transfer that left N positions holding another
    request's KV.

Only public sglang API is used: the scheduler's ``req_to_token_pool.req_to_token`` table, the
KV pool's ``get_key_buffer``/``get_value_buffer``/``start_layer``/``layer_num``, and the
``HookRegistry`` of the plugin framework.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

ENV = "SGLANG_PDSAFE_TEST_FAULTS"
PLUGIN_NAME = "pdsafe_test_faults"
SOURCE_PREFIX = "pdsafe-fault-source-"
INJECT_PREFIX = "pdsafe-fault-inject-"
#: The product's decode commit gate (stable name and signature; see commit_gate.py).
TARGET = "sglang.pdsafe.commit_gate.admit_commit"
DEFAULT_FOREIGN_KV = 16


def parse_foreign_kv(spec: str) -> int:
    """Number of positions the ``foreign_kv`` fault overwrites in ``spec`` (0: not armed).

    ``spec`` is the value of ``SGLANG_PDSAFE_TEST_FAULTS``: comma-separated ``name[:arg]`` items.
    A malformed count raises ``ValueError`` (an armed test must not silently run unarmed).
    """
    for item in spec.split(","):
        name, _, arg = item.strip().partition(":")
        if name == "foreign_kv":
            n = int(arg or DEFAULT_FOREIGN_KV)
            if n <= 0:
                raise ValueError(f"{ENV}: foreign_kv needs a positive count, got {arg!r}")
            return n
    return 0


@dataclass
class ForeignKV:
    """The armed ``foreign_kv`` fault: N positions, and the KV captured from the last source.

    Invariant: only requests whose rid starts with ``SOURCE_PREFIX`` (capture) or
    ``INJECT_PREFIX`` (overwrite) are touched; every other request passes unchanged.
    """

    n: int
    snapshot: list[tuple[Any, Any]] | None = field(default=None, repr=False)

    def before_commit(self, transfer_queue: Any, decode_req: Any) -> None:
        """BEFORE hook of ``admit_commit``: apply the fault, keep the gate's arguments."""
        self.on_decode_commit(transfer_queue.scheduler, decode_req.req)

    def on_decode_commit(self, scheduler: Any, req: Any) -> None:
        """Apply the fault to ``req`` right before its transferred KV is committed."""
        rid = getattr(req, "rid", None)
        if not isinstance(rid, str):
            return
        if rid.startswith(SOURCE_PREFIX):
            pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
            locs = _prompt_locs(scheduler, req, self.n)
            self.snapshot = [
                (pool.get_key_buffer(i)[locs].clone(), pool.get_value_buffer(i)[locs].clone())
                for i in _layers(pool)
            ]
            logger.warning("TEST FAULT: captured KV of %d positions from %s", len(locs), rid)
        elif rid.startswith(INJECT_PREFIX) and self.snapshot is not None:
            pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
            locs = _prompt_locs(scheduler, req, self.n)
            for (k, v), i in zip(self.snapshot, _layers(pool), strict=True):
                m = min(len(locs), k.shape[0])
                pool.get_key_buffer(i)[locs[-m:]] = k[-m:]
                pool.get_value_buffer(i)[locs[-m:]] = v[-m:]
            logger.warning("TEST FAULT: wrote foreign KV into %d positions of %s", len(locs), rid)


def _prompt_locs(scheduler: Any, req: Any, n: int) -> Any:
    """KV locations of the last ``n`` prompt positions of ``req`` (a long tensor)."""
    prompt_len = len(req.origin_input_ids)
    row = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    return row[max(prompt_len - n, 0):prompt_len].long()


def _layers(pool: Any) -> range:
    """The layer ids this KV pool holds (``start_layer`` .. ``start_layer + layer_num``)."""
    start = getattr(pool, "start_layer", 0) or 0
    return range(start, start + pool.layer_num)


#: The armed fault of this process (None until :func:`register` armed one).
armed: ForeignKV | None = None


def register() -> None:
    """sglang plugin entry point: arm the faults named in ``SGLANG_PDSAFE_TEST_FAULTS``.

    Inert (registers no hook, logs nothing) when the variable is unset or names no known fault.
    Idempotent within a process: a second call registers nothing more.
    """
    global armed
    spec = os.environ.get(ENV, "")
    if not spec.strip() or armed is not None:
        return
    n = parse_foreign_kv(spec)
    if not n:
        logger.warning("%s=%r names no known test fault; nothing armed", ENV, spec)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    armed = ForeignKV(n)
    HookRegistry.register(TARGET, armed.before_commit, HookType.BEFORE)
    logger.warning(
        "TEST FAULT ARMED (%s=%s, plugin %s, pid %d): at decode commit (%s), requests with rid "
        "prefix %r get the KV of the last %d prompt positions of the last request with rid "
        "prefix %r. Never install sglang-pdsafe-testkit or set this outside tests.",
        ENV, spec, PLUGIN_NAME, os.getpid(), TARGET, INJECT_PREFIX, n, SOURCE_PREFIX,
    )
