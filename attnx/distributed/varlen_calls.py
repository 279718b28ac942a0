"""The local calls of a packed ring step: one varlen `attnx.attention` per group of (query piece, key piece) pairs.

Rank r's queries against rank src's K/V block are, per sequence b, up to four pairs (its query
pieces x src's key pieces of b), each needing the mask of its **global** positions: query
piece at position ``qp`` (within b) against key piece at ``kp`` is a dense problem with
``offset = qp + offset - kp``. The public varlen API takes one offset for a whole call, or
bottom-right per sequence (``Sk_b - Sq_b``), so the pairs are grouped:

* per (query slot, key slot): the pairs of one slot pair are in the same row order in the
  query shard and in the key block, sequence after sequence, so they can be one varlen call;
* within it, by the offset the pair needs: pairs whose offset equals ``Sk' - Sq'`` of their
  pieces (pieces that end on the same token: the diagonal pieces of self-attention) take
  bottom-right; the others wholly inside the band without ALiBi need none (no mask); the rest
  are grouped by their offset value, one call per value (explicit ``offset=``).

A call covers a span of query rows and of key rows; its ``cu_seqlens`` tile both spans with
the pairs and, in between, "gap" entries (query rows with no keys, or keys with no queries),
which cost nothing and leave those rows at ``out = 0``, ``lse = -inf`` (a no-op when merged,
and no gradient). For causal self-attention (no window, ALiBi or explicit offset) that is one
call per slot pair with something to compute: at most 4 per step (zigzag), 1 (contiguous).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from .schedule import NONE, SOME, visibility
from .spec import RingSpec
from .varlen_sharding import SeqChunk, VarlenLayout


@dataclass(frozen=True)
class VarlenSpec:
    """A checked packed ring call: the options (``ring``, its ``shard_len`` unused) and the batch's cut.

    ``layout`` is the queries' cut, ``kv_layout`` the keys' (None: the same, self-attention);
    ``query_shift[b]`` is added to the position of sequence b's queries to align them with its
    keys: ``Sk_b - Sq_b`` (bottom-right, ``offset=None``), else 0 (``ring.offset`` applies).
    """

    ring: RingSpec
    layout: VarlenLayout
    per_sequence_slopes: bool  # alibi_slopes of (B, Hq)
    kv_layout: Optional[VarlenLayout] = None
    query_shift: tuple = ()

    @property
    def keys(self) -> VarlenLayout:
        """The keys' cut."""
        return self.layout if self.kv_layout is None else self.kv_layout

    def query_slots(self, rank: int) -> list:
        """Rank `rank`'s query pieces, each at its position aligned with its sequence's keys."""
        slots = self.layout.slots(rank)
        if not any(self.query_shift):
            return slots
        return [[replace(c, position=c.position + self.query_shift[c.seq]) for c in slot] for slot in slots]


@dataclass
class SubCall:
    """One varlen call: query rows ``[q_lo, q_lo + q_n)`` of the shard against key rows ``[k_lo, k_lo + k_n)``."""

    q_lo: int
    q_n: int
    k_lo: int
    k_n: int
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    window: Optional[tuple]
    offset: Optional[int]
    alibi_slopes: Optional[torch.Tensor]
    pairs: list  # (query piece, key piece, visibility): for the torch-ops backward


def _tile(entries: list[tuple[SeqChunk, SeqChunk]]):
    """``cu_q``, ``cu_k`` (relative to the spans) pairing each query piece with its key piece, gaps in between."""
    q_lo, k_lo = entries[0][0].start, entries[0][1].start
    cu_q, cu_k, seqs = [0], [0], []
    q_at, k_at = q_lo, k_lo
    for qc, kc in entries:
        if qc.start > q_at:  # query rows of other pieces: no keys
            cu_q.append(qc.start - q_lo)
            cu_k.append(k_at - k_lo)
            seqs.append(None)
        if kc.start > k_at:  # keys of other pieces: no queries
            cu_q.append(qc.start - q_lo)
            cu_k.append(kc.start - k_lo)
            seqs.append(None)
        q_at, k_at = qc.start + qc.length, kc.start + kc.length
        cu_q.append(q_at - q_lo)
        cu_k.append(k_at - k_lo)
        seqs.append(qc.seq)
    return cu_q, cu_k, seqs


def _slopes(spec: VarlenSpec, seqs: list) -> Optional[torch.Tensor]:
    slopes = spec.ring.alibi_slopes
    if slopes is None or not spec.per_sequence_slopes:
        return slopes
    index = torch.tensor([0 if b is None else b for b in seqs], dtype=torch.long, device=slopes.device)
    return slopes.index_select(0, index)


def plan_block(spec: VarlenSpec, rank: int, src: int, device) -> list[SubCall]:
    """The varlen calls of rank `rank`'s queries against rank `src`'s K/V block."""
    return plan_calls(spec, spec.query_slots(rank), spec.keys.slots(src), device)


def plan_calls(spec: VarlenSpec, q_slots, k_slots, device) -> list[SubCall]:
    """The varlen calls of the query pieces `q_slots` against the key pieces `k_slots`.

    ``slots[s][b]`` is the s-th piece of sequence b (`VarlenLayout.slots`), its ``start`` a row of
    the query shard or of the key tensor the calls will be given (a block, or a piece of one).
    """
    ring = spec.ring
    window = None
    if ring.window_left is not None or ring.window_right is not None:
        window = (ring.window_left, ring.window_right)
    calls = []
    for q_slot in q_slots:
        for k_slot in k_slots:
            groups: dict = {}
            for qc, kc in zip(q_slot, k_slot):
                seen = visibility(qc.position + ring.offset, qc.length, kc.position, kc.length,
                                  ring.window_left, ring.window_right)
                if seen == NONE:
                    continue
                offset = qc.position + ring.offset - kc.position
                if offset == kc.length - qc.length:  # pieces that end on the same token
                    key = "bottom-right"
                elif seen != SOME and ring.alibi_slopes is None:
                    key = "all"
                else:
                    key = offset
                groups.setdefault(key, []).append((qc, kc, seen))
            for key, members in groups.items():
                cu_q, cu_k, seqs = _tile([(qc, kc) for qc, kc, _ in members])
                first, last = members[0], members[-1]
                q_lo, k_lo = first[0].start, first[1].start
                calls.append(SubCall(
                    q_lo=q_lo, q_n=last[0].start + last[0].length - q_lo,
                    k_lo=k_lo, k_n=last[1].start + last[1].length - k_lo,
                    cu_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
                    cu_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
                    max_q=max(b - a for a, b in zip(cu_q, cu_q[1:])), max_k=max(b - a for a, b in zip(cu_k, cu_k[1:])),
                    window=None if key == "all" else window,
                    offset=None if key in ("all", "bottom-right") else key,
                    alibi_slopes=_slopes(spec, seqs), pairs=members))
    return calls
