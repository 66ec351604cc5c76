"""No placeholder handoff: a rejected request never reaches a KV sender or receiver.

The incident: a prompt over the prefill KV capacity was "rejected" by rewriting it to a
one-token stub that still went through the PD handoff; prefill wrote one page, decode read all
the pages it had reserved (other tenants' KV), and the client got HTTP 200.

What this module keeps:

* A rejection is a typed outcome (:class:`Rejection`) attached to the request when it is
  decided, with its reason; in PD mode the prompt is *not* rewritten to a stub, so no code path
  can mistake a rejected request for a one-token prompt (non-PD servers keep upstream's rewrite,
  which only shortens a local prefill).
* ``transfer_endpoint_allowed`` is called where a KV sender (prefill) or receiver (decode) is
  created. An aborted request arriving there is a bug in an earlier line of defence: it is
  counted (``sglang:pdsafe_placeholder_blocked``), logged as an error, refused (prefill) and, when
  ``SGLANG_PDSAFE_STRICT=1`` (the test harness sets it), raises so tests fail loudly.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from sglang.pdsafe import metrics, policy, transfer
from sglang.pdsafe.policy import Outcome, Refusal, hook, returns
from sglang.pdsafe.protections import (
    PDModeUnknownError,
    Protection,
    process_pd_mode,
    register,
)
from sglang.pdsafe.transfer import State
from sglang.srt.disaggregation.utils import is_unadmitted_reject

logger = logging.getLogger(__name__)

STRICT_ENV = "SGLANG_PDSAFE_STRICT"
FAILED = "admission_check_failed_total"


class StrictViolation(AssertionError):
    """``SGLANG_PDSAFE_STRICT=1`` (the test harness): a rejected request reached endpoint
    creation. Raised through the failure policy (it is the check's answer), so tests fail."""


policy.answers(StrictViolation)


@dataclass(frozen=True)
class Rejection:
    """Why a request was refused before it acquired anything (typed, never a stub prompt)."""

    message: str
    status_code: int
    err_type: str


def may_rewrite_to_stub() -> bool:
    """Whether upstream's one-token rewrite of a rejected prompt is allowed in this process.

    Only on a server that is known not to be PD (``process_pd_mode() == "null"``). Fails
    closed: when the PD mode cannot be read (runtime context not published), the answer is
    "PD" (no rewrite). Keeping the prompt is always safe (the rejection is typed and the
    request is retired at the queue door); a stub on a handoff path is the incident.
    """
    try:
        return process_pd_mode() == "null"
    except PDModeUnknownError as e:
        logger.error("%s; treating this process as PD: the rejected prompt is kept, not "
                     "rewritten to a one-token stub", e)
        return False


@hook("placeholder_guard.record_rejection", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=returns(False),
      key=lambda req, *a, **k: ("rid", str(getattr(req, "rid", ""))),
      effect="the request stays rejected and its prompt is kept (never a one-token stub)")
def record_rejection(req: Any, message: str, status_code: int, err_type: str) -> bool:
    """Record the typed rejection in ``req``'s transfer record (a record of no leg yet: it
    never got a sender or receiver); return True if the prompt may be rewritten.

    The rewrite to a one-token prompt is upstream's way to make a local abort cheap; in PD mode
    (or when the mode cannot be read, see :func:`may_rewrite_to_stub`) it is refused, because
    a stub on a handoff path is exactly the incident.
    """
    rec = transfer.of(req)
    if rec is None or not rec.is_open:
        room = getattr(req, "bootstrap_room", None)
        rec = transfer.attach(req, transfer.Transfer(
            seq=-1, leg="", room=None if room is None else int(room),
            rid=str(getattr(req, "rid", "?"))))
    rec.rejection = Rejection(message, int(status_code), err_type)
    if rec.state is State.RESERVED:
        rec.refuse(Refusal(int(status_code), message, "placeholder_blocked_total"))
    return may_rewrite_to_stub()


def rejection_of(req: Any) -> Rejection | None:
    """The typed rejection recorded for ``req`` (None: none)."""
    rec = transfer.of(req)
    return getattr(rec, "rejection", None) if rec is not None else None


def rejected_at_intake(req: Any) -> bool:
    """Whether ``req`` was rejected at intake: aborted and holding nothing.

    Upstream's own definition (``disaggregation.utils.is_unadmitted_reject``): a pending abort
    on a request that holds KV, a metadata slot, Mamba state, a retraction backup or that is
    retracted marks a *re-entering* request, whose queue owes the release of what it holds;
    refusing it at creation would skip that release (a leak), so it is not a rejection here.
    """
    return bool(is_unadmitted_reject(req))


@hook("placeholder_guard.transfer_endpoint_allowed", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=returns(False),
      key=lambda req, where: ("rid", str(getattr(req, "rid", ""))),
      effect="no sender/receiver is built: the request is refused (its peer told by the "
             "caller's refusal path)")
def transfer_endpoint_allowed(req: Any, where: str) -> bool:
    """False (and loud) when a request rejected at intake reaches KV sender/receiver creation.

    Invariant: such a request never gets a sender or receiver (no bootstrap, no page reserved
    or read). Re-entering requests (see :func:`rejected_at_intake`) always pass.
    """
    if not rejected_at_intake(req):
        return True
    metrics.inc("placeholder_blocked_total")
    rej = rejection_of(req)
    msg = (
        f"pdsafe: request {getattr(req, 'rid', '?')}, rejected at intake, reached {where} "
        f"(reason: {rej.message if rej else getattr(req, 'to_finish', None)}). A rejected "
        "request must be retired at the queue door; this is a bug in an earlier check. "
        "The request is refused here and no KV is exchanged for it."
    )
    logger.error(msg)
    if os.environ.get(STRICT_ENV) == "1":
        raise StrictViolation(msg)
    return False


register(Protection(
    name="no-placeholder-handoff",
    guards="rejected requests keep their typed verdict and never reach a KV sender/receiver",
))
