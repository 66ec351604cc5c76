"""The KV digest on/off benchmark (``benchmark.kv_digest_cost``) without sglang.

The benchmark is run by hand (it starts five servers); these tests pin its pure parts and its
orchestration against fake PD stacks: the command line and the burst plan, the on/off ratio
arithmetic (shared with ``benchmark.overhead``), the verdict that the digest really ran on the
``on`` stack and really did not on the ``off`` stack (counters and the startup warning), that
every answer of both stacks is judged for content (the digest-off stack must answer correctly
too), and the report writer and exit status. No timing is asserted anywhere.
"""

from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from benchmark import kv_digest_cost as kdc
from benchmark.canary import CanaryBook
from benchmark.overhead import Burst, OverheadPlan, summarize
from benchmark.scenarios import Knobs, Reference
from benchmark.targets import PDTarget

from ._fake_http import FakeServers, JsonHandler, answer_of

# ----------------------------------------------------------------------------- command line


def test_parse_args_defaults_and_quick_plan() -> None:
    a = kdc.parse_args(["--quick", "--out", "/tmp/x"])
    assert a.quick and a.backend == "mooncake" and a.page_size == 1 and a.out == Path("/tmp/x")
    assert a.plan.reps == 3 and a.plan.sweep == (32, 256, 1024)
    full = kdc.parse_args([])
    assert full.plan.reps == 5 and max(full.plan.sweep) == 2048
    assert full.out.name == "bench-kv-digest-cost"
    assert kdc.parse_args(["--quick"]).out.name == "bench-kv-digest-cost-quick"
    b = kdc.parse_args(["--backend", "nixl", "--reps", "7", "--quick"])
    assert b.backend == "nixl" and b.plan.reps == 7 and b.plan.requests == 24


@pytest.mark.parametrize("bad", [["--backend", "mori"], ["--reps", "0"], ["--page-size", "0"]])
def test_parse_args_refuses_bad_values(bad: list[str]) -> None:
    with pytest.raises(SystemExit):
        kdc.parse_args(bad)


def test_plan_for_rejects_zero_reps_and_keeps_the_quick_plan_fixed() -> None:
    with pytest.raises(ValueError):
        kdc.plan_for(True, 0)
    assert kdc.plan_for(True, None).reps == 3 and kdc.plan_for(True, 2).reps == 2
    # The plan is a fresh object each time (a --reps override never leaks into the next run).
    assert kdc.plan_for(True).reps == 3


def test_both_variants_set_the_switch_explicitly_on_both_legs() -> None:
    assert kdc.DIGEST_ENV == {"on": {"SGLANG_PDSAFE_KV_DIGEST": "1"},
                              "off": {"SGLANG_PDSAFE_KV_DIGEST": "0"}}
    assert not kdc.STACK.decode_faults and kdc.STACK.router  # no test-only fault, router
    assert kdc.STACK.context_length("prefill") == kdc.STACK.context_length("decode") == 4096


def test_burst_order_alternates_and_workloads_respect_the_limit() -> None:
    assert [kdc.burst_order(r) for r in range(4)] == [("on", "off"), ("off", "on")] * 2
    assert kdc.burst_order(-1) == ("off", "on")
    plan = kdc.plan_for(True)
    assert kdc.workloads_for(plan, 3584) == ["steady", "len-32", "len-256", "len-1024"]
    assert kdc.workloads_for(plan, 256) == ["steady", "len-32"]


# ----------------------------------------------------------------------------- ratios


