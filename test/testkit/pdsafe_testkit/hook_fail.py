"""``hook_fail``: make any named pdsafe hook fail, at its entry or midway (test only).

Part of the test-only plugin (:mod:`pdsafe_testkit.faults`, armed by
``SGLANG_PDSAFE_TEST_FAULTS=hook_fail``); never shipped in the product. It exercises the
failure policy of every hook (:mod:`sglang.pdsafe.policy`) on real servers
(``test/pd/test_hook_failures.py``).

**The seam.** Every hook's guard calls ``spec.body(*args, **kwargs)`` of its
:class:`~sglang.pdsafe.policy.HookSpec`. When the plugin loads (early in every server process:
HTTP, scheduler, detokenizer), :meth:`HookFail.install` imports every hook module
(``startup.HOOK_MODULES``) and replaces each ``spec.body`` with a shim. Unarmed, the shim is
one dict lookup and calls the body. Armed for a hook (by the control file, below), it raises
:class:`InjectedHookFailure` in one of two modes:

``entry``
    before the body runs: the hook decided nothing;
``mid``
    after the body ran: its effects happened, and its caller gets the failure anyway.

Either way the failure goes through the hook's own guard, so the real failure policy answers
(``on_failure``, counted once per key, the poison threshold). A body that raises by itself
(its answer, e.g. a refusal) is not an injection.

**Runtime control** (one pair of servers serves every case). ``SGLANG_PDSAFE_TEST_FAULT_CONTROL``
names a JSON file the suite writes (:class:`Control`: armed hooks and modes, legacy outcomes,
a reset counter); a thread of each process re-reads it every :data:`POLL_S` and applies a
new ``seq`` (a reset forgets this process's failures and poison, ``policy.reset_for_tests``,
before the new arming applies). Each process writes its status next to the control file
(:func:`status_path`: ``<control>.<tag>.<pid>.json``; tag from
``SGLANG_PDSAFE_TEST_FAULT_TAG``): the ``seq`` it applied, how often each hook was called
(``HookSpec.calls``) and injected, its poison, and in a scheduler the allocator audit.

**Legacy outcomes** (to show that the suite sees the bugs the policy closed). ``Control.legacy``
names hooks whose ``on_failure`` is replaced by what their old guard did (:data:`LEGACY`):
``room_guard.claim`` returns None (the endpoint is built with the room unclaimed: a second
request of the room is admitted), ``page_generation.release_request`` runs upstream's plain
release (every page of the reservation freed, the ones freed under the transfer a second
time).

**Allocator audit** (scheduler processes). A ``BEFORE`` hook of ``Scheduler.on_idle`` (every
scheduler pass without a batch) audits the KV allocator whenever the scheduler is quiet (no
batch, no queued or transferring request; quarantined releases may be pending) and anything
changed since the last audit (:func:`audit`): no page twice in the free lists, no page both
free and owned (a row of a running, held or quarantined request, or the prefix tree), no page
owned twice, and upstream's own conservation (free + evictable + protected + held + rows in
use = the pool). It runs before upstream's own idle check, which raises on a leak, so a double
free is recorded even when that check then stops the scheduler; every failed audit is kept
(``violations``).

Invariant: unarmed (no hook named in the control file), no hook behaves differently; an armed
hook fails on every call until it is disarmed; the shim never raises for another hook.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ENV_CONTROL = "SGLANG_PDSAFE_TEST_FAULT_CONTROL"
ENV_TAG = "SGLANG_PDSAFE_TEST_FAULT_TAG"
MODES = ("entry", "mid")
LOG = "TEST FAULT hook_fail"
#: How often each process re-reads the control file and refreshes its status (seconds).
POLL_S = 0.05
#: Upstream's scheduler pass without a batch (the audit runs before it).
AUDIT_TARGET = "sglang.srt.managers.scheduler.Scheduler.on_idle"
#: Failed audits a process keeps in its status.
MAX_VIOLATIONS = 20


class InjectedHookFailure(RuntimeError):  # noqa: N818 - named for what the log shows
    """What an armed hook raises (a RuntimeError: never read as an upstream API mismatch)."""


# =========================================================================== control file


@dataclass(frozen=True)
class Control:
    """What the suite asks of every process of a stack (the control file's content).

    ``seq`` grows with every write (each process acknowledges it in its status); ``armed``
    maps hook names to a mode of :data:`MODES`; ``legacy`` names hooks that fail with their
    old outcome (:data:`LEGACY`); a new ``reset`` forgets failures and poison; a new ``audit``
    asks each scheduler for an allocator audit at its next quiet pass."""

    seq: int = 0
    armed: dict[str, str] = field(default_factory=dict)
    legacy: tuple[str, ...] = ()
    reset: int = 0
    audit: int = 0

    def to_json(self) -> str:
        return json.dumps({"seq": self.seq, "armed": self.armed, "legacy": list(self.legacy),
                           "reset": self.reset, "audit": self.audit}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Control:
        data = json.loads(text)
        armed = {str(k): str(v) for k, v in dict(data.get("armed", {})).items()}
        bad = {k: v for k, v in armed.items() if v not in MODES}
        if bad:
            raise ValueError(f"{LOG}: unknown modes {bad} (known: {MODES})")
        unknown = set(data.get("legacy", ())) - set(LEGACY)
        if unknown:
            raise ValueError(f"{LOG}: no legacy outcome for {sorted(unknown)} "
                             f"(known: {sorted(LEGACY)})")
        return cls(seq=int(data.get("seq", 0)), armed=armed,
                   legacy=tuple(data.get("legacy", ())), reset=int(data.get("reset", 0)),
                   audit=int(data.get("audit", 0)))

    def write(self, path: Path) -> None:
        """Atomically replace the control file (readers never see half a file)."""
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(self.to_json())
        os.replace(tmp, path)


def status_path(control: Path, tag: str, pid: int) -> Path:
    """Where process ``pid`` (tagged ``tag``) of a stack writes its status."""
    return control.with_name(f"{control.name}.{tag}.{pid}.json")


def read_statuses(control: Path) -> list[dict[str, Any]]:
    """Every status written next to ``control`` (a half-written one is skipped)."""
    out = []
    for p in sorted(control.parent.glob(f"{control.name}.*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return out


# =========================================================================== legacy outcomes


def _legacy_claim(failure: Any) -> None:
    """The old room guard's default: a claim that failed let the endpoint be built."""
    return None


def _legacy_door(failure: Any) -> None:
    """The old room guard's door default: a door check that failed admitted the request."""
    return None


def _legacy_release(failure: Any) -> None:
    """The old release hook: upstream's plain release, every page of the reservation."""
    failure.args[1]()


#: Hook name -> the ``on_failure`` its guard had before the fail-closed policy.
LEGACY: dict[str, Callable[[Any], Any]] = {
    "room_guard.claim": _legacy_claim,
    "room_guard.door": _legacy_door,
    "page_generation.release_request": _legacy_release,
}


# =========================================================================== the audit


def _pages(slots: Any, page_size: int) -> Any:
    """The distinct page ids of token ``slots`` (a tensor)."""
    import torch

    return torch.unique(slots.long() // page_size)


def _deferred_rows(scheduler: Any) -> list[Any]:
    """Rows of the decode's quarantined (deferred) releases."""
    tq = getattr(scheduler, "disagg_decode_transfer_queue", None)
    entries = getattr(tq, "_deferred_releases", None) or []
    return [e[0].req.kv for e in entries]


def _owner_rows(scheduler: Any) -> dict[str, list[Any]]:
    """Rows that own pages, by kind: held by pdsafe, quarantined, running (each once)."""
    from sglang.pdsafe import transfer

    seen: set[int] = set()
    out: dict[str, list[Any]] = {"held": [], "quarantined": [], "running": []}
    running = [r.kv for r in scheduler.invariant_checker._requests_owning_rows()]
    for kind, rows in (("held", [h.row for h in transfer.held()]),
                       ("quarantined", _deferred_rows(scheduler)),
                       ("running", running)):
        for kv in rows:
            if id(kv) in seen or not getattr(kv, "holds_kv", True) or kv.req_pool_idx is None:
                continue
            seen.add(id(kv))
            out[kind].append(kv)
    return out


def _tree_pages(scheduler: Any, page_size: int) -> Any:
    import torch

    flatten = getattr(scheduler.tree_cache, "all_values_flatten", None)
    values = flatten() if flatten is not None else None
    if values is None or not hasattr(values, "numel") or values.numel() == 0:
        return torch.empty(0, dtype=torch.int64)
    return _pages(values, page_size)


def _sample(t: Any, n: int = 8) -> list[int]:
    return [int(x) for x in t[:n].tolist()]


def audit(scheduler: Any) -> dict[str, Any]:
    """Audit ``scheduler``'s KV allocator (see the module doc); ``ok`` is the verdict."""
    import torch
    from sglang.pdsafe import transfer
    from sglang.srt.managers.scheduler_components.pool_stats_observer import kv_private_tokens

    alloc = scheduler.token_to_kv_pool_allocator
    page = int(getattr(alloc, "page_size", 1) or 1)
    free = alloc.get_all_free_pages().long()
    free_u, free_n = torch.unique(free, return_counts=True)
    twice_free = free_u[free_n > 1]
    rtt = scheduler.req_to_token_pool.req_to_token
    rows = _owner_rows(scheduler)
    owned = [_tree_pages(scheduler, page)]
    # a held row whose hold is narrower than its slots (pages freed under its transfer)
    kept = {id(h.row): h.pages for h in transfer.held() if h.pages is not None}
    for kvs in rows.values():
        for kv in kvs:
            if id(kv) in kept:
                owned.append(kept[id(kv)].long())
                continue
            slots = rtt[kv.req_pool_idx, kv.cache_protected_len:kv.kv_allocated_len]
            owned.append(_pages(slots, page))
    owned_all = torch.cat(owned) if owned else torch.empty(0, dtype=torch.int64)
    owned_u, owned_n = torch.unique(owned_all, return_counts=True)
    twice_owned = owned_u[owned_n > 1]
    free_and_owned = owned_u[torch.isin(owned_u, free_u)]
    held_ids = {id(kv) for kv in rows["held"]}
    uncached = sum(kv_private_tokens(kv, page) for kind in ("quarantined", "running")
                   for kv in rows[kind] if id(kv) not in held_ids)
    leak, messages = scheduler.invariant_checker._check_all_pools(
        scheduler.pool_stats_observer.get_pool_stats(), uncached=uncached)
    problems = []
    if twice_free.numel():
        problems.append(f"{twice_free.numel()} pages freed twice (in the free lists twice, "
                        f"e.g. {_sample(twice_free)})")
    if free_and_owned.numel():
        problems.append(f"{free_and_owned.numel()} pages both free and in use (e.g. "
                        f"{_sample(free_and_owned)})")
    if twice_owned.numel():
        problems.append(f"{twice_owned.numel()} pages owned twice (e.g. {_sample(twice_owned)})")
    if leak:
        problems.append("the pool does not add up: " + " | ".join(messages))
    return {"ok": not problems, "problems": problems, "free_pages": int(free.numel()),
            "page_size": page, "owned_pages": int(owned_u.numel()),
            "rows": {k: len(v) for k, v in rows.items()}, "pool": " | ".join(messages),
            "forward_ct": int(getattr(scheduler, "forward_ct", 0) or 0)}


def _quiet(scheduler: Any) -> bool:
    """No batch and no request queued or in transfer (quarantined releases may be pending)."""
    if scheduler.is_fully_idle():
        return True
    tq = getattr(scheduler, "disagg_decode_transfer_queue", None)
    if tq is None or not tq.has_pending_deferred_releases():
        return False
    pq = scheduler.disagg_decode_prealloc_queue
    last = scheduler.last_batch
    return (scheduler.running_batch.is_empty() and scheduler.chunked_req is None
            and (last is None or last.is_empty()) and not scheduler.waiting_queue
            and not pq.queue and not pq.retracted_queue and not tq.queue)


# =========================================================================== the plugin side


class HookFail:
    """The armed ``hook_fail`` fault of one process (see the module doc)."""

    def __init__(self, control: Path, tag: str) -> None:
        self.control_path = control
        self.tag = tag
        self.control = Control()
        self.armed: dict[str, str] = {}  # replaced whole by the poller, read by every shim
        self.injected: dict[str, int] = {}
        self.original_on_failure: dict[str, Callable[[Any], Any]] = {}
        self.original_body: dict[str, Callable[..., Any]] = {}
        self._stop = threading.Event()
        self.last_audit: dict[str, Any] | None = None
        self.violations: list[dict[str, Any]] = []
        self._audit_sig: tuple[Any, ...] | None = None
        self._text = ""
        self._status_sig: tuple[Any, ...] | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ install
    def install(self, names: Iterable[str] | None = None, *, poller: bool = True) -> int:
        """Put the shim into every hook of every hook module (or only ``names``); start the
        poller thread (unless ``poller`` is False: the caller polls). Returns the number of
        hooks shimmed."""
        import importlib

        from sglang.pdsafe import policy, startup

        for module in startup.HOOK_MODULES:
            importlib.import_module(module)
        wanted = set(policy.HOOKS) if names is None else set(names)
        for spec in policy.HOOKS.values():
            if spec.name in wanted and spec.name not in self.original_body:
                self.original_on_failure[spec.name] = spec.on_failure
                self.original_body[spec.name] = spec.body
                spec.body = self._shim(spec.name, spec.body)
        self.poll()
        if poller:
            threading.Thread(target=self._run, name="pdsafe-test-hook-fail",
                             daemon=True).start()
        return len(self.original_body)

    def uninstall(self) -> None:
        """Give every shimmed hook its body and outcome back and stop the poller (tests)."""
        from sglang.pdsafe import policy

        self._stop.set()
        self.armed = {}
        for name, body in self.original_body.items():
            spec = policy.HOOKS.get(name)
            if spec is not None:
                spec.body, spec.on_failure = body, self.original_on_failure[name]
        self.original_body.clear()
        self.original_on_failure.clear()

    def _shim(self, name: str, body: Callable[..., Any]) -> Callable[..., Any]:
        def shim(*args: Any, **kwargs: Any) -> Any:
            mode = self.armed.get(name)
            if mode is None:
                return body(*args, **kwargs)
            return self._fail(name, mode, body, args, kwargs)

        shim.__wrapped__ = body  # type: ignore[attr-defined]
        return shim

    def _fail(self, name: str, mode: str, body: Callable[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> Any:
        if mode == "mid":
            body(*args, **kwargs)
        with self._lock:
            n = self.injected[name] = self.injected.get(name, 0) + 1
        if n == 1:
            logger.warning("%s: %s fails (%s) from now on, pid %d", LOG, name, mode, os.getpid())
        where = "at its entry" if mode == "entry" else "after its body ran"
        raise InjectedHookFailure(f"{LOG}: hook {name} failed {where}")

    # ------------------------------------------------------------------ control
    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.poll()
            except Exception:  # a test fault must never break the process it runs in
                logger.exception("%s: poll failed", LOG)

    def poll(self) -> None:
        """Apply a new control file, then refresh the status if anything changed."""
        try:
            text = self.control_path.read_text()
        except FileNotFoundError:
            text = ""
        if text and text != self._text:
            self._text = text
            try:
                self.apply(Control.from_json(text))
            except ValueError:
                logger.exception("%s: unreadable control file %s", LOG, self.control_path)
        self.write_status()

    def apply(self, control: Control) -> None:
        """Reset (if asked), swap legacy outcomes, then arm exactly ``control.armed``."""
        from sglang.pdsafe import policy

        if control.seq == self.control.seq:
            return
        if control.reset != self.control.reset:
            policy.reset_for_tests()
        for name, original in self.original_on_failure.items():
            spec = policy.HOOKS.get(name)
            if spec is not None:
                spec.on_failure = LEGACY[name] if name in control.legacy else original
        self.armed = {k: v for k, v in control.armed.items() if k in self.original_on_failure}
        self.control = control
        if control.armed or control.legacy:
            logger.warning("%s: control %d: armed %s, legacy outcomes %s (pid %d)", LOG,
                           control.seq, control.armed, list(control.legacy), os.getpid())

    # ------------------------------------------------------------------ audit
    def before_idle(self, scheduler: Any, *args: Any, **kwargs: Any) -> None:
        """BEFORE hook of ``Scheduler.on_idle``: audit when quiet and anything changed."""
        try:
            self._maybe_audit(scheduler)
        except Exception as e:  # never break the scheduler: record the audit as failed
            logger.exception("%s: allocator audit failed", LOG)
            self._record_audit({"ok": False, "problems": [f"audit raised {e!r}"]})

    def _maybe_audit(self, scheduler: Any) -> None:
        from sglang.pdsafe import transfer

        alloc = scheduler.token_to_kv_pool_allocator
        tq = getattr(scheduler, "disagg_decode_transfer_queue", None)
        sig = (getattr(scheduler, "forward_ct", 0), alloc.available_size(),
               len(transfer.held_rows()),
               tq.num_pending_deferred_releases() if tq is not None else 0, self.control.audit)
        if sig == self._audit_sig or not _quiet(scheduler):
            return
        self._audit_sig = sig
        self._record_audit(audit(scheduler))

    def _record_audit(self, result: dict[str, Any]) -> None:
        result.update(seq=self.control.audit, at=time.time())
        with self._lock:
            self.last_audit = result
            if not result["ok"]:
                self.violations = (self.violations + [result])[-MAX_VIOLATIONS:]
                logger.error("%s: allocator audit failed: %s", LOG, "; ".join(result["problems"]))
        self.write_status(force=True)  # now: upstream's own idle check may raise next

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        from sglang.pdsafe import policy

        poison = policy.poisoned()
        specs = policy.HOOKS.values()
        with self._lock:
            return {
                "pid": os.getpid(), "tag": self.tag, "seq": self.control.seq,
                "calls": {s.name: s.calls for s in specs if s.calls},
                "injected": dict(self.injected),
                "armed": dict(self.armed), "legacy": list(self.control.legacy),
                "poisoned": poison.reason if poison is not None else None,
                "state_dir": policy.state_dir(),
                "audit": self.last_audit, "violations": list(self.violations),
                "hooks": {s.name: [s.outcome.value, s.counter] for s in specs},
            }

    def write_status(self, force: bool = False) -> None:
        from sglang.pdsafe import policy

        sig = (self.control.seq, sum(s.calls for s in policy.HOOKS.values()),
               sum(self.injected.values()), id(self.last_audit), policy.poisoned() is not None)
        if sig == self._status_sig and not force:
            return
        self._status_sig = sig
        path = status_path(self.control_path, self.tag, os.getpid())
        tmp = path.with_name(f"{path.name}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(self.status()))
        os.replace(tmp, path)


def from_env() -> HookFail:
    """The fault for this process, from ``SGLANG_PDSAFE_TEST_FAULT_CONTROL`` (required)."""
    raw = os.environ.get(ENV_CONTROL, "").strip()
    if not raw:
        raise ValueError(f"hook_fail needs {ENV_CONTROL}: the control file the suite writes")
    return HookFail(Path(raw), os.environ.get(ENV_TAG, "server").strip() or "server")
