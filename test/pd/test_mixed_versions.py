"""Mixed fork/stock PD pairs, and fork/fork pairs of two releases, as during a rolling upgrade
(issue 11, items 2 and 3).

The stock leg is the pinned upstream 0.5.23 plus only the CPU-enablement patches 0001-0003 (the
benchmark's base tree, ``benchmark.base_tree``), run with ``PYTHONPATH`` pointing at that tree;
the fork leg is the installed package. Each started server's ``/server_info`` version is checked,
so a pair can never silently be fork/fork.

* **stock prefill, fork decode**: the stock prefill publishes no pair settings and writes no
  coverage attestation. Every request fails on both legs with an explicit error naming the
  missing pdsafe wire version (pair agreement), at once, never a hang and never an HTTP 200;
  the decode counts the refused prefill once; both servers keep running.
* **fork prefill (no cluster key yet), stock decode**: the stock decode announces no pdsafe
  wire version, so the fork prefill refuses it at bootstrap
  (``sglang.pdsafe.peer_capability``): every request fails at once on both legs with an
  explicit error naming both versions and the missing capability (``decode-protections``),
  never a hang and never an HTTP 200; the prefill counts the decode
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

Fork/fork of another release (issue 11, item 3): one leg runs with the test-only fault
``SGLANG_PDSAFE_TEST_FAULTS=wire_version:sglang-pdsafe-pair/2`` (``pdsafe_testkit.faults``),
so that server publishes, announces and requires the previous release's wire version, as a
fork of that release does; ``/server_info`` still reports this build, so both legs are checked
to be the fork. The decode compares the wire version the prefill published with its own when
it pairs, before it announces itself or sends any metadata, so it refuses in both directions:

* **prefill of another release, fork decode**: every request fails at once on both legs with
  the decode's refusal naming both versions (``wire_version: prefill='sglang-pdsafe-pair/2',
  decode='sglang-pdsafe-pair/7'``), never a hang and never an HTTP 200; the decode counts the
  prefill once (``pair_setting_mismatch``); the prefill refuses nothing (it never gets a
  decode's metadata); both servers keep running.
* **fork prefill, decode of another release**: the same, with the versions the other way
  round (``prefill='sglang-pdsafe-pair/7', decode='sglang-pdsafe-pair/2'``).
* **same release, another cluster key on the decode**: refused at pairing the same way, the
  error naming both legs' key ids (``control_key: prefill='blake2b-mac:…', decode=…``), never
  the keys; no message reaches the prefill.

Pairing is refused over HTTP before either KV backend moves a byte, so these run on Mooncake
only unless ``PDSAFE_FULL_BACKENDS=all`` (``pdsafe_testkit.backends.ci_backends``). So does the
fork prefill's refusal of a stock decode (CI's time budget): it runs in each backend's own
bootstrap thread, which ``test/unit/test_peer_capability.py`` drives on every backend.

What this does not cover: a fork prefill's own refusal of a decode that announced another wire
version over the KV wire (the decode refuses that prefill first, at pairing); that path, even
under the waiver, and that a decode never announces itself to a prefill of another version are
covered in ``test/unit/test_peer_capability.py`` (on each backend's real bootstrap loop); pair
agreement's refusal on the real pairing step in ``test/unit/test_peer_policy.py``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from pdsafe_testkit.backends import ci_backends
from pdsafe_testkit.metrics import metric_total
from pdsafe_testkit.oracle import Oracle, random_prompt
from pdsafe_testkit.servers import (
    SHARED_DECODE_POOL,
    SHARED_PREFILL_POOL,
    PDStack,
    ServerConfig,
    SGLangServer,
    direct_pd_generate,
    generate,
    launch_server,
    pd_stack,
    stop_together,
    wait_server,
)
from sglang.pdsafe.pair_agreement import WIRE_VERSION

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


def _assert_versions(st: PDStack, stock: str | None) -> None:
    """``stock``: the leg that must run the stock build (None: both run the fork)."""
    for side, server in (("prefill", st.prefill), ("decode", st.decode)):
        version = str(server.server_info().get("version", ""))
        is_fork = "+pdsafe" in version
        assert is_fork == (side != stock), f"{side} runs {version!r}; expected the " + (
            "stock build" if side == stock else "fork")


class _ForkLegs:
    """This release's default prefill and decode, one per backend, shared by the refused pairs
    of this module (a refusal at pairing leaves a server serving its other peers, and every
    assertion here reads counter deltas): two server starts fewer per backend. Started on
    first use, stopped at the module's end."""

    def __init__(self, log_dir: Path, model_path: Path) -> None:
        self.log_dir, self.model_path = log_dir, model_path
        self.servers: dict[tuple[str, str], SGLangServer] = {}

    def get(self, role: str, backend: str) -> SGLangServer:
        """The shared ``role`` server of ``backend`` (launched, not yet waited for)."""
        key = (role, backend)
        if key not in self.servers:
            cfg = _cfg(role, self.model_path)
            cfg.backend = backend
            self.servers[key] = launch_server(cfg, self.log_dir, wait=False)
        return self.servers[key]


