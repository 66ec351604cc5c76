"""Peer released at once (issue #3, item 3; metrics of item 8), on Mooncake and NIXL.

When one side of a PD pair refuses or aborts a request before its KV was sent, the other side
must hear it through the KV control channel and free what it reserved within about a second
(not at the 300 s SGLANG_DISAGGREGATION_WAITING_TIMEOUT / _BOOTSTRAP_TIMEOUT), and every client
gets an explicit error (never a hang, never a 200). Afterwards normal requests, which reuse the
released pages, still return the co-located reference's tokens.

Two real PD stacks per backend (module scope), each with the PD router in front:

* ``psmall``: prefill KV pool 320 tokens (context 320), decode 2048. Prompts the prefill must
  refuse and the decode accepts; decode's reserved pages are the thing that must come back.
* ``dsmall``: prefill 2048, decode pool 1024 (context 1024). Prompts only the decode refuses;
  the prefill's queued request/sender is the thing that must go.

Where a rejection is decided (explained because the HTTP layer is being tightened in parallel):

* ``len >= context`` is refused by the HTTP layer (TokenizerManager) before the scheduler: the
  ``on_http_undelivered`` path. ``max_req_input_len <= len < context`` reaches the scheduler
  door today (``is_unadmitted_reject``); once HTTP admission refuses over-``max_req_input_len``
  prompts, that case moves to the HTTP path too. Both must release the peer.
* To keep a test on the scheduler-door path regardless, direct requests send the two sides
  different payloads: the refusing side gets ``return_logprob`` with ``logprob_start_len`` past
  the prompt, which the scheduler (not the HTTP layer) refuses at intake and retires at the PD
  door; the other side gets the plain request.
* A client abort on the prefill (``/abort_request``) before decode published its metadata
  exercises ``CommonKVSender.abort()``.

"Reserved" is read from ``/v1/loads`` (decode: ``num_used_tokens`` excludes the evictable radix
cache, plus the prealloc/transfer queues; prefill: bootstrap/inflight queues, waiting requests,
``num_used_tokens``).

What tells a release by the peer protocol from any other way of letting go is not the time it
took but the counters and the reasons: the refusing side's ``peer_notified_release`` counter
moved for the case, and (direct requests) the peer's client error carries the refusing side's
reason. The release bound is only a wide backstop against a hang on a loaded 2-core machine
(``PDSAFE_PEER_RELEASE_BOUND_S``, default 10 s, target 1 s); upstream holds the pages for the
300 s timeout (direct) or until the router's dropped connection is noticed (seconds).

Prompt limits are read from each server (``/model_info``: ``max_prompt_tokens``, which on a
decode server includes its reserved decode tokens, patch 0013), never recomputed here.
"""

from __future__ import annotations

import os
import random
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from pdsafe_testkit.backends import ci_backends
from pdsafe_testkit.metrics import scrape, sum_samples
from pdsafe_testkit.oracle import random_prompt
from pdsafe_testkit.servers import (
    GenResult,
    PDStack,
    ServerConfig,
    SGLangServer,
    generate,
    launch_router,
    launch_server,
    skip_pair_check,
    wait_server,
)

server = pytest.mark.server

MAX_NEW = 16
#: A backstop, not the discriminator (see the module docstring): wide for a noisy machine.
RELEASE_BOUND_S = float(os.environ.get("PDSAFE_PEER_RELEASE_BOUND_S", "10"))
#: Counted by the refusing side each time it told its peer to release (sglang.pdsafe.metrics).
PEER_TOLD = "sglang:pdsafe_peer_notified_release_total"
#: How long a client of the *other* side may wait for its explicit error. Upstream makes it
#: wait for the 300 s timeout; anything near that is a hang.
CLIENT_BOUND_S = float(os.environ.get("PDSAFE_PEER_CLIENT_BOUND_S", "15"))
#: Through the router: a peer that neither received the request nor held anything this long
#: past the release bound never got it (the router cancelled its leg); such a case is sent
#: again, up to ROUTER_ATTEMPTS times.
UNDELIVERED_AFTER_S = 5.0
ROUTER_ATTEMPTS = 5
HTTP_TIMEOUT_S = CLIENT_BOUND_S + 5

PSMALL = {"prefill": (320, 320), "decode": (2048, 2048)}  # (pool tokens, context length)
DSMALL = {"prefill": (2048, 2048), "decode": (1024, 1024)}


