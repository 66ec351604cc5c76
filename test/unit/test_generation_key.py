"""Where a decode's transfer-generation key comes from (``sglang.pdsafe.generation_key``;
issue 21, items 1 and 2). The minted generation itself, on upstream's real receivers:
test/unit/test_transfer_generation.py::test_a_keyed_generation_cannot_be_computed_from_the_reservation.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang.pdsafe import generation_key, metrics
from sglang.pdsafe.transfer_generation import derive

TOKEN = "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN"
INPUTS = dict(room=12345, aux_index=3, page_indices=[7, 8, 9], epochs=(1, 2))


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for var in (generation_key.ENV_KEY, generation_key.ENV_REQUIRE, TOKEN):
        monkeypatch.delenv(var, raising=False)


def _args(nnodes: int = 1, api_key: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(nnodes=nnodes, api_key=api_key)


def test_the_key_changes_the_generation():
    assert derive(**INPUTS, key=b"a" * 32) == derive(**INPUTS, key=b"a" * 32)
    assert derive(**INPUTS, key=b"a" * 32) != derive(**INPUTS, key=b"b" * 32)
    assert derive(**INPUTS, key=b"a" * 32) != derive(**INPUTS)


@pytest.mark.parametrize("token", [None, "cluster-secret"])
def test_a_single_node_decode_gets_a_new_key_per_launch(token, monkeypatch):
    """Per-server secret, or the cluster key: either way an incarnation nonce makes every
    launch's key new (a message recorded before a restart never matches again)."""
    if token:
        monkeypatch.setenv(TOKEN, token)
    generation_key.prepare(_args())
    first = generation_key.current()
    generation_key.prepare(_args())
    assert len(first) == generation_key.KEY_BYTES and generation_key.current() != first
    assert generation_key.rank_starting(_args()) == generation_key.current()
    assert metrics.value(generation_key.GAUGE) == 0


def test_a_multi_node_decode_derives_one_key_from_the_cluster_key(monkeypatch):
    """Each node's launcher would draw its own secret: with ``nnodes > 1`` it prepares none,
    and every rank derives the same key from the cluster key (the two nodes' ranks mint
    alike)."""
    monkeypatch.setenv(TOKEN, "cluster-secret,old-secret")
    keys = []
    for _ in range(2):  # two nodes
        monkeypatch.delenv(generation_key.ENV_KEY, raising=False)
        generation_key.prepare(_args(nnodes=2))
        assert generation_key.current() == b"", "no per-node secret may be drawn"
        keys.append(generation_key.rank_starting(_args(nnodes=2)))
    assert keys[0] and keys[0] == keys[1]
    monkeypatch.delenv(TOKEN)
    monkeypatch.delenv(generation_key.ENV_KEY)
    assert generation_key.rank_starting(_args(nnodes=2, api_key="k")) != keys[0]


def test_without_any_key_the_rank_is_unkeyed_loudly_or_refused(monkeypatch, caplog):
    generation_key.prepare(_args(nnodes=2))
    with caplog.at_level("WARNING", logger="sglang.pdsafe.generation_key"):
        assert generation_key.rank_starting(_args(nnodes=2)) == b""
    assert "UNKEYED" in caplog.text and TOKEN in caplog.text
    assert metrics.value(generation_key.GAUGE) == 1
    monkeypatch.setenv(generation_key.ENV_REQUIRE, "1")
    with pytest.raises(generation_key.GenerationKeyError, match=TOKEN):
        generation_key.rank_starting(_args(nnodes=2))
