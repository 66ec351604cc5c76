"""Capacity invariant at startup (issue #3, item 7).

A PD server whose KV pool holds fewer tokens than its context length refuses to start, with a
message naming both numbers and both remedies; ``--disaggregation-clamp-context-to-kv-capacity``
lowers the effective context length instead (logged), and /model_info and /server_info
advertise the effective context length and max_req_input_len.

Without the patch, both refusal servers start (upstream only logs a warning) and the clamped
server advertises the model's context length (4096) although its pool holds 400/800 tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
from admission_helpers import CLAMP, Limits
from harness.servers import STARTUP_TIMEOUT_S, ServerConfig, SGLangServer, launch_server
from sglang.pdsafe import admission

pytestmark = pytest.mark.server

POOL = 256
CONTEXT = 4096  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def refused(log_dir: Path, model_path: Path) -> Iterator[dict[str, SGLangServer]]:
    """A prefill and a decode server with a 256-token pool and the model's 4096 context,
    started together (the invariant is checked per server, no peer is needed)."""
    servers = {
        # An explicit --context-length (the model's own) keeps the harness from adding the
        # clamp flag that it passes to PD servers with small pools by default.
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
        for s in servers.values():
            s.stop()


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


def test_clamp_flag_starts_and_advertises_effective_limits(pd_case):
    """The side started with the clamp flag (see conftest) runs with context = KV capacity."""
    side = getattr(pd_case.stack, pd_case.clamped)
    kv = side.config.max_total_tokens
    page = pd_case.page_size
    if pd_case.clamped == "decode":
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
    # The other side was started with --context-length <= its pool: no clamp, no warning.
    other = pd_case.stack.decode if pd_case.clamped == "prefill" else pd_case.stack.prefill
    assert Limits.of(other.url).context_length == other.config.context_length
    assert "lowering the effective context length" not in other.process.log_text()


# --------------------------------------------------------------------------- logic only


def _args(mode: str, clamp: bool = False, reserved: int = 512) -> SimpleNamespace:
    return SimpleNamespace(disaggregation_mode=mode, num_reserved_decode_tokens=reserved,
                           disaggregation_clamp_context_to_kv_capacity=clamp)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_enforce_refuses_pd_below_context(mode):
    with pytest.raises(admission.CapacityInvariantError) as e:
        admission.enforce_kv_capacity(_args(mode), 600, 4096)
    msg = str(e.value)
    assert "holds 600 tokens" in msg and "context length 4096" in msg
    assert "--context-length" in msg and CLAMP in msg


def test_enforce_clamps_with_flag_and_leaves_colocated_alone():
    assert admission.enforce_kv_capacity(_args("prefill", clamp=True), 600, 4096) == 600
    assert admission.enforce_kv_capacity(_args("null"), 600, 4096) == 4096
    assert admission.enforce_kv_capacity(_args("decode"), 4096, 4096) == 4096


def test_enforce_refuses_decode_pool_not_above_reserved_decode_tokens():
    """Such a decode server could never pre-allocate a request (its warmup hangs upstream)."""
    with pytest.raises(admission.CapacityInvariantError) as e:
        admission.enforce_kv_capacity(_args("decode", clamp=True), 512, 4096)
    assert "--num-reserved-decode-tokens 512" in str(e.value)
    assert admission.enforce_kv_capacity(_args("prefill", clamp=True), 512, 4096) == 512
