"""The harness's port band (``pdsafe_testkit.loopback``), no servers: ports outside the kernel's
ephemeral range and the stack's own ranges, handed out once, bindable, and a taken port
recognised in a server's log. With a real server: test/test_harness_loopback.py.
"""

from __future__ import annotations

import socket

import pytest
from pdsafe_testkit import loopback as ports

UVICORN_LINE = ("[2026-11-30 06:45:08] ERROR:    [Errno 98] error while attempting to bind on "
                "address ('127.0.0.1', 39075): address already in use")


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_reserved_ports_are_unique_bindable_and_below_the_ephemeral_range() -> None:
    got = [ports.reserve_port() for _ in range(200)]
    low, high = ports.port_band()
    assert len(set(got)) == len(got), "a port was handed out twice"
    assert all(low <= p <= high for p in got)
    assert high < _ephemeral_low(), "the band overlaps the kernel's ephemeral range"
    assert not (low <= 17000 and high >= 15000), "the band overlaps Mooncake's port range"
    assert not (low <= 29999 and high >= 22000), "the band overlaps sglang's nccl port range"


def test_reserve_port_skips_a_port_that_is_already_bound(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        # A band of two ports, one of them taken: only the other can come back.
        other = taken + 1 if taken < 65535 else taken - 1
        lo, hi = sorted((taken, other))
        monkeypatch.setenv("PDSAFE_PORT_RANGE", f"{lo}-{hi}")
        monkeypatch.setattr(ports, "_issued", set())
        assert ports.reserve_port() == other
        with pytest.raises(ports.PortBandExhausted, match="PDSAFE_PORT_RANGE"):
            ports.reserve_port()


def test_bind_conflict_recognises_the_uvicorn_line_for_our_port_only() -> None:
    assert ports.bind_conflict("x\n" + UVICORN_LINE + "\ny", {39075}) == UVICORN_LINE.strip()
    assert ports.bind_conflict(UVICORN_LINE, {3907, 9075}) is None  # no digit-substring match
    assert ports.bind_conflict(UVICORN_LINE, {18000}) is None
    assert ports.bind_conflict("Mooncake: bind 15132 failed: Address already in use",
                               {15132}) is not None


@pytest.mark.parametrize("tail,spurious", [
    ("", True), ("Traceback (most recent call last):\nRuntimeError: boom", False),
    ("The server is fired up and ready to roll!", False)])
def test_only_the_grpc_epoll_exit_at_startup_counts_as_spurious(tmp_path, tail, spurious):
    """A server process that exits at startup leaving gRPC's epoll line alone is started again
    (``wait_server``, once); one that left a traceback, or had come up, is a real failure."""
    import os
    import sys

    from pdsafe_testkit import servers

    line = f"E1207 11:31:19.333513 27513 ev_epoll1_linux.cc:373] {servers.SPURIOUS_EXIT}"
    proc = servers.ManagedProcess(
        "fake", [sys.executable, "-c", f"print({line!r}); print({tail!r})"], dict(os.environ),
        tmp_path / "fake.log")
    proc.start()
    proc.proc.wait(timeout=30)
    with pytest.raises(servers.StartupError) as e:
        servers.wait_healthy(proc, "http://127.0.0.1:9", timeout=30)
    assert isinstance(e.value, servers.DiedSpuriously) is spurious
