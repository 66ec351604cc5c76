"""The named hook API between the patched upstream code and pdsafe: the guard and the self-check.

Upstream calls pdsafe at a few hook sites (its scheduler loop, KV control threads, exception
handlers), and pdsafe calls back into upstream only through public methods or the small named
``pdsafe_*`` methods that a patch adds to upstream's common classes. Two things can go wrong:

* **A bug or a failure inside a hook.** A hook must never take its caller down or replace the
  error the caller is handling. :func:`guarded` wraps every function upstream calls: it logs the
  exception with its traceback, increments the hook's own failure counter, and returns the
  hook's ``default`` (upstream's behaviour without pdsafe).
* **Upstream changed shape** (a rebase renamed a method, changed a signature, moved a module):
  that is not an ordinary failure, and it must not hide in the failure counter. :func:`guarded`
  counts ``AttributeError``, ``ImportError``/``NameError`` and signature ``TypeError``\\ s in
  ``hook_api_mismatch_total`` and logs an ERROR naming the hook. To catch it before traffic,
  each module declares at import what it calls upstream (:func:`require`), and
  :func:`self_check`, run from the server's startup hook, imports every declared target and
  refuses to start a PD server when any declared member is missing (:class:`HookAPIError`,
  listing every missing member and why pdsafe needs it).

Invariant: a hook failure never propagates into upstream; a mismatch between this build's
patches and the installed upstream is reported as such (its own counter and an ERROR naming
the hook at run time, a refused start in PD mode), never as an ordinary failure.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from sglang.pdsafe import metrics
from sglang.pdsafe.protections import HOOK_MODULES, is_pd

logger = logging.getLogger("sglang.pdsafe.hook_api")

MISMATCH_COUNTER = "hook_api_mismatch_total"
REMEDY = ("this sglang-pdsafe build's patches do not match the installed upstream; reinstall "
          "the fork wheel (or rebuild it from the release matching the installed upstream)")

#: pdsafe modules that declare upstream requirements; self_check imports them first so their
#: declarations are in the registry even if nothing imported them yet in this process.
DECLARING_MODULES: tuple[str, ...] = HOOK_MODULES  # every module a patch hooks into

#: A TypeError with one of these messages comes from calling with the wrong signature (an
#: upstream method whose parameters changed); any other TypeError is an ordinary failure.
_SIGNATURE_ERROR = re.compile(
    r"(positional argument|keyword argument|required (positional|keyword)|takes \d+|"
    r"takes (no|exactly|at (most|least))|got multiple values|missing \d+ required)")

#: Log a repeated failure of the same hook at most this often (the counters count every one).
LOG_INTERVAL_S = 10.0

F = TypeVar("F", bound=Callable[..., Any])


class HookAPIError(RuntimeError):
    """The installed upstream lacks a member a pdsafe hook calls (PD server refuses to start)."""


def is_mismatch(exc: BaseException) -> bool:
    """Whether ``exc`` means upstream's shape differs from what the patches were written for."""
    if isinstance(exc, (AttributeError, ImportError, NameError)):
        return True
    return isinstance(exc, TypeError) and bool(_SIGNATURE_ERROR.search(str(exc)))


_log_lock = threading.Lock()
_last_logged: dict[tuple[str, bool], tuple[float, int]] = {}


def _should_log(hook_name: str, mismatch: bool) -> tuple[bool, int]:
    """Rate-limit logs per hook and kind: (log now, how many were suppressed since)."""
    now = time.monotonic()
    key = (hook_name, mismatch)
    with _log_lock:
        last, suppressed = _last_logged.get(key, (float("-inf"), 0))
        if now - last >= LOG_INTERVAL_S:
            _last_logged[key] = (now, 0)
            return True, suppressed
        _last_logged[key] = (last, suppressed + 1)
        return False, suppressed + 1


def guarded(hook_name: str, failure_counter: str, default: Any) -> Callable[[F], F]:
    """Decorate a function that upstream calls: it never raises into upstream.

    An exception that means upstream changed shape (see :func:`is_mismatch`) increments
    ``hook_api_mismatch_total`` and logs an ERROR naming ``hook_name``; any other exception
    increments ``failure_counter`` and logs it with its traceback. Both return ``default``.
    """
    if failure_counter not in metrics.COUNTERS:
        raise KeyError(f"undeclared pdsafe counter {failure_counter!r} for hook {hook_name}")

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - the guard's whole purpose
                mismatch = is_mismatch(e)
                metrics.inc(MISMATCH_COUNTER if mismatch else failure_counter)
                log, suppressed = _should_log(hook_name, mismatch)
                if log and mismatch:
                    logger.error(
                        "pdsafe hook %s: upstream API mismatch (%s: %s); the hook did nothing "
                        "and upstream's behaviour applies. %s. (%d similar suppressed)",
                        hook_name, type(e).__name__, e, REMEDY, suppressed, exc_info=True)
                elif log:
                    logger.error(
                        "pdsafe hook %s failed (%s: %s); upstream's behaviour applies "
                        "(counted in %s%s). (%d similar suppressed)", hook_name,
                        type(e).__name__, e, metrics.PREFIX, failure_counter, suppressed,
                        exc_info=True)
                return default

        inner.__pdsafe_hook__ = hook_name  # type: ignore[attr-defined]
        return inner  # type: ignore[return-value]

    return wrap


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


def self_check(server_args: Any, reqs: Iterable[Requirement] | None = None) -> None:
    """In PD mode, prove every member pdsafe's hooks call exists in the installed upstream.

    Imports the declaring pdsafe modules and the modules named by their targets (nothing
    else), and raises :class:`HookAPIError` listing every missing member, why it is needed,
    and the remedy. A non-PD server is not checked (no PD hook runs there); a server whose
    mode cannot be read is checked. ``reqs`` replaces the declared requirements (tests).
    """
    if not _pd_mode(server_args):
        return
    t0 = time.monotonic()
    if reqs is None:
        for mod in DECLARING_MODULES:
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


_attached_lock = threading.Lock()
_S = TypeVar("_S")


def attached(obj: Any, attr: str, factory: Callable[[], _S]) -> _S:
    """pdsafe state kept on an upstream object (a KV manager) under a pdsafe-owned attribute.

    Invariant: created once, on first use, under one lock (double-checked), so every thread
    that asks for ``obj``'s state gets the same instance; the attribute name is ours
    (``_pdsafe_*``), so no upstream member is read or replaced.
    """
    state = getattr(obj, attr, None)
    if state is None:
        with _attached_lock:
            state = getattr(obj, attr, None)
            if state is None:
                state = factory()
                setattr(obj, attr, state)
    return state
