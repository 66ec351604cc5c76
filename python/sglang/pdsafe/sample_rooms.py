"""Parallel sampling on a PD server: each sample of an ``n>1`` request is a KV transfer of its own.

Upstream 0.5.23's tokenizer manager turns an ``n>1`` request into a prefix-cache warmup
(``max_new_tokens`` 0) and ``n`` samples, each sent to the scheduler with the request's one
``bootstrap_room``: on a PD pair, ``n+1`` transfers share one room's state (a decode scheduler
crash, a hang, or a sample decoded over pages another sample's transfer wrote;
sgl-project/sglang#26486, #40297). The fork refused ``n>1`` in PD with 400 until this module
(issue 21, item 5: parallel sampling is common, best-of-n and RL rollouts).

**Rule.** Both legs receive the same request with the same room ``R`` (from the router, or a
client that sends both legs, as for ``n=1``) and expand it the same way (upstream's order: for
each prompt of the batch, samples ``0 .. n-1``). Sample ``k`` of a prompt whose room is ``R`` is
transferred under the room :func:`sample_room` ``(R, k)``: a 63-bit BLAKE2b of ``(R, k)``,
never 0 and never ``R`` itself. Each leg computes it on its own, so the two legs agree without a
message, and every sample has its own reservation, transfer generation, coverage row and KV
digest, checked like any ``n=1`` transfer. The prefix-cache warmup is not sent on a PD server
(:func:`warmups`): it would be one more transfer, and the prefill's radix cache shares the
prompt's KV between the samples anyway.

A derived room is as unpredictable to a third party as ``R`` is; a client that picks ``R`` to make
a derived room collide with a live room only gets the room guard's 409 for that sample (the
scheduler-side claim), never a shared transfer. The whole request then gets an explicit error
(upstream answers a batch with an error when one of its requests fails).

What it does not cover: a PD pair whose other leg is a stock server (under the operator's
waiver) expands ``n>1`` with the request's room for every sample; the fork leg's samples then
never meet theirs and fail at the waiting timeout (an explicit error, late). Streaming ``n>1``
follows upstream's batch streaming unchanged.

State: none (pure derivation).
"""

from __future__ import annotations

import hashlib
from typing import Any

from sglang.pdsafe.admission import raise_refusal
from sglang.pdsafe.hook_api import require
from sglang.pdsafe.policy import Outcome, hook
from sglang.pdsafe.protections import PDModeUnknownError, is_pd

FAILED = "room_guard_failed_total"
_U63 = (1 << 63) - 1
_PERSON = b"pdsafe-sample1"

require("sglang.srt.managers.tokenizer_manager.TokenizerManager",
        "pdsafe_parallel_warmups(batch_size)", "pdsafe_sample_room(bootstrap_room, sample)",
        why="parallel sampling in PD: each sample its own transfer room (issue 21, item 5)")


def sample_room(room: int, sample: int) -> int:
    """The room sample ``sample`` of a request of room ``room`` is transferred under (pure;
    never 0, never ``room``)."""
    h = hashlib.blake2b(f"{int(room)}:{int(sample)}".encode("ascii"), digest_size=8,
                        person=_PERSON)
    derived = (int.from_bytes(h.digest(), "little") & _U63) or 1
    return derived if derived != int(room) else (derived % _U63) + 1


def _pd(tokenizer_manager: Any) -> bool:
    try:
        return is_pd(getattr(tokenizer_manager, "server_args", None))
    except PDModeUnknownError:
        return True  # fail closed: treated as PD


@hook("sample_rooms.room_for_sample", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=raise_refusal,
      effect="the whole n>1 request is refused (503) before any sample reaches a scheduler")
def room_for_sample(tokenizer_manager: Any, room: int | None, sample: int) -> int | None:
    """TokenizerManager, expanding an ``n>1`` request: sample ``sample``'s room on a PD server
    (``room`` unchanged on a co-located server, or when the request names none)."""
    if room is None or not _pd(tokenizer_manager):
        return room
    return sample_room(int(room), int(sample))


@hook("sample_rooms.warmups", outcome=Outcome.REFUSE, counter=FAILED, on_failure=raise_refusal,
      effect="the whole n>1 request is refused (503) before any sample reaches a scheduler")
def warmups(tokenizer_manager: Any, batch_size: int) -> int:
    """How many prefix-cache warmups an ``n>1`` batch sends first: ``batch_size`` on a
    co-located server (upstream's), 0 on a PD server."""
    return 0 if _pd(tokenizer_manager) else int(batch_size)
