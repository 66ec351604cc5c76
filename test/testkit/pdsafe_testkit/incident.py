"""The incident's deployment scaled to the tiny model, and the operator's path through it (issue
22, item 2): the mechanics and the checks, shared by the CI test and the regression benchmark.

The incident: a 1,048,576-token context, a prefill KV pool of 681,280 tokens (65 %), a larger
decode pool; prompts longer than the prefill's pool were answered with another request's KV.
Scaled here (``Shape.scaled``): the model's context (the tiny model's 4096), a prefill pool of
the same fraction (2661 tokens), a decode pool of the context plus upstream's 512 reserved decode
tokens (4608: larger than the prefill's and than the context, so only the prefill refuses).

The operator's path on the fork, in docs/operator-guide.md's order ("A KV pool smaller than the
context length"), each step checked on what the operator sees:

1. **The incident's configuration** (``incident_config``): the prefill refuses to start, its log
   ends with ``admission.capacity_refusal``; the decode (its pool holds the context) starts.
2. **The clamp on the refused leg** (``clamp_config``, the decode of step 1 kept): the prefill
   starts and logs ``admission.clamp_warning``; both legs answer /health 200, and decode
   refuses every request at pairing (``pair_agreement.refusal_message``: the legs' context
   lengths differ), which both legs' clients read, with the remedy "the same --context-length
   on both"; decode logs it once.
3. **The documented working configuration** (``working_config``): both legs with the same
   ``--context-length``, the KV pool step 1 named (the smaller pool). The pair serves; decode
   logs ``pair_agreement.pairing_message`` at its first request; every prompt up to the pair's
   advertised limit (the smaller ``/model_info`` ``max_prompt_tokens``) is answered as the
   reference answers it; every longer prompt gets a 4xx naming the limit
   (``admission.PromptTooLongError``), or, with ``--allow-auto-truncate``, the reference answer of
   the prompt cut at the pair's limit. Each leg cuts at its own limit, so with auto-truncate the
   legs must advertise the same one (``aligned_context``: at page sizes above 5 the prefill's
   page rounding puts its limit below decode's, and the operator lowers ``--context-length`` on
   both by the difference, as the guide says).

Every expected message is built by the product's own function with this run's numbers
(``expected_*``), never retyped, so a reworded message fails here and in
``test/unit/test_operator_guide_incident.py`` (the guide's quotes) at once.

Users: ``test/pd/test_incident_walk.py`` (the fork's walk, Mooncake, page 1) and
``benchmark/incident.py`` (the ``incident-walk*`` scenarios: both variants, every answer judged
by the content oracle; stock starts the incident's configuration and leaks).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import requests

from pdsafe_testkit.servers import (
    DEFAULT_MODEL,
    STARTUP_TIMEOUT_S,
    Limits,
    ServerConfig,
    SGLangServer,
)

#: The incident's numbers (issue 22).
INCIDENT_CONTEXT = 1_048_576
INCIDENT_PREFILL_POOL = 681_280
#: Upstream's default ``--num-reserved-decode-tokens``: the decode pool holds the context plus
#: these, so the decode's prompt limit is the context's, as on a decode larger than the context.
RESERVED_DECODE_TOKENS = 512
#: The clamp flag (``sglang.pdsafe.admission.CLAMP_FLAG``; repeated so the base variant's users
#: need not import the fork; ``test_shape_matches_the_product`` pins it).
CLAMP_FLAG = "--disaggregation-clamp-context-to-kv-capacity"
#: The bootstrap host of every harness prefill (loopback only).
HOST = "127.0.0.1"

STEP_FIRST_START = "1 first start"
STEP_CLAMP = "2 clamp on the refused leg"
STEP_WORKING = "3 working configuration"


def model_context(model_path: Path = DEFAULT_MODEL) -> int:
    """The model's own context length (``max_position_embeddings``)."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return int(cfg["max_position_embeddings"])


def floor_page(tokens: int, page_size: int) -> int:
    """``tokens`` rounded down to whole pages: the KV capacity a server reports for a
    ``--max-total-tokens`` (upstream's pool configurator rounds the pool down)."""
    return tokens // page_size * page_size


