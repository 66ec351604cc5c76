"""Real SGLang servers on CPU for content tests: co-located reference, PD pairs, the PD router.

Used by the pytest fixtures (test/conftest.py) and by benchmark/. Every process listens on
127.0.0.1 only and every transport is pinned to loopback (see ``server_env``).

Invariants:

* A process started here is always stopped (its whole process group) by ``stop()`` or by the
  context manager, also when startup fails; failures raise with the tail of the process's log.
* Servers get explicit ``--max-total-tokens`` (uncapped pools take GBs on CPU) and a page size,
  so tests control page reuse.
* The harness adds no sglang-pdsafe option: a PD server runs the default configuration. A PD
  server whose KV pool is smaller than its context length refuses to start (the capacity
  invariant), so PD configs with small pools set ``context_length`` no larger than the pool
  (the operator's documented remedy); only tests about the clamp pass its flag.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from pdsafe_testkit.loopback import bind_conflict, reserve_port, transport_pins
from pdsafe_testkit.metrics import metric_total


def _repo_root() -> Path:
    """The sglang-pdsafe checkout this (editable) testkit lives in (test/testkit/...)."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "upstream.lock").is_file() and (parent / "test" / "assets").is_dir():
            return parent
    return here.parents[3]


REPO = _repo_root()
#: The tiny CPU model the tests run (scripts/make_tiny_model.py); PDSAFE_MODEL overrides it.
DEFAULT_MODEL = Path(os.environ.get("PDSAFE_MODEL") or REPO / "test" / "assets" / "tiny-copy-llama")
# KV pools of the shared PD stacks: small, so pages are reused within a few requests.
SHARED_DECODE_POOL = 1024
SHARED_PREFILL_POOL = 1024
STARTUP_TIMEOUT_S = float(os.environ.get("PDSAFE_STARTUP_TIMEOUT", "300"))


def skip_pair_check(*fields: str) -> dict[str, str]:
    """Decode env for a test stack whose legs deliberately differ in a setting that pair
    agreement compares (``sglang.pdsafe.pair_agreement``): such a stack tests the defences
    behind that check (peer release, coverage attestation), so it opts out of exactly those
    fields, as an operator would, with the startup warning the opt-out logs."""
    return {"SGLANG_PDSAFE_PAIR_AGREEMENT_SKIP": ",".join(fields)}


#: The cluster key of every test server (a test-only value; production draws 32 random bytes).
CLUSTER_KEY_ENV = "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN"
TEST_CLUSTER_KEY = "pdsafe-test-cluster-key-8f14e45fceea167a5a36dedd4bea2543"


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The complete environment of a server or router process: a copy of ``os.environ`` with
    the CPU engine, every transport pinned to loopback, one OMP thread, plus ``extra``.

    (Compare ``kv.kv_child_env``: only the overrides a KV harness child applies itself.)"""
    env = dict(os.environ)
    env.update(
        {
            "SGLANG_USE_CPU_ENGINE": "1",
            **transport_pins(),
            # Few threads per server: several servers share 2 cores, and a fixed thread
            # count keeps float reductions identical between the reference and PD servers.
            "OMP_NUM_THREADS": env.get("PDSAFE_OMP_THREADS", "1"),
            # A stop signals the whole process group: upstream then takes its children's
            # exit for a crash and sleeps 5 s before its py-spy / CUDA core-dump diagnostics
            # (neither applies here). Off: a server stops in about a second, not six, which
            # over the suite's ~90 server stops is minutes of CI (README, Measurements).
            "SGLANG_PYSPY_DUMP_BEFORE_CRASH": env.get("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "0"),
            "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": env.get("SGLANG_CUDA_COREDUMP_BEFORE_CRASH",
                                                         "0"),
        }
    )
    # Every test server holds the same cluster key, as a production fleet should: the PD legs
    # sign their control messages (sglang.pdsafe.control_mac), so every server test runs the
    # signed path. A test that needs a server without it passes this variable as "" in extra.
    env.setdefault(CLUSTER_KEY_ENV, TEST_CLUSTER_KEY)
    if extra:
        env.update(extra)
    return env


#: How often a starting server's /health (and a starting router's first generation) is polled:
#: a second's poll cost half a second per start on average, over about a hundred starts.
POLL_S = 0.25


class StartupError(RuntimeError):
    """A server did not become healthy; the message carries its log tail."""


class PortTaken(StartupError):
    """Another process bound one of the server's ports first (retry on fresh ports)."""


