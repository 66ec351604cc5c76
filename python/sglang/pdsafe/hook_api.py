"""The named hook API between the patched upstream code and pdsafe: declarations and self-check.

pdsafe calls back into upstream only through public methods or the small named ``pdsafe_*``
methods that a patch adds to upstream's common classes. When upstream changed shape (a rebase
renamed a method, changed a signature, moved a module), that must show before traffic, not as
an ordinary hook failure: each module declares at import what it calls upstream
(:func:`require`), and :func:`self_check`, run at startup by every entry point
(:mod:`sglang.pdsafe.startup`), imports every declared target and refuses to start a PD server
when any declared member is missing (:class:`HookAPIError`, listing every missing member and
why pdsafe needs it). At run time, :func:`is_mismatch` tells the failure policy
(:mod:`sglang.pdsafe.policy`) that a hook failed because of such a change: it is counted in
``hook_api_mismatch_total`` and logged with the remedy, never as an ordinary failure.

Invariant: a mismatch between this build's patches and the installed upstream is reported as
such (its own counter and an ERROR naming the hook at run time, a refused start in PD mode).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sglang.pdsafe.protections import is_pd

logger = logging.getLogger("sglang.pdsafe.hook_api")

MISMATCH_COUNTER = "hook_api_mismatch_total"
REMEDY = ("this sglang-pdsafe build's patches do not match the installed upstream; reinstall "
          "the fork wheel (or rebuild it from the release matching the installed upstream)")

#: A TypeError with one of these messages comes from calling with the wrong signature (an
#: upstream method whose parameters changed); any other TypeError is an ordinary failure.
_SIGNATURE_ERROR = re.compile(
    r"(positional argument|keyword argument|required (positional|keyword)|takes \d+|"
    r"takes (no|exactly|at (most|least))|got multiple values|missing \d+ required)")


class HookAPIError(RuntimeError):
    """The installed upstream lacks a member a pdsafe hook calls (PD server refuses to start)."""


def is_mismatch(exc: BaseException) -> bool:
    """Whether ``exc`` means upstream's shape differs from what the patches were written for."""
    if isinstance(exc, (AttributeError, ImportError, NameError)):
        return True
    return isinstance(exc, TypeError) and bool(_SIGNATURE_ERROR.search(str(exc)))


# =========================================================================== required API


@dataclass(frozen=True)
class Requirement:
    """``target`` must have every attr in ``attrs``; ``why`` says which pdsafe code needs it.

    An attr written ``name(p1, p2)`` must be callable with those positional parameters (after
    ``self`` for a class); ``name()`` must be callable; a bare ``name`` must merely exist.
    """

    target: str
    attrs: tuple[str, ...]
    why: str
    declared_by: str


_requirements: list[Requirement] = []
_req_lock = threading.Lock()
_ATTR_SPEC = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:\((.*)\))?\s*$")


def require(target: str, *attrs: str, why: str) -> Requirement:
    """Declare (at import) that pdsafe calls ``target.attr`` for each attr.

    ``target`` is a dotted path to a module or to an object in it, e.g.
    ``sglang.srt.disaggregation.common.conn.CommonKVManager``.
    """
    for a in attrs:
        if not _ATTR_SPEC.match(a):
            raise ValueError(f"bad attribute spec {a!r} for {target}")
    caller = inspect.currentframe()
    module = caller.f_back.f_globals.get("__name__", "?") if caller and caller.f_back else "?"
    req = Requirement(target, tuple(attrs), why, module)
    with _req_lock:
        if req not in _requirements:
            _requirements.append(req)
    return req


def requirements() -> list[Requirement]:
    with _req_lock:
        return list(_requirements)


def _resolve(target: str) -> Any:
    """Import the module part of ``target`` (only it) and walk the rest as attributes."""
    parts = target.split(".")
    obj: Any = importlib.import_module(parts[0])
    path = parts[0]
    for part in parts[1:]:
        path = f"{path}.{part}"
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif inspect.ismodule(obj):
            obj = importlib.import_module(path)  # a submodule not imported by its parent
        else:
            raise AttributeError(f"{path.rpartition('.')[0]} has no attribute {part!r}")
    return obj


def _check_attr(obj: Any, spec: str) -> str | None:
    """None when ``obj`` satisfies ``spec``, else what is wrong."""
    m = _ATTR_SPEC.match(spec)
    assert m is not None
    name, params = m.group(1), m.group(2)
    if not hasattr(obj, name):
        return "missing"
    if params is None:
        return None
    member = getattr(obj, name)
    if not callable(member):
        return f"not callable ({type(member).__name__})"
    names = [p.strip() for p in params.split(",") if p.strip()]
    try:
        sig = inspect.signature(member)
    except (TypeError, ValueError):
        return None  # a builtin without a signature: callable is all we can check
    args: list[Any] = list(names)
    if inspect.isclass(obj) and not isinstance(inspect.getattr_static(obj, name),
                                                 (staticmethod, classmethod)):
        args.insert(0, None)  # self
    try:
        sig.bind(*args)
    except TypeError as e:
        return f"signature {name}{sig} does not take ({', '.join(names)}): {e}"
    return None


def missing(reqs: Iterable[Requirement] | None = None) -> list[str]:
    """One line per declared member the installed upstream lacks (empty when all exist)."""
    out: list[str] = []
    for req in requirements() if reqs is None else reqs:
        try:
            obj = _resolve(req.target)
        except Exception as e:  # noqa: BLE001 - any import failure is a missing target
            out.append(f"{req.target} (cannot import: {type(e).__name__}: {e}) - needed by "
                       f"{req.declared_by}: {req.why}")
            continue
        for spec in req.attrs:
            problem = _check_attr(obj, spec)
            if problem is not None:
                out.append(f"{req.target}.{spec} ({problem}) - needed by {req.declared_by}: "
                           f"{req.why}")
    return out


def _pd_mode(server_args: Any) -> bool:
    """Whether the check runs: in PD mode, and when the mode cannot be read (fail closed)."""
    try:
        return is_pd(server_args)
    except Exception:  # noqa: BLE001 - unknown mode: check, as for PD
        return True


def self_check(server_args: Any, reqs: Iterable[Requirement] | None = None,
               modules: Iterable[str] = ()) -> None:
    """In PD mode, prove every member pdsafe's hooks call exists in the installed upstream.

    Imports ``modules`` (the declaring pdsafe modules) and the modules named by their
    targets (nothing else), and raises :class:`HookAPIError` listing every missing member,
    why it is needed, and the remedy. A non-PD server is not checked (no PD hook runs there);
    a server whose mode cannot be read is checked. ``reqs`` replaces the declared
    requirements (tests).
    """
    if not _pd_mode(server_args):
        return
    t0 = time.monotonic()
    if reqs is None:
        for mod in modules:
            importlib.import_module(mod)
        reqs = requirements()
    reqs = list(reqs)
    problems = missing(reqs)
    if problems:
        raise HookAPIError(
            "pdsafe: the installed upstream lacks members that this build's hooks call:\n  "
            + "\n  ".join(problems) + f"\nRemedy: {REMEDY}.")
    logger.info("pdsafe hook API self-check: %d requirements present (%.0f ms)",
                len(reqs), 1000 * (time.monotonic() - t0))
