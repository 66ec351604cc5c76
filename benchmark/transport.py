"""The benchmark's HTTP layer: every request it sends goes through here, with the deployment's
keys and headers.

* ``configure(api_key=..., admin_key=..., headers=...)`` once per run. A request to one of
  upstream's admin endpoints (``ADMIN_PATHS``: ``/abort_request`` and the like, which a server
  with ``--admin-api-key`` opens only to that key) carries ``Authorization: Bearer <admin
  key>``, every other request the API key (``--api-key``); the extra headers (a gateway's
  tenant or routing header) go on every request. Health and metrics endpoints get them too;
  upstream never asks there, a gateway may.
* ``error_message``: the message of an error body, and ``scrape``/``sum_samples``: the
  Prometheus ``/metrics`` reader. The benchmark's own copies, so that it installs and runs
  without the test harness (``pdsafe_testkit``) in deployment mode; the harness keeps its own
  reader for the tests.

Invariant: a key never leaves this module except in the ``Authorization`` header; ``describe``
names which keys are set, never their values (report.json records it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import requests

#: Upstream endpoints whose auth level is ADMIN_OPTIONAL (``sglang/srt/utils/auth.py``): with an
#: admin key configured on the server, only that key opens them.
ADMIN_PATHS: tuple[str, ...] = ("/abort_request", "/flush_cache", "/pause_generation",
                                "/continue_generation", "/pdsafe/")


@dataclass
class Auth:
    """Credentials and extra headers of the deployment under test (none: the harness)."""

    api_key: str | None = None
    admin_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def for_path(self, path: str) -> dict[str, str]:
        out = dict(self.headers)
        admin = any(path.startswith(p) for p in ADMIN_PATHS)
        key = (self.admin_key or self.api_key) if admin else self.api_key
        if key:
            out["Authorization"] = f"Bearer {key}"
        return out

    def describe(self) -> dict[str, Any]:
        return {"api_key": bool(self.api_key), "admin_key": bool(self.admin_key),
                "headers": sorted(self.headers)}


_AUTH = Auth()


def configure(api_key: str | None = None, admin_key: str | None = None,
              headers: dict[str, str] | None = None) -> Auth:
    """Set the keys and headers every later request carries (process-wide)."""
    global _AUTH
    _AUTH = Auth(api_key or None, admin_key or None, dict(headers or {}))
    return _AUTH


def auth() -> Auth:
    return _AUTH


def parse_header(text: str) -> tuple[str, str]:
    """``"Name: value"`` -> (name, value); raises ``ValueError`` on anything else."""
    name, sep, value = text.partition(":")
    if not sep or not name.strip() or not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+",
                                                       name.strip()):
        raise ValueError(f"not an HTTP header 'Name: value': {text!r}")
    return name.strip(), value.strip()


def _headers(url: str, extra: dict[str, str] | None) -> dict[str, str]:
    out = _AUTH.for_path(urlparse(url).path or "/")
    out.update(extra or {})
    return out


def get(url: str, **kw: Any) -> requests.Response:
    """``requests.get`` with the run's keys and headers for ``url``'s path."""
    return requests.get(url, headers=_headers(url, kw.pop("headers", None)), **kw)


def post(url: str, **kw: Any) -> requests.Response:
    """``requests.post`` with the run's keys and headers for ``url``'s path."""
    return requests.post(url, headers=_headers(url, kw.pop("headers", None)), **kw)


# --------------------------------------------------------------------------- error bodies


def error_message(body: Any) -> str:
    """The message of an error body: sglang's (``{"error": {"message": ...}}``), the OpenAI
    handlers' (flat) or the router's (which may wrap a server's body as a string)."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            msg = err.get("message")
            if msg is None:
                return str(err)
            return error_message(msg) if isinstance(msg, dict) else str(msg)
        return str(err)
    return str(body)


# --------------------------------------------------------------------------- /metrics

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?"
                     r"\s+(?P<value>\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_SPECIAL = {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}


@dataclass(frozen=True)
class Sample:
    """One exposed sample: metric name, its labels, its value."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


def parse_metrics(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition; a malformed line raises ``ValueError``."""
    out: list[Sample] = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if m is None:
            raise ValueError(f"malformed /metrics line: {line!r}")
        labels, text_labels, pos = [], m.group("labels") or "", 0
        while pos < len(text_labels):
            lm = _LABEL.match(text_labels, pos)
            if lm is None or lm.end() == pos:
                raise ValueError(f"malformed labels in /metrics line: {line!r}")
            labels.append((lm.group(1), lm.group(2).replace('\\"', '"')))
            pos = lm.end()
        raw = m.group("value")
        value = _SPECIAL[raw] if raw in _SPECIAL else float(raw)
        out.append(Sample(m.group("name"), tuple(labels), value))
    return out


def scrape(url: str, timeout: float = 30.0) -> list[Sample]:
    """The samples ``url``/metrics exposes now (``url``: a server's base URL)."""
    r = get(url.rstrip("/") + "/metrics", timeout=timeout)
    r.raise_for_status()
    return parse_metrics(r.text)


def sum_samples(samples: Iterable[Sample], names: str | Iterable[str], **labels: str) -> float:
    """Sum of the samples named ``names`` whose labels include ``labels`` (0.0 when none)."""
    wanted = {names} if isinstance(names, str) else set(names)
    return sum(s.value for s in samples
               if s.name in wanted and all(s.label(k) == v for k, v in labels.items()))
