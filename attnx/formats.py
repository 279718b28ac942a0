"""The varlen, cache and paged tensor formats, seen one sequence at a time.

`sequences` reads the index tensors (one host sync) and checks every value a kernel
would trust (`attnx.index_checks.read_indices`: nothing a user passes makes a read go
out of bounds; a bad value raises an error naming its entry), and yields
each sequence as a dense ``(1, H, S, D)`` problem. A backend without a kernel of
its own for a format runs its dense kernels once per sequence through
`per_sequence_forward` / `per_sequence_backward`; `gather_outputs` puts results
back in the format's shapes. Slicing and gathers are differentiable, so the
backward hands each sequence's gradients to autograd, which scatters them back
into the packed tensors and page pools.
"""
from __future__ import annotations

from typing import Iterator, NamedTuple, Optional

import torch

from .empty import empty_attention
from .index_checks import HostIndices, read_indices
from .inputs import Grads, Inputs
from .problem import Problem


class Sequence(NamedTuple):
    index: int
    q: torch.Tensor               # (1, Hq, Sq_b, D)
    k: torch.Tensor               # (1, Hkv, Sk_b, D)
    v: torch.Tensor               # (1, Hkv, Sk_b, Dv)
    alibi_slopes: torch.Tensor | None  # (1, Hq) or None


def _page_rows(p: Problem, x: Inputs, b: int, length: int) -> torch.Tensor:
    """Pool row of each of sequence b's keys: page * page_size + row in page (pages checked already)."""
    pages = x.page_table[b, :-(-length // p.page_size)].long()
    keys = torch.arange(length, device=pages.device)
    return pages[keys // p.page_size] * p.page_size + keys % p.page_size


def sequences(p: Problem, x: Inputs, host: Optional[HostIndices] = None) -> Iterator[Sequence]:
    """Each sequence of a (non-dense) problem as dense ``bhsd`` views, bottom-right offsets per sequence.

    ``host``: the call's index values from `read_indices` (read here when None).
    """
    host = read_indices(p, x) if host is None else host
    q_starts, k_starts, lengths = host
    for b in range(p.batch):
        if q_starts is not None:
            q = x.q[q_starts[b]:q_starts[b + 1]].transpose(0, 1).unsqueeze(0)
        else:
            q = x.q[b:b + 1]
        if p.kv_format == "varlen":
            k, v = (t[k_starts[b]:k_starts[b + 1]].transpose(0, 1).unsqueeze(0) for t in (x.k, x.v))
        elif p.kv_format == "cache":
            k, v = x.k[b:b + 1, :, :lengths[b]], x.v[b:b + 1, :, :lengths[b]]
        else:  # paged
            rows = _page_rows(p, x, b, lengths[b])
            k, v = (t.flatten(0, 1)[rows].transpose(0, 1).unsqueeze(0) for t in (x.k, x.v))
        slopes = None if x.alibi_slopes is None else x.alibi_slopes[b:b + 1]
        yield Sequence(b, q, k, v, slopes)


def gather_outputs(p: Problem, outs: list, lses: list, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Write per-sequence ``(1, Hq, Sq_b, Dv)`` outputs and ``(1, Hq, Sq_b)`` lses into the format's tensors.

    ``out``/``lse`` are what `attnx.alloc_out`/`attnx.autograd.lse_shape` describe.
    """
    if p.q_format == "varlen":
        if outs:
            out.copy_(torch.cat([o[0].transpose(0, 1) for o in outs], dim=0))
            lse.copy_(torch.cat([l[0] for l in lses], dim=-1))
        return
    for b, (o, l) in enumerate(zip(outs, lses)):
        out[b:b + 1].copy_(o)
        lse[b:b + 1].copy_(l)


def sequence_problem(p: Problem, seq: Sequence) -> Problem:
    """The dense problem of one sequence (bottom-right alignment stays per sequence)."""
    mask_free = dict(mask_kind=None, mask_shape=None, mask_requires_grad=False)
    return p._replace(batch=1, seqlen_q=seq.q.shape[2], seqlen_k=seq.k.shape[2], layout="bhsd",
                      q_format="dense", kv_format="dense", page_size=None, **mask_free)


def _sequence_inputs(x: Inputs, seq: Sequence) -> Inputs:
    return Inputs(seq.q, seq.k, seq.v, alibi_slopes=seq.alibi_slopes, sinks=x.sinks)


def _rows(p: Problem, t: torch.Tensor, b: int, starts) -> torch.Tensor:
    """Sequence b's rows of an output-shaped tensor: (1, H, Sq_b, ...)."""
    if p.q_format == "varlen":
        return t[starts[b]:starts[b + 1]].transpose(0, 1).unsqueeze(0)
    return t[b:b + 1]


def _lse_rows(p: Problem, lse: torch.Tensor, b: int, starts) -> torch.Tensor:
    if p.q_format == "varlen":
        return lse[:, starts[b]:starts[b + 1]].unsqueeze(0)
    return lse[b:b + 1]


def per_sequence_forward(p: Problem, x: Inputs, dense_forward, out: torch.Tensor, lse: torch.Tensor):
    """Fill ``out``/``lse`` by running ``dense_forward(p_b, x_b) -> (out_b, lse_b)`` on each sequence."""
    outs, lses = [], []
    for seq in sequences(p, x):
        p_b, x_b = sequence_problem(p, seq), _sequence_inputs(x, seq)
        o, l = empty_attention(p_b, x_b) if p_b.is_empty else dense_forward(p_b, x_b)
        outs.append(o)
        lses.append(l)
    gather_outputs(p, outs, lses, out, lse)
    return out, lse


def per_sequence_backward(p: Problem, x: Inputs, out, lse, dout, dense_backward) -> Grads:
    """`Grads` of a non-dense problem from ``dense_backward(p_b, x_b, out_b, lse_b, dout_b)`` per sequence."""
    leaves = {n: getattr(x, n).detach().requires_grad_() for n in ("q", "k", "v")}
    host = read_indices(p, x)
    starts = host.q_starts
    views, grads, dsinks = [], [], None
    with torch.enable_grad():
        for seq in sequences(p, x.replace(**leaves), host):
            p_b = sequence_problem(p, seq)
            if p_b.is_empty:
                continue
            detached = Sequence(seq.index, seq.q.detach(), seq.k.detach(), seq.v.detach(), seq.alibi_slopes)
            b = seq.index
            g = dense_backward(p_b, _sequence_inputs(x, detached), _rows(p, out, b, starts),
                               _lse_rows(p, lse, b, starts), _rows(p, dout, b, starts))
            views += [seq.q, seq.k, seq.v]
            grads += [g.dq, g.dk, g.dv]
            if g.dsinks is not None:
                dsinks = g.dsinks if dsinks is None else dsinks + g.dsinks
        if views:
            torch.autograd.backward(views, grads)
    found = {n: t.grad if t.grad is not None else torch.zeros_like(t) for n, t in leaves.items()}
    if p.has_sinks and dsinks is None:
        dsinks = torch.zeros_like(x.sinks, dtype=torch.float32)
    return Grads(found["q"], found["k"], found["v"], None, dsinks)