# --------------------------------------------------------------------------- fixtures


@dataclass
class Stacks:
    backend: str
    psmall: PDStack
    dsmall: PDStack


def _cfg(role: str, shape: dict[str, tuple[int, int]], model_path: Path) -> ServerConfig:
    pool, ctx = shape[role]
    # The legs' limits differ on purpose (context length included): peer release is the
    # defence under test, so decode opts out of that one pair-agreement field.
    env = skip_pair_check("context_length") if role == "decode" else {}
    return ServerConfig(role=role, model_path=model_path, max_total_tokens=pool,
                        context_length=ctx, env=env)


#: Mooncake in CI; ``PDSAFE_FULL_BACKENDS=all`` adds NIXL here. NIXL's peer-release path runs in
#: CI at the transport level (``test/kv/test_kv_transfer.py``: real NIXL managers, senders and
#: receivers, every abort and refusal point), where it is a few seconds instead of minutes.
@pytest.fixture(scope="module", params=ci_backends())
def stacks(request: pytest.FixtureRequest, log_dir: Path, model_path: Path,
           oracle) -> Iterator[Stacks]:
    """Both PD pairs of one backend, started together (4 servers, then 2 routers).

    Depends on ``oracle`` only so that the co-located reference starts first, alone."""
    backend = request.param
    with ExitStack() as es:
        servers: dict[str, SGLangServer] = {}
        for name, shape in (("psmall", PSMALL), ("dsmall", DSMALL)):
            for role in ("prefill", "decode"):
                cfg = _cfg(role, shape, model_path)
                cfg.backend = backend
                s = launch_server(cfg, log_dir, wait=False)
                es.callback(s.stop)
                servers[f"{name}-{role}"] = s
        for s in servers.values():
            wait_server(s)
        built = {}
        for name in ("psmall", "dsmall"):
            p, d = servers[f"{name}-prefill"], servers[f"{name}-decode"]
            router = launch_router(p, d, log_dir)
            es.callback(router.stop)
            built[name] = PDStack(backend, p, d, router)
        yield Stacks(backend, built["psmall"], built["dsmall"])


# --------------------------------------------------------------------------- observables


def _load(server: SGLangServer) -> dict[str, Any]:
    body = requests.get(server.url + "/v1/loads", timeout=10).json()
    loads = body["loads"] if isinstance(body, dict) else body
    return loads[0]


def reserved(server: SGLangServer) -> dict[str, int]:
    """What this server holds for requests: used KV tokens and the PD queues."""
    ld = _load(server)
    dis = ld.get("disaggregation") or {}
    out = {"num_used_tokens": int(ld["num_used_tokens"])}
    if server.config.role == "decode":
        out["prealloc"] = int(dis.get("decode_prealloc_queue_reqs", 0))
        out["transfer"] = int(dis.get("decode_transfer_queue_reqs", 0))
    else:
        out["bootstrap"] = int(dis.get("prefill_bootstrap_queue_reqs", 0))
        out["inflight"] = int(dis.get("prefill_inflight_queue_reqs", 0))
        out["waiting"] = int(ld.get("num_waiting_reqs", 0))
    return out


#: Counters that move when a server is done with a request. ``num_requests_total`` is counted
#: by the HTTP layer when it delivers the outcome, so it misses a request whose client (the
#: router, after the other leg's 4xx) disconnected first; the scheduler's failed-transfer and
#: failed-bootstrap counters and the tokenizer's aborted-request counter (client gone) still
#: record that the peer was done with it.
_DONE_COUNTERS = ("sglang:num_requests_total", "sglang:num_transfer_failed_reqs_total",
                  "sglang:num_bootstrap_failed_reqs_total", "sglang:num_aborted_requests_total")
#: Counted by the HTTP middleware when a request arrives (before any handler runs).
_RECEIVED = "sglang:http_requests_total"


@dataclass(frozen=True)
class Progress:
    """What a server has seen of requests so far; only increases between two snapshots count,
    so a request counted by two ``_DONE_COUNTERS`` does no harm."""

    done: float  #: requests it is done with, any outcome
    received: float  #: /generate requests its HTTP layer accepted


def progress(server: SGLangServer) -> Progress:
    samples = scrape(server.url)
    return Progress(sum_samples(samples, _DONE_COUNTERS),
                    sum_samples(samples, _RECEIVED, endpoint="/generate"))


