"""The formula of docs/semantics.md written plainly: the oracle of the conformance suite.

It materialises the ``(B, Hq, Sq, Sk)`` scores, so it is for checking and for small
problems only. Differentiable through torch autograd (``lse`` excepted).
"""
from __future__ import annotations

from typing import Optional

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, else float32 (docs/semantics.md: accumulation)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def aligned_offset(seqlen_q: int, seqlen_k: int, offset: Optional[int]) -> int:
    """Aligned position of query 0: ``offset``, or bottom-right ``Sk - Sq`` when None."""
    return seqlen_k - seqlen_q if offset is None else offset


def allowed_keys(seqlen_q: int, seqlen_k: int, window_left: Optional[int], window_right: Optional[int],
                 device, offset: Optional[int] = None) -> Optional[torch.Tensor]:
    """Bool ``(Sq, Sk)``: may query i see key j under causal/window rules (None = all)."""
    if window_left is None and window_right is None:
        return None
    pos = torch.arange(seqlen_q, device=device)[:, None] + aligned_offset(seqlen_q, seqlen_k, offset)
    key = torch.arange(seqlen_k, device=device)[None, :]
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if window_left is not None:
        allowed &= key >= pos - window_left
    if window_right is not None:
        allowed &= key <= pos + window_right
    return allowed


def alibi_bias(alibi_slopes: torch.Tensor, seqlen_q: int, seqlen_k: int, dtype,
               offset: Optional[int] = None) -> torch.Tensor:
    """``-slope * |p_i - j|`` as ``(B or 1, Hq, Sq, Sk)``."""
    device = alibi_slopes.device
    pos = torch.arange(seqlen_q, device=device, dtype=dtype)[:, None] + aligned_offset(seqlen_q, seqlen_k, offset)
    key = torch.arange(seqlen_k, device=device, dtype=dtype)[None, :]
    slopes = alibi_slopes.to(dtype)
    slopes = slopes.reshape(slopes.shape[0] if slopes.dim() == 2 else 1, slopes.shape[-1], 1, 1)
    return -slopes * (pos - key).abs()


def scores(q, k, *, scale, softcap=None, alibi_slopes=None, mask=None, window_left=None, window_right=None,
           offset=None, compute_dtype=torch.float32) -> torch.Tensor:
    """Final scores ``(B, Hq, Sq, Sk)`` in `compute_dtype`, -inf where a key may not be seen.

    ``q``, ``k`` are ``(B, H, S, D)``; GQA is handled by repeating kv heads.
    """
    group = q.shape[1] // max(k.shape[1], 1)
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
    s = torch.matmul(q.to(compute_dtype), k.to(compute_dtype).transpose(-2, -1)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes, seqlen_q, seqlen_k, compute_dtype, offset)
    if mask is not None:
        if mask.dtype == torch.bool:
            s = s.masked_fill(~mask, float("-inf"))
        else:
            s = s + mask.to(compute_dtype)
    allowed = allowed_keys(seqlen_q, seqlen_k, window_left, window_right, q.device, offset)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def attention_reference(q, k, v, *, scale, softcap=None, alibi_slopes=None, mask=None, window_left=None,
                        window_right=None, offset=None, sinks=None, compute_dtype=None):
    """``(out, lse)`` of the formula; ``out`` in `compute_dtype`, ``lse`` float32 (float64 if computed so).

    ``sinks`` (``(Hq,)``) adds a key of score ``sinks[h]`` and value 0 to every row of head h.
    Rows that see no key give ``out = 0`` and ``lse = -inf`` (``lse = sink`` with sinks) with
    zero (not NaN) gradients; a NaN score makes its row NaN. Differentiable by torch autograd
    in ``q``, ``k``, ``v``, a floating ``mask`` and ``sinks`` (``lse`` too).
    """
    if compute_dtype is None:
        compute_dtype = accumulation_dtype(q.dtype)
    s = scores(q, k, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes, mask=mask,
               window_left=window_left, window_right=window_right, offset=offset, compute_dtype=compute_dtype)
    # the sink is one more key (value 0); with no keys at all a -inf key keeps the reductions non-empty
    extra = sinks.to(compute_dtype).reshape(1, -1, 1, 1) if sinks is not None else (
        torch.full((1, 1, 1, 1), float("-inf"), dtype=compute_dtype, device=s.device) if s.shape[-1] == 0 else None)
    if extra is not None:
        s = torch.cat([s, extra.expand(*s.shape[:-1], 1)], dim=-1)
    # softmax of a row of only -inf would be NaN: give such rows zeros, then zero them out.
    # `== -inf` (not `> -inf`) so a NaN row stays NaN, as the formula says.
    sees_a_key = ~(s.amax(dim=-1, keepdim=True) == float("-inf"))
    p = torch.softmax(torch.where(sees_a_key, s, torch.zeros_like(s)), dim=-1) * sees_a_key
    if extra is not None:
        p = p[..., :-1]
    group = q.shape[1] // max(v.shape[1], 1)
    if group > 1:
        v = v.repeat_interleave(group, dim=1)
    out = torch.matmul(p, v.to(compute_dtype))
    lse_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    s = s.to(lse_dtype)
    lse = torch.logsumexp(torch.where(sees_a_key, s, torch.zeros_like(s)), dim=-1)
    lse = torch.where(sees_a_key.squeeze(-1), lse, torch.full_like(lse, float("-inf")))
    return out, lse


