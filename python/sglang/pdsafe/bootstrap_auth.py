"""Bootstrap writes need a key: ``PUT /route`` and ``POST /register_dp_rank`` of a prefill's
bootstrap server answer 401 to a caller without it.

Why: the prefill's bootstrap server (``CommonKVBootstrapServer``, one per prefill server, in
its launcher process) keeps the table decodes read to find each prefill rank's KV address.
Upstream 0.5.23 accepts any ``PUT /route``, so anyone who can reach the bootstrap port can
re-point a rank's registration at their own address, and the decodes then send that address
their metadata (page addresses, room, generation) or time out (CVE-2026-92972,
sgl-project/sglang#39400; upstream's open fix #39416 adds a bearer token). ``POST
/register_dp_rank`` likewise lets anyone re-route a room to another data-parallel rank.

The key, in this order:

1. ``SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN`` (upstream's proposed name, so that a later
   upstream fix reads the same setting). Key rotation: ``new,old`` (comma-separated); every
   listed key is accepted, the first one is sent. Set the same value on every node of a
   multi-node prefill.
2. ``--api-key``, if the server has one.
3. Otherwise a random per-server secret: the launcher (``Engine._launch_subprocesses``,
   :func:`prepare`) generates it before any scheduler exists, and the schedulers it spawns
   inherit it. Only this server's own ranks know it, which is exactly who may register. A
   multi-node prefill (``--nnodes`` > 1) cannot share such a secret: it must configure 1 or
   2, or the start is refused.

``SGLANG_PDSAFE_REQUIRE_BOOTSTRAP_TOKEN=1`` makes a missing configured key (1 or 2) a startup
error, for operators who want the key to be explicit. ``SGLANG_PDSAFE_BOOTSTRAP_AUTH=0`` turns
the check off (startup warning; every write is then accepted, as upstream does).

The GET endpoints stay open: decodes read ``GET /route`` before they hold any key, and what it
returns (rank addresses, layout) is what a decode needs to connect, not a secret that lets
anyone forge a transfer message (the transfer generation and the peer checks do not depend
on it).

State: none per request. The accepted keys live in this process's environment
(:data:`ENV_PREPARED`, set by :func:`prepare`), read at each check; a server that never ran
:func:`prepare` (a bootstrap server started outside the launcher) refuses every write (fail
closed) and says why.

Failure policy (:mod:`sglang.pdsafe.policy`): a check that cannot run refuses the write (503:
not registered); a registering rank whose key cannot be read sends none (the server then
refuses it: the prefill never becomes reachable, which its startup reports).

A configured key (1 or 2) is also the cluster key that signs the KV control messages between
the legs (:mod:`sglang.pdsafe.control_mac`) and keys the decode's transfer generations
(:mod:`sglang.pdsafe.generation_key`): :func:`configured_keys` is the one place it is read.
What this does not cover: the Rust registry (``SGLANG_RUST_SERVER``).
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from collections.abc import Mapping
from typing import Any

from sglang.pdsafe import metrics, policy
from sglang.pdsafe.log_limit import LogLimit
from sglang.pdsafe.policy import Outcome, Refusal, hook
from sglang.pdsafe.protections import Protection, off_by, register, switch_on

logger = logging.getLogger("sglang.pdsafe.bootstrap_auth")

#: The operator's key (upstream's proposed name); ``new,old`` during a rotation.
ENV_TOKEN = "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN"
#: ``1``: refuse to start without a configured key (``ENV_TOKEN`` or ``--api-key``).
ENV_REQUIRE = "SGLANG_PDSAFE_REQUIRE_BOOTSTRAP_TOKEN"
#: Off switch (default on).
ENV_ENABLE = "SGLANG_PDSAFE_BOOTSTRAP_AUTH"
#: Set by :func:`prepare` in the launcher: the accepted keys (first one sent), inherited by
#: the schedulers. Internal: operators set :data:`ENV_TOKEN`.
ENV_PREPARED = "SGLANG_PDSAFE_BOOTSTRAP_KEYS"
UNAUTHORIZED = "bootstrap_unauthorized_total"
FAILED = "bootstrap_auth_failed_total"
UNAUTHORIZED_STATUS = 401
#: A refused write is logged at most this often (every one is counted).
LOG_INTERVAL_S = 10.0
SCHEME = "Bearer "

register(Protection(
    name="bootstrap-auth",
    guards="PUT /route and POST /register_dp_rank of the prefill's bootstrap server need the "
           "key (401 otherwise): nobody else can re-point a prefill rank's registration",
    roles=frozenset({"prefill"}),
    switched_off=off_by(ENV_ENABLE),
))


class BootstrapKeyError(policy.StartupRefusedError):
    """The server cannot start: its bootstrap key setting cannot work."""


def enabled() -> bool:
    return switch_on(ENV_ENABLE)


def _split(value: str | None) -> list[str]:
    return [k.strip() for k in (value or "").split(",") if k.strip()]


def configured_keys(server_args: Any) -> list[str]:
    """The keys the operator configured: :data:`ENV_TOKEN`'s, else ``--api-key`` (may be
    empty: the launcher then generates one)."""
    keys = _split(os.environ.get(ENV_TOKEN))
    if keys:
        return keys
    api_key = getattr(server_args, "api_key", None)
    return [str(api_key)] if api_key else []


def prepare(server_args: Any) -> str:
    """Launcher, before any scheduler exists (:func:`sglang.pdsafe.startup.launching`): put the
    accepted keys in this process's environment, where the bootstrap server (this process)
    and the schedulers (spawned from it) read them. Returns where the key comes from.

    Raises :class:`BootstrapKeyError` when the setting cannot work: a multi-node prefill
    without a configured key, or :data:`ENV_REQUIRE` without one."""
    if not enabled():
        os.environ.pop(ENV_PREPARED, None)
        return "off"
    keys = configured_keys(server_args)
    source = ENV_TOKEN if os.environ.get(ENV_TOKEN, "").strip() else "--api-key"
    if not keys:
        if os.environ.get(ENV_REQUIRE, "").strip().lower() in ("1", "true", "on", "yes"):
            raise BootstrapKeyError(
                f"pdsafe: {ENV_REQUIRE}=1 but no bootstrap key is configured. Set {ENV_TOKEN} "
                f"(the same value on every prefill node) or --api-key, or unset {ENV_REQUIRE} "
                f"to let each single-node prefill generate its own.")
        nnodes = int(getattr(server_args, "nnodes", 1) or 1)
        if nnodes > 1:
            raise BootstrapKeyError(
                f"pdsafe: this prefill runs on {nnodes} nodes, whose ranks register with the "
                f"bootstrap server of node 0, but no bootstrap key is configured, and a "
                f"per-server secret cannot be shared between nodes. Set {ENV_TOKEN} to the "
                f"same random value on every node (or pass the same --api-key), or turn the "
                f"check off with {ENV_ENABLE}=0 (every bootstrap write is then accepted).")
        keys = [os.environ.get(ENV_PREPARED, "").split(",")[0] or secrets.token_hex(32)]
        source = "a per-server secret"
    os.environ[ENV_PREPARED] = ",".join(keys)
    return source


def _server_start_failed(failure: policy.Failure) -> None:
    return None


@hook("bootstrap_auth.server_starting", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_server_start_failed,
      effect="no key is prepared: the bootstrap server refuses every write (401) and the "
             "prefill stays unreachable, which its log says")
def server_starting() -> None:
    """The bootstrap server is being set up (``CommonKVBootstrapServer._setup_routes``): a
    process that did not run :func:`prepare` (the smg gRPC servicer starts its bootstrap
    server, then its schedulers, without sglang's launcher) prepares the key here, so the
    schedulers it spawns next inherit it. Configured keys first, else a per-server secret."""
    if not enabled() or _accepted():
        return
    keys = _split(os.environ.get(ENV_TOKEN)) or [secrets.token_hex(32)]
    os.environ[ENV_PREPARED] = ",".join(keys)


def rank_starting(server_args: Any) -> None:
    """A prefill scheduler is starting (:func:`sglang.pdsafe.startup.scheduler_starting`): it
    must hold the key its registration sends. Inherited from the launcher or the bootstrap
    server's process, else a configured key; else the start is refused (a rank no key
    reached would be refused by the bootstrap server, and the prefill would never become
    reachable)."""
    if not enabled() or _accepted():
        return
    keys = configured_keys(server_args)
    if not keys:
        raise BootstrapKeyError(
            f"pdsafe: this prefill rank holds no bootstrap key: it was started without "
            f"sglang's launcher or bootstrap server in its parent process (another node of a "
            f"multi-node prefill, a Ray actor), so it cannot register with the bootstrap "
            f"server. Set {ENV_TOKEN} to the same random value on every prefill node (or pass "
            f"the same --api-key), or turn the check off with {ENV_ENABLE}=0.")
    os.environ[ENV_PREPARED] = ",".join(keys)


def _accepted() -> list[str]:
    return _split(os.environ.get(ENV_PREPARED))


def _send_failed(failure: policy.Failure) -> dict[str, str]:
    """The key could not be read: the registration goes without one (and is refused)."""
    return {}


@hook("bootstrap_auth.headers", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_send_failed,
      effect="the rank registers without the key and is refused (the prefill stays "
             "unreachable; its startup says so)")
def headers() -> dict[str, str]:
    """The header a prefill rank's bootstrap writes carry (none when the check is off)."""
    keys = _accepted()
    if not enabled() or not keys:
        return {}
    return {"Authorization": SCHEME + keys[0]}


