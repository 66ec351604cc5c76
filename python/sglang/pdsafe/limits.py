"""The longest prompt each leg of a PD pair can always schedule: page rounding, reserved tokens.

Upstream 0.5.23 advertises ``max_req_input_len = min(context_len - 1, kv_capacity - 1) - 5``
(``TpModelWorker.get_worker_info``) and its HTTP layer and scheduler door admit every prompt
below it, but neither PD leg can schedule all of those on an idle server:

* **Prefill** (``PrefillAdder.add_one_req`` -> ``PrefillBudget.check_prefill``) admits a
  request only when ``extend_len + max_new_tokens + page_size < remaining_total``. A PD prefill
  runs every request with ``max_new_tokens = 1`` (``PrefillBootstrapQueue._process_req``) and
  an idle pool has ``remaining_total = C`` (the pool, whole pages), so the longest prompt it
  can ever schedule is ``C - page_size - 2``. Chunked prefill does not lift this: the FIRST
  chunk is admitted only if the whole prompt fits (``total_tokens`` is computed from the full
  extend length); later chunks are page-aligned and always progress. With the radix cache
  disabled, ``ignore_eos`` requests take ``add_one_req_ignore_eos`` instead, which needs
  ``ceil_page(len) + page_size <= C - max_new_tokens - IGNORE_EOS_RESERVE_TOKENS - 1``, one
  page lower for page sizes >= 3. A prompt above the bound waited at the head of the waiting
  queue forever, and every request behind it waited too (FCFS: the adder stops at the first
  request that does not fit).
* **Decode** pre-allocates ``ceil_page(len) + num_reserved_decode_tokens``
  (``DecodePreallocQueue._required_admission_tokens``) and waits until that fits; on an idle
  server the budget is the pool, so the longest prompt is ``floor_page(C - reserved)``. Its
  scheduler also clips ``max_new_tokens`` to ``C - ceil_page(len) - page_size - 1``
  (``init_req_max_new_tokens``), so a prompt must leave room for at least one new token.

Invariant: a prompt of at most :func:`leg_limit`\\ ``(...).max_prompt_tokens`` tokens can be
scheduled by that leg on an idle server (so it is answered once the requests ahead of it end),
and the leg's ``max_req_input_len`` (the HTTP check, the scheduler door, ``/model_info``) is
exactly one more, so every longer prompt is refused with a 400 at admission. Only for the
plain (unsharded, non-hybrid) KV pool; other pools keep upstream's own checks as well.

Pure functions; :func:`pd_input_limit` is the one entry point that reads server arguments
(``TpModelWorker.get_worker_info`` calls it where ``max_req_input_len`` is computed). The
closed forms are cross-checked against the real upstream ``PrefillAdder`` and decode
pre-allocation arithmetic in ``test/unit/test_liveness_limits.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sglang.pdsafe import policy
from sglang.pdsafe.policy import Outcome, hook
from sglang.pdsafe.protections import pd_mode

logger = logging.getLogger("sglang.pdsafe.limits")

#: ``schedule_policy.IGNORE_EOS_RESERVE_TOKENS`` in upstream 0.5.23.
IGNORE_EOS_RESERVE_TOKENS = 1
#: A PD prefill runs every request with ``max_new_tokens = 1``
#: (``PrefillBootstrapQueue._process_req``).
PD_PREFILL_MAX_NEW_TOKENS = 1
#: ``max_req_input_len = max_req_len - 5`` in ``TpModelWorker.get_worker_info``.
UPSTREAM_INPUT_MARGIN = 5


def ceil_page(tokens: int, page_size: int) -> int:
    """``tokens`` rounded up to whole pages."""
    page = max(1, int(page_size))
    return -(-int(tokens) // page) * page


def floor_page(tokens: int, page_size: int) -> int:
    """``tokens`` rounded down to whole pages (never below 0)."""
    page = max(1, int(page_size))
    return max(0, int(tokens) // page * page)


def upstream_max_req_input_len(context_len: int, kv_capacity: int) -> int:
    """Upstream's own ``max_req_input_len`` (prompts of this length or more are refused)."""
    return min(int(context_len) - 1, int(kv_capacity) - 1) - UPSTREAM_INPUT_MARGIN


