"""The scheduler door for entry points without the TokenizerManager funnel (issue 19, item 7).

The smg gRPC servicer (``--smg-grpc-mode``) builds ``TokenizedGenerateReqInput`` from the
client's ``GenerateRequest`` and sends it straight to the scheduler, so patch 0010's check in
``TokenizerManager.generate_request`` never sees it. Patch 0027's hook in
``Scheduler._handle_generate_request`` (``client_guard.scheduler_door``) refuses there, with
400 and the HTTP layer's reasons and counters, a request carrying the fake bootstrap host or a
``HEALTH_CHECK`` rid unless it has the shape of the server's own probes (the servicer's
HealthCheck and startup warmup).

Driven through upstream's real ``Scheduler.handle_generate_request`` (patched) on a stand-in
for the scheduler state it reads: real ``TokenizedGenerateReqInput``, real ``Req``, real
``prepare_abort``; the stand-in records what the scheduler streams back (a refusal) or stops
the request right after the door (admitted).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from sglang.pdsafe import client_guard, metrics, policy
from sglang.srt.disaggregation.utils import DisaggregationMode, TransferBackend
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

HOST = client_guard.FAKE_BOOTSTRAP_HOST
SPOOFED_HOST, SPOOFED_RID = client_guard.SPOOFED_HOST, client_guard.SPOOFED_RID
#: The servicer's startup warmup (smg_grpc_servicer.sglang.server, 0.14.1): its prompt.
WARMUP_IDS = [123, 456, 789, 234, 567, 890, 345]


class Admitted(Exception):  # noqa: N818 - a signal, not an error
    """The request passed the door: the stand-in stops it at the next step."""


class _Streamer:
    def __init__(self) -> None:
        self.reqs: list[Any] = []

    def stream_output(self, reqs: list[Any], return_logprob: bool) -> None:
        self.reqs.extend(reqs)


class _Scheduler:
    """What ``Scheduler._handle_generate_request`` reads up to the door and on its refusal
    path; the first step after the door raises :class:`Admitted`."""

    handle_generate_request = Scheduler.handle_generate_request
    _handle_generate_request = Scheduler._handle_generate_request
    _create_generation_req = Scheduler._create_generation_req

    def __init__(self, server_args: Any, mode: str) -> None:
        self.server_args = server_args
        self.disaggregation_mode = DisaggregationMode(mode)
        self.transfer_backend = TransferBackend.MOONCAKE
        self.enable_session_radix_cache = False
        self.session_controller: dict[str, Any] = {}
        self.model_config = SimpleNamespace(hf_eos_token_id=None, vocab_size=32000)
        self.metrics_reporter = SimpleNamespace(enable_metrics=False)
        self.metrics_collector = None
        self.tokenizer = None
        self.dllm_config = None
        self.output_streamer = _Streamer()

    def _maybe_namespace_elastic_radix_cache(self, req: Any) -> None:
        raise Admitted(req.rid)


def _args(mode: str, grpc: bool) -> ServerArgs:
    return ServerArgs(model_path="dummy", disaggregation_mode=mode, smg_grpc_mode=grpc)


@pytest.fixture(params=["prefill", "decode", "null"])
def mode(request: pytest.FixtureRequest) -> Iterator[str]:
    reset_context()
    publish(_args(request.param, True), role="scheduler",
            ranks=SpawnRanks(world_rank=0, gpu_id=0))
    policy.reset_for_tests()
    yield request.param
    reset_context()


def _req(rid: str = "r-1", ids: list[int] | None = None, new: int = 16, host: str | None =
         "127.0.0.1", room: int | None = 12345, **kw: Any) -> TokenizedGenerateReqInput:
    params = SamplingParams(max_new_tokens=new, temperature=0.0)
    return TokenizedGenerateReqInput(
        rid=rid, input_text="", input_ids=array("q", ids if ids is not None else [5, 6, 7]),
        input_embeds=None, mm_inputs=None, token_type_ids=None, sampling_params=params,
        return_logprob=False, logprob_start_len=-1, top_logprobs_num=0, stream=False,
        token_ids_logprob=None, bootstrap_host=host, bootstrap_port=8998, bootstrap_room=room,
        **kw)


def _send(sched: _Scheduler, req: TokenizedGenerateReqInput) -> FINISH_ABORT | None:
    """The refusal the scheduler streamed back for ``req``, or None when it was admitted."""
    try:
        sched.handle_generate_request(req)
    except Admitted:
        assert not sched.output_streamer.reqs
        return None
    (out,) = sched.output_streamer.reqs
    sched.output_streamer.reqs.clear()
    assert isinstance(out.finished_reason, FINISH_ABORT), out.finished_reason
    return out.finished_reason


def test_grpc_refuses_the_fake_host_and_a_health_rid_with_400_and_the_http_reason(mode):
    sched = _Scheduler(_args(mode, True), mode)
    host0, rid0 = metrics.value(SPOOFED_HOST), metrics.value(SPOOFED_RID)

    refused = _send(sched, _req(host=HOST, room=7))
    assert refused is not None and refused.status_code == 400
    assert "'2.2.2.2' is reserved" in refused.message and "--smg-grpc-mode" in refused.message
    assert metrics.value(SPOOFED_HOST) == host0 + 1

    refused = _send(sched, _req(rid="HEALTH_CHECK_spoof"))
    assert refused is not None and refused.status_code == 400
    assert "'HEALTH_CHECK'" in refused.message and "HEALTH_CHECK_spoof" in refused.message
    assert metrics.value(SPOOFED_RID) == rid0 + 1


def test_grpc_admits_the_servicers_own_probes_and_plain_requests(mode):
    sched = _Scheduler(_args(mode, True), mode)
    before = metrics.value(SPOOFED_HOST) + metrics.value(SPOOFED_RID)
    pd = mode != "null"
    # HealthCheck: rid HEALTH_CHECK_<time>, prompt [0], one new token, PD: fake host, room 0.
    assert _send(sched, _req(rid="HEALTH_CHECK_1.5", ids=[0], new=1,
                             host=HOST if pd else None, room=0 if pd else None)) is None
    # The startup warmup: 7 prompt tokens, 8 new tokens, PD: fake host, room 0.
    assert _send(sched, _req(rid="WARMUP_1.5", ids=WARMUP_IDS, new=8,
                             host=HOST if pd else None, room=0 if pd else None)) is None
    assert _send(sched, _req(ids=list(range(1, 40)), new=64)) is None  # an ordinary request
    assert metrics.value(SPOOFED_HOST) + metrics.value(SPOOFED_RID) == before


@pytest.mark.parametrize("change", [
    {"room": 7}, {"ids": list(range(1, 10))}, {"new": 9}, {"ids": []},
    {"session_id": "s-1"},
])
def test_a_marker_outside_the_probe_shape_is_refused(mode, change):
    sched = _Scheduler(_args(mode, True), mode)
    probe = {"rid": "HEALTH_CHECK_x", "ids": [0], "new": 1, "host": HOST, "room": 0}
    refused = _send(sched, _req(**{**probe, **change}))
    assert refused is not None and refused.status_code == 400, change


def test_behind_the_tokenizer_manager_the_door_does_nothing(mode, monkeypatch):
    """HTTP server, offline Engine, --use-ray: the funnel checked every client request, and
    the server's own warmups there (the PD warmup over HTTP: 4 tokens, room = DP rank) pass
    the scheduler unchecked, as before."""
    monkeypatch.delenv(client_guard.SMG_HANDSHAKE_ENV, raising=False)
    sched = _Scheduler(_args(mode, False), mode)
    assert _send(sched, _req(host=HOST, room=3, new=32)) is None
    assert _send(sched, _req(rid="HEALTH_CHECK_x", new=32)) is None


def test_ranks_run_headless_behind_smg_are_guarded_too(mode, monkeypatch):
    monkeypatch.setenv(client_guard.SMG_HANDSHAKE_ENV, "tcp://127.0.0.1:1")
    sched = _Scheduler(_args(mode, False), mode)
    refused = _send(sched, _req(host=HOST, room=7))
    assert refused is not None and "headless SMG" in refused.message


def test_a_door_that_cannot_run_refuses_with_503(mode):
    """A renamed flag (upstream changed shape) fails the hook: the request is refused, not
    served unchecked, and counted as an API mismatch."""
    sched = _Scheduler(SimpleNamespace(), mode)
    before = metrics.value("hook_api_mismatch_total")
    refused = _send(sched, _req())
    assert refused is not None and refused.status_code == 503
    assert "client_guard.scheduler_door" in refused.message
    assert metrics.value("hook_api_mismatch_total") == before + 1
