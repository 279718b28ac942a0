"""Backward (FlashAttention-2 style): recompute each score tile from lse, never store Sq x Sk.

Per tile: P = exp(S - lse); dV += P^T dO; dP = dO V^T; dS = P * (dP - delta) with
delta = rowsum(dO * O); softcap multiplies dS by 1 - tanh^2; dK += dS^T Q * scale;
dQ += dS K * scale; an additive mask that requires grad receives dS summed over the
dimensions it broadcasts. GQA grads sum over the group inside the GEMMs. The forward's
lse already counts the sinks, so P needs nothing more for them; their gradient comes
from every row's lse and delta (`attnx.inputs.sinks_grad`).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from attnx.inputs import Grads, Inputs, sinks_grad
from attnx.limits import LOG2E
from attnx.problem import Problem

from .forward import scratch, tile_view
from .operands import LN2, Operands, prepare
from .parallel import map_tiles
from .scores import score_tile
from .tiles import TileSizes, key_count, key_span

INF = float("inf")


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """Where the gradients are allocated (in the caller's strides); tests poison it with NaN."""
    return torch.empty_like(t)


def refine_lse(ops: Operands, q_tile, lse_tile, i0: int, i1: int, lo: int, hi: int, block_n: int, buffers):
    """Base-2 lse in the accumulation dtype from the float32 one: ``lse + log2(sum exp2(s - lse))``.

    The forward's lse is float32; float64 inputs need the exact denominator in float64
    (the sinks included). Rows that saw nothing (lse = +inf here) keep +inf.
    """
    dead_rows = lse_tile == INF
    total = torch.zeros_like(lse_tile)
    for j0 in range(lo, hi, block_n):
        j1 = min(j0 + block_n, hi)
        s = score_tile(ops, q_tile, i0, i1, j0, j1, tile_view(buffers.scores, ops, i1 - i0, j1 - j0), buffers)
        total.add_(s.sub_(lse_tile).exp2_().sum(dim=-1, keepdim=True))
    if ops.sinks5 is not None:
        total.add_((ops.sink_rows(i1 - i0) - lse_tile).exp2_())
    return (lse_tile + total.log2()).masked_fill_(dead_rows, INF)


class SinkGradient:
    """Every row's delta and lse (natural log, accumulation dtype), filled tile by tile, for dsinks."""

    def __init__(self, ops: Operands, lse: torch.Tensor):
        self.split = (ops.p.batch, ops.p.heads_kv, ops.p.group_size)
        self.lse = lse.to(ops.acc, copy=True)
        # rows no tile visits saw no key: out = 0 there, so delta = 0
        self.delta = torch.zeros_like(self.lse)
        self.lse5, self.delta5 = ops.split_heads(self.lse), ops.split_heads(self.delta)
        self.refined = ops.acc != torch.float32

    def record(self, i0: int, i1: int, delta: torch.Tensor, lse_tile: torch.Tensor) -> None:
        """`delta` and the base-2 `lse_tile` (+inf: saw nothing) of rows ``[i0, i1)``, ``(B*Hkv, G*rows, 1)``."""
        self.delta5[:, :, :, i0:i1].copy_(delta.view(*self.split, i1 - i0))
        if self.refined:
            natural = (lse_tile * LN2).masked_fill_(lse_tile == INF, float("-inf"))
            self.lse5[:, :, :, i0:i1].copy_(natural.view(*self.split, i1 - i0))

    def grad(self, sinks: torch.Tensor) -> torch.Tensor:
        return sinks_grad(sinks, self.lse, self.delta).to(torch.float32)


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


class BackwardBuffers(NamedTuple):
    """One worker's scratch, reused by every tile (K / V None where their tiles are used in place)."""

    scores: torch.Tensor
    dp: torch.Tensor
    tanh: Optional[torch.Tensor]       # softcap only
    key_grad: torch.Tensor             # one tile of dK or dV before it is added
    keys: object                       # whole converted tiles (`Operands.kv_buffers`), or None
    values: object
    product: None = None               # tiles are never split into chunks here (`kv.key_scores`)

    @classmethod
    def of(cls, ops: Operands, tiles: TileSizes) -> "BackwardBuffers":
        p = ops.p
        tile = functools.partial(scratch, ops, tiles.block_m, tiles.block_n)
        key_grad = torch.empty(ops.batch_heads * tiles.block_n * max(p.head_dim, p.head_dim_v), dtype=ops.acc,
                               device=ops.k.device)
        return cls(tile(), tile(), tile() if p.softcap is not None else None, key_grad,
                   *ops.kv_buffers(tiles.block_n))


def rows_backward(ops: Operands, grads: KeyGradients, i0: int, i1: int, q_tile, do_tile, delta, lse_tile,
                  tiles: TileSizes, buffers) -> torch.Tensor:
    """Accumulate dK, dV, dmask of query rows ``[i0, i1)`` into `grads`; return their dQ tile.

    `q_tile` holds ``q * scale * log2(e)``; `lse_tile` is base 2 with +inf for rows that saw nothing.
    """
    p = ops.p
    rows = i1 - i0
    lo, hi = key_span(p, i0, i1)
    dq_tile = torch.zeros((ops.batch_heads, p.group_size * rows, p.head_dim), dtype=ops.acc, device=q_tile.device)
    for j0 in range(lo, hi, tiles.block_n):
        j1 = min(j0 + tiles.block_n, hi)
        cols = j1 - j0
        tanh_tile = None if buffers.tanh is None else tile_view(buffers.tanh, ops, rows, cols)
        keys = ops.key_tile(j0, j1, buffers.keys)
        probs = score_tile(ops, q_tile, i0, i1, j0, j1, tile_view(buffers.scores, ops, rows, cols), buffers,
                           tanh_tile, keys=keys)
        probs.sub_(lse_tile).exp2_()
        # into a contiguous tile, then added: baddbmm_ into a strided slice loops over the batch
        key_grad = torch.bmm(probs.transpose(1, 2), do_tile,
                             out=buffers.key_grad[: ops.batch_heads * cols * p.head_dim_v]
                             .view(ops.batch_heads, cols, p.head_dim_v))
        grads.dv[:, j0:j1].add_(key_grad)
        values = ops.value_tile(j0, j1, buffers.values)
        ds = torch.bmm(do_tile, values.transpose(1, 2), out=tile_view(buffers.dp, ops, rows, cols))
        ds.sub_(delta).mul_(probs)
        if grads.dmask is not None:
            grads.dmask.add(ds, i0, i1, j0, j1)
        if tanh_tile is not None:
            ds.mul_(tanh_tile.square_().neg_().add_(1.0))
        key_grad = torch.bmm(ds.transpose(1, 2), q_tile, out=buffers.key_grad[: ops.batch_heads * cols * p.head_dim]
                             .view(ops.batch_heads, cols, p.head_dim))
        grads.dk[:, j0:j1].add_(key_grad, alpha=LN2)  # q_tile holds scale*log2(e)
        dq_tile.baddbmm_(ds, keys, alpha=p.scale)
    return dq_tile


def blocked_backward(p: Problem, x: Inputs, out, lse, dout, tiles: TileSizes) -> Grads:
    """`Grads` of q, k, v (dmask when ``p.mask_requires_grad``, dsinks when ``p.has_sinks``)."""
    ops = prepare(p, x)
    dq = empty_like(x.q)
    dq5, out5, dout5, lse5 = (ops.split_heads(t) for t in (dq, out, dout, lse))
    split = (p.batch, p.heads_kv, p.group_size)
    # a mask with a query-row dimension gets disjoint rows from each worker: share one gradient
    shared_mask_grad = None
    if p.mask_requires_grad and p.mask_shape[2] != 1:
        shared_mask_grad = MaskGradient(ops)
    sink_grad: Optional[SinkGradient] = SinkGradient(ops, lse) if p.has_sinks else None

    def run(starts):
        grads = KeyGradients(ops, shared_mask_grad)
        buffers = BackwardBuffers.of(ops, tiles)
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
            lse_tile.masked_fill_(lse_tile == float("-inf"), INF)
            q_tile = ops.q_tile(i0, i1)  # times scale * log2(e)
            if ops.acc != torch.float32:  # float64: the float32 lse is not exact enough
                lse_tile = refine_lse(ops, q_tile, lse_tile, i0, i1, lo, hi, tiles.block_n, buffers)
            if sink_grad is not None:
                sink_grad.record(i0, i1, delta, lse_tile)
            dq_tile = rows_backward(ops, grads, i0, i1, q_tile, do_tile, delta, lse_tile, tiles, buffers)
            dq5[:, :, :, i0:i1].copy_(dq_tile.view(*split, i1 - i0, p.head_dim))
        return grads

    parts = map_tiles(p, range(0, p.seqlen_q, tiles.block_m), run,
                      cost=lambda i0: key_count(p, i0, tiles.block_m))
    dk_acc, dv_acc = parts[0].dk, parts[0].dv
    for part in parts[1:]:
        dk_acc.add_(part.dk)
        dv_acc.add_(part.dv)
    dk, dv = empty_like(x.k), empty_like(x.v)
    dk.copy_(dk_acc.view(p.batch, p.heads_kv, p.seqlen_k, p.head_dim))
    dv.copy_(dv_acc.view(p.batch, p.heads_kv, p.seqlen_k, p.head_dim_v))
    grad_mask = None
    if p.mask_requires_grad:
        dmask = parts[0].dmask
        if shared_mask_grad is None:
            for part in parts[1:]:
                dmask.grad.add_(part.dmask.grad)
        grad_mask = dmask.grad.to(x.mask.dtype)
    dsinks = sink_grad.grad(x.sinks) if sink_grad is not None else None
    return Grads(dq, dk, dv, grad_mask, dsinks)
