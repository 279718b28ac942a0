"""One tile of final scores: GEMM, then softcap, alibi, dense mask and causal/window (docs/semantics.md's order).

Scores are kept in base-2 units (times log2(e)) so the softmax can use exp2, which
is about three times faster than exp on the CPU; lse is converted back at the end.
"""
from __future__ import annotations

from typing import Optional

import torch

from attnx.limits import LOG2E

from . import kv
from .operands import Operands
from .tiles import alibi_distance, allowed_tile, tile_is_interior

NEG_INF = float("-inf")


def score_tile(ops: Operands, q_tile: torch.Tensor, i0: int, i1: int, j0: int, j1: int, out: torch.Tensor,
               buffers, tanh_out: Optional[torch.Tensor] = None, keys: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Final scores of query rows ``[i0, i1)`` against keys ``[j0, j1)`` times log2(e), into `out`.

    `q_tile` is ``(B*Hkv, G*rows, D)`` already multiplied by ``scale * log2(e)``; `out` is a
    contiguous ``(B*Hkv, G*rows, cols)`` buffer. The keys are read through the worker's
    `buffers` (``.keys`` and ``.product``: `kv.key_scores`), or are `keys` (``ops.key_tile(j0, j1, ...)``)
    when the caller has them already. With softcap, `tanh_out` (same shape) receives ``tanh(raw / softcap)`` for the
    backward's chain rule.
    """
    p = ops.p
    rows, cols = i1 - i0, j1 - j0
    if keys is not None:
        s = torch.bmm(q_tile, keys.transpose(1, 2), out=out)
    else:
        s = kv.key_scores(q_tile, ops.k, j0, j1, out, buffers.keys, buffers.product)
    if p.softcap is not None:
        s.mul_(1.0 / (p.softcap * LOG2E)).tanh_()
        if tanh_out is not None:
            tanh_out.copy_(s)
        s.mul_(p.softcap * LOG2E)
    # (B*Hkv, G, rows, cols): the view the per-head and per-position terms broadcast over
    s4 = s.view(ops.batch_heads, p.group_size, rows, cols)
    if ops.neg_slopes is not None:
        s4.addcmul_(ops.neg_slopes, alibi_distance(p, i0, i1, j0, j1, ops.acc, s.device))
    if ops.mask5 is not None:
        s5 = s.view(p.batch, p.heads_kv, p.group_size, rows, cols)
        mask_tile = ops.mask5[:, :, :, i0:i1, j0:j1]
        if mask_tile.dtype == torch.bool:
            s5.masked_fill_(mask_tile.logical_not(), NEG_INF)
        else:
            if torch.promote_types(mask_tile.dtype, ops.acc) != ops.acc:
                mask_tile = mask_tile.to(ops.acc)  # a float64 bias on float32 scores
            s5.add_(mask_tile, alpha=LOG2E)
    if not tile_is_interior(p, i0, i1, j0, j1):
        hidden = allowed_tile(p, i0, i1, j0, j1, s.device).logical_not_()
        if ops.finite_scores:
            # a broadcast add of a (rows, cols) 0 / -inf bias is several times faster than a broadcast
            # masked_fill_, and hides the same entries while every score is finite
            s4.add_(torch.zeros((rows, cols), dtype=ops.acc, device=s.device).masked_fill_(hidden, NEG_INF))
        else:  # a NaN or inf score: the rule must overwrite it (NaN + -inf is NaN)
            s4.masked_fill_(hidden, NEG_INF)
    return s
