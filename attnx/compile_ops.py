"""torch.library custom ops, so `torch.compile(fullgraph=True)` traces attnx without graph breaks.

Eager calls do not come through here (a custom op costs ~20 us a call on a CPU);
`attnx.attention` routes through these ops only while torch.compile traces. The
op implementations run the same validation, dispatch and backend as eager calls.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .autograd import run, run_backward
from .dispatch import choose
from .problem import make_problem


def _problem(q, k, v, mask, alibi_slopes, causal, window_left, window_right, scale, softcap, layout, needs_grad):
    p = make_problem(q, k, v, causal=causal, window=(window_left, window_right), mask=mask, scale=scale,
                     softcap=softcap, alibi_slopes=alibi_slopes, layout=layout)
    mask_grad = needs_grad and mask is not None and mask.requires_grad
    deterministic = needs_grad and torch.are_deterministic_algorithms_enabled()
    return p._replace(needs_grad=needs_grad, mask_requires_grad=mask_grad, deterministic=deterministic)


@torch.library.custom_op("attnx::attention_fwd", mutates_args=())
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], alibi_slopes: Optional[Tensor],
                  causal: bool, window_left: Optional[int], window_right: Optional[int], scale: Optional[float],
                  softcap: Optional[float], layout: str, backend: str, needs_grad: bool) -> tuple[Tensor, Tensor]:
    p = _problem(q, k, v, mask, alibi_slopes, causal, window_left, window_right, scale, softcap, layout, needs_grad)
    with torch.no_grad():
        out, lse = run(p._replace(needs_grad=False), choose(p, backend or None), q, k, v, mask, alibi_slopes)
    return out, lse


@attention_fwd.register_fake
def _(q, k, v, mask, alibi_slopes, causal, window_left, window_right, scale, softcap, layout, backend, needs_grad):
    p = _problem(q, k, v, mask, alibi_slopes, causal, window_left, window_right, scale, softcap, layout, False)
    shape = (p.batch, p.heads_q, p.seqlen_q, p.head_dim_v) if layout == "bhsd" else \
        (p.batch, p.seqlen_q, p.heads_q, p.head_dim_v)
    return q.new_empty(shape), q.new_empty((p.batch, p.heads_q, p.seqlen_q), dtype=torch.float32)


@torch.library.custom_op("attnx::attention_bwd", mutates_args=())
def attention_bwd(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], alibi_slopes: Optional[Tensor],
                  out: Tensor, lse: Tensor, dout: Tensor, causal: bool, window_left: Optional[int],
                  window_right: Optional[int], scale: Optional[float], softcap: Optional[float], layout: str,
                  backend: str, mask_needs_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    p = _problem(q, k, v, mask, alibi_slopes, causal, window_left, window_right, scale, softcap, layout, True)
    p = p._replace(mask_requires_grad=mask_needs_grad)
    dq, dk, dv, dmask = run_backward(p, choose(p, backend or None), q, k, v, mask, alibi_slopes, out, lse, dout)
    if dmask is None:
        dmask = q.new_empty((0,))
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dmask.contiguous()


@attention_bwd.register_fake
def _(q, k, v, mask, alibi_slopes, out, lse, dout, causal, window_left, window_right, scale, softcap, layout,
      backend, mask_needs_grad):
    dmask = torch.empty_like(mask) if mask_needs_grad else q.new_empty((0,))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dmask


_SCALAR_ARGS = ("causal", "window_left", "window_right", "scale", "softcap", "layout", "backend")


def _setup_context(ctx, inputs, output):
    q, k, v, mask, alibi_slopes = inputs[:5]
    ctx.scalars = dict(zip(_SCALAR_ARGS, inputs[5:12]))
    ctx.mask_needs_grad = mask is not None and mask.requires_grad
    ctx.save_for_backward(q, k, v, mask, alibi_slopes, *output)


def _backward(ctx, dout, _dlse):
    q, k, v, mask, alibi_slopes, out, lse = ctx.saved_tensors
    s = ctx.scalars
    dq, dk, dv, dmask = attention_bwd(q, k, v, mask, alibi_slopes, out, lse, dout, s["causal"], s["window_left"],
                                      s["window_right"], s["scale"], s["softcap"], s["layout"], s["backend"],
                                      ctx.mask_needs_grad)
    return (dq, dk, dv, dmask if ctx.mask_needs_grad else None) + (None,) * 9


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def traced_attention(q, k, v, mask, alibi_slopes, causal, window, scale, softcap, layout, backend):
    """The call `attnx.attention` makes while torch.compile traces it."""
    window_left, window_right = (None, None) if window is None else window
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or (
        mask is not None and mask.requires_grad))
    return attention_fwd(q, k, v, mask, alibi_slopes, causal, window_left, window_right,
                         None if scale is None else float(scale), None if softcap is None else float(softcap),
                         layout, backend or "", needs_grad)
