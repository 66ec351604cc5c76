"""The secret that keys a decode's transfer generations, so nobody without it can predict one.

A decode mints a generation for each reservation (:func:`sglang.pdsafe.transfer_generation.derive`)
and drops every message of the room that does not carry exactly that generation; the prefill
only echoes what it received. Unkeyed, the generation is a hash of inputs a network attacker can
guess (room, metadata slot, page ids, page epochs), so a forged KV status, aux frame, CHUNK_READY
or ABORT could carry the right one (issue 21, item 2). Keyed, it is a BLAKE2b MAC under a secret
only the decode's own processes hold: a forger must observe the generation on the wire (a
message of that very reservation), not compute it.

Only the decode that minted a generation checks it, so the key never has to leave the decode.
The decode's ranks of one room must mint the same generation (the prefill refuses a split), so
every rank of one decode server uses one key:

* **single-node decode** (the launcher runs on the node): the launcher draws a random secret
  and a random incarnation nonce before any scheduler exists and derives the key from both;
  its schedulers inherit it (``SGLANG_PDSAFE_GENERATION_KEY``, internal: set by the server, never
  by an operator). A restarted decode has a new key, so a message recorded before a restart never
  matches a generation minted after it;
* **multi-node decode, Ray actors, the smg gRPC servicer** (no launcher that all ranks descend
  from): the key is derived from the cluster key, ``SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN``
  (first value) or ``--api-key``, the same on every node; without an incarnation nonce (the nodes
  cannot agree on one without talking), so restarts are told apart by the page epochs only;
* neither: the generations are **unkeyed** (guessable as before, still stopping stale and replayed
  messages), which the scheduler logs as a WARNING at start and exports as the gauge
  ``sglang:pdsafe_transfer_generation_unkeyed`` = 1. ``SGLANG_PDSAFE_REQUIRE_GENERATION_KEY=1``
  makes that a startup error.

What it does not do: sign the messages. Someone who observes a reservation's generation on the
network (the decode's metadata goes in clear over ZMQ) could forge that reservation's messages;
the per-message MAC under the cluster key both legs share (:mod:`sglang.pdsafe.control_mac`)
stops that where a cluster key is configured.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import secrets
from typing import Any

from sglang.pdsafe import bootstrap_auth, metrics, policy

logger = logging.getLogger("sglang.pdsafe.generation_key")

ENV_KEY = "SGLANG_PDSAFE_GENERATION_KEY"
ENV_REQUIRE = "SGLANG_PDSAFE_REQUIRE_GENERATION_KEY"
GAUGE = "transfer_generation_unkeyed"
_LABEL = b"sglang-pdsafe transfer generation key v1\0"
#: BLAKE2b accepts keys of up to 64 bytes; ours are SHA-256 HMACs (32 bytes).
KEY_BYTES = 32


class GenerationKeyError(policy.StartupRefusedError):
    """The generation key cannot be set up as configured (the server refuses to start)."""


def _derive(base: bytes, nonce: bytes = b"") -> bytes:
    return hmac.new(base, _LABEL + nonce, hashlib.sha256).digest()


def _nnodes(server_args: Any) -> int:
    return int(getattr(server_args, "nnodes", 1) or 1)


def _required() -> bool:
    return os.environ.get(ENV_REQUIRE, "").strip().lower() in ("1", "true", "on", "yes")


def prepare(server_args: Any) -> str:
    """Launcher of a decode, before any scheduler exists: put the key its schedulers inherit in
    this process's environment. Returns where it comes from (for the startup log)."""
    keys = bootstrap_auth.configured_keys(server_args)
    if _nnodes(server_args) > 1:
        # Every node's launcher would draw its own secret: the ranks must derive it instead.
        os.environ.pop(ENV_KEY, None)
        return "the cluster key (every node)" if keys else "none (unkeyed: no cluster key)"
    base = keys[0].encode("utf-8") if keys else secrets.token_bytes(KEY_BYTES)
    os.environ[ENV_KEY] = _derive(base, secrets.token_bytes(16)).hex()
    return ("the cluster key and this server's incarnation nonce" if keys
            else "a per-server secret and incarnation nonce")


def rank_starting(server_args: Any) -> bytes:
    """A decode scheduler is starting: the key it mints with (b"": unkeyed, logged and
    exported). Inherited from the launcher, else derived from the cluster key; else unkeyed,
    or a :class:`GenerationKeyError` when :data:`ENV_REQUIRE` asks for a key."""
    key = current()
    if not key:
        keys = bootstrap_auth.configured_keys(server_args)
        if keys:
            key = _derive(keys[0].encode("utf-8"))
            os.environ[ENV_KEY] = key.hex()
    if not key and _required():
        raise GenerationKeyError(
            f"pdsafe: {ENV_REQUIRE}=1 but this decode rank has no key for its transfer "
            f"generations: it was started without sglang's launcher in its parent process "
            f"(another node of a multi-node decode, a Ray actor, the smg gRPC servicer) and no "
            f"cluster key is configured. Set {bootstrap_auth.ENV_TOKEN} (or --api-key) to the "
            f"same random value on every node of the decode.")
    if not key:
        logger.warning(
            "pdsafe: this decode's transfer generations are UNKEYED: no launcher prepared a "
            "key and no cluster key is configured (%s or --api-key). They still stop stale and "
            "replayed control messages, but someone who can reach this decode's KV control "
            "port and guess a reservation (room, metadata slot, pages) can forge its messages. "
            "Set %s to the same random value on every node of the decode.",
            bootstrap_auth.ENV_TOKEN, bootstrap_auth.ENV_TOKEN)
    metrics.set_gauge(GAUGE, 0 if key else 1)
    return key


def current() -> bytes:
    """The key this process mints generations with (b"": none prepared, unkeyed)."""
    return _key_of(os.environ.get(ENV_KEY, "").strip())


@functools.lru_cache(maxsize=4)
def _key_of(raw: str) -> bytes:
    """The key ``raw`` (hex) names; cached: every reservation's mint reads it."""
    if not raw:
        return b""
    try:
        key = bytes.fromhex(raw)
    except ValueError:
        return b""
    return key[:64]
