"""Bootstrap writes need the prefill's key (``sglang.pdsafe.bootstrap_auth``, patch 0029;
issue 21, items 1 and 3), on upstream's real ``CommonKVBootstrapServer`` over loopback HTTP and
the prefill rank's real registration call (``CommonKVManager._register_topology_row``).

Shown: a ``PUT /route`` or ``POST /register_dp_rank`` without the key, with another key, or
with the right key as a bearer token, is answered 401, counted, and changes nothing (the
decodes' ``GET /route`` still returns the real rank's address); with the check off, the same
PUT re-points the rank (the CVE-2026-92972 attack works on upstream's code, so these tests can
see it); the rank's own registration is signed and never carries the key; a captured signed
write cannot be replayed, re-dated or given another body; a rotation accepts both keys; the
key's sources and the start refusals. Signatures are also built here independently, from the
scheme the module documents, so the test checks the scheme, not only the code against itself.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import requests
from pdsafe_testkit.loopback import reserve_port
from sglang.pdsafe import bootstrap_auth, metrics

ROW = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
       "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
       "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": 17001,
       "page_size": 1, "kv_cache_dtype": "float32"}
RANK_QUERY = "?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
ATTACKER = {**ROW, "rank_ip": "10.66.66.66", "rank_port": 6666}


@pytest.fixture(autouse=True)
def _env(monkeypatch) -> None:
    for name in (bootstrap_auth.ENV_TOKEN, bootstrap_auth.ENV_PREPARED,
                 bootstrap_auth.ENV_ENABLE, bootstrap_auth.ENV_REQUIRE):
        monkeypatch.setenv(name, "")  # recorded, so what the code under test sets is undone
        monkeypatch.delenv(name)


def _server() -> tuple[Any, str]:
    from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer

    port = reserve_port()
    server = CommonKVBootstrapServer("127.0.0.1", port)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            requests.get(base + "/health", timeout=2)
            return server, base
        except requests.RequestException:
            if time.monotonic() > deadline:
                server.close()
                raise
            time.sleep(0.1)


@pytest.fixture
def bootstrap() -> Iterator[str]:
    server, base = _server()
    try:
        yield base
    finally:
        server.close()


def _register(base: str) -> None:
    """The prefill rank's own registration, upstream's code path (retries on failure)."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    CommonKVManager._register_topology_row(SimpleNamespace(), base + "/route", dict(ROW))


def _signed(key: str, what: str, body: bytes, ts: float | None = None) -> dict[str, str]:
    """A signed write's header, from the documented scheme (not the module's code)."""
    wkey = hmac.new(key.encode(), b"sglang-pdsafe bootstrap write 1", hashlib.sha256).digest()
    t, nonce = int(time.time() if ts is None else ts), secrets.token_hex(16)
    mac = hmac.new(wkey, f"{what}\n{t}\n{nonce}\n".encode() + hashlib.sha256(body).digest(),
                   hashlib.sha256).hexdigest()
    return {"Authorization": f"PDSAFE-HMAC1 ts={t},nonce={nonce},mac={mac}",
            "Content-Type": "application/json"}


def _put(base: str, body: bytes, hdrs: dict[str, str]) -> requests.Response:
    return requests.put(base + "/route", data=body, headers=hdrs, timeout=10)


def _rank(base: str) -> tuple[str, int]:
    got = requests.get(base + "/route" + RANK_QUERY, timeout=10)
    assert got.status_code == 200, got.text
    info = got.json()
    return info["rank_ip"], int(info["rank_port"])