#: The one line a server process leaves when gRPC's event engine kills it at startup (seen a few
#: times in many CI runs, on gRPC and HTTP servers alike; the same server starts right after).
SPURIOUS_EXIT = "epoll_wait error: Bad file descriptor"


class DiedSpuriously(StartupError):
    """The server exited at startup with only :data:`SPURIOUS_EXIT` in its log (retry once)."""


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the test process dies (a killed test run,
    a ``timeout`` that ends a suite, must not leave servers holding ports, memory and CPU
    on a shared machine). Linux only; elsewhere servers are stopped by the fixtures alone."""
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class ManagedProcess:
    """One child process in its own session, with its output in a log file."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, process_group=0,
            # The parent-death signal follows the spawning *thread*: only the main thread's
            # children get it (a benchmark starts stacks from worker threads that exit).
            preexec_fn=(_die_with_parent
                        if threading.current_thread() is threading.main_thread() else None),
        )
        log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        keep = [ln for ln in lines if "warnings.warn" not in ln and "Warning:" not in ln]
        return "\n".join(keep[-n:])

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def kill(self) -> None:
        """SIGKILL the whole process group at once, as a crash would (no cleanup runs)."""
        if self.proc is None:
            return
        try:
            os.killpg(os.getpgid(self.proc.pid), signal.SIGKILL)
        except ProcessLookupError:
            return
        self.proc.wait(timeout=30)

    def stop(self, timeout: float = 20.0) -> None:
        """Stop the process and its whole process group (schedulers, detokenizer...)."""
        if self.proc is None:
            return
        try:
            pgid = os.getpgid(self.proc.pid)
        except ProcessLookupError:
            pgid = None
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            if pgid is not None:
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        if pgid is not None:  # reap stragglers of the group
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _thread_ticks(pid: int) -> dict[int, int]:
    """CPU ticks (user+system) of every thread of ``pid`` and its descendants."""
    out: dict[int, int] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                out[int(task.name)] = int(fields[11]) + int(fields[12])
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return out


def deprioritise_busy_pollers(pid: int, sample_s: float = 0.5) -> list[int]:
    """Renice to 19 the threads of an idle server that still burn a core.

    NIXL's UCX progress thread polls with no delay (``nixl_agent`` hard-codes ``pthrDelay =
    0``), so every NIXL server keeps one core busy while idle. On a 2-core CI machine two such
    threads starve the servers that do work. Niced, they still progress transfers (the
    kernel runs them whenever a core is free) but no longer compete on equal terms. Sampled
    right after /health answers, when the server is idle: only a busy poller is busy then.
    """
    if not hasattr(os, "setpriority"):
        return []
    before = _thread_ticks(pid)
    time.sleep(sample_s)
    after = _thread_ticks(pid)
    hz = os.sysconf("SC_CLK_TCK")
    busy = [t for t, n in after.items() if (n - before.get(t, n)) / hz > 0.5 * sample_s]
    for tid in busy:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 19)
        except OSError:
            pass
    return busy


