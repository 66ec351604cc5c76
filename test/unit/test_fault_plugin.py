"""The test-only fault plugin (``pdsafe_testkit.faults``) through sglang's own plugin loader.

Each case runs in a fresh interpreter, as a server process would: sglang's ``load_plugins()``
discovers the ``sglang.srt.plugins`` entry point of the installed testkit, the plugin registers
its ``HookRegistry`` hook, and ``apply_hooks`` patches ``sglang.pdsafe.commit_gate.admit_commit``.
A caller that looks the gate up through the module at call time (as the patched decode
scheduler does) must then run the fault right before the coverage check. Real sglang KV pools
(``MHATokenToKVPool``, ``ReqToTokenPool``, ``TokenToKVPoolAllocator``) and real ``Req`` /
``DecodeRequest`` objects; only the scheduler and transfer queue are namespaces holding them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from pdsafe_testkit.faults import (
    parse_park_commit,
    parse_park_log,
    parse_spec,
    parse_wire_version,
)
from sglang.pdsafe.pair_agreement import WIRE_VERSION

FAULT_ENV = "SGLANG_PDSAFE_TEST_FAULTS"

ARMED = r"""
import json, logging, sys
from types import SimpleNamespace
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
import torch
from sglang.pdsafe import commit_gate, coverage
from sglang.srt.disaggregation.decode import DecodeRequest
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.plugins import load_plugins
from sglang.srt.sampling.sampling_params import SamplingParams

# In a dict, not a module global: apply_hooks rebinds every module attribute that is the
# original function (sys.modules-wide), __main__'s globals included.
keep = {"original": commit_gate.admit_commit}
seen = []

def fake_admit(tq, dr):  # stands in for the coverage check: records what it saw
    seen.append((dr.req.rid, k(0, dr.req).tolist()))
    return "coverage-verdict"

coverage.admit = fake_admit

def caller(tq, dr):  # looks the gate up at call time, like the patched scheduler
    return commit_gate.admit_commit(tq, dr)

load_plugins()

pool = MHATokenToKVPool(size=64, page_size=1, dtype=torch.float32, head_num=2, head_dim=4,
                        layer_num=2, device="cpu", enable_memory_saver=False,
                        enable_alt_stream=False)
alloc = TokenToKVPoolAllocator(64, torch.float32, "cpu", pool, need_sort=False)
rtt = ReqToTokenPool(size=4, max_context_len=32, device="cpu", enable_memory_saver=False)
for layer in range(pool.layer_num):  # every position and layer holds distinct content
    pool.get_key_buffer(layer).copy_(
        torch.arange(pool.get_key_buffer(layer).numel(), dtype=torch.float32)
        .reshape(pool.get_key_buffer(layer).shape) + 1000 * layer)
    pool.get_value_buffer(layer).copy_(-pool.get_key_buffer(layer))
sched = SimpleNamespace(req_to_token_pool=rtt, token_to_kv_pool_allocator=alloc)
tq = SimpleNamespace(scheduler=sched)

def make(row, rid, n=10):
    req = Req(rid, "", list(range(n)), SamplingParams())
    req.kv.req_pool_idx = row
    rtt.req_to_token[row, :n] = alloc.alloc(n).to(torch.int32)
    return req

def k(layer, req):
    locs = rtt.req_to_token[req.kv.req_pool_idx, : len(req.origin_input_ids)].long()
    return pool.get_key_buffer(layer)[locs][:, 0, 0]

def v(layer, req):
    locs = rtt.req_to_token[req.kv.req_pool_idx, : len(req.origin_input_ids)].long()
    return pool.get_value_buffer(layer)[locs][:, 0, 0]

a, b, c = make(1, "pdsafe-fault-source-x"), make(2, "pdsafe-fault-inject-x"), make(3, "plain")
before = {r.rid: [[k(i, r).tolist(), v(i, r).tolist()] for i in range(2)] for r in (a, b, c)}
verdicts = [caller(tq, DecodeRequest(req=r, kv_receiver=None)) for r in (c, a, b)]
after = {r.rid: [[k(i, r).tolist(), v(i, r).tolist()] for i in range(2)] for r in (a, b, c)}
print(json.dumps({
    "wrapped": commit_gate.admit_commit is not keep["original"],
    "inner": getattr(commit_gate.admit_commit, "__wrapped__", None) is keep["original"],
    "verdicts": verdicts, "seen": seen, "before": before, "after": after,
}))
"""

UNARMED = r"""
import json, logging, os, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from sglang.pdsafe import commit_gate
from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins, load_plugins_by_group

