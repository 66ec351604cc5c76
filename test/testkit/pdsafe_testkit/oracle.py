"""The content oracle: a PD answer must equal the co-located server's, token for token.

The incident's lesson: an HTTP 200 proves nothing. Every PD answer is judged on content
against a co-located (non-PD) server of the same build and model, for the same greedy request:
it is either IDENTICAL to the reference, or an EXPLICIT_ERROR (non-200 with a message), and
anything else is WRONG_CONTENT: a leak or corruption.

Decoding on CPU is deterministic for this model: float32, one OMP thread per server, torch_native
attention, and a model trained to predict with large logit margins (scripts/make_tiny_model.py
reports them), so batch composition cannot flip a greedy choice. No tolerance is applied.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdsafe_testkit.servers import GenResult, generate


class Verdict(enum.Enum):
    IDENTICAL = "identical"
    EXPLICIT_ERROR = "explicit_error"
    WRONG_CONTENT = "wrong_content"


@dataclass
class Oracle:
    """Reference answers from a co-located server, memoized per (prompt, max_new_tokens)."""

    reference_url: str
    _cache: dict[tuple[tuple[int, ...], int], list[int]] = field(default_factory=dict)

    def expected(self, input_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        key = (tuple(input_ids), max_new_tokens)
        if key not in self._cache:
            r = generate(self.reference_url, input_ids, max_new_tokens)
            if not r.ok:
                raise AssertionError(f"reference server failed: {r.status} {r.body}")
            self._cache[key] = r.output_ids
        return self._cache[key]

    def judge(self, result: GenResult, input_ids: Sequence[int], max_new_tokens: int) -> Verdict:
        if result.status != 200:
            return Verdict.EXPLICIT_ERROR if result.error_message else Verdict.WRONG_CONTENT
        if result.output_ids == self.expected(input_ids, max_new_tokens):
            return Verdict.IDENTICAL
        return Verdict.WRONG_CONTENT

    def assert_identical(self, result: GenResult, input_ids: Sequence[int],
                         max_new_tokens: int, what: str = "") -> None:
        exp = self.expected(input_ids, max_new_tokens)
        assert result.status == 200, f"{what}: HTTP {result.status}: {result.error_message}"
        assert result.output_ids == exp, (
            f"{what}: PD answer differs from the co-located reference "
            f"(prompt len {len(input_ids)}):\n  got      {result.output_ids}\n  expected {exp}"
        )

    def assert_identical_or_error(self, result: GenResult, input_ids: Sequence[int],
                                  max_new_tokens: int, what: str = "") -> Verdict:
        v = self.judge(result, input_ids, max_new_tokens)
        assert v is not Verdict.WRONG_CONTENT, (
            f"{what}: HTTP {result.status} with content that is not the reference answer "
            f"(prompt len {len(input_ids)}):\n  got      {result.output_ids}\n"
            f"  expected {self.expected(input_ids, max_new_tokens)}"
        )
        return v


def word_token_range(model_path: Path) -> tuple[int, int]:
    """[lo, hi) of the plain word tokens of the tiny model (no special tokens)."""
    import json

    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return 4, int(cfg["vocab_size"])


def random_prompt(rng: random.Random, length: int, model_path: Path) -> list[int]:
    lo, hi = word_token_range(model_path)
    return [rng.randrange(lo, hi) for _ in range(length)]
