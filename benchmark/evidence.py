"""Server-side evidence: did the KV really travel, and what stays reserved after a scenario.

Proof of transfer (both upstream metrics, present in stock 0.5.23 and in the fork; the
servers run with ``--enable-metrics``):

* decode: ``sglang:per_stage_req_latency_seconds_count{stage="decode_transferred"}``, observed
  once per request whose transfer decode committed (``ReqTimeStats.set_wait_queue_entry_time``
  in decode mode). A *fake* transfer (bootstrap host 2.2.2.2) is committed too, so this alone
  proves nothing;
* prefill: ``sglang:kv_transfer_total_mb_count`` / ``_sum``, observed once per request whose
  KV prefill finished sending (``prefill.py``, skipped for the fake host and aborted requests),
  with the bytes sent.

A phase of a scenario proves ``min(delta decode commits, delta prefill sends)`` transfers; its
identical answers beyond that number are ``unproven`` (``outcomes.apply_evidence``). On a shared
deployment other traffic also moves these counters, so deployment mode can only under-report
``unproven``.

Reserved pages after a scenario (``Reservations``): the live load snapshot each scheduler
publishes at ``/v1/loads`` (``num_used_tokens``: KV slots held by requests, not counting the
evictable radix cache; the PD queue lengths: prefill bootstrap/inflight, decode prealloc/
transfer/retracted) plus ``sglang:num_decode_deferred_kv_release_reqs`` from ``/metrics`` (pages
upstream holds after a failed transfer until the prefill side acknowledges, or its timeout: the
closest thing to "quarantined" upstream has). Read after a settle period: the snapshot is
republished when the scheduler idles.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import requests

from benchmark import transport
from benchmark.transport import Sample, scrape, sum_samples

DECODE_COMMITS = "sglang:per_stage_req_latency_seconds_count"
PREFILL_SENDS = "sglang:kv_transfer_total_mb_count"
PREFILL_MB = "sglang:kv_transfer_total_mb_sum"
TRANSFER_FAILED = "sglang:num_transfer_failed_reqs_total"
BOOTSTRAP_FAILED = "sglang:num_bootstrap_failed_reqs_total"
DEFERRED = "sglang:num_decode_deferred_kv_release_reqs"
PDSAFE_PREFIX = "sglang:pdsafe_"


@dataclass(frozen=True)
class Counters:
    """A snapshot of the transfer counters of one PD pair."""

    decode_commits: float = 0.0
    prefill_sends: float = 0.0
    prefill_mb: float = 0.0
    transfer_failed: float = 0.0
    bootstrap_failed: float = 0.0
    pdsafe: tuple[tuple[str, float], ...] = ()
    #: False when a server's /metrics could not be read (a dead server): nothing is proven.
    complete: bool = True

    def minus(self, before: Counters) -> Counters:
        prev = dict(before.pdsafe)
        return Counters(
            self.decode_commits - before.decode_commits,
            self.prefill_sends - before.prefill_sends,
            self.prefill_mb - before.prefill_mb,
            self.transfer_failed - before.transfer_failed,
            self.bootstrap_failed - before.bootstrap_failed,
            tuple((k, v - prev.get(k, 0.0)) for k, v in self.pdsafe if v - prev.get(k, 0.0)),
            self.complete and before.complete,
        )

    @property
    def proven(self) -> int:
        """Transfers both sides counted (the proof ``apply_evidence`` uses); 0 when either
        snapshot is incomplete (a restarted server's counters start again from zero)."""
        if not self.complete:
            return 0
        return max(0, int(min(self.decode_commits, self.prefill_sends)))

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["pdsafe"] = dict(self.pdsafe)
        d["proven"] = self.proven
        return d


def counters_from(prefill: list[Sample], decode: list[Sample]) -> Counters:
    """The counters of a pair from its two scrapes (pure; unit-tested)."""
    pdsafe: dict[str, float] = {}
    for s in prefill + decode:
        if s.name.startswith(PDSAFE_PREFIX) and s.name.endswith("_total"):
            pdsafe[s.name] = pdsafe.get(s.name, 0.0) + s.value
    return Counters(
        decode_commits=sum_samples(decode, DECODE_COMMITS, stage="decode_transferred"),
        prefill_sends=sum_samples(prefill, PREFILL_SENDS),
        prefill_mb=sum_samples(prefill, PREFILL_MB),
        transfer_failed=sum_samples(prefill, TRANSFER_FAILED) + sum_samples(decode,
                                                                           TRANSFER_FAILED),
        bootstrap_failed=sum_samples(prefill, BOOTSTRAP_FAILED) + sum_samples(decode,
                                                                             BOOTSTRAP_FAILED),
        pdsafe=tuple(sorted(pdsafe.items())),
    )


def _urls(url: str | Sequence[str]) -> list[str]:
    return [url] if isinstance(url, str) else list(url)


def read_counters(prefill_url: str | Sequence[str],
                  decode_url: str | Sequence[str]) -> Counters:
    """Scrape the servers' /metrics (one prefill and one decode, or every instance behind a
    router: each side's counters are summed); ``complete`` is False if any could not be read."""
    ok = True
    p: list[Sample] = []
    d: list[Sample] = []
    for urls, into in ((_urls(prefill_url), p), (_urls(decode_url), d)):
        for url in urls:
            try:
                into += scrape(url, timeout=10)
            except requests.RequestException:
                ok = False
    c = counters_from(p, d)
    return c if ok else replace(c, complete=False)


@dataclass
class Reservations:
    """What one PD pair still holds after a scenario (see the module docstring)."""

    decode_used_tokens: int | None = None
    decode_pages: int | None = None
    decode_prealloc_queue: int | None = None
    decode_transfer_queue: int | None = None
    decode_retracted_queue: int | None = None
    decode_deferred_release: int | None = None
    prefill_used_tokens: int | None = None
    prefill_pages: int | None = None
    prefill_bootstrap_queue: int | None = None
    prefill_inflight_queue: int | None = None
    settled_after_s: float | None = None
    settled: bool = False
    source: str = "/v1/loads (num_used_tokens, disaggregation queues) + /metrics " + DEFERRED
    error: str = ""

    @property
    def pages_reserved(self) -> int | None:
        """Pages held on either side plus requests parked in a PD queue or deferred release."""
        vals = [self.decode_pages, self.prefill_pages]
        if any(v is None for v in vals):
            return None
        return int(sum(v for v in vals if v is not None))

    @property
    def requests_parked(self) -> int:
        return int(sum(v or 0 for v in (
            self.decode_prealloc_queue, self.decode_transfer_queue, self.decode_retracted_queue,
            self.decode_deferred_release, self.prefill_bootstrap_queue,
            self.prefill_inflight_queue)))

    @property
    def clean(self) -> bool:
        return self.pages_reserved == 0 and self.requests_parked == 0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["pages_reserved"] = self.pages_reserved
        d["requests_parked"] = self.requests_parked
        return d


def _load(url: str) -> dict[str, Any]:
    body = transport.get(url + "/v1/loads", timeout=15).json()
    loads = body.get("loads") if isinstance(body, dict) else None
    if not loads:
        raise ValueError(f"{url}/v1/loads has no loads: {str(body)[:200]}")
    # One scheduler per server here (tp=dp=1); sum over ranks otherwise.
    out: dict[str, float] = {}
    for ld in loads:
        out["used"] = out.get("used", 0) + float(ld.get("num_used_tokens") or 0)
        dis = ld.get("disaggregation") or {}
        for k in ("prefill_bootstrap_queue_reqs", "prefill_inflight_queue_reqs",
                  "decode_prealloc_queue_reqs", "decode_transfer_queue_reqs",
                  "decode_retracted_queue_reqs"):
            out[k] = out.get(k, 0) + float(dis.get(k) or 0)
    return out


def _sum_loads(urls: Sequence[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for url in urls:
        for k, v in _load(url).items():
            out[k] = out.get(k, 0) + v
    return out


def reservations_once(prefill_url: str | Sequence[str], decode_url: str | Sequence[str],
                      page_size: int) -> Reservations:
    """One reading of both sides (fields stay None where a server did not answer; several
    prefills or decodes behind a router are summed per side)."""
    res = Reservations()
    errors = []
    try:
        d = _sum_loads(_urls(decode_url))
        res.decode_used_tokens = int(d["used"])
        res.decode_pages = math.ceil(d["used"] / max(1, page_size))
        res.decode_prealloc_queue = int(d["decode_prealloc_queue_reqs"])
        res.decode_transfer_queue = int(d["decode_transfer_queue_reqs"])
        res.decode_retracted_queue = int(d["decode_retracted_queue_reqs"])
        res.decode_deferred_release = int(sum(sum_samples(scrape(u), DEFERRED)
                                              for u in _urls(decode_url)))
    except (requests.RequestException, ValueError) as e:
        errors.append(f"decode: {e}")
    try:
        p = _sum_loads(_urls(prefill_url))
        res.prefill_used_tokens = int(p["used"])
        res.prefill_pages = math.ceil(p["used"] / max(1, page_size))
        res.prefill_bootstrap_queue = int(p["prefill_bootstrap_queue_reqs"])
        res.prefill_inflight_queue = int(p["prefill_inflight_queue_reqs"])
    except (requests.RequestException, ValueError) as e:
        errors.append(f"prefill: {e}")
    res.error = "; ".join(errors)
    return res


def reservations_after(prefill_url: str | Sequence[str], decode_url: str | Sequence[str],
                       page_size: int, *,
                       settle_s: float, poll_s: float = 0.5) -> Reservations:
    """Poll until both servers hold nothing, or ``settle_s`` passed; the last reading. A
    server that does not answer at all ends the polling (it will not settle)."""
    t0 = time.monotonic()
    while True:
        res = reservations_once(prefill_url, decode_url, page_size)
        res.settled_after_s = round(time.monotonic() - t0, 2)
        if res.clean:
            res.settled = True
            return res
        if res.error or time.monotonic() - t0 >= settle_s:
            return res
        time.sleep(poll_s)
