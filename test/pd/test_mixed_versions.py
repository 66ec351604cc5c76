"""Mixed fork/stock PD pairs, as during a rolling upgrade (issue 11, item 2; first slice).

The stock leg is the pinned upstream 0.5.23 plus only the CPU-enablement patches 0001-0003 (the
benchmark's base tree, ``benchmark.base_tree``), run with ``PYTHONPATH`` pointing at that tree;
the fork leg is the installed package. Each started server's ``/server_info`` version is checked,
so a pair can never silently be fork/fork.

* **stock prefill, fork decode**: the stock prefill publishes no pair settings and writes no
  coverage attestation. Every request fails on both legs with an explicit error naming the
  missing pdsafe wire version (pair agreement), at once, never a hang and never an HTTP 200;
  the decode counts the refused prefill once; both servers keep running.
* **fork prefill, stock decode**: the stock decode announces no pdsafe wire version, so the
  fork prefill refuses it at bootstrap (``sglang.pdsafe.peer_capability``): every request fails
  at once on both legs with an explicit error naming both versions and the missing capability
  (``decode-protections``), never a hang and never an HTTP 200; the prefill counts the decode
  once per rank (``decode_peer_refused``); both servers keep running.
* **fork prefill, stock decode with the upgrade-window waiver**
  (``SGLANG_PDSAFE_WAIVE_FOR_STOCK_PEERS=decode-protections`` on the prefill): the fork's extra
  data (attestation slots of the metadata row, pair settings only on request) must not confuse
  a stock decode: every answer, direct and through the router, is the co-located reference's,
  token for token; the prefill counts the decode once (``stock_decode_served``).

* **stock prefill, fork decode with the upgrade-window waiver**
  (``SGLANG_PDSAFE_WAIVE_FOR_STOCK_PEERS=pair-agreement,coverage-attestation,kv-digest`` on
  the decode): every answer is the reference's, token for token; the decode counts the stock
  prefill once (``stock_peer_paired``), every unattested transfer it committed
  (``coverage_waived``) and every transfer it decoded without a KV digest
  (``kv_digest_waived``).

What this does not cover: fork/fork of another release over the KV wire (no test-only knob
makes a server publish another wire version). Pair agreement refuses another wire version at
bootstrap (``test/unit/test_peer_policy.py``, on the real pairing step); the prefill refuses a
decode that announced another wire version, even under the waiver, and a decode never
announces itself to a prefill of another version (``test/unit/test_peer_capability.py``, on
each backend's real bootstrap loop).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from pdsafe_testkit.backends import BACKENDS
from pdsafe_testkit.metrics import metric_total
from pdsafe_testkit.oracle import Oracle, random_prompt
from pdsafe_testkit.servers import (
    SHARED_DECODE_POOL,
    SHARED_PREFILL_POOL,
    PDStack,
    ServerConfig,
    direct_pd_generate,
    generate,
    pd_stack,
)

pytestmark = pytest.mark.server

MAX_NEW = 16
#: Longest a refused request may take to be answered (upstream's own timeouts are 300 s).
BOUND_S = 60.0
MISMATCH_COUNTER = "sglang:pdsafe_pair_setting_mismatch_total"
#: The context both legs share (pair agreement compares it).
CONTEXT = min(SHARED_PREFILL_POOL, SHARED_DECODE_POOL)


@pytest.fixture(scope="module")
def stock_env() -> dict[str, str]:
    """Environment that makes a server run the stock tree (built once, reused by key)."""
    from benchmark.base_tree import prepare_base_tree

    return prepare_base_tree().env()


def _cfg(role: str, model_path: Path, env: dict[str, str] | None = None) -> ServerConfig:
    pool = SHARED_PREFILL_POOL if role == "prefill" else SHARED_DECODE_POOL
    return ServerConfig(role=role, model_path=model_path, max_total_tokens=pool,
                        context_length=CONTEXT, env=dict(env or {}))


def _assert_versions(st: PDStack, stock: str) -> None:
    for side, server in (("prefill", st.prefill), ("decode", st.decode)):
        version = str(server.server_info().get("version", ""))
        is_fork = "+pdsafe" in version
        assert is_fork == (side != stock), f"{side} runs {version!r}; expected the " + (
            "stock build" if side == stock else "fork")


#: Pairing is refused at bootstrap (decode reads the prefill's published settings over HTTP)
#: before either KV backend moves a byte: one backend proves it (CI time); the other direction
#: exercises each backend's wire data and runs on both.
@pytest.fixture(scope="module", params=["mooncake"])
def stock_prefill(request, stock_env, log_dir: Path, model_path: Path) -> Iterator[PDStack]:
    with pd_stack(request.param, log_dir, prefill=_cfg("prefill", model_path, stock_env),
                  decode=_cfg("decode", model_path), with_router=False) as st:
        _assert_versions(st, stock="prefill")
        yield st


#: No router: it waits for a served request before it counts as started, and this pair serves
#: none (the router sends each request to both legs, as ``direct_pd_generate`` does).
@pytest.fixture(scope="module", params=BACKENDS)
def stock_decode(request, stock_env, log_dir: Path, model_path: Path) -> Iterator[PDStack]:
    with pd_stack(request.param, log_dir, prefill=_cfg("prefill", model_path),
                  decode=_cfg("decode", model_path, stock_env), with_router=False) as st:
        _assert_versions(st, stock="decode")
        yield st


DECODE_WAIVER = {"SGLANG_PDSAFE_WAIVE_FOR_STOCK_PEERS": "decode-protections"}


@pytest.fixture(params=BACKENDS)
def stock_decode_waived(request, stock_env, log_dir: Path,
                        model_path: Path) -> Iterator[PDStack]:
    """Function-scoped: torn down right after its test (the module's other stacks stay)."""
    with pd_stack(request.param, log_dir, prefill=_cfg("prefill", model_path, DECODE_WAIVER),
                  decode=_cfg("decode", model_path, stock_env)) as st:
        _assert_versions(st, stock="decode")
        yield st


def test_stock_prefill_fork_decode_refused_at_pairing(stock_prefill: PDStack, model_path):
    """Every request fails at once on both legs with the pairing refusal; nothing is served."""
    st = stock_prefill
    before = metric_total(st.decode.url, MISMATCH_COUNTER)
    rng = random.Random(1101)
    for i in range(3):
        ids = random_prompt(rng, rng.randint(20, 120), model_path)
        p, d = direct_pd_generate(st, ids, MAX_NEW, timeout=BOUND_S)
        what = f"{st.backend} stock prefill + fork decode, request {i}"
        assert d.status != 200 and not d.output_ids, f"{what}: decode served: {d}"
        msg = d.error_message
        assert "wire_version" in msg and "sglang-pdsafe" in msg, (
            f"{what}: the decode's error does not name the missing pdsafe wire version: {msg}")
        assert p.status != 200 or not p.output_ids or p.error_message, (
            f"{what}: the stock prefill's client got no error: {p}")
    assert metric_total(st.decode.url, MISMATCH_COUNTER) == before + 1, (
        "the refused prefill must be counted once, however many requests name it")
    for side in (st.prefill, st.decode):
        assert side.process.alive(), f"{side.config.role} died"


WAIVER = {"SGLANG_PDSAFE_WAIVE_FOR_STOCK_PEERS": "pair-agreement,coverage-attestation,kv-digest"}


@pytest.fixture(params=["mooncake"])
def stock_prefill_waived(request, stock_env, log_dir: Path,
                         model_path: Path) -> Iterator[PDStack]:
    """Function-scoped: torn down right after its one test (the module's other stacks stay)."""
    with pd_stack(request.param, log_dir, prefill=_cfg("prefill", model_path, stock_env),
                  decode=_cfg("decode", model_path, WAIVER), with_router=False) as st:
        _assert_versions(st, stock="prefill")
        yield st


def test_stock_prefill_fork_decode_served_under_the_waiver(stock_prefill_waived: PDStack,
                                                          oracle: Oracle, model_path):
    """The operator's explicit waiver: the stock prefill is paired (counted once) and each of
    its unattested transfers is committed (counted), with reference-identical content."""
    st = stock_prefill_waived
    paired0 = metric_total(st.decode.url, "sglang:pdsafe_stock_peer_paired_total")
    waived0 = metric_total(st.decode.url, "sglang:pdsafe_coverage_waived_total")
    undigested0 = metric_total(st.decode.url, "sglang:pdsafe_kv_digest_waived_total")
    rng = random.Random(1103)
    n = 3
    for i in range(n):
        ids = random_prompt(rng, rng.randint(20, 200), model_path)
        _, d = direct_pd_generate(st, ids, MAX_NEW, timeout=BOUND_S)
        oracle.assert_identical(d, ids, MAX_NEW, what=f"{st.backend} stock->fork waived {i}")
    assert metric_total(st.decode.url, "sglang:pdsafe_stock_peer_paired_total") == paired0 + 1
    assert metric_total(st.decode.url, "sglang:pdsafe_coverage_waived_total") == waived0 + n, (
        "every unattested transfer committed under the waiver must be counted")
    assert metric_total(st.decode.url, "sglang:pdsafe_kv_digest_waived_total") == \
        undigested0 + n, "every transfer decoded without a KV digest must be counted"


REFUSED_COUNTER = "sglang:pdsafe_decode_peer_refused_total"


def test_fork_prefill_stock_decode_refused_at_bootstrap(stock_decode: PDStack, model_path):
    """Every request fails at once on both legs with the prefill's refusal (both versions and
    the missing capability named); the stock decode is counted once; nothing is served."""
    st = stock_decode
    before = metric_total(st.prefill.url, REFUSED_COUNTER)
    rng = random.Random(1102)
    for i in range(3):
        ids = random_prompt(rng, rng.randint(20, 200), model_path)
        p, d = direct_pd_generate(st, ids, MAX_NEW, timeout=BOUND_S)
        what = f"{st.backend} fork prefill + stock decode, request {i}"
        assert d.status != 200 and not d.output_ids, f"{what}: the stock decode served: {d}"
        for side, msg in (("decode", d.error_message), ("prefill", p.error_message)):
            assert "decode-protections" in msg and "sglang-pdsafe-pair/" in msg, (
                f"{what}: the {side}'s error does not name the versions and capability: {msg}")
    # One decode rank here (TP 1): counted once however many requests it sent.
    assert metric_total(st.prefill.url, REFUSED_COUNTER) == before + 1
    for side in (st.prefill, st.decode):
        assert side.process.alive(), f"{side.config.role} died"


def test_fork_prefill_stock_decode_served_under_the_waiver(stock_decode_waived: PDStack,
                                                          oracle: Oracle, model_path):
    """The operator's explicit waiver on the prefill: the fork's extra wire data does not
    confuse a stock decode (reference-identical answers); the decode is counted once."""
    st = stock_decode_waived
    rng = random.Random(1104)
    for i in range(3):
        ids = random_prompt(rng, rng.randint(20, 200), model_path)
        _, d = direct_pd_generate(st, ids, MAX_NEW, timeout=BOUND_S)
        oracle.assert_identical(d, ids, MAX_NEW, what=f"{st.backend} fork->stock direct {i}")
        r = generate(st.router.url, ids, MAX_NEW, timeout=BOUND_S)
        oracle.assert_identical(r, ids, MAX_NEW, what=f"{st.backend} fork->stock router {i}")
    # The router's start-up probe was this decode's first request: counted then, never again.
    assert metric_total(st.prefill.url, "sglang:pdsafe_stock_decode_served_total") == 1, (
        "the stock decode served under the waiver must be counted once (one decode rank)")
