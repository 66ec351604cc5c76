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

from sglang.pdsafe import metrics
from sglang.pdsafe.protections import Protection, register

logger = logging.getLogger(__name__)

STRICT_ENV = "SGLANG_PDSAFE_STRICT"


@dataclass(frozen=True)
class Rejection:
    """Why a request was refused before it acquired anything (typed, never a stub prompt)."""

    message: str
    status_code: int
    err_type: str


def _disagg_mode() -> str:
    try:
        from sglang.srt.runtime_context import get_disagg

        mode = get_disagg().disaggregation_mode
    except Exception:
        return "null"
    return str(getattr(mode, "value", mode) or "null").lower()


def is_pd_mode() -> bool:
    return _disagg_mode() in ("prefill", "decode")


def record_rejection(req: Any, message: str, status_code: int, err_type: str) -> bool:
    """Attach the typed rejection to ``req``; return True if the prompt may be rewritten.

    The rewrite to a one-token prompt is upstream's way to make a local abort cheap; in PD mode it
    is refused, because a stub on a handoff path is exactly the incident.
    """
    req.pdsafe_rejection = Rejection(message, int(status_code), err_type)
    return not is_pd_mode()


def _is_aborted(req: Any) -> bool:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return (
        getattr(req, "pdsafe_rejection", None) is not None
        or isinstance(getattr(req, "to_finish", None), FINISH_ABORT)
        or isinstance(getattr(req, "finished_reason", None), FINISH_ABORT)
    )


def transfer_endpoint_allowed(req: Any, where: str) -> bool:
    """False (and loud) when an aborted request reaches KV sender/receiver creation."""
    if not _is_aborted(req):
        return True
    metrics.inc("placeholder_blocked_total")
    rej = getattr(req, "pdsafe_rejection", None)
    msg = (
        f"pdsafe: aborted request {getattr(req, 'rid', '?')} reached {where} "
        f"(reason: {rej.message if rej else getattr(req, 'to_finish', None)}). A rejected "
        "request must be retired at the queue door; this is a bug in an earlier check. "
        "The request is refused here and no KV is exchanged for it."
    )
    logger.error(msg)
    if os.environ.get(STRICT_ENV) == "1":
        raise AssertionError(msg)
    return False


register(Protection(
    name="no-placeholder-handoff",
    guards="rejected requests keep their typed verdict and never reach a KV sender/receiver",
    is_active=lambda server_args: getattr(server_args, "disaggregation_mode", "null")
    in ("prefill", "decode"),
))
