"""The varlen, cache and paged tensor formats, seen one sequence at a time.

`sequences` reads the index tensors (one host sync), checks every value a kernel
would trust (so nothing a user passes makes a read go out of bounds), and yields
each sequence as a dense ``(1, H, S, D)`` problem. A backend without a kernel of
its own for a format can loop over it; `gather_outputs` puts the results back in
the format's shapes. Slicing and gathers are differentiable, so autograd sees
through them.
"""
from __future__ import annotations

from typing import Iterator, NamedTuple

import torch

from .errors import InvalidArgumentError
from .inputs import Inputs
from .problem import Problem


class Sequence(NamedTuple):
    index: int
    q: torch.Tensor               # (1, Hq, Sq_b, D)
    k: torch.Tensor               # (1, Hkv, Sk_b, D)
    v: torch.Tensor               # (1, Hkv, Sk_b, Dv)
    alibi_slopes: torch.Tensor | None  # (1, Hq) or None


def _offsets(name: str, cu: torch.Tensor, total: int) -> list[int]:
    values = cu.tolist()
    if values[0] != 0 or values[-1] != total or any(b < a for a, b in zip(values, values[1:])):
        raise InvalidArgumentError(f"`{name}` must rise from 0 to the packed length {total}, got {values}")
    return values


def _lengths(p: Problem, x: Inputs) -> list[int]:
    lengths = x.seqlens_k.tolist()
    if any(n < 0 or n > p.seqlen_k for n in lengths):
        raise InvalidArgumentError(f"`seqlens_k` must lie in [0, {p.seqlen_k}] (the cache's capacity), got {lengths}")
    return lengths


def _page_rows(p: Problem, x: Inputs, b: int, length: int) -> torch.Tensor:
    """Pool row of each of sequence b's keys: page * page_size + row in page."""
    used = -(-length // p.page_size)
    pages = x.page_table[b, :used].long()
    num_pages = x.k.shape[0]
    if used and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
        raise InvalidArgumentError(f"`page_table` row {b} names pages outside the pool [0, {num_pages})")
    keys = torch.arange(length, device=pages.device)
    return pages[keys // p.page_size] * p.page_size + keys % p.page_size


def sequences(p: Problem, x: Inputs) -> Iterator[Sequence]:
    """Each sequence of a (non-dense) problem as dense ``bhsd`` views, bottom-right offsets per sequence."""
    q_starts = _offsets("cu_seqlens_q", x.cu_seqlens_q, x.q.shape[0]) if p.q_format == "varlen" else None
    if p.kv_format == "varlen":
        k_starts = _offsets("cu_seqlens_k", x.cu_seqlens_k, x.k.shape[0])
        lengths = [b - a for a, b in zip(k_starts, k_starts[1:])]
    else:
        lengths = _lengths(p, x)
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
