"""The benchmark's fake PD servers (unit tests only: the benchmark's scenario code runs against
these in place of real servers): a JSON-answering handler base and the fake model."""

from __future__ import annotations

import json
import threading
from collections.abc import Hashable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class JsonHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive, silent, with :meth:`_json` for a complete JSON answer."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *a: Any) -> None:
        pass

    def _json(self, code: int, body: Any) -> None:
        raw = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _server_info(self, tokens: int) -> None:
        """A fork server's ``/server_info``: a ``tokens``-token pool and context."""
        self._json(200, {"max_total_num_tokens": tokens, "context_length": tokens,
                         "version": "0.5.23+pdsafe.1"})

    def _text(self, code: int, text: str) -> None:
        """A complete plain-text answer (a fake ``/metrics`` page)."""
        raw = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


class FakeServers:
    """One threading HTTP server per key, each on a free loopback port and served by a daemon
    thread from construction until :meth:`close`."""

    def __init__(self, handlers: Mapping[Hashable, type[BaseHTTPRequestHandler]]) -> None:
        self.servers = {k: ThreadingHTTPServer(("127.0.0.1", 0), h) for k, h in handlers.items()}
        for s in self.servers.values():
            s.daemon_threads = True
            threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05},
                             daemon=True).start()

    def url(self, key: Hashable) -> str:
        return f"http://127.0.0.1:{self.servers[key].server_address[1]}"

    def close(self) -> None:
        for s in self.servers.values():
            s.shutdown()
            s.server_close()


def answer_of(prompt: list[int], n: int) -> list[int]:
    """The fake model (and the fake reference): copy the token 16 positions back."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(seq[-16])
    return seq[len(prompt):]
