"""Client bypasses closed (issue #3, item 6): the fake-transfer bootstrap host and the
health-check rid prefix are server-internal; a client request carrying them is refused with 400
on every generation endpoint (single and batch, streaming and not), while the server's own PD
warmup and /health_generate keep working.

Without the guard, a client's ``bootstrap_host: "2.2.2.2"`` sent to a decode server makes it
skip the KV transfer and decode over pages nobody wrote (HTTP 200 with garbage), and a
``HEALTH_CHECK`` rid turns off the KV checksum and metrics for that request.

The guard's logic alone (no servers): test/unit/test_client_guard_logic.py.
"""

from __future__ import annotations

import random
import uuid
from typing import Any

import pytest
import requests
from pdsafe_testkit.metrics import metric_total
from pdsafe_testkit.oracle import random_prompt
from pdsafe_testkit.servers import error_message, generate
from sglang.pdsafe.client_guard import FAKE_BOOTSTRAP_HOST as FAKE

pytestmark = pytest.mark.server

HOST_COUNTER = "sglang:pdsafe_rejected_spoofed_bootstrap_host_total"
RID_COUNTER = "sglang:pdsafe_rejected_spoofed_rid_total"
MAX_NEW = 4


def _requests(prompt: list[int], room: int, port: int, *, host: Any = None,
              rid: Any = None) -> list[tuple[str, dict]]:
    """The same spoofed request through /generate (single, batch), /v1/completions and
    /v1/chat/completions, streaming and not."""
    text = " ".join(f"w{i - 4}" for i in prompt)
    boot: dict[str, Any] = {"bootstrap_port": port, "bootstrap_room": room}
    if host is not None:
        boot["bootstrap_host"] = host
    extra: dict[str, Any] = {"rid": rid} if rid is not None else {}
    out: list[tuple[str, dict]] = []
    for stream in (False, True):
        out.append(("/generate", {"input_ids": prompt, "stream": stream, **boot, **extra,
                                  "sampling_params": {"max_new_tokens": MAX_NEW}}))
        out.append(("/v1/completions", {"model": "default", "prompt": text, "stream": stream,
                                        "max_tokens": MAX_NEW, **boot, **extra}))
        out.append(("/v1/chat/completions", {
            "model": "default", "stream": stream, "max_tokens": MAX_NEW, **boot, **extra,
            "messages": [{"role": "user", "content": text}]}))
    # Batch form: the marker in one element of the list is enough.
    b_boot = {"bootstrap_port": [port, port], "bootstrap_room": [room + 1, room + 2]}
    if host is not None:
        b_boot["bootstrap_host"] = ["127.0.0.1", host]
    b_extra = {"rid": [f"ok-{uuid.uuid4().hex}", rid]} if rid is not None else {}
    out.append(("/generate", {"input_ids": [prompt, prompt], **b_boot, **b_extra,
                              "sampling_params": {"max_new_tokens": MAX_NEW}}))
    return out


def _assert_all_refused(url: str, reqs: list[tuple[str, dict]], needle: str) -> int:
    for path, body in reqs:
        r = requests.post(url + path, json=body, timeout=60)
        try:
            parsed: Any = r.json()
        except ValueError:
            parsed = r.text
        assert r.status_code == 400, (
            f"{url}{path} (stream={body.get('stream')}) must refuse a client request "
            f"carrying {needle}: HTTP {r.status_code} {str(parsed)[:300]}")
        msg = error_message(parsed)
        assert needle in msg and "refused from clients" in msg, msg
    return len(reqs)


def test_spoofed_bootstrap_host_refused_on_both_pd_sides(pd_case, small_oracle, model_path):
    st = pd_case.stack
    rng = random.Random(21)
    prompt = random_prompt(rng, 40, model_path)
    n_refused = {}
    for side in ("decode", "prefill"):
        url = getattr(st, side).url
        before = metric_total(url, HOST_COUNTER)
        n = _assert_all_refused(url, _requests(prompt, rng.randrange(1 << 60),
                                               st.prefill.bootstrap_port, host=FAKE), repr(FAKE))
        n_refused[side] = n
        assert metric_total(url, HOST_COUNTER) - before == n
        # The server's own health check (which uses the fake host in PD mode) still works.
        assert requests.get(url + "/health_generate", timeout=60).status_code == 200
        assert requests.get(url + "/health", timeout=60).status_code == 200
    # The server's own PD warmup used the fake host over HTTP and was accepted.
    for side in ("prefill", "decode"):
        log = getattr(st, side).process.log_text()
        assert "End of disaggregation warmup" in log and "Disaggregation warmup failed" not in log
    # Normal traffic is unaffected and reference-identical.
    small_oracle.assert_identical(generate(st.router.url, prompt, 16), prompt, 16,
                                  what="after spoof attempts")


def test_spoofed_health_check_rid_refused(pd_case, small, small_oracle, model_path):
    st = pd_case.stack
    rng = random.Random(22)
    prompt = random_prompt(rng, 30, model_path)
    targets = [("co-located", small.url), ("decode", st.decode.url),
               ("prefill", st.prefill.url)]
    for what, url in targets:
        before = metric_total(url, RID_COUNTER)
        for rid in ("HEALTH_CHECK_0", f"x-HEALTH_CHECK-{uuid.uuid4().hex}"):
            n = _assert_all_refused(url, _requests(
                prompt, rng.randrange(1 << 60), st.prefill.bootstrap_port,
                host="127.0.0.1" if what != "co-located" else None, rid=rid), "HEALTH_CHECK")
            before += n
        assert metric_total(url, RID_COUNTER) == before, what
        assert requests.get(url + "/health_generate", timeout=60).status_code == 200, what
    # Through the router: it forwards the rid to both workers, which refuse it.
    r = requests.post(st.router.url + "/generate", json={
        "input_ids": prompt, "rid": "HEALTH_CHECK_router",
        "sampling_params": {"max_new_tokens": MAX_NEW}}, timeout=60)
    assert 400 <= r.status_code < 500 and "HEALTH_CHECK" in r.text, r.text[:300]
    small_oracle.assert_identical(generate(st.router.url, prompt, 16), prompt, 16,
                                  what="after rid spoof attempts")


MM_COUNTER = "sglang:pdsafe_rejected_client_mm_hashes_total"


def test_client_mm_hashes_refused_400(small, small_oracle, model_path):
    """A client-chosen prefix-cache key (``mm_hashes``, CVE-2026-111392) is refused with 400
    on /generate, single and batch, and counted; the same request without it is served, the
    reference's answer token for token."""
    prompt = random_prompt(random.Random("mm-hashes"), 24, model_path)
    key = "ab" * 32
    bodies = [
        {"input_ids": prompt, "mm_hashes": [key], "sampling_params": {"max_new_tokens": MAX_NEW}},
        {"input_ids": [prompt, prompt], "mm_hashes": [[key], [key]],
         "sampling_params": {"max_new_tokens": MAX_NEW}},
    ]
    before = metric_total(small.url, MM_COUNTER)
    for body in bodies:
        r = requests.post(small.url + "/generate", json=body, timeout=60)
        assert r.status_code == 400, f"HTTP {r.status_code}: {r.text[:300]}"
        msg = error_message(r.json())
        assert "mm_hashes is refused from clients" in msg, msg
    assert metric_total(small.url, MM_COUNTER) == before + len(bodies)
    small_oracle.assert_identical(generate(small.url, prompt, MAX_NEW), prompt, MAX_NEW,
                                  what="the same request without mm_hashes")