def wait_released(server: SGLangServer, baseline: dict[str, int], since: float,
                  before: Progress, bound: float = RELEASE_BOUND_S,
                  what: str = "", router_may_drop: bool = False) -> float | None:
    """Poll until ``server`` is done with the peer request (its done count passed
    ``before.done``) and holds no more than ``baseline``; return seconds since ``since``.

    The done count matters: the refusing side can answer before the peer has even reserved
    anything, and "at baseline" alone would then pass without any release.

    ``router_may_drop``: through the router, the peer's leg can be cancelled by the router
    (after the other leg's 4xx) before it reaches the peer at all. Then there is nothing to
    release, and None is returned, but only if for ``UNDELIVERED_AFTER_S`` past the bound the
    peer held nothing and its HTTP layer received no other /generate request (the caller then
    sends the case again: see check_router_refusals)."""
    last: dict[str, int] = {}
    at_baseline_throughout = True
    deadline = since + max(bound, 0.0) + 30.0  # keep observing past the bound, for the report
    undelivered_at = since + max(bound, 0.0) + UNDELIVERED_AFTER_S
    now = before
    while time.monotonic() < deadline:
        last = reserved(server)
        at_baseline = all(last[k] <= baseline.get(k, 0) for k in last)
        # Only then read the counters: polling costs the watched server's HTTP front end (and
        # the bootstrap server in its process) CPU on a 2-core machine.
        if at_baseline:
            now = progress(server)
        at_baseline_throughout &= at_baseline
        if at_baseline and now.done > before.done:
            elapsed = time.monotonic() - since
            assert elapsed <= bound, (
                f"{what}: the peer ({server.config.role}) released its reservation only after "
                f"{elapsed:.2f}s (bound {bound}s, target 1s); it was not told promptly")
            return elapsed
        if (router_may_drop and at_baseline_throughout and now.received == before.received
                and time.monotonic() > undelivered_at):
            print(f"{what}: the router never delivered the request to the "
                  f"{server.config.role} (its /generate count stayed {now.received:.0f}); "
                  "nothing was reserved there")
            return None
        time.sleep(0.05)
    raise AssertionError(
        f"{what}: the peer ({server.config.role}) still holds {last} (baseline {baseline}) "
        f"or is not done with the request ({now} vs before {before}) "
        f"{time.monotonic() - since:.1f}s after the rejection: it was never told "
        "(upstream waits for SGLANG_DISAGGREGATION_WAITING_TIMEOUT/_BOOTSTRAP_TIMEOUT, 300 s)")


def _released_line(what: str, role: str, released: float | None, after: str) -> str:
    if released is None:
        return f"{what}: {role} never received it"
    return f"{what}: {role} released {released:.3f}s after {after}"


def assert_idle(server: SGLangServer) -> dict[str, int]:
    """The server holds nothing right now (allowing a moment for a previous test to settle)."""
    deadline = time.monotonic() + 10
    while True:
        r = reserved(server)
        if not any(r.values()) or time.monotonic() > deadline:
            assert not any(r.values()), f"{server.config.role} not idle before the test: {r}"
            return r
        time.sleep(0.1)


def peer_told_after(server: SGLangServer, floor: float, what: str,
                    timeout: float = RELEASE_BOUND_S) -> float:
    """``server``'s ``PEER_TOLD`` counter once it is above ``floor`` (the refusing side counts
    right after it sent the notice, so allow it a moment after the peer released)."""
    deadline = time.monotonic() + timeout
    while True:
        told = server.metric(PEER_TOLD)
        if told > floor:
            return told
        assert time.monotonic() < deadline, (
            f"{what}: the {server.config.role} never told its peer ({PEER_TOLD} stayed at "
            f"{told:.0f}): whatever freed the peer, it was not the peer-release protocol")
        time.sleep(0.1)


def first_refused_len(server: SGLangServer) -> int:
    """The shortest prompt ``server`` refuses, as it advertises it (/model_info
    ``max_prompt_tokens`` + 1); on a decode server this includes the reserved decode tokens."""
    return server.limits().max_prompt_tokens + 1


def assert_peer_accepts(peer: SGLangServer, n: int, what: str) -> None:
    """Precondition: only the refusing side refuses a prompt of ``n`` tokens."""
    accepts = peer.limits().max_prompt_tokens
    assert n <= accepts, (f"{what}: the peer ({peer.config.role}) would refuse {n} tokens "
                          f"too (it accepts at most {accepts}); the case tests nothing")