def test_a_write_without_the_key_is_refused_401_and_changes_nothing(bootstrap: str) -> None:
    """The bootstrap server prepared a per-server secret (nothing configured); the rank's own
    registration carries it. An attacker's PUT without a key and with a guessed key, and a
    dp-rank registration without a key, are each answered 401 and counted; the decodes'
    GET still returns the real rank."""
    _register(bootstrap)
    assert _rank(bootstrap) == ("127.0.0.1", 17001)
    before = metrics.value(bootstrap_auth.UNAUTHORIZED)
    attempts = [
        requests.put(bootstrap + "/route", json=ATTACKER, timeout=10),
        requests.put(bootstrap + "/route", json=ATTACKER, timeout=10,
                     headers={"Authorization": "Bearer guessed"}),
        requests.put(bootstrap + "/route", json=ATTACKER, timeout=10,  # the key, no scheme
                     headers={"Authorization": os.environ.get(bootstrap_auth.ENV_PREPARED,
                                                              "")}),
        requests.put(bootstrap + "/route", json=ATTACKER, timeout=10,  # the key, in clear
                     headers={"Authorization": "Bearer " + os.environ.get(
                         bootstrap_auth.ENV_PREPARED, "")}),
        _put(bootstrap, json.dumps(ATTACKER).encode(),  # signed under a guessed key
             _signed("guessed", "PUT /route", json.dumps(ATTACKER).encode())),
        requests.post(bootstrap + "/register_dp_rank", timeout=10,
                      json={"bootstrap_room": 7, "dp_rank": 0}),
    ]
    for r in attempts:
        assert r.status_code == 401, (r.status_code, r.text)
        assert bootstrap_auth.ENV_TOKEN in r.text, r.text
    assert metrics.value(bootstrap_auth.UNAUTHORIZED) == before + len(attempts)
    assert _rank(bootstrap) == ("127.0.0.1", 17001), "a refused PUT re-pointed the rank"


def test_with_the_check_off_the_same_put_re_points_the_rank(monkeypatch) -> None:
    """Upstream's behaviour (the check switched off): the attacker's keyless PUT replaces the
    rank's registration, so decodes would send their metadata to the attacker."""
    monkeypatch.setenv(bootstrap_auth.ENV_ENABLE, "0")
    server, base = _server()
    try:
        _register(base)
        assert requests.put(base + "/route", json=ATTACKER, timeout=10).status_code == 200
        assert _rank(base) == ("10.66.66.66", 6666)
    finally:
        server.close()


def test_a_captured_write_cannot_be_replayed_redated_or_reused(bootstrap: str) -> None:
    """What a party on the cluster network sees of the rank's registration is of no use to
    it: the key is not in it; sent again it is refused (replay); its header on another body
    is refused (the attacker's address); a signature dated outside the window is refused."""
    key = os.environ[bootstrap_auth.ENV_PREPARED]
    seen = bootstrap_auth.signed_write("PUT /route", dict(ROW))
    assert key not in json.dumps(seen["headers"]) and key.encode() not in seen["data"]
    assert _put(bootstrap, seen["data"], seen["headers"]).status_code == 200
    assert _rank(bootstrap) == ("127.0.0.1", 17001)
    before = {c: metrics.value(c) for c in (bootstrap_auth.UNAUTHORIZED, bootstrap_auth.STALE)}
    attacker = json.dumps(ATTACKER).encode()
    late = time.time() - bootstrap_auth.FRESH_S - 5
    early = time.time() + bootstrap_auth.FRESH_S + 5
    for body, hdrs, counter in (
            (seen["data"], seen["headers"], bootstrap_auth.STALE),  # replayed as captured
            (attacker, seen["headers"], bootstrap_auth.UNAUTHORIZED),  # another body
            (attacker, _signed(key, "POST /register_dp_rank", attacker),  # another endpoint
             bootstrap_auth.UNAUTHORIZED),
            (attacker, _signed(key, "PUT /route", attacker, ts=late), bootstrap_auth.STALE),
            (attacker, _signed(key, "PUT /route", attacker, ts=early), bootstrap_auth.STALE)):
        r = _put(bootstrap, body, hdrs)
        assert r.status_code == 401, (r.status_code, r.text)
        before[counter] += 1
        assert {c: metrics.value(c) for c in before} == before
    assert _rank(bootstrap) == ("127.0.0.1", 17001), "a refused write re-pointed the rank"
    fresh = _signed(key, "PUT /route", attacker)  # only a holder of the key gets through
    assert _put(bootstrap, attacker, fresh).status_code == 200
    assert _rank(bootstrap) == ("10.66.66.66", 6666)


