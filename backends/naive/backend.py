"""naive: the formula itself. Any device, dtype and tensor format; the oracle and the last resort."""
from __future__ import annotations

import torch

from attnx.autograd import alloc_out, lse_shape, sum_to_shape
from attnx.backend import Backend
from attnx.formats import per_sequence_forward
from attnx.inputs import Grads, Inputs
from attnx.problem import FORMAT_PAIRS
from attnx.reference import attention_reference

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
    """``(out, lse)`` in the backend's shapes, differentiable by torch autograd."""
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
        # differentiate the formula itself: recompute it with the inputs as fresh leaves
        names = [n for n in Inputs.DIFFERENTIABLE
                 if (t := getattr(x, n)) is not None and t.is_floating_point() and (n != "mask" or p.mask_requires_grad)]
        leaves = {n: getattr(x, n).detach().requires_grad_() for n in names}
        with torch.enable_grad():
            result, _ = _attend(p, x.replace(**leaves))
            grads = torch.autograd.grad(result, list(leaves.values()), dout, allow_unused=True)
        found = {n: (g if g is not None else torch.zeros_like(leaves[n])) for n, g in zip(names, grads)}
        dmask = sum_to_shape(found["mask"], p.mask_shape).to(x.mask.dtype) if "mask" in found else None
        return Grads(found["q"].to(x.q.dtype), found["k"].to(x.k.dtype), found["v"].to(x.v.dtype), dmask,
                     found.get("sinks"))


BACKEND = NaiveBackend()
