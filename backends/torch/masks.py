"""What torch's fused kernels are told about masking: ``is_causal`` and one additive mask.

torch's kernels know two rules: ``is_causal`` (top-left: query ``i`` sees key ``j <= i``)
and an additive ``attn_mask``. attnx's rules map onto them exactly:

* a causal/window rule whose right side is ``j <= i`` and that has no left side is
  ``is_causal`` (bottom-right causal when ``Sq == Sk``, ``offset=0`` causal otherwise);
* every other positional rule, and a bool mask, become ``-inf`` entries of an additive
  mask in the accumulation dtype (float32 for fp16/bf16, as the formula adds it);
* an additive mask is added as it is (converted to the accumulation dtype).

A ``-inf`` that stands for a *hidden* key differs from the formula in one way: the
kernel adds it to the score, so a NaN score (a non-finite ``q`` or ``k``) leaks into a
row that should not see it. `KernelMask.hides` says when that can happen; the backend
then checks ``q`` and ``k`` for non-finite values (see ``nonfinite.py``).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from attnx.problem import Problem
from attnx.reference import accumulation_dtype, allowed_keys

NEG_INF = float("-inf")


class KernelMask(NamedTuple):
    is_causal: bool
    mask: Optional[torch.Tensor]        # additive, 2-D (Sq, Sk) or 4-D broadcastable, or None
    hides: bool                         # some -inf stands for a key the formula hides (masked_fill)


def positional_sides(p: Problem) -> tuple[Optional[int], Optional[int]]:
    """The window sides that actually hide a key in this problem (None: the side never binds)."""
    offset = p.key_offset
    left, right = p.window_left, p.window_right
    if right is not None and offset + right >= p.seqlen_k - 1:
        right = None  # even query 0 sees the last key
    if left is not None and p.seqlen_q - 1 + offset - left <= 0:
        left = None   # even the last query sees key 0
    return left, right


def uses_is_causal(p: Problem) -> bool:
    """True when the positional rule is exactly torch's top-left ``is_causal`` (with no left side)."""
    left, right = positional_sides(p)
    return right is not None and left is None and p.key_offset + right == 0


def needs_positional_mask(p: Problem) -> bool:
    """True when a causal/window rule hides keys that ``is_causal`` cannot (a mask must say it)."""
    return positional_sides(p) != (None, None) and not uses_is_causal(p)


def needs_mask_tensor(p: Problem) -> bool:
    """True when the kernel needs an attn_mask tensor (a mask, or a rule ``is_causal`` cannot say)."""
    return p.mask_kind is not None or needs_positional_mask(p)


def compact(mask: torch.Tensor) -> torch.Tensor:
    """An expanded ``(B, Hq, Sq, Sk)`` view shrunk to size 1 along every broadcast (stride-0) dim."""
    for dim in range(mask.dim()):
        if mask.stride(dim) == 0 and mask.shape[dim] > 1:
            mask = mask.narrow(dim, 0, 1)
    return mask


NO_MASKING = KernelMask(False, None, False)


def kernel_mask(p: Problem, mask: Optional[torch.Tensor], like: torch.Tensor) -> KernelMask:
    """The ``is_causal`` flag and additive mask (on `like`'s device) that make the kernel compute `p`'s masking."""
    if mask is None and p.window_left is None and p.window_right is None:
        return NO_MASKING  # full attention (the common small call: no rule to look at)
    device = like.device
    is_causal = uses_is_causal(p)
    left, right = positional_sides(p)
    if is_causal:
        right = None  # is_causal says it
    allowed = allowed_keys(p.seqlen_q, p.seqlen_k, left, right, device, p.offset)
    if mask is None and allowed is None:
        return KernelMask(is_causal, None, False)
    dtype = accumulation_dtype(p.dtype)
    additive = None
    hides = allowed is not None
    if mask is not None:
        mask = compact(mask)
        if mask.dtype == torch.bool:
            hides = True
            additive = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, NEG_INF)
        else:
            additive = mask.to(dtype)
    if allowed is not None:
        if additive is None:
            additive = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, NEG_INF)
        else:
            additive = additive.masked_fill(~allowed, NEG_INF)
    if additive.dim() not in (2, 4):
        additive = additive.reshape((1,) * (4 - additive.dim()) + tuple(additive.shape))
    return KernelMask(is_causal, additive, hides)


def dead_rows(km: KernelMask, seqlen_q: int) -> Optional[torch.Tensor]:
    """Bool, broadcastable to ``(B, Hq, Sq)``: rows whose every key is hidden (None when there are none)."""
    if km.mask is None:
        return None  # top-left is_causal gives every row key 0
    visible = km.mask != NEG_INF
    dead = ~visible.any(dim=-1)
    if km.is_causal:  # row i sees keys j <= i: dead when its first visible key lies beyond i
        first = visible.to(torch.uint8).argmax(dim=-1)
        dead = dead | (first > torch.arange(seqlen_q, device=first.device))
    return dead if bool(dead.any()) else None
