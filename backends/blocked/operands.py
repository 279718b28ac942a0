"""The operands of one call, arranged so one kv head's G query heads form one GEMM batch.

Query heads ``h = hkv * G + g`` (G = Hq // Hkv) are viewed as ``(B, Hkv, G, S, D)``; a
query tile becomes ``(B * Hkv, G * rows, D)`` so every GEMM runs against the kv head
itself: K and V are never repeated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from attnx.problem import Problem
from attnx.reference import accumulation_dtype

LOG2E = math.log2(math.e)  # scores are kept in base 2: exp2 is cheaper than exp
LN2 = math.log(2.0)


def batched_kv(t: torch.Tensor, batch_heads: int, dtype) -> torch.Tensor:
    """``(B, Hkv, S, D)`` as ``(B * Hkv, S, D)`` in `dtype`: a view when strides allow, else one copy."""
    flat = t.reshape(batch_heads, t.shape[2], t.shape[3]).to(dtype)
    if flat.stride(-1) != 1 and flat.stride(-2) != 1:
        flat = flat.contiguous()  # BLAS needs one unit stride; copy once, not per tile
    return flat


@dataclass
class Operands:
    """Everything a tile needs, prepared once per forward or backward call."""

    p: Problem
    acc: torch.dtype                   # accumulation dtype: float64 for float64, else float32
    k: torch.Tensor                    # (B*Hkv, Sk, D) in acc
    v: torch.Tensor                    # (B*Hkv, Sk, Dv) in acc
    q5: torch.Tensor                   # (B, Hkv, G, Sq, D) view of the caller's q
    mask5: Optional[torch.Tensor]      # (B, Hkv, G, Sq, Sk) view of the expanded mask
    neg_slopes: Optional[torch.Tensor]  # (B*Hkv, G, 1, 1) -alibi slope * log2(e) in acc

    @property
    def batch_heads(self) -> int:
        return self.p.batch * self.p.heads_kv

    def split_heads(self, t: torch.Tensor) -> torch.Tensor:
        """``(B, Hq, ...)`` view as ``(B, Hkv, G, ...)``."""
        return t.unflatten(1, (self.p.heads_kv, self.p.group_size))

    def rows(self, t5_tile: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
        """A ``(B, Hkv, G, rows, X)`` tile as a fresh ``(B*Hkv, G*rows, X)`` tensor in acc, times `scale`."""
        b, hkv, g, rows, width = t5_tile.shape
        dense = torch.empty((b, hkv, g, rows, width), dtype=self.acc, device=t5_tile.device)
        if scale is not None and t5_tile.dtype == self.acc:
            torch.mul(t5_tile, scale, out=dense)
        else:
            dense.copy_(t5_tile)
            if scale is not None:
                dense.mul_(scale)
        return dense.view(b * hkv, g * rows, width)

    def q_tile(self, i0: int, i1: int) -> torch.Tensor:
        """Query rows ``[i0, i1)`` times ``scale * log2(e)``: ``(B*Hkv, G*rows, D)`` in acc."""
        return self.rows(self.q5[:, :, :, i0:i1], self.p.scale * LOG2E)


def prepare(p: Problem, q, k, v, mask, alibi_slopes) -> Operands:
    acc = accumulation_dtype(p.dtype)
    batch_heads = p.batch * p.heads_kv
    split = (p.heads_kv, p.group_size)
    neg_slopes = None
    if alibi_slopes is not None:
        neg_slopes = (alibi_slopes.to(acc) * -LOG2E).reshape(batch_heads, p.group_size, 1, 1)
    return Operands(
        p=p, acc=acc,
        k=batched_kv(k, batch_heads, acc), v=batched_kv(v, batch_heads, acc),
        q5=q.unflatten(1, split),
        mask5=None if mask is None else mask.unflatten(1, split),
        neg_slopes=neg_slopes)