# In a dict, not a module global: apply_hooks rebinds every module attribute that is the
# original function (sys.modules-wide), __main__'s globals included.
keep = {"original": commit_gate.admit_commit}
discovered = sorted(load_plugins_by_group(GENERAL_PLUGINS_GROUP))
os.environ["SGLANG_PLUGINS"] = "some_other_plugin"
whitelisted = sorted(load_plugins_by_group(GENERAL_PLUGINS_GROUP))
del os.environ["SGLANG_PLUGINS"]
load_plugins()
print(json.dumps({"discovered": discovered, "whitelisted": whitelisted,
                  "wrapped": commit_gate.admit_commit is not keep["original"]}))
"""


def _run(script: str, **env: str | None) -> tuple[dict, str]:
    e = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, "SGLANG_PLUGINS")}
    e.update({k: v for k, v in env.items() if v is not None})
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300, env=e)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_armed_plugin_injects_foreign_kv_right_before_the_coverage_check():
    out, log = _run(ARMED, **{FAULT_ENV: "foreign_kv:4"})
    assert "Loaded plugin pdsafe_test_faults" in log, log[-3000:]
    assert "TEST FAULT ARMED" in log, log[-3000:]
    assert out["wrapped"] and out["inner"], "admit_commit was not hooked by the plugin"
    # The gate's verdict is the coverage check's, unchanged, for every request.
    assert out["verdicts"] == ["coverage-verdict"] * 3
    before, after = out["before"], out["after"]
    src, inj, plain = "pdsafe-fault-source-x", "pdsafe-fault-inject-x", "plain"
    assert after[src] == before[src] and after[plain] == before[plain]
    for layer in range(2):
        for kv in range(2):  # K and V
            assert after[inj][layer][kv][:6] == before[inj][layer][kv][:6]
            assert after[inj][layer][kv][6:] == before[src][layer][kv][6:], (layer, kv)
            assert before[inj][layer][kv][6:] != before[src][layer][kv][6:]
    # The coverage check ran after the fault: it already saw the foreign KV.
    assert [rid for rid, _ in out["seen"]] == [plain, src, inj]
    assert out["seen"][2][1] == after[inj][0][0]


def test_unarmed_plugin_hooks_nothing_and_sglang_plugins_whitelist_applies():
    """Unarmed: the plugin loads and hooks nothing. With ``SGLANG_PLUGINS`` naming other plugins
    sglang's loader never loads it, so even an armed variable would arm nothing."""
    out, log = _run(UNARMED)
    assert "pdsafe_test_faults" in out["discovered"]
    assert "pdsafe_test_faults" not in out["whitelisted"]
    assert out["wrapped"] is False
    assert "TEST FAULT ARMED" not in log



CORRUPT = r"""
import json, logging, sys
from types import SimpleNamespace
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
import torch
from sglang.srt.disaggregation.decode import SchedulerDisaggregationDecodeMixin
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.plugins import load_plugins
from sglang.srt.sampling.sampling_params import SamplingParams

def caller(sched, req):  # looks the method up at call time, like the scheduler
    batch = SimpleNamespace(reqs=[req])
    return SchedulerDisaggregationDecodeMixin._verify_kv_checksums(sched, batch)

load_plugins()
pool = MHATokenToKVPool(size=128, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=4,
                        layer_num=3, device="cpu", enable_memory_saver=False,
                        enable_alt_stream=False)
alloc = TokenToKVPoolAllocator(128, torch.bfloat16, "cpu", pool, need_sort=False)
rtt = ReqToTokenPool(size=8, max_context_len=32, device="cpu", enable_memory_saver=False)
g = torch.Generator().manual_seed(0)
for layer in range(pool.layer_num):
    pool.get_key_buffer(layer).copy_(torch.randn(pool.get_key_buffer(layer).shape, generator=g))
    pool.get_value_buffer(layer).copy_(torch.randn(pool.get_value_buffer(layer).shape, generator=g))
# kv_checksum_computer None: the check itself returns at once (stock's behaviour).
sched = SimpleNamespace(req_to_token_pool=rtt, token_to_kv_pool_allocator=alloc,
                        kv_checksum_computer=None)

def snapshot():
    return torch.cat([torch.stack([pool.get_key_buffer(i), pool.get_value_buffer(i)])
                      .view(torch.uint8).flatten() for i in range(pool.layer_num)]).clone()

reqs = []
for row, rid in enumerate(["pdsafe-fault-corrupt-bit-a", "pdsafe-fault-corrupt-lastpage-b",
                           "pdsafe-fault-corrupt-page-c", "pdsafe-fault-corrupt-layer-d",
                           "pdsafe-fault-corrupt-nosuchmode-e", "plain"], start=1):
    req = Req(rid, "", list(range(12)), SamplingParams())
    req.kv.req_pool_idx = row
    req.kv.cache_protected_len = 4  # positions 0..3: decode's own prefix, never touched
    rtt.req_to_token[row, :12] = alloc.alloc(12).to(torch.int32)
    reqs.append(req)

row_bytes = pool.get_key_buffer(0)[0].numel() * 2
out = {}
for req in reqs:
    before = snapshot()
    caller(sched, req)
    diff = (before ^ snapshot()).nonzero().flatten()
    bits = int(sum(bin(int(x)).count("1") for x in (before ^ snapshot())[diff]))
    # Which slots changed: byte offset -> (layer, K/V, slot)
    slots = sorted({int(d) // row_bytes % pool.get_key_buffer(0).shape[0] for d in diff})
    locs = rtt.req_to_token[req.kv.req_pool_idx, :12].tolist()
    out[req.rid] = {"bytes": len(diff), "bits": bits, "slots": slots, "owned": locs[4:],
                    "last": locs[-1]}
print(json.dumps(out))
"""


