"""Numbers every kernel launcher shares: position limits, the unbounded-window stand-in, base-2 lse.

Kernels do window arithmetic (``p_i - left``, ``p_i + right``) on int32 positions. Keeping every
length and offset below `MAX_SEQLEN` and standing `UNBOUNDED_WINDOW` in for a side of None
keeps each such sum inside int32.
"""
from __future__ import annotations

import math

import torch

LOG2E = math.log2(math.e)      # kernels run the softmax in base 2 (exp2 is the hardware's)
MAX_SEQLEN = 1 << 28           # lengths, and |offset|, stay below this
UNBOUNDED_WINDOW = 1 << 30     # a window side of None; 2 * 2**28 + 2**30 < 2**31


def length_reasons(p) -> list[str]:
    """Why a kernel backend declines `p`'s lengths or offset (empty when they fit)."""
    longest = max(p.seqlen_q, p.seqlen_k)
    if longest >= MAX_SEQLEN:
        return [f"sequence length {longest} at or above {MAX_SEQLEN} (int32 position arithmetic)"]
    return []


def kernel_window(p) -> tuple[int, int]:
    """``(left, right)`` window sides as kernels take them: ints, `UNBOUNDED_WINDOW` for None."""
    left = UNBOUNDED_WINDOW if p.window_left is None else min(p.window_left, UNBOUNDED_WINDOW)
    right = UNBOUNDED_WINDOW if p.window_right is None else min(p.window_right, UNBOUNDED_WINDOW)
    return left, right


def lse_log2(lse: torch.Tensor) -> torch.Tensor:
    """``lse * log2(e)`` for a backward kernel, with ``+inf`` for rows that saw nothing (so P = 0 there)."""
    return torch.where(lse == float("-inf"), torch.full_like(lse, float("inf")), lse * LOG2E).contiguous()
