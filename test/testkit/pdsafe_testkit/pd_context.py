"""A published PD server context for server-free tests of scheduler-side hooks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from unittest.mock import patch


@contextmanager
def published_pd_context(mode: str) -> Iterator[str]:
    """Publish a ``disaggregation_mode=mode`` server context (what every server process does at
    startup) with tp_rank 0 stated (no process group); reset it again on exit."""
    from sglang.srt.runtime_context import publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(ServerArgs(model_path="dummy", disaggregation_mode=mode), role="tokenizer")
    try:
        with patch("sglang.srt.managers.schedule_batch.get_parallel",
                   return_value=SimpleNamespace(tp_rank=0)):
            yield mode
    finally:
        reset_context()
