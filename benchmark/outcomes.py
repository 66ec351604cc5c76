"""Outcome classes of one benchmark request, and the classifier (pure: no server, no network).

Every PD answer is judged on content against the co-located reference's greedy answer for the
same prompt (the content oracle, ``pdsafe_testkit.oracle``), never on its status code alone:

``identical``       HTTP 200, token for token equal to the reference, AND the transfer
                    counters moved for it (decode committed a transfer and prefill sent one;
                    ``evidence.TransferEvidence``). Equal output from a decode that never
                    received KV would otherwise hide a broken transfer.
``unproven``        equal to the reference, but the transfer counters of its phase did not
                    move enough to cover it (assigned per phase by ``apply_evidence``).
``explicit_error``  the client was told: a non-200 answer with a reason, or an in-band abort
                    (a stream's last chunk with ``finish_reason.type == "abort"`` and a message).
``leak``            HTTP 200 whose content differs from the reference (including an empty
                    answer): the client got an answer that is not the one for its prompt.
``hang``            no answer within the bound.
``broken``          no usable answer and no reason: the connection failed or was reset, or a
                    non-200 without any message.

**List answers** (``n>1`` parallel sampling: a 200 whose body is a list, ``Answer.samples``):
every sample is judged on its own against the same reference answer (greedy sampling, so each
of the ``n`` samples must equal the single request's greedy answer token for token).
``per_sample`` splits such an answer into one answer per sample, padded with a ``broken``
answer for each sample asked for but missing; the benchmark records one ``RequestRecord`` per
sample (so ``sent`` counts judged answers: a list answer counts its samples). ``classify`` on
an unsplit list answer returns the worst of its samples' outcomes (``SEVERITY``), naming the
sample; it is never ``identical`` unless every sample is. An error, a hang or a refusal is one
answer for the whole request.

Invariant: the classifier never returns ``identical`` for content that differs from the
reference, and never returns ``leak`` for a non-200 answer.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


class Outcome(str, enum.Enum):
    IDENTICAL = "identical"
    UNPROVEN = "unproven"
    EXPLICIT_ERROR = "explicit_error"
    LEAK = "leak"
    HANG = "hang"
    BROKEN = "broken"


#: Outcomes that make the benchmark fail when the fork shows them.
FAILING = (Outcome.LEAK, Outcome.HANG)


@dataclass
class Answer:
    """What the client saw for one HTTP request (``client.send`` fills it)."""

    status: int | None  # None: no HTTP answer at all (timeout or transport error)
    output_ids: list[int] = field(default_factory=list)
    message: str = ""  # the error message of a non-200 answer or of an in-band abort
    timed_out: bool = False
    transport_error: str = ""
    in_band_abort: bool = False
    stream: bool = False
    e2e_s: float | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    finish_reason: Any = None
    prompt_ids: list[int] | None = None  # the prompt as the server tokenized it, when it says
    # A 200 answer whose body was a list (n>1 samples): one Answer per sample, in order.
    samples: list[Answer] | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.in_band_abort and not self.timed_out


#: Worst first: the outcome an unsplit list answer gets is that of its worst sample.
SEVERITY = (Outcome.LEAK, Outcome.HANG, Outcome.BROKEN, Outcome.EXPLICIT_ERROR,
            Outcome.UNPROVEN, Outcome.IDENTICAL)


def _is_list(answer: Answer) -> bool:
    return answer.samples is not None and answer.status == 200 and not answer.timed_out


def per_sample(answer: Answer, n: int = 1) -> list[Answer]:
    """The answers to judge for one request that asked for ``n`` samples: each sample of a 200
    list answer, else the answer itself; a 200 (list or not, no in-band abort) with fewer than
    ``n`` samples is padded with a no-reason answer per missing sample (``broken``: the client
    lost it without being told). An error, a refusal or a hang stays one answer."""
    if _is_list(answer):
        got = list(answer.samples or [])
    elif answer.ok:
        got = [answer]
    else:
        return [answer]
    for i in range(len(got), n):
        got.append(Answer(status=None, transport_error=f"sample {i + 1} of the {n} asked for "
                                                       f"is missing from the 200 answer "
                                                       f"({len(got)} samples)",
                          e2e_s=answer.e2e_s))
    return got


def classify(answer: Answer, expected: Sequence[int] | None) -> tuple[Outcome, str]:
    """(outcome, detail) of ``answer`` against the reference answer ``expected``.

    ``expected`` None means the reference itself failed for this prompt: a 200 answer can then
    not be judged and is reported as ``broken`` with that reason (never as identical). A list
    answer (``samples``) gets its worst sample's outcome (see the module doc)."""
    if answer.timed_out:
        return Outcome.HANG, "no answer within the bound"
    if answer.status is None:
        return Outcome.BROKEN, f"no HTTP answer: {answer.transport_error or 'unknown'}"
    if answer.status != 200:
        if answer.message.strip():
            return Outcome.EXPLICIT_ERROR, f"HTTP {answer.status}: {answer.message[:300]}"
        return Outcome.BROKEN, f"HTTP {answer.status} without a reason"
    if answer.samples is not None:
        if not answer.samples:
            return Outcome.LEAK, "HTTP 200 with an empty list of samples"
        judged = [classify(s, expected) for s in answer.samples]
        i = min(range(len(judged)), key=lambda k: SEVERITY.index(judged[k][0]))
        worst, detail = judged[i]
        if worst is Outcome.IDENTICAL:
            return worst, ""
        return worst, f"sample {i + 1} of {len(judged)}: {detail}"
    if answer.in_band_abort:
        if answer.message.strip():
            return Outcome.EXPLICIT_ERROR, f"in-band abort: {answer.message[:300]}"
        return Outcome.BROKEN, "in-band abort without a reason"
    if expected is None:
        return Outcome.BROKEN, "reference answer unavailable"
    if list(answer.output_ids) == list(expected):
        return Outcome.IDENTICAL, ""
    if not answer.output_ids:
        return Outcome.LEAK, "HTTP 200 with an empty answer"
    same = sum(1 for a, b in zip(answer.output_ids, expected, strict=False) if a == b)
    return Outcome.LEAK, (f"HTTP 200 with other content: {same}/{len(expected)} tokens at their "
                          f"reference position")


