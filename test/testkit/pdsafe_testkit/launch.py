"""``python -m pdsafe_testkit.launch ARGS``: ``python -m sglang.launch_server ARGS`` whose
scheduler and detokenizer processes start from a forkserver that imported them once.

Why: a server start on the 2-core CI machine is mostly three processes each importing torch,
transformers and sglang (about 10 s of CPU apiece); the suite starts about a hundred servers.
Upstream forces the ``spawn`` start method (``engine._set_envs_and_config``), so its scheduler
and detokenizer import everything again after the HTTP process did. Here ``spawn`` becomes
``forkserver``, with the two subprocess modules preloaded: the forkserver is a fresh
interpreter started by the server process (same environment, same argv) that has only
*imported* modules, and each subprocess is forked from it. A PD stack is ready in about 27 s
instead of 33 s when started alone (README, "Measurements").

What this keeps: the server code is the installed package, unchanged; each subprocess still
starts from an interpreter that holds no server state (the forkserver never ran
``launch_server``; nothing the HTTP process set up after the forkserver started reaches a
subprocess), exactly as under ``spawn``. What it changes: the subprocesses share the
forkserver's imported module objects, so an import-time side effect that differs between two
imports (a thread started at import, a module reading an environment variable that the server
process changes between starting its scheduler and its detokenizer) would differ from
production. The shared PD stacks of ``test/conftest.py`` therefore run under upstream's own
``spawn`` (``ServerConfig.upstream_spawn``), and ``PDSAFE_SERVER_START=spawn`` runs every test
server that way.
"""

from __future__ import annotations

import multiprocessing
import runpy
import sys
from typing import Any

#: What the forkserver imports before it forks the scheduler and the detokenizer.
PRELOAD = ("sglang.srt.managers.scheduler", "sglang.srt.managers.detokenizer_manager")

_set_start_method = multiprocessing.set_start_method


def _forkserver_for_spawn(method: str | None, force: bool = False) -> Any:
    """``multiprocessing.set_start_method`` with ``spawn`` read as ``forkserver``."""
    return _set_start_method("forkserver" if method == "spawn" else method, force=force)


def main() -> None:
    multiprocessing.set_start_method = _forkserver_for_spawn
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    sys.argv = ["sglang.launch_server", *sys.argv[1:]]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
