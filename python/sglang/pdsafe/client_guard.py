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

**The scheduler door** (:func:`scheduler_door`, ``Scheduler._handle_generate_request``) covers
the entry points that reach the scheduler without ``TokenizerManager.generate_request``: the smg
gRPC servicer (``--smg-grpc-mode``, or the deprecated ``--grpc-mode``; package
``smg-grpc-servicer``) builds ``TokenizedGenerateReqInput`` itself from the client's
``GenerateRequest`` (``rid`` = ``request_id``, the bootstrap fields from
``disaggregated_params``) and sends it to the scheduler over ZMQ, and so do the scheduler ranks
it runs headless behind SMG (its ZMQ plugin, :data:`SMG_HANDSHAKE_ENV` set). There the door
refuses (400, the same counters, the same reasons) a request carrying either marker unless it
has the shape of the probes such a server sends itself (:func:`probe_shaped`: at most
:data:`PROBE_MAX_PROMPT_TOKENS` prompt tokens, at most :data:`PROBE_MAX_NEW_TOKENS` new tokens,
``bootstrap_room`` 0 or unset, no embeddings, multimodal input or session): the servicer's
``HealthCheck`` (rid ``HEALTH_CHECK_<time>``, prompt ``[0]``, one new token, PD: the fake host
and room 0) and its startup warmup (rid ``WARMUP_<time>``, 7 prompt tokens, 8 new tokens, PD:
the fake host and room 0). The scheduler cannot tell those from a client's request of the same
shape, and need not: a decode zeroes the pages of every fake transfer before it decodes
(:mod:`sglang.pdsafe.kv_integrity`, ``fake_transfer_served_total``), so a probe-shaped request
reads nobody's KV; the shape bound keeps the fake path a probe (a few tokens), not a way to
serve traffic without the transfer checks. Behind the HTTP server and the offline Engine the
door does nothing (the funnel above checked every client request, and the server's own
warmups there have other shapes).

