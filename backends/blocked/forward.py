"""Forward: query tiles outside, key tiles inside, online softmax in the accumulation dtype.

With fewer query tiles than CPU workers (decode, short chunks, speculative verification), a
tile's keys are split into pieces that run on different workers; their softmax states are
merged as flash-decoding's combine does (`merge`), so a 1-row decode uses every core without
splitting each small op across threads.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from attnx.autograd import alloc_out
from attnx.inputs import Inputs
from attnx.problem import Problem

from . import kv
from .operands import LN2, Operands, prepare
from .parallel import map_tiles, worker_count
from .scores import score_tile
from .tiles import TileSizes, key_span

NEG_INF = float("-inf")
# Few query tiles (decode): key pieces per worker, so a worker the OS deschedules on a loaded
# machine leaves its later pieces to the others; each piece at least this many keys.
PIECES_PER_WORKER = 2
MIN_KEYS_PER_PIECE = 1024
# Below this many rows per kv head (G * block_m), K/V are converted in L2-sized chunks (`kv.chunk_keys`).
FEW_ROWS = 64


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


class Partial(NamedTuple):
    """One row block's softmax state over some keys (base 2): running max, sum of exp2, unnormalised out."""

    row_max: torch.Tensor   # (B*Hkv, G*rows, 1)
    row_sum: torch.Tensor   # (B*Hkv, G*rows, 1)
    acc: torch.Tensor       # (B*Hkv, G*rows, Dv)


class Buffers(NamedTuple):
    """One worker's scratch, reused by every tile: scores, converted K / V chunks (None: read in place)
    and one chunk's scores before they join the tile."""

    scores: torch.Tensor
    keys: object                       # `kv.buffer_for`'s scratch, or None
    values: object
    product: Optional[torch.Tensor]

    @classmethod
    def of(cls, ops: Operands, tiles: TileSizes) -> "Buffers":
        # many rows per tile: the GEMMs outweigh converting a whole tile, and chunks only add ops
        few_rows = ops.p.group_size * tiles.block_m < FEW_ROWS
        chunk = min(tiles.block_n, ops.chunk_keys()) if few_rows else tiles.block_n
        keys, values = ops.kv_buffers(chunk)
        product = None if keys is None or chunk == tiles.block_n else scratch(ops, tiles.block_m, chunk)
        return cls(scratch(ops, tiles.block_m, tiles.block_n), keys, values, product)


def attend_keys(ops: Operands, q_tile: torch.Tensor, i0: int, i1: int, lo: int, hi: int, block_n: int,
                buffers: Buffers) -> Partial:
    """Online softmax of query rows ``[i0, i1)`` over keys ``[lo, hi)`` (``lo < hi``), `block_n` at a time."""
    rows = i1 - i0
    row_max = row_sum = acc = None
    for j0 in range(lo, hi, block_n):
        j1 = min(j0 + block_n, hi)
        # scores in base 2 (times log2 e): the softmax below uses exp2
        s = score_tile(ops, q_tile, i0, i1, j0, j1, tile_view(buffers.scores, ops, rows, j1 - j0), buffers)
        tile_max = s.amax(dim=-1, keepdim=True)
        if row_max is None:
            row_max = tile_max
            s.sub_(safe_max(row_max)).exp2_()
            row_sum = s.sum(dim=-1, keepdim=True)
            acc = kv.value_products(s, ops.v, j0, j1, buffers.values, None)
        else:
            new_max = torch.maximum(row_max, tile_max)
            shift = safe_max(new_max)
            rescale = (row_max - shift).exp2_()
            s.sub_(shift).exp2_()
            row_sum.mul_(rescale).add_(s.sum(dim=-1, keepdim=True))
            kv.value_products(s, ops.v, j0, j1, buffers.values, acc.mul_(rescale))
            row_max = new_max
    return Partial(row_max, row_sum, acc)


def merge(parts: list) -> Partial:
    """The state over the union of the parts' key ranges (flash-decoding's combine)."""
    if len(parts) == 1:
        return parts[0]
    row_max = functools.reduce(torch.maximum, [part.row_max for part in parts])
    shift = safe_max(row_max)
    row_sum, acc = torch.zeros_like(parts[0].row_sum), torch.zeros_like(parts[0].acc)
    for part in parts:
        rescale = (part.row_max - shift).exp2_()
        row_sum.addcmul_(part.row_sum, rescale)
        acc.addcmul_(part.acc, rescale)
    return Partial(row_max, row_sum, acc)


def finish(ops: Operands, rows: int, part: Partial):
    """``(out, lse)`` of a row block from its state over all its keys: sinks folded in, normalised."""
    row_max, row_sum, acc = part
    if ops.sinks5 is not None:
        row_max = add_sink(ops, rows, row_max, row_sum, acc)
    # a row that saw no key (and no sink) has acc = 0 and row_sum = 0: out 0, lse = -inf
    acc.div_(row_sum.clamp_min(torch.finfo(ops.acc).tiny))
    lse = safe_max(row_max).add_(row_sum.log2()).mul_(LN2)
    return acc, lse


class WorkItem(NamedTuple):
    """Job `job`'s query rows ``[i0, i1)`` against keys ``[lo, hi)``; `whole` when that is every key they see."""

    job: int
    i0: int
    i1: int
    lo: int
    hi: int
    whole: bool