def wait_healthy(proc: ManagedProcess, url: str, path: str = "/health",
                 timeout: float = STARTUP_TIMEOUT_S, ports: set[int] | None = None) -> None:
    """Poll ``url+path`` until it answers 200; raise StartupError with the log otherwise.

    With ``ports``, a log line saying one of them could not be bound raises PortTaken at once
    (uvicorn logs the bind error and then hangs instead of exiting)."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if ports:
            conflict = bind_conflict(proc.log_text(), ports)
            if conflict:
                raise PortTaken(f"{proc.name}: a port was taken before it bound it: {conflict}")
        if not proc.alive():
            text = proc.log_text()
            cls = DiedSpuriously if SPURIOUS_EXIT in text and "ready to roll" not in text \
                and "Traceback" not in text else StartupError
            raise cls(f"{proc.name} exited during startup:\n{proc.log_tail()}")
        try:
            r = requests.get(url + path, timeout=5)
            if r.status_code == 200:
                if proc.proc is not None and "nixl" in proc.argv:
                    deprioritise_busy_pollers(proc.proc.pid)
                return
            last = f"{r.status_code} {r.text[:200]}"
        except requests.RequestException as e:
            last = str(e)[:200]
        time.sleep(POLL_S)
    raise StartupError(f"{proc.name} not healthy after {timeout:.0f}s ({last}):\n{proc.log_tail()}")


@dataclass
class ServerConfig:
    """What one sglang server runs with. ``role``: colocated | prefill | decode."""

    role: str
    model_path: Path = DEFAULT_MODEL
    backend: str = "mooncake"
    max_total_tokens: int = 4096
    page_size: int = 1
    context_length: int | None = None
    allow_auto_truncate: bool = False
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    #: Start under upstream's own ``spawn`` start method, not through the forkserver of
    #: ``pdsafe_testkit.launch`` (its docstring says what that changes and why it is safe).
    upstream_spawn: bool = False

    def launcher(self) -> list[str]:
        """The command that starts this server, before its arguments."""
        if self.upstream_spawn or os.environ.get("PDSAFE_SERVER_START") == "spawn":
            return [sys.executable, "-m", "sglang.launch_server"]
        return [sys.executable, "-m", "pdsafe_testkit.launch"]


@dataclass
class SGLangServer:
    """A running ``python -m sglang.launch_server`` on 127.0.0.1."""

    config: ServerConfig
    port: int
    process: ManagedProcess
    bootstrap_port: int | None = None
    log_dir: Path | None = None
    #: How often :func:`restart_server` started it again on its ports.
    restarts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ports(self) -> set[int]:
        return {p for p in (self.port, self.bootstrap_port) if p is not None}

    def stop(self) -> None:
        self.process.stop()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the Prometheus metric ``name`` on this server (see ``metrics.metric_total``)."""
        return metric_total(self.url, name, **labels)

    def limits(self) -> Limits:
        """The prompt limits this server advertises now (``/model_info``)."""
        return Limits.of(self.url)

    def server_info(self) -> dict[str, Any]:
        return requests.get(self.url + "/server_info", timeout=10).json()


PORT_ATTEMPTS = 3


def launch_server(cfg: ServerConfig, log_dir: Path, *, wait: bool = True) -> SGLangServer:
    """Start one server; with ``wait`` return only once it answers /health (see wait_server)."""
    server = _spawn_server(cfg, log_dir)
    if wait:
        wait_server(server)
    return server


def wait_server(server: SGLangServer) -> None:
    """Wait until ``server`` answers /health; stop it if it never does.

    If another process took one of its ports first, restart it on fresh ports (up to
    PORT_ATTEMPTS starts in all); ``server.port`` and ``server.url`` then change. A process
    that died at startup leaving only :data:`SPURIOUS_EXIT` is restarted the same way, once.
    Call this before anything (a router) is given the server's ports."""
    spurious = 0
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            wait_healthy(server.process, server.url, ports=server.ports)
            return
        except (PortTaken, DiedSpuriously) as e:
            server.process.stop()
            if isinstance(e, DiedSpuriously):
                spurious += 1
                print(f"{server.process.name}: {SPURIOUS_EXIT!r} at startup, starting it again")
            if attempt == PORT_ATTEMPTS or spurious > 1:
                raise
            assert server.log_dir is not None
            fresh = _spawn_server(server.config, server.log_dir)
            server.port, server.bootstrap_port = fresh.port, fresh.bootstrap_port
            server.process = fresh.process
        except BaseException:
            server.process.stop()
            raise