@pytest.fixture(scope="module")
def fork_legs(log_dir: Path, model_path: Path) -> Iterator[_ForkLegs]:
    legs = _ForkLegs(log_dir, model_path)
    try:
        yield legs
    finally:
        stop_together(*legs.servers.values())


def _with_fork_leg(legs: _ForkLegs, backend: str, *, own: str,
                   own_env: dict[str, str] | None) -> Iterator[PDStack]:
    """A pair of the shared fork server of the other role and a server of role ``own`` (its
    own environment) started for this pair only. No router: it waits for a served request
    before it counts as started, and these pairs serve none (the router sends each request to
    both legs, as ``direct_pd_generate`` does)."""
    shared = legs.get("decode" if own == "prefill" else "prefill", backend)
    cfg = _cfg(own, legs.model_path, own_env)
    cfg.backend = backend
    mine = launch_server(cfg, legs.log_dir, wait=False)
    try:
        wait_server(shared)
        wait_server(mine)
        p, d = (mine, shared) if own == "prefill" else (shared, mine)
        yield PDStack(backend, p, d, None)
    finally:
        mine.stop()


#: Pairing is refused at bootstrap (decode reads the prefill's published settings over HTTP)
#: before either KV backend moves a byte: one backend proves it (CI time); the other direction
#: exercises each backend's wire data and runs on both.
@pytest.fixture(params=["mooncake"])
def stock_prefill(request, stock_env, fork_legs: _ForkLegs) -> Iterator[PDStack]:
    for st in _with_fork_leg(fork_legs, request.param, own="prefill", own_env=stock_env):
        _assert_versions(st, stock="prefill")
        yield st


#: A fork prefill without a cluster key: the rolling upgrade from stock decodes, before the key
#: is introduced (a keyed prefill drops a stock decode's unsigned metadata instead of refusing it
#: with this message: test/unit/test_control_mac.py; operator guide, "Rolling upgrades").
UNKEYED = {"SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN": ""}


@pytest.fixture(params=ci_backends())
def stock_decode(request, stock_env, log_dir: Path, model_path: Path) -> Iterator[PDStack]:
    backend = request.param
    p_cfg, d_cfg = _cfg("prefill", model_path, UNKEYED), _cfg("decode", model_path, stock_env)
    p_cfg.backend = d_cfg.backend = backend
    p = launch_server(p_cfg, log_dir, wait=False)
    d = launch_server(d_cfg, log_dir, wait=False)
    try:
        wait_server(p)
        wait_server(d)
        st = PDStack(backend, p, d, None)
        _assert_versions(st, stock="decode")
        yield st
    finally:
        stop_together(p, d)


DECODE_WAIVER = {"SGLANG_PDSAFE_WAIVE_FOR_STOCK_PEERS": "decode-protections"}


@pytest.fixture(params=ci_backends())
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


#: The wire version of the previous sglang-pdsafe release (before transfer generations).
OTHER_RELEASE = "sglang-pdsafe-pair/2"
#: Makes one server speak ``OTHER_RELEASE`` (test-only fault, ``pdsafe_testkit.faults``).
OTHER_RELEASE_ENV = {"SGLANG_PDSAFE_TEST_FAULTS": f"wire_version:{OTHER_RELEASE}"}


def _other_release_stack(legs: _ForkLegs, backend: str, *, other: str) -> Iterator[PDStack]:
    """A fork/fork pair whose ``other`` leg speaks ``OTHER_RELEASE`` (the other leg is the
    module's shared one)."""
    for st in _with_fork_leg(legs, backend, own=other, own_env=OTHER_RELEASE_ENV):
        _assert_versions(st, stock=None)
        server = st.prefill if other == "prefill" else st.decode
        assert f"wire version {OTHER_RELEASE} instead of this release's {WIRE_VERSION}" in \
            server.process.log_text(), f"the {other} did not arm wire_version"
        yield st


#: Function-scoped: one test each, its own leg torn down right after it.
@pytest.fixture(params=ci_backends())
def other_release_prefill(request, fork_legs: _ForkLegs) -> Iterator[PDStack]:
    yield from _other_release_stack(fork_legs, request.param, other="prefill")


@pytest.fixture(params=ci_backends())
def other_release_decode(request, fork_legs: _ForkLegs) -> Iterator[PDStack]:
    yield from _other_release_stack(fork_legs, request.param, other="decode")


