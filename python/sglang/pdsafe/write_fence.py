"""Prefill writers stop before writing: a KV chunk of an aborted room is dropped, and counted.

Upstream's prefill transfer workers (Mooncake ``transfer_worker``, NIXL ``transfer_worker``,
MORI ``_should_skip_transfer``) read the room's status when they dequeue a chunk and drop the
chunk when the room failed, was aborted (decode's ABORT marks it Failed) or was cleared, so
nothing more is posted once an abort is known; a chunk already being posted finishes, and the
decode's quarantine (``quarantine``) holds the destination pages until that drain is
acknowledged. Patch 0020 makes every drop visible: :func:`chunk_discarded` counts it in
``sglang:pdsafe_writes_discarded_total``.

What it proves and what it does not: the counter shows that aborts reach the writers before they
post; it does not fence a write already posted (no transport can recall a one-sided write;
the drain ACK is what proves it landed).
"""

from __future__ import annotations

import logging

from sglang.pdsafe import metrics
from sglang.pdsafe.policy import Outcome, hook, returns

logger = logging.getLogger("sglang.pdsafe.write_fence")

DISCARDED = "writes_discarded_total"


@hook("write_fence.chunk_discarded", outcome=Outcome.REFUSE, counter="write_fence_failed_total",
      on_failure=returns(None), key=lambda room: ("room", room),
      effect="the chunk is dropped regardless (its room already failed); the drop is not "
             "counted")
def chunk_discarded(room: int) -> None:
    """A transfer worker dropped a KV chunk of ``room`` before posting it (room failed,
    aborted or cleared)."""
    metrics.inc(DISCARDED)
    logger.debug("pdsafe: dropped a KV chunk of room %s before posting it (aborted)", room)
