"""The CPU-only shim that lets DeepSeek-family (MLA) models serve on ``torch_native``
(``sglang.pdsafe.cpu_compat``): installed through upstream's public registry, on the real
upstream dispatch module, never over a handler of upstream's own.

The served proof (an MLA model's PD answers reference-identical, its latent KV digested) is
``test/pd/test_mla_e2e.py``.
"""

from __future__ import annotations

import importlib
import types

from sglang.pdsafe import cpu_compat


def _dispatch_module() -> types.ModuleType:
    return importlib.import_module(cpu_compat.MLA_DISPATCH_MODULE)


def test_torch_native_gets_the_absorbed_mla_path_on_a_cpu_only_torch():
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    assert cpu_compat.is_cpu_only_torch(), "this suite runs on the CPU profile"
    registry = _dispatch_module().AttentionBackendRegistry
    handler = registry.get_handler("torch_native")
    assert handler is cpu_compat.torch_native_mla_method, (
        "importing upstream's dispatch module did not register the torch_native handler")
    assert handler(object(), object()) is AttnForwardMethod.MLA
    # Every other backend keeps upstream's own handler.
    assert registry.get_handler("triton") is not handler


def test_an_upstream_handler_for_torch_native_is_never_replaced():
    """If upstream registers its own ``torch_native`` handler, the shim leaves it alone."""

    class Registry:
        handlers = {"triton": "triton-handler", "torch_native": "upstream-handler"}

        @classmethod
        def get_handler(cls, name):
            return cls.handlers.get(name, cls.handlers["triton"])

        @classmethod
        def register(cls, name, fn):
            cls.handlers[name] = fn

    mod = types.SimpleNamespace(AttentionBackendRegistry=Registry)
    assert cpu_compat.register_torch_native_mla(mod) is False
    assert Registry.handlers["torch_native"] == "upstream-handler"
    del Registry.handlers["torch_native"]
    assert cpu_compat.register_torch_native_mla(mod) is True
    assert Registry.handlers["torch_native"] is cpu_compat.torch_native_mla_method
