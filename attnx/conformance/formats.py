"""Inputs of the varlen, cache and paged format cases, and the oracle's own way back to dense.

The generator decides every sequence's lengths and (for paged caches) which pages hold it,
packs the values into the format's tensors, and keeps that plan as plain Python (`Packing`).
The oracle unpacks with the plan, never by reading the index tensors the backend reads, so
a backend that misreads them cannot agree with the oracle by sharing its mistake.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .cases import Case


@dataclass
class Packing:
    """How the case's sequences were packed (Python ints, read by the oracle)."""

    q_lengths: list
    k_lengths: list
    pages: Optional[list] = None   # paged: pool page of each page of each sequence


def plan_packing(case: Case, gen: torch.Generator) -> Packing:
    """Three sequences: full length; no queries (varlen) or a short cache; keys that see nothing.

    A case with fewer than three sequences keeps the first ``batch`` of them; every sequence
    of a zero-length case (``seqlen_q`` or ``seqlen_k`` 0) is empty on that side.
    """
    def draw(upper: int) -> int:
        return int(torch.randint(min(1, upper), max(upper, 0) + 1, (1,), generator=gen))

    sq, sk = case.seqlen_q, case.seqlen_k
    if case.q_format == "varlen":
        q_lengths = ([sq, 0, draw(sq)] + [draw(sq) for _ in range(case.batch - 3)])[:case.batch]
    else:
        q_lengths = [sq] * case.batch
    k_lengths = ([sk, draw(sk), 0] + [draw(sk) for _ in range(case.batch - 3)])[:case.batch]
    pages = None
    if case.kv_format == "paged":
        need = [math.ceil(n / case.page_size) for n in k_lengths]
        order = torch.randperm(sum(need) + 2, generator=gen).tolist()  # two pages no sequence uses
        pages, start = [], 0
        for n in need:
            pages.append(order[start:start + n])
            start += n
    return Packing(q_lengths, k_lengths, pages)


def _cumulative(lengths: list) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)


def packed_shapes(case: Case, packing: Packing) -> dict:
    """Shapes of q, k, v as the format stores them."""
    hq, hkv, d, dv = case.heads_q, case.heads_kv, case.head_dim, case.head_dim_v
    b, sq, sk = case.batch, case.seqlen_q, case.seqlen_k
    bshd = case.layout == "bshd"
    if case.q_format == "varlen":
        q = (sum(packing.q_lengths), hq, d)
    else:
        q = (b, sq, hq, d) if bshd else (b, hq, sq, d)
    if case.kv_format == "varlen":
        total = sum(packing.k_lengths)
        k, v = (total, hkv, d), (total, hkv, dv)
    elif case.kv_format == "paged":
        pool = sum(len(p) for p in packing.pages) + 2
        k, v = (pool, case.page_size, hkv, d), (pool, case.page_size, hkv, dv)
    else:
        k, v = ((b, sk, hkv, d), (b, sk, hkv, dv)) if bshd else ((b, hkv, sk, d), (b, hkv, sk, dv))
    return {"q": q, "k": k, "v": v}


def out_shape(case: Case, packing: Packing) -> tuple:
    if case.q_format == "varlen":
        return (sum(packing.q_lengths), case.heads_q, case.head_dim_v)
    if case.layout == "bshd":
        return (case.batch, case.seqlen_q, case.heads_q, case.head_dim_v)
    return (case.batch, case.heads_q, case.seqlen_q, case.head_dim_v)


def lse_shape(case: Case, packing: Packing) -> tuple:
    if case.q_format == "varlen":
        return (case.heads_q, sum(packing.q_lengths))
    return (case.batch, case.heads_q, case.seqlen_q)


def index_tensors(case: Case, packing: Packing, device) -> dict:
    """The keyword arguments that describe the format to `attnx.attention`."""
    index = {}
    if case.q_format == "varlen":
        index["cu_seqlens_q"] = _cumulative(packing.q_lengths)
        index["max_seqlen_q"] = case.seqlen_q
    if case.kv_format == "varlen":
        index["cu_seqlens_k"] = _cumulative(packing.k_lengths)
        index["max_seqlen_k"] = case.seqlen_k
    if case.kv_format in ("cache", "paged"):
        index["seqlens_k"] = torch.tensor(packing.k_lengths, dtype=torch.int32)
    if case.kv_format == "paged":
        capacity = math.ceil(case.seqlen_k / case.page_size)
        table = torch.zeros((case.batch, capacity), dtype=torch.int32)
        for b, pages in enumerate(packing.pages):
            table[b, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        index["page_table"] = table
    return {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in index.items()}


def _bhsd(case: Case, t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2) if case.layout == "bshd" else t


def unpack(case: Case, packing: Packing, views: dict) -> list:
    """Per sequence ``(q, k, v)`` as dense ``(1, H, S, D)`` tensors (differentiable slices)."""
    starts_q = [0] + list(torch.tensor(packing.q_lengths).cumsum(0).tolist())
    starts_k = [0] + list(torch.tensor(packing.k_lengths).cumsum(0).tolist())
    sequences = []
    for b in range(case.batch):
        if case.q_format == "varlen":
            q = views["q"][starts_q[b]:starts_q[b + 1]].transpose(0, 1)[None]
        else:
            q = _bhsd(case, views["q"])[b:b + 1]
        n = packing.k_lengths[b]
        if case.kv_format == "varlen":
            k, v = (views[x][starts_k[b]:starts_k[b + 1]].transpose(0, 1)[None] for x in ("k", "v"))
        elif case.kv_format == "paged":
            k, v = (torch.cat([views[x][page] for page in packing.pages[b]] or [views[x][:0, 0]], dim=0)[:n]
                    .transpose(0, 1)[None] for x in ("k", "v"))
        else:
            k, v = (_bhsd(case, views[x])[b:b + 1, :, :n] for x in ("k", "v"))
        sequences.append((q, k, v))
    return sequences


def pack_outputs(case: Case, outs: list, lses: list, views: Optional[dict] = None) -> tuple:
    """Per-sequence ``(1, Hq, Sq_b, Dv)`` outputs and ``(1, Hq, Sq_b)`` lses in the format's shapes.

    With no sequence at all (``batch`` 0) the outputs are empty tensors like ``views["q"]``, joined
    to every view's graph by a zero so that gradients (all zero) reach the inputs.
    """
    if not outs and views is not None:
        q = views["q"]
        hq, dv, sq = case.heads_q, case.head_dim_v, case.seqlen_q
        shape = ((0, hq, dv) if case.q_format == "varlen" else (0, sq, hq, dv) if case.layout == "bshd"
                 else (0, hq, sq, dv))
        zero = sum(t.sum() for t in views.values() if t.is_floating_point()) * 0
        lse = q.new_zeros((hq, 0) if case.q_format == "varlen" else (0, hq, sq))
        return q.new_zeros(shape) + zero, lse
    if case.q_format == "varlen":
        return (torch.cat([o[0].transpose(0, 1) for o in outs], dim=0), torch.cat([l[0] for l in lses], dim=-1))
    out, lse = torch.cat(outs, dim=0), torch.cat(lses, dim=0)
    return (out.transpose(1, 2) if case.layout == "bshd" else out), lse
