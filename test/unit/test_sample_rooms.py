"""Each sample of an ``n>1`` request on a PD server is a KV transfer of its own room
(``sglang.pdsafe.sample_rooms``, patch 0031; issue 21, item 5).

No servers: upstream's real ``TokenizerManager._handle_batch_request`` (the n>1 expansion) on a
tokenizer manager built without its constructor; what it would hand the scheduler is recorded
(``_send_one_request``), and tokenizing and waiting for answers are stand-ins. With real
servers (every sample reference-identical, through the router and directly):
test/pd/test_parallel_sampling.py.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from sglang.pdsafe import room_guard, sample_rooms

ROOM = 123456789012345


def test_a_sample_room_is_derived_alike_distinct_and_never_the_requests() -> None:
    rooms = [sample_rooms.sample_room(ROOM, k) for k in range(1000)]
    assert rooms == [sample_rooms.sample_room(ROOM, k) for k in range(1000)], "both legs agree"
    assert len(set(rooms)) == 1000 and ROOM not in rooms
    assert all(0 < r < (1 << 63) for r in rooms)
    assert sample_rooms.sample_room(ROOM + 1, 0) != rooms[0]


def _tm(mode: str | None) -> Any:
    """A tokenizer manager of upstream's class with what ``_handle_batch_request`` reads."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    tm = object.__new__(TokenizerManager)
    tm.server_args = SimpleNamespace(disaggregation_mode=mode or "null")
    tm.rid_to_state = {}
    tm.sent = []

    async def tokenize(obj: Any) -> Any:
        return SimpleNamespace(rid=obj.rid, bootstrap_room=obj.bootstrap_room, input_ids=[1, 2],
                               sampling_params=SimpleNamespace(max_new_tokens=8), stream=False,
                               mm_inputs=None, time_stats=None, lora_path=None, lora_id=None)

    def init_state(obj: Any, request: Any = None) -> None:
        for rid in obj.rid if isinstance(obj.rid, list) else [obj.rid]:
            tm.rid_to_state[rid] = SimpleNamespace(
                time_stats=SimpleNamespace(set_finished_time=lambda: None), lora_released=False)

    async def send(tokenized: Any) -> None:
        tm.sent.append(tokenized)

    async def wait(obj: Any, request: Any) -> Any:
        yield {"meta_info": {"id": obj.rid}, "text": ""}

    tm._tokenize_one_request, tm._init_req_state = tokenize, init_state
    tm._send_one_request, tm._wait_one_response = send, wait
    return tm


def _expand(tm: Any, n: int, rooms: list[int | None]) -> list[Any]:
    from sglang.srt.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(input_ids=[[1, 2, 3]] * len(rooms),
                           sampling_params={"n": n, "max_new_tokens": 8, "temperature": 0},
                           bootstrap_room=rooms)
    obj.normalize_batch_and_arguments()
    tm._init_req_state(obj)
    states = {rid: tm.rid_to_state[rid] for rid in obj.rid}

    async def run() -> list[Any]:
        return [out async for out in tm._handle_batch_request(obj, None, states)]

    (outputs,) = asyncio.run(run())
    assert len(outputs) == n * len(rooms)
    return tm.sent


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_on_a_pd_server_every_sample_gets_its_own_room_and_no_warmup_is_sent(mode) -> None:
    rooms = [ROOM, ROOM + 7]
    sent = _expand(_tm(mode), 3, rooms)
    assert [t.sampling_params.max_new_tokens for t in sent] == [8] * 6, "no warmup transfer"
    expected = [sample_rooms.sample_room(r, k) for r in rooms for k in range(3)]
    assert [t.bootstrap_room for t in sent] == expected
    assert len({t.rid for t in sent}) == 6


def test_a_colocated_server_expands_as_upstream_does() -> None:
    sent = _expand(_tm(None), 2, [None])
    assert [t.sampling_params.max_new_tokens for t in sent] == [0, 8, 8], "warmup, samples"
    assert [t.bootstrap_room for t in sent] == [None] * 3


def test_n_gt_1_is_served_in_pd_and_refused_only_without_per_sample_rooms(monkeypatch) -> None:
    """The HTTP check lets ``n>1`` through on a tokenizer manager that gives each sample its
    room; an upstream without that (an earlier prefix of the series) still refuses it."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    obj = SimpleNamespace(parallel_sample_num=3)
    room_guard.check_http_request(_tm("decode"), obj)  # served
    bare = SimpleNamespace(server_args=SimpleNamespace(disaggregation_mode="decode"))
    with pytest.raises(room_guard.ParallelSamplingRefusedError):
        room_guard.check_http_request(bare, obj)
    monkeypatch.delattr(TokenizerManager, "pdsafe_sample_room")
    with pytest.raises(room_guard.ParallelSamplingRefusedError):
        room_guard.check_http_request(_tm("prefill"), obj)
