"""The test-only ``late_write`` fault (``pdsafe_testkit.faults``): parsing, room filter, hooks.

Server-free. The parsing and room-range helpers run in this process (the fault module imports
no sglang). The hook runs in a fresh interpreter, as a prefill server process would: sglang's
``load_plugins()`` discovers the installed testkit's entry point, the plugin registers its
``AROUND`` hooks, ``HookRegistry.apply_hooks`` wraps the KV write functions of the Mooncake and
NIXL managers. The write functions are replaced by recording stand-ins (same parameter names)
before the plugin loads, so the hook's own behaviour is observed: which rooms it holds, for how
long (its sleep is recorded, not slept), and that it always calls the original with the
original arguments and returns its result. A further check reads the real upstream classes:
each hooked function exists, takes ``dst_kv_indices``, and is called by ``transfer_worker``
after the worker's "room failed or aborted" skip, with the chunk in a local ``kv_chunk`` (what
the fault reads the room from). What this does not prove: that a held write lands in a real
decode's pages (test/pd/test_late_write.py does that with servers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from pdsafe_testkit import faults
from pdsafe_testkit.faults import (
    LATE_ROOM_BASE,
    ROOM_RANGE_WIDTH,
    TRACE_ROOM_BASE,
    is_late_room,
    is_traced_room,
    late_room,
    page_runs,
    parse_foreign_kv,
    parse_late_write,
    parse_late_write_log,
    parse_page_runs,
    parse_spec,
    traced_room,
)

FAULT_ENV = faults.ENV


def test_spec_parsing_arms_each_named_fault_and_refuses_mistakes() -> None:
    """``name[:arg]`` items: each fault reads its own; a typo, a missing, non-positive or
    non-finite delay, or a fault named twice is an error, never a silently unarmed server."""
    assert parse_late_write("late_write:6") == 6.0
    assert parse_late_write(" foreign_kv:16 , late_write:0.25 ") == 0.25
    assert parse_late_write("foreign_kv:16") == 0.0
    assert parse_foreign_kv("late_write:6,foreign_kv:8") == 8  # foreign_kv keeps working
    assert parse_foreign_kv("foreign_kv") == 16
    assert parse_spec("late_write:6,,") == {"late_write": "6"}
    for bad in ("late_write", "late_write:", "late_write:x", "late_write:0", "late_write:-1",
                "late_write:nan", "late_write:inf"):
        with pytest.raises(ValueError, match="late_write"):
            parse_late_write(bad)
    with pytest.raises(ValueError, match="unknown test fault 'late_wirte'"):
        parse_late_write("late_wirte:6")  # a typo must not run unarmed
    with pytest.raises(ValueError, match="named twice"):
        parse_spec("late_write:1,late_write:2")


def test_room_ranges_are_disjoint_and_bounded() -> None:
    """The late and traced room ranges are disjoint, exact (no neighbour room matches) and
    below 2**62; indexes outside the width are refused."""
    assert late_room(0) == LATE_ROOM_BASE and traced_room(0) == TRACE_ROOM_BASE
    last_late, last_traced = late_room(ROOM_RANGE_WIDTH - 1), traced_room(ROOM_RANGE_WIDTH - 1)
    assert is_late_room(last_late) and not is_traced_room(last_late)
    assert is_traced_room(last_traced) and not is_late_room(last_traced)
    assert last_traced < 1 << 62  # inside what clients pick rooms from (testkit, router)
    for outside in (LATE_ROOM_BASE - 1, TRACE_ROOM_BASE + ROOM_RANGE_WIDTH, 0, 12345, None,
                    str(LATE_ROOM_BASE)):
        assert not is_late_room(outside) and not is_traced_room(outside)
    for i in (-1, ROOM_RANGE_WIDTH):
        with pytest.raises(ValueError):
            late_room(i)
        with pytest.raises(ValueError):
            traced_room(i)


def test_page_runs_round_trip_and_log_parsing() -> None:
    """Destination pages survive the log format, and the tests' parser reads the lines back."""
    pages = [9, 1, 2, 3, 7, 8, 3]
    assert page_runs(pages) == "1-3,7-9" and page_runs([]) == ""
    assert parse_page_runs(page_runs(pages)) == set(pages)
    log = (
        "[t] TEST FAULT late_write held: room 5, decode pages [1-3,7-9], status Transferring, "
        "at 100.500; holding this write for 6.0 s (X.send_kvcache)\n"
        "[t] TEST FAULT late_write done: room 5, decode pages [1-3,7-9], status cleared, "
        "at 106.600; late write returned 0 (X.send_kvcache)\n"
    )
    held, done = parse_late_write_log(log)
    assert (held.event, held.room, held.status, held.at) == ("held", 5, "Transferring", 100.5)
    assert held.pages == frozenset({1, 2, 3, 7, 8, 9})
    assert (done.event, done.status, done.at) == ("done", "cleared", 106.6)


