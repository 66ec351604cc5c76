"""The server's internal token is never in any process's environment (issue #7, finding 8).

The PD startup warmup reaches the server over HTTP with the fake bootstrap host, which clients
may not use; a per-server secret header marks it as the server's own. That secret used to live
in ``os.environ`` (inherited by every child process, readable in ``/proc/<pid>/environ``). Now
it lives in ``client_guard``'s memory; multi-process HTTP workers get it from the launcher in
the scheduler info it already hands them (``worker_handoff`` / ``adopt_worker_handoff``), and
take it out before that dict is kept or served.

Checked on starlette's real ``Request`` (what upstream's HTTP handlers pass to
``TokenizerManager.generate_request``).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
from sglang.pdsafe import client_guard
from starlette.requests import Request

LEGACY_ENV = "SGLANG_PDSAFE_INTERNAL_TOKEN"


def _request(headers: dict[str, str] | None = None, method: str = "POST",
             path: str = "/generate") -> Request:
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    return Request({"type": "http", "method": method, "path": path, "headers": raw,
                    "query_string": b""})


@pytest.fixture
def fresh_token() -> Iterator[None]:
    """Run with this module's secret unset (a new process), restored afterwards."""
    saved = client_guard._TOKEN
    client_guard._TOKEN = None
    yield
    client_guard._TOKEN = saved


def _env_holds(token: str) -> list[str]:
    return [k for k, v in os.environ.items() if token in v or k == LEGACY_ENV]


def test_no_secret_in_the_environment_after_import_and_use(fresh_token):
    headers = client_guard.internal_headers()
    token = headers[client_guard.INTERNAL_HEADER]
    assert len(token) >= 32
    assert _env_holds(token) == [], "the internal token leaked into os.environ"
    assert client_guard.worker_handoff() == {client_guard.HANDOFF_KEY: token}  # one per server
    assert _env_holds(token) == []


def test_fresh_interpreter_environment_stays_clean():
    """Importing the module (what every server process does) adds nothing to os.environ, and a
    child process started afterwards inherits no token."""
    code = textwrap.dedent(f"""
        import os, subprocess, sys
        before = dict(os.environ)
        from sglang.pdsafe import client_guard
        token = client_guard.internal_headers()[client_guard.INTERNAL_HEADER]
        added = sorted(set(os.environ) - set(before))
        child = subprocess.run([sys.executable, "-c", "import os; print(repr(dict(os.environ)))"],
                               capture_output=True, text=True, check=True).stdout
        print("ADDED", added)
        print("CHILD_HAS_TOKEN", token in child or {LEGACY_ENV!r} in child)
    """)
    env = {k: v for k, v in os.environ.items() if k != LEGACY_ENV}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ADDED []" in r.stdout, r.stdout
    assert "CHILD_HAS_TOKEN False" in r.stdout, r.stdout


def test_warmup_header_accepted_random_refused(fresh_token):
    spoof = type("Obj", (), {"bootstrap_host": client_guard.FAKE_BOOTSTRAP_HOST, "rid": None})()
    warmup = _request(client_guard.internal_headers())
    assert client_guard.is_server_built(warmup)
    client_guard.check_client_request(spoof, warmup)  # the warmup's fake host passes
    for headers in ({client_guard.INTERNAL_HEADER: secrets.token_urlsafe(32)},
                    {client_guard.INTERNAL_HEADER: ""}, {}):
        req = _request(headers)
        assert not client_guard.is_server_built(req), headers
        with pytest.raises(client_guard.SpoofedInternalFieldError):
            client_guard.check_client_request(spoof, req)


def test_no_header_is_trusted_before_a_secret_exists(fresh_token):
    """A process that has not generated or adopted a secret trusts no header at all."""
    assert not client_guard.is_server_built(_request({client_guard.INTERNAL_HEADER: "x" * 43}))


def test_http_worker_adopts_the_launchers_secret(fresh_token):
    """Launcher: worker_handoff() goes into the scheduler info handed to the workers. Worker
    (fresh state): adopt_worker_handoff() takes it out of the dict and accepts exactly the
    launcher's header, so a warmup sent by any worker is accepted by every worker."""
    launcher = client_guard.worker_handoff()[client_guard.HANDOFF_KEY]
    info = {"max_req_input_len": 100, **client_guard.worker_handoff()}
    client_guard._TOKEN = None  # the worker process starts without one
    client_guard.adopt_worker_handoff(info)
    assert client_guard.HANDOFF_KEY not in info, "the secret would be served in /server_info"
    assert info == {"max_req_input_len": 100}
    assert client_guard.internal_headers() == {client_guard.INTERNAL_HEADER: launcher}
    assert client_guard.is_server_built(_request({client_guard.INTERNAL_HEADER: launcher}))
    assert not client_guard.is_server_built(
        _request({client_guard.INTERNAL_HEADER: secrets.token_urlsafe(32)}))


def test_http_worker_handed_no_secret_fails_closed(fresh_token, caplog):
    launcher = client_guard.worker_handoff()[client_guard.HANDOFF_KEY]
    client_guard._TOKEN = None
    with caplog.at_level("ERROR", logger=client_guard.logger.name):
        client_guard.adopt_worker_handoff({"max_req_input_len": 100})
    assert any("no internal token" in r.getMessage() for r in caplog.records)
    assert client_guard.internal_headers() == {}
    for token in (launcher, "", secrets.token_urlsafe(32)):
        assert not client_guard.is_server_built(_request({client_guard.INTERNAL_HEADER: token}))