def _assert_refused_at_pairing(st: PDStack, model_path: Path, *, prefill_version: str,
                               decode_version: str, seed: int) -> None:
    """Every request fails at once on both legs with the decode's pairing refusal naming both
    wire versions (each as its leg's); the decode counts it once, the prefill refuses nothing
    (no decode metadata reaches it); both servers keep running."""
    named = f"wire_version: prefill={prefill_version!r}, decode={decode_version!r}"
    mismatch0 = metric_total(st.decode.url, MISMATCH_COUNTER)
    refused0 = metric_total(st.prefill.url, REFUSED_COUNTER)
    rng = random.Random(seed)
    for i in range(3):
        ids = random_prompt(rng, rng.randint(20, 120), model_path)
        p, d = direct_pd_generate(st, ids, MAX_NEW, timeout=BOUND_S)
        what = (f"{st.backend} prefill {prefill_version} + decode {decode_version}, "
                f"request {i}")
        for side, r in (("decode", d), ("prefill", p)):
            assert r.status != 200 and not r.output_ids, f"{what}: the {side} served: {r}"
            msg = r.error_message
            assert named in msg and "refuses to pair with the prefill" in msg \
                    and "run the same sglang-pdsafe release on both servers" in msg, (
                f"{what}: the {side}'s error does not name both wire versions: {msg}")
    assert metric_total(st.decode.url, MISMATCH_COUNTER) == mismatch0 + 1, (
        "the refused prefill must be counted once, however many requests name it")
    assert metric_total(st.prefill.url, REFUSED_COUNTER) == refused0, (
        "the decode refuses at pairing: no metadata may reach the prefill")
    for side in (st.prefill, st.decode):
        assert side.process.alive(), f"{side.config.role} died"
        assert requests.get(side.url + "/health", timeout=30).status_code == 200, (
            f"{side.config.role} is not healthy after the refusals")


def test_other_release_prefill_fork_decode_refused_at_pairing(other_release_prefill: PDStack,
                                                              model_path):
    """A fork prefill of the previous release (wire version /2) and this release's decode."""
    _assert_refused_at_pairing(other_release_prefill, model_path,
                               prefill_version=OTHER_RELEASE, decode_version=WIRE_VERSION,
                               seed=1105)


def test_fork_prefill_other_release_decode_refused_at_pairing(other_release_decode: PDStack,
                                                              model_path):
    """This release's prefill and a fork decode of the previous release (wire version /2):
    the decode of the other release refuses this prefill at pairing, before it would
    announce itself (so the prefill's own check of announced versions never runs)."""
    _assert_refused_at_pairing(other_release_decode, model_path,
                               prefill_version=WIRE_VERSION, decode_version=OTHER_RELEASE,
                               seed=1106)


#: A decode of this release with another cluster key than the fleet's (issue 21, item 7).
WRONG_KEY_ENV = {"SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN":
                 "a-different-cluster-key-0f1e2d3c4b5a69788796a5b4c3d2e1f0"}
UNAUTHENTICATED = ("sglang:pdsafe_unauthenticated_announce_dropped_total",
                   "sglang:pdsafe_unauthenticated_registration_dropped_total",
                   "sglang:pdsafe_unauthenticated_transfer_info_dropped_total",
                   "sglang:pdsafe_unauthenticated_abort_dropped_total")
HONOURED = "sglang:pdsafe_unsigned_abort_honoured_total"


@pytest.fixture(params=ci_backends())
def wrong_key_decode(request, fork_legs: _ForkLegs) -> Iterator[PDStack]:
    for st in _with_fork_leg(fork_legs, request.param, own="decode", own_env=WRONG_KEY_ENV):
        _assert_versions(st, stock=None)
        yield st


def test_a_decode_with_another_cluster_key_is_refused_at_pairing(wrong_key_decode: PDStack,
                                                                 model_path):
    """Same release, another cluster key on the decode: the decode refuses the prefill at
    pairing, naming both legs' key ids (never the keys) and the remedy; every request fails at
    once on both legs, counted once; no message is dropped at the prefill (the decode never
    announces itself; it tells the prefill with unsigned ABORTs, which the prefill cannot
    check under its key and acts on because no decode claimed the room:
    ``unsigned_abort_honoured``); both servers keep running."""
    st = wrong_key_decode
    mismatch0 = metric_total(st.decode.url, MISMATCH_COUNTER)
    dropped0 = sum(metric_total(st.prefill.url, n) for n in UNAUTHENTICATED)
    honoured0 = metric_total(st.prefill.url, HONOURED)
    rng = random.Random(1107)
    for i in range(2):
        ids = random_prompt(rng, rng.randint(20, 120), model_path)
        p, d = direct_pd_generate(st, ids, MAX_NEW, timeout=BOUND_S)
        for side, r in (("decode", d), ("prefill", p)):
            assert r.status != 200 and not r.output_ids, f"request {i}: the {side} served: {r}"
            msg = r.error_message
            assert "control_key: prefill='blake2b-mac:" in msg and \
                "decode='blake2b-mac:" in msg and \
                "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN" in msg, (
                    f"request {i}: the {side}'s error does not name the key mismatch: {msg}")
            assert WRONG_KEY_ENV["SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN"] not in msg
    assert metric_total(st.decode.url, MISMATCH_COUNTER) == mismatch0 + 1
    assert sum(metric_total(st.prefill.url, n) for n in UNAUTHENTICATED) == dropped0
    deadline = time.monotonic() + 10  # counters are exported about once a second
    while metric_total(st.prefill.url, HONOURED) < honoured0 + 2 and \
            time.monotonic() < deadline:
        time.sleep(0.5)
    assert metric_total(st.prefill.url, HONOURED) >= honoured0 + 2
    for side in (st.prefill, st.decode):
        assert side.process.alive(), f"{side.config.role} died"
        assert requests.get(side.url + "/health", timeout=30).status_code == 200
