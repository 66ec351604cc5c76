"""HTTP client of the benchmark: one /generate request with a hard bound, timed when streaming.

``send`` never raises for what a server does: a timeout becomes ``Answer(timed_out=True)``
(a hang), a refused or reset connection ``Answer(status=None, transport_error=...)``. Streaming
answers are reassembled (SGLang streams cumulative ``output_ids``); the arrival time of the first
chunk that carries tokens is the TTFT, and the gaps between token-carrying chunks, divided by the
number of tokens each added, are the inter-token latencies (ITL).

Invariant: a request is never retried; what the first attempt got is what is judged.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests

from benchmark import transport
from benchmark.outcomes import Answer
from benchmark.transport import error_message

CONNECT_TIMEOUT_S = 10.0


def greedy_payload(input_ids: Sequence[int], max_new_tokens: int, *, stream: bool = False,
                   n: int = 1, **extra: Any) -> dict[str, Any]:
    """A greedy /generate body by token ids (``ignore_eos``: fixed answer length). ``n`` > 1:
    parallel sampling (``sampling_params.n``); a server answers a list of ``n`` samples, which
    ``send`` keeps as ``Answer.samples``; greedy, every sample is the single greedy answer."""
    sp: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                          "ignore_eos": True}
    if n != 1:
        sp["n"] = n
    body: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": sp,
                            "stream": stream}
    body.update(extra)
    return body


def _abort_of(body: Any) -> tuple[bool, str]:
    """(is an in-band abort, its message) of a 200 body's ``meta_info.finish_reason``."""
    if not isinstance(body, dict):
        return False, ""
    fr = (body.get("meta_info") or {}).get("finish_reason")
    if isinstance(fr, dict) and fr.get("type") == "abort":
        return True, str(fr.get("message") or fr.get("status_code") or "")
    return False, ""


def _parse(status: int, body: Any) -> Answer:
    if status != 200:
        return Answer(status=status, message=error_message(body) if body not in (None, "") else "")
    if isinstance(body, list):
        # One entry per sample (n>1) or per prompt of a batch: each parsed on its own and
        # judged on its own (``outcomes.per_sample``).
        return Answer(status=200, samples=[_parse(200, b) for b in body])
    if not isinstance(body, dict):
        return Answer(status=200, message="", transport_error=f"non-JSON 200 body: {body!r:.200}")
    abort, msg = _abort_of(body)
    return Answer(status=200, output_ids=list(body.get("output_ids") or []), in_band_abort=abort,
                  message=msg, finish_reason=(body.get("meta_info") or {}).get("finish_reason"))


def parse_answer(status: int, body: Any) -> Answer:
    """A non-streaming /generate answer (HTTP status, parsed JSON body) as the ``Answer``
    ``send`` would make of it (in-band aborts included); for answers received elsewhere."""
    return _parse(status, body)


CHAT_PATH = "/v1/chat/completions"


def chat_payload(content: str, max_new_tokens: int, *, model: str,
                 **extra: Any) -> dict[str, Any]:
    """A greedy, non-streaming /v1/chat/completions body with one user message; the answer's
    token ids are asked for (``return_token_ids``) so it is judged token for token."""
    body: dict[str, Any] = {
        "model": model, "messages": [{"role": "user", "content": content}],
        "max_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True, "stream": False,
    }
    body.update(extra)
    return body


def _parse_chat(status: int, body: Any) -> Answer:
    """An OpenAI chat answer as an ``Answer``: ``output_ids`` are the first choice's
    ``response_token_ids``; a 200 whose choice finished with ``abort`` is an in-band abort."""
    if status != 200:
        return _parse(status, body)
    if not isinstance(body, dict) or not body.get("choices"):
        return Answer(status=200, transport_error=f"no choices in a chat 200 body: {body!r:.200}")
    choice = body["choices"][0]
    fr = choice.get("finish_reason")
    if fr == "abort":
        msg = str((choice.get("message") or {}).get("content") or choice.get("matched_stop")
                  or "abort")
        return Answer(status=200, in_band_abort=True, message=msg, finish_reason=fr)
    prompt = choice.get("prompt_token_ids")
    return Answer(status=200, output_ids=list(choice.get("response_token_ids") or []),
                  finish_reason=fr, prompt_ids=list(prompt) if isinstance(prompt, list) else None)