def test_on_off_ratios_per_rep_spread_and_pooled() -> None:
    bursts = []
    for rep, (off_ttft, on_ttft) in enumerate(((1.0, 1.1), (1.0, 1.3), (1.0, 1.2))):
        bursts.append(Burst("off", rep, "steady", 4, 4, 1.0, 100, [off_ttft] * 4, [0.01] * 8))
        bursts.append(Burst("on", rep, "steady", 4, 4, 1.25, 100, [on_ttft] * 4, [0.02] * 8))
    s = summarize(bursts, ["steady"], num="on", den="off")["steady"]
    assert s["reps"] == 3 and set(s["absolute"]) == {"on", "off"}
    tp = s["ratios"]["throughput_tok_s"]
    assert tp["mean"] == pytest.approx(0.8) and tp["n"] == 3 and tp["stdev"] == pytest.approx(0)
    ttft = s["ratios"]["ttft_p50_s"]
    assert (ttft["min"], ttft["max"], ttft["mean"]) == (pytest.approx(1.1), pytest.approx(1.3),
                                                         pytest.approx(1.2))
    assert s["ratios"]["itl_p50_s"]["mean"] == pytest.approx(2.0)
    assert s["pooled"]["throughput_tok_s"] == pytest.approx(0.8)
    # A repetition with one side missing gives no ratio (never a ratio against nothing).
    partial = summarize(bursts[:-1], ["steady"], num="on", den="off")["steady"]
    assert partial["ratios"]["ttft_p50_s"]["n"] == 2
    cell = kdc.ratio_text(ttft, s["pooled"]["ttft_p50_s"])
    assert cell.startswith("1.200 [1.100, 1.300]; pooled ")
    assert kdc.ratio_text({"mean": None, "min": None, "max": None}, None) == "- [-, -]; pooled -"


# ----------------------------------------------------------------------------- digest verdict


def _moved(verified: float = 0, commits: float = 10, **fail: float) -> dict[str, float]:
    return {"verified": verified, "decode_commits": commits, "mismatch": 0, "missing": 0,
            "invalid": 0, "failed": 0, "prefill_sends": commits, **fail}


def test_judge_digest_on() -> None:
    assert kdc.judge_digest("on", _moved(verified=12), 10, [])["ok"]
    assert kdc.judge_digest("on", _moved(verified=10), 10, None)["ok"]  # logs not read
    short = kdc.judge_digest("on", _moved(verified=9), 10, [])
    assert not short["ok"] and "at least 10" in short["why"][0]
    assert not kdc.judge_digest("on", _moved(verified=0), 0, [])["ok"]  # nothing checked
    warned = kdc.judge_digest("on", _moved(verified=10), 10, ["decode"])
    assert not warned["ok"] and "OFF warning" in warned["why"][0]


def test_judge_digest_off() -> None:
    assert kdc.judge_digest("off", _moved(), 10, ["prefill", "decode"])["ok"]
    moved = kdc.judge_digest("off", _moved(verified=1), 10, ["prefill", "decode"])
    assert not moved["ok"] and "digest off" in moved["why"][0]
    idle = kdc.judge_digest("off", _moved(commits=0), 0, ["prefill", "decode"])
    assert not idle["ok"] and "no transfer" in idle["why"][0]
    one_leg = kdc.judge_digest("off", _moved(), 10, ["decode"])
    assert not one_leg["ok"] and "both legs" in one_leg["why"][0]
    with pytest.raises(ValueError):
        kdc.judge_digest("maybe", _moved(), 1)


@pytest.mark.parametrize("key", ["mismatch", "missing", "invalid", "failed", "prefill_failed"])
def test_any_digest_failure_counter_fails_either_variant(key: str) -> None:
    assert not kdc.judge_digest("on", _moved(verified=10, **{key: 1}), 10, [])["ok"]
    assert not kdc.judge_digest("off", _moved(**{key: 1}), 10, ["prefill", "decode"])["ok"]


def test_off_warning_legs_reads_the_logs(tmp_path: Path) -> None:
    (tmp_path / "p.log").write_text("x\nWARNING pdsafe protection 'kv-digest' is OFF (env)\n")
    (tmp_path / "d.log").write_text("protections active: kv-digest, room-guard\n")
    logs = {"prefill": str(tmp_path / "p.log"), "decode": str(tmp_path / "d.log"),
            "router": str(tmp_path / "p.log")}
    assert kdc.off_warning_legs(logs) == ["prefill"]
    assert kdc.off_warning_legs({"decode": str(tmp_path / "missing.log")}) == []


def test_delta_counts_new_keys_from_zero() -> None:
    assert kdc.delta({"a": 5.0, "b": 2.0}, {"a": 3.0}) == {"a": 2.0, "b": 2.0}


# ----------------------------------------------------------------------------- fake stacks


@dataclass
class Stack:
    """One fake PD stack: ``digest`` says whether decode counts verified transfers, ``wrong``
    makes every answer differ from the reference in its last token."""

    digest: bool
    wrong: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    commits: int = 0
    verified: int = 0
    requests: int = 0


