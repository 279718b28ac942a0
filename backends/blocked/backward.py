"""Backward (FlashAttention-2 style): recompute each score tile from lse, never store Sq x Sk.

Per tile: P = exp(S - lse); dV += P^T dO; dP = dO V^T; dS = P * (dP - delta) with
delta = rowsum(dO * O); softcap multiplies dS by 1 - tanh^2; dK += dS^T Q * scale;
dQ += dS K * scale; an additive mask that requires grad receives dS summed over the
dimensions it broadcasts. GQA grads sum over the group inside the GEMMs.
"""
from __future__ import annotations

import functools

import torch

from attnx.problem import Problem

from .forward import scratch, tile_view
from .operands import LN2, LOG2E, Operands, prepare
from .parallel import map_tiles
from .scores import score_tile
from .tiles import TileSizes, key_count, key_span


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """Where the gradients are allocated (in the caller's strides); tests poison it with NaN."""
    return torch.empty_like(t)


def refine_lse(ops: Operands, q_tile, lse_tile, i0: int, i1: int, lo: int, hi: int, block_n: int, buffer):
    """Base-2 lse in the accumulation dtype from the float32 one: ``lse + log2(sum exp2(s - lse))``.

    The forward's lse is float32; float64 inputs need the exact denominator in float64.
    """
    total = torch.zeros_like(lse_tile)
    for j0 in range(lo, hi, block_n):
        j1 = min(j0 + block_n, hi)
        s = score_tile(ops, q_tile, i0, i1, j0, j1, tile_view(buffer, ops, i1 - i0, j1 - j0))
        total.add_(s.sub_(lse_tile).exp2_().sum(dim=-1, keepdim=True))
    return lse_tile + total.log2()


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


class KeyGradients:
    """dK, dV (and dmask) accumulators of one worker, in the accumulation dtype."""

    def __init__(self, ops: Operands, shared_mask_grad):
        p = ops.p
        device = ops.k.device
        self.dk = torch.zeros((ops.batch_heads, p.seqlen_k, p.head_dim), dtype=ops.acc, device=device)
        self.dv = torch.zeros((ops.batch_heads, p.seqlen_k, p.head_dim_v), dtype=ops.acc, device=device)
        self.dmask = None
        if p.mask_requires_grad:
            self.dmask = shared_mask_grad if shared_mask_grad is not None else MaskGradient(ops)


def rows_backward(ops: Operands, grads: KeyGradients, i0: int, i1: int, do_tile, delta, lse_tile,
                  tiles: TileSizes, buffers) -> torch.Tensor:
    """Accumulate dK, dV, dmask of query rows ``[i0, i1)`` into `grads`; return their dQ tile."""
    p = ops.p
    rows = i1 - i0
    lo, hi = key_span(p, i0, i1)
    scores_buf, dp_buf, tanh_buf, key_buf = buffers
    q_tile = ops.q_tile(i0, i1)  # times scale * log2(e)
    dq_tile = torch.zeros((ops.batch_heads, p.group_size * rows, p.head_dim), dtype=ops.acc, device=q_tile.device)
    if ops.acc != torch.float32:  # float64: the float32 lse is not exact enough
        dead_rows = lse_tile == float("inf")
        lse_tile = refine_lse(ops, q_tile, lse_tile, i0, i1, lo, hi, tiles.block_n, scores_buf)
        lse_tile.masked_fill_(dead_rows, float("inf"))
    for j0 in range(lo, hi, tiles.block_n):
        j1 = min(j0 + tiles.block_n, hi)
        cols = j1 - j0
        tanh_tile = None if tanh_buf is None else tile_view(tanh_buf, ops, rows, cols)
        probs = score_tile(ops, q_tile, i0, i1, j0, j1, tile_view(scores_buf, ops, rows, cols), tanh_tile)
        probs.sub_(lse_tile).exp2_()
        # into a contiguous tile, then added: baddbmm_ into a strided slice loops over the batch
        key_grad = torch.bmm(probs.transpose(1, 2), do_tile, out=key_buf[: ops.batch_heads * cols * p.head_dim_v]
                             .view(ops.batch_heads, cols, p.head_dim_v))
        grads.dv[:, j0:j1].add_(key_grad)
        ds = torch.bmm(do_tile, ops.v[:, j0:j1].transpose(1, 2), out=tile_view(dp_buf, ops, rows, cols))
        ds.sub_(delta).mul_(probs)
        if grads.dmask is not None:
            grads.dmask.add(ds, i0, i1, j0, j1)
        if tanh_tile is not None:
            ds.mul_(tanh_tile.square_().neg_().add_(1.0))
        key_grad = torch.bmm(ds.transpose(1, 2), q_tile, out=key_buf[: ops.batch_heads * cols * p.head_dim]
                             .view(ops.batch_heads, cols, p.head_dim))
        grads.dk[:, j0:j1].add_(key_grad, alpha=LN2)  # q_tile holds scale*log2(e)
        dq_tile.baddbmm_(ds, ops.k[:, j0:j1], alpha=p.scale)
    return dq_tile


