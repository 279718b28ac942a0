"""The cuda backend: FlashAttention-2 kernels in CUDA C++ compiled at run time (CuPy is imported lazily)."""
from .backend import BACKEND, CudaBackend


def compile_time_report():
    """Per loaded kernel specialisation: seconds to compile (or load from cache), registers, spills."""
    from .compile import compile_time_report as report

    return report()


__all__ = ["BACKEND", "CudaBackend", "compile_time_report"]