@dataclass(frozen=True)
class Shape:
    """The incident's shape on this machine: the model context and both legs' pools."""

    context: int
    prefill_pool: int
    decode_pool: int
    page_size: int = 1

    @classmethod
    def scaled(cls, model_path: Path = DEFAULT_MODEL, page_size: int = 1) -> Shape:
        ctx = model_context(model_path)
        return cls(ctx, round(ctx * INCIDENT_PREFILL_POOL / INCIDENT_CONTEXT),
                   ctx + RESERVED_DECODE_TOKENS, page_size)

    def kv(self, role: str) -> int:
        """The KV capacity the ``role`` server reports (its pool in whole pages)."""
        pool = self.prefill_pool if role == "prefill" else self.decode_pool
        return floor_page(pool, self.page_size)

    @property
    def working_context(self) -> int:
        """Step 3's ``--context-length``: the smaller pool, as the step-1 refusal names it."""
        return min(self.kv("prefill"), self.kv("decode"))

    def describe(self) -> str:
        return (f"context {self.context}, prefill pool {self.prefill_pool} "
                f"({self.prefill_pool / self.context:.0%}; KV {self.kv('prefill')}), decode pool "
                f"{self.decode_pool} (KV {self.kv('decode')}), page size {self.page_size}")


# --------------------------------------------------------------------------- configurations


def _config(shape: Shape, role: str, model: Path, backend: str, *, context: int | None,
            truncate: bool, env: dict[str, str] | None, extra: Sequence[str] = ()) -> ServerConfig:
    pool = shape.prefill_pool if role == "prefill" else shape.decode_pool
    return ServerConfig(role=role, model_path=model, backend=backend, max_total_tokens=pool,
                        page_size=shape.page_size, context_length=context,
                        allow_auto_truncate=truncate, extra_args=list(extra),
                        env=dict(env or {}))


def incident_config(shape: Shape, role: str, backend: str, *, model: Path = DEFAULT_MODEL,
                    truncate: bool = False, env: dict[str, str] | None = None) -> ServerConfig:
    """Step 1 (and the configuration stock runs): each leg its own pool, the model's context
    (no ``--context-length``, as in the incident)."""
    return _config(shape, role, model, backend, context=None, truncate=truncate, env=env)


def clamp_config(shape: Shape, backend: str, *, model: Path = DEFAULT_MODEL,
                 truncate: bool = False, env: dict[str, str] | None = None) -> ServerConfig:
    """Step 2: the refused leg (the prefill) again, with the clamp flag."""
    return _config(shape, "prefill", model, backend, context=None, truncate=truncate, env=env,
                   extra=[CLAMP_FLAG])


def working_config(shape: Shape, role: str, backend: str, context: int, *,
                   model: Path = DEFAULT_MODEL, truncate: bool = False,
                   env: dict[str, str] | None = None) -> ServerConfig:
    """Step 3: the same ``--context-length`` ``context`` on both legs, pools unchanged."""
    return _config(shape, role, model, backend, context=context, truncate=truncate, env=env)


def aligned_context(context: int, prefill_limit: int, decode_limit: int) -> int:
    """The ``--context-length`` with which both legs advertise the same prompt limit: lowered by
    the difference when they differ (the guide's rule for ``--allow-auto-truncate``)."""
    return context - max(0, max(prefill_limit, decode_limit) - min(prefill_limit, decode_limit))


# --------------------------------------------------------------------------- servers


def settle(servers: Sequence[SGLangServer], timeout: float = STARTUP_TIMEOUT_S) -> None:
    """Wait until every server answers /health 200 or has exited (a refused start)."""
    deadline = time.monotonic() + timeout
    for s in servers:
        while s.process.alive() and time.monotonic() < deadline:
            if is_healthy(s.url):
                break
            time.sleep(0.5)


def is_healthy(url: str) -> bool:
    try:
        return requests.get(url + "/health", timeout=10).status_code == 200
    except requests.RequestException:
        return False


def model_info(url: str) -> dict[str, Any]:
    try:
        return dict(requests.get(url + "/model_info", timeout=30).json())
    except (requests.RequestException, ValueError):
        return {}


def log_lines(server: SGLangServer, needle: str, *, as_message: bool = False) -> list[str]:
    """The log lines of ``server`` that contain ``needle``; ``as_message``: only those whose
    message (after the ``[time] `` prefix) is ``needle`` itself, not a line of upstream's
    that quotes it (its per-request failure lines end with the reason they failed for)."""
    lines = server.process.log_text().splitlines()
    if not as_message:
        return [ln for ln in lines if needle in ln]
    return [ln for ln in lines if ln.split("] ", 1)[-1].startswith(needle)]


def bootstrap_addr(prefill: SGLangServer) -> str:
    """How decode names the prefill (the router's and a client's ``bootstrap_host:port``)."""
    return f"{HOST}:{prefill.bootstrap_port}"


# --------------------------------------------------------------------------- expected messages
#
# Built by the fork's own functions (imported here, not at module level: the benchmark's base
# variant imports this module too, and only the fork's walk needs them).


def expected_refusal(shape: Shape) -> str:
    from sglang.pdsafe.admission import capacity_refusal

    return capacity_refusal("prefill", shape.kv("prefill"), shape.context)