_log_limit = LogLimit(LOG_INTERVAL_S)


def _log(what: str, peer: str, why: str) -> None:
    suppressed = _log_limit.admit()
    if suppressed is None:
        return
    logger.warning("pdsafe: refused %s from %s (401): %s. Only this prefill's own ranks may "
                   "register; if this was one, give every node the same %s. (%d similar "
                   "suppressed)", what, peer, why, ENV_TOKEN, suppressed)


def refusal_message(what: str) -> str:
    return (f"pdsafe: {what} on this bootstrap server needs the prefill's bootstrap key "
            f"('Authorization: Bearer <key>'); the request carried none or another. Prefill "
            f"ranks send it themselves; operators set {ENV_TOKEN} (or --api-key) to the same "
            f"value on every node.")


def _check_failed(failure: policy.Failure) -> Refusal:
    return failure.refusal(503, f"the bootstrap write ({failure.args[0]})")


@hook("bootstrap_auth.refuses_write", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_check_failed, key=lambda what, *a, **k: ("write", what),
      effect="the write is refused (503); nothing is registered")
def refuses_write(what: str, request_headers: Mapping[str, str], peer: Any = None
                  ) -> Refusal | None:
    """A bootstrap write (``what``: ``"PUT /route"``, ``"POST /register_dp_rank"``) arrived:
    None to let it through, else the refusal (401, counted in
    ``sglang:pdsafe_bootstrap_unauthorized_total``) the server answers with, before the body
    is read. Keys compare in constant time."""
    if not enabled():
        return None
    keys = _accepted()
    got = str(request_headers.get("Authorization", "") or "")
    if not keys:
        why = ("no key was prepared in this process (the bootstrap server runs outside "
               "sglang's launcher)")
    elif not got.startswith(SCHEME):
        why = "no bearer key"
    else:
        presented = got[len(SCHEME):].strip().encode()
        ok = False
        for k in keys:  # every key compared: the time does not say which one matched
            ok |= hmac.compare_digest(presented, k.encode())
        if ok:
            return None
        why = "a key this server does not accept"
    metrics.inc(UNAUTHORIZED)
    _log(what, str(peer or "?"), why)
    return Refusal(UNAUTHORIZED_STATUS, refusal_message(what), UNAUTHORIZED)
