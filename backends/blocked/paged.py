"""The paged format's forward, one sequence at a time, reading the page pool tile by tile.

`attnx.formats.per_sequence_forward` hands a backend each sequence as dense tensors, which
for a paged cache means gathering the sequence's keys and values whole first (measured as
slow as the attention itself at 32k keys). Here each sequence's keys stay in the pool
(`pages.PagedKV`) and the dense forward gathers one tile's pages at a time. The backward
keeps the per-sequence path (its gradients are scattered back into the pools by autograd).
"""
from __future__ import annotations

from typing import Callable

from attnx.empty import empty_attention
from attnx.formats import Sequence, gather_outputs, sequence_problem
from attnx.index_checks import read_indices
from attnx.inputs import Inputs
from attnx.problem import Problem

from .forward import blocked_forward
from .pages import PagedKV
from .tiles import TileSizes


def paged_forward(p: Problem, x: Inputs, tile_sizes: Callable[[Problem], TileSizes], out, lse):
    """Fill `out` / `lse` (the format's shapes) for a paged-kv problem (`p.kv_format == "paged"`)."""
    host = read_indices(p, x)  # checks every page and length before any read
    outs, lses = [], []
    for b in range(p.batch):
        if host.q_starts is not None:
            q = x.q[host.q_starts[b]:host.q_starts[b + 1]].transpose(0, 1).unsqueeze(0)
        else:
            q = x.q[b:b + 1]
        length = host.lengths[b]
        pages = x.page_table[b, :-(-length // p.page_size)]
        seq = Sequence(b, q, PagedKV(x.k, pages, length), PagedKV(x.v, pages, length),
                       None if x.alibi_slopes is None else x.alibi_slopes[b:b + 1])
        p_b = sequence_problem(p, seq)  # reads the keys' shape only
        x_b = Inputs(seq.q, seq.k, seq.v, alibi_slopes=seq.alibi_slopes, sinks=x.sinks)
        if p_b.is_empty:  # no key: nothing to gather (the pools stand in for the keys)
            o, l = empty_attention(p_b, x_b.replace(k=x.k, v=x.v))
        else:
            o, l = blocked_forward(p_b, x_b, tile_sizes(p_b))
        outs.append(o)
        lses.append(l)
    gather_outputs(p, outs, lses, out, lse)
    return out, lse
