"""Parent-child RPC of the KV harness: one spawned child per side and its command pipe.

The parent sends ``(command, kwargs)`` and reads ``("ok", value)`` or ``("err", traceback)``
(see ``child.child_main``). At most one command is in flight per child; ``gather`` collects the
answers of commands running in several children at once.

Invariants: imports neither torch nor sglang; every wait is bounded and a dead, silent or
failing child raises ``HarnessError`` with the tail of its log; ``Child.stop`` always ends the
process (graceful ``shutdown``, then terminate, then kill).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from pathlib import Path
from typing import Any

from pdsafe_testkit.kv.child import ChildConfig, child_main

__all__ = ["Child", "HarnessError", "gather"]


class HarnessError(RuntimeError):
    """The harness itself failed (a child died, timed out or raised); carries the log tails."""



class Child:
    """One spawned child and its command pipe; at most one command in flight."""

    def __init__(self, cfg: ChildConfig, log_path: Path) -> None:
        self.cfg = cfg
        self.log_path = log_path
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=child_main,
            args=(cfg, child_conn, str(log_path)),
            name=f"kv-harness-{cfg.role}",
            daemon=True,
        )
        self.proc.start()
        child_conn.close()
        self.pending: str | None = "startup"

    def log_tail(self, max_chars: int = 6000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"<no log: {e}>"
        return text[-max_chars:]

    def submit(self, cmd: str, **kwargs: Any) -> None:
        if self.pending is not None:
            raise HarnessError(f"{self.cfg.role}: {cmd} submitted while {self.pending} pending")
        if not self.proc.is_alive():
            raise HarnessError(
                f"{self.cfg.role} child is dead (exit {self.proc.exitcode}); cannot run {cmd}\n"
                f"--- {self.cfg.role} log ---\n{self.log_tail()}"
            )
        try:
            self.conn.send((cmd, kwargs))
        except OSError as e:
            raise HarnessError(f"{self.cfg.role} pipe broke sending {cmd}: {e}") from e
        self.pending = cmd

    def result(self, timeout: float) -> Any:
        cmd = self.pending
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.05):
            if not self.proc.is_alive():
                raise HarnessError(
                    f"{self.cfg.role} child died (exit {self.proc.exitcode}) during {cmd}\n"
                    f"--- {self.cfg.role} log ---\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise HarnessError(
                    f"{self.cfg.role} child did not answer {cmd} within {timeout:.0f}s\n"
                    f"--- {self.cfg.role} log ---\n{self.log_tail()}"
                )
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError) as e:
            raise HarnessError(
                f"{self.cfg.role} pipe broke during {cmd}: {e}\n{self.log_tail()}"
            ) from e
        self.pending = None
        if status != "ok":
            raise HarnessError(f"{self.cfg.role} command {cmd} raised:\n{value}")
        return value

    def call(self, cmd: str, wait: float, /, **kwargs: Any) -> Any:
        """Run ``cmd`` in the child; ``wait`` bounds the parent's wait for the answer."""
        self.submit(cmd, **kwargs)
        return self.result(wait)

    def request_stop(self) -> None:
        """Ask an idle, live child to exit (no wait); ``stop`` finishes the job."""
        if self.proc.is_alive() and self.pending is None:
            try:
                self.conn.send(("shutdown", {}))
                self.pending = "shutdown"
            except OSError:
                pass

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful ``shutdown`` when idle, else (or on no answer) terminate, then kill."""
        self.request_stop()
        if self.pending == "shutdown":
            with contextlib.suppress(Exception):
                if self.conn.poll(timeout):
                    self.conn.recv()
            self.proc.join(timeout=timeout)
        for kill in (self.proc.terminate, self.proc.kill):
            if self.proc.is_alive():
                kill()
                self.proc.join(timeout=5)
        self.pending = "stopped"
        with contextlib.suppress(Exception):
            self.conn.close()


def gather(*pairs: tuple[Child, float]) -> list[Any]:
    """Results of in-flight commands of several children (all collected, first error raised)."""
    results: list[Any] = []
    error: BaseException | None = None
    for child, timeout in pairs:
        try:
            results.append(child.result(timeout))
        except BaseException as e:  # keep draining the others
            results.append(None)
            error = error or e
    if error is not None:
        raise error
    return results
