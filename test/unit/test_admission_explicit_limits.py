"""Admission limits travel explicitly, not through module state (issue #7, finding 7).

``enforce_kv_capacity`` used to record the KV capacity and effective context length in a
module global that ``scheduler_limits`` read later, coupling the tp worker's and the
scheduler's call sites (and every worker in the process) through ``admission``. Now the tp
worker keeps the effective context length (its ``model_config.context_len``) and the served
capacity (``pdsafe_kv_capacity``), and the scheduler passes them to ``scheduler_limits``.

Checked through upstream's real ``TpModelWorker.get_worker_info`` and
``Scheduler.get_init_info`` (patched), on stand-ins for the objects they read.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from sglang.pdsafe import admission
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.runtime_context import publish, reset_context
from sglang.srt.server_args import ServerArgs

CONTEXT = 4096


@pytest.fixture
def prefill_args() -> Iterator[ServerArgs]:
    args = ServerArgs(model_path="dummy", disaggregation_mode="prefill",
                      disaggregation_clamp_context_to_kv_capacity=True)
    reset_context()
    publish(args, role="scheduler")
    yield args
    reset_context()


def _worker(server_args: ServerArgs, kv_capacity: int) -> SimpleNamespace:
    """What get_worker_info reads from a TpModelWorker (its model runner, config, args)."""
    runner = SimpleNamespace(
        effective_logical_max_total_num_tokens=kv_capacity,
        logical_max_total_num_tokens=kv_capacity,
        token_to_kv_pool_allocator=SimpleNamespace(page_size=1),
        max_running_requests=8, forward_stream=None,
        req_to_token_pool=SimpleNamespace(size=8, max_context_len=CONTEXT),
        token_to_kv_pool=SimpleNamespace(size=kv_capacity),
    )
    return SimpleNamespace(model_runner=runner, model_config=SimpleNamespace(context_len=CONTEXT),
                           server_args=server_args, dllm_algorithm=None, random_seed=0,
                           device="cpu")


def _scheduler(worker: SimpleNamespace) -> SimpleNamespace:
    info = TpModelWorker.get_worker_info(worker)
    return SimpleNamespace(tp_worker=worker, max_total_num_tokens=info[0],
                           max_req_input_len=info[5], startup_time=0.0,
                           _hicache_l3_layout=lambda: {})


def test_each_scheduler_reports_its_own_workers_limits(prefill_args):
    """Two workers computed one after the other (as with two engines in one process): each
    scheduler's init info carries its own worker's values. With the module global the first
    one reported the second one's capacity and context length."""
    a = _scheduler(_worker(prefill_args, 600))
    b = _scheduler(_worker(prefill_args, 3000))
    info_a = Scheduler.get_init_info(a)
    info_b = Scheduler.get_init_info(b)
    assert (info_a["pdsafe_kv_capacity"], info_a["pdsafe_context_len"]) == (600, 600)
    assert (info_b["pdsafe_kv_capacity"], info_b["pdsafe_context_len"]) == (3000, 3000)
    assert info_a["pdsafe_max_prompt_tokens"] == info_a["max_req_input_len"] - 1 == 593
    assert a.tp_worker.pdsafe_kv_capacity == 600 and a.tp_worker.model_config.context_len == 600


def test_scheduler_limits_reports_exactly_what_it_is_given():
    assert admission.scheduler_limits(506, 1024, 512) == {
        "pdsafe_context_len": 1024, "pdsafe_kv_capacity": 512, "pdsafe_max_prompt_tokens": 505}
    assert admission.scheduler_limits(None, None, None) == {}
    with pytest.raises(TypeError):
        admission.scheduler_limits(506)  # type: ignore[call-arg]  # no hidden source


def test_enforce_kv_capacity_leaves_no_trace():
    args = SimpleNamespace(disaggregation_mode="prefill", num_reserved_decode_tokens=512,
                           disaggregation_clamp_context_to_kv_capacity=True)
    assert admission.enforce_kv_capacity(args, 600, CONTEXT) == 600
    assert admission.scheduler_limits(10, 20, 30) == {
        "pdsafe_context_len": 20, "pdsafe_kv_capacity": 30, "pdsafe_max_prompt_tokens": 9}


def test_admission_has_no_module_level_mutable_state():
    """No dict/list/set (literal, comprehension or constructor call) bound at module level."""
    tree = ast.parse(Path(admission.__file__).read_text())
    mutable = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
    found = []
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            v = node.value
            ctor = isinstance(v, ast.Call) and getattr(v.func, "id", "") in (
                "dict", "list", "set", "defaultdict", "OrderedDict")
            if isinstance(v, mutable) or ctor:
                found.append(ast.unparse(node).splitlines()[0])
    assert not found, f"module-level mutable state in admission: {found}"
