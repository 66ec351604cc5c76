"""Stock prefills during a rolling upgrade (``sglang.pdsafe.peer_policy``, issue 11 item 1).

Through the real pairing step (``pair_agreement.ensure_prefill_info``) and the real commit gate
(``coverage.admit`` over sglang's real ``MetadataBuffers``): by default a prefill that announces
no pdsafe wire version is refused at pairing; with ``SGLANG_PDSAFE_WAIVE_FOR_STOCK_PEERS`` it is
paired (logged and counted once) and, with ``coverage-attestation`` waived, its unattested
transfers are committed (counted per transfer). The waiver never reaches a prefill that
announces a wire version, nor a row that carries an attestation.

With real servers (stock prefill, fork decode): ``test/pd/test_mixed_versions.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang.pdsafe import coverage as cov
from sglang.pdsafe import metrics, pair_agreement, peer_policy

from .test_coverage import TOKENS, _roundtrip
from .test_pair_agreement import FakeKVManager, decode_reqs, info_with, queue_for

BOTH = "pair-agreement,coverage-attestation"


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    from sglang.pdsafe import peer_notifier

    for var in (peer_policy.ENV_WAIVE, pair_agreement.ENV_ENABLE, pair_agreement.ENV_SKIP,
                cov.ENV_MODE):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(peer_notifier, "notify_prefill", lambda *a, **k: None)
    monkeypatch.setattr(pair_agreement, "_fetch_info", lambda addr: getattr(
        FakeKVManager.current, "info", None))


def stock_info(page_size: int = 64) -> SimpleNamespace:
    """What a stock 0.5.23 prefill's bootstrap server answers: upstream's fields only."""
    return SimpleNamespace(page_size=page_size, kv_cache_dtype="float32", kv_layout=None)


def test_default_refuses_a_stock_prefill_naming_the_versions():
    mgr = FakeKVManager(info=stock_info())
    assert pair_agreement.ensure_prefill_info(queue_for(mgr), "s:1", decode_reqs(1)) is None
    assert "wire_version" in mgr.failures[1] and pair_agreement.WIRE_VERSION in mgr.failures[1]


def test_waiver_pairs_a_stock_prefill_once_and_counts_it(monkeypatch):
    monkeypatch.setenv(peer_policy.ENV_WAIVE, BOTH)
    mgr = FakeKVManager(info=stock_info())
    before = metrics.value("stock_peer_paired_total")
    assert pair_agreement.ensure_prefill_info(queue_for(mgr), "s:2", decode_reqs(1)) is True
    assert "s:2" in peer_policy.stock_peers(mgr) and not mgr.failures
    mgr.prefill_info_table.clear()  # asked again (e.g. after a restart): still counted once
    assert pair_agreement.ensure_prefill_info(queue_for(mgr), "s:2", decode_reqs(2)) is True
    assert metrics.value("stock_peer_paired_total") == before + 1


def test_waiver_still_checks_upstreams_fields():
    mgr = FakeKVManager(info=stock_info(page_size=16))
    with pytest.MonkeyPatch.context() as m:
        m.setenv(peer_policy.ENV_WAIVE, BOTH)
        assert pair_agreement.ensure_prefill_info(queue_for(mgr), "s:3", decode_reqs(1)) is None
    assert "page_size: prefill=16, decode=64" in mgr.failures[1]
    assert "s:3" not in peer_policy.stock_peers(mgr)


def test_waiver_never_reaches_a_fork_prefill_of_another_release(monkeypatch):
    monkeypatch.setenv(peer_policy.ENV_WAIVE, BOTH)
    mgr = FakeKVManager(info=info_with(wire_version="sglang-pdsafe-pair/999"))
    assert pair_agreement.ensure_prefill_info(queue_for(mgr), "f:1", decode_reqs(1)) is None
    assert "sglang-pdsafe-pair/999" in mgr.failures[1]


def test_unknown_names_waive_nothing(monkeypatch):
    monkeypatch.setenv(peer_policy.ENV_WAIVE, "coverage, everything")
    assert peer_policy.waived() == frozenset()
    mgr = FakeKVManager(info=stock_info())
    assert pair_agreement.ensure_prefill_info(queue_for(mgr), "s:4", decode_reqs(1)) is None


def _from(dreq, kv_mgr, addr):
    dreq.kv_receiver = SimpleNamespace(kv_mgr=kv_mgr, bootstrap_addr=addr)
    return dreq


def _unattested(kv_mgr, addr):
    """A finished transfer whose row carries no attestation (what a stock prefill sends)."""
    dq, dreq = _roundtrip(TOKENS, TOKENS)
    dq.metadata_buffers.bootstrap_room[dreq.metadata_buffer_index, 1:] = 0
    return dq, _from(dreq, kv_mgr, addr)


def test_unattested_transfer_from_a_waived_stock_prefill_is_committed(monkeypatch):
    monkeypatch.setenv(peer_policy.ENV_WAIVE, BOTH)
    mgr = SimpleNamespace()
    peer_policy.stock_peers(mgr).add("s:5")
    waived = metrics.value("coverage_waived_total")
    dq, dreq = _unattested(mgr, "s:5")
    assert cov.admit(dq, dreq) is True and dreq.req.finished_reason is None
    assert metrics.value("coverage_waived_total") == waived + 1
    # another prefill, not paired as a stock peer: refused as always
    dq, dreq = _unattested(mgr, "f:2")
    assert cov.admit(dq, dreq) is False


def test_only_pair_agreement_waived_still_refuses_the_transfer(monkeypatch):
    monkeypatch.setenv(peer_policy.ENV_WAIVE, "pair-agreement")
    mgr = SimpleNamespace()
    peer_policy.stock_peers(mgr).add("s:6")
    dq, dreq = _unattested(mgr, "s:6")
    assert cov.admit(dq, dreq) is False


def test_an_attestation_that_differs_is_refused_even_from_a_waived_peer(monkeypatch):
    monkeypatch.setenv(peer_policy.ENV_WAIVE, BOTH)
    mgr = SimpleNamespace()
    peer_policy.stock_peers(mgr).add("s:7")
    dq, dreq = _roundtrip(TOKENS[:100], TOKENS)
    _from(dreq, mgr, "s:7")
    assert cov.admit(dq, dreq) is False
