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

**Signed writes, not a bearer key.** The key never travels. A rank signs each write: the
``Authorization`` header is ``PDSAFE-HMAC1 ts=<unix seconds>,nonce=<32 hex>,mac=<64 hex>``,
where ``mac`` is HMAC-SHA256, under a key derived from the bootstrap key (:func:`_write_key`),
of the endpoint (``PUT /route``), the time, the nonce and the SHA-256 of the body. The server
checks the MAC under every key it accepts (constant time), then freshness: the time within
:data:`FRESH_S` of its own clock and the nonce not seen before in that window (a bounded
cache: at most :data:`NONCE_LIMIT` nonces; a full cache refuses, fail closed). So a party that
sees the traffic on the cluster network learns no key (upstream's open fix, #39416, sends a
bearer token in clear: a sniffer of one registration would hold the key that also signs the
KV control messages), cannot re-point a rank with a changed body, and cannot replay a
captured registration (``sglang:pdsafe_bootstrap_stale_write_total``). A bearer header is
refused like a missing key. The nodes of a multi-node prefill need clocks within
:data:`FRESH_S` seconds of each other (NTP).

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

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import threading
import time
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
STALE = "bootstrap_stale_write_total"
FAILED = "bootstrap_auth_failed_total"
UNAUTHORIZED_STATUS = 401
#: A refused write is logged at most this often (every one is counted).
LOG_INTERVAL_S = 10.0
SCHEME = "PDSAFE-HMAC1 "
#: A signed write is fresh when its time is within this many seconds of the server's clock.
FRESH_S = 30.0
#: Nonces remembered (those of the last ``2 * FRESH_S`` seconds); a full cache refuses.
NONCE_LIMIT = 1 << 17
_LABEL = b"sglang-pdsafe bootstrap write 1"
_HEADER = re.compile(r"^ts=(\d{1,12}),nonce=([0-9a-f]{32}),mac=([0-9a-f]{64})$")

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


def _write_key(key: str) -> bytes:
    """The key that signs bootstrap writes, derived from a bootstrap key (never sent)."""
    return hmac.new(key.encode("utf-8"), _LABEL, hashlib.sha256).digest()


def _mac(key: bytes, what: str, ts: int, nonce: str, body: bytes) -> bytes:
    msg = f"{what}\n{ts}\n{nonce}\n".encode() + hashlib.sha256(body).digest()
    return hmac.new(key, msg, hashlib.sha256).digest()


def headers(what: str, body: bytes, *, now: float | None = None) -> dict[str, str]:
    """The ``Authorization`` header of the write ``what`` (``"PUT /route"``) with ``body``:
    signed with the first accepted key, fresh (this time, a new nonce); none when the check
    is off or no key is prepared (the server then refuses the write)."""
    keys = _accepted()
    if not enabled() or not keys:
        return {}
    ts = int(time.time() if now is None else now)
    nonce = secrets.token_hex(16)
    mac = _mac(_write_key(keys[0]), what, ts, nonce, body).hex()
    return {"Authorization": f"{SCHEME}ts={ts},nonce={nonce},mac={mac}"}


def _send_failed(failure: policy.Failure) -> dict[str, Any]:
    """The key could not be read: the registration goes unsigned (and is refused)."""
    return {"json": failure.args[1]}


@hook("bootstrap_auth.signed_write", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_send_failed,
      effect="the rank registers unsigned and is refused (the prefill stays unreachable; "
             "its startup says so)")
def signed_write(what: str, payload: Any) -> dict[str, Any]:
    """The ``requests`` arguments of a prefill rank's bootstrap write ``what`` with the JSON
    ``payload`` (``_register_topology_row``, ``_register_prefill_dp_rank``): the body, and
    its signature (:func:`headers`), so the server checks exactly the bytes it reads."""
    body = json.dumps(payload).encode()
    return {"data": body,
            "headers": {"Content-Type": "application/json", **headers(what, body)}}