def test_armed_kv_corrupt_changes_only_owned_transferred_bytes():
    """``kv_corrupt`` (issue 10's corruption family): each mode changes what it says, only in
    the request's own transferred positions (never its prefix or another request's slots);
    an unknown mode and a plain rid are untouched."""
    out, log = _run(CORRUPT, **{FAULT_ENV: "kv_corrupt"})
    assert "TEST FAULT ARMED" in log, log[-3000:]
    bit, last = out["pdsafe-fault-corrupt-bit-a"], out["pdsafe-fault-corrupt-lastpage-b"]
    page, layer = out["pdsafe-fault-corrupt-page-c"], out["pdsafe-fault-corrupt-layer-d"]
    assert (bit["bytes"], bit["bits"]) == (1, 1) and set(bit["slots"]) <= set(bit["owned"])
    assert (last["bytes"], last["bits"]) == (1, 1) and last["slots"] == [last["last"]]
    assert page["bytes"] > 0 and len(page["slots"]) == 1 and page["slots"][0] in page["owned"]
    assert layer["slots"] == sorted(layer["owned"]) and layer["bits"] == len(layer["owned"])
    assert out["pdsafe-fault-corrupt-nosuchmode-e"]["bytes"] == 0
    assert out["plain"]["bytes"] == 0
    assert log.count("TEST FAULT kv_corrupt: rid") == 4, log[-3000:]


PARK = r"""
import inspect, json, logging, sys
from types import SimpleNamespace
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from sglang.srt.disaggregation.decode import DecodeRequest, DecodeTransferQueue
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.plugins import load_plugins
from sglang.srt.sampling.sampling_params import SamplingParams

# What the fault relies on in the real upstream class: pop_transferred polls through one of
# the two hooked methods and commits the requests whose poll is Success.
src = inspect.getsource(DecodeTransferQueue.pop_transferred)
real = ["self._poll_with_metadata_gate()" in src, "self._poll_with_staging()" in src,
        "poll == KVPoll.Success" in src and "self._commit_transfer_to_req(decode_req)" in src]

# Stand-ins for the two polls (upstream's all-reduce over a process group): the queue's
# prepared real polls, one per request in queue order. The plugin wraps these.
def gate(self):
    return list(self.next_polls)

def staging(self):
    return list(self.next_polls)

DecodeTransferQueue._poll_with_metadata_gate = gate
DecodeTransferQueue._poll_with_staging = staging
# In a dict, not module globals: apply_hooks rebinds every module attribute that is the
# original function (__main__'s globals included).
keep = {"gate": gate, "staging": staging}
load_plugins()
from pdsafe_testkit import faults

clock = [100.0]
faults.armed_park.clock = lambda: clock[0]

def dreq(rid):
    return DecodeRequest(req=Req(rid, "", [1, 2, 3], SamplingParams()), kv_receiver=None)

tq = SimpleNamespace(queue=[dreq("pdsafe-fault-park-a"), dreq("plain"),
                            dreq("pdsafe-fault-park-b")], next_polls=[])
steps = []
for t, polls in ((100.0, [4, 4, 3]), (100.5, [4, 4, 4]), (101.0, [4, 4, 0]),
                 (101.1, [4, 4, 4])):
    clock[0], tq.next_polls = t, polls
    steps.append(DecodeTransferQueue._poll_with_metadata_gate(tq))  # as pop_transferred does
tq2 = SimpleNamespace(queue=[dreq("pdsafe-fault-park-c")], next_polls=[4])
staged = DecodeTransferQueue._poll_with_staging(tq2)
print(json.dumps({"real": real, "steps": steps, "staged": staged,
                  "wrapped": [DecodeTransferQueue._poll_with_metadata_gate is not keep["gate"],
                              DecodeTransferQueue._poll_with_staging is not keep["staging"]]}))
"""


