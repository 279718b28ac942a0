"""Whether tensors share memory: a write through one would change what another reads.

Caches check it before appending (`attnx.KVCache`, `flash_attn_with_kvcache`): one tensor passed as
both k and v, or an expanded view, would have values written over keys.
"""
from __future__ import annotations

import torch


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two positions of `t` share memory (an expanded view): writes through it would collide."""
    if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
        return True
    check = getattr(torch, "_debug_has_internal_overlap", None)  # 1: overlaps (0: no, 2: too hard to tell)
    return check is not None and check(t) == 1


def shares_memory(k: torch.Tensor, v: torch.Tensor, budget: int = 10_000) -> bool:
    """Whether an element of ``k`` and an element of ``v`` are one memory location (same dtype).

    Exact: solves ``sum_d c_d * stride_d = offset(v) - offset(k)`` over the coefficient ranges of both
    tensors' dims (dims of equal stride merged), a few steps for real layouts. Interleaved views of one
    buffer (a packed ``kv``) do not overlap and pass. A search that would take more than ``budget`` steps
    (pathological strides) reports no overlap: the check never raises a false alarm.
    """
    if not k.numel() or not v.numel() or k.device != v.device or k.is_meta:
        return False
    if k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr():
        return False
    size = k.element_size()
    gap = v.data_ptr() - k.data_ptr()
    if gap % size:  # misaligned views of one buffer: compare the byte ranges
        ends = [t.data_ptr() + size * (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) for t in (k, v)]
        return k.data_ptr() < ends[1] and v.data_ptr() < ends[0]
    ranges: dict[int, tuple[int, int]] = {}  # stride -> (lowest, highest) coefficient
    for t, sign in ((k, 1), (v, -1)):
        for n, stride in zip(t.shape, t.stride()):
            if n > 1 and stride:
                low, high = ranges.get(stride, (0, 0))
                ranges[stride] = (low, high + n - 1) if sign > 0 else (low - (n - 1), high)
    terms = sorted(ranges.items(), reverse=True)
    reach = [(0, 0)] * (len(terms) + 1)  # what the terms from i on can add up to
    for i in range(len(terms) - 1, -1, -1):
        stride, (low, high) = terms[i]
        reach[i] = (reach[i + 1][0] + low * stride, reach[i + 1][1] + high * stride)
    steps = [budget]

    def solve(i: int, rest: int) -> bool:
        if i == len(terms):
            return rest == 0
        stride, (low, high) = terms[i]
        inner_low, inner_high = reach[i + 1]
        for c in range(max(low, -((inner_high - rest) // stride)), min(high, (rest - inner_low) // stride) + 1):
            steps[0] -= 1
            if steps[0] < 0:
                raise OverflowError
            if solve(i + 1, rest - c * stride):
                return True
        return False

    try:
        return solve(0, gap // size)
    except OverflowError:
        return False
