"""Bootstrap writes need the prefill's key (``sglang.pdsafe.bootstrap_auth``, patch 0029;
issue 21, items 1 and 3), on upstream's real ``CommonKVBootstrapServer`` over loopback HTTP and
the prefill rank's real registration call (``CommonKVManager._register_topology_row``).

Shown: a ``PUT /route`` or ``POST /register_dp_rank`` without the key, or with another key, is
answered 401, counted, and changes nothing (the decodes' ``GET /route`` still returns the real
rank's address); with the check off, the same PUT re-points the rank (the CVE-2026-92972 attack
works on upstream's code, so these tests can see it); the rank's own registration carries the
key; a rotation accepts both keys; the key's sources and the start refusals.
"""

from __future__ import annotations

import os
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


def test_a_rotation_accepts_both_keys_and_sends_the_first(monkeypatch) -> None:
    monkeypatch.setenv(bootstrap_auth.ENV_TOKEN, "new-key, old-key")
    server, base = _server()
    try:
        assert bootstrap_auth.headers() == {"Authorization": "Bearer new-key"}
        for key, want in (("new-key", 200), ("old-key", 200), ("other-key", 401)):
            r = requests.put(base + "/route", json=dict(ROW), timeout=10,
                             headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == want, (key, r.status_code, r.text)
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
    assert bootstrap_auth.headers() == {"Authorization": "Bearer sk-2"}


def test_off_sends_and_checks_nothing(monkeypatch) -> None:
    monkeypatch.setenv(bootstrap_auth.ENV_ENABLE, "0")
    assert bootstrap_auth.prepare(SimpleNamespace(api_key=None, nnodes=4)) == "off"
    assert bootstrap_auth.headers() == {}
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
