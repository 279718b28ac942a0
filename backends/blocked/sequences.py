"""The packed, cache and paged formats' forward: every sequence's tiles run in one pool.

`attnx.formats.per_sequence_forward` runs a backend's dense forward once per sequence, one
after the other; for decode (one query row per sequence) each call is too small to spread
over the CPU's workers, and a paged sequence is gathered whole first (measured as slow as
the attention itself at 32k keys). Here every sequence becomes a `forward.Job` and their
items share the workers (`forward.forward_jobs`); a paged sequence's keys stay in the pool
(`pages.PagedKV`) and each tile gathers its own pages. The backward keeps the per-sequence
path (autograd scatters its gradients back into packed tensors and page pools).
"""
from __future__ import annotations

from typing import Callable, Iterator

from attnx.empty import empty_attention
from attnx.formats import Sequence, gather_outputs, sequence_problem, sequences
from attnx.index_checks import HostIndices, read_indices
from attnx.inputs import Inputs
from attnx.problem import Problem

from .forward import Job, forward_jobs
from .pages import PagedKV
from .tiles import TileSizes


def paged_sequences(p: Problem, x: Inputs, host: HostIndices) -> Iterator[Sequence]:
    """Like `attnx.formats.sequences` for a paged cache, with the keys left in the pool."""
    for b in range(p.batch):
        if host.q_starts is not None:
            q = x.q[host.q_starts[b]:host.q_starts[b + 1]].transpose(0, 1).unsqueeze(0)
        else:
            q = x.q[b:b + 1]
        length = host.lengths[b]
        pages = x.page_table[b, :-(-length // p.page_size)]
        yield Sequence(b, q, PagedKV(x.k, pages, length), PagedKV(x.v, pages, length),
                       None if x.alibi_slopes is None else x.alibi_slopes[b:b + 1])


def sequences_forward(p: Problem, x: Inputs, tile_sizes: Callable[[Problem], TileSizes], out, lse):
    """Fill `out` / `lse` (the format's shapes) for a non-dense problem."""
    host = read_indices(p, x)  # checks every offset, length and page before any read
    seqs = paged_sequences(p, x, host) if p.kv_format == "paged" else sequences(p, x, host)
    results, jobs = [], []
    for seq in seqs:
        p_b = sequence_problem(p, seq)  # reads the keys' shape only
        x_b = Inputs(seq.q, seq.k, seq.v, alibi_slopes=seq.alibi_slopes, sinks=x.sinks)
        if p_b.is_empty:  # nothing to read (the format's k / v stand in for the sequence's)
            results.append(empty_attention(p_b, x_b.replace(k=x.k, v=x.v)))
        else:
            jobs.append(Job(p_b, x_b, tile_sizes(p_b)))
            results.append(jobs[-1])
    forward_jobs(p, jobs)
    outs = [r.out if isinstance(r, Job) else r[0] for r in results]
    lses = [r.lse if isinstance(r, Job) else r[1] for r in results]
    gather_outputs(p, outs, lses, out, lse)
    return out, lse
