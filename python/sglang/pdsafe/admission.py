"""Admission by the real limits: KV-derived prompt limit at HTTP, capacity invariant at startup.

Three things live here, each hooked into upstream SGLang by a thin patch:

* **HTTP input-length limit** (``check_input_length``, called from
  ``TokenizerManager._validate_one_request``). Upstream's tokenizer checks prompts only against
  the context length, but the scheduler's real limit is ``max_req_input_len``
  (``min(context_len - 1, kv_capacity - 1) - 5``), so a prompt between the KV capacity and the
  context length passed HTTP admission and was caught only inside the scheduler (the incident:
  it became a one-token placeholder that reached the PD handoff). Invariant: a prompt the
  scheduler door would refuse (``len >= max_req_input_len``) never leaves the HTTP layer; the
  client gets a 400 that names the prompt length and the limit, and
  ``rejected_over_capacity_http_total`` counts it. With ``--allow-auto-truncate`` the prompt is
  truncated to the longest length the scheduler accepts instead (same rule as the scheduler
  door, so the two layers never disagree).

* **Capacity invariant at startup** (``enforce_kv_capacity``, called from
  ``TpModelWorker.get_worker_info`` where the final KV capacity is known). In PD mode a server
  whose KV pool holds fewer tokens than its context length refuses to start, unless
  ``--disaggregation-clamp-context-to-kv-capacity`` lowers the effective context length to the
  KV capacity (logged as a warning). Invariant: a PD server that is up has
  ``context_len <= kv_capacity``.

* **Advertised limits** (``scheduler_limits`` -> scheduler init info -> ``adopt_scheduler_limits``
  in the tokenizer process -> ``advertised_limits`` in ``/model_info`` and ``/server_info``), so
  a router can align prefill and decode.

No module state: every limit is a return value that its caller keeps (the tp worker keeps the
effective context length and the KV capacity) and passes on explicitly.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.pdsafe import metrics, policy
from sglang.pdsafe.policy import Outcome, RefusedError, hook, raise_refusal
from sglang.pdsafe.protections import EVERY, Protection, pd_mode, register

logger = logging.getLogger("sglang.pdsafe.admission")

CLAMP_FLAG = "--disaggregation-clamp-context-to-kv-capacity"
CLAMP_FIELD = "disaggregation_clamp_context_to_kv_capacity"
FAILED = "admission_check_failed_total"


register(Protection(
    name="http-input-length-limit",
    guards="the HTTP layer refuses prompts longer than max_req_input_len (KV capacity), "
           "before any scheduling, bootstrap or page allocation",
    roles=EVERY,
))
register(Protection(
    name="pd-capacity-invariant",
    guards="a PD server refuses to start when its KV pool holds fewer tokens than its "
           "context length (or clamps the context length with " + CLAMP_FLAG + ")",
))


# --------------------------------------------------------------------------- HTTP admission


class AdmissionError(RefusedError):
    """A request refused at the HTTP layer (the one refusal type, raised: a ``ValueError``, so
    every upstream entry point, ``/generate``, the OpenAI handlers, streaming or not, already
    turns it into a 4xx before the request reaches the scheduler; ``status_code`` is read by
    the HTTP handlers)."""


class PromptTooLongError(AdmissionError):
    """The prompt is longer than this server's ``max_req_input_len`` allows."""

    error_code = "context_length_exceeded"
    param = "prompt"
    counter = "rejected_over_capacity_http_total"

    def __init__(self, prompt_tokens: int, max_req_input_len: int,
                 context_len: int | None, kv_capacity: int | None) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_req_input_len = max_req_input_len
        self.max_prompt_tokens = max_req_input_len - 1
        self.context_len = context_len
        self.kv_capacity = kv_capacity
        bounds = []
        if kv_capacity is not None:
            bounds.append(f"KV cache pool of {kv_capacity} tokens")
        if context_len is not None:
            bounds.append(f"context length {context_len}")
        why = f" (max_req_input_len={max_req_input_len}, from its " + " and ".join(bounds) + ")" \
            if bounds else f" (max_req_input_len={max_req_input_len})"
        super().__init__(
            f"The prompt has {prompt_tokens} tokens, but this server accepts at most "
            f"{self.max_prompt_tokens} prompt tokens{why}. Shorten the prompt to at most "
            f"{self.max_prompt_tokens} tokens. Operators: raise the KV capacity "
            f"(--max-total-tokens or --mem-fraction-static), or lower --context-length to "
            f"the KV capacity so clients see the real limit."
        )


@policy.passthrough("admission.error_content",
                    why="formats the body of a refusal already decided (upstream's own body "
                        "stands if it raises)")
