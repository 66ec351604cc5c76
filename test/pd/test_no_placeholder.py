"""No placeholder handoff: a rejected request keeps a typed verdict and never reaches a KV
sender or receiver; the client is told, nothing is transferred, later requests are clean."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
from harness.oracle import random_prompt
from harness.servers import direct_pd_generate, generate

_UNIT = textwrap.dedent("""
    import json, os, sys
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.pdsafe import metrics, placeholder_guard
    out = {}
    for mode in ("prefill", "decode", "null"):
        get_context().set_server_args(
            ServerArgs(model_path=sys.argv[1], disaggregation_mode=mode, device="cpu"))
        with get_parallel().override(tp_rank=0):
            req = Req("r-" + mode, "", [5, 6, 7, 8, 9], SamplingParams(max_new_tokens=4))
            req.set_finish_with_abort("prompt too long for this test", 400)
        rej = getattr(req, "pdsafe_rejection", None)
        strict_raised = False
        os.environ["SGLANG_PDSAFE_STRICT"] = "1"
        try:
            placeholder_guard.transfer_endpoint_allowed(req, "test")
        except AssertionError:
            strict_raised = True
        os.environ["SGLANG_PDSAFE_STRICT"] = "0"
        out[mode] = {
            "prompt": list(req.origin_input_ids),
            "rejection": [rej.message, rej.status_code] if rej else None,
            "allowed": placeholder_guard.transfer_endpoint_allowed(req, "test"),
            "strict_raised": strict_raised,
        }
    out["blocked_count"] = metrics.value("placeholder_blocked_total")
    print("RESULT" + json.dumps(out))
""")


def test_rejection_is_typed_and_never_a_stub_prompt_in_pd_mode(model_path):
    """Real Req + real ServerArgs: in PD mode the verdict is typed and the prompt is kept;
    an aborted request at a KV endpoint is refused, counted, and fatal in strict mode."""
    env = dict(os.environ, SGLANG_PDSAFE_STRICT="0")
    r = subprocess.run([sys.executable, "-c", _UNIT, str(model_path)], capture_output=True,
                       text=True, timeout=300, env=env)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line, r.stdout[-2000:] + r.stderr[-3000:]
    out = json.loads(line[len("RESULT"):])
    for mode in ("prefill", "decode"):
        assert out[mode]["prompt"] == [5, 6, 7, 8, 9], f"{mode}: prompt rewritten to a stub"
        assert out[mode]["rejection"] == ["prompt too long for this test", 400]
    assert out["null"]["prompt"] == [0], "non-PD keeps upstream's cheap local abort"
    for mode in ("prefill", "decode", "null"):
        assert out[mode]["allowed"] is False and out[mode]["strict_raised"] is True
    assert out["blocked_count"] == 6


@pytest.mark.server
def test_intake_rejection_in_pd_tells_client_and_transfers_nothing(pd, oracle, model_path):
    """A request both legs reject at intake: explicit 400s, no tokens, no handoff, and the
    pages that follow are clean (the scheduler would have died in strict mode otherwise)."""
    rng = random.Random(5)
    prompt = random_prompt(rng, 60, model_path)
    pr, dr = direct_pd_generate(pd, prompt, 8, return_logprob=True, logprob_start_len=10_000,
                                timeout=60)
    for leg, r in (("prefill", pr), ("decode", dr)):
        assert r.status == 400, f"{leg}: HTTP {r.status} {r.body}"
        assert "logprob_start_len" in r.error_message, r.error_message
        assert r.output_ids == []
    for server in (pd.prefill, pd.decode):
        text = server.metrics()
        assert not any(ln.startswith("sglang:pdsafe_placeholder_blocked_total")
                       and not ln.rstrip().endswith(" 0.0") for ln in text.splitlines())
    for n in (40, 100):
        p = random_prompt(rng, n, model_path)
        oracle.assert_identical(generate(pd.router.url, p, 16), p, 16, what="after rejection")


_CALL_SITES = textwrap.dedent("""
    import json, os, sys
    from types import SimpleNamespace
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.pdsafe import metrics

    def aborted(mode):
        get_context().set_server_args(
            ServerArgs(model_path=sys.argv[1], disaggregation_mode=mode, device="cpu"))
        with get_parallel().override(tp_rank=0):
            req = Req("site-" + mode, "", list(range(5, 60)), SamplingParams(max_new_tokens=4))
            req.set_finish_with_abort("over capacity (test)", 400)
        return req

    def call(fn):
        try:
            return ["returned", fn()]
        except AssertionError as e:
            return ["assertion", str(e)[:300]]
        except Exception as e:  # the upstream body ran on into the bare test object
            return ["ran_on", type(e).__name__ + ": " + str(e)[:200]]

    out = {}
    retired = []
    # Bare objects: the upstream bodies fail on their first attribute access, so anything but
    # the guard's verdict means the call site went on towards creating a sender/receiver.
    prefill_q = SimpleNamespace(_check_if_req_exceed_kv_capacity=lambda req: False,
                                scheduler=SimpleNamespace(retire_unadmitted_request=retired.append))
    decode_q = SimpleNamespace()
    for strict in ("1", "0"):
        os.environ["SGLANG_PDSAFE_STRICT"] = strict
        out["prefill", strict] = call(lambda: PrefillBootstrapQueue.create_sender(
            prefill_q, aborted("prefill"), 2))
        out["decode", strict] = call(lambda: DecodePreallocQueue._create_receiver_and_enqueue(
            decode_q, aborted("decode")))
    out = {f"{k[0]}/{k[1]}": v for k, v in out.items()}
    out["retired"] = [r.rid for r in retired]
    out["blocked_count"] = metrics.value("placeholder_blocked_total")
    print("RESULT" + json.dumps(out))
""")


def test_aborted_request_never_reaches_sender_or_receiver_creation(model_path):
    """The real upstream call sites (``PrefillBootstrapQueue.create_sender``,
    ``DecodePreallocQueue._create_receiver_and_enqueue``) refuse an aborted request before
    they touch the KV backend: an AssertionError under SGLANG_PDSAFE_STRICT=1 (tests), else
    no sender/receiver (prefill retires the request through the unadmitted path and returns
    False; decode returns None and ``add`` retires it). Without the hook (patch 0007) both
    bodies run on towards a sender/receiver."""
    r = subprocess.run([sys.executable, "-c", _CALL_SITES, str(model_path)], capture_output=True,
                       text=True, timeout=300)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line, r.stdout[-2000:] + r.stderr[-3000:]
    out = json.loads(line[len("RESULT"):])
    for side, where in (("prefill", "prefill create_sender"),
                        ("decode", "decode create_receiver")):
        kind, detail = out[f"{side}/1"]
        assert kind == "assertion" and where in detail, f"{side} strict: {kind}: {detail}"
    assert out["prefill/0"] == ["returned", False], out["prefill/0"]
    assert out["decode/0"] == ["returned", None], out["decode/0"]  # caller retires it
    assert out["retired"] == ["site-prefill"], out["retired"]
    assert out["blocked_count"] == 4, out