def restart_server(server: SGLangServer, *, wait: bool = True) -> SGLangServer:
    """Start ``server`` again, a new process on the same ports, after it was stopped or
    killed (a prefill then registers with its bootstrap server as a new process incarnation,
    at the address decodes already know). Its log goes to a new file (``NAME-restartN.log``);
    ``server.process`` is replaced in place, so whoever holds ``server`` stops the new process.

    No retry on fresh ports (the point is the same address): a port taken in the meantime
    raises :class:`PortTaken`. With ``wait``, returns once it answers /health."""
    if server.process.alive():
        raise RuntimeError(f"{server.process.name} is still running; stop or kill it first")
    assert server.log_dir is not None
    server.restarts += 1
    fresh = _spawn_server(server.config, server.log_dir, port=server.port,
                          bootstrap_port=server.bootstrap_port,
                          suffix=f"-restart{server.restarts}")
    server.process = fresh.process
    if wait:
        try:
            wait_healthy(server.process, server.url, ports=server.ports)
        except BaseException:
            server.process.stop()
            raise
    return server


def _spawn_server(cfg: ServerConfig, log_dir: Path, *, port: int | None = None,
                  bootstrap_port: int | None = None, suffix: str = "") -> SGLangServer:
    """Start the process of ``cfg`` (fresh ports unless given; ``suffix`` ends its name)."""
    port = reserve_port() if port is None else port
    argv = [
        *cfg.launcher(),
        "--model-path", str(cfg.model_path),
        "--host", "127.0.0.1", "--port", str(port),
        "--device", "cpu", "--dtype", "float32",
        "--max-total-tokens", str(cfg.max_total_tokens),
        "--page-size", str(cfg.page_size),
        "--random-seed", "0",
        "--enable-metrics",
        "--log-level", "info",
        # An idle scheduler otherwise spins a core; the harness keeps several stacks alive on
        # a 2-core machine. It sleeps only when fully idle (no PD queue holds a request).
        "--sleep-on-idle",
    ]
    if cfg.context_length:
        argv += ["--context-length", str(cfg.context_length)]
    if cfg.allow_auto_truncate:
        argv += ["--allow-auto-truncate"]
    if cfg.role in ("prefill", "decode"):
        argv += [
            "--disaggregation-mode", cfg.role,
            "--disaggregation-transfer-backend", cfg.backend,
        ]
        if cfg.role == "prefill":
            bootstrap_port = reserve_port() if bootstrap_port is None else bootstrap_port
            argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
        else:
            argv += ["--disaggregation-decode-retraction-backup", "none"]
    if cfg.role != "prefill":
        bootstrap_port = None
    argv += cfg.extra_args
    name = f"{cfg.role}-{cfg.backend if cfg.role != 'colocated' else 'ref'}-{port}{suffix}"
    proc = ManagedProcess(name, argv, server_env(cfg.env), log_dir / f"{name}.log")
    proc.start()
    return SGLangServer(cfg, port, proc, bootstrap_port, log_dir)


@dataclass
class Router:
    """The real PD router (``smg launch --pd-disaggregation``) in front of a PD pair."""

    port: int
    process: ManagedProcess

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.process.stop()


def launch_router(prefill: SGLangServer, decode: SGLangServer, log_dir: Path) -> Router:
    """Start the router in front of a healthy pair (on fresh ports if one was taken)."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            return _launch_router_once(prefill, decode, log_dir)
        except PortTaken:
            if attempt == PORT_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


def _launch_router_once(prefill: SGLangServer, decode: SGLangServer, log_dir: Path) -> Router:
    port, metrics_port = reserve_port(), reserve_port()
    smg = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")
    if smg is None:
        raise StartupError("the `smg` router is not installed (pip install smg; see README)")
    argv = [
        smg, "launch", "--pd-disaggregation",
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--prefill", prefill.url, str(prefill.bootstrap_port),
        "--decode", decode.url,
        "--policy", "round_robin",
        # Tests judge every answer: no silent re-sends, and no circuit breaker or strict health
        # timeouts that a loaded 2-core machine trips while the workers are merely slow.
        "--disable-retries", "--disable-circuit-breaker",
        "--health-check-timeout-secs", "30", "--health-failure-threshold", "20",
        "--worker-startup-timeout-secs", "600",
    ]
    proc = ManagedProcess(f"router-{port}", argv, server_env(), log_dir / f"router-{port}.log")
    proc.start()
    router = Router(port, proc)
    try:
        wait_healthy(proc, router.url, "/health", ports={port, metrics_port})
        # The router's health answers before it has probed the workers: wait for a
        # real generation to go through.
        deadline = time.monotonic() + 300
        while True:
            r = requests.post(router.url + "/generate", json={
                "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1,
                                                              "temperature": 0}}, timeout=60)
            if r.status_code == 200:
                break
            if time.monotonic() > deadline:
                raise StartupError(f"router never served a request: {r.status_code} {r.text}")
            time.sleep(POLL_S)
    except BaseException:
        proc.stop()
        raise
    return router


@dataclass
class PDStack:
    """A prefill server, a decode server and the router in front of them."""

    backend: str
    prefill: SGLangServer
    decode: SGLangServer
    router: Router | None

    def stop(self) -> None:
        stop_together(self.router, self.decode, self.prefill)


def stop_together(*servers: Any) -> None:
    """Stop every given server, router or process (``None`` skipped) at the same time.

    Each stop signals a process group and waits for it to exit (about a second for a server);
    one after the other, a stack's three stops cost seconds on every module teardown."""
    live = [x for x in servers if x is not None]
    if len(live) <= 1:
        for x in live:
            x.stop()
        return
    errors: list[BaseException] = []

    def _stop(x: Any) -> None:
        try:
            x.stop()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after every stop ran
            errors.append(e)

    threads = [threading.Thread(target=_stop, args=(x,), daemon=True) for x in live]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@contextmanager