def error_content(exc: BaseException) -> dict[str, Any] | None:
    """OpenAI-style error body for one of our refusals (None for other errors)."""
    if not isinstance(exc, RefusedError):
        return None
    err: dict[str, Any] = {
        "message": str(exc),
        "type": exc.error_type,
        "param": exc.param,
        "code": exc.error_code,
    }
    if isinstance(exc, PromptTooLongError):
        err["prompt_tokens"] = exc.prompt_tokens
        err["max_prompt_tokens"] = exc.max_prompt_tokens
        err["max_req_input_len"] = exc.max_req_input_len
    return {"error": err}


@hook("admission.check_input_length", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=raise_refusal, effect="503 at the HTTP layer, before the request is queued")
def check_input_length(tokenizer_manager: Any, input_ids: list[int] | None) -> None:
    """Refuse (or, with --allow-auto-truncate, truncate) a prompt over ``max_req_input_len``.

    Mirrors the scheduler door exactly (``managers/utils.py::validate_input_length``: a prompt
    of ``max_req_input_len`` tokens or more is refused), so a prompt that passes here is never
    refused there for its length. Truncation keeps the first ``max_req_input_len - 1`` tokens,
    the longest prompt both layers accept. Does nothing before the scheduler has reported its
    limit (``max_req_input_len is None``) and for requests without token ids (input_embeds).
    """
    limit = getattr(tokenizer_manager, "max_req_input_len", None)
    if not limit or input_ids is None:
        return
    n = len(input_ids)
    if n < limit:
        return
    if getattr(tokenizer_manager, "allow_auto_truncate", False):
        keep = limit - 1
        logger.warning(
            "Prompt of %d tokens exceeds this server's limit (max_req_input_len=%d); "
            "truncating it to %d tokens (--allow-auto-truncate).", n, limit, keep,
        )
        del input_ids[keep:]
        return
    metrics.inc("rejected_over_capacity_http_total")
    raise PromptTooLongError(
        n, limit,
        context_len=getattr(tokenizer_manager, "context_len", None),
        kv_capacity=getattr(tokenizer_manager, "pdsafe_kv_capacity", None),
    )


@policy.passthrough("admission.prestart_stream",
                    why="runs upstream's generator to its first item; the exceptions are "
                        "upstream's (or a refusal raised by a hook inside)")
async def prestart_stream(agen: Any) -> Any:
    """Run a streaming request up to its first output before the HTTP 200 is sent.

    Validation (this module's admission, upstream's checks) runs inside the generator; awaiting
    its first item here makes a refusal raise in the handler, which answers 4xx, instead of
    inside an already-started 200 event stream. Returns a generator that yields the first item
    again, then the rest.
    """
    try:
        first = await agen.__anext__()
    except StopAsyncIteration:
        first = _NOTHING

    async def rest():
        if first is not _NOTHING:
            yield first
        async for item in agen:
            yield item

    return rest()


_NOTHING = object()


# --------------------------------------------------------------------------- startup invariant


class CapacityInvariantError(policy.StartupRefusedError):
    """A PD server's KV pool cannot hold one request of its context length."""


def capacity_refusal(mode: str, kv_capacity: int, context_len: int) -> str:
    """The message a ``mode`` server (prefill or decode) refuses to start with when its KV pool
    holds ``kv_capacity`` tokens, fewer than its context length ``context_len``.

    Pure (docs/operator-guide.md quotes it with example numbers; test/unit/
    test_operator_guide_incident.py builds it here). Names both numbers and both remedies,
    and that the two legs of a pair must end with the same context length: a clamp on one leg
    only makes decode refuse to pair with it (``pair_agreement``)."""
    return (
        f"pdsafe: refusing to start this {mode} server: its KV "
        f"pool holds {kv_capacity} tokens, fewer than its context length {context_len}, "
        f"so one full-length request cannot fit and the two sides of the PD pair could "
        f"admit different prompts. Either lower --context-length to at most "
        f"{kv_capacity} (or raise the KV pool with --max-total-tokens / "
        f"--mem-fraction-static), or pass {CLAMP_FLAG} to lower the effective context "
        f"length to {kv_capacity} (logged and advertised in /model_info). Both legs of a PD "
        f"pair must run the same context length (decode refuses to pair otherwise): give "
        f"prefill and decode the same --context-length, at most the smaller KV pool."
    )


def clamp_warning(kv_capacity: int, context_len: int) -> str:
    """The WARNING a server started with the clamp flag logs when it lowers its context length
    (pure; quoted by docs/operator-guide.md like ``capacity_refusal``)."""
    return (f"KV pool holds {kv_capacity} tokens, fewer than the context length {context_len}: "
            f"lowering the effective context length to {kv_capacity} ({CLAMP_FLAG}). "
            f"/model_info and /server_info advertise context_length={kv_capacity}.")


@hook("admission.enforce_kv_capacity", outcome=Outcome.POISON, counter=FAILED,
      on_failure=policy.reraise_at_startup, effect="the server refuses to start")