class _Nonces:
    """The nonces of accepted signed writes of the last ``2 * FRESH_S`` seconds, bounded.

    Invariant: a nonce is accepted at most once while its write could be fresh; when the
    cache is full of fresh nonces a write is refused rather than a nonce forgotten."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, float] = {}

    def first_use(self, nonce: str, now: float) -> bool | None:
        """True: new (now remembered); False: a replay; None: the cache is full."""
        with self._lock:
            if nonce in self._seen:
                return False
            if len(self._seen) >= NONCE_LIMIT:
                horizon = now - 2 * FRESH_S
                self._seen = {n: t for n, t in self._seen.items() if t >= horizon}
                if len(self._seen) >= NONCE_LIMIT:
                    return None
            self._seen[nonce] = now
            return True


_nonces = _Nonces()


def _signature_problem(got: str, what: str, body: bytes, keys: list[str],
                       now: float) -> tuple[str, str] | None:
    """None when ``got`` is a fresh, first-used signature of ``what`` and ``body`` under one
    of ``keys``; else ``(counter, why)``."""
    if not got.startswith(SCHEME):
        return UNAUTHORIZED, ("a bearer key (this release signs its writes; a bearer key would "
                              "travel in clear)" if got.startswith("Bearer ")
                              else "no signed key")
    m = _HEADER.match(got[len(SCHEME):].strip())
    if m is None:
        return UNAUTHORIZED, "a malformed signature"
    ts, nonce, mac = int(m.group(1)), m.group(2), bytes.fromhex(m.group(3))
    ok = False
    for k in keys:  # every key compared: the time does not say which one matched
        ok |= hmac.compare_digest(mac, _mac(_write_key(k), what, ts, nonce, body))
    if not ok:
        return UNAUTHORIZED, "a key this server does not accept"
    if abs(now - ts) > FRESH_S:
        return STALE, (f"a signature {now - ts:+.0f} s old (fresh: within {FRESH_S:.0f} s; "
                       "a replay, or this node's clock is off)")
    first = _nonces.first_use(nonce, now)
    if first is None:
        return STALE, f"more than {NONCE_LIMIT} signed writes in {2 * FRESH_S:.0f} s"
    if not first:
        return STALE, "a replayed signature (its nonce was used before)"
    return None


_log_limit = LogLimit(LOG_INTERVAL_S)


def _log(what: str, peer: str, why: str) -> None:
    suppressed = _log_limit.admit()
    if suppressed is None:
        return
    logger.warning("pdsafe: refused %s from %s (401): %s. Only this prefill's own ranks may "
                   "register; if this was one, give every node the same %s. (%d similar "
                   "suppressed)", what, peer, why, ENV_TOKEN, suppressed)


def refusal_message(what: str) -> str:
    return (f"pdsafe: {what} on this bootstrap server needs a fresh write signed with the "
            f"prefill's bootstrap key ('Authorization: {SCHEME.strip()} ...'); the request "
            f"carried none, another key, or an old or replayed signature. Prefill ranks sign "
            f"their own writes; operators set {ENV_TOKEN} (or --api-key) to the same value on "
            f"every node and keep the nodes' clocks in sync.")


def _check_failed(failure: policy.Failure) -> Refusal:
    return failure.refusal(503, f"the bootstrap write ({failure.args[0]})")


@hook("bootstrap_auth.refuses_write", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_check_failed, key=lambda what, *a, **k: ("write", what),
      effect="the write is refused (503); nothing is registered")
def refuses_write(what: str, request_headers: Mapping[str, str], peer: Any = None,
                  body: bytes = b"") -> Refusal | None:
    """A bootstrap write (``what``: ``"PUT /route"``, ``"POST /register_dp_rank"``) with
    ``body`` arrived: None to let it through (signed under an accepted key, over exactly this
    endpoint and body, fresh, its nonce unused), else the refusal (401) the server answers
    with before it parses the body, counted in ``sglang:pdsafe_bootstrap_unauthorized_total``
    (no key, another key, a bearer key, a malformed header) or
    ``sglang:pdsafe_bootstrap_stale_write_total`` (a valid signature too old, replayed, or
    over the nonce cache)."""
    if not enabled():
        return None
    keys = _accepted()
    got = str(request_headers.get("Authorization", "") or "")
    if not keys:
        problem: tuple[str, str] | None = (
            UNAUTHORIZED, "no key was prepared in this process (the bootstrap server runs "
                          "outside sglang's launcher)")
    else:
        problem = _signature_problem(got, what, bytes(body), keys, time.time())
    if problem is None:
        return None
    counter, why = problem
    metrics.inc(counter)
    _log(what, str(peer or "?"), why)
    return Refusal(UNAUTHORIZED_STATUS, refusal_message(what), counter)