ARMED = r"""
import json, logging, sys
from types import SimpleNamespace
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
import numpy as np
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
from sglang.srt.disaggregation.nixl.conn import NixlKVManager
from sglang.srt.plugins import load_plugins

calls = []

def mooncake_send(self, mooncake_session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices,
                  executor=None, **kwargs):
    calls.append(["mooncake", self.name, list(map(int, dst_kv_indices)), sorted(kwargs)])
    return 0

def nixl_slice(self, peer_name, prefill_kv_indices, dst_kv_indices):
    calls.append(["nixl", self.name, list(map(int, dst_kv_indices)), []])
    return "handle"

# Stand-ins first: the plugin's hooks then wrap them (as they wrap the real functions).
# Kept in a dict: apply_hooks rebinds every module attribute that is the original function
# (sys.modules-wide), __main__'s globals included.
keep = {"mooncake": mooncake_send, "nixl": nixl_slice}
MooncakeKVManager.send_kvcache = mooncake_send
NixlKVManager.send_kvcache_slice = nixl_slice
load_plugins()
from pdsafe_testkit import faults
sleeps = []
faults.armed_late_write.sleep = sleeps.append

def transfer_worker(kind, mgr, room):  # named like upstream's worker: the fault reads kv_chunk
    kv_chunk = SimpleNamespace(room=room)
    dst = np.array([4, 5, 6, 10], dtype=np.int32)
    if kind == "mooncake":
        return MooncakeKVManager.send_kvcache(mgr, "sess", np.arange(4), [1], dst, None,
                                              dst_layer_ids=None)
    return NixlKVManager.send_kvcache_slice(mgr, "peer", np.arange(4), dst_kv_indices=dst)

def elsewhere(room):  # not a transfer worker: never delayed
    kv_chunk = SimpleNamespace(room=room)
    return MooncakeKVManager.send_kvcache(SimpleNamespace(name="x"), "s", [], [], [7])

rooms = json.loads(sys.argv[1])
results = []
for kind, room in rooms:
    mgr = SimpleNamespace(name=f"{kind}-{room}", request_status={room: 0})
    before = len(sleeps)
    results.append([transfer_worker(kind, mgr, room), sleeps[before:]])
results.append([elsewhere(rooms[0][1]), []])
print(json.dumps({
    "wrapped": [getattr(MooncakeKVManager.send_kvcache, "__wrapped__", None) is keep["mooncake"],
                getattr(NixlKVManager.send_kvcache_slice, "__wrapped__", None) is keep["nixl"]],
    "results": results, "calls": calls, "sleeps": sleeps,
}))
"""


