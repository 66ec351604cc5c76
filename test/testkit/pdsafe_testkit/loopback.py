"""Keeping test processes on loopback and out of each other's way.

``transport_pins``: the environment that pins every transport (SGLang's host IP, UCX, Mooncake)
to 127.0.0.1; SGLang and UCX otherwise pick the machine's outward address.

``reserve_port``: listening ports for processes that bind them later (servers, routers, KV
pairs). Why not ``bind(("127.0.0.1", 0))``: that hands out a port from the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default). The port is free only
for a moment. A server binds its HTTP port only after importing sglang and loading the model,
15-20 s later on a loaded 2-core machine. In that window every outgoing TCP connection and
every ZMQ or Mooncake ``bind(0)`` draws from the same range. A running PD pair holds dozens
of such ports, so in CI one of them took a server's port, uvicorn failed with
``[Errno 98] address already in use``, and the server hung until the startup timeout.

Invariants kept here:

* Ports come from a band below the ephemeral range that no component of the stack picks by
  itself. Mooncake's RPC and handshake ports use 15000-17000 and sglang's
  ``get_free_port_below_ephemeral`` uses 22000-29999, so the band is 18000-21999.
  ``PDSAFE_PORT_RANGE=LOW-HIGH`` overrides it.
* A port is handed out at most once per process, so two servers started together never get
  the same one.
* Each port could be bound on 0.0.0.0 and 127.0.0.1 when it was handed out.

The band can still be taken by another program on the machine. ``servers.wait_server`` then
sees the bind error in the log and restarts the server on fresh ports.
"""

from __future__ import annotations

import os
import random
import re
import socket
import threading

_DEFAULT_BAND = (18000, 21999)
_issued: set[int] = set()
_lock = threading.Lock()

# uvicorn: "error while attempting to bind on address ('127.0.0.1', 39075): address already
# in use"; aiohttp/asyncio and Rust (smg) print "[Errno 98]" / "os error 98" with the port.
_BIND_ERROR = re.compile(r"address already in use|errno 98|os error 98|eaddrinuse",
                         re.IGNORECASE)


class PortBandExhausted(RuntimeError):
    """No free port left in the band (raise PDSAFE_PORT_RANGE)."""


def transport_pins() -> dict[str, str]:
    """Environment entries that keep every transport of a child on loopback (a delta to apply
    over the child's environment before it imports sglang)."""
    return {
        "SGLANG_HOST_IP": "127.0.0.1",
        "UCX_NET_DEVICES": "lo",
        "UCX_TLS": os.environ.get("UCX_TLS", "tcp,self,sm"),
        "MOONCAKE_PROTOCOL": "tcp",
        "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES": "64",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }


def port_band() -> tuple[int, int]:
    """The (low, high) band ports come from; both ends inclusive."""
    spec = os.environ.get("PDSAFE_PORT_RANGE")
    if not spec:
        return _DEFAULT_BAND
    low, _, high = spec.partition("-")
    return int(low), int(high)


def _bindable(port: int) -> bool:
    for host in ("0.0.0.0", "127.0.0.1"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def reserve_port() -> int:
    """A port in the band, never handed out before by this process, bindable right now."""
    low, high = port_band()
    with _lock:
        candidates = [p for p in range(low, high + 1) if p not in _issued]
        random.shuffle(candidates)
        for port in candidates[:512]:
            if _bindable(port):
                _issued.add(port)
                return port
    raise PortBandExhausted(
        f"no bindable port left in {low}-{high} ({len(_issued)} already handed out); "
        "set PDSAFE_PORT_RANGE=LOW-HIGH to a wider band below the ephemeral range")


def bind_conflict(log_text: str, ports: set[int]) -> str | None:
    """The log line saying one of ``ports`` could not be bound, if there is one."""
    for line in log_text.splitlines():
        if _BIND_ERROR.search(line) and any(re.search(rf"(?<!\d){p}(?!\d)", line)
                                            for p in ports):
            return line.strip()
    return None
