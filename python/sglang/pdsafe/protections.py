"""Registry of the pdsafe protections and the startup report of which are active.

Default-safe: every protection is on unless an explicit flag or environment variable turns it
off, and turning one off logs a warning at startup. New protections register here so the
startup log (and /server_info) always tells an operator exactly what guards this process.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

logger = logging.getLogger("sglang.pdsafe")


@dataclass(frozen=True)
class Protection:
    """One protection: its name, what it guards, and how to tell whether it is active."""

    name: str
    guards: str
    is_active: Callable[[Any], bool]
    disabled_by: str = ""  # the explicit flag/env that turns it off ("" = cannot be turned off)


_REGISTRY: list[Protection] = []


def register(p: Protection) -> Protection:
    """Add a protection to the registry (idempotent by name)."""
    if all(x.name != p.name for x in _REGISTRY):
        _REGISTRY.append(p)
    return p


def registered() -> list[Protection]:
    return list(_REGISTRY)


# --------------------------------------------------------------------------- PD mode
#
# The one place that decides whether this process is one side of a PD pair. Every guard asks
# here; nothing else in sglang.pdsafe reads ``disaggregation_mode`` itself. It fails closed:
# a mode it cannot read (no server arguments, no attribute, a value that is not one of
# upstream's three modes) raises :class:`PDModeUnknownError` instead of being taken for "not
# PD", because "not PD" switches protections off (the one-token stub came back that way).
# A call site that must not raise decides the safe side itself and documents it (e.g.
# ``placeholder_guard.record_rejection``: unknown = PD = never rewrite the prompt).

PDMode = Literal["prefill", "decode", "null"]
PD_MODES: tuple[PDMode, ...] = ("prefill", "decode", "null")


class PDModeUnknownError(RuntimeError):
    """The disaggregation mode of this process could not be determined."""


#: Values (case-insensitive, surrounding blanks ignored) that turn a default-on switch off.
OFF_VALUES = ("0", "false", "off", "no")


def switch_on(env: str) -> bool:
    """A default-on switch (every protection's off switch, upstream's deferred release):
    False only when ``env`` is set to one of :data:`OFF_VALUES`; unset or anything else is on,
    so a typo never turns a protection off."""
    return os.environ.get(env, "1").strip().lower() not in OFF_VALUES


def pd_mode(server_args: Any) -> PDMode:
    """``server_args.disaggregation_mode`` as one of ``"prefill"``, ``"decode"``, ``"null"``.

    Accepts upstream's ``ServerArgs``, the published ``get_disagg()`` namespace, or anything
    else carrying ``disaggregation_mode`` as a string or as upstream's ``DisaggregationMode``
    enum. Raises :class:`PDModeUnknownError` (never guesses "null") when the attribute is
    missing or its value is not one of the three modes.
    """
    if server_args is None:
        raise PDModeUnknownError("pdsafe: no server arguments, so the PD mode is unknown")
    try:
        raw = server_args.disaggregation_mode
    except AttributeError as e:
        raise PDModeUnknownError(
            f"pdsafe: {type(server_args).__name__} has no disaggregation_mode, so the PD mode "
            "is unknown"
        ) from e
    value = getattr(raw, "value", raw)  # DisaggregationMode enum -> its string value
    mode = value.strip().lower() if isinstance(value, str) else None
    if mode not in PD_MODES:
        raise PDModeUnknownError(
            f"pdsafe: disaggregation_mode={raw!r} is none of {', '.join(PD_MODES)}, so the PD "
            "mode is unknown"
        )
    return mode  # type: ignore[return-value]  # narrowed by the membership test above


def is_pd(server_args: Any) -> bool:
    """Whether ``server_args`` describe one side of a PD pair (prefill or decode).

    Raises :class:`PDModeUnknownError` when the mode cannot be read (see :func:`pd_mode`).
    """
    return pd_mode(server_args) != "null"


def process_pd_mode() -> PDMode:
    """The PD mode of this process, for hooks that have no server arguments at hand.

    Reads upstream's published runtime context (``sglang.srt.runtime_context.get_disagg()``,
    set by ``publish()`` in every server process before it builds requests). Raises
    :class:`PDModeUnknownError` when nothing was published in this process.
    """
    from sglang.srt.runtime_context import get_disagg

    try:
        disagg = get_disagg()
    except ValueError as e:  # "config namespace 'disagg' not published"
        raise PDModeUnknownError(
            f"pdsafe: the runtime context of this process is not published ({e}), so the PD "
            "mode is unknown"
        ) from e
    return pd_mode(disagg)


register(Protection(
    name="decode-commit-gate",
    guards="decode checks every finished transfer before its pages become a request's KV",
    is_active=is_pd,
))


def status(server_args: Any) -> dict[str, bool]:
    """Map protection name -> active, for this server's arguments."""
    return {p.name: bool(p.is_active(server_args)) for p in _REGISTRY}


#: The modules whose hooks the patch series calls. Each registers its protections and declares
#: the upstream API it needs (``hook_api.require``) at import; the startup hook imports them all,
#: because the patched call sites import them lazily, at first use.
HOOK_MODULES: tuple[str, ...] = (
    "sglang.pdsafe.admission",
    "sglang.pdsafe.client_guard",
    "sglang.pdsafe.placeholder_guard",
    "sglang.pdsafe.coverage",
    "sglang.pdsafe.commit_gate",
    "sglang.pdsafe.peer_release",
    "sglang.pdsafe.peer_release_wire",
    "sglang.pdsafe.peer_notifier",
    "sglang.pdsafe.limits",
    "sglang.pdsafe.pair_agreement",
    "sglang.pdsafe.room_guard",
    "sglang.pdsafe.quarantine",
    "sglang.pdsafe.write_fence",
    "sglang.pdsafe.peer_policy",
    "sglang.pdsafe.peer_capability",
    "sglang.pdsafe.kv_integrity",
    "sglang.pdsafe.source_lease",
    "sglang.pdsafe.page_generation",
    "sglang.pdsafe.transfer_generation",
)


def log_startup(server_args: Any) -> dict[str, bool]:
    """The startup hook (launch_server): self-check the hook API, then report the protections.

    In PD mode, raises ``hook_api.HookAPIError`` (the server refuses to start) when an upstream
    method that a pdsafe hook calls is missing; otherwise logs which protections are active and
    warns for each one explicitly turned off.
    """
    import importlib

    from sglang.pdsafe import hook_api
    from sglang.pdsafe.version import version_string

    for name in HOOK_MODULES:  # registers every protection (and its hook-API needs)
        importlib.import_module(name)
    hook_api.self_check(server_args)
    st = status(server_args)
    on = [n for n, a in st.items() if a]
    logger.info("%s: protections active: %s", version_string(), ", ".join(on) or "none")
    for p in _REGISTRY:
        if not st[p.name] and p.disabled_by and is_pd(server_args):
            logger.warning(
                "pdsafe protection %r is OFF (%s). It guards: %s.", p.name, p.disabled_by,
                p.guards,
            )
    return st