def _run(script: str, *argv: str, **env: str) -> tuple[dict, str]:
    e = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, "SGLANG_PLUGINS")}
    e.update(env)
    r = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True,
                       timeout=300, env=e)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_armed_plugin_holds_only_late_rooms_and_always_writes() -> None:
    """Through sglang's loader: only late rooms are held (once, for the armed delay), traced
    rooms are logged, other rooms and callers outside a transfer worker pass untouched, and
    every write reaches the original with its arguments. Not proven: real transfers."""
    late, traced, plain = late_room(7), traced_room(7), TRACE_ROOM_BASE + ROOM_RANGE_WIDTH
    rooms = [["mooncake", late], ["mooncake", traced], ["mooncake", plain], ["nixl", late],
             ["nixl", 42]]
    out, log = _run(ARMED, json.dumps(rooms), **{FAULT_ENV: "late_write:0.5"})
    assert "Loaded plugin pdsafe_test_faults" in log, log[-3000:]
    assert "TEST FAULT ARMED" in log and "land 0.5 s late" in log, log[-3000:]
    assert out["wrapped"] == [True, True], "the KV write functions were not hooked"
    # Only the late rooms were held, each exactly once, for the armed delay.
    assert [r[1] for r in out["results"]] == [[0.5], [], [], [0.5], [], []]
    # Every write reached the original, with its arguments, and its result came back.
    assert [r[0] for r in out["results"]] == [0, 0, 0, "handle", "handle", 0]
    assert [c[:2] for c in out["calls"]] == [
        ["mooncake", f"mooncake-{late}"], ["mooncake", f"mooncake-{traced}"],
        ["mooncake", f"mooncake-{plain}"], ["nixl", f"nixl-{late}"], ["nixl", "nixl-42"],
        ["mooncake", "x"]]
    assert out["calls"][0][2] == [4, 5, 6, 10] and out["calls"][0][3] == ["dst_layer_ids"]
    # Held and traced writes are logged with their decode pages; others are not.
    events = parse_late_write_log(log)
    assert [(e.event, e.room) for e in events] == [
        ("held", late), ("writing", late), ("done", late), ("traced", traced),
        ("held", late), ("writing", late), ("done", late)]
    assert all(e.pages == {4, 5, 6, 10} and e.status == "Failed" for e in events)
    assert str(plain) not in log and "room 42," not in log


def test_unarmed_or_malformed_hooks_no_write() -> None:
    """Unarmed, or armed with a malformed delay, no KV write function is wrapped (the malformed
    value is refused loudly instead of running unarmed in silence)."""
    script = r"""
import json
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
from sglang.srt.disaggregation.nixl.conn import NixlKVManager
from sglang.srt.plugins import load_plugins
load_plugins()
print(json.dumps([hasattr(MooncakeKVManager.send_kvcache, "__wrapped__"),
                  hasattr(NixlKVManager.send_kvcache, "__wrapped__")]))
"""
    for env in ({}, {FAULT_ENV: "late_write:abc"}):
        out, log = _run(script, **env)
        assert out == [False, False], (env, log[-2000:])
    # The malformed value was refused loudly (sglang's loader logs the plugin's error).
    assert "Failed to execute general plugin" in log and "late_write needs seconds" in log, (
        log[-2000:])


REAL = r"""
import inspect, json
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
from sglang.srt.disaggregation.nixl.conn import NixlKVManager
from pdsafe_testkit.faults import LATE_WRITE_TARGETS
classes = {"mooncake": MooncakeKVManager, "nixl": NixlKVManager}
skip = {"mooncake": "because it has already failed or been aborted",
        "nixl": "if self.check_status(room) == KVPoll.Failed:"}
out = {}
for backend, targets in LATE_WRITE_TARGETS.items():
    cls = classes[backend]
    worker = inspect.getsource(cls.transfer_worker)
    for target in targets:
        name = target.rsplit(".", 1)[1]
        fn = getattr(cls, name)
        call = worker.find(f"self.{name}(")
        out[target] = {
            "takes_dst": "dst_kv_indices" in inspect.signature(fn).parameters,
            "called_after_skip": 0 <= worker.find(skip[backend]) < call,
            "kv_chunk_local": "kv_chunk" in cls.transfer_worker.__code__.co_varnames,
        }
print(json.dumps(out))
"""


def test_hooked_functions_are_the_workers_writes_after_its_abort_check() -> None:
    """Upstream drift guard: every hooked function exists on the real manager, takes
    ``dst_kv_indices``, and is called in ``transfer_worker`` after its skip of failed/aborted
    rooms, with the chunk in ``kv_chunk``. A source-order check, not an execution."""
    out, _ = _run(REAL)
    assert set(out) == {t for ts in faults.LATE_WRITE_TARGETS.values() for t in ts}
    for target, facts in out.items():
        assert facts == {"takes_dst": True, "called_after_skip": True, "kv_chunk_local": True}, (
            target, facts)