**Client-chosen cache keys.** ``GenerateReqInput.mm_hashes`` lets the caller set the hash of
each image's processor features, which upstream 0.5.23 uses as the item's prefix-cache key and
the encoder server's embedding-cache key (``TokenizerManager._tokenize_one_request``:
``item.set_hash``); a client that sends another request's image hash could reuse that request's
cached KV or embedding (CVE-2026-111392). The same funnel refuses a client request carrying
``mm_hashes`` with 400 (``rejected_client_mm_hashes_total``) unless the operator sets
``SGLANG_PDSAFE_TRUST_CLIENT_MM_HASHES=1`` (an external KV router that computes them for every
request; the startup report lists the guard as OFF then). The other client fields checked for
the same role (``docs/operator-guide.md``, "Client fields that key caches or transfers"):
``mm_content_hashes`` (identifies media, never replaces the cache key), ``bootstrap_room``
(the room guard), ``rid`` (upstream refuses a rid already in flight); ``session_params`` is
not covered (a session id is a bearer capability upstream: whoever knows it continues the
session's KV).

Invariant: a request that the server did not build itself never reaches the scheduler with the
fake bootstrap host or a health-check rid, on any entry point, unless it is probe-shaped and
came through an smg gRPC front end (where it decodes over zeroed pages); it is refused with 400
and counted in ``rejected_spoofed_bootstrap_host_total`` / ``rejected_spoofed_rid_total``.
"""

from __future__ import annotations

import contextlib
import contextvars
import hmac
import logging
import os
import secrets
import threading
from collections.abc import Hashable, Iterable, Iterator
from http import HTTPStatus
from typing import Any

from sglang.pdsafe import metrics, policy
from sglang.pdsafe.admission import AdmissionError
from sglang.pdsafe.hook_api import require
from sglang.pdsafe.policy import CheckFailedError, Outcome, Refusal, hook, raise_refusal
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
    "ClientCacheKeyError",
    "SpoofedInternalFieldError",
    "adopt_worker_handoff",
    "check_client_request",
    "internal_headers",
    "is_server_built",
    "probe_shaped",
    "scheduler_door",
    "server_internal",
    "tokenizer_manager_in_front",
    "worker_handoff",
]
FAILED = "admission_check_failed_total"
SPOOFED_HOST = "rejected_spoofed_bootstrap_host_total"
SPOOFED_RID = "rejected_spoofed_rid_total"
CLIENT_MM_HASHES = "rejected_client_mm_hashes_total"
#: ``1``: accept client ``mm_hashes`` (an external KV router that computes its own image hashes
#: and sits in front of every client). Off by default; a startup warning while set.
ENV_TRUST_MM_HASHES = "SGLANG_PDSAFE_TRUST_CLIENT_MM_HASHES"

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

register(Protection(
    name="client-cache-key-guard",
    guards="client requests may not choose prefix-cache keys (mm_hashes replace the hash of "
           "an image's features: another request's cached KV or embedding would be reused)",
    roles=EVERY,
    switched_off=lambda _args: (f"{ENV_TRUST_MM_HASHES}=1" if mm_hashes_trusted() else None),
))


def mm_hashes_trusted() -> bool:
    """Whether the operator accepts client ``mm_hashes`` (:data:`ENV_TRUST_MM_HASHES`)."""
    return os.environ.get(ENV_TRUST_MM_HASHES, "").strip().lower() in ("1", "true", "on", "yes")


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


class ClientCacheKeyError(AdmissionError):
    """A client request chose a prefix-cache key (``mm_hashes``)."""

    error_code = "client_cache_key_refused"
    param = "mm_hashes"


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
      on_failure=raise_refusal,
      effect="503 before the request is registered (every TokenizerManager entry point)")
def check_client_request(obj: Any, request: Any) -> None:
    """Refuse a client request carrying the fake bootstrap host, a health-check rid or a
    chosen prefix-cache key (``mm_hashes``, unless the operator trusts them) with 400, and
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
        if _is_fake_host(host):
            metrics.inc(SPOOFED_HOST)
            raise SpoofedInternalFieldError(_fake_host_reason())
    for rid in _values(getattr(obj, "rid", None)):
        if _is_health_rid(rid):
            metrics.inc(SPOOFED_RID)
            raise SpoofedInternalFieldError(_health_rid_reason(rid))
    if _chose(getattr(obj, "mm_hashes", None)) and not mm_hashes_trusted():
        metrics.inc(CLIENT_MM_HASHES)
        raise ClientCacheKeyError(_mm_hashes_reason())


def _chose(value: Any) -> bool:
    """True when a client field holds any value (a list of lists counts per item)."""
    if value is None:
        return False
    if isinstance(value, (list, tuple)):
        return any(_chose(v) for v in value)
    return value != ""


def _mm_hashes_reason() -> str:
    return ("mm_hashes is refused from clients: it replaces the hash of each image's features, "
            "which keys the prefix cache and the encoder's embedding cache, so a chosen value "
            "could reuse another request's cached KV (CVE-2026-111392). Send the images "
            "without mm_hashes (the server hashes them itself). Operators whose external KV "
            f"router computes these hashes for every request can set {ENV_TRUST_MM_HASHES}=1.")


def _is_fake_host(host: Any) -> bool:
    return host is not None and str(host).strip() == FAKE_BOOTSTRAP_HOST


def _is_health_rid(rid: Any) -> bool:
    return isinstance(rid, str) and HEALTH_CHECK_RID_PREFIX in rid


def _fake_host_reason() -> str:
    return (f"bootstrap_host {FAKE_BOOTSTRAP_HOST!r} is reserved for the server's own warmup "
            f"and health checks (it makes the server skip the KV transfer) and is refused from "
            f"clients. Send the prefill server's real bootstrap host, or let the PD router fill "
            f"in the bootstrap fields.")


def _health_rid_reason(rid: str) -> str:
    return (f"request id {rid[:64]!r} contains {HEALTH_CHECK_RID_PREFIX!r}, which is reserved "
            f"for the server's own health checks and refused from clients. Use a request id "
            f"without {HEALTH_CHECK_RID_PREFIX!r} (or none: the server assigns one).")


# --------------------------------------------------------------------------- scheduler door

#: smg-grpc-servicer sets this (its ``HANDSHAKE_ENV``) for scheduler ranks it runs headless
#: behind SMG, whose requests then arrive through its ZMQ plugin, not a TokenizerManager.
SMG_HANDSHAKE_ENV = "SMG_SGLANG_ZMQ_HANDSHAKE"
#: The probe shape (see module doc): bounds that the smg servicer's own HealthCheck (1 prompt
#: token, 1 new token) and startup warmup (7 prompt tokens, 8 new tokens) fit in.
PROBE_MAX_PROMPT_TOKENS = 8
PROBE_MAX_NEW_TOKENS = 8
SCHEDULER_DOOR_REASON = ("Only the server's own probes (at most {prompt} prompt tokens, at most "
                         "{new} new tokens, bootstrap_room 0 or unset) may carry it on this "
                         "{front} entry point.")

require("sglang.srt.server_args.ServerArgs", "smg_grpc_mode", "grpc_mode",
        why="client_guard.scheduler_door: which entry points reach the scheduler without the "
            "TokenizerManager funnel (a renamed flag would leave the door open)")
require("sglang.srt.runtime_context", "get_parallel()",
        why="client_guard.scheduler_door: count a refusal once per attention-TP group")


def tokenizer_manager_in_front(server_args: Any) -> bool:
    """Whether every generation request reaches this scheduler through
    ``TokenizerManager.generate_request`` (HTTP server, offline Engine, native gRPC bridge,
    ``--use-ray``). False behind the smg gRPC servicer (``--smg-grpc-mode``/``--grpc-mode``)
    and for ranks run headless behind SMG (:data:`SMG_HANDSHAKE_ENV`). The flags are read
    as attributes, not with defaults: a renamed flag fails the hook (503), not open."""
    if server_args.smg_grpc_mode or server_args.grpc_mode:
        return False
    return not os.environ.get(SMG_HANDSHAKE_ENV, "").strip()


def probe_shaped(recv_req: Any) -> bool:
    """Whether a ``TokenizedGenerateReqInput`` has the shape of a server probe (module doc):
    a prompt of 1..:data:`PROBE_MAX_PROMPT_TOKENS` token ids, at most
    :data:`PROBE_MAX_NEW_TOKENS` new tokens, ``bootstrap_room`` 0 or unset, and no input
    embeddings, multimodal input or session."""
    ids = recv_req.input_ids
    params = recv_req.sampling_params
    new_tokens = getattr(params, "max_new_tokens", None)
    return (ids is not None and 1 <= len(ids) <= PROBE_MAX_PROMPT_TOKENS
            and isinstance(new_tokens, int) and 0 <= new_tokens <= PROBE_MAX_NEW_TOKENS
            and recv_req.bootstrap_room in (None, 0)
            and recv_req.input_embeds is None and not recv_req.mm_inputs
            and recv_req.session_params is None
            and getattr(recv_req, "session_id", None) is None)


def _front(server_args: Any) -> str:
    return ("smg gRPC (--smg-grpc-mode)" if server_args.smg_grpc_mode or server_args.grpc_mode
            else "headless SMG (ZMQ)")


def _counts_here() -> bool:
    """Every attention-TP rank of a group sees the same request and refuses it the same way;
    the first one counts it (every rank, when the rank cannot be read: the verdict never
    depends on it)."""
    from sglang.srt.runtime_context import get_parallel

    try:
        return int(get_parallel().attn_tp_rank) == 0
    except Exception:  # noqa: BLE001 - no rank published: over-count rather than not count
        return True


def _door_key(scheduler: Any, recv_req: Any, *_: Any, **__: Any) -> Hashable:
    return ("rid", str(getattr(recv_req, "rid", "?")))


@hook("client_guard.scheduler_door", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=policy.refuse_with(503, "the request (its server-internal fields could not "
                                         "be checked)"),
      key=_door_key,
      effect="503 at the scheduler door (smg gRPC entry points), before the request is queued")
def scheduler_door(scheduler: Any, recv_req: Any) -> Refusal | None:
    """``Scheduler._handle_generate_request``, every generation request, once its ``Req`` is
    built and before it is queued: the :class:`~sglang.pdsafe.policy.Refusal` (400) the
    caller aborts the request with, or None. Refuses only where no TokenizerManager is in
    front (:func:`tokenizer_manager_in_front`) and only a request carrying the fake bootstrap
    host or a health-check rid that is not :func:`probe_shaped`. A pure function of the
    request and the server's flags, so every rank of a TP group reaches the same verdict."""
    if tokenizer_manager_in_front(scheduler.server_args):
        return None
    if _is_fake_host(recv_req.bootstrap_host):
        counter, reason = SPOOFED_HOST, _fake_host_reason()
    elif _is_health_rid(recv_req.rid):
        counter, reason = SPOOFED_RID, _health_rid_reason(recv_req.rid)
    else:
        return None
    if probe_shaped(recv_req):
        return None
    if _counts_here():
        metrics.inc(counter)
    return Refusal(int(HTTPStatus.BAD_REQUEST), reason + " " + SCHEDULER_DOOR_REASON.format(
        prompt=PROBE_MAX_PROMPT_TOKENS, new=PROBE_MAX_NEW_TOKENS,
        front=_front(scheduler.server_args)), counter)