def enforce_kv_capacity(server_args: Any, kv_capacity: int, context_len: int) -> int:
    """Return the effective context length for a KV pool of ``kv_capacity`` tokens.

    * ``kv_capacity >= context_len``: unchanged.
    * clamp flag set (any mode): lowered to ``kv_capacity``, with a warning.
    * PD mode without the flag: raises ``CapacityInvariantError`` naming both numbers and
      both remedies (the server must not start: the two legs of a PD pair would otherwise
      admit different prompts, and a prompt over the KV capacity has no safe outcome).
    * otherwise (co-located): unchanged; upstream's warning follows.

    A decode server whose pool is not larger than ``--num-reserved-decode-tokens`` also refuses
    to start (its pre-allocation can never fit a request; see
    ``sglang.pdsafe.limits.pd_input_limit``).

    Pure apart from the log and the exception: the caller keeps the returned value (the tp
    worker stores it as its ``model_config.context_len``) and passes it on explicitly
    (``scheduler_limits``). A mode that cannot be read raises ``PDModeUnknownError``.
    """
    mode = pd_mode(server_args)
    effective = int(context_len)
    if kv_capacity < context_len:
        if getattr(server_args, CLAMP_FIELD, False):
            logger.warning("%s", clamp_warning(kv_capacity, context_len))
            effective = int(kv_capacity)
        elif mode != "null":
            raise CapacityInvariantError(capacity_refusal(mode, kv_capacity, context_len))
    if mode == "decode":
        reserved = int(server_args.num_reserved_decode_tokens)
        if kv_capacity <= reserved:
            # Decode pre-allocates prompt pages + the reserved decode tokens: nothing fits,
            # not even the startup warmup (upstream waits forever, /health stays 503).
            raise CapacityInvariantError(
                f"pdsafe: refusing to start this decode server: its KV pool holds "
                f"{kv_capacity} tokens, not more than --num-reserved-decode-tokens "
                f"{reserved}, so no request can ever be pre-allocated. Raise the KV pool "
                f"(--max-total-tokens / --mem-fraction-static) or lower "
                f"--num-reserved-decode-tokens."
            )
    return effective


@hook("admission.scheduler_limits", outcome=Outcome.POISON, counter=FAILED,
      on_failure=policy.reraise_at_startup, effect="the server refuses to start")
def scheduler_limits(max_req_input_len: int | None, context_len: int | None,
                     kv_capacity: int | None) -> dict[str, Any]:
    """Extra keys for the scheduler's init info (read by the tokenizer process).

    All three values are passed explicitly by the scheduler from its target worker
    (``max_req_input_len`` from ``get_worker_info()``, ``context_len`` = the worker's effective
    ``model_config.context_len`` after ``enforce_kv_capacity``, ``kv_capacity`` = the worker's
    ``pdsafe_kv_capacity``); nothing is kept between calls. ``None`` leaves a key out.
    """
    out: dict[str, Any] = {}
    if context_len is not None:
        out["pdsafe_context_len"] = int(context_len)
    if kv_capacity is not None:
        out["pdsafe_kv_capacity"] = int(kv_capacity)
    if max_req_input_len is not None:
        out["pdsafe_max_prompt_tokens"] = int(max_req_input_len) - 1
    return out


@hook("admission.adopt_scheduler_limits", outcome=Outcome.POISON, counter=FAILED,
      on_failure=policy.reraise_at_startup,
      effect="the server refuses to start (its HTTP layer would not know its limits)")
def adopt_scheduler_limits(tokenizer_manager: Any, scheduler_info: dict[str, Any]) -> None:
    """Make the tokenizer process use the scheduler's effective context length and KV size."""
    if tokenizer_manager is None:
        return
    kv = scheduler_info.get("pdsafe_kv_capacity")
    if kv is not None:
        tokenizer_manager.pdsafe_kv_capacity = int(kv)
    ctx = scheduler_info.get("pdsafe_context_len")
    cur = getattr(tokenizer_manager, "context_len", None)
    if ctx is not None and cur is not None and int(ctx) < cur:
        logger.info("tokenizer: effective context length %d (was %d)", ctx, cur)
        tokenizer_manager.context_len = int(ctx)


@hook("admission.advertised_limits", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=raise_refusal, effect="/model_info and /server_info answer 503")
def advertised_limits(tokenizer_manager: Any) -> dict[str, Any]:
    """The limits a router needs to align both PD legs, for /model_info and /server_info.

    ``context_length``: effective context length (after any clamp); ``max_req_input_len``: the
    scheduler's limit (prompts of this length or more are refused); ``max_prompt_tokens``: the
    longest prompt this server accepts (``max_req_input_len - 1``).
    """
    out: dict[str, Any] = {"context_length": getattr(tokenizer_manager, "context_len", None)}
    limit = getattr(tokenizer_manager, "max_req_input_len", None)
    out["max_req_input_len"] = limit
    out["max_prompt_tokens"] = limit - 1 if limit else None
    out["kv_capacity_tokens"] = getattr(tokenizer_manager, "pdsafe_kv_capacity", None)
    return out
