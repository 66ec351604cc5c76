"""Compatibility shims that let the pinned SGLang run on a CPU-only torch build.

Invariant: every shim here is a no-op unless torch is a CPU-only build (``torch.version.cuda``
and ``torch.version.hip`` both unset). GPU installs never see any of it.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_installed = False


def is_cpu_only_torch() -> bool:
    """True when the installed torch has neither CUDA nor ROCm support compiled in."""
    import torch

    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


def _define_torchvision_op_schemas() -> None:
    """Let PyPI's (CUDA-only) torchvision import beside a CPU torch.

    torchvision's ``_meta_registrations`` registers fake kernels for ``torchvision::nms`` and
    ``torchvision::qnms`` unconditionally; when its compiled ops cannot load (CUDA build on a
    CPU torch) the schemas are missing and the import fails. Defining the two schemas first
    lets the pure-Python parts (transforms) import; calling the ops would still fail loudly.
    """
    import torch

    if importlib.util.find_spec("torchvision") is None:
        return
    for name in ("nms", "qnms"):
        try:
            torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
        except RuntimeError:
            schema = (
                "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
                if name == "nms"
                else "(Tensor qdets, Tensor qscores, float iou_threshold) -> Tensor"
            )
            torch.library.define(f"torchvision::{name}", schema)


def install() -> None:
    """Install the CPU shims once; safe to call from several import sites."""
    global _installed
    if _installed:
        return
    _installed = True
    try:
        if not is_cpu_only_torch():
            return
        _install_all()
    except Exception as e:  # never break import of sglang itself
        logger.warning("sglang-pdsafe CPU compatibility shims not installed: %s", e)


class _MissingKernel:
    """Stands in for one ``sgl_kernel`` attribute on a CPU-only install; fails loudly on use."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(
            f"{self._qualname} was called, but sgl-kernel is not installed (no CPU build of "
            "sgl-kernel is published). This code path needs a GPU install of sglang, or an "
            "sgl-kernel CPU build from source."
        )

    def __getattr__(self, name: str) -> _MissingKernel:
        if name.startswith("__"):
            raise AttributeError(name)
        return _MissingKernel(f"{self._qualname}.{name}")

    def __repr__(self) -> str:
        return f"<missing {self._qualname}>"


def _make_absent_sgl_kernel_finder():  # noqa: ANN202 - importlib protocol objects
    import importlib.abc
    import importlib.machinery
    import types

    class _AbsentModule(types.ModuleType):
        def __getattr__(self, name: str) -> _MissingKernel:
            if name.startswith("__"):
                raise AttributeError(name)
            return _MissingKernel(f"{self.__name__}.{name}")

    class _Loader(importlib.abc.Loader):
        def create_module(self, spec):  # noqa: ANN001, ANN202
            mod = _AbsentModule(spec.name)
            mod.__path__ = []  # a package, so ``sgl_kernel.x`` submodule imports resolve here
            mod.__pdsafe_absent__ = True
            return mod

        def exec_module(self, module) -> None:  # noqa: ANN001
            return None

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001, ANN202
            if fullname == "sgl_kernel" or fullname.startswith("sgl_kernel."):
                return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
            return None

    return _Finder()


def _tolerate_absent_sgl_kernel() -> None:
    """Let module-level ``sgl_kernel`` imports succeed when sgl-kernel is not installed.

    Only when it is genuinely absent (a real install is never shadowed: the finder is appended
    last on ``sys.meta_path`` and only added when ``find_spec`` finds nothing). Every attribute
    is a placeholder that raises a clear error when called, so a CPU path that actually needs
    an sgl-kernel op fails loudly instead of computing garbage.
    """
    import sys

    if importlib.util.find_spec("sgl_kernel") is not None:
        return
    sys.meta_path.append(_make_absent_sgl_kernel_finder())
    logger.info("sgl-kernel not installed: module-level imports tolerated (CPU-only torch)")


#: Upstream's module that picks how a DeepSeek-family (MLA) attention layer runs, per backend.
MLA_DISPATCH_MODULE = "sglang.srt.models.deepseek_common.attention_backend_handler"


def torch_native_mla_method(attn: object, forward_batch: object) -> object:
    """DeepSeek-family attention on the ``torch_native`` backend: always the absorbed MLA path.

    Upstream registers no handler for ``torch_native``, so it gets the ``triton`` one, which
    runs a fresh prefill on the MHA path: its ``qk_nope + qk_rope``-wide keys then meet
    ``torch_native``'s read of the latent rows of ``MLATokenToKVPool``
    (``kv_lora_rank + qk_rope`` wide) and the first prefill fails. The absorbed path reads and
    writes exactly the pool's latent rows, in prefill and decode alike (what the ``triton``
    handler itself does under deterministic inference, and what the CPU engine's own
    ``intel_amx`` backend does with sgl-kernel's CPU operators)."""
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    return AttnForwardMethod.MLA


def register_torch_native_mla(module: object) -> bool:
    """Register :func:`torch_native_mla_method` for ``torch_native`` in ``module``'s
    ``AttentionBackendRegistry`` (upstream's public ``register``), unless upstream has a
    handler of its own for it (then upstream's stays). True when registered."""
    registry = module.AttentionBackendRegistry  # type: ignore[attr-defined]
    if registry.get_handler("torch_native") is not registry.get_handler("triton"):
        return False
    registry.register("torch_native", torch_native_mla_method)
    return True


def _run_after_import(fullname: str, then: Callable[[Any], object]) -> None:
    """Call ``then(module)`` once ``fullname`` has executed (at once if it already has)."""
    import importlib.abc
    import importlib.machinery
    import sys

    if fullname in sys.modules:
        then(sys.modules[fullname])
        return

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN202
            if name != fullname:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return None
            loader_exec = spec.loader.exec_module

            def exec_module(module: Any) -> None:
                loader_exec(module)
                then(module)

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _Finder())


def _absorbed_mla_on_torch_native() -> None:
    """Let DeepSeek-family (MLA) models serve on the CPU engine's ``torch_native`` fallback
    (:func:`torch_native_mla_method`), registered when upstream's dispatch module loads."""
    _run_after_import(MLA_DISPATCH_MODULE, register_torch_native_mla)


def _install_all() -> None:
    _define_torchvision_op_schemas()
    _tolerate_absent_sgl_kernel()
    _absorbed_mla_on_torch_native()
