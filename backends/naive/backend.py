"""naive: the formula itself. Any device, any float dtype; the oracle and the last resort."""
from __future__ import annotations

import torch

from attnx.autograd import alloc_out, sum_to_shape
from attnx.backend import Backend
from attnx.reference import attention_reference, attention_reference_backward


def _formula(p, q, k, v, mask, alibi_slopes):
    return attention_reference(q, k, v, scale=p.scale, softcap=p.softcap, alibi_slopes=alibi_slopes, mask=mask,
                               window_left=p.window_left, window_right=p.window_right)


class NaiveBackend(Backend):
    name = "naive"
    description = "SPEC.md's formula in torch ops; materialises the Sq x Sk scores (memory grows with Sq*Sk)"
    device_types = frozenset({"cpu", "cuda", "mps", "xpu", "meta"})

    def forward(self, p, q, k, v, mask, alibi_slopes):
        with torch.no_grad():
            out, lse = _formula(p, q, k, v, mask, alibi_slopes)
        result = alloc_out(p, q)
        result.copy_(out)
        return result, lse.float()

    def backward(self, p, q, k, v, mask, alibi_slopes, out, lse, dout):
        dq, dk, dv, dscores = attention_reference_backward(
            q, k, v, out, dout, scale=p.scale, softcap=p.softcap, alibi_slopes=alibi_slopes, mask=mask,
            window_left=p.window_left, window_right=p.window_right)
        dmask = sum_to_shape(dscores, p.mask_shape).to(mask.dtype) if p.mask_requires_grad else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dmask


BACKEND = NaiveBackend()
