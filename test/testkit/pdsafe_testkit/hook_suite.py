"""The hook-failure suite's driver: every pdsafe hook made to fail in turn on a real PD stack.

Used by ``test/pd/test_hook_failures.py``; the servers run the test-only ``hook_fail`` fault
(:mod:`pdsafe_testkit.hook_fail`), controlled at runtime through a control file, so one stack
per backend serves every case.

A **case** is (hook, mode): the hook is armed (``entry`` or ``mid``), the workload items that
reach it run (:data:`ITEMS`, chosen by a calibration run of each item with nothing armed), the
hook is disarmed, a probe request goes through the router, and each scheduler audits its KV
allocator. The case's :class:`CaseResult` says what every client saw (content-judged by the
oracle, with the time to its answer), how often the hook was injected, by how much its counter
moved, whether a server was poisoned, died or left broken, and the audits. :meth:`CaseResult.
problems` is the suite's verdict: no wrong content, no client waiting for a server timeout
(:data:`ANSWER_BOUND_S`, far below the stacks' own timeouts), no dead server, a clean audit,
every failure counted, and the declared outcome (poison exactly for POISON hooks).

Between cases the failure policy of every process is reset (its counted failures and poison:
``policy.reset_for_tests`` through the control file, and the shared poison record removed), so
each case starts clean; a stack that still does not serve the probe is restarted (recorded).

Hooks that run only at startup (their failure refuses the start: ``on_failure`` is
``reraise_at_startup``) cannot fail at runtime; :func:`catalog` marks them and the suite lists
them as covered by the unit tests.
"""

from __future__ import annotations

import ast
import json
import os
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import requests

from pdsafe_testkit import faults
from pdsafe_testkit.hook_fail import Control, read_statuses
from pdsafe_testkit.metrics import scrape, sum_samples
from pdsafe_testkit.oracle import Oracle, random_prompt
from pdsafe_testkit.servers import (
    REPO,
    GenResult,
    Limits,
    PDStack,
    ServerConfig,
    generate,
    pd_stack,
)

#: A client gives up after this (the stacks' own timeouts are far longer): no answer by then
#: means it waited for a server timeout.
ANSWER_BOUND_S = 20.0
#: An explicit error must arrive within this: a refusal is immediate (well under a second),
#: an error that takes longer came from a timeout, not from the failed check.
ERROR_BOUND_S = 5.0
#: The stacks' bootstrap/waiting timeouts (shortened so a leg left waiting is freed soon).
SERVER_TIMEOUT_S = 60
#: The stacks' ``/health`` timeout (upstream's 20 s, shortened: a health check that waits for
#: it shows as an error after ERROR_BOUND_S either way, only sooner).
HEALTH_TIMEOUT_S = 8
#: The prefill's chunk size: prompts span several chunks, so an abort lands between them.
CHUNK = 32
#: ``late_write`` hold of the abort item's transfer on the prefill (seconds).
LATE_S = 1.0
POOL = 4096
CONTEXT = 1024
MAX_NEW = 8
PROMPT_VARIANTS = 3
MISMATCH = "hook_api_mismatch_total"
PREFIX = "sglang:pdsafe_"
#: Server log lines worth showing with a case, most telling first: crashes and audits, the
#: policy's first log of each failure, then the errors clients were answered with.
LOG_PATTERNS = (
    re.compile(r"Scheduler hit an exception|Traceback|\w+Error: |CRITICAL|allocator audit failed|"
               r"Health check failed|this server stopped admitting|memory leak"),
    re.compile(r"pdsafe hook \S+ failed"),
    re.compile(r"\] Error: "),
)
#: Refusals of a failed check name it like this (``policy.Failure.refusal``).
CHECK_FAILED_RE = re.compile(r"the (\S+) check could not run")


# =========================================================================== the hook table


@dataclass(frozen=True)
class HookInfo:
    """One declared hook, read from the source (no sglang import at collection time)."""

    name: str
    outcome: str  # refuse | hold | poison
    counter: str
    startup: bool  # its failure refuses the start: it runs only at startup
    module: str


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _hook_call(dec: ast.expr) -> ast.Call | None:
    """``dec`` if it is ``hook("name", ...)`` or ``policy.hook("name", ...)``."""
    if not isinstance(dec, ast.Call) or not dec.args:
        return None
    f = dec.func
    named = (isinstance(f, ast.Name) and f.id == "hook") or (
        isinstance(f, ast.Attribute) and f.attr == "hook")
    first = dec.args[0]
    return dec if named and isinstance(first, ast.Constant) and isinstance(first.value, str) \
        else None


def _literal_counter(expr: ast.expr | None, consts: dict[str, str]) -> str:
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return expr.value
    if isinstance(expr, ast.Name):
        return consts.get(expr.id, expr.id)
    if isinstance(expr, ast.Attribute):  # e.g. coverage.FAILED
        return f"{ast.unparse(expr)}"
    return "?"