def work_items(jobs: list, workers: int) -> list:
    """Every query tile of every job; a tile whose keys are a large share of all the work (decode,
    short chunks, one long sequence among short ones) is split into pieces of keys, computed apart
    and merged (`merge`), so each worker gets about `PIECES_PER_WORKER` items' worth of keys."""
    spans = [(n, i0, min(i0 + job.tiles.block_m, job.p.seqlen_q))
             for n, job in enumerate(jobs) for i0 in range(0, job.p.seqlen_q, job.tiles.block_m)]
    spans = [(n, i0, i1, *key_span(jobs[n].p, i0, i1)) for n, i0, i1 in spans]
    total = sum(max(0, hi - lo) for *_, lo, hi in spans)
    piece = max(MIN_KEYS_PER_PIECE, -(-total // (workers * PIECES_PER_WORKER)))
    items = []
    for n, i0, i1, lo, hi in spans:
        count = -(-(hi - lo) // piece) if workers > 1 and hi > lo else 1
        if count == 1:  # one item, also when no key is seen (hi <= lo)
            items.append(WorkItem(n, i0, i1, lo, hi, True))
            continue
        per_piece = -(-(hi - lo) // count)
        items += [WorkItem(n, i0, i1, j0, min(j0 + per_piece, hi), False) for j0 in range(lo, hi, per_piece)]
    return items


def fill_keyless_rows(ops: Operands, out5, lse5, sinks: Optional[torch.Tensor], i0: int, i1: int) -> None:
    """Rows ``[i0, i1)`` see no key: out 0 and lse -inf, or lse = sink (a NaN or infinite sink makes out NaN)."""
    if sinks is None:
        out5[:, :, :, i0:i1].zero_()
        lse5[:, :, :, i0:i1].fill_(NEG_INF)
        return
    sink5 = sinks.float().view(1, ops.p.heads_kv, ops.p.group_size, 1)
    lse5[:, :, :, i0:i1].copy_(sink5.expand_as(lse5[:, :, :, i0:i1]))
    out5[:, :, :, i0:i1].copy_((sink5 * 0.0)[..., None].expand_as(out5[:, :, :, i0:i1]))


class Job:
    """One dense problem's forward: its operands, tiles and the outputs it fills."""

    def __init__(self, p: Problem, x: Inputs, tiles: TileSizes):
        self.p, self.tiles, self.sinks = p, tiles, x.sinks
        self.ops = prepare(p, x)
        self.out = alloc_out(p, x.q)
        self.lse = torch.empty((p.batch, p.heads_q, p.seqlen_q), dtype=torch.float32, device=x.q.device)
        self.out5, self.lse5 = self.ops.split_heads(self.out), self.ops.split_heads(self.lse)

    def write(self, i0: int, i1: int, part: Partial) -> None:
        p = self.p
        tile_out, tile_lse = finish(self.ops, i1 - i0, part)
        split = (p.batch, p.heads_kv, p.group_size, i1 - i0)
        self.out5[:, :, :, i0:i1].copy_(tile_out.view(*split, p.head_dim_v))
        self.lse5[:, :, :, i0:i1].copy_(tile_lse.view(*split))

    def attend(self, item: WorkItem, buffers: Buffers) -> Optional[Partial]:
        """Run `item`: its rows' results written when it is whole, else its partial state returned."""
        if item.hi <= item.lo:  # no query here sees a key
            fill_keyless_rows(self.ops, self.out5, self.lse5, self.sinks, item.i0, item.i1)
            return None
        part = attend_keys(self.ops, self.ops.q_tile(item.i0, item.i1), item.i0, item.i1, item.lo, item.hi,
                           self.tiles.block_n, buffers)
        if not item.whole:
            return part
        self.write(item.i0, item.i1, part)
        return None


def forward_jobs(p: Problem, jobs: list) -> None:
    """Fill every job's outputs; `p` is the whole call (one job, or a format's sequences), which
    decides how many workers run the items of all the jobs together."""
    most_items = sum(max(-(-job.p.seqlen_q // job.tiles.block_m), -(-job.p.seqlen_k // MIN_KEYS_PER_PIECE))
                     for job in jobs)
    workers = worker_count(p, most_items)
    items = work_items(jobs, workers)

    def run(my_items):
        buffers, buffers_job = None, None
        pieces = []
        for item in my_items:
            if buffers_job != item.job:  # sized for one job's tiles and operands
                buffers, buffers_job = Buffers.of(jobs[item.job].ops, jobs[item.job].tiles), item.job
            part = jobs[item.job].attend(item, buffers)
            if part is not None:
                pieces.append((item, part))
        return pieces

    split_rows: dict = {}
    for pieces in map_tiles(p, items, run, cost=lambda item: item.hi - item.lo):
        for item, part in pieces:
            split_rows.setdefault((item.job, item.i0, item.i1), []).append((item.lo, part))
    for (n, i0, i1), parts in split_rows.items():
        # merged in key order, whichever worker ran each piece: the same bits every run
        jobs[n].write(i0, i1, merge([part for _, part in sorted(parts, key=lambda piece: piece[0])]))


def blocked_forward(p: Problem, x: Inputs, tiles: TileSizes):
    """``(out, lse)`` of docs/semantics.md's formula without materialising more than one tile of scores."""
    job = Job(p, x, tiles)
    forward_jobs(p, [job])
    return job.out, job.lse
