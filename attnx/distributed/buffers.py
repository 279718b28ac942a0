"""The tensors a ring call allocates, and the caller's layout on the way in and out.

Every other module works on ``(B, H, S, D)`` views; accumulators are in the accumulation
dtype (float32, float64 for float64 inputs).
"""
from __future__ import annotations

import torch

from ..reference import accumulation_dtype
from .spec import RingSpec


def as_bhsd(layout: str, t: torch.Tensor) -> torch.Tensor:
    """A ``(B, H, S, D)`` view of a dense tensor in `layout` (``bshd`` is transposed, never copied)."""
    return t.transpose(1, 2) if layout == "bshd" else t


def empty_bhsd(layout: str, like: torch.Tensor, heads: int, seqlen: int, width: int, dtype=None) -> torch.Tensor:
    """A new tensor contiguous in `layout`, returned as its ``(B, H, S, width)`` view."""
    batch = like.shape[0]
    dtype = like.dtype if dtype is None else dtype
    if layout == "bshd":
        return like.new_empty((batch, seqlen, heads, width), dtype=dtype).transpose(1, 2)
    return like.new_empty((batch, heads, seqlen, width), dtype=dtype)


def grad_like(layout: str, acc: torch.Tensor, dtype) -> torch.Tensor:
    """The ``(B, H, S, D)`` accumulator `acc` as a gradient contiguous in the caller's layout and `dtype`.

    The accumulator itself when it already is one (float32 inputs, accumulators laid out so), else a copy.
    """
    grad = as_bhsd(layout, acc)
    if acc.dtype == dtype and grad.is_contiguous():
        return grad
    out = empty_bhsd(layout, acc, acc.shape[1], acc.shape[2], acc.shape[3], dtype)
    out.copy_(acc)
    return as_bhsd(layout, out)


def own_kv(spec: RingSpec, k, v) -> list:
    """The rank's K/V block as contiguous ``bhsd`` tensors (what is sent)."""
    return [as_bhsd(spec.layout, k).contiguous(), as_bhsd(spec.layout, v).contiguous()]


def new_outputs(spec: RingSpec, q, heads_q: int, head_dim_v: int):
    """``out`` (``bhsd`` view, contiguous in the caller's layout) and float32 ``lse`` of the shard."""
    out = empty_bhsd(spec.layout, q, heads_q, spec.shard_len, head_dim_v)
    lse = q.new_empty((q.shape[0], heads_q, spec.shard_len), dtype=torch.float32)
    return out, lse


def backward_setup(spec: RingSpec, q, out, dout):
    """``(q, dout, delta, dq accumulator)`` as ``bhsd``; ``delta = rowsum(dout * out)``."""
    qh, outh, douth = (as_bhsd(spec.layout, t) for t in (q, out, dout))
    acc = accumulation_dtype(q.dtype)
    delta = (douth.to(acc) * outh.to(acc)).sum(dim=-1)
    # laid out as the caller's layout, so that for float32 the accumulator is the gradient itself
    dq = empty_bhsd(spec.layout, qh, qh.shape[1], qh.shape[2], qh.shape[3], acc).zero_()
    return qh, douth, delta, dq


def key_accumulators(k, v, acc) -> list:
    """Zeroed dK/dV accumulators for one ``bhsd`` K/V block."""
    return [torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)]