def pd_stack(
    backend: str,
    log_dir: Path,
    *,
    prefill: ServerConfig | None = None,
    decode: ServerConfig | None = None,
    with_router: bool = True,
) -> Iterator[PDStack]:
    """Start prefill + decode (in parallel) and, optionally, the router; stop all on exit."""
    pcfg = prefill or ServerConfig(role="prefill")
    dcfg = decode or ServerConfig(role="decode")
    pcfg.role, dcfg.role = "prefill", "decode"
    pcfg.backend = dcfg.backend = backend
    p = launch_server(pcfg, log_dir, wait=False)
    d = launch_server(dcfg, log_dir, wait=False)
    router = None
    try:
        wait_server(p)
        wait_server(d)
        if with_router:
            router = launch_router(p, d, log_dir)
        stack = PDStack(backend, p, d, router)
        yield stack
    finally:
        stop_together(router, d, p)


@contextmanager
def colocated_server(log_dir: Path, cfg: ServerConfig | None = None) -> Iterator[SGLangServer]:
    cfg = cfg or ServerConfig(role="colocated")
    cfg.role = "colocated"
    s = launch_server(cfg, log_dir)
    try:
        yield s
    finally:
        s.stop()


# --------------------------------------------------------------------------- clients


@dataclass
class GenResult:
    """One /generate answer: HTTP status, output token ids (empty on error), raw body."""

    status: int
    output_ids: list[int]
    body: Any
    prompt_tokens: int | None = None
    #: True when the client gave up waiting (no answer within its timeout): a hang, not an
    #: answer; ``status`` is then 0. Set only by callers that bound a request and keep going.
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def error_message(self) -> str:
        return error_message(self.body)


