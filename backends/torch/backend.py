"""torch: torch's own fused attention kernels, for the problems they compute exactly as attnx does.

What each device path computes is declared as data: the class attributes are the CPU path,
`cuda.CUDA_DECLARATIONS` what differs on CUDA (`Backend.device_declarations`), so the shared
reason code declines exactly what a path does not compute.

On the CPU: the flash kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``): every
float dtype and head dim, GQA, bool/additive masks, causal, windows and explicit offsets
(rules ``is_causal`` cannot say become an additive mask; see ``masks.py``). On NVIDIA GPUs:
cuDNN and FlashAttention-2 for fp16/bf16, head dims multiple of 8 up to 256, no mask tensor,
no window or offset, causal only with Sq == Sk (``cuda.py``). The lse comes from the ops
themselves (they return logsumexp); the backward calls their backward ops. Declined everywhere:
softcap, ALiBi, sinks, mask gradients, ``Dv != D``, the varlen/cache/paged formats.
"""
from __future__ import annotations

import math

import torch

from attnx.backend import Backend
from attnx.inputs import Grads, Inputs
from attnx.limits import length_reasons
from attnx.problem import Problem, length_bucket

from . import cpu, cuda
from .cpu import forward as _cpu_forward
from .masks import needs_mask_tensor, needs_positional_mask

# An additive mask the kernel would need that is larger than this (elements) is declined:
# 2**28 float32 values are 1 GiB, and blocked computes the same without one.
MAX_MASK_ELEMENTS = 1 << 28


def mask_elements(p: Problem) -> int:
    """Elements of the additive mask the CPU kernel would get (on power-of-two length buckets)."""
    lead = math.prod(p.mask_shape[:2]) if p.mask_shape else 1
    return lead * length_bucket(p.seqlen_q) * length_bucket(p.seqlen_k)


class TorchBackend(Backend):
    name = "torch"
    description = ("torch's fused SDPA kernels: the CPU flash kernel (any dtype, GQA, masks, windows via an "
                   "additive mask); cuDNN/FlashAttention-2 on NVIDIA GPUs (fp16/bf16, no mask tensor); lse "
                   "from the aten ops that return it")
    device_types = frozenset({"cpu", "cuda"})
    min_capability = (8, 0)
    supports_dv_differs = False
    supports_mask_grad = False
    supports_alibi = False
    supports_softcap = False
    supports_offset = True
    deterministic = True   # the CPU kernel; not declared on CUDA (cuda.CUDA_DECLARATIONS)
    device_declarations = {"cuda": cuda.CUDA_DECLARATIONS}
    # CPU: ahead of blocked (20) and naive (30 for small problems) where measured faster
    # (benchmarks/results/cpu-2026-12-01); CUDA: behind triton and cuda, ahead of blocked,
    # except where cuDNN was measured fastest on the H200 (`rank`).
    priority = {"cpu": 40, "cuda": 50}

    def environment_reasons(self) -> list[str]:
        if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
            return [f"torch {torch.__version__} lacks aten::_scaled_dot_product_flash_attention_for_cpu"]
        return []

    def extra_reasons(self, p: Problem) -> list[str]:
        """Size limits only (the declarations say the rest): CUDA: int32 positions; CPU: masks up to 2**28 values.

        On CPUs a mask the kernel would need (windows, offsets, bool masks) is built in the
        accumulation dtype; one above 2**28 elements (1 GiB in float32) is declined.
        """
        if p.device_type == "cuda":
            return length_reasons(p)
        if needs_mask_tensor(p) and mask_elements(p) > MAX_MASK_ELEMENTS:
            return [f"would build an additive mask of {mask_elements(p)} elements (more than 2**28); "
                    "blocked needs none"]
        return []

    def rank(self, p: Problem) -> int:
        """95 on sm_90 where cuDNN was measured fastest (97 without lse, where it beat cuda, decoding
        included: `cuda.cudnn_decodes`); CPU: 15 with a mask.

        95 is just above triton's 90 (H200: cuDNN 1.3-1.7x triton, MHA, D 64/128, S >= 512, with
        gradients; forward-only with lse only where `cuda.cudnn_forward_wins`: computing lse slows
        cuDNN's forward below triton's at short lengths). Without lse (`Problem.wants_lse`) cuDNN's
        forward also beat the cuda backend's (96) at d64 and up to 4k tokens: 97 there. On CPUs
        blocked (20) skips the hidden tiles instead of masking them: 1.5-5x faster there.
        """
        if p.device_type == "cuda" and cuda.cudnn_decodes(p):
            return 97  # ahead of the cuda backend's decode kernel (96), measured
        if p.device_type == "cuda" and cuda.cudnn_wins(p):
            if not p.wants_lse:  # cuDNN's own forward, no lse: ahead of triton; of cuda (96) where faster
                return 97 if cuda.cudnn_beats_hopper_forward(p) else 95
            if p.needs_grad or cuda.cudnn_forward_wins(p):
                return 95
        if p.device_type == "cpu" and needs_positional_mask(p):
            return 15
        return super().rank(p)

    def forward(self, p: Problem, x: Inputs):
        if p.device_type == "cpu":  # (the CPU first: its calls are short, every lookup shows)
            return _cpu_forward(p, x)
        return cuda.forward(p, x)

    def dense_forward(self, p: Problem):
        return cpu.dense_forward(p) if p.device_type == "cpu" else None

    def backward(self, p: Problem, x: Inputs, out, lse, dout) -> Grads:
        return (cuda if p.device_type == "cuda" else cpu).backward(p, x, out, lse, dout)

    def doctor_details(self) -> dict:
        return {"torch": torch.__version__}


BACKEND = TorchBackend()
