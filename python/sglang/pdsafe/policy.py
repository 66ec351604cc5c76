"""One refusal and one failure policy: what a pdsafe hook does when it cannot decide.

Upstream calls pdsafe at hook sites (its scheduler loop, its KV control threads, its HTTP
layer). A hook either decides (serve, refuse, hold) or fails: it raises where nothing in the
pdsafe code expected it (a bug, a corrupt message, upstream changed shape, an injected fault).
"Upstream's behaviour applies" is not an answer for a hook that guards isolation, because
upstream's behaviour is the hole the hook exists to close. So every hook declares, once, what
its failure means, and :func:`hook` carries it out:

=========  =====================================================================================
outcome    what a failure does
=========  =====================================================================================
REFUSE     the request (or transfer) in hand is refused now with an explicit error, counted;
           the peer leg is told through the same path as any other refusal of that site
HOLD       the pages in hand are never freed by this path (leaked rather than freed twice),
           counted and alarmed; they stay accounted to this server until evidence or restart
POISON     this server stops admitting PD requests (HTTP 503, ``/health`` says why) until it
           is restarted; counted once
=========  =====================================================================================

A failure is also counted toward this server's **poison threshold**: after
``SGLANG_PDSAFE_POISON_AFTER`` distinct hook failures (default :data:`DEFAULT_POISON_AFTER`;
distinct: one per hook and request, see below) the server poisons itself, as TensorRT-LLM's
transceiver stops serving when it cannot prove reuse safe. A server that fails that often is
not one whose isolation anyone should rely on.

**Counted once per request, not per iteration.** Hooks in the scheduler loop run every pass;
a hook that fails for one transfer would fail again on every pass. Each hook names its
*failure key* (``key=``: usually the bootstrap room or the request), and a failure is counted,
logged and charged to the threshold only the first time for its (hook, key). A hook without a
key is server-wide: its first failure is counted and later ones are not counted again.

**One refusal type.** :class:`Refusal` carries the HTTP status, the reason the client reads and
the counter that counted it; :class:`RefusedError` carries one where upstream expects an
exception (the HTTP layer). Every pdsafe door, gate and check answers with these.

**Poison across processes.** A PD server is several processes (HTTP, scheduler ranks). A
scheduler that poisons itself writes the reason into the server's state directory
(``SGLANG_PDSAFE_STATE_DIR``, created by the launcher, :mod:`sglang.pdsafe.startup`); the HTTP
layer reads it and refuses new PD requests before they reach any scheduler, so every TP rank
sees the same requests (a rank-local refusal at a scheduler door would split the ranks), and
``/health`` answers 503 with the reason. Without a state directory (an entry point whose
launcher did not create one) the scheduler's own door refuses as well (:func:`poison_refusal`).

**Test seam, not a fault.** Each hook's undecorated function is kept in its :class:`HookSpec`
(``body``), which the guard calls through. The product never changes it; the testkit's fault
plugin (test profile only) wraps it to make a named hook fail at entry or midway, so that the
failure policy of every hook can be exercised on real servers.

Invariant: a hook never raises into upstream except through the outcome it declares (a refusal
at the HTTP layer, or a refused start); every failure is counted exactly once per (hook, key)
in the hook's own counter (or ``hook_api_mismatch_total`` when upstream changed shape); the
table of hooks and outcomes (``docs/failure-policy.md``) is generated from :data:`HOOKS`.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, TypeVar

from sglang.pdsafe import metrics
from sglang.pdsafe.hook_api import MISMATCH_COUNTER, REMEDY, is_mismatch

logger = logging.getLogger("sglang.pdsafe.policy")

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

ENV_POISON_AFTER = "SGLANG_PDSAFE_POISON_AFTER"
ENV_STATE_DIR = "SGLANG_PDSAFE_STATE_DIR"
DEFAULT_POISON_AFTER = 16
POISONED_COUNTER = "server_poisoned_total"
POISONED_REFUSED = "poisoned_refused_total"
#: Log a repeated failure of the same hook at most this often (every first failure per key
#: is counted; the log says how many it did not show).
LOG_INTERVAL_S = 10.0
#: (hook, key) pairs remembered for "counted once" (oldest forgotten first).
MAX_FAILURE_KEYS = 65536
#: How every poison refusal begins (``/health`` and the HTTP layer recognise it by this).
POISON_MARKER = "pdsafe: this server stopped admitting PD requests"
#: In every refusal a failed check answers (:meth:`Failure.refusal`). ``/health`` answers 503 at
#: once when its own probe got one (:func:`health_reason`): the server cannot serve a request
#: now, and upstream would otherwise wait out its health timeout (20 s) before saying so.
CHECK_FAILED_MARKER = "check could not run on this server"


class Outcome(enum.Enum):
    """What a hook's failure does (see the module doc)."""

    REFUSE = "refuse"
    HOLD = "hold"
    POISON = "poison"


