"""Servers shared by the admission tests (test_http_admission, test_client_guard,
test_startup_capacity): one small co-located server and PD stacks with unequal capacities.

Small pools make the KV capacity, not the model's context length (4096), the binding limit:

* ``small``: co-located, 512-token pool (max_req_input_len = min(4095, 511) - 5 = 506).
  Also the content oracle's reference for these tests (same build, same model, co-located).
* PD stacks (session-scoped, parametrized, so one is alive at a time), in the default
  configuration (no clamp flag): each PD server gets ``--context-length`` equal to its pool,
  the operator's documented remedy for a pool smaller than the model's context.
  - ``p_lt_d`` (page 1): prefill pool 400 (context 400, limit 393), decode pool 1024
    (context 1024, limit 512: 1024 - 512 reserved decode tokens). Prefill is the smaller side.
  - ``d_lt_p`` (page 4): prefill pool 1024 (context 1024, limit 1017), decode pool 800
    (context 800, limit 288 = floor_4(800 - 512)). Decode is smaller.
  Both capacity orders run on both backends (4 stacks); ``PDSAFE_ADMISSION_ALL=0`` keeps only
  ``p_lt_d`` on Mooncake and ``d_lt_p`` on NIXL.
  The clamp flag has its own servers in test_startup_capacity.py (the tests about it).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from admission_helpers import CHAT_TEMPLATE, PDCase
from pdsafe_testkit.oracle import Oracle
from pdsafe_testkit.servers import (
    ServerConfig,
    SGLangServer,
    colocated_server,
    pd_stack,
    skip_pair_check,
)

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
                                                               int]:
    """(prefill config, decode config, page size) of one capacity order."""
    chat = ["--chat-template", str(tpl)]
    if order == "p_lt_d":
        return (ServerConfig(role="prefill", model_path=model, max_total_tokens=400,
                             context_length=400, extra_args=chat),
                ServerConfig(role="decode", model_path=model, max_total_tokens=1024,
                             context_length=1024, extra_args=chat,
                             env=skip_pair_check("context_length")), 1)
    return (ServerConfig(role="prefill", model_path=model, max_total_tokens=1024, page_size=4,
                         context_length=1024, extra_args=chat),
            ServerConfig(role="decode", model_path=model, max_total_tokens=800, page_size=4,
                         context_length=800, extra_args=chat,
                         env=skip_pair_check("context_length")), 4)


_DEFAULT_CASES = [("p_lt_d", "mooncake"), ("d_lt_p", "nixl")]
_ALL_CASES = [(o, b) for o in ("p_lt_d", "d_lt_p") for b in ("mooncake", "nixl")]
# One capacity order per backend by default (CI's time budget: the admission decision is the
# same code on both backends); PDSAFE_ADMISSION_ALL=1 or PDSAFE_FULL_BACKENDS=all runs both
# orders on both backends (the matrix, two more PD stacks).
CASES = (_ALL_CASES if os.environ.get("PDSAFE_ADMISSION_ALL") == "1"
         or os.environ.get("PDSAFE_FULL_BACKENDS", "").strip() == "all" else _DEFAULT_CASES)


@pytest.fixture(scope="session", params=CASES, ids=[f"{o}-{b}" for o, b in CASES])
def pd_case(request: pytest.FixtureRequest, log_dir: Path, model_path: Path,
            chat_template: Path) -> Iterator[PDCase]:
    order, backend = request.param
    p, d, page = _case_configs(order, model_path, chat_template)
    with pd_stack(backend, log_dir, prefill=p, decode=d) as stack:
        yield PDCase(f"{order}-{backend}", "prefill" if order == "p_lt_d" else "decode",
                     page, stack)