def _stream_abort_message(r: GenResult) -> str:
    """The message of a stream that ended in an abort with no tokens ("" otherwise)."""
    if r.status != 200 or r.output_ids or not isinstance(r.body, dict):
        return ""
    reason = (r.body.get("meta_info") or {}).get("finish_reason") or {}
    return str(reason.get("message") or "") if reason.get("type") == "abort" else ""


def assert_explicit_error(r: GenResult | BaseException, what: str,
                          statuses: tuple[int, ...] = (400, 500, 503),
                          stream: bool = False) -> str:
    """``r`` is an explicit error: an error status with a message and no tokens, or (streaming,
    once the 200 header is out) a stream that ends in an abort with a message and no tokens."""
    if isinstance(r, BaseException):
        raise AssertionError(f"{what}: no answer ({type(r).__name__}: {r}); the client hung "
                             "instead of getting an explicit error") from r
    if stream and _stream_abort_message(r):
        return _stream_abort_message(r)
    assert r.status in statuses and r.error_message and not r.output_ids, (
        f"{what}: expected an explicit error ({statuses}), got HTTP {r.status}: "
        f"{str(r.body)[:300]}")
    return r.error_message


# --------------------------------------------------------------------------- clients


def _boot(stack: PDStack, room: int) -> dict[str, Any]:
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": stack.prefill.bootstrap_port,
            "bootstrap_room": room}


def _timed(url: str, ids: list[int], **extra: Any) -> tuple[GenResult | BaseException, float]:
    try:
        r: GenResult | BaseException = generate(url, ids, MAX_NEW, timeout=HTTP_TIMEOUT_S,
                                                **extra)
    except requests.RequestException as e:
        r = e
    return r, time.monotonic()  # monotonic time the answer arrived


def split_pd(stack: PDStack, prefill: tuple[list[int], dict[str, Any]],
             decode: tuple[list[int], dict[str, Any]], *, room: int | None = None,
             watch: SGLangServer, baseline: dict[str, int], refusing: str, what: str,
             ) -> tuple[GenResult | BaseException, GenResult | BaseException, float]:
    """Send prefill and decode their (possibly different) requests for one room, in parallel.

    ``refusing`` names the side expected to refuse: once its answer arrives, ``watch`` (the
    other side) must be back to ``baseline`` within the bound. Returns both answers and the
    release time.
    """
    room = room if room is not None else random.randrange(1 << 62)
    out: dict[str, tuple[GenResult | BaseException, float]] = {}
    fin0 = progress(watch)

    def go(side: str, url: str, ids: list[int], extra: dict[str, Any]) -> None:
        out[side] = _timed(url, ids, **_boot(stack, room), **extra)

    ts = [threading.Thread(target=go, args=("prefill", stack.prefill.url, *prefill)),
          threading.Thread(target=go, args=("decode", stack.decode.url, *decode))]
    for t in ts:
        t.start()
    deadline = time.monotonic() + HTTP_TIMEOUT_S
    while refusing not in out and time.monotonic() < deadline:
        time.sleep(0.01)
    assert refusing in out, f"{what}: the refusing side ({refusing}) never answered"
    released = wait_released(watch, baseline, out[refusing][1], fin0, what=what)
    for t in ts:
        t.join()
    return out["prefill"][0], out["decode"][0], released


def _sides(stack: PDStack, refusing: str) -> tuple[SGLangServer, SGLangServer]:
    """(the refusing server, its peer)."""
    if refusing == "prefill":
        return stack.prefill, stack.decode
    return stack.decode, stack.prefill


