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

* the server's own warmups (``entrypoints/warmup.py``'s ``execute_warmups``, which runs them
  inside :func:`server_internal`, a context variable no client can set);
* the requests built by ``/health`` and ``/health_generate`` themselves (GET endpoints that take
  no request body; identified by path or by their route handler);
* the PD startup warmup, which reaches the server over its own HTTP port: it carries the
  per-server secret header ``INTERNAL_HEADER`` (``internal_headers()``), generated at startup
  and never sent to clients.

Where the secret lives: in this module's memory only, never in ``os.environ`` (an environment
is inherited by every child process and readable in ``/proc/<pid>/environ``). The process that
serves HTTP generates it on first use. With ``--tokenizer-worker-num > 1`` the launcher hands
it to its HTTP worker processes the way it hands them everything else: inside the scheduler
info it writes to the workers' argument segment (shared memory, mode 0600, unlinked at
shutdown; ``worker_handoff()`` adds it there), and each worker takes it out again before it
keeps that dict (``adopt_worker_handoff()``), so it never appears in ``/server_info``. A
worker that has not adopted a secret accepts no internal header at all.

Every other caller is a client, whatever its entry point: the HTTP server, the offline
``sglang.Engine`` (which passes no HTTP request), the native gRPC bridge. A caller that passes
no HTTP request is **not** trusted for that alone.

The same funnel refuses every generation request of a poisoned server with 503 and the reason
(:func:`sglang.pdsafe.policy.poison_refusal`), before it reaches any scheduler.

Invariant: a request that the server did not build itself never reaches the scheduler with the
fake bootstrap host or a health-check rid, on any entry point; it is refused with 400 and
counted in ``rejected_spoofed_bootstrap_host_total`` / ``rejected_spoofed_rid_total``.
"""

from __future__ import annotations

import contextlib
import contextvars
import hmac
import logging
import secrets
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from sglang.pdsafe import metrics, policy
from sglang.pdsafe.admission import AdmissionError
from sglang.pdsafe.policy import CheckFailedError, Outcome, hook, raise_refusal
from sglang.pdsafe.protections import EVERY, Protection, register
from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX
from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

logger = logging.getLogger("sglang.pdsafe.client_guard")

# The two server-internal markers are upstream's own constants, imported (fail closed: if a
# rebase moves them, importing this module fails loudly instead of guarding a stale value).
# Other pdsafe modules take FAKE_BOOTSTRAP_HOST from here.
__all__ = [
    "FAKE_BOOTSTRAP_HOST",
    "HEALTH_CHECK_RID_PREFIX",
    "INTERNAL_HEADER",
    "SpoofedInternalFieldError",
    "adopt_worker_handoff",
    "check_client_request",
    "internal_headers",
    "is_server_built",
    "server_internal",
    "worker_handoff",
]
FAILED = "admission_check_failed_total"

INTERNAL_HEADER = "x-sglang-pdsafe-internal"
#: Key of the secret in the scheduler info the launcher hands its HTTP worker processes.
HANDOFF_KEY = "pdsafe_internal_token"
#: Paths of endpoints that build their generation request in-process (GET, no body).
SERVER_BUILT_PATHS = frozenset({"/health", "/health_generate"})
SERVER_BUILT_ENDPOINTS = frozenset({"health_generate"})

# One secret per server, in this module's memory only (see module doc). None until first use;
# "" in an HTTP worker that was handed none (it then sends and accepts no internal header).
_TOKEN: str | None = None
_token_lock = threading.Lock()

register(Protection(
    name="client-bypass-guard",
    guards="client requests may not carry the fake bootstrap host (2.2.2.2) or a "
           "health-check rid (server-internal switches that skip the KV transfer/checks)",
    roles=EVERY,
))

#: Set while the server runs its own requests in-process (its warmups): see module doc.
_SERVER_INTERNAL: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "pdsafe_server_internal", default=False)


@policy.passthrough("client_guard.server_internal",
                    why="sets a context variable around the server's own warmups; the requests "
                        "it marks are still checked by check_client_request (a hook)")
@contextlib.contextmanager
def server_internal() -> Iterator[None]:
    """Requests generated inside are the server's own (``execute_warmups``)."""
    token = _SERVER_INTERNAL.set(True)
    try:
        yield
    finally:
        _SERVER_INTERNAL.reset(token)


class SpoofedInternalFieldError(AdmissionError):
    """A client request carried a server-internal marker."""

    error_code = "server_internal_field"


def _token() -> str:
    """This server's secret, generated on first use (32 random bytes, url-safe); "" in an
    HTTP worker that was handed none."""
    global _TOKEN
    with _token_lock:
        if _TOKEN is None:
            _TOKEN = secrets.token_urlsafe(32)
        return _TOKEN


@hook("client_guard.internal_headers", outcome=Outcome.POISON, counter=FAILED,
      on_failure=policy.reraise_at_startup,
      effect="the server refuses to start (its warmup could not be told from a client)")
def internal_headers() -> dict[str, str]:
    """Headers that mark a request the server sends to itself (startup warmup)."""
    token = _token()
    return {INTERNAL_HEADER: token} if token else {}


@hook("client_guard.worker_handoff", outcome=Outcome.POISON, counter=FAILED,
      on_failure=policy.reraise_at_startup, effect="the server refuses to start")
def worker_handoff() -> dict[str, str]:
    """Launcher side: the entry to add to the scheduler info handed to HTTP worker processes
    (``write_data_for_multi_tokenizer``), so every worker accepts the same warmup header."""
    return {HANDOFF_KEY: _token()}


@hook("client_guard.adopt_worker_handoff", outcome=Outcome.POISON, counter=FAILED,
      on_failure=policy.reraise_at_startup, effect="the HTTP worker refuses to start")
def adopt_worker_handoff(scheduler_info: dict[str, Any]) -> None:
    """Worker side: take this server's secret out of the scheduler info the launcher handed
    over (``init_multi_tokenizer``), before the dict is kept or served (``/server_info``).

    Without the entry (a launcher without ``worker_handoff``) this worker trusts no internal
    header: its warmup and the other workers' are then refused like any client's (fail closed).
    """
    global _TOKEN
    token = scheduler_info.pop(HANDOFF_KEY, None)
    with _token_lock:
        _TOKEN = token if isinstance(token, str) and token else ""
    if not _TOKEN:
        logger.error("pdsafe: the launcher handed this HTTP worker no internal token; the "
                     "server's own warmup requests will be refused here as client requests")


def _values(v: Any) -> Iterable[Any]:
    if isinstance(v, (list, tuple)):
        return v
    return (v,)


def is_server_built(request: Any) -> bool:
    """True for requests the server built itself (see module doc); never for a caller only
    because it passed no HTTP request."""
    if _SERVER_INTERNAL.get():
        return True
    if request is None:
        return False
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
    got = headers.get(INTERNAL_HEADER) if headers is not None else None
    token = _TOKEN  # a worker that adopted no secret has none: nothing matches
    return bool(got and token and hmac.compare_digest(str(got), token))


@hook("client_guard.check_client_request", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=raise_refusal, effect="503 before the request is registered (every entry point)")
def check_client_request(obj: Any, request: Any) -> None:
    """Refuse a client request carrying the fake bootstrap host or a health-check rid, and
    every request of a poisoned server (503).

    ``obj``: a GenerateReqInput / EmbeddingReqInput (single or batch, before normalization);
    ``request``: the HTTP request it came with (None for in-process callers, which are
    clients too unless the server runs them: :func:`server_internal`).
    """
    poisoned = policy.poison_refusal()
    if poisoned is not None:
        raise CheckFailedError.of(poisoned)
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
