"""A flood of bogus prefill bootstrap hosts must not delay a real release notice (issue 7, #7).

No sglang server: a "real prefill" is a tiny HTTP server answering upstream's bootstrap
``/route`` queries (topology, then the rank endpoint) plus a ZMQ PULL socket as its rank's
control port, all on 127.0.0.1. Bogus hosts are ports that accept a TCP connection and never
answer (each lookup costs a full HTTP timeout) and closed ports (refused at once), named the way
a client names them: in the request's ``bootstrap_host``/``bootstrap_port``.

Against the single-thread notifier that preceded ``sglang.pdsafe.peer_notifier`` (one queue,
2 s lookups in line), the first test fails: the real notice waits behind every hanging lookup.
"""

from __future__ import annotations

import json
import math
import random
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
import zmq
from sglang.pdsafe import metrics
from sglang.pdsafe import peer_notifier as notifier_module

HOST = "127.0.0.1"
FAILED = "peer_release_notify_failed_total"
#: What a real notice may take with a flood in front of it (the bogus lookups take 2 s each).
KNOWN_ROUTE_BOUND_S = 1.5


def _fresh_notifier(**limits: Any) -> Any:
    return notifier_module.reset_notifier(**limits)


class _Prefill:
    """A fake prefill: bootstrap ``/route`` over HTTP and one rank's ZMQ control socket."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.pull = ctx.socket(zmq.PULL)
        self.rank_port = self.pull.bind_to_random_port(f"tcp://{HOST}")
        self.lookups = 0
        prefill = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                q = {k: int(v[0]) for k, v in parse_qs(urlparse(self.path).query).items()}
                prefill.lookups += 1
                if q.get("prefill_dp_rank") == -1:
                    body = {"dp_size": 1, "attn_tp_size": 1, "attn_cp_size": 1, "pp_size": 1,
                            "follow_bootstrap_room": True}
                else:
                    body = {"rank_ip": HOST, "rank_port": prefill.rank_port}
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer((HOST, 0), Handler)
        self.http.daemon_threads = True
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.seen: set[int] = set()

    def wait_for(self, room: int, timeout: float) -> float | None:
        """Seconds until the ABORT for ``room`` arrived, or None after ``timeout``."""
        t0 = time.monotonic()
        while room not in self.seen:
            left = timeout - (time.monotonic() - t0)
            if left <= 0:
                return None
            if self.pull.poll(int(left * 1000) + 1):
                frames = self.pull.recv_multipart()
                assert frames[0] == b"ABORT" and len(frames) == 3, frames
                self.seen.add(int(frames[1]))
        return time.monotonic() - t0

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.pull.close(linger=0)


@contextmanager
def _prefills(n: int) -> Iterator[list[_Prefill]]:
    ctx = zmq.Context()
    ps = [_Prefill(ctx) for _ in range(n)]
    try:
        yield ps
    finally:
        for p in ps:
            p.close()
        ctx.term()


@contextmanager
def _bogus_hosts(hanging: int, closed: int) -> Iterator[list[tuple[str, int]]]:
    """``hanging`` ports that accept and never answer, then ``closed`` refused ports."""
    with ExitStack() as stack:
        out = []
        for _ in range(hanging):
            s = stack.enter_context(socket.socket())
            s.bind((HOST, 0))
            s.listen(8)  # never accepted: the kernel completes the handshake, nobody answers
            out.append((HOST, s.getsockname()[1]))
        for _ in range(closed):
            with socket.socket() as s:
                s.bind((HOST, 0))
                out.append((HOST, s.getsockname()[1]))
        yield out


@contextmanager
def _dripping_hosts(n: int) -> Iterator[list[tuple[str, int]]]:
    """``n`` ports whose server answers one header byte every 0.1 s, forever: each read is
    quick, so only a deadline on the whole answer ends the lookup."""
    stop = threading.Event()
    listeners = []

    def drip(conn: socket.socket) -> None:
        with conn:
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\n")
                while not stop.wait(0.1):
                    conn.sendall(b"X")
            except OSError:
                pass

    def accept(ls: socket.socket) -> None:
        while not stop.is_set():
            try:
                conn, _ = ls.accept()
            except OSError:
                return
            threading.Thread(target=drip, args=(conn,), daemon=True).start()

    try:
        for _ in range(n):
            ls = socket.socket()
            ls.bind((HOST, 0))
            ls.listen(8)
            listeners.append(ls)
            threading.Thread(target=accept, args=(ls,), daemon=True).start()
        yield [(HOST, ls.getsockname()[1]) for ls in listeners]
    finally:
        stop.set()
        for ls in listeners:
            ls.close()


def _room() -> int:
    return random.randrange(1 << 62)


def _notify(host: str, port: int, room: int) -> bool:
    return notifier_module.notify_prefill(host, port, room, "the decode server refused it: test")


def test_bogus_hosts_do_not_delay_a_known_prefill():
    notifier = _fresh_notifier()
    with _prefills(1) as (real,), _bogus_hosts(hanging=150, closed=80) as bogus:
        warm = _room()
        assert _notify(HOST, real.port, warm)
        assert real.wait_for(warm, 20.0) is not None, "the real prefill never got its notice"

        failed0 = metrics.value(FAILED)
        accepted = sum(_notify(h, p, _room()) for h, p in bogus)
        room = _room()
        t0 = time.monotonic()
        assert _notify(HOST, real.port, room)
        took = real.wait_for(room, KNOWN_ROUTE_BOUND_S + 2.0)
        took = None if took is None else time.monotonic() - t0
        assert took is not None and took < KNOWN_ROUTE_BOUND_S, (
            f"the real prefill's notice took {took or 'more than 3.5'} s behind {len(bogus)} "
            f"bogus hosts (bound {KNOWN_ROUTE_BOUND_S} s)")

        # The flood was bounded, and what it could not queue was refused and counted.
        assert accepted <= notifier.MAX_NEW_DESTS, accepted
        assert metrics.value(FAILED) - failed0 >= len(bogus) - accepted
        st = notifier.stats()
        assert st["pending_dests"] <= notifier.MAX_NEW_DESTS + notifier.MAX_ROUTES, st
        assert st["bad_addrs"] <= notifier.MAX_BAD_ADDRS and st["routes"] <= 1, st


def test_caches_stay_bounded_and_evicted_prefills_are_reached_again(monkeypatch):
    closed_sockets: list[str] = []
    original_close = notifier_module.Notifier._close_socket

    def spy(self: Any, endpoint: str, sock: Any) -> None:
        closed_sockets.append(endpoint)
        original_close(self, endpoint, sock)

    monkeypatch.setattr(notifier_module.Notifier, "_close_socket", spy)
    limits = {"MAX_ROUTES": 3, "MAX_SOCKETS": 2, "MAX_BAD_ADDRS": 16, "MAX_NEW_DESTS": 8,
              "MAX_PENDING_PER_DEST": 4, "LOOKUP_WORKERS": 4, "HTTP_TIMEOUT_S": 0.5}
    notifier = _fresh_notifier(**limits)
    peak: dict[str, int] = {}

    def sample() -> None:
        for k, v in notifier.stats().items():
            peak[k] = max(peak.get(k, 0), v)

    with _prefills(6) as reals, _bogus_hosts(hanging=40, closed=40) as bogus:
        for rnd in range(2):  # the second round reaches prefills whose route was evicted
            for i, p in enumerate(reals):
                for h, port in bogus[i * 13:(i + 1) * 13]:
                    _notify(h, port, _room())
                    sample()
                room = _room()
                deadline = time.monotonic() + 15.0
                while not _notify(HOST, p.port, room):  # refused while 8 lookups are queued
                    assert time.monotonic() < deadline, "the real prefill was refused for 15 s"
                    sample()
                    time.sleep(0.05)
                while p.wait_for(room, 0.05) is None:
                    assert time.monotonic() < deadline, f"round {rnd}: prefill {i} not reached"
                    sample()
        assert all(p.lookups >= 4 for p in reals), "evicted routes must be looked up again"

        # One destination holds at most MAX_PENDING_PER_DEST notices (a fresh notifier, so the
        # hanging host is not known bad yet: its one lookup takes 0.5 s).
        notifier = _fresh_notifier(**limits)
        results = [_notify(*bogus[0], _room()) for _ in range(10)]
        assert results.count(True) == limits["MAX_PENDING_PER_DEST"], results
        sample()

    assert peak["routes"] <= limits["MAX_ROUTES"], peak
    assert peak["sockets"] <= limits["MAX_SOCKETS"], peak
    assert peak["bad_addrs"] <= limits["MAX_BAD_ADDRS"], peak
    assert peak["pending_dests"] <= limits["MAX_NEW_DESTS"] + limits["MAX_ROUTES"], peak
    assert peak["pending_notices"] <= (
        (limits["MAX_NEW_DESTS"] + limits["MAX_ROUTES"]) * limits["MAX_PENDING_PER_DEST"]), peak
    assert len(closed_sockets) >= 6 * 2 - limits["MAX_SOCKETS"], (
        f"evicted sockets must be closed: {closed_sockets}")


def test_first_contact_waits_at_most_the_documented_bound():
    """A prefill never contacted before, queued behind lookups of hosts that hang or drip
    bytes forever, is looked up within ceil(MAX_NEW_DESTS / LOOKUP_WORKERS) lookup timeouts;
    one more unresolved host is refused."""
    limits = {"MAX_NEW_DESTS": 8, "LOOKUP_WORKERS": 4, "HTTP_TIMEOUT_S": 0.5}
    notifier = _fresh_notifier(**limits)
    bound = math.ceil(limits["MAX_NEW_DESTS"] / limits["LOOKUP_WORKERS"]) * limits[
        "HTTP_TIMEOUT_S"]
    with (_prefills(1) as (real,), _dripping_hosts(4) as drips,
          _bogus_hosts(hanging=4, closed=0) as hanging):
        bogus = drips + hanging
        assert all(_notify(h, p, _room()) for h, p in bogus[:7])
        room = _room()
        t0 = time.monotonic()
        assert _notify(HOST, real.port, room)
        failed0 = metrics.value(FAILED)
        assert not _notify(*bogus[7], _room()), "a 9th unresolved host must be refused"
        assert metrics.value(FAILED) == failed0 + 1
        assert real.wait_for(room, bound + 3.0) is not None
        took = time.monotonic() - t0
        # Wide margin for a loaded machine; the discriminator is that it is not queued behind
        # the hanging lookups one after another (7 x 0.5 s).
        assert took < bound + 1.5, f"first contact took {took:.2f} s (bound {bound} s)"
        assert notifier.stats()["pending_dests"] <= limits["MAX_NEW_DESTS"]


@pytest.fixture(autouse=True)
def _restore_notifier() -> Iterator[None]:
    yield
    notifier_module.reset_notifier()
