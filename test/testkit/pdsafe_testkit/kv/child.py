"""The KV harness's child process: the only place that imports torch and sglang.

``child_main`` is the entry point of each spawned child (prefill or decode): it redirects the
child's output to its log, applies ``ChildConfig.env`` before importing sglang, builds one lane
per page size (``scheduler_glue``) and then serves the parent's commands (``rpc``) forever.

Invariants:

* Importing this module imports neither torch nor sglang (the parent imports it to name the
  spawn target and to build ``ChildConfig``); ``Side`` imports them in the child only.
* A child dies with its parent: ``PR_SET_PDEATHSIG`` and a watchdog thread on ``getppid``.
* Every command is answered ``("ok", value)`` or ``("err", traceback text)``; ``shutdown``
  answers and then ``os._exit(0)`` (backend threads are not joinable).
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdsafe_testkit.loopback import transport_pins

if TYPE_CHECKING:  # the lanes import sglang when built; only the child builds them
    from pdsafe_testkit.kv.scheduler_glue import Lane

__all__ = ["ChildConfig", "Side", "child_main", "kv_child_env", "write_stub_model_config"]

def kv_child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment overrides of a KV harness child: every transport pinned to loopback,
    one OMP thread, plus ``extra``.

    A delta, not a copy of ``os.environ`` (compare ``servers.server_env``, the complete
    environment of a server process); the child applies it to its own environment before it
    imports sglang.
    """
    env = {**transport_pins(), "OMP_NUM_THREADS": "1"}
    if extra:
        env.update(extra)
    return env


def write_stub_model_config(directory: Path, num_layers: int) -> Path:
    """A weight-less model directory (``config.json`` only) for ``ServerArgs.model_path``.

    ``ServerArgs.resolve_once`` reads the HF config; no weights or tokenizer are ever loaded.
    """
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "vocab_size": 256,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory



@dataclass(frozen=True)
class ChildConfig:
    """What one child builds: its role, backend, lanes (page sizes), pools and environment."""

    role: str  # "prefill" | "decode"
    backend: str
    page_sizes: tuple[int, ...]  # one lane per page size
    bootstrap_ports: tuple[int, ...]  # one bootstrap server per lane (prefill hosts them)
    num_pages: int
    num_layers: int
    token_words: int
    aux_slots: int
    http_port: int
    env: dict[str, str]
    parent_pid: int
    log_level: str
    model_dir: str
    #: Run every protection hook a patched scheduler runs around a transfer, over upstream's
    #: real allocator with page generations (``pdsafe_testkit.kv.bookkeeping``).
    bookkeeping: bool = False
    #: The pool class of each lane, aligned with ``page_sizes`` (``layouts.POOL_KINDS``:
    #: ``mha``, ``mla``, ``dsa``, ``dsa-kpool``, ``hybrid``, ``swa``); empty: every lane MHA
    #: (the default).
    pool_kinds: tuple[str, ...] = ()


def set_pdeathsig() -> None:
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def watch_parent(parent_pid: int) -> None:
    def loop() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(3)

    threading.Thread(target=loop, name="kv-harness-parent-watch", daemon=True).start()


def child_main(
    cfg: ChildConfig, conn: multiprocessing.connection.Connection, log_path: str
) -> None:
    """Entry point of a child: redirect output, build the side, then serve commands forever.

    Replies ``("ok", value)`` or ``("err", traceback text)``; ``shutdown`` replies and then
    ``os._exit(0)`` (backend threads are not joinable).
    """
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    set_pdeathsig()
    watch_parent(cfg.parent_pid)
    os.environ.update(cfg.env)
    logging.basicConfig(
        level=cfg.log_level,
        format=f"%(asctime)s {cfg.role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        side = Side(cfg)
        conn.send(("ok", side.ready_info()))
    except BaseException:
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            conn.send(("err", tb))
        os._exit(2)
    while True:
        try:
            cmd, kwargs = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        if cmd == "shutdown":
            with contextlib.suppress(Exception):
                side.shutdown()
            with contextlib.suppress(Exception):
                conn.send(("ok", None))
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        try:
            lane = side.lanes[kwargs.pop("lane")]
            result = getattr(lane, f"cmd_{cmd}")(**kwargs)
            conn.send(("ok", result))
        except BaseException:
            tb = traceback.format_exc()
            print(f"command {cmd} failed:\n{tb}", file=sys.stderr, flush=True)
            conn.send(("err", tb))


class Side:
    """One child process: a lane per page size, built one after the other."""

    def __init__(self, cfg: ChildConfig) -> None:
        t0 = time.monotonic()
        import sglang.srt.disaggregation.utils  # noqa: F401  (the heavy import, timed apart)
        import sglang.srt.server_args  # noqa: F401
        import torch

        from pdsafe_testkit.kv.scheduler_glue import DecodeLane, PrefillLane

        torch.set_num_threads(1)
        self.cfg = cfg

        self.import_s = time.monotonic() - t0
        self.lane_s: dict[int, float] = {}
        self.lanes: dict[int, Lane] = {}
        kinds = cfg.pool_kinds or ("mha",) * len(cfg.page_sizes)
        for page_size, port, kind in zip(cfg.page_sizes, cfg.bootstrap_ports, kinds,
                                         strict=True):
            t1 = time.monotonic()
            lane_cls = PrefillLane if cfg.role == "prefill" else DecodeLane
            self.lanes[page_size] = lane_cls(cfg, page_size, port, pool_kind=kind)
            self.lane_s[page_size] = time.monotonic() - t1

    def ready_info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "import_s": self.import_s, "lane_s": self.lane_s}

    def shutdown(self) -> None:
        for lane in self.lanes.values():
            with contextlib.suppress(Exception):
                lane.shutdown()


