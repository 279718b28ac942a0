"""Forward: query tiles outside, key tiles inside, online softmax in the accumulation dtype."""
from __future__ import annotations

from typing import Optional

import torch

from attnx.autograd import alloc_out
from attnx.inputs import Inputs
from attnx.problem import Problem

from .operands import LN2, Operands, prepare
from .parallel import map_tiles
from .scores import score_tile
from .tiles import TileSizes, key_count, key_span

NEG_INF = float("-inf")


def scratch(ops: Operands, rows: int, cols: int) -> torch.Tensor:
    """A flat buffer big enough for one ``(B*Hkv, G*rows, cols)`` tile, reused by every tile."""
    return torch.empty(ops.batch_heads * ops.p.group_size * rows * cols, dtype=ops.acc, device=ops.k.device)


def tile_view(buffer: torch.Tensor, ops: Operands, rows: int, cols: int) -> torch.Tensor:
    count = ops.batch_heads * ops.p.group_size * rows
    return buffer[: count * cols].view(ops.batch_heads, ops.p.group_size * rows, cols)


def safe_max(m: torch.Tensor) -> torch.Tensor:
    """The running max with -inf (row saw no key yet) replaced by 0, so exp2(s - max) never makes NaN.

    Only -inf: a NaN max (a NaN score) stays NaN and makes its row NaN (docs/semantics.md).
    """
    return m.masked_fill(m == NEG_INF, 0.0)


def add_sink(ops: Operands, rows: int, row_max, row_sum, acc) -> torch.Tensor:
    """Fold each row's sink (a key of score ``sink``, value 0) into `row_sum`; return the new max."""
    sink = ops.sink_rows(rows)
    new_max = torch.maximum(row_max, sink)
    shift = safe_max(new_max)
    rescale = (row_max - shift).exp2_()
    row_sum.mul_(rescale).add_((sink - shift).exp2_())
    acc.mul_(rescale)
    return new_max


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
    if ops.sinks5 is not None:
        row_max = add_sink(ops, rows, row_max, row_sum, acc)
    # a row that saw no key (and no sink) has acc = 0 and row_sum = 0: out 0, lse = -inf
    acc.div_(row_sum.clamp_min(torch.finfo(ops.acc).tiny))
    lse = safe_max(row_max).add_(row_sum.log2()).mul_(LN2)
    return acc, lse


def fill_keyless_rows(ops: Operands, out5, lse5, sinks: Optional[torch.Tensor], i0: int, i1: int) -> None:
    """Rows ``[i0, i1)`` see no key: out 0 and lse -inf, or lse = sink (a NaN or infinite sink makes out NaN)."""
    if sinks is None:
        out5[:, :, :, i0:i1].zero_()
        lse5[:, :, :, i0:i1].fill_(NEG_INF)
        return
    sink5 = sinks.float().view(1, ops.p.heads_kv, ops.p.group_size, 1)
    lse5[:, :, :, i0:i1].copy_(sink5.expand_as(lse5[:, :, :, i0:i1]))
    out5[:, :, :, i0:i1].copy_((sink5 * 0.0)[..., None].expand_as(out5[:, :, :, i0:i1]))


def blocked_forward(p: Problem, x: Inputs, tiles: TileSizes):
    """``(out, lse)`` of docs/semantics.md's formula without materialising more than one tile of scores."""
    ops = prepare(p, x)
    out = alloc_out(p, x.q)
    lse = torch.empty((p.batch, p.heads_q, p.seqlen_q), dtype=torch.float32, device=x.q.device)
    out5, lse5 = ops.split_heads(out), ops.split_heads(lse)
    split = (p.batch, p.heads_kv, p.group_size)

    def run(starts):
        buffer = scratch(ops, tiles.block_m, tiles.block_n)
        for i0 in starts:
            i1 = min(i0 + tiles.block_m, p.seqlen_q)
            lo, hi = key_span(p, i0, i1)
            if hi <= lo:  # no query here sees a key
                fill_keyless_rows(ops, out5, lse5, x.sinks, i0, i1)
                continue
            tile_out, tile_lse = attend_rows(ops, i0, i1, tiles, buffer)
            out5[:, :, :, i0:i1].copy_(tile_out.view(*split, i1 - i0, p.head_dim_v))
            lse5[:, :, :, i0:i1].copy_(tile_lse.view(*split, i1 - i0))

    map_tiles(p, range(0, p.seqlen_q, tiles.block_m), run,
              cost=lambda i0: key_count(p, i0, tiles.block_m))
    return out, lse
