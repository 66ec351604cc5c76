"""The decode-side commit gate: the last check before transferred pages become a request's KV.

Upstream commits a finished transfer after checking only the bootstrap room in the metadata
row. ``admit_commit`` is called (through patches/) at that point, after the room check and
before the first token is appended. It returns False when the request must not decode; it has
then already put the request into its aborted state with a message for the client.

Checks, in order: the test-only fault injection (``test_faults``, inert unless armed by its
environment variable), then the token-exact coverage attestation (``coverage``): prefill must
attest exactly the token range, tokens and pages this decode reserved.

Invariant: a request for which ``admit_commit`` returned False never reaches a decode batch.
"""

from __future__ import annotations

from typing import Any

from sglang.pdsafe import coverage, test_faults


def admit_commit(transfer_queue: Any, decode_req: Any) -> bool:
    """Decide whether ``decode_req``'s transferred KV may be committed (see module doc)."""
    test_faults.on_decode_commit(transfer_queue.scheduler, decode_req.req)
    return coverage.admit(transfer_queue, decode_req)