# =========================================================================== refusals


@dataclass(frozen=True)
class Refusal:
    """One refused request: the HTTP status its client gets, the reason it reads, and the
    Prometheus counter (declared in :mod:`metrics`) that counted the refusal."""

    status: int
    reason: str
    counter: str

    @property
    def message(self) -> str:
        return self.reason


class RefusedError(ValueError):
    """A :class:`Refusal` raised where upstream expects an exception (its HTTP layer turns a
    ``ValueError`` into a 4xx before the request reaches a scheduler; patch 0009 answers with
    :attr:`status_code`). Subclasses name the error's OpenAI-style ``code`` and ``param``."""

    status_code: int = 400
    error_type = "invalid_request_error"
    error_code = "bad_request"
    param: str | None = None
    counter: str = ""

    def __init__(self, message: str, *, status: int | None = None,
                 counter: str | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status_code = int(status)
        if counter is not None:
            self.counter = counter

    @property
    def refusal(self) -> Refusal:
        return Refusal(int(self.status_code), str(self), self.counter)

    @classmethod
    def of(cls, refusal: Refusal) -> RefusedError:
        err = cls(refusal.reason, status=refusal.status, counter=refusal.counter)
        if refusal.status >= 500:
            err.error_type = "server_error"
        return err


class StartupRefusedError(RuntimeError):
    """A startup check failed or could not run: the server refuses to start."""


class _Reraise(Exception):  # noqa: N818 - a carrier
    """Raised by an ``on_failure`` that refuses a start with the hook's own exception."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(str(original))
        self.original = original


class UpstreamRaised(Exception):  # noqa: N818 - a carrier, not an error of its own
    """Upstream code that a hook was handed and ran (a release) raised: the hook's wrapper
    hands ``original`` back to upstream unchanged; it is not the hook's failure."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(str(original))
        self.original = original


class CheckFailedError(RefusedError):
    """A check that could not run refused the request (HTTP 503: retry)."""

    status_code = int(HTTPStatus.SERVICE_UNAVAILABLE)
    error_type = "server_error"
    error_code = "pdsafe_check_failed"


# =========================================================================== hooks


@dataclass(frozen=True)
class Failure:
    """One hook failure, handed to the hook's ``on_failure``."""

    spec: HookSpec
    exc: BaseException
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    key: Hashable | None
    first: bool  # the first failure of this hook for this key (counted, logged)
    mismatch: bool  # upstream changed shape (``hook_api.is_mismatch``)

    @property
    def counter(self) -> str:
        return MISMATCH_COUNTER if self.mismatch else self.spec.counter

    def refusal(self, status: int = int(HTTPStatus.SERVICE_UNAVAILABLE),
                what: str = "the request") -> Refusal:
        """The refusal a failed check answers: names the check, the cause and the remedy."""
        cause = f"{type(self.exc).__name__}: {self.exc}"
        fix = REMEDY if self.mismatch else (
            f"Retry; operators: see the server log (ERROR '{self.spec.name}') and "
            f"{metrics.PREFIX}{self.counter}")
        return Refusal(int(status), (
            f"pdsafe: the {self.spec.name} {CHECK_FAILED_MARKER} ({cause[:300]}), "
            f"so {what} was refused instead of being served unchecked. {fix}."), self.counter)


@dataclass
class HookSpec:
    """A hook upstream calls: its name, declared failure outcome and counter, and its body.

    ``effect`` says in one line what the outcome means at this hook (the failure-policy
    table's column). ``body`` is the undecorated function (see the module doc: the testkit's
    fault plugin wraps it; the product never does)."""

    name: str
    outcome: Outcome
    counter: str
    effect: str
    module: str
    qualname: str
    body: Callable[..., Any]
    on_failure: Callable[[Failure], Any]
    key: Callable[..., Hashable | None] | None = None
    calls: int = 0  # how often upstream called it in this process (failure-suite evidence)
    internal: bool = False  # only pdsafe's own modules call it (no patch does)
    ns: int = 0  # wall time inside it in this process, nested hooks included, upstream code
    #              it ran through run_upstream excluded (cost table)
    top_calls: int = 0  # of those, the calls made outside every other hook (cost table)
    top_ns: int = 0  # their time: summed over every hook, the process total ("*")

    @property
    def function(self) -> str:
        return f"{self.module}.{self.qualname}"


#: Every hook of every imported pdsafe module, by name (the failure-policy table's rows).
HOOKS: dict[str, HookSpec] = {}

#: Exceptions a hook raises *as its answer* (never a failure): a refusal at the HTTP layer,
#: a refused start. Extended by :func:`answers` (e.g. the startup errors of other modules).
_ANSWERS: tuple[type[BaseException], ...] = (RefusedError, StartupRefusedError)


def answers(*types: type[BaseException]) -> None:
    """Declare exception types that hooks raise as their decision (they pass through)."""
    global _ANSWERS
    _ANSWERS = tuple(dict.fromkeys(_ANSWERS + types))


def hook(name: str, *, outcome: Outcome, counter: str, on_failure: Callable[[Failure], Any],
         effect: str, key: Callable[..., Hashable | None] | None = None,
         internal: bool = False) -> Callable[[F], F]:
    """Declare a function upstream calls as a hook with its failure ``outcome``.

    ``on_failure(failure)`` is what the hook returns when its body raised: it must carry out
    ``outcome`` for the hook's call site (return the refusal the site acts on, fail the room,
    keep the pages). ``key(*args, **kwargs)`` names what a failure is counted once for (a
    room, a request; None: server-wide). ``internal``: no patch calls it, only pdsafe's own
    modules (the failure-policy table checks that every other hook has a call site).
    Exceptions in :data:`_ANSWERS` are the hook's answer and pass through.
    """
    if counter not in metrics.COUNTERS:
        raise KeyError(f"undeclared pdsafe counter {counter!r} for hook {name}")
    if name in HOOKS:
        raise ValueError(f"pdsafe hook {name!r} is declared twice")

    def wrap(fn: F) -> F:
        spec = HookSpec(name=name, outcome=outcome, counter=counter, effect=effect,
                        module=fn.__module__, qualname=fn.__qualname__, body=fn,
                        on_failure=on_failure, key=key, internal=internal)
        HOOKS[name] = spec

        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            spec.calls += 1
            if _cost_on:
                return _timed_call(spec, args, kwargs)
            try:
                return spec.body(*args, **kwargs)
            except UpstreamRaised as up:
                raise up.original from None
            except _ANSWERS:
                raise
            except Exception as e:  # noqa: BLE001 - the policy's whole purpose
                return _failed(spec, e, args, kwargs)

        inner.__pdsafe_hook__ = spec  # type: ignore[attr-defined]
        return inner  # type: ignore[return-value]

    return wrap


def _timed_call(spec: HookSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The hook call of :func:`hook` with its wall time charged to the cost table (only
    while :func:`measure_cost` is on: timing costs about a microsecond per call).

    Charged: the hook's own time, nested pdsafe hooks included, upstream code it ran through
    :func:`run_upstream` excluded (a release, a radix insert: upstream's work, not the
    protection's). Only a call made outside every other hook of its thread (the outermost)
    adds to the process total (``"*"``), so a hook that runs inside another hook, directly or
    inside the upstream code that hook ran, is counted once, in its caller."""
    frames = _frames()
    frame = [0, 0]  # [upstream ns excluded, ns of hooks nested inside that upstream code]
    frames.append(frame)
    t0 = _now_ns()
    try:
        return spec.body(*args, **kwargs)
    except UpstreamRaised as up:
        raise up.original from None
    except _ANSWERS:
        raise
    except Exception as e:  # noqa: BLE001 - the policy's whole purpose
        return _failed(spec, e, args, kwargs)
    finally:
        t1 = _now_ns()
        frames.pop()
        own = t1 - t0 - frame[0]
        spec.ns += own
        if frames:
            frames[-1][1] += own  # inside upstream code run by a hook: ours, charged there
        else:
            spec.top_calls += 1
            spec.top_ns += own
            total = _cost
            total[0] += own
            total[1] += 1
            if t0 >= total[2]:
                flush_cost(t0)


def run_upstream(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run upstream code ``fn`` from inside a hook (a release the hook guards). While the cost
    table is on, its time is excluded from the calling hook's charge, except the time of
    pdsafe hooks it calls in turn (a free's generation stamp). Off: just ``fn(...)``."""
    if not _cost_on:
        return fn(*args, **kwargs)
    frames = _frames()
    if not frames:
        return fn(*args, **kwargs)
    inside = [0, 0]
    frames.append(inside)
    t0 = _now_ns()
    try:
        return fn(*args, **kwargs)
    finally:
        dt = _now_ns() - t0
        frames.pop()
        frames[-1][0] += dt - inside[1]  # upstream's time, less the pdsafe hooks inside it


_tls = threading.local()


def _frames() -> list[list[int]]:
    """This thread's stack of timed hook calls (and upstream calls inside them)."""
    try:
        return _tls.frames  # type: ignore[no-any-return]
    except AttributeError:
        _tls.frames = []
        return _tls.frames  # type: ignore[no-any-return]


#: ``SGLANG_PDSAFE_HOOK_COST=1``: time every hook call (the cost table, hook_seconds_total).
ENV_HOOK_COST = "SGLANG_PDSAFE_HOOK_COST"
_cost_on = os.environ.get(ENV_HOOK_COST, "").strip() == "1"


def measure_cost(on: bool = True) -> None:
    """Turn the hook-cost timing on or off in this process (benchmarks; servers read
    :data:`ENV_HOOK_COST` at start)."""
    global _cost_on
    _cost_on = on


_now_ns = time.perf_counter_ns
#: [ns, calls, next flush at] of the outermost hook calls of this process: hooks a patch
#: calls (an ``internal`` hook runs inside another hook and is charged there). Updated
#: without a lock (a lost increment under a thread race costs a sample, not correctness):
#: a lock per call would cost more than most hooks.
_cost: list[int] = [0, 0, 0]
_cost_lock = threading.Lock()
_cost_flushed = (0, 0)  # (ns, calls) already added to the exported counters
COST_FLUSH_NS = 1_000_000_000


def flush_cost(now: int | None = None) -> None:
    """Export the hook-cost totals not yet exported (``hook_seconds_total``,
    ``hook_calls_total``); called at most once a second from the hooks (a Prometheus
    increment per call would cost more than most hooks)."""
    global _cost_flushed
    with _cost_lock:
        _cost[2] = (now if now is not None else _now_ns()) + COST_FLUSH_NS
        ns, calls = _cost[0], _cost[1]
        d_ns, d_calls = ns - _cost_flushed[0], calls - _cost_flushed[1]
        _cost_flushed = (ns, calls)
    if d_calls:
        metrics.inc("hook_seconds_total", d_ns / 1e9)
        metrics.inc("hook_calls_total", d_calls)


def hook_cost() -> dict[str, tuple[int, int]]:
    """``{hook name: (calls, ns)}`` of this process, nested hooks included in their callers'
    time too, upstream code a hook ran through :func:`run_upstream` excluded, plus ``"*"``:
    the outermost calls only (what the hooks added in all). ``calls`` counts every call;
    ``ns`` only the calls made while the timing was on."""
    table = {name: (spec.calls, spec.ns) for name, spec in HOOKS.items() if spec.calls}
    table["*"] = (_cost[1], _cost[0])
    return table


def hook_cost_outermost() -> dict[str, tuple[int, int]]:
    """``{hook name: (calls, ns)}`` of the calls made outside every other hook: each timed
    call's time counted once, in the hook upstream called (a hook nested in it, directly or
    inside the upstream code it ran, is charged there). The values add up to ``"*"`` of
    :func:`hook_cost`: a partition of what the hooks added, by the hook upstream called."""
    return {name: (spec.top_calls, spec.top_ns) for name, spec in HOOKS.items()
            if spec.top_calls}


def reset_cost() -> None:
    """Zero the cost table (benchmarks, between measured runs)."""
    global _cost_flushed
    for spec in HOOKS.values():
        spec.calls = 0
        spec.ns = 0
        spec.top_calls = 0
        spec.top_ns = 0
    with _cost_lock:
        _cost[0] = _cost[1] = 0
        _cost_flushed = (0, 0)


_lock = threading.Lock()
_seen: OrderedDict[tuple[str, Hashable | None], None] = OrderedDict()
_distinct = 0
_last_logged: dict[str, tuple[float, int]] = {}


def _key_of(spec: HookSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable | None:
    if spec.key is None:
        return None
    try:
        return spec.key(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an unreadable key: count as server-wide
        return None


def _failed(spec: HookSpec, exc: BaseException, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:
    global _distinct
    key = _key_of(spec, args, kwargs)
    mismatch = is_mismatch(exc)
    with _lock:
        first = (spec.name, key) not in _seen
        if first:
            _seen[(spec.name, key)] = None
            while len(_seen) > MAX_FAILURE_KEYS:
                _seen.popitem(last=False)
            _distinct += 1
            distinct = _distinct
        last, suppressed = _last_logged.get(spec.name, (float("-inf"), 0))
        now = time.monotonic()
        log = first and now - last >= LOG_INTERVAL_S
        if first:
            _last_logged[spec.name] = (now, 0) if log else (last, suppressed + 1)
    failure = Failure(spec, exc, args, kwargs, key, first, mismatch)
    if first:
        metrics.inc(failure.counter)
        if log:
            logger.error(
                "pdsafe hook %s failed (%s: %s)%s; failure outcome: %s (%s). Counted in %s%s "
                "once per %s. (%d similar suppressed)", spec.name, type(exc).__name__, exc,
                " - upstream API mismatch: " + REMEDY if mismatch else "",
                spec.outcome.value.upper(), spec.effect, metrics.PREFIX, failure.counter,
                "server" if key is None else "request", suppressed, exc_info=True)
        if spec.outcome is Outcome.POISON:
            poison(f"the {spec.name} hook failed ({type(exc).__name__}: {exc})", by=spec.name)
        elif distinct >= poison_after():
            poison(f"{distinct} pdsafe hook failures (the last: {spec.name}, "
                   f"{type(exc).__name__}: {exc}); threshold {ENV_POISON_AFTER}="
                   f"{poison_after()}", by=spec.name)
    try:
        return spec.on_failure(failure)
    except _Reraise as r:
        raise r.original from None
    except _ANSWERS:
        raise
    except Exception as e2:  # noqa: BLE001 - the outcome itself failed: poison, keep going
        poison(f"the failure outcome of {spec.name} failed ({type(e2).__name__}: {e2})",
               by=spec.name)
        logger.critical("pdsafe hook %s: carrying out its failure outcome %s failed too "
                        "(%s: %s); this server stops admitting PD requests.", spec.name,
                        spec.outcome.value, type(e2).__name__, e2, exc_info=True)
        return None


def poison_after() -> int:
    """Distinct hook failures after which this server poisons itself (>= 1)."""
    raw = os.environ.get(ENV_POISON_AFTER, "").strip()
    if not raw:
        return DEFAULT_POISON_AFTER
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{ENV_POISON_AFTER}={raw!r} is not an integer; give the number of "
                         f"distinct pdsafe hook failures after which a server stops admitting "
                         f"PD requests (default {DEFAULT_POISON_AFTER})") from None
    if value < 1:
        raise ValueError(f"{ENV_POISON_AFTER}={raw!r} must be >= 1")
    return value


# =========================================================================== poison


@dataclass(frozen=True)
class Poison:
    """Why this server stopped admitting PD requests, since when, and what poisoned it."""

    reason: str
    since: float  # wall clock
    by: str
    pid: int = field(default_factory=os.getpid)

    def message(self) -> str:
        return (f"{POISON_MARKER}: {self.reason} (since "
                f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(self.since))}, by "
                f"{self.by}). It can no longer prove that a KV transfer is safe, so it refuses "
                "new PD requests instead of serving them unchecked; requests already admitted "
                "finish or fail explicitly. Retry on another server; operators: read this "
                "server's log (ERROR 'pdsafe'), fix the cause and restart it "
                f"({metrics.PREFIX}{POISONED_COUNTER}).")


_poison: Poison | None = None
_poison_file_seen: tuple[float, Poison | None] = (0.0, None)
#: How long the HTTP layer trusts its last read of the state directory (seconds).
POISON_FILE_TTL_S = 0.25


def state_dir() -> str | None:
    """The server's shared state directory (None: none was created)."""
    path = os.environ.get(ENV_STATE_DIR, "").strip()
    return path or None


def _poison_path() -> str | None:
    d = state_dir()
    return os.path.join(d, "poison.json") if d else None


def poison(reason: str, *, by: str) -> Poison:
    """Poison this server (idempotent: the first reason stands). Counted once, logged
    CRITICAL, and shared with the other processes of the server through its state
    directory."""
    global _poison
    with _lock:
        first = _poison is None
        if first:
            _poison = Poison(reason=reason, since=time.time(), by=by)
        current = _poison
    if first:
        metrics.inc(POISONED_COUNTER)
        metrics.set_gauge("poisoned", 1.0)
        logger.critical("%s", current.message())
        path = _poison_path()
        if path is not None:
            try:
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    json.dump({"reason": current.reason, "since": current.since,
                               "by": current.by, "pid": current.pid}, f)
                os.replace(tmp, path)
            except OSError as e:  # the local door still refuses (see poison_refusal)
                logger.error("pdsafe: could not share the poison with the server's other "
                             "processes (%s: %s); this process refuses on its own",
                             type(e).__name__, e)
    return current


def poisoned() -> Poison | None:
    """This server's poison: this process's own, else what another process of the server
    wrote into the state directory (re-read at most every :data:`POISON_FILE_TTL_S`)."""
    global _poison_file_seen
    if _poison is not None:
        return _poison
    path = _poison_path()
    if path is None:
        return None
    now = time.monotonic()
    checked, seen = _poison_file_seen
    if seen is not None or now - checked < POISON_FILE_TTL_S:
        return seen
    try:
        with open(path) as f:
            data = json.load(f)
        seen = Poison(reason=str(data["reason"]), since=float(data["since"]),
                      by=str(data["by"]), pid=int(data.get("pid", 0)))
    except FileNotFoundError:
        seen = None
    except (OSError, ValueError, KeyError, TypeError) as e:  # unreadable: fail closed
        seen = Poison(reason=f"the server's poison record is unreadable ({e})",
                      since=time.time(), by="policy.poisoned")
    _poison_file_seen = (now, seen)
    return seen


def poison_refusal() -> Refusal | None:
    """The 503 a poisoned server answers every new PD request with (counted), else None."""
    p = poisoned()
    if p is None:
        return None
    metrics.inc(POISONED_REFUSED)
    return Refusal(int(HTTPStatus.SERVICE_UNAVAILABLE), p.message(), POISONED_REFUSED)


def health_reason(errors: list[BaseException] | tuple[BaseException, ...] = ()) -> str | None:
    """``/health``: why this server answers 503 (poisoned, its health request refused by a
    pdsafe limit whose message contains one of :data:`HEALTH_MARKERS`, or by a check that could
    not run), else None."""
    p = poisoned()
    if p is not None:
        return p.message()
    for e in errors:
        text = str(getattr(e, "detail", None) or e)
        if any(marker in text for marker in HEALTH_MARKERS):
            return text
    return None


#: Refusal texts that make ``/health`` answer 503 (registered by the modules that refuse
#: admission for the whole server: the quarantine limit, the KV mismatch breaker, poison).
HEALTH_MARKERS: list[str] = [POISON_MARKER, CHECK_FAILED_MARKER]


def health_marker(marker: str) -> str:
    """Register ``marker`` (a refusal text prefix) as one that makes ``/health`` unhealthy."""
    if marker not in HEALTH_MARKERS:
        HEALTH_MARKERS.append(marker)
    return marker


def create_state_dir() -> str:
    """Launcher side: a fresh state directory for this server, exported to its children
    (scheduler processes inherit the environment). Returns its path."""
    path = tempfile.mkdtemp(prefix="sglang-pdsafe-")
    os.environ[ENV_STATE_DIR] = path
    return path


def reset_for_tests() -> None:
    """Forget every failure and the poison of this process (tests only)."""
    global _poison, _distinct, _poison_file_seen
    with _lock:
        _poison = None
        _distinct = 0
        _seen.clear()
        _last_logged.clear()
        _poison_file_seen = (0.0, None)
    metrics.set_gauge("poisoned", 0.0)


# =========================================================================== common outcomes


def refuse_with(status: int = int(HTTPStatus.SERVICE_UNAVAILABLE),
                what: str = "the request") -> Callable[[Failure], Refusal]:
    """``on_failure`` of a hook whose call site acts on a returned :class:`Refusal`."""
    return lambda failure: failure.refusal(status, what)


def raise_refusal(failure: Failure) -> Any:
    """``on_failure`` of a hook whose call site expects an exception (the HTTP layer)."""
    raise CheckFailedError.of(failure.refusal())


def returns(value: Any) -> Callable[[Failure], Any]:
    """``on_failure`` that answers a fixed value (the declared outcome's value at the site:
    e.g. "drop the message", "held")."""
    return lambda failure: value


def reraise_at_startup(failure: Failure) -> Any:
    """``on_failure`` of a startup hook: the check's own exception refuses the start (counted
    and logged by the policy first)."""
    raise _Reraise(failure.exc)


def table() -> list[HookSpec]:
    """Every declared hook, by name (the failure-policy table)."""
    return [HOOKS[n] for n in sorted(HOOKS)]


@dataclass(frozen=True)
class Passthrough:
    """A function upstream calls that decides nothing about isolation (it formats, or runs
    upstream's own code): its exceptions are upstream's. Listed in the failure-policy table
    with ``why``."""

    name: str
    function: str
    why: str


#: Functions upstream calls that are not hooks, by name (see :class:`Passthrough`).
PASSTHROUGH: dict[str, Passthrough] = {}


def passthrough(name: str, *, why: str) -> Callable[[F], F]:
    """Declare ``fn`` a function upstream calls that decides nothing (no failure outcome)."""

    def wrap(fn: F) -> F:
        PASSTHROUGH[name] = Passthrough(name, f"{fn.__module__}.{fn.__qualname__}", why)
        return fn

    return wrap
