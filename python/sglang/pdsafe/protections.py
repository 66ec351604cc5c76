"""Registry of the pdsafe protections and the startup report of which are active.

Default-safe: every protection is on unless an explicit flag or environment variable turns it
off, and turning one off logs a warning at startup. New protections register here so the
startup log (and /server_info) always tells an operator exactly what guards this process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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


def is_pd(server_args: Any) -> bool:
    """Whether ``server_args`` describe one side of a PD pair (prefill or decode)."""
    return getattr(server_args, "disaggregation_mode", "null") in ("prefill", "decode")


register(Protection(
    name="decode-commit-gate",
    guards="decode checks every finished transfer before its pages become a request's KV",
    is_active=is_pd,
))


def status(server_args: Any) -> dict[str, bool]:
    """Map protection name -> active, for this server's arguments."""
    return {p.name: bool(p.is_active(server_args)) for p in _REGISTRY}


def log_startup(server_args: Any) -> dict[str, bool]:
    """Log which protections are active (warning for each one explicitly turned off)."""
    from sglang.pdsafe import test_faults
    from sglang.pdsafe.version import version_string

    st = status(server_args)
    on = [n for n, a in st.items() if a]
    logger.info("%s: protections active: %s", version_string(), ", ".join(on) or "none")
    for p in _REGISTRY:
        if not st[p.name] and p.disabled_by and is_pd(server_args):
            logger.warning(
                "pdsafe protection %r is OFF (%s). It guards: %s.", p.name, p.disabled_by,
                p.guards,
            )
    if test_faults.armed_foreign_kv():
        logger.warning("pdsafe test faults are armed in this process (%s)", test_faults.ENV)
    return st
