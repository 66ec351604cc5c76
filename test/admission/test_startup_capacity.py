"""Capacity invariant at startup (issue #3, item 7), with real servers.

A PD server whose KV pool holds fewer tokens than its context length refuses to start, with a
message naming both numbers and both remedies; ``--disaggregation-clamp-context-to-kv-capacity``
lowers the effective context length instead (logged), and /model_info and /server_info
advertise the effective context length and max_req_input_len.

These are the only tests that pass the clamp flag: every other PD server of the suite runs the
default configuration (``test_shared_pd_stacks_run_the_default_configuration``).

Without the patch, both refusal servers start (upstream only logs a warning) and the clamped
servers advertise the model's context length (4096) although their pools hold 400/800 tokens.
The invariant's logic alone: test/unit/test_capacity_invariant.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from pdsafe_testkit.servers import (
    STARTUP_TIMEOUT_S,
    Limits,
    ServerConfig,
    SGLangServer,
    launch_server,
    stop_together,
    wait_server,
)
from sglang.pdsafe.admission import CLAMP_FLAG

CLAMP = CLAMP_FLAG

pytestmark = pytest.mark.server

POOL = 256
CONTEXT = 4096  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def refused(log_dir: Path, model_path: Path) -> Iterator[dict[str, SGLangServer]]:
    """A prefill and a decode server with a 256-token pool and the model's 4096 context,
    started together (the invariant is checked per server, no peer is needed)."""
    servers = {
        role: launch_server(ServerConfig(role=role, model_path=model_path,
                                         max_total_tokens=POOL, context_length=CONTEXT),
                            log_dir, wait=False)
        for role in ("prefill", "decode")
    }
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for s in servers.values():  # until it exits, or answers /health (it started)
            while s.process.alive() and time.monotonic() < deadline:
                try:
                    if requests.get(s.url + "/health", timeout=2).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                time.sleep(1.0)
        yield servers
    finally:
        stop_together(*servers.values())


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_pd_server_refuses_to_start_below_context(refused, role):
    s = refused[role]
    rc = s.process.proc.poll()
    log = s.process.log_text()
    assert rc is not None and rc != 0, (
        f"{role} server with a {POOL}-token pool and context {CONTEXT} must refuse to start "
        f"(rc={rc}):\n{s.process.log_tail(20)}")
    lines = [ln for ln in log.splitlines() if "refusing to start" in ln]
    assert lines, f"no refusal message in the {role} log:\n{s.process.log_tail(30)}"
    msg = lines[-1]
    assert f"holds {POOL} tokens" in msg and f"context length {CONTEXT}" in msg, msg
    assert "--context-length" in msg and CLAMP in msg, msg


#: The clamped servers: (pool, page size) per role. Decode's limit also leaves room for the
#: 512 reserved decode tokens, on page boundaries.
CLAMPED = {"prefill": (400, 1), "decode": (800, 4)}


@pytest.fixture(scope="module")
def clamped(log_dir: Path, model_path: Path) -> Iterator[dict[str, SGLangServer]]:
    """A prefill and a decode server with small pools, the model's context (4096) and the clamp
    flag, started together and standalone (each clamps on its own; no peer is needed)."""
    servers = {
        role: launch_server(ServerConfig(role=role, model_path=model_path,
                                         max_total_tokens=pool, page_size=page,
                                         extra_args=[CLAMP]), log_dir, wait=False)
        for role, (pool, page) in CLAMPED.items()
    }
    try:
        for s in servers.values():
            wait_server(s)
        yield servers
    finally:
        stop_together(*servers.values())


def _check_advertised(url: str, kv: int) -> None:
    lim = Limits.of(url)
    assert lim.kv_capacity_tokens == kv
    assert lim.context_length == kv, f"context not clamped to the KV capacity: {lim}"
    expected = min(kv - 1, kv - 1) - 5  # min(context - 1, kv - 1) - 5 with context == kv
    assert lim.max_req_input_len == expected, lim
    assert lim.max_prompt_tokens == expected - 1
    info = requests.get(url + "/server_info", timeout=30).json()
    assert info["context_length"] == kv and info["max_req_input_len"] == expected, (
        {k: info.get(k) for k in ("context_length", "max_req_input_len")})


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_clamp_flag_starts_and_advertises_effective_limits(clamped, role):
    """A server started with the clamp flag runs with context = KV capacity, says so in its
    log, and advertises the limits that follow from it."""
    side = clamped[role]
    kv, page = CLAMPED[role]
    if role == "decode":
        # Decode pre-allocates the prompt's pages plus 512 reserved decode tokens.
        lim = Limits.of(side.url)
        assert lim.max_req_input_len == (kv - 512) // page * page + 1
        assert lim.context_length == kv and lim.kv_capacity_tokens == kv
        info = requests.get(side.url + "/server_info", timeout=30).json()
        assert info["context_length"] == kv
        assert info["max_req_input_len"] == lim.max_req_input_len
    else:
        _check_advertised(side.url, kv)
    warn = [ln for ln in side.process.log_text().splitlines()
            if "lowering the effective context length" in ln]
    assert warn and f"holds {kv} tokens" in warn[0] and str(CONTEXT) in warn[0], warn


def test_shared_pd_stacks_run_the_default_configuration(pd_case):
    """The admission PD stacks (see conftest) run without the clamp flag: their context length
    is what they were given (<= the pool), nothing is clamped and nothing says so."""
    for side in (pd_case.stack.prefill, pd_case.stack.decode):
        assert CLAMP not in side.process.argv, side.process.argv
        assert Limits.of(side.url).context_length == side.config.context_length
        assert side.config.context_length <= side.config.max_total_tokens
        assert "lowering the effective context length" not in side.process.log_text()