def expected_clamp_warning(shape: Shape) -> str:
    from sglang.pdsafe.admission import clamp_warning

    return clamp_warning(shape.kv("prefill"), shape.context)


def expected_pair_refusal(shape: Shape, prefill: SGLangServer) -> str:
    from sglang.pdsafe.pair_agreement import Mismatch, refusal_message

    return refusal_message(bootstrap_addr(prefill),
                           [Mismatch("context_length", shape.kv("prefill"), shape.context)])


def expected_pairing(prefill: SGLangServer, limits: dict[str, Limits]) -> str:
    from sglang.pdsafe.pair_agreement import pairing_message

    return pairing_message(bootstrap_addr(prefill), limits["prefill"].max_prompt_tokens,
                           limits["decode"].max_prompt_tokens)


def expected_too_long(n: int, lim: Limits) -> str:
    """The 400 a leg with limits ``lim`` answers to an ``n``-token prompt."""
    from sglang.pdsafe.admission import PromptTooLongError

    return str(PromptTooLongError(n, lim.max_req_input_len, lim.context_length,
                                  lim.kv_capacity_tokens))


#: The remedy the pairing refusal must name (issue 22: the server's message gives it).
PAIR_REMEDY = "start both with the same --context-length"


# --------------------------------------------------------------------------- checks


@dataclass
class Check:
    """One thing the operator sees at one step, compared with what the guide says."""

    step: str
    what: str
    ok: bool
    expected: str = ""
    seen: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        mark = "ok" if self.ok else "FAILED"
        out = f"[{mark}] {self.step}: {self.what}"
        if not self.ok:
            out += f"\n    expected: {self.expected[:600]}\n    seen:     {self.seen[:600]}"
        return out


@dataclass
class Checks:
    """The checks of one walk, in the order they were made."""

    items: list[Check] = field(default_factory=list)

    def add(self, step: str, what: str, ok: bool, expected: Any = "", seen: Any = "") -> bool:
        self.items.append(Check(step, what, bool(ok), str(expected), str(seen)))
        return bool(ok)

    def failed(self, step: str | None = None) -> list[Check]:
        return [c for c in self.items if not c.ok and (step is None or c.step == step)]

    def of(self, step: str) -> list[Check]:
        return [c for c in self.items if c.step == step]

    def report(self, step: str | None = None) -> str:
        return "\n".join(str(c) for c in self.items if step is None or c.step == step)


def check_first_start(checks: Checks, shape: Shape, prefill: SGLangServer,
                      decode: SGLangServer) -> None:
    """Step 1: the prefill refused to start with the capacity refusal; the decode is up."""
    s = STEP_FIRST_START
    rc = prefill.process.proc.poll() if prefill.process.proc else None
    checks.add(s, "the prefill exits (refuses to start)", rc is not None and rc != 0,
               "a non-zero exit status", f"exit status {rc}; log tail: "
               f"{prefill.process.log_tail(8)}")
    want = expected_refusal(shape)
    got = log_lines(prefill, "refusing to start")
    checks.add(s, "the prefill's log names its pool, its context and the remedies",
               any(want in ln for ln in got), want, got[-1] if got else "(no refusal line)")
    checks.add(s, "the decode starts (its pool holds the context)", is_healthy(decode.url),
               "/health 200", decode.process.log_tail(5))
    ctx = model_info(decode.url).get("context_length")
    checks.add(s, "the decode advertises the model's context", ctx == shape.context,
               shape.context, ctx)


def check_clamped(checks: Checks, shape: Shape, prefill: SGLangServer,
                  decode: SGLangServer) -> None:
    """Step 2, at startup: the clamped prefill is up, warned, and advertises its pool as its
    context; the decode of step 1 is still up."""
    s = STEP_CLAMP
    checks.add(s, "the clamped prefill starts", is_healthy(prefill.url), "/health 200",
               prefill.process.log_tail(5))
    want = expected_clamp_warning(shape)
    got = log_lines(prefill, "lowering the effective context length")
    checks.add(s, "the prefill warns that it lowered its context", any(want in ln for ln in got),
               want, got[-1] if got else "(no warning)")
    ctx = model_info(prefill.url).get("context_length")
    checks.add(s, "the prefill advertises its pool as its context", ctx == shape.kv("prefill"),
               shape.kv("prefill"), ctx)
    checks.add(s, "the decode is still up", is_healthy(decode.url), "/health 200",
               decode.process.log_tail(5))


