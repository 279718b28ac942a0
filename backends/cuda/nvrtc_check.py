"""Compile kernel specialisations with NVRTC from cuda-bindings, without a GPU or CuPy.

Used by the CI test (tests/test_cuda_nvrtc.py): it proves that every source the
launcher can request compiles for a given architecture with the compiler CuPy
uses at run time. The kernels include no CUDA headers, so no include path is needed.
"""
from __future__ import annotations

from .compile import kernel_source, nvrtc_options
from .variants import Variant


def unavailable_reason() -> str:
    """Why NVRTC cannot compile here ("" when it can): what a test skips with."""
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        return "cuda-bindings is not installed (pip install cuda-bindings)"
    try:
        nvrtc.nvrtcVersion()
    except Exception as err:  # noqa: BLE001 - the bindings load libnvrtc lazily
        return f"libnvrtc not found (pip install nvidia-cuda-nvrtc): {str(err).splitlines()[0] if str(err) else err!r}"
    return ""


def compile_source(source: str, name: str, options) -> tuple[bool, str, int]:
    """(ok, log, cubin bytes) of one NVRTC compile of `source` with `options`."""
    from cuda.bindings import nvrtc

    def check(result):
        return result[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS

    res = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    if not check(res):
        return False, f"nvrtcCreateProgram failed: {res[0]}", 0
    prog = res[1]
    try:
        opts = [o.encode() for o in options]
        compiled = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        log_size = nvrtc.nvrtcGetProgramLogSize(prog)[1]
        log = b" " * log_size
        nvrtc.nvrtcGetProgramLog(prog, log)
        log = log.decode(errors="replace").rstrip("\x00 \n")
        if not check(compiled):
            return False, log, 0
        return True, log, nvrtc.nvrtcGetCUBINSize(prog)[1]
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def nvrtc_compile(variant: Variant, arch: str) -> tuple[bool, str, int]:
    """(ok, log, cubin bytes) of one NVRTC compile of `variant` for `arch`."""
    return compile_source(kernel_source(variant.source), variant.source, nvrtc_options(variant, arch))