def test_park_commit_spec_parsing() -> None:
    """``park_commit:SECONDS`` arms beside the other faults; a missing, non-numeric,
    non-positive or non-finite delay is an error, never a silently unarmed server."""
    assert parse_park_commit("park_commit:3") == 3.0
    assert parse_park_commit("kv_corrupt, park_commit:0.5") == 0.5
    assert parse_park_commit("kv_corrupt") == 0.0
    for bad in ("park_commit", "park_commit:", "park_commit:x", "park_commit:0",
                "park_commit:-2", "park_commit:nan", "park_commit:inf"):
        with pytest.raises(ValueError, match="park_commit"):
            parse_park_commit(bad)


def test_armed_park_commit_holds_only_its_rids_finished_transfers_and_ends_on_abort():
    """``park_commit`` (the abort family's after-transfer-before-commit phase), through
    sglang's plugin loader on the real ``DecodeTransferQueue``: a ``pdsafe-fault-park-`` request
    whose transfer is done (poll Success) is reported Transferring for SECONDS, then committed
    once; a plain request is never touched; a parked request whose poll turns Failed (it was
    aborted) passes at once and is never parked again. Both poll paths are hooked."""
    out, log = _run(PARK, **{FAULT_ENV: "park_commit:1"})
    assert "TEST FAULT ARMED" in log and "park_commit" in log, log[-3000:]
    assert out["real"] == [True, True, True], "upstream's pop_transferred changed"
    assert out["wrapped"] == [True, True]
    # a: parked at 100.0, held at 100.5, released at 101.0 (1 s), then left alone;
    # plain: never changed; b: Transferring passes, parked at 100.5, Failed at 101.0 ends it.
    assert out["steps"] == [[3, 4, 3], [3, 4, 3], [4, 4, 0], [4, 4, 4]]
    assert out["staged"] == [3]
    events = [(e.event, e.rid.rsplit("-", 1)[1], e.status, e.after) for e in parse_park_log(log)]
    assert events == [("parked", "a", "Success", 0.0), ("parked", "b", "Success", 0.0),
                      ("released", "a", "Success", 1.0), ("left", "b", "Failed", 0.5),
                      ("parked", "c", "Success", 0.0)], log[-3000:]


def test_wire_version_spec_parsing() -> None:
    """``wire_version:VERSION`` arms beside the other faults with a pdsafe wire version of
    another release; a missing, malformed or this release's own version is an error, never a
    silently unarmed server (nor one that pretends nothing)."""
    assert "wire_version" in parse_spec("wire_version:sglang-pdsafe-pair/2")
    assert parse_wire_version("wire_version:sglang-pdsafe-pair/2") == "sglang-pdsafe-pair/2"
    assert parse_wire_version("kv_corrupt, wire_version: sglang-pdsafe-pair/17 ") == \
        "sglang-pdsafe-pair/17"
    assert parse_wire_version("kv_corrupt,park_commit:1") == ""
    for bad in ("wire_version", "wire_version:", "wire_version:2", "wire_version:/2",
                "wire_version:sglang-pdsafe-pair/", "wire_version:sglang-pdsafe-pair/0",
                "wire_version:sglang-pdsafe-pair/02", "wire_version:sglang-pdsafe-pair/2x",
                "wire_version:sglang-pdsafe-pair/-1", "wire_version:sglang-pdsafe-pair/two",
                "wire_version:SGLANG-PDSAFE-PAIR/2", "wire_version:sglang-pdsafe/2",
                "wire_version:sglang-pdsafe-pair/2/3"):
        with pytest.raises(ValueError, match="wire_version needs .*sglang-pdsafe-pair/N"):
            parse_wire_version(bad)
    with pytest.raises(ValueError, match="this release's own wire version"):
        parse_wire_version(f"wire_version:{WIRE_VERSION}")
    with pytest.raises(ValueError, match="named twice"):
        parse_wire_version("wire_version:sglang-pdsafe-pair/2,wire_version:sglang-pdsafe-pair/1")


