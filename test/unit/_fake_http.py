"""A JSON-answering ``BaseHTTPRequestHandler`` base for the benchmark's fake PD servers (unit
tests only: the benchmark's scenario code runs against these in place of real servers)."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
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
