"""Helpers shared by the admission tests (kept out of conftest.py so tests can import them).

Server-side facts (advertised limits, error messages) come from ``pdsafe_testkit.servers``;
only what these tests configure lives here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pdsafe_testkit.servers import DEFAULT_MODEL, Limits, PDStack

#: The tiny model's chat template (written by scripts/make_tiny_model.py into the checkpoint),
#: passed explicitly so that the tests also run on checkpoints without one (PDSAFE_MODEL): the
#: chat prompt is the message text.
CHAT_TEMPLATE: str = json.loads(
    (DEFAULT_MODEL / "tokenizer_config.json").read_text())["chat_template"]


@dataclass
class PDCase:
    """A running PD stack plus what the test expects of it."""

    name: str
    smaller: str  # "prefill" | "decode": the side with the lower prompt limit
    page_size: int
    stack: PDStack

    def limits(self, side: str) -> Limits:
        return getattr(self.stack, side).limits()

    @property
    def limit(self) -> int:
        """The longest prompt the pair accepts (the smaller side's max_prompt_tokens)."""
        return min(self.limits("prefill").max_prompt_tokens,
                   self.limits("decode").max_prompt_tokens)