def test_a_rotation_accepts_both_keys_and_signs_with_the_first(monkeypatch) -> None:
    monkeypatch.setenv(bootstrap_auth.ENV_TOKEN, "new-key, old-key")
    server, base = _server()
    try:
        body = json.dumps(dict(ROW)).encode()
        ours = bootstrap_auth.headers("PUT /route", body)["Authorization"]
        nonce = ours.split("nonce=")[1].split(",")[0]
        ts = int(ours.split("ts=")[1].split(",")[0])
        wkey = hmac.new(b"new-key", b"sglang-pdsafe bootstrap write 1", hashlib.sha256).digest()
        want = hmac.new(wkey, f"PUT /route\n{ts}\n{nonce}\n".encode()
                        + hashlib.sha256(body).digest(), hashlib.sha256).hexdigest()
        assert ours.endswith(f"mac={want}"), "not signed with the first key, as documented"
        for key, status in (("new-key", 200), ("old-key", 200), ("other-key", 401)):
            r = _put(base, body, _signed(key, "PUT /route", body))
            assert r.status_code == status, (key, r.status_code, r.text)
    finally:
        server.close()


def test_the_key_comes_from_the_setting_then_the_api_key_then_a_secret(monkeypatch) -> None:
    args = SimpleNamespace(api_key=None, nnodes=1)
    assert bootstrap_auth.prepare(args) == "a per-server secret"
    secret = os.environ[bootstrap_auth.ENV_PREPARED]
    assert len(secret) == 64
    assert bootstrap_auth.prepare(args) == "a per-server secret"
    assert os.environ[bootstrap_auth.ENV_PREPARED] == secret, "a second launch changed it"
    assert bootstrap_auth.prepare(SimpleNamespace(api_key="sk-1", nnodes=2)) == "--api-key"
    assert os.environ[bootstrap_auth.ENV_PREPARED] == "sk-1"
    monkeypatch.setenv(bootstrap_auth.ENV_TOKEN, "tok-a,tok-b")
    assert bootstrap_auth.prepare(args) == bootstrap_auth.ENV_TOKEN
    assert os.environ[bootstrap_auth.ENV_PREPARED] == "tok-a,tok-b"


@pytest.mark.parametrize("why", ["multi-node", "required"])
def test_a_setting_that_cannot_work_refuses_the_start(monkeypatch, why: str) -> None:
    args = SimpleNamespace(api_key=None, nnodes=2 if why == "multi-node" else 1)
    if why == "required":
        monkeypatch.setenv(bootstrap_auth.ENV_REQUIRE, "1")
    with pytest.raises(bootstrap_auth.BootstrapKeyError, match=bootstrap_auth.ENV_TOKEN):
        bootstrap_auth.prepare(args)
    assert bootstrap_auth.ENV_PREPARED not in os.environ


def test_a_rank_that_no_key_reached_refuses_to_start(monkeypatch) -> None:
    with pytest.raises(bootstrap_auth.BootstrapKeyError, match="holds no bootstrap key"):
        bootstrap_auth.rank_starting(SimpleNamespace(api_key=None))
    bootstrap_auth.rank_starting(SimpleNamespace(api_key="sk-2"))  # a configured key works
    assert os.environ[bootstrap_auth.ENV_PREPARED] == "sk-2"
    assert bootstrap_auth.headers("PUT /route", b"{}")["Authorization"].startswith(
        "PDSAFE-HMAC1 ts=")


def test_off_sends_and_checks_nothing(monkeypatch) -> None:
    monkeypatch.setenv(bootstrap_auth.ENV_ENABLE, "0")
    assert bootstrap_auth.prepare(SimpleNamespace(api_key=None, nnodes=4)) == "off"
    assert bootstrap_auth.headers("PUT /route", b"{}") == {}
    assert bootstrap_auth.signed_write("PUT /route", {})["headers"] == {
        "Content-Type": "application/json"}
    assert bootstrap_auth.refuses_write("PUT /route", {}) is None


def test_a_check_that_cannot_run_refuses(monkeypatch) -> None:
    """Fail closed: the check raising refuses the write (503), counted as a hook failure."""
    monkeypatch.setenv(bootstrap_auth.ENV_PREPARED, "k")

    class Boom:
        def get(self, *a: Any) -> str:
            raise RuntimeError("boom")

    before = metrics.value(bootstrap_auth.FAILED)
    refusal = bootstrap_auth.refuses_write("PUT /route", Boom())
    assert refusal is not None and refusal.status == 503
    assert "bootstrap_auth.refuses_write" in refusal.reason
    assert metrics.value(bootstrap_auth.FAILED) == before + 1
