"""The KV sender/receiver creation guard (patch 0006), through the real queue methods.

A request rejected at intake (aborted, holding nothing: upstream's ``is_unadmitted_reject``)
must never get a KV receiver or sender; a request that re-enters the decode queue (re-bootstrap
after preemption, or a retracted request) may carry a pending abort legitimately, because its
queue still owes the release of what it holds: the guard must let it through, in the default
(non-strict) mode and in strict mode alike.

Runs the real ``DecodePreallocQueue._create_receiver_and_enqueue`` and
``PrefillBootstrapQueue.create_sender`` of the installed fork on real ``Req`` objects (the
fake transfer backend stands in for the transport: no server, no KV pool).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from types import SimpleNamespace
from unittest.mock import MagicMock, patch

import pytest
from pdsafe_testkit.pd_context import published_pd_context
from sglang.pdsafe import metrics
from sglang.pdsafe.placeholder_guard import STRICT_ENV
from sglang.srt.disaggregation.decode import DecodePreallocQueue
from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
from sglang.srt.disaggregation.utils import (
    FAKE_BOOTSTRAP_HOST,
    TransferBackend,
    is_unadmitted_reject,
)
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req
from sglang.srt.sampling.sampling_params import SamplingParams


@pytest.fixture(params=["decode", "prefill"])
def pd_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A published PD server context (no process group: tp_rank is stated)."""
    monkeypatch.delenv(STRICT_ENV, raising=False)
    with published_pd_context(request.param) as mode:
        yield mode


def _req(room: int = 7) -> Req:
    req = Req(rid=f"guard-{room}", origin_input_text="",
              origin_input_ids=array("q", list(range(40))),
              sampling_params=SamplingParams(max_new_tokens=4),
              bootstrap_host=FAKE_BOOTSTRAP_HOST, bootstrap_port=1, bootstrap_room=room)
    req.time_stats.trace_ctx = MagicMock()
    return req


def _decode_queue() -> DecodePreallocQueue:
    q = DecodePreallocQueue.__new__(DecodePreallocQueue)
    q.queue = []
    q.transfer_backend = TransferBackend.FAKE
    q.kv_manager = None
    return q


def _intake_rejected() -> Req:
    req = _req()
    req.set_finish_with_abort("The prompt is too long.", 400, "BadRequest")
    assert isinstance(req.to_finish, FINISH_ABORT) and is_unadmitted_reject(req)
    return req


def test_decode_refuses_a_request_rejected_at_intake(pd_mode: str) -> None:
    q = _decode_queue()
    before = metrics.value("placeholder_blocked_total")
    assert q._create_receiver_and_enqueue(_intake_rejected()) is None
    assert q.queue == [], "a receiver was enqueued for a request rejected at intake"
    assert metrics.value("placeholder_blocked_total") == before + 1


def test_decode_lets_a_rebootstrapping_request_with_a_pending_abort_through(
        pd_mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 15: re-entering after preemption/re-bootstrap is not a rejection. Strict mode
    too: it must not raise inside the scheduler."""
    monkeypatch.setenv(STRICT_ENV, "1")
    q = _decode_queue()
    req = _intake_rejected()  # a pending abort, as "Abort method 3" leaves on a running req
    before = metrics.value("placeholder_blocked_total")
    decode_req = q._create_receiver_and_enqueue(req, is_rebootstrap=True)
    assert decode_req is not None and decode_req.req is req and q.queue == [decode_req]
    assert metrics.value("placeholder_blocked_total") == before


def test_decode_lets_a_retracted_request_with_a_pending_abort_through(
        pd_mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that holds resources (here: marked retracted, as release_req leaves it) is
    not 'rejected at intake' even without the rebootstrap flag."""
    monkeypatch.setenv(STRICT_ENV, "1")
    q = _decode_queue()
    req = _intake_rejected()
    req.is_retracted = True
    assert not is_unadmitted_reject(req)
    decode_req = q._create_receiver_and_enqueue(req)
    assert decode_req is not None and q.queue == [decode_req]


def test_strict_mode_raises_only_for_intake_rejections(
        pd_mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(AssertionError, match="reached decode create_receiver"):
        _decode_queue()._create_receiver_and_enqueue(_intake_rejected())


def test_decode_door_retires_what_the_guard_refuses(pd_mode: str) -> None:
    """Through the real DecodePreallocQueue.add: the refused request is retired (its client
    is answered), never enqueued. is_unadmitted_reject at the door is bypassed here to reach
    the second line, as a path that misses the door would."""
    q = _decode_queue()
    q.scheduler = SimpleNamespace(retire_unadmitted_request=MagicMock())
    q._check_if_req_exceed_kv_capacity = lambda req: False
    req = _intake_rejected()
    with patch("sglang.srt.disaggregation.decode.is_unadmitted_reject", return_value=False):
        q.add(req)
    q.scheduler.retire_unadmitted_request.assert_called_once_with(req)
    assert q.queue == []


def test_prefill_refuses_a_sender_for_a_request_rejected_at_intake(pd_mode: str) -> None:
    q = PrefillBootstrapQueue.__new__(PrefillBootstrapQueue)
    q.scheduler = SimpleNamespace(retire_unadmitted_request=MagicMock())
    q._check_if_req_exceed_kv_capacity = lambda req: False
    req = _intake_rejected()
    before = metrics.value("placeholder_blocked_total")
    assert q.create_sender(req, 8) is False
    q.scheduler.retire_unadmitted_request.assert_called_once_with(req)
    assert getattr(req, "disagg_kv_sender", None) is None
    assert metrics.value("placeholder_blocked_total") == before + 1