def check_pair_refusals(checks: Checks, shape: Shape, prefill: SGLangServer,
                        decode: SGLangServer,
                        answers: Sequence[tuple[int | None, str, int | None, str]]) -> None:
    """Step 2, requests: ``answers`` is one ``(prefill status, prefill message, decode status,
    decode message)`` per request sent to both legs. Each leg refuses every one with decode's
    pairing refusal (naming both context lengths and the remedy), decode logs it once, and
    both legs stay up."""
    s = STEP_CLAMP
    want = expected_pair_refusal(shape, prefill)
    checks.add(s, "the pairing refusal names the remedy", PAIR_REMEDY in want, PAIR_REMEDY, want)
    for i, (ps, pm, ds, dm) in enumerate(answers):
        checks.add(s, f"request {i}: decode's client gets the pairing refusal",
                   ds is not None and ds >= 400 and want in dm, f"HTTP 5xx/4xx: {want}",
                   f"HTTP {ds}: {dm}")
        checks.add(s, f"request {i}: prefill's client gets the pairing refusal",
                   ps is not None and ps >= 400 and want in pm, f"HTTP 5xx/4xx: {want}",
                   f"HTTP {ps}: {pm}")
    # The refusal itself, once per prefill; each refused request's failure line (upstream's
    # "Decode handshake failed ... with exception ...") quotes it too and is not counted.
    logged = log_lines(decode, want, as_message=True)
    checks.add(s, "decode logs the refusal once", len(logged) == 1, "one line",
               f"{len(logged)} lines: {logged[:2]}")
    checks.add(s, "both legs stay up", is_healthy(prefill.url) and is_healthy(decode.url),
               "/health 200 on both", "")


def check_working(checks: Checks, context: int, prefill: SGLangServer,
                  decode: SGLangServer) -> dict[str, Limits] | None:
    """Step 3, at startup: both legs up with the same effective context, nothing refused or
    clamped; returns both legs' advertised limits (None when unreadable)."""
    s = STEP_WORKING
    up = is_healthy(prefill.url) and is_healthy(decode.url)
    checks.add(s, f"both legs start with --context-length {context}", up, "/health 200 on both",
               f"{prefill.process.log_tail(3)}\n{decode.process.log_tail(3)}")
    quiet = not any(log_lines(x, "refusing to start") or
                    log_lines(x, "lowering the effective context length")
                    for x in (prefill, decode))
    checks.add(s, "nothing refused or clamped", quiet, "no refusal, no clamp warning", "")
    if not up:
        return None
    limits = {"prefill": Limits.of(prefill.url), "decode": Limits.of(decode.url)}
    ctxs = {r: v.context_length for r, v in limits.items()}
    checks.add(s, "both advertise the same context length",
               set(ctxs.values()) == {context}, context, ctxs)
    return limits


def check_paired(checks: Checks, prefill: SGLangServer, decode: SGLangServer,
                 limits: dict[str, Limits]) -> None:
    """Step 3, after the first served request: decode logged the pair's prompt limit."""
    want = expected_pairing(prefill, limits)
    got = log_lines(decode, "pdsafe: paired with prefill")
    checks.add(STEP_WORKING, "decode logs the pair's prompt limit", any(want in ln for ln in got),
               want, got[-1] if got else "(no pairing line)")


def pair_limit(limits: dict[str, Limits]) -> int:
    """The longest prompt the pair accepts (the smaller advertised ``max_prompt_tokens``)."""
    return min(v.max_prompt_tokens for v in limits.values())


def check_over_long(checks: Checks, n: int, status: int | None, message: str,
                    limits: dict[str, Limits], label: str = "") -> None:
    """Step 3 without auto-truncate: an ``n``-token prompt over the pair's limit got a 4xx
    whose message is a refusing leg's ``PromptTooLongError`` (a leg whose limit ``n``
    exceeds)."""
    wants = [expected_too_long(n, lim) for lim in limits.values() if n > lim.max_prompt_tokens]
    checks.add(STEP_WORKING, f"{label or f'{n}-token prompt'}: 4xx naming the limit",
               status is not None and 400 <= status < 500 and any(w in message for w in wants),
               " or ".join(f"HTTP 400: {w}" for w in wants), f"HTTP {status}: {message}")


__all__ = ["CLAMP_FLAG", "INCIDENT_CONTEXT", "INCIDENT_PREFILL_POOL", "PAIR_REMEDY",
           "STEP_CLAMP", "STEP_FIRST_START", "STEP_WORKING", "Check", "Checks", "Shape",
           "aligned_context", "bootstrap_addr", "check_clamped", "check_first_start",
           "check_over_long", "check_pair_refusals", "check_paired", "check_working",
           "clamp_config", "expected_clamp_warning", "expected_pair_refusal",
           "expected_pairing", "expected_refusal", "expected_too_long", "incident_config",
           "is_healthy", "log_lines", "model_context", "model_info", "pair_limit", "settle",
           "working_config"]
