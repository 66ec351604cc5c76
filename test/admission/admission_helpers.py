"""Helpers shared by the admission tests (kept out of conftest.py so tests can import them)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import requests
from harness.servers import CLAMP_FLAG, DEFAULT_MODEL, PDStack

CLAMP = CLAMP_FLAG
#: The tiny model's chat template (written by scripts/make_tiny_model.py into the checkpoint),
#: passed explicitly so that the tests also run on checkpoints without one (PDSAFE_MODEL): the
#: chat prompt is the message text.
CHAT_TEMPLATE: str = json.loads(
    (DEFAULT_MODEL / "tokenizer_config.json").read_text())["chat_template"]


@dataclass
class Limits:
    """What one server advertises in /model_info."""

    context_length: int
    max_req_input_len: int
    max_prompt_tokens: int
    kv_capacity_tokens: int

    @classmethod
    def of(cls, url: str) -> Limits:
        info = requests.get(url + "/model_info", timeout=30).json()
        return cls(**{k: info[k] for k in cls.__dataclass_fields__})


@dataclass
class PDCase:
    """A running PD stack plus what the test expects of it."""

    name: str
    smaller: str  # "prefill" | "decode": the side with the lower prompt limit
    page_size: int
    clamped: str  # the side started with the clamp flag
    stack: PDStack

    def limits(self, side: str) -> Limits:
        return Limits.of(getattr(self.stack, side).url)

    @property
    def limit(self) -> int:
        """The longest prompt the pair accepts (the smaller side's max_prompt_tokens)."""
        return min(self.limits("prefill").max_prompt_tokens,
                   self.limits("decode").max_prompt_tokens)




def error_message(body: Any) -> str:
    """The message of an error body: ours ({"error": {...}}), the OpenAI handlers' (flat) or
    the router's (which may wrap a server's body as a string)."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            msg = err.get("message", err)
            return error_message(msg) if isinstance(msg, dict) else str(msg)
        return str(err)
    return str(body)
