"""The decode-side commit gate: the last check before transferred pages become a request's KV.

Upstream commits a finished transfer after checking only the bootstrap room in the metadata
row. ``admit_commit`` is called (through patches/) at that point, after the room check and
before the first token is appended. It returns False when the request must not decode; it has
then already put the request into its aborted state with a message for the client.

The check is the token-exact coverage attestation (``coverage``): prefill must attest exactly
the token range, tokens and pages this decode reserved.

``admit_commit(transfer_queue, decode_req)`` is a stable name and signature, and callers look it
up through this module at call time (``commit_gate.admit_commit(...)``), so that sglang plugins
(``sglang.srt.plugins`` hooks, e.g. the test-only fault plugin of the testkit) can wrap it.

Invariant: a request for which ``admit_commit`` returned False never reaches a decode batch.
"""

from __future__ import annotations

from typing import Any

from sglang.pdsafe import coverage, policy, transfer
from sglang.srt.disaggregation.utils import prepare_abort


def _admit_failed(failure: policy.Failure) -> bool:
    """The commit gate could not run: the request is refused (500), never decoded."""
    decode_req = failure.args[1]
    refusal = failure.refusal(500, "the KV transfer (its coverage could not be checked)")
    prepare_abort(decode_req.req, refusal.reason, status_code=refusal.status)
    rec = transfer.of(decode_req.req)
    if rec is not None:
        rec.refuse(refusal)
    return False


@policy.hook("commit_gate.admit_commit", outcome=policy.Outcome.REFUSE,
             counter=coverage.FAILED, on_failure=_admit_failed,
             key=lambda q, decode_req: ("room", decode_req.req.bootstrap_room,
                                        str(decode_req.req.rid)),
             effect="the request is refused at commit (500), never decoded")
def admit_commit(transfer_queue: Any, decode_req: Any) -> bool:
    """Decide whether ``decode_req``'s transferred KV may be committed (see module doc)."""
    return coverage.admit(transfer_queue, decode_req)
