"""SPEC.md's formula written plainly: the oracle of the conformance suite.

It materialises the ``(B, Hq, Sq, Sk)`` scores, so it is for checking and for small
problems only. Differentiable through torch autograd (``lse`` excepted).
"""
from __future__ import annotations

from typing import Optional

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, else float32 (SPEC: accumulation rule)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def allowed_keys(seqlen_q: int, seqlen_k: int, window_left: Optional[int], window_right: Optional[int],
                 device) -> Optional[torch.Tensor]:
    """Bool ``(Sq, Sk)``: may query i see key j under causal/window rules (None = all)."""
    if window_left is None and window_right is None:
        return None
    pos = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    key = torch.arange(seqlen_k, device=device)[None, :]
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if window_left is not None:
        allowed &= key >= pos - window_left
    if window_right is not None:
        allowed &= key <= pos + window_right
    return allowed


def alibi_bias(alibi_slopes: torch.Tensor, seqlen_q: int, seqlen_k: int, dtype) -> torch.Tensor:
    """``-slope * |p_i - j|`` as ``(B or 1, Hq, Sq, Sk)``."""
    device = alibi_slopes.device
    pos = torch.arange(seqlen_q, device=device, dtype=dtype)[:, None] + (seqlen_k - seqlen_q)
    key = torch.arange(seqlen_k, device=device, dtype=dtype)[None, :]
    slopes = alibi_slopes.to(dtype)
    slopes = slopes.reshape(-1 if slopes.dim() == 2 else 1, slopes.shape[-1], 1, 1)
    return -slopes * (pos - key).abs()


def scores(q, k, *, scale, softcap=None, alibi_slopes=None, mask=None, window_left=None, window_right=None,
           compute_dtype=torch.float32) -> torch.Tensor:
    """Final scores ``(B, Hq, Sq, Sk)`` in `compute_dtype`, -inf where a key may not be seen.

    ``q``, ``k`` are ``(B, H, S, D)``; GQA is handled by repeating kv heads.
    """
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
    s = torch.matmul(q.to(compute_dtype), k.to(compute_dtype).transpose(-2, -1)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes, seqlen_q, seqlen_k, compute_dtype)
    if mask is not None:
        if mask.dtype == torch.bool:
            s = s.masked_fill(~mask, float("-inf"))
        else:
            s = s + mask.to(compute_dtype)
    allowed = allowed_keys(seqlen_q, seqlen_k, window_left, window_right, q.device)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def attention_reference(q, k, v, *, scale, softcap=None, alibi_slopes=None, mask=None, window_left=None,
                        window_right=None, compute_dtype=None):
    """``(out, lse)`` of SPEC.md's formula; ``out`` in `compute_dtype`, ``lse`` float32 (float64 if computed so).

    Rows that see no key give ``out = 0`` and ``lse = -inf`` with zero (not NaN) gradients.
    """
    if compute_dtype is None:
        compute_dtype = accumulation_dtype(q.dtype)
    s = scores(q, k, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes, mask=mask,
               window_left=window_left, window_right=window_right, compute_dtype=compute_dtype)
    sees_a_key = s.amax(dim=-1, keepdim=True) > float("-inf")
    # softmax of a fully masked row would be NaN: give it zeros, then zero it out
    p = torch.softmax(torch.where(sees_a_key, s, torch.zeros_like(s)), dim=-1) * sees_a_key
    group = q.shape[1] // v.shape[1]
    if group > 1:
        v = v.repeat_interleave(group, dim=1)
    out = torch.matmul(p, v.to(compute_dtype))
    lse_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    lse = torch.logsumexp(s.detach().to(lse_dtype), dim=-1)
    return out, lse


def attention_reference_backward(q, k, v, out, dout, *, scale, softcap=None, alibi_slopes=None, mask=None,
                                 window_left=None, window_right=None, compute_dtype=None):
    """Explicit gradients of `attention_reference`: ``(dq, dk, dv, dscores)`` in `compute_dtype`.

    ``dscores`` is the gradient of the final scores, which is the gradient of an
    additive mask before it is summed over broadcast dimensions.
    """
    if compute_dtype is None:
        compute_dtype = accumulation_dtype(q.dtype)
    s = scores(q, k, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes, mask=mask,
               window_left=window_left, window_right=window_right, compute_dtype=compute_dtype)
    sees_a_key = s.amax(dim=-1, keepdim=True) > float("-inf")
    p = torch.softmax(torch.where(sees_a_key, s, torch.zeros_like(s)), dim=-1) * sees_a_key
    group = q.shape[1] // k.shape[1]
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
    return dq, dk, dv, dscores
