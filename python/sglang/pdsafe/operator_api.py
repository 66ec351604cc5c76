"""``POST /pdsafe/quarantine/release``: an operator releases a decode's quarantined KV pages.

A decode keeps the pages of an aborted or failed transfer quarantined until evidence that no
prefill can write them again (:mod:`sglang.pdsafe.quarantine`): the writers' drain ACK, or a
new process incarnation registered at the writer's address. A writer that is gone for good
gives neither (a host fenced off, a prefill that will not come back): the operator supplies
the evidence, asserting that the writer can no longer post a write::

    curl -X POST http://DECODE:PORT/pdsafe/quarantine/release \\
         -H "Authorization: Bearer $ADMIN_API_KEY" -d '{"writer": "10.0.0.5:8998"}'

**Body**: ``{"writer": "host:port"}`` (the prefill's bootstrap address, as the decode's log,
``/health`` and its quarantine-limit refusal name it) or ``{"all": true}`` (every writer).
Nothing else: an unknown key, both, a malformed address, a non-object body are refused (400).

**Who may**: upstream's admin-optional level (``sglang.srt.utils.auth.decide_request_auth``
with ``AuthLevel.ADMIN_OPTIONAL``, the level of upstream's own admin endpoints): the admin API
key when the server has one (``--admin-api-key``), else its API key (``--api-key``), else
anyone who reaches the port. Checked here as well as by upstream's middleware, which runs in
single-tokenizer mode only.

**Answers**: 200 with the recorded release (the decode schedulers apply it at their next pass:
holds of that writer whose destinations went out before the release end, counted in
``quarantine_released_operator_total``); 400 a bad body; 401/403 upstream's auth answers; 404
on a server that is not a PD decode (no quarantine there); 503 when the server has no pdsafe
state directory (an entry point that bypassed the launcher); 500 when the release could not be
recorded (the failure policy: nothing is released). Every accepted release is counted
(``quarantine_operator_release_total``) and logged with the writer and the client's address.

Invariant: nothing is released unless the body names exactly one writer or says ``all``, the
caller passed upstream's admin check, and this server is a PD decode.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from sglang.pdsafe import policy, quarantine
from sglang.pdsafe.hook_api import require
from sglang.pdsafe.policy import Outcome, hook
from sglang.pdsafe.protections import PDModeUnknownError, process_pd_mode
from sglang.srt.runtime_context import get_serving
from sglang.srt.utils.auth import AuthLevel, decide_request_auth

logger = logging.getLogger("sglang.pdsafe.quarantine")

PATH = "/pdsafe/quarantine/release"
#: ``host:port``: a host name, IPv4 address or bracketed IPv6 address, and a port.
_WRITER = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")

require("sglang.srt.utils.auth", "decide_request_auth", "AuthLevel",
        why="the operator's quarantine release is admin-only, as upstream's admin endpoints")
require("sglang.srt.runtime_context", "get_serving()",
        why="the operator's quarantine release reads the server's API keys")


class BadRequest(ValueError):
    """The body does not name a writer or ``all`` (HTTP 400)."""


def parse_body(body: bytes | str) -> str | None:
    """The writer the body names (``host:port``), or None for ``{"all": true}``; raises
    :class:`BadRequest` saying what is wrong otherwise."""
    try:
        data = json.loads(body or b"")
    except ValueError as e:
        raise BadRequest(f"the body is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = sorted(set(data) - {"writer", "all"})
    if unknown:
        raise BadRequest(f"unknown keys {unknown}")
    if ("writer" in data) == ("all" in data):
        raise BadRequest("give exactly one of 'writer' or 'all'")
    if "all" in data:
        if data["all"] is not True:
            raise BadRequest("'all' must be true")
        return None
    writer = data["writer"]
    m = _WRITER.match(writer) if isinstance(writer, str) else None
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise BadRequest(f"'writer' must be the prefill's bootstrap address host:port, got "
                         f"{writer!r}")
    return writer


def client_name(client: Any) -> str:
    """``host:port`` of the HTTP client (Starlette's ``request.client``), or ``unknown``."""
    host = getattr(client, "host", None)
    port = getattr(client, "port", None)
    return f"{host}:{port}" if host else "unknown"


def authorized(authorization: str | None, serving: Any) -> int | None:
    """None when the caller may release, else upstream's status (401, 403)."""
    decision = decide_request_auth(
        method="POST", path=PATH, authorization_header=authorization,
        api_key=getattr(serving, "api_key", None),
        admin_api_key=getattr(serving, "admin_api_key", None),
        auth_level=AuthLevel.ADMIN_OPTIONAL)
    return None if decision.allowed else int(decision.error_status_code)


def _is_decode() -> bool:
    try:
        return process_pd_mode() == "decode"
    except PDModeUnknownError:
        return False


def _error(status: int, message: str) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": message, "code": status}}


def _failed(failure: policy.Failure) -> tuple[int, dict[str, Any]]:
    return _error(500, failure.refusal(500, "the quarantine release (nothing was released)")
                  .reason)


@hook("operator_api.quarantine_release", outcome=Outcome.HOLD,
      counter="quarantine_failed_total", on_failure=_failed,
      effect="nothing is released: the operator gets 500 with the cause and the pages stay "
             "held")
def quarantine_release(body: bytes | str, authorization: str | None,
                       client: Any) -> tuple[int, dict[str, Any]]:
    """``POST /pdsafe/quarantine/release`` (patch 0028): (HTTP status, JSON body)."""
    denied = authorized(authorization, get_serving())
    if denied is not None:
        logger.warning("pdsafe quarantine: refused an operator release from %s (HTTP %d: "
                       "admin key missing or wrong)", client_name(client), denied)
        return _error(denied, "Unauthorized" if denied == 401 else "Forbidden")
    if not _is_decode():
        return _error(404, "not a PD decode server: it quarantines no KV pages")
    try:
        writer = parse_body(body)
    except BadRequest as e:
        return _error(400, f"pdsafe quarantine release: {e}. Send {{\"writer\": "
                           f"\"host:port\"}} (the prefill's bootstrap address) or "
                           f"{{\"all\": true}}.")
    if policy.state_dir() is None:
        return _error(503, "this decode has no pdsafe state directory (it was not started "
                           "through sglang's launcher), so its schedulers cannot be told")
    recorded = quarantine.request_operator_release(writer, who=client_name(client))
    return 200, {**recorded, "applies": "at the next scheduler pass of this decode, to the "
                                        "holds of that writer taken before now; watch "
                                        "sglang:pdsafe_quarantine_released_operator_total"}
