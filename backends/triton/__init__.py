"""The Triton backend: FlashAttention-2 kernels written once for NVIDIA and AMD GPUs."""
from .backend import BACKEND, TritonBackend

__all__ = ["BACKEND", "TritonBackend"]