def blocked_backward(p: Problem, q, k, v, mask, alibi_slopes, out, lse, dout, tiles: TileSizes):
    """``(dq, dk, dv, dmask)``; dmask is None unless ``p.mask_requires_grad``."""
    ops = prepare(p, q, k, v, mask, alibi_slopes)
    dq = empty_like(q)
    dq5, out5, dout5, lse5 = (ops.split_heads(t) for t in (dq, out, dout, lse))
    split = (p.batch, p.heads_kv, p.group_size)
    # a mask with a query-row dimension gets disjoint rows from each worker: share one gradient
    shared_mask_grad = None
    if p.mask_requires_grad and p.mask_shape[2] != 1:
        shared_mask_grad = MaskGradient(ops)

    def run(starts):
        grads = KeyGradients(ops, shared_mask_grad)
        tile_buffer = functools.partial(scratch, ops, tiles.block_m, tiles.block_n)
        key_buffer = torch.empty(ops.batch_heads * tiles.block_n * max(p.head_dim, p.head_dim_v), dtype=ops.acc,
                                 device=q.device)
        buffers = (tile_buffer(), tile_buffer(), tile_buffer() if p.softcap is not None else None, key_buffer)
        for i0 in starts:
            i1 = min(i0 + tiles.block_m, p.seqlen_q)
            lo, hi = key_span(p, i0, i1)
            if hi <= lo:  # no query here sees a key: zero gradients
                dq5[:, :, :, i0:i1].zero_()
                continue
            do_tile = ops.rows(dout5[:, :, :, i0:i1])
            delta = (do_tile * ops.rows(out5[:, :, :, i0:i1])).sum(dim=-1, keepdim=True)
            lse_tile = ops.rows(lse5[:, :, :, i0:i1, None], LOG2E)  # base 2, like the scores
            # rows that saw no key: lse = -inf; +inf makes exp2(s - lse) = 0 for them
            lse_tile.masked_fill_(lse_tile == float("-inf"), float("inf"))
            dq_tile = rows_backward(ops, grads, i0, i1, do_tile, delta, lse_tile, tiles, buffers)
            dq5[:, :, :, i0:i1].copy_(dq_tile.view(*split, i1 - i0, p.head_dim))
        return grads

    parts = map_tiles(p, range(0, p.seqlen_q, tiles.block_m), run,
                      cost=lambda i0: key_count(p, i0, tiles.block_m))
    dk_acc, dv_acc = parts[0].dk, parts[0].dv
    for part in parts[1:]:
        dk_acc.add_(part.dk)
        dv_acc.add_(part.dv)
    dk, dv = empty_like(k), empty_like(v)
    dk.copy_(dk_acc.view(p.batch, p.heads_kv, p.seqlen_k, p.head_dim))
    dv.copy_(dv_acc.view(p.batch, p.heads_kv, p.seqlen_k, p.head_dim_v))
    grad_mask = None
    if p.mask_requires_grad:
        dmask = parts[0].dmask
        if shared_mask_grad is None:
            for part in parts[1:]:
                dmask.grad.add_(part.dmask.grad)
        grad_mask = dmask.grad.to(mask.dtype)
    return dq, dk, dv, grad_mask
