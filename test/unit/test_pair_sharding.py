"""Heterogeneous parallelism between the PD legs is refused at pairing while the KV digest is on
(issue 20, item 6; ``pair_agreement.sharding_mismatches``).

The KV digest verifies each decode rank's KV against the digest of the one prefill rank that
wrote it. With another attention-TP, PP or attention-CP size on the two legs, or a prefill that
splits its DSA cache by layer or shards pages, the digests cover other bytes: before this check
every request of such a pair failed with ``kv_digest_invalid`` (500). Now the decode refuses the
pair once, naming both layouts and the remedy, and every request to that prefill fails at once.

No servers: test_peer_capability's decode manager and the real pairing step
(``pair_agreement.ensure_prefill_info``) over what the prefill's bootstrap server answers.
"""

from __future__ import annotations

import pytest
from sglang.pdsafe import kv_integrity, pair_agreement

from . import test_peer_capability as cap


def _decode(attn_tp: int = 1, pp: int = 1, attn_cp: int = 1):
    d = cap._decode_manager("mooncake", cap._identity("mooncake"))
    d.attn_tp_size, d.pp_size, d.attn_cp_size = attn_tp, pp, attn_cp
    return d


def _info(d, **topology):
    info = cap.fork_prefill_info(d)
    info.update({"attn_tp_size": 1, "pp_size": 1, "attn_cp_size": 1, **topology})
    return info


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for var in (kv_integrity.ENV_ENABLE, pair_agreement.ENV_SKIP, pair_agreement.ENV_ENABLE):
        monkeypatch.delenv(var, raising=False)


def test_legs_sharded_alike_pair(monkeypatch):
    d = _decode(attn_tp=2)
    assert cap._pair(monkeypatch, d, _info(d, attn_tp_size=2)) is True


@pytest.mark.parametrize("topology,prefill_says", [
    ({"attn_tp_size": 4}, "attn_tp=4,pp=1,attn_cp=1"),
    ({"pp_size": 2}, "attn_tp=1,pp=2,attn_cp=1"),
    ({"attn_cp_size": 2}, "attn_tp=1,pp=1,attn_cp=2"),
    ({"enable_dsa_cache_layer_split": True}, "attn_tp=1,pp=1,attn_cp=1,dsa-layer-split"),
    ({"enable_kv_cache_sharding": True}, "attn_tp=1,pp=1,attn_cp=1,kv-cache-sharding"),
])
def test_another_sharding_is_refused_at_pairing_naming_both(monkeypatch, topology,
                                                           prefill_says):
    d = _decode()
    assert cap._pair(monkeypatch, d, _info(d, **topology)) is not True
    message = pair_agreement._refused(d, cap.ADDR)
    assert message is not None, "refused at pairing"
    assert f"kv_sharding: prefill='{prefill_says}', decode='attn_tp=1,pp=1,attn_cp=1'" in \
        message, message
    assert kv_integrity.ENV_ENABLE + "=0" in message and "heterogeneous" in message, message


def test_with_the_digest_off_on_both_legs_upstreams_heterogeneous_pairing_stands(monkeypatch):
    monkeypatch.setenv(kv_integrity.ENV_ENABLE, "0")
    d = _decode()
    assert cap._pair(monkeypatch, d, _info(d, attn_tp_size=4)) is True


def test_the_operator_can_skip_the_field(monkeypatch):
    monkeypatch.setenv(pair_agreement.ENV_SKIP, "kv_sharding")
    d = _decode()
    assert cap._pair(monkeypatch, d, _info(d, pp_size=2)) is True
