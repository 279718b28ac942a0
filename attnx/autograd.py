"""The one place where a backend's forward and backward become a differentiable op."""
from __future__ import annotations

import torch

from .problem import Problem


def alloc_out(p: Problem, q: torch.Tensor) -> torch.Tensor:
    """An uninitialised output, contiguous in the caller's layout, returned as a (B, H, S, Dv) view."""
    if p.layout == "bshd":
        return q.new_empty((p.batch, p.seqlen_q, p.heads_q, p.head_dim_v)).transpose(1, 2)
    return q.new_empty((p.batch, p.heads_q, p.seqlen_q, p.head_dim_v))


def sum_to_shape(grad: torch.Tensor, shape: tuple) -> torch.Tensor:
    """Sum `grad` over the dimensions where a tensor of `shape` was broadcast."""
    dims = tuple(i for i, (g, s) in enumerate(zip(grad.shape, shape)) if s == 1 and g != 1)
    return grad.sum(dims, keepdim=True) if dims else grad


def expand_mask(p: Problem, mask):
    if mask is None:
        return None
    return mask.reshape(p.mask_shape).expand(p.batch, p.heads_q, p.seqlen_q, p.seqlen_k)


def expand_alibi(p: Problem, alibi_slopes):
    if alibi_slopes is None:
        return None
    return alibi_slopes.reshape(-1 if alibi_slopes.dim() == 2 else 1, p.heads_q).expand(p.batch, p.heads_q)


class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, alibi_slopes, p, backend):
        out, lse = backend.forward(p, q, k, v, expand_mask(p, mask), expand_alibi(p, alibi_slopes))
        ctx.save_for_backward(q, k, v, mask, alibi_slopes, out, lse)
        ctx.problem, ctx.backend = p, backend
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, mask, alibi_slopes, out, lse = ctx.saved_tensors
        p = ctx.problem
        dq, dk, dv, dmask = ctx.backend.backward(
            p, q, k, v, expand_mask(p, mask), expand_alibi(p, alibi_slopes), out, lse, dout)
        if dmask is not None:
            dmask = dmask.reshape(mask.shape)
        return dq, dk, dv, dmask, None, None, None


def to_bhsd(p: Problem, t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2) if p.layout == "bshd" else t


def run(p: Problem, backend, q, k, v, mask, alibi_slopes):
    """Run `backend` on the caller's tensors; returns (out, lse) with out in the caller's layout."""
    if p.layout == "bshd":
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if p.needs_grad:
        out, lse = _AttentionFunction.apply(q, k, v, mask, alibi_slopes, p, backend)
    else:
        out, lse = backend.forward(p, q, k, v, expand_mask(p, mask), expand_alibi(p, alibi_slopes))
    if p.layout == "bshd":
        out = out.transpose(1, 2)
    return out, lse


def run_backward(p: Problem, backend, q, k, v, mask, alibi_slopes, out, lse, dout):
    """Backward on the caller's tensors (used by the torch.compile custom op)."""
    if p.layout == "bshd":
        q, k, v, out, dout = (t.transpose(1, 2) for t in (q, k, v, out, dout))
    dq, dk, dv, dmask = backend.backward(
        p, q, k, v, expand_mask(p, mask), expand_alibi(p, alibi_slopes), out, lse, dout)
    if p.layout == "bshd":
        dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    if dmask is not None:
        dmask = dmask.reshape(mask.shape)
    return dq, dk, dv, dmask