@dataclass
class RequestRecord:
    """One judged request of a scenario (what report.json lists per request)."""

    label: str
    path: str  # router | decode-direct | pd-direct | ...
    prompt_len: int
    max_new_tokens: int
    outcome: Outcome
    detail: str = ""
    status: int | None = None
    canary: int | None = None
    leaked_from: list[str] = field(default_factory=list)
    attribution: str = ""
    output_head: list[int] = field(default_factory=list)
    expected_head: list[int] = field(default_factory=list)
    e2e_s: float | None = None
    phase: str = ""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["outcome"] = self.outcome.value
        return d


def count(records: Iterable[RequestRecord]) -> dict[str, int]:
    """Per-outcome counts (every class present, zero when absent) plus ``sent``."""
    out = {o.value: 0 for o in Outcome}
    n = 0
    for r in records:
        out[r.outcome.value] += 1
        n += 1
    out["sent"] = n
    return out


def apply_evidence(records: Sequence[RequestRecord], proven: int) -> int:
    """Turn identical answers beyond ``proven`` transfers into ``unproven``; return how many.

    ``proven`` is the number of requests of the phase whose KV provably travelled (the smaller
    of decode's committed transfers and prefill's sent transfers over the phase). Counters are
    per phase, not per request, so the shortfall is charged to the last identical records (the
    report says the choice is arbitrary within the phase)."""
    ident = [r for r in records if r.outcome is Outcome.IDENTICAL]
    short = max(0, len(ident) - max(0, proven))
    for r in ident[len(ident) - short:]:
        r.outcome = Outcome.UNPROVEN
        r.detail = (f"equal to the reference, but only {proven} transfer(s) were counted for "
                    f"{len(ident)} identical answers in phase {r.phase!r}")
    return short