def _handler(st: Stack, role: str) -> type[BaseHTTPRequestHandler]:
    class H(JsonHandler):
        def do_GET(self) -> None:
            if self.path.startswith("/server_info"):
                self._server_info(4096)
            elif self.path.startswith("/model_info"):
                self._json(200, {"max_prompt_tokens": 300})
            elif self.path.startswith("/metrics"):
                lines = ["# HELP x y"]
                if role == "decode":
                    lines.append('sglang:per_stage_req_latency_seconds_count'
                                 f'{{stage="decode_transferred"}} {st.commits}')
                    if st.digest:
                        lines.append(f"{kdc.VERIFIED} {st.verified}")
                else:
                    lines.append(f"sglang:kv_transfer_total_mb_count {st.commits}")
                self._text(200, "\n".join(lines) + "\n")
            else:
                self._json(200, {})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt, n = list(body["input_ids"]), int(body["sampling_params"]["max_new_tokens"])
            out = answer_of(prompt, n)
            if st.wrong:
                out[-1] = (out[-1] + 1) % 512
            with st.lock:
                st.requests += 1
                st.commits += 1
                st.verified += int(st.digest)
            if not body.get("stream"):
                self._json(200, {"output_ids": out, "meta_info": {"finish_reason": "length"}})
                return
            raw = "".join(f"data: {json.dumps({'output_ids': out[:i + 1]})}\n\n"
                          for i in range(len(out))) + "data: [DONE]\n\n"
            data = raw.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return H


class FakeStacks:
    def __init__(self, stacks: dict[str, Stack]) -> None:
        self.stacks = stacks
        self.http = FakeServers({(v, r): _handler(st, r) for v, st in stacks.items()
                                 for r in ("prefill", "decode", "router")})

    def url(self, v: str, role: str) -> str:
        return self.http.url((v, role))

    def targets(self) -> dict[str, PDTarget]:
        return {v: PDTarget("fork", "mooncake", 1, kdc.STACK.name, self.url(v, "prefill"),
                            self.url(v, "decode"), self.url(v, "router"), "127.0.0.1", 1, {},
                            CanaryBook(512)) for v in self.stacks}

    def close(self) -> None:
        self.http.close()


@pytest.fixture
def fake():
    made: list[FakeStacks] = []

    def make(on: Stack, off: Stack) -> FakeStacks:
        made.append(FakeStacks({"on": on, "off": off}))
        return made[-1]

    yield make
    for f in made:
        f.close()


PLAN = OverheadPlan(reps=2, requests=4, concurrency=2, max_new=4, sweep=(32, 1024),
                    sweep_requests=2, warmup=2)


def _measure(f: FakeStacks) -> dict[str, Any]:
    ref = Reference("http://unused")
    ref.expected = lambda prompt, n: answer_of(list(prompt), n)  # type: ignore[method-assign]
    knobs = Knobs.for_mode(True, bound_s=5.0, evidence_wait_s=0.0)
    return kdc.measure(f.targets(), ref, knobs, PLAN, read_logs=False)


def test_digest_counters_read_decode_and_prefill(fake) -> None:
    f = fake(Stack(digest=True), Stack(digest=False))
    f.stacks["on"].commits, f.stacks["on"].verified = 3, 2
    c = kdc.digest_counters(f.url("on", "decode"), f.url("on", "prefill"))
    assert c["verified"] == 2 and c["decode_commits"] == 3 and c["prefill_sends"] == 3
    assert c["mismatch"] == c["prefill_missing"] == 0
    assert kdc.digest_counters(f.url("off", "decode"))["verified"] == 0  # absent reads 0


