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

from attnx.inputs import Inputs
from attnx.limits import LOG2E  # scores are kept in base 2: exp2 is cheaper than exp
from attnx.problem import Problem
from attnx.reference import accumulation_dtype

from . import kv
from .pages import PagedKV

LN2 = math.log(2.0)


@dataclass
class Operands:
    """Everything a tile needs, prepared once per forward or backward call."""

    p: Problem
    acc: torch.dtype                   # accumulation dtype: float64 for float64, else float32
    k: torch.Tensor                    # (B, Hkv, Sk, D): the caller's view, or `PagedKV` (tiles via `key_tile`)
    v: torch.Tensor                    # (B, Hkv, Sk, Dv): likewise (tiles via `value_tile`)
    q5: torch.Tensor                   # (B, Hkv, G, Sq, D) view of the caller's q
    mask5: Optional[torch.Tensor]      # (B, Hkv, G, Sq, Sk) view of the expanded mask
    neg_slopes: Optional[torch.Tensor]  # (B*Hkv, G, 1, 1) -alibi slope * log2(e) in acc
    sinks5: Optional[torch.Tensor]      # (1, Hkv, G, 1, 1) sink logits times log2(e) in acc
    finite_scores: bool = True          # no NaN/inf before the causal/window rule (see `finite_scores`)

    @property
    def batch_heads(self) -> int:
        return self.p.batch * self.p.heads_kv

    def key_tile(self, j0: int, j1: int, buffer) -> torch.Tensor:
        """Keys ``[j0, j1)`` as ``(B*Hkv, cols, D)`` in acc: a view, or a copy into `buffer` (`kv_buffers`)."""
        return kv.tile(self.k, j0, j1, buffer)

    def value_tile(self, j0: int, j1: int, buffer) -> torch.Tensor:
        """Values ``[j0, j1)`` as ``(B*Hkv, cols, Dv)`` in acc: a view, or a copy into `buffer`."""
        return kv.tile(self.v, j0, j1, buffer)

    def kv_buffers(self, keys: int) -> tuple:
        """One worker's scratch for `keys` converted keys and values (None where tiles are read in place)."""
        return kv.buffer_for(self.k, self.acc, keys), kv.buffer_for(self.v, self.acc, keys)

    def chunk_keys(self) -> int:
        """Keys per converted chunk in the forward's products (`kv.key_scores`, `kv.value_products`)."""
        return min(kv.chunk_keys(self.k), kv.chunk_keys(self.v))

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

    def sink_rows(self, rows: int) -> torch.Tensor:
        """The sink logit of each row of a `rows`-row tile, in base 2: ``(B*Hkv, G*rows, 1)`` in acc."""
        p = self.p
        return self.sinks5.expand(p.batch, p.heads_kv, p.group_size, rows, 1).reshape(
            self.batch_heads, p.group_size * rows, 1)


def _unexpanded(t: torch.Tensor) -> torch.Tensor:
    """`t` without the dimensions it was expanded along (stride 0): each element once."""
    return t[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in t.stride())]


def finite_scores(p: Problem, x: Inputs, acc: torch.dtype) -> bool:
    """True when every score is finite before the causal/window rule is applied.

    Boundary tiles then hide keys by adding a 0 / -inf bias (several times faster than
    ``masked_fill_``); a NaN or +inf score there would turn the hidden entry into NaN where
    docs/semantics.md hides it, so inputs that hold NaN or inf take the ``masked_fill_`` path.
    A sum is the cheap test (NaN and inf reach it; a sum that merely overflows only costs the
    slower path). An additive mask may hold -inf, which the bias leaves hidden.
    """
    if not p.has_window:
        return True  # no bias is added
    if isinstance(x.k, PagedKV):
        return False  # checking would gather every page: take the path that needs no check
    for t in (x.q, x.k, x.alibi_slopes):
        if t is not None and not bool(torch.isfinite(t.sum(dtype=acc))):
            return False
    if x.mask is not None and x.mask.is_floating_point():
        return bool(_unexpanded(x.mask).amax() < float("inf"))  # False for NaN too
    return True


def prepare(p: Problem, x: Inputs) -> Operands:
    acc = accumulation_dtype(p.dtype)
    batch_heads = p.batch * p.heads_kv
    split = (p.heads_kv, p.group_size)
    neg_slopes = sinks5 = None
    if x.alibi_slopes is not None:
        neg_slopes = (x.alibi_slopes.to(acc) * -LOG2E).reshape(batch_heads, p.group_size, 1, 1)
    if x.sinks is not None:
        sinks5 = (x.sinks.to(acc) * LOG2E).reshape(1, p.heads_kv, p.group_size, 1, 1)
    return Operands(
        p=p, acc=acc,
        k=x.k, v=x.v,
        q5=x.q.unflatten(1, split),
        mask5=None if x.mask is None else x.mask.unflatten(1, split),
        neg_slopes=neg_slopes, sinks5=sinks5, finite_scores=finite_scores(p, x, acc))
