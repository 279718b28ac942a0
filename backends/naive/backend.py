"""naive: the formula itself. Any device, dtype and tensor format; the oracle and the last resort."""
from __future__ import annotations

import torch

from attnx.autograd import alloc_out, lse_shape, sum_to_shape
from attnx.backend import Backend
from attnx.formats import per_sequence_backward, per_sequence_forward
from attnx.inputs import Grads, Inputs
from attnx.problem import FORMAT_PAIRS
from attnx.reference import attention_reference, attention_reference_backward

# On the CPU the plain formula wins while the whole score matrix is small. Measured on a 2-core
# EPYC (fp32, D=64, fwd and fwd+bwd, causal or not): naive ~10% faster at 64k scores, blocked
# 10-40% faster at 128k and 1.5-4x at 256k+ (docs/benchmarks.md). Under GQA blocked wins
# (it batches the group; naive repeats K/V per query head).
SMALL_SCORES = 1 << 16


def _formula(p, q, k, v, mask, alibi_slopes, sinks):
    return attention_reference(q, k, v, scale=p.scale, softcap=p.softcap, alibi_slopes=alibi_slopes, mask=mask,
                               window_left=p.window_left, window_right=p.window_right, offset=p.offset,
                               sinks=sinks)


def _attend(p, x: Inputs):
    """``(out, lse)`` in the backend's shapes."""
    if not p.is_dense:
        lse = x.q.new_empty(lse_shape(p, x.q), dtype=torch.float32)
        return per_sequence_forward(p, x, _attend, alloc_out(p, x.q), lse)
    out, lse = _formula(p, x.q, x.k, x.v, x.mask, x.alibi_slopes, x.sinks)
    result = alloc_out(p, x.q)
    result.copy_(out)
    return result, lse.float()


class NaiveBackend(Backend):
    name = "naive"
    description = ("the formula of docs/semantics.md in torch ops, every tensor format; materialises the "
                   "Sq x Sk scores (memory grows with Sq*Sk)")
    device_types = frozenset({"cpu", "cuda", "mps", "xpu", "meta"})
    supports_offset = True
    supports_sinks = True
    formats = FORMAT_PAIRS
    # its backward (the reference's) recomputes the softmax normaliser from its own scores
    backward_uses_given_lse = frozenset()
    priority = {"*": 10}

    def rank(self, p) -> int:
        """Ahead of blocked on non-CUDA devices while B * Hq * Sq * Sk <= 65,536 without GQA (measured)."""
        small = p.batch * p.heads_q * p.seqlen_q * p.seqlen_k <= SMALL_SCORES
        if p.device_type != "cuda" and p.heads_q == p.heads_kv and small:
            return 30  # ahead of blocked (20)
        return super().rank(p)

    def forward(self, p, x):
        with torch.no_grad():
            return _attend(p, x)

    def backward(self, p, x, out, lse, dout):
        if not p.is_dense:
            return per_sequence_backward(p, x, out, lse, dout, self.backward)
        dq, dk, dv, dscores, dsinks = attention_reference_backward(
            x.q, x.k, x.v, out, lse, dout, scale=p.scale, softcap=p.softcap, alibi_slopes=x.alibi_slopes,
            mask=x.mask, window_left=p.window_left, window_right=p.window_right, offset=p.offset, sinks=x.sinks)
        dmask = sum_to_shape(dscores, p.mask_shape).to(x.mask.dtype) if p.mask_requires_grad else None
        return Grads(dq.to(x.q.dtype), dk.to(x.k.dtype), dv.to(x.v.dtype), dmask, dsinks)


BACKEND = NaiveBackend()