def test_measure_interleaves_judges_everything_and_proves_the_switch(fake) -> None:
    f = fake(Stack(digest=True), Stack(digest=False))
    m = _measure(f)
    assert m["ok"], m["digest"]
    assert m["workloads"] == ["steady", "len-32"] and m["limit"] == 300  # 1024 >= limit
    per_variant = PLAN.warmup + PLAN.reps * (PLAN.requests + PLAN.sweep_requests)
    for v in ("on", "off"):
        assert m["content"][v]["sent"] == per_variant == f.stacks[v].requests
        assert m["content"][v]["identical"] == per_variant and not m["content_failures"][v]
    assert m["digest"]["on"]["moved"]["verified"] == per_variant
    assert m["digest"]["off"]["moved"]["verified"] == 0
    assert m["digest"]["off"]["moved"]["decode_commits"] == per_variant
    # Interleaved, order alternating per repetition; both variants got the same prompts.
    order = [(b["rep"], b["workload"], b["variant"]) for b in m["bursts"]]
    assert order[:4] == [(0, "steady", "on"), (0, "steady", "off"), (0, "len-32", "on"),
                         (0, "len-32", "off")]
    assert order[4:6] == [(1, "steady", "off"), (1, "steady", "on")]
    s = m["summary"]["steady"]
    assert s["reps"] == 2 and s["ratios"]["throughput_tok_s"]["n"] == 2


def test_a_wrong_answer_on_the_off_stack_fails_the_run(fake) -> None:
    f = fake(Stack(digest=True), Stack(digest=False, wrong=True))
    m = _measure(f)
    assert not m["ok"]
    assert m["content"]["off"]["leak"] == m["content"]["off"]["sent"] > 0
    assert m["content_failures"]["off"] and not m["content_failures"]["on"]


def test_a_stack_that_did_not_switch_fails_the_run(fake) -> None:
    f = fake(Stack(digest=True), Stack(digest=True))  # the "off" stack still verifies
    m = _measure(f)
    assert not m["ok"] and m["digest"]["on"]["ok"] and not m["digest"]["off"]["ok"]
    f2 = fake(Stack(digest=False), Stack(digest=False))  # the "on" stack never verifies
    m2 = _measure(f2)
    assert not m2["ok"] and not m2["digest"]["on"]["ok"]


# ----------------------------------------------------------------------------- report


def test_report_writer_and_exit_status(fake, tmp_path: Path) -> None:
    f = fake(Stack(digest=True), Stack(digest=False))
    m = _measure(f)
    report = {"created": "now", "command": "python -m benchmark.kv_digest_cost --quick",
              "version": "0.5.23+pdsafe.1", "backend": "mooncake", "page_size": 1,
              "stack": kdc.STACK.doc, "conditions": {"cpu_count": 2, "loadavg_start": [1, 1, 1]},
              "timing": {"total_s": 1.0}, "measurement": m, "ok": m["ok"]}
    pj, pm = kdc.write_report(report, tmp_path / "out")
    assert json.loads(pj.read_text())["measurement"]["digest"]["on"]["ok"]
    md = pm.read_text()
    assert "## Ratios on / off" in md and "| steady | 2 |" in md and "| len-32 | 2 |" in md
    assert "| on | " in md and "| off | " in md and "result: **ok**" in md
    assert "load average at start [1, 1, 1]" in md
    assert kdc.exit_status(report) == 0
    assert kdc.exit_status(report | {"ok": False}) == 1
    assert kdc.exit_status({"error": "StartupError: x", "ok": False}) == 2
    failed = {"created": "now", "error": "StartupError: boom", "timing": {}, "ok": False}
    _, pm2 = kdc.write_report(failed, tmp_path / "failed")
    assert "FAILED" in pm2.read_text() and "boom" in pm2.read_text()


def test_report_lists_content_failures(fake, tmp_path: Path) -> None:
    f = fake(Stack(digest=True), Stack(digest=False, wrong=True))
    m = _measure(f)
    report = {"created": "now", "timing": {}, "measurement": m, "ok": m["ok"]}
    _, pm = kdc.write_report(report, tmp_path)
    md = pm.read_text()
    assert "result: **FAILED**" in md and "- off: `oh-" in md and "leak" in md
    assert kdc.exit_status(report) == 1


def test_seeded_canary_prompts_are_the_same_for_both_variants() -> None:
    """Both contexts draw from RNGs with the same seed in the same order: the same prompts,
    so the on/off bursts do the same work (and the reference answers each prompt once)."""
    a, b = CanaryBook(512), CanaryBook(512)
    ra, rb = random.Random(7), random.Random(7)
    assert [a.prompt(ra, f"x{i}", 40) for i in range(5)] == [
        b.prompt(rb, f"x{i}", 40) for i in range(5)]
