"""``POST /pdsafe/quarantine/release`` (patch 0028, ``sglang.pdsafe.operator_api``): an operator
releases a decode's quarantined pages; validated, admin-only, counted and logged.

Two layers: the module's own logic (body validation, upstream's admin-optional auth decision,
the answers by server role and state), and the patched route of upstream's real FastAPI app
(``sglang.srt.entrypoints.http_server.app``) driven with Starlette's test client, without
upstream's API-key middleware (as in multi-tokenizer mode, where upstream adds none): the
route still refuses a caller without the admin key, and an accepted release reaches a decode
scheduler's quarantine through the state directory (evidence ``operator``).

What this does not show: a real decode releasing real pages on the operator's word
(``test/pd/test_late_write.py::test_crashed_prefill_not_restarted_pages_released_by_operator``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sglang.pdsafe import metrics, operator_api, policy, quarantine
from sglang.pdsafe.operator_api import BadRequest, parse_body

WRITER = "127.0.0.1:8998"


@pytest.fixture
def decode(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """A PD decode's HTTP process: its role, its API keys (none), its state directory."""
    keys: dict[str, Any] = {"api_key": None, "admin_api_key": None}
    monkeypatch.setattr(operator_api, "process_pd_mode", lambda: "decode")
    monkeypatch.setattr(operator_api, "get_serving", lambda: SimpleNamespace(**keys))
    monkeypatch.setenv(policy.ENV_STATE_DIR, str(tmp_path))
    return keys


def _released(tmp_path: Path) -> list[tuple[str | None, float]]:
    quarantine._operator_cache.clear()
    return quarantine.operator_requests() if os.environ.get(policy.ENV_STATE_DIR) else []


CLIENT = SimpleNamespace(host="10.1.2.3", port=5555)


# --------------------------------------------------------------------------- the body


@pytest.mark.parametrize(("body", "writer"), [
    (b'{"writer": "127.0.0.1:8998"}', "127.0.0.1:8998"),
    (b'{"writer": "prefill-0.pd.svc:8998"}', "prefill-0.pd.svc:8998"),
    (b'{"writer": "[fd00::5]:8998"}', "[fd00::5]:8998"),
    (b'{"all": true}', None),
])
def test_a_body_names_one_writer_or_all(body: bytes, writer: str | None):
    assert parse_body(body) == writer


@pytest.mark.parametrize("body", [
    b"", b"not json", b"[]", b'"127.0.0.1:8998"', b"{}", b'{"all": false}', b'{"all": 1}',
    b'{"all": "true"}', b'{"writer": "127.0.0.1:8998", "all": true}', b'{"writer": null}',
    b'{"writer": 8998}', b'{"writer": "127.0.0.1"}', b'{"writer": "127.0.0.1:0"}',
    b'{"writer": "127.0.0.1:70000"}', b'{"writer": "a b:1"}', b'{"writer": "h:1/route"}',
    b'{"writer": "127.0.0.1:8998", "force": true}',
])
def test_anything_else_is_refused(body: bytes):
    with pytest.raises(BadRequest):
        parse_body(body)


# --------------------------------------------------------------------------- who may


@pytest.mark.parametrize(("api_key", "admin_key", "header", "want"), [
    (None, None, None, None),  # no key configured: open, as upstream's admin endpoints
    (None, "adm", None, 401),
    (None, "adm", "Bearer wrong", 401),
    (None, "adm", "Bearer adm", None),
    ("api", None, None, 401),
    ("api", None, "Bearer api", None),
    ("api", "adm", "Bearer api", 401),  # with an admin key, the API key is not enough
    ("api", "adm", "Bearer adm", None),
])
def test_upstreams_admin_optional_level_decides(api_key, admin_key, header, want):
    serving = SimpleNamespace(api_key=api_key, admin_api_key=admin_key)
    assert operator_api.authorized(header, serving) == want


# --------------------------------------------------------------------------- the answers


def test_an_accepted_release_is_recorded_counted_and_logged(decode, tmp_path, caplog):
    ops = metrics.value("quarantine_operator_release_total")
    with caplog.at_level(logging.WARNING, logger="sglang.pdsafe.quarantine"):
        status, body = operator_api.quarantine_release(
            f'{{"writer": "{WRITER}"}}'.encode(), None, CLIENT)
    assert status == 200 and body["released_writer"] == WRITER, body
    assert metrics.value("quarantine_operator_release_total") == ops + 1
    assert [w for w, _ in _released(tmp_path)] == [WRITER]
    assert any("10.1.2.3:5555" in r.message and WRITER in r.message for r in caplog.records)
    status, body = operator_api.quarantine_release(b'{"all": true}', None, CLIENT)
    assert status == 200 and [w for w, _ in _released(tmp_path)] == [WRITER, None]


