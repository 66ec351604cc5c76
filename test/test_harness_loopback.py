"""The harness's loopback discipline with a real server: a server whose port was taken before it
bound it is restarted on fresh ports instead of hanging until the timeout.

CI once lost 4 tests because a server's pre-chosen port (from the ephemeral range) was taken by
another process's outgoing connection during the ~15 s the server spent starting up. The port
band itself (no server): test/unit/test_loopback_ports.py.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from pdsafe_testkit import loopback as ports
from pdsafe_testkit import servers
from pdsafe_testkit.servers import ServerConfig, generate, launch_server


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port some other process would own: bound and listening for the whole test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.server
def test_server_whose_port_was_taken_restarts_on_a_fresh_port(
        held_port: int, log_dir: Path, model_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    handed = iter([held_port])
    real = servers.reserve_port
    monkeypatch.setattr(servers, "reserve_port", lambda: next(handed, None) or real())
    server = launch_server(ServerConfig(role="colocated", model_path=model_path,
                                        max_total_tokens=512), log_dir)
    try:
        assert server.port != held_port
        first_log = log_dir / f"colocated-ref-{held_port}.log"
        assert ports.bind_conflict(first_log.read_text(errors="replace"), {held_port}), \
            "the first start did not hit the taken port; the test proves nothing"
        r = generate(server.url, [5, 6, 7, 8], max_new_tokens=2)
        assert r.status == 200 and len(r.output_ids) == 2
    finally:
        server.stop()
