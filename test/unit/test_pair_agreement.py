"""Settings both PD legs must share are compared when decode pairs (issue #7, finding 14).

``sglang.pdsafe.pair_agreement``: what each leg publishes, the comparison (every differing
field with both values), and decode's pairing step, which refuses a prefill (once per prefill:
one ERROR, one count) and fails every request that targets it at once, instead of raising in
the decode scheduler (upstream 0.5.23 raises ``RuntimeError`` there on a page-size, KV dtype or
layout mismatch). The prefill's settings travel through the real (patched) bootstrap server.
No sglang servers; with servers: test/pd/test_liveness_limits.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import requests
from pdsafe_testkit.loopback import reserve_port
from sglang.pdsafe import (  # noqa: F401 - kv_integrity registers kv_digest
    control_mac,
    kv_integrity,
    metrics,
    pair_agreement,
    pair_settings,
)
from sglang.pdsafe.pair_agreement import Mismatch, PairSettings, compare
from sglang.srt.disaggregation.base.conn import KVPoll


def settings(**kw: Any) -> PairSettings:
    base = dict(wire_version=pair_agreement.WIRE_VERSION, page_size=16, kv_cache_dtype="float32",
                kv_layout=None, context_length=512, chat_template="sha256:abc",
                max_prompt_tokens=494)
    base.update(kw)
    return PairSettings(**base)


# --------------------------------------------------------------------------- compare


def test_equal_settings_agree_and_max_prompt_tokens_may_differ():
    assert compare(settings(), settings(max_prompt_tokens=384)) == []


def test_every_differing_field_is_named_with_both_values():
    found = compare(settings(page_size=16, context_length=512),
                    settings(page_size=64, context_length=600, chat_template="sha256:def"))
    assert found == [Mismatch("page_size", 16, 64), Mismatch("context_length", 512, 600),
                     Mismatch("chat_template", "sha256:abc", "sha256:def")]
    msg = pair_agreement.refusal_message("127.0.0.1:9000", found)
    for text in ("127.0.0.1:9000", "page_size: prefill=16, decode=64",
                 "context_length: prefill=512, decode=600", "--page-size", "--context-length",
                 "--chat-template"):
        assert text in msg, (text, msg)


def test_a_prefill_without_pdsafe_settings_differs_in_the_wire_version():
    assert compare(None, settings()) == [
        Mismatch("wire_version", None, pair_agreement.WIRE_VERSION)]


def test_a_field_one_leg_cannot_tell_is_not_compared_and_skips_are_honoured():
    assert compare(settings(chat_template=None), settings()) == []
    assert compare(settings(context_length=400), settings(), skip=frozenset({"context_length"})) \
        == []


def test_wire_round_trip_ignores_unknown_fields():
    wire = {**settings().to_wire(), "from_a_newer_release": 1}
    assert PairSettings.from_wire(wire) == settings()
    assert PairSettings.from_wire("garbage") is None


def test_chat_template_digest(tmp_path: Path):
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{{ messages }}")
    other = tmp_path / "u.jinja"
    other.write_text("{{ messages }} ")
    d = pair_agreement.chat_template_digest
    assert d(SimpleNamespace(chat_template=str(tpl))) != d(
        SimpleNamespace(chat_template=str(other)))
    assert d(SimpleNamespace(chat_template="chatml")) == "name:chatml"
    model = tmp_path / "model"
    model.mkdir()
    assert d(SimpleNamespace(chat_template=None, tokenizer_path=str(model))) == "none"
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    first = d(SimpleNamespace(chat_template=None, tokenizer_path=str(model)))
    assert first.startswith("sha256:")
    assert d(SimpleNamespace(chat_template=None, tokenizer_path="org/hub-id")) is None


def test_local_settings_read_the_effective_limits():
    scheduler = SimpleNamespace(tp_worker=SimpleNamespace(model_config=SimpleNamespace(
        context_len=512)), max_req_input_len=447, server_args=SimpleNamespace(
        chat_template="chatml"))
    kv_args = SimpleNamespace(page_size=64, kv_cache_dtype_str="float32", kv_layout=None)
    got = pair_agreement.local_settings(scheduler, kv_args)
    assert got == PairSettings(pair_agreement.WIRE_VERSION, 64, "float32", None, 512,
                               "name:chatml", 446, kv_digest="pdsafe-kvdigest/1",
                               incarnation=pair_settings.INCARNATION, control_key=(
                                   control_mac.advertised(scheduler.server_args)))
    assert got.control_key in ("none", "off") or got.control_key.startswith("blake2b-mac:")
    assert len(pair_settings.INCARNATION) == 16  # this process's random id


# --------------------------------------------------------------------------- decode pairing


class FakeKVManager:
    """The members of upstream's CommonKVManager the pairing step uses (public API only)."""

    #: The manager under test: its prefill's GET /route?pdsafe_pair=1 answer is ``info``.
    current: FakeKVManager | None = None

    def __init__(self, info: Any = None, raises: str | None = None) -> None:
        FakeKVManager.current = self
        self.kv_args = SimpleNamespace(page_size=64, kv_cache_dtype_str="float32", kv_layout=None)
        self.prefill_info_table: dict[str, Any] = {}
        self.info, self.raises = info, raises
        self.fetches = 0
        self.failures: dict[int, str] = {}
        self.status: dict[int, Any] = {}

    def try_ensure_parallel_info(self, addr: str) -> bool:
        if addr in self.prefill_info_table:
            return True
        self.fetches += 1
        if self.raises:
            raise RuntimeError(self.raises)
        if self.info is None:
            return False
        self.prefill_info_table[addr] = self.info
        return True

    def record_failure(self, room: int, reason: str) -> None:
        self.failures[room] = reason

    def update_status(self, room: int, status: Any) -> None:
        self.status[room] = status


