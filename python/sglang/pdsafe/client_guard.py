"""Client bypasses closed: server-internal request markers are refused from clients.

Two values act as server-internal switches inside SGLang, and both are copied from client
requests unchecked upstream:

* ``bootstrap_host == FAKE_BOOTSTRAP_HOST`` ("2.2.2.2"): a PD server does a *fake* transfer
  (decode skips the KV transfer and decodes over pages nobody wrote), used by the server's own
  warmup and health checks;
* a rid containing ``HEALTH_CHECK_RID_PREFIX`` ("HEALTH_CHECK"): health-check treatment
  (the KV checksum is skipped, metrics are not exported, outputs may be dropped).

``check_client_request`` is called (through a patch) at the top of
``TokenizerManager.generate_request``, the one funnel every HTTP generation endpoint goes
through (``/generate``, ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``,
``/encode``, Ollama, gRPC bridge; single and batch forms), before the request is normalized,
tokenized or registered. Checking typed fields there costs a few comparisons per request
(no body scan, no second JSON parse) and cannot be evaded by JSON escapes, which a raw-bytes
filter in a middleware could not promise.

What is trusted (server-built requests):

* in-process callers that pass no HTTP request (``request is None``: ``entrypoints/warmup.py``,
  the offline ``Engine`` API);
* the requests built by ``/health`` and ``/health_generate`` themselves (GET endpoints that take
  no request body; identified by path or by their route handler);
* the PD startup warmup, which reaches the server over its own HTTP port: it carries the
  per-server secret header ``INTERNAL_HEADER`` (``internal_headers()``), generated at startup
  and never sent to clients.

Invariant: a request whose body came from an HTTP client never reaches the scheduler with the
fake bootstrap host or a health-check rid; it is refused with 400 and counted in
``rejected_spoofed_bootstrap_host_total`` / ``rejected_spoofed_rid_total``.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from collections.abc import Iterable
from typing import Any

from sglang.pdsafe import metrics
from sglang.pdsafe.admission import AdmissionError
from sglang.pdsafe.protections import Protection, register

logger = logging.getLogger("sglang.pdsafe.client_guard")

# Same values as sglang.srt.disaggregation.utils.FAKE_BOOTSTRAP_HOST and
# sglang.srt.constants.HEALTH_CHECK_RID_PREFIX (imported lazily below; test_client_guard
# checks they stay equal).
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"

INTERNAL_HEADER = "x-sglang-pdsafe-internal"
TOKEN_ENV = "SGLANG_PDSAFE_INTERNAL_TOKEN"
#: Paths of endpoints that build their generation request in-process (GET, no body).
SERVER_BUILT_PATHS = frozenset({"/health", "/health_generate"})
SERVER_BUILT_ENDPOINTS = frozenset({"health_generate"})

# One secret per server: set in the launching process before any tokenizer worker process is
# spawned, so workers (which inherit the environment) accept the warmup the launcher sends.
_TOKEN: str = os.environ.setdefault(TOKEN_ENV, secrets.token_urlsafe(32))

register(Protection(
    name="client-bypass-guard",
    guards="client requests may not carry the fake bootstrap host (2.2.2.2) or a "
           "health-check rid (server-internal switches that skip the KV transfer/checks)",
    is_active=lambda server_args: True,
))


def _sync_constants() -> None:
    global FAKE_BOOTSTRAP_HOST, HEALTH_CHECK_RID_PREFIX
    try:
        from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX as rid_prefix
        from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST as fake_host
    except Exception:  # pragma: no cover - keep the defaults if upstream moves them
        return
    FAKE_BOOTSTRAP_HOST, HEALTH_CHECK_RID_PREFIX = fake_host, rid_prefix


_sync_constants()


class SpoofedInternalFieldError(AdmissionError):
    """A client request carried a server-internal marker."""

    error_code = "server_internal_field"


def internal_headers() -> dict[str, str]:
    """Headers that mark a request the server sends to itself (startup warmup)."""
    return {INTERNAL_HEADER: _TOKEN}


def _values(v: Any) -> Iterable[Any]:
    if isinstance(v, (list, tuple)):
        return v
    return (v,)


def is_server_built(request: Any) -> bool:
    """True for requests the server built itself (see module doc)."""
    if request is None:
        return True
    method = getattr(request, "method", None)
    if method in ("GET", "HEAD"):
        path = getattr(getattr(request, "url", None), "path", None)
        scope = getattr(request, "scope", None)
        endpoint = scope.get("endpoint") if isinstance(scope, dict) else None
        # By path, or by route handler (also behind a --root-path prefix).
        name = getattr(endpoint, "__name__", "")
        if path in SERVER_BUILT_PATHS or name in SERVER_BUILT_ENDPOINTS:
            return True
    headers = getattr(request, "headers", None)
    if headers is not None:
        try:
            got = headers.get(INTERNAL_HEADER)
        except Exception:
            got = None
        if got and hmac.compare_digest(str(got), _TOKEN):
            return True
    return False


def check_client_request(obj: Any, request: Any) -> None:
    """Refuse a client request carrying the fake bootstrap host or a health-check rid.

    ``obj``: a GenerateReqInput / EmbeddingReqInput (single or batch, before normalization);
    ``request``: the HTTP request it came with (None for in-process callers).
    """
    if is_server_built(request):
        return
    for host in _values(getattr(obj, "bootstrap_host", None)):
        if host is not None and str(host).strip() == FAKE_BOOTSTRAP_HOST:
            metrics.inc("rejected_spoofed_bootstrap_host_total")
            raise SpoofedInternalFieldError(
                f"bootstrap_host {FAKE_BOOTSTRAP_HOST!r} is reserved for the server's own "
                f"warmup and health checks (it makes the server skip the KV transfer) and is "
                f"refused from clients. Send the prefill server's real bootstrap host, or let "
                f"the PD router fill in the bootstrap fields."
            )
    for rid in _values(getattr(obj, "rid", None)):
        if isinstance(rid, str) and HEALTH_CHECK_RID_PREFIX in rid:
            metrics.inc("rejected_spoofed_rid_total")
            raise SpoofedInternalFieldError(
                f"request id {rid[:64]!r} contains {HEALTH_CHECK_RID_PREFIX!r}, which is "
                f"reserved for the server's own health checks and refused from clients. "
                f"Use a request id without {HEALTH_CHECK_RID_PREFIX!r} (or none: the server "
                f"assigns one)."
            )