def error_message(body: Any) -> str:
    """The message of an error body: sglang-pdsafe's and upstream's (``{"error": {...}}``), the
    OpenAI handlers' (flat) or the router's (which may wrap a server's body as a string)."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            msg = err.get("message")
            if msg is None:  # no message field (e.g. a 200 answer): the body itself
                return str(err)
            return error_message(msg) if isinstance(msg, dict) else str(msg)
        return str(err)
    return str(body)


@dataclass(frozen=True)
class Limits:
    """The prompt limits one server advertises in ``/model_info`` (sglang-pdsafe, patch 0009).

    ``max_req_input_len``: the shortest prompt the server refuses (its scheduler door and HTTP
    layer refuse ``len >= max_req_input_len``); ``max_prompt_tokens`` (= that - 1): the longest
    prompt it accepts. On a decode server both already include the pre-allocation of the
    prompt's pages plus the reserved decode tokens (patch 0013). Tests read these instead of
    recomputing them from the configuration.
    """

    context_length: int
    max_req_input_len: int
    max_prompt_tokens: int
    kv_capacity_tokens: int

    @classmethod
    def of(cls, url: str) -> Limits:
        info = requests.get(url + "/model_info", timeout=30).json()
        missing = [k for k in cls.__dataclass_fields__ if not isinstance(info.get(k), int)]
        if missing:
            raise AssertionError(f"{url}/model_info does not advertise {missing}: {info}")
        return cls(**{k: info[k] for k in cls.__dataclass_fields__})


def _parse_generate(status: int, body: Any) -> GenResult:
    if status == 200 and isinstance(body, dict) and "output_ids" in body:
        return GenResult(status, list(body["output_ids"]), body,
                         body.get("meta_info", {}).get("prompt_tokens"))
    return GenResult(status, [], body)


def generate(url: str, input_ids: Sequence[int], max_new_tokens: int = 16, *,
             stream: bool = False, timeout: float = 120.0, **extra: Any) -> GenResult:
    """Greedy /generate by token ids. Streaming answers are reassembled into one result."""
    payload: dict[str, Any] = {
        "input_ids": list(input_ids),
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                            "ignore_eos": True},
        "stream": stream,
    }
    payload.update(extra)
    if not stream:
        r = requests.post(url + "/generate", json=payload, timeout=timeout)
        try:
            body = r.json()
        except ValueError:
            body = r.text
        return _parse_generate(r.status_code, body)
    with requests.post(url + "/generate", json=payload, timeout=timeout, stream=True) as r:
        if r.status_code != 200:
            try:
                body = r.json()
            except ValueError:
                body = r.text
            return GenResult(r.status_code, [], body)
        last: Any = None
        for line in r.iter_lines():
            if not line or not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk or chunk.get("object") == "error":
                return GenResult(400 if "error" in chunk else 500, [], chunk)
            last = chunk
        return _parse_generate(200, last) if last else GenResult(200, [], None)


def direct_pd_generate(stack: PDStack, input_ids: Sequence[int], max_new_tokens: int = 16,
                       *, room: int | None = None, timeout: float = 120.0,
                       **extra: Any) -> tuple[GenResult, GenResult]:
    """Send one request to prefill and decode directly (what the router does), in parallel."""
    room = room if room is not None else random.randrange(1 << 62)
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": stack.prefill.bootstrap_port,
            "bootstrap_room": room}
    out: dict[str, GenResult] = {}
    raised: dict[str, BaseException] = {}

    def go(key: str, url: str) -> None:
        try:
            out[key] = generate(url, input_ids, max_new_tokens, timeout=timeout, **boot,
                                **extra)
        except BaseException as e:  # noqa: BLE001 - re-raised below, naming the leg
            raised[key] = e

    ts = [threading.Thread(target=go, args=(k, u))
          for k, u in (("p", stack.prefill.url), ("d", stack.decode.url))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for key, leg in (("p", "prefill"), ("d", "decode")):
        if key in raised:
            raise RuntimeError(f"the {leg} leg of room {room} got no answer: "
                               f"{raised[key]!r}") from raised[key]
    return out["p"], out["d"]


def decode_holds(decode: SGLangServer) -> dict[str, int]:
    """What a decode server holds now (``/v1/loads``): used KV tokens and requests in its
    prealloc and transfer queues (all zero: it holds nothing)."""
    body = requests.get(decode.url + "/v1/loads", timeout=10).json()
    ld = (body["loads"] if isinstance(body, dict) else body)[0]
    dis = ld.get("disaggregation") or {}
    return {"num_used_tokens": int(ld["num_used_tokens"]),
            "prealloc": int(dis.get("decode_prealloc_queue_reqs", 0)),
            "transfer": int(dis.get("decode_transfer_queue_reqs", 0))}


def decode_idle(decode: SGLangServer, bound: float) -> dict[str, int]:
    """:func:`decode_holds` once it is all zero, or after ``bound`` seconds (what it held)."""
    deadline = time.monotonic() + bound
    while True:
        held = decode_holds(decode)
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.1)


def new_log_dir(prefix: str = "pdsafe-") -> Path:
    base = os.environ.get("PDSAFE_LOG_DIR")
    if base:
        Path(base).mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    return Path(tempfile.mkdtemp(prefix=prefix))
