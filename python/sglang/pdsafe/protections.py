"""Registry of the pdsafe protections, the PD-mode decision and the default-on switches.

Default-safe: every protection is on unless an explicit flag or environment variable turns it
off, and turning one off logs a warning at startup (:mod:`sglang.pdsafe.startup`). A
protection registers here with the PD roles it applies to, how to tell that an operator
switched it off (the setting they changed, named in the warning), and which other protection
it leans on (so that turning that one off warns that this one is weaker). The startup report
and ``/server_info`` read this registry.

This module is the bottom floor of the package: it imports nothing of pdsafe.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from sglang.srt.runtime_context import get_disagg

logger = logging.getLogger("sglang.pdsafe")

PDMode = Literal["prefill", "decode", "null"]
PD_MODES: tuple[PDMode, ...] = ("prefill", "decode", "null")
#: Roles a protection can apply to ("null": a co-located server).
BOTH: frozenset[str] = frozenset({"prefill", "decode"})
EVERY: frozenset[str] = frozenset({"prefill", "decode", "null"})

#: Values (case-insensitive, surrounding blanks ignored) that turn a default-on switch off.
OFF_VALUES = ("0", "false", "off", "no")


def _never(_args: Any) -> str | None:
    return None


@dataclass(frozen=True)
class Protection:
    """One protection.

    ``roles``: the PD roles it guards (a decode does not report a prefill protection).
    ``switched_off(args)``: the setting an operator changed to turn it off (``"VAR=0"``), or
    None while it is on. ``leans_on``: protections it relies on; when one of those is
    switched off, the report warns that this one is weaker (``weaker_without`` says how).
    """

    name: str
    guards: str
    roles: frozenset[str] = BOTH
    switched_off: Callable[[Any], str | None] = _never
    leans_on: tuple[str, ...] = ()
    weaker_without: str = ""


_REGISTRY: list[Protection] = []


def register(p: Protection) -> Protection:
    """Add a protection to the registry (idempotent by name)."""
    if all(x.name != p.name for x in _REGISTRY):
        _REGISTRY.append(p)
    return p


def registered() -> list[Protection]:
    return list(_REGISTRY)


def switch_on(env: str) -> bool:
    """A default-on switch (every protection's off switch, upstream's deferred release):
    False only when ``env`` is set to one of :data:`OFF_VALUES`; unset or anything else is on,
    so a typo never turns a protection off."""
    return os.environ.get(env, "1").strip().lower() not in OFF_VALUES


def positive_seconds(env: str, default: float, what: str) -> float:
    """The positive number of seconds ``env`` gives (``default`` when unset); raises
    ``ValueError`` naming ``env`` and ``what`` it sets for anything else. Cached per raw value
    (hot paths read it on every message)."""
    return _positive_seconds(env, os.environ.get(env, "").strip(), float(default), what)


@functools.lru_cache(maxsize=32)
def _positive_seconds(env: str, raw: str, default: float, what: str) -> float:
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError as e:
        raise ValueError(f"{env}={raw!r} is not a number of seconds; give e.g. "
                         f"{default:g}") from e
    if not value > 0:
        raise ValueError(f"{env}={raw!r} must be positive (seconds {what})")
    return value


def off_by(env: str) -> Callable[[Any], str | None]:
    """``switched_off`` for a protection turned off by ``env`` set to an off value."""

    def check(_args: Any) -> str | None:
        return None if switch_on(env) else f"{env}={os.environ.get(env, '').strip()}"

    return check


# --------------------------------------------------------------------------- PD mode
#
# The one place that decides whether this process is one side of a PD pair. Every guard asks
# here; nothing else in sglang.pdsafe reads ``disaggregation_mode`` itself. It fails closed:
# a mode it cannot read (no server arguments, no attribute, a value that is not one of
# upstream's three modes) raises :class:`PDModeUnknownError` instead of being taken for "not
# PD", because "not PD" switches protections off (the one-token stub came back that way).


class PDModeUnknownError(RuntimeError):
    """The disaggregation mode of this process could not be determined."""


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
    roles=frozenset({"decode"}),
))


def applies(p: Protection, server_args: Any) -> bool:
    """Whether ``p`` guards a server of this role (fails closed: an unknown mode raises)."""
    return pd_mode(server_args) in p.roles


def status(server_args: Any) -> dict[str, bool]:
    """Map protection name -> active, for the protections that apply to this server's role
    (a protection of the other role is not listed: it is not "off" here, it does not apply)."""
    return {p.name: p.switched_off(server_args) is None
            for p in _REGISTRY if applies(p, server_args)}