def queue_for(kv_mgr: FakeKVManager) -> SimpleNamespace:
    scheduler = SimpleNamespace(tp_worker=SimpleNamespace(model_config=SimpleNamespace(
        context_len=512)), max_req_input_len=385, server_args=SimpleNamespace(
        chat_template="chatml"))
    return SimpleNamespace(kv_manager=kv_mgr, scheduler=scheduler)


def decode_reqs(*rooms: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(req=SimpleNamespace(bootstrap_room=r, bootstrap_host="127.0.0.1",
                                                bootstrap_port=9000,
                                                disagg_prefill_dp_rank=None),
                            kv_receiver=object()) for r in rooms]


@pytest.fixture
def notices(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """The peer-release notices the refusal queues for the prefill (recorded, not sent)."""
    from sglang.pdsafe import peer_notifier

    sent: list[tuple] = []
    monkeypatch.setattr(peer_notifier, "notify_prefill",
                        lambda host, port, room, reason, **kw: sent.append((room, reason)))
    monkeypatch.delenv(pair_agreement.ENV_ENABLE, raising=False)
    monkeypatch.delenv(pair_agreement.ENV_SKIP, raising=False)
    return sent


@pytest.fixture(autouse=True)
def _route(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pairing step asks the prefill's bootstrap server for its pair settings
    (``?pdsafe_pair=1``); here that answer is the fake manager's prefill info."""
    monkeypatch.setattr(pair_agreement, "_fetch_info", lambda addr: getattr(
        FakeKVManager.current, "info", None))


def info_with(**kw: Any) -> SimpleNamespace:
    pub = settings(page_size=64, context_length=512, chat_template="name:chatml",
                   max_prompt_tokens=446)
    pub = PairSettings(**{**pub.to_wire(), **kw})
    return SimpleNamespace(page_size=pub.page_size, kv_cache_dtype="float32", kv_layout=None,
                           pdsafe_pair=pub.to_wire())


def test_agreeing_prefill_pairs(notices):
    mgr = FakeKVManager(info=info_with())
    assert pair_agreement.ensure_prefill_info(queue_for(mgr), "p:1", decode_reqs(1)) is True
    assert "p:1" in mgr.prefill_info_table and not mgr.failures and not notices


def test_unreachable_prefill_takes_upstreams_retry_path(notices):
    mgr = FakeKVManager(info=None)
    assert pair_agreement.ensure_prefill_info(queue_for(mgr), "p:1", decode_reqs(1)) is False
    assert not mgr.failures


def test_mismatch_is_refused_once_and_fails_every_request_at_once(notices):
    mgr = FakeKVManager(info=info_with(context_length=600))
    q = queue_for(mgr)
    before = metrics.value(pair_agreement.MISMATCH)
    assert pair_agreement.ensure_prefill_info(q, "p:1", decode_reqs(1, 2)) is None
    assert "p:1" not in mgr.prefill_info_table  # asked again after RECHECK_S
    for room in (1, 2):
        assert "context_length: prefill=600, decode=512" in mgr.failures[room]
        assert mgr.status[room] == KVPoll.Failed
    assert [r for r, _ in notices] == [1, 2] and "prefill=600" in notices[0][1]
    # A second request for the same prefill: failed from the standing verdict, not fetched,
    # and the verdict still expires when it would have (it is not extended by traffic).
    fetches = mgr.fetches
    until = pair_agreement._verdicts(mgr).refused["p:1"][1]
    assert pair_agreement.ensure_prefill_info(q, "p:1", decode_reqs(3)) is None
    assert mgr.fetches == fetches and "prefill=600" in mgr.failures[3]
    assert pair_agreement._verdicts(mgr).refused["p:1"][1] == until
    assert metrics.value(pair_agreement.MISMATCH) == before + 1  # once per prefill


def test_upstreams_raise_becomes_a_refusal_naming_every_field(notices, monkeypatch):
    mgr = FakeKVManager(raises="Page size mismatch: prefill server has page_size=16, but "
                               "decode server has page_size=64.")
    monkeypatch.setattr(pair_agreement, "_fetch_info",
                        lambda addr: {**vars(info_with(page_size=16, context_length=600)),
                                      "page_size": 16})
    assert pair_agreement.ensure_prefill_info(queue_for(mgr), "p:2", decode_reqs(7)) is None
    msg = mgr.failures[7]
    assert "page_size: prefill=16, decode=64" in msg and "context_length: prefill=600" in msg


def test_upstreams_raise_is_refused_with_its_own_message_when_nothing_is_published(notices,
                                                                                   monkeypatch):
    mgr = FakeKVManager(raises="KV cache dtype mismatch: prefill=fp8, decode=float32")
    monkeypatch.setattr(pair_agreement, "_fetch_info", lambda addr: None)
    assert pair_agreement.ensure_prefill_info(queue_for(mgr), "p:3", decode_reqs(8)) is None
    assert "KV cache dtype mismatch: prefill=fp8, decode=float32" in mgr.failures[8]


def test_a_refusal_is_rechecked_after_its_time(notices, monkeypatch):
    mgr = FakeKVManager(info=info_with(context_length=600))
    q = queue_for(mgr)
    assert pair_agreement.ensure_prefill_info(q, "p:4", decode_reqs(1)) is None
    mgr.info = info_with()  # the operator restarted the prefill with matching settings
    monkeypatch.setattr(pair_agreement, "RECHECK_S", 0.0)
    pair_agreement._verdicts(mgr).refused.clear()  # the standing verdict has expired
    assert pair_agreement.ensure_prefill_info(q, "p:4", decode_reqs(2)) is True
    assert 2 not in mgr.failures


def test_the_switch_turns_the_comparison_off(notices, monkeypatch):
    monkeypatch.setenv(pair_agreement.ENV_ENABLE, "0")
    mgr = FakeKVManager(info=info_with(context_length=600))
    assert pair_agreement.ensure_prefill_info(queue_for(mgr), "p:5", decode_reqs(1)) is True
    monkeypatch.setenv(pair_agreement.ENV_ENABLE, "1")
    monkeypatch.setenv(pair_agreement.ENV_SKIP, "context_length")
    mgr = FakeKVManager(info=info_with(context_length=600))
    assert pair_agreement.ensure_prefill_info(queue_for(mgr), "p:6", decode_reqs(1)) is True


# --------------------------------------------------------------------------- the wire


def test_prefill_settings_travel_through_the_real_bootstrap_server():
    """The patched bootstrap server stores the prefill's pdsafe_pair from its registration and
    returns it in GET /route to a decode that asks (?pdsafe_pair=1); a stock decode's query
    gets upstream's payload unchanged, which upstream's PrefillServerInfo(**payload) accepts."""
    from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer, PrefillServerInfo

    port = reserve_port()
    server = CommonKVBootstrapServer("127.0.0.1", port)
    try:
        url = f"http://127.0.0.1:{port}/route"
        deadline = time.monotonic() + 30
        while True:
            try:
                requests.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except requests.RequestException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        row = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
               "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
               "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1",
               "rank_port": 1, "page_size": 64, "kv_cache_dtype": "float32",
               "pdsafe_pair": settings(page_size=64).to_wire()}
        from sglang.pdsafe import bootstrap_auth

        assert requests.put(url, timeout=10,
                            **bootstrap_auth.signed_write("PUT /route", row)).status_code == 200
        query = "?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
        stock = requests.get(url + query, timeout=10).json()
        assert "pdsafe_pair" not in stock
        PrefillServerInfo(**stock)  # what a stock decode does with the answer
        got = requests.get(url + query + "&pdsafe_pair=1", timeout=10).json()
        assert PairSettings.from_wire(got["pdsafe_pair"]) == settings(page_size=64)
    finally:
        server.close()
