"""The smg gRPC entry point (``--smg-grpc-mode``) runs the startup checks and the client-input
checks (issue 19, item 7).

The smg gRPC servicer (package ``smg-grpc-servicer``) has no TokenizerManager: it builds the
scheduler's ``TokenizedGenerateReqInput`` from the client's ``GenerateRequest`` and sends it over
ZMQ, past patch 0010's check. Real servers started on the CPU with ``--smg-grpc-mode`` (a PD
prefill on Mooncake, which starts alone, and a co-located one), driven with the servicer's own
proto stubs (``smg_grpc_proto``), show:

* the startup report and the hook-API self-check appear in the gRPC server's log (the
  scheduler logs them: the servicer launches it without ``Engine._launch_subprocesses``);
* a spoofed fake bootstrap host and a spoofed ``HEALTH_CHECK`` rid are refused at the scheduler
  door (patch 0027) with ``INVALID_ARGUMENT`` and the HTTP layer's reason, and counted in the
  same Prometheus counters (read from the servicer's HTTP sidecar ``/metrics``); a request of
  the servicer's own probe shape still passes, and the servicer's own ``HealthCheck`` and
  startup warmup still work (the server would not come up otherwise);
* the scheduler-level client rules apply too: a second request with a live ``bootstrap_room``
  is refused by the room guard, an over-long prompt gets an explicit error (not a placeholder
  answer);
* a plain request is served, token for token the HTTP reference server's greedy answer.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import requests
from pdsafe_testkit.loopback import reserve_port
from pdsafe_testkit.servers import (
    DEFAULT_MODEL,
    STARTUP_TIMEOUT_S,
    ManagedProcess,
    StartupError,
    server_env,
)
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc

pytestmark = pytest.mark.server

POOL = 1024
READY = "The server is fired up and ready to roll!"
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


@dataclass
class GrpcServer:
    """A running ``python -m sglang.launch_server --smg-grpc-mode`` on 127.0.0.1."""

    role: str
    port: int
    sidecar_port: int
    bootstrap_port: int | None
    process: ManagedProcess
    channel: grpc.Channel

    @property
    def stub(self) -> pb_grpc.SglangSchedulerStub:
        return pb_grpc.SglangSchedulerStub(self.channel)

    def metric(self, name: str) -> float:
        """``sglang:pdsafe_<name>`` summed over the sidecar's /metrics (0 when absent; the
        sidecar exposes the names with ``_`` for ``:``, ``sglang_pdsafe_<name>``)."""
        text = requests.get(f"http://127.0.0.1:{self.sidecar_port}/metrics", timeout=10).text
        pattern = re.compile(rf"^sglang[:_]pdsafe_{re.escape(name)}(?:_total)?(?:\{{[^}}]*\}})? "
                             r"([0-9.e+-]+)$", re.M)
        return sum(float(v) for v in pattern.findall(text))

    def stop(self) -> None:
        self.channel.close()
        self.process.stop()


def _launch(role: str, log_dir: Path) -> GrpcServer:
    port, sidecar = reserve_port(), reserve_port()
    argv = [
        sys.executable, "-m", "sglang.launch_server", "--smg-grpc-mode",
        "--model-path", str(DEFAULT_MODEL), "--host", "127.0.0.1", "--port", str(port),
        "--smg-http-sidecar-port", str(sidecar),
        "--device", "cpu", "--dtype", "float32", "--max-total-tokens", str(POOL),
        "--context-length", str(POOL), "--page-size", "1", "--random-seed", "0",
        "--enable-metrics", "--log-level", "info", "--sleep-on-idle",
        # The servicer's startup warm-up request sends fixed token ids up to 890, past the tiny
        # model's 512-token vocabulary (the scheduler dies with an IndexError in the
        # embedding): skipped. Its shape (fake host, room 0) is the HealthCheck's and
        # ``test_the_servicers_own_probes_still_work`` sends it.
        "--skip-server-warmup",
    ]
    bootstrap = None
    if role != "colocated":
        bootstrap = reserve_port()
        argv += ["--disaggregation-mode", role, "--disaggregation-transfer-backend", "mooncake",
                 "--disaggregation-bootstrap-port", str(bootstrap)]
    # The servicer's planned warm-up pass (every batch size, up to 300 s) only tunes speed:
    # off. Its first warm-up request (the probe shape the door must admit) still runs.
    proc = ManagedProcess(f"grpc-{role}-{port}", argv,
                          server_env({"SMG_SGLANG_SERVICER_WARMUP": "off"}),
                          log_dir / f"grpc-{role}-{port}.log")
    proc.start()
    server = GrpcServer(role, port, sidecar, bootstrap, proc,
                        grpc.insecure_channel(f"127.0.0.1:{port}"))
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while READY not in proc.log_text():
        if not proc.alive() or time.monotonic() > deadline:
            server.stop()
            died = not proc.alive() and time.monotonic() <= deadline
            raise (_DiedAtStartup if died else StartupError)(
                f"{proc.name} did not come up:\n{proc.log_tail()}")
        time.sleep(1.0)
    return server


class _DiedAtStartup(StartupError):
    """The server process exited before it was ready (not a timeout)."""


def _launch_retrying(role: str, log_dir: Path) -> GrpcServer:
    """:func:`_launch`, once more if the process died at startup: a CI run saw the servicer
    exit at once with only gRPC's ``epoll_wait error: Bad file descriptor`` in its log (once
    in many runs; the same module passed alone right after). A second death, or a server that
    never gets ready, fails the fixture."""
    try:
        return _launch(role, log_dir)
    except _DiedAtStartup as first:
        print(f"grpc-{role}: died at startup, starting once more: {first}")
        return _launch(role, log_dir)


@pytest.fixture(scope="module")
def grpc_prefill(log_dir: Path) -> Iterator[GrpcServer]:
    server = _launch_retrying("prefill", log_dir)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def grpc_colocated(log_dir: Path) -> Iterator[GrpcServer]:
    server = _launch_retrying("colocated", log_dir)
    try:
        yield server
    finally:
        server.stop()


def _request(rid: str, ids: list[int], new: int, *, host: str | None = None,
             port: int | None = None, room: int | None = None) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        request_id=rid, tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(temperature=0.0, top_k=1, n=1, max_new_tokens=new,
                                          ignore_eos=True),
        stream=False)
    if host is not None:
        req.disaggregated_params.CopyFrom(pb.DisaggregatedParams(
            bootstrap_host=host, bootstrap_port=port or 0, bootstrap_room=room or 0))
    return req


def _generate(server: GrpcServer, req: pb.GenerateRequest, timeout: float = 120.0) -> Any:
    """The final ``GenerateComplete``; raises ``grpc.RpcError`` on a refusal."""
    responses = list(server.stub.Generate(req, timeout=timeout))
    assert responses and responses[-1].HasField("complete"), responses
    return responses[-1].complete


def _refused(server: GrpcServer, req: pb.GenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        _generate(server, req)
    return info.value


def test_the_grpc_server_logs_the_startup_report(grpc_prefill):
    log = grpc_prefill.process.log_text()
    assert "pdsafe hook API self-check:" in log, log[-3000:]
    assert "prefill protections active:" in log and "client-bypass-guard" in log


def test_spoofed_markers_are_refused_at_the_scheduler_door(grpc_prefill):
    s = grpc_prefill
    host0, rid0 = s.metric("rejected_spoofed_bootstrap_host"), s.metric("rejected_spoofed_rid")

    err = _refused(s, _request("spoof-host-1", PROMPT, 4, host="2.2.2.2", room=7))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    assert "'2.2.2.2' is reserved" in err.details() and "--smg-grpc-mode" in err.details()

    err = _refused(s, _request("HEALTH_CHECK_spoof", PROMPT, 4, host="127.0.0.1",
                               port=s.bootstrap_port, room=8))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    assert "'HEALTH_CHECK'" in err.details()

    assert s.metric("rejected_spoofed_bootstrap_host") == host0 + 1
    assert s.metric("rejected_spoofed_rid") == rid0 + 1


def test_the_servicers_own_probes_still_work(grpc_prefill):
    """Its HealthCheck (rid HEALTH_CHECK_<time>, fake host, room 0) is healthy; a request of
    its startup warm-up's shape (fake host, room 0, a few tokens; the warm-up itself is skipped
    on the tiny model, see ``_launch``) passes the door too (a decode would serve it over
    zeroed pages)."""
    s = grpc_prefill
    before = s.metric("rejected_spoofed_bootstrap_host") + s.metric("rejected_spoofed_rid")
    health = s.stub.HealthCheck(pb.HealthCheckRequest(), timeout=60)
    assert health.healthy, health.message
    warm = _generate(s, _request("WARMUP_probe", [1, 2, 3, 4, 5, 6, 7], 8, host="2.2.2.2",
                                 room=0))
    assert warm.finish_reason != "abort", warm
    done = _generate(s, _request("HEALTH_CHECK_probe", [0], 1, host="2.2.2.2", room=0))
    assert done.finish_reason != "abort", done
    assert s.metric("rejected_spoofed_bootstrap_host") + s.metric("rejected_spoofed_rid") \
        == before


def test_the_room_guard_applies_behind_grpc(grpc_prefill):
    """A second request with a bootstrap_room live on the prefill (the first waits for a
    decode that never comes) is refused, not allowed to crash the scheduler."""
    s = grpc_prefill
    room = 424242
    first: dict[str, Any] = {}

    def hold() -> None:
        try:
            first["out"] = _generate(s, _request("room-holder", PROMPT, 4, host="127.0.0.1",
                                                 port=s.bootstrap_port, room=room), timeout=20)
        except grpc.RpcError as e:
            first["err"] = e

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    time.sleep(3.0)  # the first one is queued and holds the room
    err = _refused(s, _request("room-dup", PROMPT, 4, host="127.0.0.1", port=s.bootstrap_port,
                               room=room))
    assert str(room) in err.details() and "bootstrap_room" in err.details(), err.details()
    assert s.metric("room_duplicate_refused") >= 1
    t.join(timeout=30)
    health = s.stub.HealthCheck(pb.HealthCheckRequest(), timeout=60)
    assert health.healthy, health.message


def test_an_over_long_prompt_gets_an_explicit_error(grpc_colocated, grpc_prefill):
    for s in (grpc_colocated, grpc_prefill):
        pd = s.bootstrap_port is not None
        req = _request(f"too-long-{s.role}", list(range(1, POOL + 50)), 4,
                       host="127.0.0.1" if pd else None, port=s.bootstrap_port,
                       room=9001 if pd else None)
        err = _refused(s, req)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (s.role, err.code(),
                                                                err.details())
        assert "exceeds the maximum allowed length" in err.details(), err.details()


def test_a_plain_request_is_served_like_the_http_reference(grpc_colocated, oracle):
    s = grpc_colocated
    done = _generate(s, _request("plain-1", PROMPT, 12))
    assert list(done.output_ids) == oracle.expected(PROMPT, 12)
    err = _refused(s, _request("spoof-host-coloc", PROMPT, 4, host="2.2.2.2", room=5))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "2.2.2.2" in err.details()
    assert s.metric("rejected_spoofed_bootstrap_host") == 1
    assert "co-located server protections active" in s.process.log_text()
