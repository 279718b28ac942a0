"""Compile kernel specialisations with NVRTC from cuda-bindings, without a GPU or CuPy.

Used by the CI test (tests/test_cuda_nvrtc.py): it proves that every source the
launcher can request compiles for a given architecture with the compiler CuPy
uses at run time. The kernels include no CUDA headers, so no include path is needed.
"""
from __future__ import annotations

from .compile import kernel_source, nvrtc_options
from .variants import Variant


def nvrtc_compile(variant: Variant, arch: str) -> tuple[bool, str, int]:
    """(ok, log, cubin bytes) of one NVRTC compile of `variant` for `arch`."""
    from cuda.bindings import nvrtc

    def check(result):
        err = result[0]
        return err == nvrtc.nvrtcResult.NVRTC_SUCCESS

    source = kernel_source(variant.source).encode()
    res = nvrtc.nvrtcCreateProgram(source, variant.source.encode(), 0, [], [])
    if not check(res):
        return False, f"nvrtcCreateProgram failed: {res[0]}", 0
    prog = res[1]
    try:
        opts = [o.encode() for o in nvrtc_options(variant, arch)]
        compiled = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        log_size = nvrtc.nvrtcGetProgramLogSize(prog)[1]
        log = b" " * log_size
        nvrtc.nvrtcGetProgramLog(prog, log)
        log = log.decode(errors="replace").rstrip("\x00 \n")
        if not check(compiled):
            return False, log, 0
        size = nvrtc.nvrtcGetCUBINSize(prog)[1]
        return True, log, size
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
