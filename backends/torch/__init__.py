"""torch: torch's own fused SDPA kernels (the CPU flash kernel; cuDNN and flash on NVIDIA GPUs).

Installed as ``attnx.backends.torch``; its modules import the real ``torch`` package by
absolute imports, as every module does.
"""
from .backend import BACKEND

__all__ = ["BACKEND"]