def _module_consts(tree: ast.Module) -> dict[str, str]:
    """Module-level string constants, and names imported from a sibling module (as
    ``"module.NAME"``, resolved by :func:`catalog`)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node.value.value
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang.pdsafe"):
            for a in node.names:
                out.setdefault(a.asname or a.name, f"{node.module.rsplit('.', 1)[-1]}.{a.name}")
    return out


def catalog(root: Path = REPO) -> list[HookInfo]:
    """Every ``@hook``/``@policy.hook`` declared in ``root/python/sglang/pdsafe``, by name."""
    found: list[HookInfo] = []
    consts_by_module: dict[str, dict[str, str]] = {}
    for path in sorted((root / "python" / "sglang" / "pdsafe").glob("*.py")):
        tree = ast.parse(path.read_text())
        consts_by_module[path.stem] = _module_consts(tree)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for dec in node.decorator_list:
                call = _hook_call(dec)
                if call is None:
                    continue
                outcome = ast.unparse(_kw(call, "outcome") or ast.Constant("?"))
                on_failure = ast.unparse(_kw(call, "on_failure") or ast.Constant(""))
                found.append(HookInfo(
                    name=call.args[0].value, outcome=outcome.rsplit(".", 1)[-1].lower(),
                    counter=_literal_counter(_kw(call, "counter"), consts_by_module[path.stem]),
                    startup=on_failure.endswith("reraise_at_startup"), module=path.stem))
    for i, h in enumerate(found):  # counters named through another module's constant
        if "." in h.counter:
            mod, const = h.counter.split(".", 1)
            found[i] = HookInfo(h.name, h.outcome, consts_by_module.get(mod, {}).get(
                const, h.counter), h.startup, h.module)
    return sorted(found, key=lambda h: h.name)


#: Why the workload does not reach a runtime hook (the docs table's "not exercised" list).
NOT_REACHED_WHY: dict[str, str] = {
    "pair_agreement.published": "runs once, when a prefill starts (the settings it registers "
                                "with its bootstrap server)",
    "quarantine.dropped": "runs only when the KV pool is torn down "
                          "(release_memory_occupation)",
    "quarantine.peer_gone": "runs only when the heartbeat declares a prefill dead (a killed "
                            "prefill: test/pd/test_late_write.py's crash scenario)",
    "quarantine.refused": "runs only past the decode's quarantine limit (its door refuses)",
    "source_lease.room_poisoned": "runs only when a backend cannot prove a room drained "
                                  "(poison_deferred_ack_room)",
    "transfer_generation.stale_abort_ack": "runs only for an ABORT_ACK of an earlier "
                                           "reservation, or one arriving twice",
}


# =========================================================================== answers


@dataclass
class Answer:
    """What one client saw: the item and leg, HTTP status, the oracle's verdict, seconds to
    the answer, the error message (excerpt). ``strict``: it must be answered within
    :data:`ANSWER_BOUND_S` (the legs a client of the request reads)."""

    item: str
    leg: str
    status: int
    verdict: str  # identical | explicit_error | wrong_content | no_answer | answered
    seconds: float
    message: str = ""
    strict: bool = True

    @property
    def waited(self) -> bool:
        """No answer within the client's bound, or an error only after a timeout's time."""
        return self.verdict == "no_answer" or (
            self.verdict == "explicit_error" and self.seconds > ERROR_BOUND_S)


def _bounded(url: str, ids: list[int], timeout: float, **extra: Any) -> tuple[GenResult, float]:
    t0 = time.monotonic()
    try:
        r = generate(url, ids, MAX_NEW, timeout=timeout, **extra)
    except requests.Timeout:
        r = GenResult(0, [], {"error": {"message": f"no answer within {timeout:g}s"}},
                      timed_out=True)
    except requests.RequestException as e:
        r = GenResult(0, [], {"error": {"message": f"connection failed: {e}"}})
    return r, time.monotonic() - t0


def _judge(oracle: Oracle | None, item: str, leg: str, r: GenResult, secs: float,
           ids: list[int], strict: bool = True) -> Answer:
    msg = "" if r.ok else r.error_message[:400]
    if r.status == 0:
        verdict = "no_answer"
    elif oracle is None:
        verdict = "answered" if r.ok else ("explicit_error" if msg else "wrong_content")
    else:
        verdict = oracle.judge(r, ids, MAX_NEW).value
    return Answer(item, leg, r.status, verdict, round(secs, 3), msg, strict)


# =========================================================================== the stack


def _server_env(tag: str, control: Path, faults_spec: str) -> dict[str, str]:
    return {
        faults.ENV: faults_spec,
        "SGLANG_PDSAFE_TEST_FAULT_CONTROL": str(control),
        "SGLANG_PDSAFE_TEST_FAULT_TAG": tag,
        # Only POISON hooks poison (not the count of failures across cases).
        "SGLANG_PDSAFE_POISON_AFTER": "1000000",
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(SERVER_TIMEOUT_S),
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(SERVER_TIMEOUT_S),
        "SGLANG_HEALTH_CHECK_TIMEOUT": str(HEALTH_TIMEOUT_S),
    }


@dataclass
class FaultStack:
    """A PD stack (prefill, decode, router) whose servers run ``hook_fail``, and its control.

    Invariant: at most one stack runs per instance; ``control`` is written only through
    :meth:`write`, which waits until every live process applied it."""

    backend: str
    log_dir: Path
    model_path: Path
    stack: PDStack | None = None
    control_path: Path | None = None
    control: Control = field(default_factory=Control)
    starts: int = 0
    limits: Limits | None = None  # the decode's, read once per start
    #: The last case left the stack unusable (dead, or refusing the probe): restart it
    #: before the next case (lazily, so the last case of a run costs no restart).
    broken: bool = False
    aliases: int = 0  # prefill address spellings used (item_alias)
    _exit: ExitStack | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.stop()
        self.starts += 1
        cdir = self.log_dir / f"hook-fail-{self.backend}-{self.starts}"
        cdir.mkdir(parents=True, exist_ok=True)
        self.control_path = cdir / "control.json"
        self.control = Control()
        self.aliases = 0
        self.broken = False
        self.control.write(self.control_path)
        pcfg = ServerConfig(role="prefill", model_path=self.model_path, max_total_tokens=POOL,
                            context_length=CONTEXT,
                            extra_args=["--chunked-prefill-size", str(CHUNK)],
                            env=_server_env("prefill", self.control_path,
                                            f"hook_fail,late_write:{LATE_S:g}"))
        dcfg = ServerConfig(role="decode", model_path=self.model_path, max_total_tokens=POOL,
                            context_length=CONTEXT, env=_server_env(
                                "decode", self.control_path,
                                f"hook_fail,free_reserved,kv_corrupt,park_commit:{PARK_S:g}"))
        self._exit = ExitStack()
        try:
            self.stack = self._exit.enter_context(
                pd_stack(self.backend, self.log_dir, prefill=pcfg, decode=dcfg))
            self.limits = self.stack.decode.limits()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self._exit is not None:
            self._exit.close()
        self._exit, self.stack = None, None

    def restart(self) -> None:
        self.start()

    def alive(self) -> dict[str, bool]:
        """Whether each server process (and the router) still runs."""
        assert self.stack is not None and self.stack.router is not None
        return {"prefill": self.stack.prefill.process.alive(),
                "decode": self.stack.decode.process.alive(),
                "router": self.stack.router.process.alive()}

    # ------------------------------------------------------------------ control
    def statuses(self) -> list[dict[str, Any]]:
        """The status of every live process of the stack."""
        assert self.control_path is not None
        return [s for s in read_statuses(self.control_path) if _pid_alive(int(s["pid"]))]

    def write(self, *, armed: dict[str, str] | None = None, legacy: tuple[str, ...] = (),
              reset: bool = False, audit: bool = False, timeout: float = 10.0) -> list[str]:
        """Write the next control and wait until every live process applied it; the processes
        that did not within ``timeout`` (empty: all did)."""
        assert self.control_path is not None
        c = self.control
        if reset:
            self._remove_poison_records()
        self.control = Control(seq=c.seq + 1, armed=dict(armed or {}), legacy=legacy,
                               reset=c.reset + int(reset), audit=c.audit + int(audit))
        self.control.write(self.control_path)
        deadline = time.monotonic() + timeout
        while True:
            stale = [f"{s['tag']}:{s['pid']}" for s in self.statuses()
                     if s["seq"] < self.control.seq]
            if not stale or time.monotonic() > deadline:
                return stale
            time.sleep(0.02)

    def _remove_poison_records(self) -> None:
        for d in {s.get("state_dir") for s in self.statuses()} - {None}:
            try:
                os.unlink(os.path.join(d, "poison.json"))
            except FileNotFoundError:
                pass

    # ------------------------------------------------------------------ observations
    def _all_statuses(self) -> list[dict[str, Any]]:
        """Every process's last status, dead processes included (their counts stand)."""
        assert self.control_path is not None
        return read_statuses(self.control_path)

    def calls(self) -> dict[str, int]:
        return _sum_by_hook(self._all_statuses(), "calls")

    def injected(self) -> dict[str, int]:
        return _sum_by_hook(self._all_statuses(), "injected")

    def poisoned(self) -> dict[str, str]:
        return {f"{s['tag']}:{s['pid']}": s["poisoned"] for s in self.statuses()
                if s.get("poisoned")}

    def counters(self, names: list[str]) -> float:
        """Sum of the pdsafe counters ``names`` over both servers (their /metrics)."""
        assert self.stack is not None
        total = 0.0
        for server in (self.stack.prefill, self.stack.decode):
            try:
                samples = scrape(server.url, timeout=10)
            except requests.RequestException:
                continue
            total += sum_samples(samples, [f"{PREFIX}{n}" for n in names])
        return total

    def audits(self, timeout: float = 15.0) -> dict[str, dict[str, Any]]:
        """Ask every scheduler for an audit at its next quiet pass; its result by role."""
        self.write(audit=True)
        want = self.control.audit
        deadline = time.monotonic() + timeout
        while True:
            got = {s["tag"]: s["audit"] for s in self.statuses()
                   if s.get("audit") and s["audit"].get("seq", -1) >= want}
            if len(got) >= 2 or time.monotonic() > deadline:
                return got
            self._nudge()
            time.sleep(0.1)

    def violations(self, since: float = 0.0) -> list[dict[str, Any]]:
        """Every failed audit a process of the stack recorded at or after ``since`` (wall
        clock), dead processes included."""
        out = []
        for s in self._all_statuses():
            for v in s.get("violations", ()):
                if float(v.get("at", 0.0)) >= since:
                    out.append({"tag": s["tag"], "pid": s["pid"], **v})
        return out

    def fresh_alias(self) -> str:
        """A spelling of 127.0.0.1 this stack's decode has not seen (``127.0.0.01``,
        ``127.0.0.001``, ...: every resolver reads leading zeros away)."""
        self.aliases += 1
        return "127.0.0." + "0" * self.aliases + "1"

    def log_offsets(self) -> dict[str, int]:
        assert self.stack is not None
        return {"prefill": len(self.stack.prefill.process.log_text()),
                "decode": len(self.stack.decode.process.log_text())}

    def log_lines_since(self, offsets: dict[str, int], limit: int = 12) -> list[str]:
        """The lines that explain a case: its servers' log since ``offsets``, the most
        telling first (:data:`LOG_PATTERNS`), each distinct line once."""
        assert self.stack is not None
        lines = []
        for role, server in (("prefill", self.stack.prefill), ("decode", self.stack.decode)):
            text = server.process.log_text()[offsets.get(role, 0):]
            lines += [f"{role}: {ln[:400]}" for ln in text.splitlines()]
        out: list[str] = []
        for pattern in LOG_PATTERNS:
            for ln in lines:
                key = re.sub(r"\[[0-9: -]+\] ", "", ln)[:160]
                if pattern.search(ln) and all(key not in o for o in out):
                    out.append(ln)
        return out[:limit]

    def _nudge(self) -> None:
        """Wake sleeping schedulers (an idle scheduler polls its sockets once a second):
        ``/server_info`` asks each scheduler for its state."""
        assert self.stack is not None
        for server in (self.stack.prefill, self.stack.decode):
            try:
                requests.get(server.url + "/server_info", timeout=2)
            except requests.RequestException:
                pass


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped yet, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _sum_by_hook(statuses: list[dict[str, Any]], key: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in statuses:
        for name, n in s.get(key, {}).items():
            out[name] = out.get(name, 0) + int(n)
    return out


# =========================================================================== workload


@dataclass
class Workload:
    """The items' shared inputs: the stack, the oracle, prompts (a few fixed variants per
    item, so reference answers are computed once), a counter for fresh rids and rooms."""

    fs: FaultStack
    oracle: Oracle
    model_path: Path
    n: int = 0
    _prompts: dict[tuple[str, int, int | None], list[int]] = field(default_factory=dict)

    def prompt(self, item: str, k: int = 0, length: int | None = None) -> list[int]:
        key = (item, (self.n + k) % PROMPT_VARIANTS, length)
        if key not in self._prompts:
            rng = random.Random(f"{item}-{key[1]}-{length}")
            self._prompts[key] = random_prompt(rng, length or rng.randint(24, 72),
                                               self.model_path)
        return self._prompts[key]

    @property
    def stack(self) -> PDStack:
        assert self.fs.stack is not None
        return self.fs.stack

    def boot(self, room: int, host: str = "127.0.0.1") -> dict[str, Any]:
        return {"bootstrap_host": host,
                "bootstrap_port": self.stack.prefill.bootstrap_port, "bootstrap_room": room}

    def direct(self, item: str, ids: list[int], room: int, *, strict_prefill: bool = True,
               timeout: float = ANSWER_BOUND_S, host: str = "127.0.0.1",
               **extra: Any) -> list[Answer]:
        """One request sent to both legs directly (what the router does), judged."""
        out: dict[str, Answer] = {}

        def leg(name: str, url: str) -> None:
            r, secs = _bounded(url, ids, timeout, **self.boot(room, host), **extra)
            out[name] = _judge(self.oracle if name == "decode" else None, item, name, r, secs,
                               ids, strict=(name == "decode" or strict_prefill))

        ts = [threading.Thread(target=leg, args=("prefill", self.stack.prefill.url)),
              threading.Thread(target=leg, args=("decode", self.stack.decode.url))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return [out["prefill"], out["decode"]]


def _room() -> int:
    return random.randrange(1 << 62)


def item_router(w: Workload) -> list[Answer]:
    """Two normal greedy requests through the router, concurrently."""
    prompts = [w.prompt("router", k) for k in range(2)]
    for p in prompts:
        w.oracle.expected(p, MAX_NEW)

    def one(p: list[int]) -> Answer:
        assert w.stack.router is not None
        r, secs = _bounded(w.stack.router.url, p, ANSWER_BOUND_S)
        return _judge(w.oracle, "router", "router", r, secs, p)

    with ThreadPoolExecutor(2) as ex:
        return list(ex.map(one, prompts))


def item_direct(w: Workload) -> list[Answer]:
    """One normal request to both legs directly, with a client-chosen room."""
    p = w.prompt("direct")
    w.oracle.expected(p, MAX_NEW)
    return w.direct("direct", p, _room())


def item_duplicate(w: Workload) -> list[Answer]:
    """Two requests sharing one client-chosen bootstrap_room, both legs each, concurrently
    (the room guard's path). A prefill leg whose duplicate was refused on decode may wait for
    its bootstrap timeout (a known limit, test_room_guard.py): not strict."""
    room = _room()
    prompts = [w.prompt("duplicate", k) for k in range(2)]
    for p in prompts:
        w.oracle.expected(p, MAX_NEW)
    with ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(w.direct, "duplicate", p, room, strict_prefill=False)
                for p in prompts]
        return [a for f in futs for a in f.result()]


def item_overlong(w: Workload) -> list[Answer]:
    """A prompt over the servers' limit: through the router and to both legs directly."""
    assert w.fs.limits is not None and w.stack.router is not None
    ids = w.prompt("overlong", 0, length=w.fs.limits.max_req_input_len + 8)
    r, secs = _bounded(w.stack.router.url, ids, ANSWER_BOUND_S)
    out = [_judge(None, "overlong", "router", r, secs, ids)]
    return out + w.direct("overlong", ids, _room())


def item_rejected(w: Workload) -> list[Answer]:
    """A request each scheduler rejects at intake (``logprob_start_len`` past the prompt):
    the rejection is recorded and each leg tells the other (the placeholder guard, the peer
    notices of both doors)."""
    ids = w.prompt("rejected")
    return w.direct("rejected", ids, _room(), return_logprob=True,
                    logprob_start_len=len(ids) + 4)


def item_info(w: Workload) -> list[Answer]:
    """``/model_info``, ``/server_info`` and ``/health`` of both servers, concurrently. Any
    non-200 status is an explicit answer (``/health`` says unhealthy by its status)."""

    def get(leg: str, url: str, path: str) -> Answer:
        t0 = time.monotonic()
        try:
            r = requests.get(url + path, timeout=ANSWER_BOUND_S)
            status, body = r.status_code, r.text
        except requests.RequestException as e:
            status, body = 0, str(e)
        verdict = "no_answer" if status == 0 else "answered" if status == 200 \
            else "explicit_error"
        return Answer("info", f"{leg}{path}", status, verdict,
                      round(time.monotonic() - t0, 3), "" if status == 200 else body[:400])

    jobs = [(leg, server.url, path)
            for leg, server in (("prefill", w.stack.prefill), ("decode", w.stack.decode))
            for path in ("/model_info", "/server_info", "/health")]
    with ThreadPoolExecutor(len(jobs)) as ex:
        return list(ex.map(lambda j: get(*j), jobs))


def _late_write_events(w: Workload, room: int, offset: int, event: str,
                       timeout: float) -> bool:
    """Wait until the prefill logged ``late_write`` ``event`` for ``room`` (after ``offset``
    characters of its log); whether it did within ``timeout``."""
    log = w.stack.prefill.process
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(e.room == room and e.event == event
               for e in faults.parse_late_write_log(log.log_text()[offset:])):
            return True
        time.sleep(0.05)
    return False


def _abort(w: Workload, leg: str, url: str, rid: str) -> Answer:
    t0 = time.monotonic()
    try:
        a = requests.post(url + "/abort_request", json={"rid": rid}, timeout=ANSWER_BOUND_S)
        return Answer("abort", f"{leg}/abort_request", a.status_code,
                      "answered" if a.ok else "explicit_error",
                      round(time.monotonic() - t0, 3), "" if a.ok else a.text[:400])
    except requests.RequestException as e:
        return Answer("abort", f"{leg}/abort_request", 0, "no_answer",
                      round(time.monotonic() - t0, 3), str(e))


def _aborted(w: Workload, item: str, leg: str) -> list[Answer]:
    """A request whose prefill holds its first KV chunk (``late_write``) is aborted on ``leg``
    meanwhile, and a second request of the same room arrives while the first holds it;
    waits until the held write landed and the decode's quarantine let the pages go."""
    ids = w.prompt(item, 0, length=4 * CHUNK + 5)
    dup = w.prompt(item, 1)
    rid = f"hf-{item}-{uuid.uuid4().hex}"
    room = faults.late_room(random.randrange(faults.ROOM_RANGE_WIDTH))
    offset = len(w.stack.prefill.process.log_text())
    victim = w.stack.decode if leg == "decode" else w.stack.prefill
    with ThreadPoolExecutor(2) as ex:
        fut = ex.submit(w.direct, item, ids, room, timeout=ANSWER_BOUND_S + LATE_S, rid=rid)
        _late_write_events(w, room, offset, "held", 5.0)
        dups = w.direct(item, dup, room)  # the room is live on both legs: refused (409)
        aborted = _abort(w, leg, victim.url, rid)
        legs = fut.result()
    for a in legs + dups:  # aborted or refused: errors, not the oracle's business
        if a.status != 200 and a.verdict == "wrong_content":
            a.verdict = "explicit_error"
    _late_write_events(w, room, offset, "done", LATE_S + 5.0)
    time.sleep(0.3)  # the drain ACK follows the write
    return legs + dups + [aborted]


def item_abort(w: Workload) -> list[Answer]:
    """Aborted on the decode while the prefill's write is held: the decode quarantines the
    pages until the drain ACK, the prefill drops the chunks not yet posted."""
    return _aborted(w, "abort", "decode")


def item_abort_prefill(w: Workload) -> list[Answer]:
    """Aborted on the prefill while its write is held: the sender's abort reaches the
    decode."""
    return _aborted(w, "abort_prefill", "prefill")


def item_moved(w: Workload) -> list[Answer]:
    """A request one of whose reserved decode pages is freed under its transfer
    (``free_reserved``): decode's commit must refuse it and its release must not free that
    page again."""
    ids = w.prompt("moved")
    w.oracle.expected(ids, MAX_NEW)
    return w.direct("moved", ids, _room(), rid=f"{faults.FREE_RESERVED_PREFIX}{uuid.uuid4().hex}")


def item_corrupt(w: Workload) -> list[Answer]:
    """A request whose KV bytes change in flight (``kv_corrupt``): the decode's digest
    refuses it (the mismatch path of the KV digest and its breaker)."""
    ids = w.prompt("corrupt")
    w.oracle.expected(ids, MAX_NEW)
    return w.direct("corrupt", ids, _room(), rid=f"{faults.CORRUPT_PREFIX}bit-{uuid.uuid4().hex}")


def item_alias(w: Workload) -> list[Answer]:
    """A request naming its prefill by an address this decode has not paired with yet (a
    spelling of 127.0.0.1 used once per stack): the decode pairs with it again (settings
    fetched and compared, the wire version announced, the registration, the incarnation)."""
    ids = w.prompt("alias")
    w.oracle.expected(ids, MAX_NEW)
    host = w.fs.fresh_alias()
    return w.direct("alias", ids, _room(), host=host)


#: How long the decode parks a ``parked_duplicate`` request between its transfer's Success and
#: its commit (the test fault ``park_commit``; only rids with its prefix are parked).
PARK_S = 6.0


def item_parked_duplicate(w: Workload) -> list[Answer]:
    """A request whose transfer succeeded but which the decode has not committed yet (parked
    by the test fault ``park_commit``), and a second request of the same room sent in that
    window, to both legs directly. The room is live on both servers, so the room guard must
    refuse the second (409); a guard that let it in would have the second receiver share the
    first one's Success, and upstream's decode scheduler dies on it ("Unexpected poll case:
    4"), taking every request with it. Not a calibration item: only the legacy room-claim
    case runs it (it waits for the park)."""
    room = _room()
    first_ids, second_ids = w.prompt("parked", 0), w.prompt("parked", 1)
    for p in (first_ids, second_ids):
        w.oracle.expected(p, MAX_NEW)
    rid = f"{faults.PARK_PREFIX}{uuid.uuid4().hex}"

    def parked() -> bool:
        return any(e.rid == rid and e.event == "parked"
                   for e in faults.parse_park_log(w.stack.decode.process.log_text()))

    with ThreadPoolExecutor(1) as ex:
        first = ex.submit(w.direct, "parked", first_ids, room, rid=rid)
        deadline = time.monotonic() + ANSWER_BOUND_S
        while not parked() and not first.done() and time.monotonic() < deadline:
            time.sleep(0.05)
        second = w.direct("parked", second_ids, room, strict_prefill=False)
        return first.result() + second


#: Items only the legacy demonstrations run (never calibrated, never in a hook's case).
LEGACY_ITEMS: dict[str, Callable[[Workload], list[Answer]]] = {
    "parked_duplicate": item_parked_duplicate,
}


#: The workload items, by name, cheapest first.
ITEMS: dict[str, Callable[[Workload], list[Answer]]] = {
    "info": item_info,
    "overlong": item_overlong,
    "rejected": item_rejected,
    "router": item_router,
    "direct": item_direct,
    "duplicate": item_duplicate,
    "moved": item_moved,
    "corrupt": item_corrupt,
    "abort": item_abort,
    "abort_prefill": item_abort_prefill,
    "alias": item_alias,
}


def run_items(w: Workload, names: list[str]) -> list[Answer]:
    """Run the named items: ``info`` first and alone (``/health`` answers 200 as soon as any
    output arrives, so other traffic would mask its own check), then the others
    concurrently; every answer."""
    w.n += 1
    out = ITEMS["info"](w) if "info" in names else []
    rest = [n for n in names if n != "info"]
    with ThreadPoolExecutor(max(1, len(rest))) as ex:
        futs = [ex.submit(ITEMS.get(n) or LEGACY_ITEMS[n], w) for n in rest]
        return out + [a for f in futs for a in f.result()]


def calibrate(w: Workload) -> dict[str, set[str]]:
    """Which hooks each item reaches (calls moved while it ran alone, nothing armed)."""
    reach: dict[str, set[str]] = {}
    for name in ITEMS:
        before = w.fs.calls()
        run_items(w, [name])
        time.sleep(0.3)  # the status files trail the calls by a poll
        after = w.fs.calls()
        reach[name] = {h for h, n in after.items() if n > before.get(h, 0)}
    return reach


# =========================================================================== cases


@dataclass
class CaseResult:
    """One case: what was armed, what every client saw, and what the stack looked like after."""

    backend: str
    hook: str
    mode: str
    outcome: str  # declared: refuse | hold | poison
    counter: str
    legacy: list[str]
    items: list[str]
    injected: int = 0
    counter_delta: float = 0.0
    answers: list[Answer] = field(default_factory=list)
    probe: list[Answer] = field(default_factory=list)
    poisoned: dict[str, str] = field(default_factory=dict)
    alive: dict[str, bool] = field(default_factory=dict)
    audits: dict[str, Any] = field(default_factory=dict)
    violations: list[dict[str, Any]] = field(default_factory=list)
    restarted: bool = False
    held_rows: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    note: str = ""
    log_excerpt: list[str] = field(default_factory=list)

    @property
    def reached(self) -> bool:
        return self.injected > 0

    def problems(self) -> list[str]:
        """The suite's verdict on this case (empty: it passed)."""
        out = []
        for a in self.answers + self.probe:
            if a.verdict == "wrong_content":
                out.append(f"WRONG CONTENT: {a.item}/{a.leg} HTTP {a.status} {a.message[:160]}")
            elif a.waited and a.strict:
                got = (f"no answer within {ANSWER_BOUND_S:g}s" if a.verdict == "no_answer"
                       else f"HTTP {a.status} only after {a.seconds:.1f}s "
                            f"({a.message[:120] or 'no reason given'})")
                out.append(f"waited for a timeout: {a.item}/{a.leg}: {got}")
            elif a.verdict == "explicit_error" and a.strict and not _explains(a.message):
                out.append(f"error without a reason: {a.item}/{a.leg} HTTP {a.status} "
                           f"{a.message[:80]!r}")
        dead = [k for k, v in self.alive.items() if not v]
        if dead:
            out.append(f"server died: {', '.join(dead)}")
        for v in self.violations:
            out.append(f"allocator audit ({v['tag']}): {'; '.join(v['problems'])}")
        for tag, a in self.audits.items():
            if a and not a.get("ok", True):
                out.append(f"allocator audit ({tag}) after the case: {'; '.join(a['problems'])}")
        if self.reached and not dead and self.counter_delta < 1:
            out.append(f"{self.injected} injected failures, counter {self.counter} moved "
                       f"{self.counter_delta:g}: a failure was not counted")
        if self.reached and (self.outcome == "poison") != bool(self.poisoned):
            out.append(f"declared outcome {self.outcome}, but poisoned: {self.poisoned or 'no'}")
        return out

    def summary(self) -> dict[str, Any]:
        """The row of the docs table (see scripts/hook-failure-table.py)."""
        errors = [a for a in self.answers if a.verdict == "explicit_error"]
        by_check = [a for a in errors if CHECK_FAILED_RE.search(a.message)]
        statuses: dict[str, int] = {}
        for a in errors:
            statuses[str(a.status)] = statuses.get(str(a.status), 0) + 1
        strict_errors = [a.seconds for a in by_check if a.strict]
        return {
            "backend": self.backend, "hook": self.hook, "mode": self.mode,
            "outcome": self.outcome, "reached": self.reached, "injected": self.injected,
            "counter": self.counter, "counter_delta": self.counter_delta,
            "served": sum(a.verdict == "identical" for a in self.answers),
            "errors": len(errors), "error_statuses": statuses,
            "refused_by_check": len(by_check),
            "message": (by_check or errors or [Answer("", "", 0, "", 0.0)])[0].message[:200],
            "max_error_s": max(strict_errors, default=None),
            "waited": sum(a.waited and a.strict for a in self.answers + self.probe),
            "waited_not_strict": sum(a.waited and not a.strict for a in self.answers),
            "wrong": sum(a.verdict == "wrong_content" for a in self.answers + self.probe),
            "poisoned": bool(self.poisoned), "alive": all(self.alive.values()),
            "audit_ok": not self.violations and all(
                a.get("ok", True) for a in self.audits.values() if a),
            "held_rows": self.held_rows, "restarted": self.restarted,
            "probe_ok": all(a.verdict == "identical" for a in self.probe),
            "items": self.items, "legacy": self.legacy, "seconds": round(self.seconds, 1),
            "problems": self.problems(), "note": self.note,
        }

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["summary"] = self.summary()
        return d


#: Error bodies that name no reason (the server's generic status texts).
GENERIC = {"", "internal server error", "service unavailable", "bad request", "not found"}


def _explains(message: str) -> bool:
    """Whether an error message says why (not just a generic status text)."""
    return message.strip().strip('"').strip().lower() not in GENERIC


def _held(audits: dict[str, dict[str, Any]]) -> dict[str, int]:
    return {tag: int(a.get("rows", {}).get("held", 0)) for tag, a in audits.items() if a}


def run_case(w: Workload, hook: HookInfo, mode: str, items: list[str], *,
             legacy: tuple[str, ...] = (), also: tuple[str, ...] = ()) -> CaseResult:
    """Arm ``hook`` (``mode``), run ``items``, disarm, probe, audit (see the module doc).
    ``also``: further hooks armed in the same mode (a legacy demonstration that restores
    several old defaults at once); the case's counts are ``hook``'s."""
    fs = w.fs
    res = CaseResult(fs.backend, hook.name, mode, hook.outcome, hook.counter, list(legacy),
                     list(items))
    t0 = time.monotonic()
    if fs.broken:
        fs.restart()
    since = time.time()
    offsets = fs.log_offsets()
    inj0 = fs.injected().get(hook.name, 0)
    c0 = fs.counters([hook.counter, MISMATCH])
    stale = fs.write(armed={name: mode for name in (hook.name, *also)}, legacy=legacy,
                     reset=True)
    try:
        res.answers = run_items(w, items)
    finally:
        stale += fs.write(armed={}, legacy=legacy)
    if stale:
        res.note = f"control not applied by {sorted(set(stale))} (dead or stuck)"
    time.sleep(2 * 0.05)  # let the status files catch up with the last calls
    res.injected = fs.injected().get(hook.name, 0) - inj0
    res.poisoned = fs.poisoned()
    res.alive = fs.alive()
    if all(res.alive.values()):
        res.counter_delta = fs.counters([hook.counter, MISMATCH]) - c0
        fs.write(reset=True)  # forget the poison: the probe asks whether the stack serves
        res.probe, repaired = _probe(w)
        if repaired:
            res.note = (res.note + "; " if res.note else "") + (
                "the probe was refused until the decode paired with its prefill again")
        res.audits = fs.audits()
        res.held_rows = _held(res.audits)
    res.violations = fs.violations(since)
    res.log_excerpt = fs.log_lines_since(offsets)
    res.alive = fs.alive()
    fs.broken = res.restarted = not all(res.alive.values()) or not _served(res.probe)
    res.seconds = time.monotonic() - t0
    return res


def _served(answers: list[Answer]) -> bool:
    return bool(answers) and all(a.verdict == "identical" for a in answers)


def _probe(w: Workload) -> tuple[list[Answer], bool]:
    """Does the stack serve again, disarmed and reset? A request through the router; if it is
    refused, the decode pairs with its prefill once more (a failed announcement or
    registration is forgotten by the next one) and the router is asked again. Returns the
    (last) probe's answers and whether that re-pairing was needed."""
    probe = item_router(w)
    if _served(probe) or not all(w.fs.alive().values()):
        return probe, False
    item_alias(w)
    return item_router(w), True


def select_items(reach: dict[str, set[str]], hook: str) -> list[str]:
    """The items that reached ``hook`` in the calibration (in :data:`ITEMS` order)."""
    return [name for name in ITEMS if hook in reach.get(name, set())]


def write_results(path: Path, results: list[CaseResult], extra: dict[str, Any]) -> None:
    """The suite's results file (read by scripts/hook-failure-table.py)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**extra, "cases": [r.to_json() for r in results]}, indent=1,
                               default=str))


def iter_cases(hooks: list[HookInfo], backends: tuple[str, ...],
               modes: Callable[[str], tuple[str, ...]]) -> Iterator[tuple[str, HookInfo, str]]:
    """(backend, hook, mode) of every runtime case, backend first (one stack at a time)."""
    for backend in backends:
        for h in hooks:
            if h.startup:
                continue
            for mode in modes(backend):
                yield backend, h, mode