WIRE = r"""
import json, logging, sys
from types import SimpleNamespace
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from sglang.pdsafe import pair_agreement, peer_capability
from sglang.srt.plugins import load_plugins

own = pair_agreement.WIRE_VERSION
load_plugins()

class Mgr:  # a decode KV manager that paired with two prefills (one per version)
    def pdsafe_decode_identity(self):
        return "decode-1"

mgr = Mgr()
for addr, version in (("p-own:1", own), ("p-armed:1", pair_agreement.WIRE_VERSION)):
    pair_agreement._remember_published(
        mgr, addr, {"pdsafe_pair": {"wire_version": version}})
settings = pair_agreement.local_settings(SimpleNamespace(), SimpleNamespace())
prefill = pair_agreement.PairSettings.from_wire({**settings.to_wire(), "wire_version": own})
print(json.dumps({
    "own": own, "now": pair_agreement.WIRE_VERSION, "capability": peer_capability._wire_version(),
    "published": settings.wire_version,
    "mismatch": [str(m) for m in pair_agreement.compare(prefill, settings)],
    "announce_own": peer_capability.announce_frames(mgr, "p-own:1") is not None,
    "announce_armed": [f.decode() for f in peer_capability.announce_frames(mgr, "p-armed:1")],
    "refusal": peer_capability.refusal_message("decode-2", "127.0.0.1", 1, own),
}))
"""


def test_armed_wire_version_makes_every_reader_speak_the_other_release():
    """``wire_version`` through sglang's plugin loader: every reader of the fork's own wire
    version sees VERSION (the pair settings a prefill publishes and a decode compares, what a
    decode announces and to whom, what a prefill requires), read at call time, not at import."""
    other = "sglang-pdsafe-pair/2"
    out, log = _run(WIRE, **{FAULT_ENV: f"wire_version:{other}"})
    assert "TEST FAULT ARMED" in log and other in log, log[-3000:]
    assert (out["own"], out["now"], out["capability"], out["published"]) == \
        (WIRE_VERSION, other, other, other)
    assert out["mismatch"] == [f"wire_version: prefill={WIRE_VERSION!r}, decode={other!r}"]
    # Announced only to a prefill that published the armed version, and as that version.
    assert out["announce_own"] is False
    assert out["announce_armed"] == ["PDSAFE_PEER", other, "decode-1"]
    # A prefill of the armed version refuses a decode that announced this release's version.
    assert f"wire version {other}" in out["refusal"]
    assert f"announced wire version {WIRE_VERSION!r}" in out["refusal"]


def test_malformed_wire_version_arms_nothing_and_says_why():
    """A malformed VERSION: sglang's loader logs the plugin's ValueError; the process keeps
    this release's wire version (the test that asked for another one then fails visibly)."""
    out, log = _run(WIRE, **{FAULT_ENV: "wire_version:sglang-pdsafe-pair/x"})
    assert "wire_version needs a pdsafe wire version" in log, log[-3000:]
    assert "TEST FAULT ARMED" not in log
    assert out["now"] == out["published"] == WIRE_VERSION


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_stale_status_messages_parse_as_the_backends_status_for_their_room(backend) -> None:
    """``stale_status`` speaks the backend's own status format: the decode's real parser reads
    each message as a status of the room (Failed, Failed, Success), and the generation frame
    (none, another one) comes last, where the decode's transfer-generation check reads it."""
    from pdsafe_testkit.faults import (
        STALE_GENERATION_FRAME,
        STALE_LOG,
        StaleStatus,
        is_stale_room,
        stale_room,
    )
    from sglang.srt.disaggregation.base.conn import KVPoll

    from .test_peer_release_backends import _backend_managers

    assert "stale_status" in parse_spec("stale_status,kv_corrupt")
    room = stale_room(7)
    assert is_stale_room(room) and not is_stale_room(room - 8) and not is_stale_room("x")
    m = object.__new__(_backend_managers()[backend])
    m.attn_tp_rank, m.pp_rank, m.attn_cp_rank, m.pp_size, m.attn_cp_size = 0, 0, 0, 1, 1
    got = [(name, m.parse_kv_status_message(parts), parts[-1])
           for name, parts in StaleStatus.messages(m, room)]
    assert [(p[0], p[1]) for _, p, _ in got] == [
        (room, int(KVPoll.Failed)), (room, int(KVPoll.Failed)), (room, int(KVPoll.Success))]
    assert all(p[3] and p[3].startswith(STALE_LOG) for _, p, _ in got[:2]), got
    assert [last == STALE_GENERATION_FRAME for _, _, last in got] == [False, True, True]