def check_router_refusals(st: PDStack, refusing: str, cases: list[tuple[int, bool]],
                          model_path: Path, seed: int) -> None:
    """Prompts of ``cases`` (length, stream) that only ``refusing`` refuses, through the router:
    the client gets a 400 naming the length, and the peer frees what it reserved within the
    bound. Streaming: the router forwards decode's stream (200 already sent) even though the
    prefill refused; decode must then end it at once with an abort naming the cause."""
    refuser, peer = _sides(st, refusing)
    base = assert_idle(peer)
    rng = random.Random(seed)
    for n, stream in cases:
        assert_peer_accepts(peer, n, f"{st.backend} {refusing} refuses {n} tokens via router")
        told = refuser.metric(PEER_TOLD)
        # The router sometimes cancels the peer's leg before sending it (once the refusing
        # leg's 400 is back): then nothing was reserved or tested there, so send it again.
        for attempt in range(1, ROUTER_ATTEMPTS + 1):
            ids = random_prompt(rng, n, model_path)
            what = (f"{st.backend} {refusing} refuses {n} tokens via router (stream={stream}, "
                    f"attempt {attempt})")
            fin0 = progress(peer)
            r, t_answer = _timed(st.router.url, ids, stream=stream)
            message = assert_explicit_error(r, what, statuses=(400,), stream=stream)
            assert str(n) in message, f"{what}: the message should name the length: {r.body}"
            released = wait_released(peer, base, t_answer, fin0, what=what,
                                     router_may_drop=True)
            print(_released_line(what, peer.config.role, released, "the client's 400"))
            if released is not None:
                break
        else:
            raise AssertionError(f"{what}: the router never delivered the request to the "
                                 f"{peer.config.role} in {ROUTER_ATTEMPTS} attempts")
        # The refusing side told the peer (once the peer's metadata arrived): the release was
        # the protocol's, not the router's dropped connection or a timeout.
        peer_told_after(refuser, told, what)


def check_direct_refusals(st: PDStack, refusing: str, over_capacity: int, model_path: Path,
                          seed: int) -> None:
    """The same prompt sent directly to both sides, one room, which only ``refusing`` refuses
    (over its capacity, or at its scheduler door for a logprob_start_len past the prompt).
    The refusing client gets a 400; the peer's client gets a 400 too, with the
    refusing side's reason, at once instead of after a 300 s hang; the peer frees its
    reservation within the bound."""
    refuser, peer = _sides(st, refusing)
    base = assert_idle(peer)
    rng = random.Random(seed)
    cases = [
        ("over capacity (same prompt to both)", random_prompt(rng, over_capacity, model_path),
         {}),
        (f"scheduler-door refusal ({refusing} gets logprob_start_len past the prompt)",
         random_prompt(rng, 64, model_path), DOOR_REJECT),
    ]
    for label, ids, extra in cases:
        what = f"{st.backend} {refusing} refuses, direct: {label}"
        assert_peer_accepts(peer, len(ids), what)
        reqs = {"prefill": (ids, {}), "decode": (ids, {})}
        reqs[refusing] = (ids, extra)
        told = refuser.metric(PEER_TOLD)
        p, d, released = split_pd(st, reqs["prefill"], reqs["decode"], watch=peer,
                                  baseline=base, refusing=refusing, what=what)
        answers = {"prefill": p, "decode": d}
        rmsg = assert_explicit_error(answers[refusing], f"{what} ({refusing} client)",
                                     statuses=(400,))
        role = peer.config.role
        # The peer's client gets the refusing side's 400 too (patch 0017), not a 500 for a
        # "failed transfer": the request, not the server, was at fault.
        pmsg = assert_explicit_error(answers[role], f"{what} ({role} client)", statuses=(400,))
        # The peer's client learns the cause, on every backend (NIXL's own ABORT handler used
        # to overwrite it with a generic "Aborted by decode-side abort notification.").
        assert refusing in pmsg and rmsg[:60] in pmsg, (
            f"{what}: the {role} client's error does not carry the {refusing}'s reason "
            f"({rmsg[:60]!r}): {pmsg[:300]!r}")
        peer_told_after(refuser, told, what)
        print(f"{what}: {role} released {released:.3f}s after {refusing}'s refusal")