@dataclass(frozen=True)
class LegLimit:
    """One leg's prompt limit and the rule that sets it.

    ``max_req_input_len``: the shortest prompt the leg refuses (upstream's convention);
    ``binding``: which rule binds (``upstream``, ``prefill-admission``,
    ``prefill-admission-ignore-eos``, ``decode-preallocation``, ``decode-new-token``);
    ``reason``: the arithmetic, for logs and error messages.
    """

    mode: str
    max_req_input_len: int
    binding: str
    reason: str

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt the leg accepts."""
        return self.max_req_input_len - 1


def prefill_max_prompt(kv_capacity: int, page_size: int, *,
                       radix_cache_disabled: bool) -> tuple[int, str, str]:
    """Longest prompt a PD prefill schedules on an idle pool: ``(tokens, binding, reason)``."""
    page = max(1, int(page_size))
    pool = floor_page(kv_capacity, page)
    # extend + max_new(1) + page < pool
    best = pool - page - PD_PREFILL_MAX_NEW_TOKENS - 1
    binding = "prefill-admission"
    reason = (f"prefill admits a prompt only if prompt + {PD_PREFILL_MAX_NEW_TOKENS} new token "
              f"+ one page ({page}) < KV pool ({pool})")
    if radix_cache_disabled:
        # ceil_page(prompt) + page <= pool - max_new - IGNORE_EOS_RESERVE_TOKENS - 1
        ignore_eos = floor_page(
            pool - page - PD_PREFILL_MAX_NEW_TOKENS - IGNORE_EOS_RESERVE_TOKENS - 1, page)
        if ignore_eos < best:
            best = ignore_eos
            binding = "prefill-admission-ignore-eos"
            reason = (f"with the radix cache disabled, an ignore_eos prompt is admitted only "
                      f"if its pages + one page ({page}) <= KV pool ({pool}) - "
                      f"{PD_PREFILL_MAX_NEW_TOKENS + IGNORE_EOS_RESERVE_TOKENS + 1}")
    return best, binding, reason


def decode_max_prompt(kv_capacity: int, page_size: int,
                      reserved_decode_tokens: int) -> tuple[int, str, str]:
    """Longest prompt a PD decode pre-allocates on an idle pool: ``(tokens, binding, reason)``."""
    page = max(1, int(page_size))
    pool = floor_page(kv_capacity, page)
    reserved = max(0, int(reserved_decode_tokens))
    best = floor_page(pool - reserved, page)
    binding = "decode-preallocation"
    reason = (f"decode pre-allocates the prompt's pages + {reserved} reserved decode tokens "
              f"(--num-reserved-decode-tokens) in a KV pool of {pool}")
    # init_req_max_new_tokens: max_new <= pool - ceil_page(prompt) - page - 1, keep >= 1.
    new_token = floor_page(pool - page - 2, page)
    if new_token < best:
        best = new_token
        binding = "decode-new-token"
        reason = (f"decode keeps room for one new token: the prompt's pages + one page "
                  f"({page}) + 2 <= KV pool ({pool})")
    return best, binding, reason


def leg_limit(mode: str, *, kv_capacity: int, upstream_limit: int, page_size: int = 1,
              reserved_decode_tokens: int = 0, radix_cache_disabled: bool = False) -> LegLimit:
    """The real ``max_req_input_len`` of one server.

    ``mode``: ``prefill`` | ``decode`` | ``null`` (co-located: upstream's limit, unchanged);
    ``kv_capacity``: tokens in the served KV pool; ``upstream_limit``: upstream's computed
    ``max_req_input_len`` (:func:`upstream_max_req_input_len` for a plain server). Never above
    upstream's limit; may be below 2 when nothing fits (the caller refuses to start).
    """
    upstream = int(upstream_limit)
    out = LegLimit(mode, upstream, "upstream",
                   "upstream's min(context length - 1, KV pool - 1) - "
                   f"{UPSTREAM_INPUT_MARGIN}")
    if mode == "prefill":
        best, binding, reason = prefill_max_prompt(
            kv_capacity, page_size, radix_cache_disabled=radix_cache_disabled)
    elif mode == "decode":
        best, binding, reason = decode_max_prompt(kv_capacity, page_size,
                                                  reserved_decode_tokens)
    else:
        return out
    if best + 1 < upstream:
        out = LegLimit(mode, best + 1, binding, reason)
    return out


class NoSchedulablePromptError(policy.StartupRefusedError):
    """A PD server whose KV pool cannot schedule even a one-token prompt."""


@hook("limits.pd_input_limit", outcome=Outcome.POISON, counter="admission_check_failed_total",
      on_failure=policy.reraise_at_startup, effect="the server refuses to start")
def pd_input_limit(server_args: Any, kv_capacity: int, max_req_input_len: int,
                   page_size: int = 1) -> int:
    """This server's ``max_req_input_len`` with page rounding and reserved tokens (logged).

    Called once per scheduler process from ``TpModelWorker.get_worker_info`` with upstream's
    value. Co-located servers: unchanged. A PD server on which no prompt can ever be scheduled
    raises :class:`NoSchedulablePromptError` (it must not start; every request would wait).
    """
    mode = pd_mode(server_args)
    if mode == "null":
        return max_req_input_len
    lim = leg_limit(
        mode,
        kv_capacity=int(kv_capacity),
        upstream_limit=int(max_req_input_len),
        page_size=int(page_size or 1),
        reserved_decode_tokens=(int(server_args.num_reserved_decode_tokens)
                                if mode == "decode" else 0),
        radix_cache_disabled=bool(server_args.disable_radix_cache),
    )
    if lim.max_req_input_len < 2:
        raise NoSchedulablePromptError(
            f"pdsafe: refusing to start this {mode} server: no prompt can ever be scheduled "
            f"({lim.reason}). Raise the KV pool (--max-total-tokens / --mem-fraction-static)"
            + (" or lower --num-reserved-decode-tokens" if mode == "decode" else "")
            + " or lower --page-size."
        )
    if lim.max_req_input_len < max_req_input_len:
        logger.warning(
            "%s: prompts are limited to %d tokens (max_req_input_len %d -> %d): %s. Raise "
            "--max-total-tokens%s to accept longer prompts.",
            mode, lim.max_prompt_tokens, max_req_input_len, lim.max_req_input_len, lim.reason,
            " or lower --num-reserved-decode-tokens" if lim.binding == "decode-preallocation"
            else "",
        )
    return lim.max_req_input_len