def attention_reference_backward(q, k, v, out, lse, dout, *, scale, softcap=None, alibi_slopes=None, mask=None,
                                 window_left=None, window_right=None, offset=None, sinks=None, compute_dtype=None):
    """FlashAttention's backward of the formula: ``(dq, dk, dv, dscores, dsinks)`` in `compute_dtype`.

    Probabilities are recomputed from the scores (``P = exp(s - lse)``, the sink in ``lse``) and
    ``delta = rowsum(dout * out)`` comes from the forward's (rounded) ``out``, as in the kernels, so
    its low-precision errors are those of a FlashAttention backward. ``lse`` is the forward's; only
    the sinks' gradient reads it. ``dscores`` is the gradient of the
    final scores (an additive mask's, before summing over broadcast dimensions); ``dsinks`` is None
    without sinks.
    """
    from .inputs import sinks_grad

    if compute_dtype is None:
        compute_dtype = accumulation_dtype(q.dtype)
    s = scores(q, k, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes, mask=mask, window_left=window_left,
               window_right=window_right, offset=offset, compute_dtype=compute_dtype)
    # the row's log-normaliser, recomputed in compute_dtype (the forward's lse is float32 even for float64)
    with_sink = s if sinks is None else torch.cat(
        [s, sinks.to(compute_dtype).reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    lse_c = torch.logsumexp(with_sink, dim=-1, keepdim=True) if with_sink.shape[-1] else \
        torch.full((*s.shape[:-1], 1), float("-inf"), dtype=compute_dtype, device=s.device)
    dead = lse_c == float("-inf")  # rows that saw nothing (and no sink): P = 0, not exp(-inf + inf)
    p = torch.where(dead, torch.zeros_like(s), torch.exp(s - torch.where(dead, torch.zeros_like(lse_c), lse_c)))
    group = q.shape[1] // max(k.shape[1], 1)
    k_rep = k.repeat_interleave(group, dim=1) if group > 1 else k
    v_rep = v.repeat_interleave(group, dim=1) if group > 1 else v
    dout = dout.to(compute_dtype)
    delta = (dout * out.to(compute_dtype)).sum(-1, keepdim=True)
    dv = torch.matmul(p.transpose(-2, -1), dout)
    dp = torch.matmul(dout, v_rep.to(compute_dtype).transpose(-2, -1))
    dscores = p * (dp - delta)
    draw = dscores
    if softcap is not None:
        raw = torch.matmul(q.to(compute_dtype), k_rep.to(compute_dtype).transpose(-2, -1)) * scale
        draw = dscores * (1 - torch.tanh(raw / softcap) ** 2)
    dq = torch.matmul(draw, k_rep.to(compute_dtype)) * scale
    dk = torch.matmul(draw.transpose(-2, -1), q.to(compute_dtype)) * scale
    if group > 1:
        b, hq, sk = dk.shape[0], dk.shape[1], dk.shape[2]
        dk = dk.reshape(b, hq // group, group, sk, -1).sum(2)
        dv = dv.reshape(b, hq // group, group, sk, -1).sum(2)
    dsinks = None if sinks is None else sinks_grad(sinks, lse_c[..., 0], delta[..., 0]).float()
    return dq, dk, dv, dscores, dsinks
