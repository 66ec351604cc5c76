"""A PD side that refuses a request for a client error (prompt too long, bad parameters) answers
its own client with a 4xx; the peer's client must get the same 4xx, not upstream's 500 for a
failed transfer (the router answers with the prefill's error first, so a decode refusal used to
reach the client as "Prefill server error (500)").

No servers: the refusal reasons peer release writes, carried through each backend's real prefill
ABORT handler and real KV_STATUS encoding, read back with ``peer_refusal_status`` exactly as the
patched failure handlers (prefill.py, decode.py; patch 0017) do. With real servers:
test/pd/test_peer_release.py (``check_direct_refusals`` asserts the peer client's 400).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from .test_peer_release_backends import _abort_handler, _backend_managers, _prefill_manager

BACKENDS = ["mooncake", "nixl", "mori", "ascend"]


def _refused_req(room: int, status: int,
                 message: str = "The prompt is too long") -> SimpleNamespace:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return SimpleNamespace(bootstrap_room=room, bootstrap_host="127.0.0.1", bootstrap_port=8998,
                           finished_reason=FINISH_ABORT(message, status, "BadRequestError"),
                           to_finish=None)


def _client_error_message(room: int, failure_reason: str) -> str:
    """The error_message upstream's failure handlers build around the receiver's/sender's
    ``failure_exception()``."""
    from sglang.srt.disaggregation.common.conn import KVTransferError

    return (f"Prefill transfer failed for request rank=0 req.rid='x' req.bootstrap_room={room}"
            f" with exception {KVTransferError(room, failure_reason)}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_refusal_status_reaches_the_prefill_client(backend):
    """Decode refuses (400): the prefill's live sender fails with a reason that carries 400."""
    from sglang.pdsafe import peer_notifier, peer_release
    from sglang.srt.disaggregation.base.conn import KVPoll

    m, _ = _prefill_manager(_backend_managers()[backend])
    room = random.randrange(1 << 62)
    m.request_status[room] = KVPoll.WaitingForInput  # bootstrapped, waiting for the forward
    peer_release._registry(m).live.add(room)  # a live sender owns the room
    reason = peer_notifier.decode_refusal_reason(_refused_req(room, 400))
    _abort_handler(m)([b"ABORT", str(room).encode(),
                       peer_release.wire_frame(peer_release.ORIGIN_PEER, reason)])
    failure = m.failure_records.get(room)
    assert failure and "The prompt is too long" in failure, (backend, failure)
    assert peer_release.peer_refusal_status(_client_error_message(room, failure), 500) == 400


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_refusal_status_reaches_the_decode_client(backend):
    """Prefill refuses at its door (400): decode's metadata is answered Failed with a reason that
    carries 400, through the backend's real KV_STATUS encoding."""
    from sglang.pdsafe import peer_release
    from sglang.srt.disaggregation.base.conn import KVPoll

    m, sent = _prefill_manager(_backend_managers()[backend])
    room = random.randrange(1 << 62)
    m.transfer_infos[room] = {"decode-0": SimpleNamespace(endpoint="127.0.0.1", dst_port=4321,
                                                          is_dummy=False)}
    m.request_status[room] = KVPoll.WaitingForInput
    peer_release.prefill_door_rejected(SimpleNamespace(kv_manager=m), _refused_req(room, 400))
    assert len(sent) == 1, (backend, sent)
    parsed = m.parse_kv_status_message(sent[0][1])
    assert parsed is not None and parsed[1] == int(KVPoll.Failed), parsed
    assert peer_release.peer_refusal_status(_client_error_message(room, parsed[3]), 500) == 400


def test_only_client_errors_from_peer_release_change_the_status():
    """A server error, a client abort, or a status note outside a peer-release failure keep
    upstream's 500; a failure is never turned into a success."""
    from sglang.pdsafe import peer_notifier, peer_release
    from sglang.pdsafe.peer_release_wire import FAILURE_PREFIX, peer_refusal_status

    room = 7
    for status in (500, 503, 200, 302):
        reason = peer_notifier.decode_refusal_reason(_refused_req(room, status))
        assert "(HTTP" not in reason, reason
        assert peer_refusal_status(f"{FAILURE_PREFIX} (bootstrap room 7): {reason}", 500) == 500
    # A transfer failure that is not peer release's, even one quoting a status note.
    assert peer_refusal_status("Decode transfer failed with exception (HTTP 404) x", 500) == 500
    assert peer_refusal_status(None, 500) == 500
    assert peer_refusal_status(f"{FAILURE_PREFIX} (bootstrap room 7): (HTTP 200) x", 500) == 500
    # Client aborts carry no status: the peer's client keeps 500.
    rec = peer_release._Room("aborted on the prefill server", peer_release.ORIGIN_LOCAL, 0.0,
                             None, 0.0)
    assert peer_refusal_status(peer_release._failure_message(room, rec), 500) == 500
    rec.status = 413
    assert peer_refusal_status(peer_release._failure_message(room, rec), 500) == 413


def test_http_layer_refusal_statuses():
    """The HTTP layer's refusal: an AdmissionError's own status, 400 for a ValueError (what
    upstream's handlers answer), none for anything else."""
    from sglang.pdsafe.admission import AdmissionError
    from sglang.pdsafe.peer_release_wire import error_refusal_status, status_note

    assert error_refusal_status(AdmissionError("too long")) == 400
    assert error_refusal_status(ValueError("bad")) == 400
    assert error_refusal_status(RuntimeError("boom")) is None
    assert error_refusal_status(None) is None
    assert status_note(400) == " (HTTP 400)" and status_note(None) == "" and status_note(500) == ""