def check_normal_traffic(stack: PDStack, oracle, model_path: Path, seed: int,
                         max_len: int) -> None:
    """Requests that reuse the released pages still match the co-located reference."""
    rng = random.Random(seed)
    prompts = [random_prompt(rng, rng.randint(17, max_len), model_path) for _ in range(4)]
    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(lambda p: generate(stack.router.url, p, MAX_NEW, timeout=120),
                              prompts))
    for i, (p, r) in enumerate(zip(prompts, results, strict=True)):
        oracle.assert_identical(r, p, MAX_NEW, what=f"{stack.backend} after release, #{i}")
    p = prompts[0]
    room = random.randrange(1 << 62)
    res: dict[str, GenResult] = {}
    ts = [threading.Thread(target=lambda k=k, u=u: res.__setitem__(
        k, generate(u, p, MAX_NEW, timeout=120, **_boot(stack, room))))
        for k, u in (("p", stack.prefill.url), ("d", stack.decode.url))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    oracle.assert_identical(res["d"], p, MAX_NEW, what=f"{stack.backend} direct after release")


#: Refused by the scheduler at intake (not by the HTTP layer), then retired at the PD door.
DOOR_REJECT = {"return_logprob": True, "logprob_start_len": 1_000_000}


# --------------------------------------------------------------------------- prefill refuses


@server
def test_prefill_refusal_through_router_frees_decode(stacks, model_path):
    """Prompts only the prefill refuses: the client gets a 4xx at once, decode frees its pages.
    At the limit (the shortest prompt the prefill refuses; scheduler door before 0010, HTTP
    layer now), at 400 >= context 320 (HTTP layer), and streaming."""
    limit = first_refused_len(stacks.psmall.prefill)
    check_router_refusals(stacks.psmall, "prefill",
                          [(limit, False), (400, False), (limit + 1, True)], model_path, seed=11)


@server
def test_prefill_refusal_direct_frees_decode(stacks, model_path):
    """Direct to both sides: the decode client gets an explicit error, not a 300 s hang."""
    check_direct_refusals(stacks.psmall, "prefill", 400, model_path, seed=12)


@server
def test_prefill_client_abort_before_decode_metadata(stacks, model_path):
    """A prefill request aborted while it waits for decode's metadata: when decode then
    reserves pages and publishes metadata, prefill answers Failed and decode frees them."""
    st = stacks.psmall
    base = assert_idle(st.decode)
    told = st.prefill.metric(PEER_TOLD)
    ids = random_prompt(random.Random(13), 100, model_path)
    room, rid = random.randrange(1 << 62), f"peer-release-abort-{uuid.uuid4().hex}"
    holder: dict[str, Any] = {}
    t = threading.Thread(target=lambda: holder.__setitem__(
        "p", _timed(st.prefill.url, ids, rid=rid, **_boot(st, room))))
    t.start()
    deadline = time.monotonic() + 20
    while reserved(st.prefill)["bootstrap"] == 0:  # waiting for decode's metadata
        assert time.monotonic() < deadline, "prefill request never queued for bootstrap"
        time.sleep(0.05)
    requests.post(st.prefill.url + "/abort_request", json={"rid": rid}, timeout=10)
    t.join(HTTP_TIMEOUT_S)
    assert_explicit_error(holder["p"][0], f"{st.backend} aborted prefill request",
                          statuses=(400, 500, 503, 499))
    what = f"{st.backend} decode request for a room prefill aborted"
    fin0 = progress(st.decode)
    r, t_answer = _timed(st.decode.url, ids, **_boot(st, room))
    dmsg = assert_explicit_error(r, what)
    # The decode client learns that the prefill gave the room up (not a timeout of its own).
    assert "prefill" in dmsg, f"{what}: the error does not name the prefill's abort: {dmsg}"
    released = wait_released(st.decode, base, t_answer, fin0, what=what)
    peer_told_after(st.prefill, told, what)
    print(f"{what}: answered with an error, decode released {released:.3f}s later")


@server
def test_normal_traffic_after_prefill_refusals(stacks, oracle, model_path):
    check_normal_traffic(stacks.psmall, oracle, model_path, seed=14, max_len=250)


# --------------------------------------------------------------------------- decode refuses


@server
def test_decode_refusal_through_router_frees_prefill(stacks, model_path):
    """Prompts only the decode refuses: the client gets a 4xx, the prefill drops its request.
    At the limit (the shortest prompt the decode refuses: its pool less the reserved decode
    tokens, patch 0013) and at 1100 >= context 1024."""
    limit = first_refused_len(stacks.dsmall.decode)
    check_router_refusals(stacks.dsmall, "decode", [(limit, False), (1100, False)], model_path,
                          seed=21)


@server
def test_decode_refusal_direct_frees_prefill(stacks, model_path):
    """Direct to both sides: the prefill client gets an explicit error at once."""
    check_direct_refusals(stacks.dsmall, "decode", 1100, model_path, seed=22)


@server
def test_normal_traffic_after_decode_refusals(stacks, oracle, model_path):
    check_normal_traffic(stacks.dsmall, oracle, model_path, seed=23, max_len=250)