def send(url: str, payload: dict[str, Any], *, bound_s: float, path: str = "/generate") -> Answer:
    """POST ``payload`` to ``url + path``; at most ``bound_s`` seconds (a hang beyond).
    ``path`` ``CHAT_PATH``: an OpenAI chat request (non-streaming only)."""
    stream = bool(payload.get("stream"))
    parse = _parse_chat if path == CHAT_PATH else _parse
    if stream and path == CHAT_PATH:
        raise ValueError("streaming chat requests are not supported by the benchmark client")
    if stream and (payload.get("sampling_params") or {}).get("n", 1) != 1:
        raise ValueError("streamed parallel sampling (n>1) is not supported by the benchmark "
                         "client (its chunks interleave the samples)")
    t0 = time.monotonic()
    try:
        if not stream:
            r = transport.post(url + path, json=payload,
                               timeout=(CONNECT_TIMEOUT_S, bound_s))
            try:
                body: Any = r.json()
            except ValueError:
                body = r.text
            a = parse(r.status_code, body)
            a.e2e_s = time.monotonic() - t0
            return a
        return _send_stream(url + path, payload, t0, bound_s)
    except requests.Timeout:
        return Answer(status=None, timed_out=True, stream=stream, e2e_s=time.monotonic() - t0)
    except requests.RequestException as e:
        return Answer(status=None, transport_error=f"{type(e).__name__}: {str(e)[:200]}",
                      stream=stream, e2e_s=time.monotonic() - t0)


def _send_stream(url: str, payload: dict[str, Any], t0: float, bound_s: float) -> Answer:
    with transport.post(url, json=payload, timeout=(CONNECT_TIMEOUT_S, bound_s),
                       stream=True) as r:
        if r.status_code != 200:
            try:
                body: Any = r.json()
            except ValueError:
                body = r.text
            a = _parse(r.status_code, body)
            a.stream, a.e2e_s = True, time.monotonic() - t0
            return a
        last: Any = None
        n_prev = 0
        t_prev: float | None = None
        ttft: float | None = None
        itl: list[float] = []
        for line in r.iter_lines():
            now = time.monotonic()
            if now - t0 > bound_s:
                return Answer(status=None, timed_out=True, stream=True, e2e_s=now - t0)
            if not line or not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk or chunk.get("object") == "error":
                return Answer(status=200, in_band_abort=True, message=error_message(chunk),
                              stream=True, e2e_s=now - t0)
            n = len(chunk.get("output_ids") or [])
            if n > n_prev:
                if ttft is None:
                    ttft = now - t0
                elif t_prev is not None:
                    itl.extend([(now - t_prev) / (n - n_prev)] * (n - n_prev))
                t_prev, n_prev = now, n
            last = chunk
        a = _parse(200, last) if last is not None else Answer(status=200)
        a.stream, a.e2e_s, a.ttft_s, a.itl_s = True, time.monotonic() - t0, ttft, itl
        return a


def send_many(jobs: Sequence[tuple[str, dict[str, Any]]], *, bound_s: float,
              concurrency: int) -> list[Answer]:
    """Send ``(url, payload)`` jobs with ``concurrency`` in flight; answers in job order."""
    if not jobs:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(jobs)))) as ex:
        futs = [ex.submit(send, url, body, bound_s=bound_s) for url, body in jobs]
        return [f.result() for f in futs]


def direct_pd(prefill_url: str, decode_url: str, payload: dict[str, Any], *,
              bootstrap_host: str, bootstrap_port: int, room: int | None = None,
              bound_s: float, path: str = "/generate") -> tuple[Answer, Answer]:
    """Send one request to prefill and decode directly, in parallel (what the router does),
    both to ``path`` (``/generate`` or ``CHAT_PATH``).

    ``payload`` may already carry ``bootstrap_*`` fields (a client's own choice); otherwise
    the given host/port and ``room`` (random when None) are added."""
    body = dict(payload)
    body.setdefault("bootstrap_host", bootstrap_host)
    body.setdefault("bootstrap_port", bootstrap_port)
    body.setdefault("bootstrap_room", room if room is not None else random.randrange(1 << 62))
    out: dict[str, Answer] = {}

    def go(key: str, url: str) -> None:
        out[key] = send(url, body, bound_s=bound_s, path=path)

    ts = [threading.Thread(target=go, args=kv) for kv in (("p", prefill_url), ("d", decode_url))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out["p"], out["d"]
