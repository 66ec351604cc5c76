"""The KV digest's Triton kernels compile for real GPUs, ahead of time, on a machine without one.

Triton's interpreter (test_kv_digest_triton.py) checks what the kernels compute, with numpy; it
does not lower them. This test compiles them through Triton's real pipeline (TTIR, TTGIR, LLVM
IR, then ``ptxas`` to a cubin for an H100/H200, sm_90, and the AMD backend to a code object for
an MI300, gfx942), which needs no device: a construct the interpreter accepts but the compiler
rejects (a type the lowering does not support, a loop-carried value that changes type) fails
here. Each variant the host code launches is compiled: the long kernel
with int64 word loads and with byte loads, and the short-input kernel.

Skipped when triton is not importable, under ``TRITON_INTERPRET=1`` (the kernels are then
interpreted functions), and per backend when the installed triton lacks it.
"""

from __future__ import annotations

from typing import Any

import pytest

triton = pytest.importorskip("triton")

from sglang.pdsafe import kv_digest_triton as kdt  # noqa: E402  (after the triton skip)

if kdt.interpreting():
    pytest.skip("TRITON_INTERPRET=1: the kernels are interpreted, not compiled",
                allow_module_level=True)

_LONG = {"src_ptr": "*u8", "words_ptr": "*i64", "secret_ptr": "*u8", "off_ptr": "*i64",
         "len_ptr": "*i64", "dst_ptr": "*i64", "out_ptr": "*i64", "ALIGNED": "constexpr",
         "BLOCKS": "constexpr"}
_SHORT = {"src_ptr": "*u8", "secret_ptr": "*u8", "off_ptr": "*i64", "len_ptr": "*i64",
          "dst_ptr": "*i64", "out_ptr": "*i64"}


def _compile(target: Any, fn: Any, signature: dict[str, str], constexprs: dict[str, Any],
             num_warps: int) -> Any:
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=target, options={"num_warps": num_warps})


@pytest.mark.parametrize("backend,arch,warp,binary", [("cuda", 90, 32, "cubin"),
                                                      ("hip", "gfx942", 64, "hsaco")])
def test_kernels_compile_for_a_real_gpu(backend: str, arch: Any, warp: int, binary: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget

    if {"cuda": "nvidia", "hip": "amd"}[backend] not in backends:
        pytest.skip(f"this triton has no {backend} backend")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # silence 3.9's default-change warning
    target = GPUTarget(backend, arch, warp)
    variants = [(kdt._xxh3_long_kernel, {**_LONG, "words_ptr": "*i64"},
                 {"ALIGNED": True, "BLOCKS": kdt.DEFAULT_BLOCKS}, 4),
                (kdt._xxh3_long_kernel, {**_LONG, "words_ptr": "*u8"},
                 {"ALIGNED": False, "BLOCKS": kdt.DEFAULT_BLOCKS}, 4),
                (kdt._xxh3_short_kernel, _SHORT, {}, 1)]
    for fn, sig, const, warps in variants:
        compiled = _compile(target, fn, sig, const, warps)
        assert compiled.asm.get(binary), f"{fn.__name__} {const}: no {binary}"
