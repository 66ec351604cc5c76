"""No one-token placeholder in PD mode (patch 0005), on the real ``Req.set_finish_with_abort``.

In PD mode a rejection is a typed outcome and the prompt is kept, so no path can hand a
one-token stub to a KV sender; a co-located server keeps upstream's rewrite (it only shortens a
local prefill). When the process's disaggregation mode cannot be read, the guard fails closed:
no rewrite (finding 6 of issue 7: "not PD" on an unreadable mode brought the stub back).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from types import SimpleNamespace
from unittest.mock import MagicMock, patch

import pytest
from sglang.pdsafe import placeholder_guard
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req
from sglang.srt.runtime_context import publish, reset_context
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

PROMPT = list(range(50))


@pytest.fixture(autouse=True)
def _tp_rank() -> Iterator[None]:
    with patch("sglang.srt.managers.schedule_batch.get_parallel",
               return_value=SimpleNamespace(tp_rank=0)):
        yield
    reset_context()


def _rejected(mode: str | None) -> Req:
    reset_context()
    if mode is not None:
        publish(ServerArgs(model_path="dummy", disaggregation_mode=mode), role="tokenizer")
    req = Req(rid="ph", origin_input_text="", origin_input_ids=array("q", PROMPT),
              sampling_params=SamplingParams(max_new_tokens=4))
    req.time_stats.trace_ctx = MagicMock()
    req.set_finish_with_abort("The prompt has 50 tokens, over the limit.", 400, "BadRequest")
    assert isinstance(req.to_finish, FINISH_ABORT)
    return req


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_pd_rejection_keeps_the_prompt_and_a_typed_verdict(mode: str) -> None:
    req = _rejected(mode)
    assert list(req.origin_input_ids) == PROMPT, "PD rejection rewrote the prompt to a stub"
    rej = placeholder_guard.rejection_of(req)
    assert (rej.status_code, rej.err_type) == (400, "BadRequest")
    assert "50 tokens" in rej.message


def test_colocated_rejection_keeps_upstreams_stub() -> None:
    req = _rejected("null")
    assert len(req.origin_input_ids) == 1


def test_unreadable_mode_fails_closed() -> None:
    """No published server context: the guard cannot tell the mode, so it keeps the prompt."""
    req = _rejected(None)
    assert list(req.origin_input_ids) == PROMPT
