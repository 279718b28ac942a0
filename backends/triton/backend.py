"""triton: FlashAttention-2 forward and backward written once for NVIDIA (sm80+) and AMD (CDNA2/3, RDNA3).

Declarations only; the kernels and their launcher (`launch.py`) are imported on first use,
so this module imports without triton installed.
"""
from __future__ import annotations

import os

import torch

from attnx.backend import Backend
from attnx.limits import length_reasons
from attnx.problem import FORMAT_PAIRS

from . import configs

MAX_GRID_Y = 65535            # batch * heads rides on the grid's second axis


def interpreter_active() -> bool:
    """Triton's own switch for its CPU interpreter (read when kernels are first imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class TritonBackend(Backend):
    name = "triton"
    description = ("FlashAttention-2 in Triton (forward + recomputing backward, no atomics), packed/cache/paged "
                   "formats and split-KV decode; NVIDIA sm80+ and AMD gfx90a/gfx942/gfx11; on CPU tensors only "
                   "under TRITON_INTERPRET=1")
    min_capability = (8, 0)
    amd_archs = frozenset({"gfx90a", "gfx94", "gfx110"})
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32})
    max_head_dim = max(configs.BLOCK_DS)
    deterministic = True
    supports_offset = True
    supports_sinks = True
    # every pair: packed, cache and paged formats are runtime arguments of the same kernels
    # (paged keys: forward in-kernel through the page table; backward gathers the pages into a cache)
    formats = FORMAT_PAIRS
    # Measured faster than the cuda backend's Ampere family on Hopper (docs/backends.md); "cpu" is the
    # interpreter (TRITON_INTERPRET=1), a test mode that must never outrank blocked (20) or naive.
    priority = {"cuda:sm_90": 90, "cuda": 70, "cpu": 0}
    required_modules = ("triton",)
    install_hint = 'pip install "attnx[triton]"'

    # CPU tensors are accepted only while Triton's interpreter is on (a test mode, never a default)
    @property
    def device_types(self):
        return frozenset({"cuda", "cpu"}) if interpreter_active() else frozenset({"cuda"})

    @property
    def vendors(self):
        return frozenset({"nvidia", "amd", "cpu"}) if interpreter_active() else frozenset({"nvidia", "amd"})

    def environment_reasons(self) -> list[str]:
        if interpreter_active() or torch.cuda.is_available():
            return []
        return ["no CUDA or ROCm GPU visible to torch (TRITON_INTERPRET=1 runs it on CPU tensors, slowly)"]

    def extra_reasons(self, p) -> list[str]:
        reasons = length_reasons(p)
        if p.batch * max(p.heads_q, 1) > MAX_GRID_Y:
            reasons.append(f"batch * heads = {p.batch * p.heads_q} above the grid limit {MAX_GRID_Y}")
        if p.vendor == "nvidia" and p.dtype == torch.bfloat16 and p.capability is not None and p.capability < (8, 0):
            reasons.append("bfloat16 needs compute capability 8.0+")
        if p.device_type == "cuda":
            fam = configs.family(p.vendor, p.arch)
            bd = configs.block_d(p.head_dim, p.head_dim_v)
            path = configs.path_of(p)
            for kernel in configs.KERNELS if p.needs_grad else ("fwd",):
                why = configs.unsupported_reason(fam, kernel, path, bd, configs.DTYPE_NAMES[p.dtype])
                if why:
                    reasons.append(why)
        return reasons

    def forward(self, p, x):
        from .launch import forward

        return forward(p, x)

    def backward(self, p, x, out, lse, dout):
        from .launch import backward

        return backward(p, x, out, lse, dout)


BACKEND = TritonBackend()
