"""Backward (FlashAttention-2 style): recompute each score tile from lse, never store Sq x Sk.

Per tile: P = exp(S - lse); dV += P^T dO; dP = dO V^T; dS = P * (dP - delta) with
delta = rowsum(dO * O); softcap multiplies dS by 1 - tanh^2; dK += dS^T (Q * scale);
dQ += dS K * scale; an additive mask that requires grad receives dS summed over the
dimensions it broadcasts. GQA grads sum over the group inside the GEMMs.
"""
from __future__ import annotations

import torch

from attnx.problem import Problem

from .forward import scratch, tile_view
from .operands import Operands, prepare
from .scores import score_tile
from .tiles import TileSizes, key_span


def refine_lse(ops: Operands, q_tile, lse_tile, i0: int, i1: int, lo: int, hi: int, block_n: int, buffer):
    """lse in the accumulation dtype from the float32 one: ``lse + log(sum exp(s - lse))``.

    The forward's lse is float32; float64 inputs need the exact denominator in float64.
    """
    total = torch.zeros_like(lse_tile)
    for j0 in range(lo, hi, block_n):
        j1 = min(j0 + block_n, hi)
        s = score_tile(ops, q_tile, i0, i1, j0, j1, tile_view(buffer, ops, i1 - i0, j1 - j0))
        total.add_(s.sub_(lse_tile).exp_().sum(dim=-1, keepdim=True))
    return lse_tile + total.log()


class MaskGradient:
    """dmask of shape ``p.mask_shape`` in the accumulation dtype, filled tile by tile."""

    def __init__(self, ops: Operands):
        p = ops.p
        self.p = p
        self.grad = torch.zeros(p.mask_shape, dtype=ops.acc, device=ops.k.device)
        self.summed_heads = tuple(d for d in (0, 1) if p.mask_shape[d] == 1)
        self.full_rows = p.mask_shape[2] != 1
        self.full_cols = p.mask_shape[3] != 1

    def add(self, ds: torch.Tensor, i0: int, i1: int, j0: int, j1: int) -> None:
        p = self.p
        g = ds.view(p.batch, p.heads_q, i1 - i0, j1 - j0)
        dims = self.summed_heads + (() if self.full_rows else (2,)) + (() if self.full_cols else (3,))
        if dims:
            g = g.sum(dim=dims, keepdim=True)
        rows = slice(i0, i1) if self.full_rows else slice(0, 1)
        cols = slice(j0, j1) if self.full_cols else slice(0, 1)
        self.grad[:, :, rows, cols].add_(g)


def blocked_backward(p: Problem, q, k, v, mask, alibi_slopes, out, lse, dout, tiles: TileSizes):
    """``(dq, dk, dv, dmask)``; dmask is None unless ``p.mask_requires_grad``."""
    ops = prepare(p, q, k, v, mask, alibi_slopes)
    block_m, block_n = tiles
    n, g = ops.batch_heads, p.group_size
    dk_acc = torch.zeros((n, p.seqlen_k, p.head_dim), dtype=ops.acc, device=q.device)
    dv_acc = torch.zeros((n, p.seqlen_k, p.head_dim_v), dtype=ops.acc, device=q.device)
    dq = torch.empty_like(q)
    dq5, out5, dout5, lse5 = (ops.split_heads(t) for t in (dq, out, dout, lse))
    dmask = MaskGradient(ops) if p.mask_requires_grad else None
    scores_buf = scratch(ops, block_m, block_n)
    dp_buf = scratch(ops, block_m, block_n)
    tanh_buf = scratch(ops, block_m, block_n) if p.softcap is not None else None
    for i0 in range(0, p.seqlen_q, block_m):
        i1 = min(i0 + block_m, p.seqlen_q)
        rows = i1 - i0
        lo, hi = key_span(p, i0, i1)
        if hi <= lo:
            dq5[:, :, :, i0:i1].zero_()
            continue
        q_tile = ops.q_tile(i0, i1)
        do_tile = ops.rows(dout5[:, :, :, i0:i1])
        delta = (do_tile * ops.rows(out5[:, :, :, i0:i1])).sum(dim=-1, keepdim=True)
        lse_tile = ops.rows(lse5[:, :, :, i0:i1, None])
        # rows that saw no key: lse = -inf; +inf makes exp(s - lse) = 0 for them
        dead_rows = lse_tile == float("-inf")
        lse_tile.masked_fill_(dead_rows, float("inf"))
        if lse.dtype != ops.acc:
            lse_tile = refine_lse(ops, q_tile, lse_tile, i0, i1, lo, hi, block_n, scores_buf)
            lse_tile.masked_fill_(dead_rows, float("inf"))
        dq_tile = torch.zeros((n, g * rows, p.head_dim), dtype=ops.acc, device=q.device)
        for j0 in range(lo, hi, block_n):
            j1 = min(j0 + block_n, hi)
            cols = j1 - j0
            tanh_tile = None if tanh_buf is None else tile_view(tanh_buf, ops, rows, cols)
            probs = score_tile(ops, q_tile, i0, i1, j0, j1, tile_view(scores_buf, ops, rows, cols), tanh_tile)
            probs.sub_(lse_tile).exp_()
            dv_acc[:, j0:j1].baddbmm_(probs.transpose(1, 2), do_tile)
            ds = torch.bmm(do_tile, ops.v[:, j0:j1].transpose(1, 2), out=tile_view(dp_buf, ops, rows, cols))
            ds.sub_(delta).mul_(probs)
            if dmask is not None:
                dmask.add(ds, i0, i1, j0, j1)
            if tanh_tile is not None:
                ds.mul_(tanh_tile.square_().neg_().add_(1.0))
            dk_acc[:, j0:j1].baddbmm_(ds.transpose(1, 2), q_tile)
            dq_tile.baddbmm_(ds, ops.k[:, j0:j1], alpha=p.scale)
        dq5[:, :, :, i0:i1].copy_(dq_tile.view(p.batch, p.heads_kv, g, rows, p.head_dim))
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dk.copy_(dk_acc.view(p.batch, p.heads_kv, p.seqlen_k, p.head_dim))
    dv.copy_(dv_acc.view(p.batch, p.heads_kv, p.seqlen_k, p.head_dim_v))
    grad_mask = None
    if dmask is not None:
        grad_mask = dmask.grad.to(mask.dtype)
    return dq, dk, dv, grad_mask