@pytest.mark.parametrize(("setup", "body", "want"), [
    ("admin_key", b'{"all": true}', 401),
    ("prefill", b'{"all": true}', 404),
    ("null", b'{"all": true}', 404),
    ("unknown_mode", b'{"all": true}', 404),
    ("none", b'{"writer": "nowhere"}', 400),
    ("no_state_dir", b'{"all": true}', 503),
])
def test_nothing_is_released_when_refused(decode, tmp_path, monkeypatch, setup, body, want):
    if setup == "admin_key":
        decode["admin_api_key"] = "adm"
    elif setup in ("prefill", "null"):
        monkeypatch.setattr(operator_api, "process_pd_mode", lambda: setup)
    elif setup == "unknown_mode":
        def unknown() -> str:
            raise operator_api.PDModeUnknownError("not published")
        monkeypatch.setattr(operator_api, "process_pd_mode", unknown)
    elif setup == "no_state_dir":
        monkeypatch.delenv(policy.ENV_STATE_DIR)
    ops = metrics.value("quarantine_operator_release_total")
    status, answer = operator_api.quarantine_release(body, None, CLIENT)
    assert status == want and answer["error"]["message"], answer
    assert metrics.value("quarantine_operator_release_total") == ops
    assert _released(tmp_path) == []


def test_a_failure_releases_nothing_and_answers_500(decode, tmp_path, monkeypatch):
    def broken(writer: Any, *, who: str) -> dict[str, Any]:
        raise OSError("disk full")

    monkeypatch.setattr(quarantine, "request_operator_release", broken)
    failed = metrics.value("quarantine_failed_total")
    status, answer = operator_api.quarantine_release(b'{"all": true}', None, CLIENT)
    assert status == 500 and "disk full" in answer["error"]["message"]
    assert "nothing was released" in answer["error"]["message"]
    assert metrics.value("quarantine_failed_total") == failed + 1
    assert _released(tmp_path) == []


# --------------------------------------------------------------------------- the patched route


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    import asyncio

    from sglang.srt.entrypoints import http_server
    from starlette.testclient import TestClient

    # Importing upstream's http_server installs uvloop's event-loop policy for the process;
    # the test client's portal runs on the default asyncio loop instead (uvloop in a process
    # forked after the import, as `pdsafe-patches check --each-patch` runs its tests, gives
    # anyio no current task).
    _require_a_working_portal(asyncio.SelectorEventLoop)
    # Not entered as a context manager: upstream's lifespan (it starts the server's
    # processes) does not run; the route is served by the app as routed.
    yield TestClient(http_server.app, client=("10.9.8.7", 4242),
                     backend_options={"loop_factory": asyncio.SelectorEventLoop})


def _require_a_working_portal(loop_factory: Any) -> None:
    """Skip (with the reason) in a process whose asyncio cannot run anyio's blocking portal:
    ``asyncio.current_task()`` answers None inside the portal's task in the children that
    ``pdsafe-patches check --each-patch`` forks from its preloaded zygote (seen with anyio
    4 on Python 3.11; a fresh interpreter, as ``scripts/run-tests.sh`` runs these tests, is
    not affected). The route tests need the portal; the module's other tests do not."""
    from anyio.from_thread import start_blocking_portal

    try:
        with start_blocking_portal(backend_options={"loop_factory": loop_factory}):
            pass
    except AttributeError as e:
        pytest.skip(f"this process's asyncio cannot run anyio's portal ({e}): a forked "
                    "test process; the route tests run in scripts/run-tests.sh")


def test_the_route_releases_through_the_state_dir_into_the_schedulers_quarantine(
        decode, tmp_path, client, caplog):
    kv_mgr = SimpleNamespace()
    q = quarantine.of(kv_mgr)
    q.hold(5, room=9, rid="victim", tokens=32, writer=WRITER, now=0.0, deadline=1.0,
           writer_since=1.0)
    assert not quarantine.ready(kv_mgr, 5, drained=False, now=2.0, deadline=1.0)
    with caplog.at_level(logging.WARNING, logger="sglang.pdsafe.quarantine"):
        r = client.post(operator_api.PATH, json={"writer": WRITER})
    assert r.status_code == 200, r.text
    assert r.json()["released_writer"] == WRITER
    assert any("operator 10.9.8.7:4242 released" in m.message for m in caplog.records)
    assert quarantine.ready(kv_mgr, 5, drained=False, now=3.0, deadline=1.0)
    released = metrics.value("quarantine_released_operator_total")
    quarantine.released(kv_mgr, 5, drained=False, now=3.0)
    assert metrics.value("quarantine_released_operator_total") == released + 1


def test_the_route_checks_the_admin_key_itself(decode, tmp_path, client):
    """Upstream adds its API-key middleware in single-tokenizer mode only; the route refuses
    a caller without the admin key on its own."""
    decode["admin_api_key"] = "s3cret"
    assert client.post(operator_api.PATH, json={"all": True}).status_code == 401
    assert client.post(operator_api.PATH, json={"all": True},
                       headers={"Authorization": "Bearer nope"}).status_code == 401
    assert _released(tmp_path) == []
    r = client.post(operator_api.PATH, json={"all": True},
                    headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200, r.text
    assert [w for w, _ in _released(tmp_path)] == [None]


def test_the_route_answers_400_with_the_expected_shape(decode, client):
    r = client.post(operator_api.PATH, content=b'{"writer": "x"}')
    assert r.status_code == 400 and '"writer"' in r.json()["error"]["message"]
