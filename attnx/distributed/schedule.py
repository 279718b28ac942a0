"""Which (query chunk, key chunk) blocks a rank computes, and which of their keys each query row can reach.

A shard is one or two chunks of consecutive tokens (`sharding.Chunk`), so a rank's queries
against a K/V block are up to four (query chunk, key chunk) pairs. Each pair knows the global
positions of its rows and columns: a pair wholly outside the causal/window band is skipped
without compute (``NONE``), one wholly inside it runs unmasked (``ALL``), the others (``SOME``)
apply the band with the global positions.
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence

import torch

from .sharding import Chunk
from .spec import RingSpec

NONE, ALL, SOME = "none", "all", "some"


def visibility(q_pos: int, q_len: int, k_pos: int, k_len: int, left: Optional[int], right: Optional[int]) -> str:
    """Which keys ``[k_pos, k_pos + k_len)`` the queries at aligned positions ``[q_pos, q_pos + q_len)`` see.

    ``NONE`` (no query sees any key: skip), ``ALL`` (every query sees every key: no mask) or
    ``SOME``; query at position p sees key j iff ``p - left <= j <= p + right`` (None = unbounded).
    """
    if q_len <= 0 or k_len <= 0:
        return NONE
    q_last, k_last = q_pos + q_len - 1, k_pos + k_len - 1
    if (right is not None and k_pos > q_last + right) or (left is not None and k_last < q_pos - left):
        return NONE
    if (right is None or k_last <= q_pos + right) and (left is None or k_pos >= q_last - left):
        return ALL
    return SOME


def pairs(spec: RingSpec, q_chunks: Sequence[Chunk], k_chunks: Sequence[Chunk]) -> Iterator[tuple]:
    """``(query chunk index, query chunk, key chunk, visibility)`` of every pair with something to compute."""
    for i, qc in enumerate(q_chunks):
        for kc in k_chunks:
            seen = visibility(qc.position + spec.offset, qc.length, kc.position, kc.length,
                              spec.window_left, spec.window_right)
            if seen != NONE:
                yield i, qc, kc, seen


def key_span(spec: RingSpec, q_first: int, q_last: int, k_pos: int, keys: int, seen: str) -> tuple[int, int]:
    """The columns ``[lo, hi)`` of a key chunk at `k_pos` that queries at positions ``q_first..q_last`` may see."""
    if seen != SOME:
        return 0, keys
    lo = 0 if spec.window_left is None else max(0, q_first - spec.window_left - k_pos)
    hi = keys if spec.window_right is None else min(keys, q_last + spec.window_right - k_pos + 1)
    return lo, max(lo, hi)


def rows(t: torch.Tensor, c: Chunk) -> torch.Tensor:
    """Chunk `c`'s rows of a ``(B, H, S, W)`` tensor."""
    return t.narrow(2, c.start, c.length)
