"""The CPU harness's stacks for the regression benchmark (harness mode only).

Real servers started through ``pdsafe_testkit.servers`` (the test-only distribution) on the
tiny model, one stack kind (``targets.STACK_KINDS``) per configuration a scenario needs, either
variant: ``fork`` = the installed package, ``base`` = the tree of ``benchmark.base_tree``
(``PYTHONPATH`` per server). Deployment mode never imports this module, so the benchmark's
client-only install (``pip install ./benchmark``) needs neither the testkit nor sglang.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pdsafe_testkit.servers import (
    DEFAULT_MODEL,
    ServerConfig,
    SGLangServer,
    StartupError,
    colocated_server,
    pd_stack,
)

from benchmark.base_tree import BaseTree
from benchmark.canary import CanaryBook
from benchmark.targets import (
    CHAT_SUFFIX,
    LATE_HOLDS_S,
    REFERENCE_POOL,
    STACK_KINDS,
    PDTarget,
    StackKind,
    chat_template_text,
    verify_variant,
    word_vocab,
)

__all__ = ["Harness", "StartupError", "vocab_size"]


def vocab_size(model_path: Path = DEFAULT_MODEL) -> int:
    import json

    return int(json.loads((Path(model_path) / "config.json").read_text())["vocab_size"])


class Harness:
    """Starts and stops the CPU harness's servers for both variants (one reference server)."""

    def __init__(self, log_dir: Path, *, base: BaseTree | None, model: Path = DEFAULT_MODEL,
                 reference_variant: str = "fork") -> None:
        self.log_dir, self.base, self.model = log_dir, base, model
        self.reference_variant = reference_variant
        self._ref_cm: Any = None
        self.reference: SGLangServer | None = None
        self.reference_version = ""
        self.vocab = vocab_size(model)

    def env(self, variant: str) -> dict[str, str]:
        if variant == "base":
            if self.base is None:
                raise ValueError("base variant requested without a base tree")
            return self.base.env()
        return {}

    def start_reference(self) -> str:
        """Start the co-located reference (greedy oracle); return its URL."""
        if self.reference is None:
            cfg = ServerConfig(role="colocated", model_path=self.model,
                               max_total_tokens=REFERENCE_POOL,
                               env=self.env(self.reference_variant))
            self._ref_cm = colocated_server(self.log_dir, cfg)
            self.reference = self._ref_cm.__enter__()
            self.reference_version = verify_variant({"reference": self.reference.url},
                                                    self.reference_variant)["reference"]
        return self.reference.url

    def stop_reference(self) -> None:
        if self._ref_cm is not None:
            cm, self._ref_cm, self.reference = self._ref_cm, None, None
            cm.__exit__(None, None, None)

    @contextlib.contextmanager
    def stack(self, variant: str, backend: str, page_size: int, kind: str | StackKind, *,
              env: dict[str, str] | None = None):
        """Start one PD stack of ``kind`` (a ``STACK_KINDS`` name, or a ``StackKind`` of the
        caller's own) for ``variant``; yield its ``PDTarget``; stop it. ``env``: extra
        environment for both legs (after the variant's own; e.g. a pdsafe setting that both
        legs must agree on); not supported for the ``late_write`` stack."""
        k = kind if isinstance(kind, StackKind) else STACK_KINDS[kind]
        kind = k.name
        if k.late_write_trio:
            if env:
                raise ValueError("extra env is not supported for the late_write stack")
            with self._late_write_stack(variant, backend, page_size, kind) as target:
                yield target
            return

        def cfg(role: str, pool: int) -> ServerConfig:
            extra: list[str] = []
            if k.chat_templates:
                tpl = self.log_dir / f"chat-template-{role}.jinja"
                tpl.write_text(chat_template_text(CHAT_SUFFIX[role], word_vocab(self.model)))
                extra = ["--chat-template", str(tpl)]
            env_ = dict(self.env(variant))
            env_.update(env or {})
            if role == "decode" and k.decode_faults:
                env_["SGLANG_PDSAFE_TEST_FAULTS"] = k.decode_faults
            return ServerConfig(role=role, model_path=self.model, backend=backend,
                                max_total_tokens=pool, page_size=page_size,
                                context_length=k.context_length(role),
                                allow_auto_truncate=k.auto_truncate, extra_args=extra,
                                env=env_)

        with pd_stack(backend, self.log_dir, prefill=cfg("prefill", k.prefill_pool),
                      decode=cfg("decode", k.decode_pool), with_router=k.router) as st:
            urls = {"prefill": st.prefill.url, "decode": st.decode.url}
            versions = verify_variant(urls, variant)
            assert st.prefill.bootstrap_port is not None
            yield PDTarget(variant, backend, page_size, kind, st.prefill.url, st.decode.url,
                           st.router.url if st.router else None, "127.0.0.1",
                           st.prefill.bootstrap_port, versions, CanaryBook(self.vocab), st)

    @contextlib.contextmanager
    def _late_write_stack(self, variant: str, backend: str, page_size: int,
                          kind: str) -> Iterator[PDTarget]:
        """The ``late_write`` stack (``pdsafe_testkit.late_write.late_write_stack``): the
        test-only fault is armed here, on harness servers only."""
        from pdsafe_testkit.late_write import late_write_stack

        with late_write_stack(backend, self.log_dir, self.model, self.env(variant),
                              held_s=LATE_HOLDS_S["held"], other_s=LATE_HOLDS_S["other"],
                              page_size=page_size) as trio:
            versions = verify_variant({"prefill": trio.held.url, "prefill_other": trio.other.url,
                                       "decode": trio.decode.url}, variant)
            assert trio.other.bootstrap_port is not None
            yield PDTarget(variant, backend, page_size, kind, trio.other.url, trio.decode.url,
                           None, "127.0.0.1", trio.other.bootstrap_port, versions,
                           CanaryBook(self.vocab), trio.pair(trio.other), trio=trio)
