"""Servers shared by the admission tests (test_http_admission, test_client_guard,
test_startup_capacity): one small co-located server and two PD stacks with unequal capacities.

Small pools make the KV capacity, not the model's context length (4096), the binding limit:

* ``small``: co-located, 512-token pool (max_req_input_len = min(4095, 511) - 5 = 506).
  Also the content oracle's reference for these tests (same build, same model, co-located).
* PD stacks (session-scoped, parametrized, so one is alive at a time):
  - ``p_lt_d`` (Mooncake, page 1): prefill pool 400 with
    ``--disaggregation-clamp-context-to-kv-capacity`` (context clamped to 400, limit 393),
    decode pool 1024 with ``--context-length 1024`` (limit 512: 1024 - 512 reserved decode
    tokens). Prefill is the smaller side.
  - ``d_lt_p`` (NIXL, page 4): prefill pool 1024, ``--context-length 1024`` (limit 1017),
    decode pool 800 with the clamp flag (limit 288 = floor_4(800 - 512)). Decode is smaller.
  Both capacity orders run on both backends (4 stacks); ``PDSAFE_ADMISSION_ALL=0`` keeps only
  the two above.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from admission_helpers import CHAT_TEMPLATE, CLAMP, PDCase
from harness.oracle import Oracle
from harness.servers import ServerConfig, SGLangServer, colocated_server, pd_stack

SMALL_POOL = 512


@pytest.fixture(scope="session")
def chat_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("admission") / "chat.jinja"
    p.write_text(CHAT_TEMPLATE)
    return p


@pytest.fixture(scope="session")
def small(log_dir: Path, model_path: Path, chat_template: Path) -> Iterator[SGLangServer]:
    """Co-located server whose limit comes from its 512-token KV pool."""
    with colocated_server(log_dir, ServerConfig(
        role="colocated", model_path=model_path, max_total_tokens=SMALL_POOL,
        extra_args=["--chat-template", str(chat_template)],
    )) as s:
        yield s


@pytest.fixture(scope="session")
def small_oracle(small: SGLangServer) -> Oracle:
    """Reference answers from the small co-located server (prompts < 506 tokens)."""
    return Oracle(small.url)


def _case_configs(order: str, model: Path, tpl: Path) -> tuple[ServerConfig, ServerConfig,
                                                               int, str]:
    chat = ["--chat-template", str(tpl)]
    if order == "p_lt_d":
        return (ServerConfig(role="prefill", model_path=model, max_total_tokens=400,
                             extra_args=[CLAMP, *chat]),
                ServerConfig(role="decode", model_path=model, max_total_tokens=1024,
                             context_length=1024, extra_args=chat), 1, "prefill")
    return (ServerConfig(role="prefill", model_path=model, max_total_tokens=1024, page_size=4,
                         context_length=1024, extra_args=chat),
            ServerConfig(role="decode", model_path=model, max_total_tokens=800, page_size=4,
                         extra_args=[CLAMP, *chat]), 4, "decode")


_DEFAULT_CASES = [("p_lt_d", "mooncake"), ("d_lt_p", "nixl")]
_ALL_CASES = [(o, b) for o in ("p_lt_d", "d_lt_p") for b in ("mooncake", "nixl")]
# Both capacity orders on both backends by default (the matrix, ~2 min more on 2 cores);
# PDSAFE_ADMISSION_ALL=0 keeps one order per backend for quick local runs.
CASES = _DEFAULT_CASES if os.environ.get("PDSAFE_ADMISSION_ALL") == "0" else _ALL_CASES


@pytest.fixture(scope="session", params=CASES, ids=[f"{o}-{b}" for o, b in CASES])
def pd_case(request: pytest.FixtureRequest, log_dir: Path, model_path: Path,
            chat_template: Path) -> Iterator[PDCase]:
    order, backend = request.param
    p, d, page, clamped = _case_configs(order, model_path, chat_template)
    with pd_stack(backend, log_dir, prefill=p, decode=d) as stack:
        yield PDCase(f"{order}-{backend}", "prefill" if order == "p_lt_d" else "decode",
                     page, clamped, stack)


