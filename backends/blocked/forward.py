"""Forward: query tiles outside, key tiles inside, online softmax in the accumulation dtype."""
from __future__ import annotations

import torch

from attnx.autograd import alloc_out
from attnx.problem import Problem

from .operands import LN2, Operands, prepare
from .parallel import map_tiles
from .scores import score_tile
from .tiles import TileSizes, key_count, key_span


def scratch(ops: Operands, rows: int, cols: int) -> torch.Tensor:
    """A flat buffer big enough for one ``(B*Hkv, G*rows, cols)`` tile, reused by every tile."""
    return torch.empty(ops.batch_heads * ops.p.group_size * rows * cols, dtype=ops.acc, device=ops.k.device)


def tile_view(buffer: torch.Tensor, ops: Operands, rows: int, cols: int) -> torch.Tensor:
    count = ops.batch_heads * ops.p.group_size * rows
    return buffer[: count * cols].view(ops.batch_heads, ops.p.group_size * rows, cols)


def safe_max(m: torch.Tensor) -> torch.Tensor:
    """The running max with -inf (row saw no key yet) replaced by 0, so exp2(s - max) never makes NaN."""
    return torch.nan_to_num(m, neginf=0.0)


def attend_rows(ops: Operands, i0: int, i1: int, tiles: TileSizes, buffer: torch.Tensor):
    """``(out, lse)`` of query rows ``[i0, i1)`` as ``(B*Hkv, G*rows, Dv)`` and ``(B*Hkv, G*rows, 1)``."""
    p = ops.p
    rows = i1 - i0
    lo, hi = key_span(p, i0, i1)
    q_tile = ops.q_tile(i0, i1)
    row_max = row_sum = acc = None
    for j0 in range(lo, hi, tiles.block_n):
        j1 = min(j0 + tiles.block_n, hi)
        # scores in base 2 (times log2 e): the softmax below uses exp2
        s = score_tile(ops, q_tile, i0, i1, j0, j1, tile_view(buffer, ops, rows, j1 - j0))
        tile_max = s.amax(dim=-1, keepdim=True)
        if row_max is None:
            row_max = tile_max
            s.sub_(safe_max(row_max)).exp2_()
            row_sum = s.sum(dim=-1, keepdim=True)
            acc = torch.bmm(s, ops.v[:, j0:j1])
        else:
            new_max = torch.maximum(row_max, tile_max)
            shift = safe_max(new_max)
            rescale = (row_max - shift).exp2_()
            s.sub_(shift).exp2_()
            row_sum.mul_(rescale).add_(s.sum(dim=-1, keepdim=True))
            acc.mul_(rescale).baddbmm_(s, ops.v[:, j0:j1])
            row_max = new_max
    # a row that saw no key has acc = 0 and row_sum = 0: out 0, lse = -inf
    acc.div_(row_sum.clamp_min(torch.finfo(ops.acc).tiny))
    lse = safe_max(row_max).add_(row_sum.log2()).mul_(LN2)
    return acc, lse


def blocked_forward(p: Problem, q, k, v, mask, alibi_slopes, tiles: TileSizes):
    """``(out, lse)`` of SPEC.md's formula without materialising more than one tile of scores."""
    ops = prepare(p, q, k, v, mask, alibi_slopes)
    out = alloc_out(p, q)
    lse = torch.empty((p.batch, p.heads_q, p.seqlen_q), dtype=torch.float32, device=q.device)
    out5, lse5 = ops.split_heads(out), ops.split_heads(lse)
    split = (p.batch, p.heads_kv, p.group_size)

    def run(starts):
        buffer = scratch(ops, tiles.block_m, tiles.block_n)
        for i0 in starts:
            i1 = min(i0 + tiles.block_m, p.seqlen_q)
            lo, hi = key_span(p, i0, i1)
            if hi <= lo:  # no query here sees a key
                out5[:, :, :, i0:i1].zero_()
                lse5[:, :, :, i0:i1].fill_(float("-inf"))
                continue
            tile_out, tile_lse = attend_rows(ops, i0, i1, tiles, buffer)
            out5[:, :, :, i0:i1].copy_(tile_out.view(*split, i1 - i0, p.head_dim_v))
            lse5[:, :, :, i0:i1].copy_(tile_lse.view(*split, i1 - i0))

    map_tiles(p, range(0, p.seqlen_q, tiles.block_m), run,
              cost=lambda i0: key_count(p, i0, tiles.block_m))
    return out, lse
