"""Results of zero-size problems (B, H, Sq or Sk = 0): no kernel needed, gradients exactly zero.

docs/semantics.md: ``B``, ``H`` or ``Sq`` = 0 give empty outputs; ``Sk`` = 0 gives ``out = 0``
and ``lse = -inf`` (``lse = sink`` with sinks), as ``F.scaled_dot_product_attention`` does.
"""
from __future__ import annotations

import torch

from .autograd import lse_shape
from .inputs import Inputs
from .problem import Problem


def empty_attention(p: Problem, x: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a zero-size problem (`Problem.is_empty`), in the caller's layout or format."""
    # A sum over zero elements is exactly 0 and still links every input to the output, so
    # autograd gives each one a zero gradient (never NaN, whatever the inputs hold).
    link = sum(t.reshape(-1)[:0].sum() for name in Inputs.DIFFERENTIABLE
               if (t := getattr(x, name)) is not None and t.is_floating_point())
    if p.q_format == "varlen":
        shape = (x.q.shape[0], p.heads_q, p.head_dim_v)
    elif p.layout == "bshd":
        shape = (p.batch, p.seqlen_q, p.heads_q, p.head_dim_v)
    else:
        shape = (p.batch, p.heads_q, p.seqlen_q, p.head_dim_v)
    out = x.q.new_zeros(shape) + link.to(x.q.dtype)
    if x.sinks is not None:
        sinks = x.sinks.detach().float()
        sinks = sinks[:, None] if p.q_format == "varlen" else sinks[None, :, None]
        lse = sinks.expand(lse_shape(p, x.q)).clone()
    else:
        lse = torch.full(lse_shape(p, x.q), float("-inf"), dtype=torch.float32, device=x.q.device)
    return out, lse
