"""Batch entries whose NaN/inf inputs the kernel's additive ``-inf`` would let leak, recomputed exactly.

The contract (docs/semantics.md) hides a key from a row by dropping it (``masked_fill``),
so a NaN in a hidden key never reaches that row; torch's kernels add ``-inf`` instead, and
``NaN + -inf`` is NaN. With finite ``q`` and ``k`` the two are the same function, so only
batch entries holding a non-finite ``q`` or ``k`` value are recomputed here, by the formula
itself (`attnx.reference.attention_reference`), one batch entry at a time. Finding them costs
one summing pass over ``q`` and ``k``; it runs only when the kernel's mask hides keys
(`masks.KernelMask.hides`).
"""
from __future__ import annotations

import torch

from attnx.problem import Problem
from attnx.reference import attention_reference


def bad_batches(q: torch.Tensor, k: torch.Tensor) -> list[int]:
    """Batch indices whose ``q`` or ``k`` may hold a NaN or an infinity.

    One float32 sum per batch entry (a NaN or infinity makes it non-finite); a sum that merely
    overflows flags an entry too, which only costs it the (exact) slow path.
    """
    def sums(t):
        return torch.sum(t, dim=tuple(range(1, t.dim())), dtype=torch.float32)

    finite = torch.isfinite(sums(q)) & torch.isfinite(sums(k))
    return (~finite).nonzero().flatten().tolist()


def formula(p: Problem, q, k, v, mask):
    """``(out, lse)`` of one batch entry's ``(1, H, S, D)`` tensors by the formula (differentiable)."""
    return attention_reference(q, k, v, scale=p.scale, mask=mask, window_left=p.window_left,
                               window_right=p.window_right, offset=p.offset)


def _entry(t, b: int):
    return None if t is None else t[b:b + 1]


def fix_forward(p: Problem, x, out: torch.Tensor, lse: torch.Tensor, batches: list[int]) -> None:
    """Overwrite `out`/`lse` of the given batch entries with the formula's values."""
    with torch.no_grad():
        for b in batches:
            ref_out, ref_lse = formula(p, *(_entry(t, b) for t in (x.q, x.k, x.v, x.mask)))
            out[b:b + 1].copy_(ref_out)
            lse[b:b + 1].copy_(ref_lse)


def fix_backward(p: Problem, x, dout: torch.Tensor, grads, batches: list[int]) -> None:
    """Overwrite ``dq``, ``dk``, ``dv`` (the tuple `grads`) of the given batch entries with the formula's."""
    for b in batches:
        leaves = [t[b:b + 1].detach().requires_grad_() for t in (x.q, x.k, x.v)]
        with torch.enable_grad():
            ref_out, _ = formula(p, *leaves, _entry(x.mask, b))
            found = torch.autograd.grad(ref_out, leaves, dout[b:b + 1].to(ref_out.dtype), allow_unused=True)
        for grad, g in zip(grads, found):
            grad[b:b + 1].copy_(g if g is not None else torch.zeros_like(grad[b:b + 1]))
