"""Tile sizes, and which (query tile, key tile) pairs causal/window rules leave.

Positions follow docs/semantics.md: query ``i`` sits at ``p_i = i + offset`` (``p.key_offset``:
the stored offset, or bottom-right ``Sk - Sq`` when None) and may see key ``j`` iff
``p_i - window_left <= j <= p_i + window_right`` (``None`` = unbounded).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from attnx.errors import InvalidArgumentError, InvalidTypeError
from attnx.problem import Problem

# CPU (measured on a 2-core Zen 4 against torch's own CPU flash attention, see
# benchmarks/blocked_cpu.py): 256 x 512 forward and 256 x 256 backward tiles per head;
# smaller query blocks lose more to per-op overhead than they gain in cache.
CPU_BLOCK_N = 512
CPU_BACKWARD_BLOCK_N = 256
# Few query rows (decode, short chunks): more keys per forward tile, so per-op overhead is paid
# over as much work as a 256 x 512 tile, up to this many keys (benchmarks/cpu_decode.py).
CPU_MAX_BLOCK_N = 2048
CPU_TILE_ELEMENTS = 1 << 23
# Accelerators: each op is a kernel launch, so tiles are as large as memory allows.
GPU_BLOCK_M = 1024
GPU_BLOCK_N = 2048
GPU_TILE_ELEMENTS = 1 << 25
MIN_BLOCK_M = 64


class TileSizes(NamedTuple):
    """Query rows (``block_m``) and keys (``block_n``) per tile, per head."""

    block_m: int
    block_n: int


def _cpu_block_m(seqlen_q: int) -> int:
    # PyTorch's CPU flash attention uses 256 / 64 / 32 by query length; 128 measured
    # better than 64 here, and a short query block is one tile.
    if seqlen_q >= 768:
        return 256
    if seqlen_q >= 192:
        return 128
    return seqlen_q


def _cpu_block_n(block_m: int) -> int:
    return max(CPU_BLOCK_N, min(CPU_MAX_BLOCK_N, 256 * CPU_BLOCK_N // max(1, block_m)))


def default_tile_sizes(p: Problem, backward: bool = False) -> TileSizes:
    """The tile sizes the blocked backend uses for `p` (forward, or `backward`) when none are forced."""
    heads = p.batch * p.heads_q
    if p.device_type == "cpu":
        block_m = _cpu_block_m(p.seqlen_q)
        block_n = CPU_BACKWARD_BLOCK_N if backward else _cpu_block_n(block_m)
        budget = CPU_TILE_ELEMENTS
    else:
        block_m, block_n, budget = GPU_BLOCK_M, GPU_BLOCK_N, GPU_TILE_ELEMENTS
    block_m = min(block_m, p.seqlen_q)
    block_n = min(block_n, p.seqlen_k)
    # one tile of scores for all heads stays within the budget (the query block shrinks first)
    while block_m > MIN_BLOCK_M and heads * block_m * block_n > budget:
        block_m //= 2
    while block_n > MIN_BLOCK_M and heads * block_m * block_n > budget:
        block_n //= 2
    return TileSizes(max(1, block_m), max(1, block_n))


def check_tile_size(name: str, value) -> Optional[int]:
    """Validate a user-forced tile size (a positive int, or None for the default)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"`{name}` must be a positive int or None, got {value!r}")
    if value < 1:
        raise InvalidArgumentError(f"`{name}` must be >= 1, got {value}")
    return value


def key_span(p: Problem, i0: int, i1: int) -> tuple[int, int]:
    """Keys ``[lo, hi)`` that any query of rows ``[i0, i1)`` may see (``hi <= lo``: none)."""
    offset = p.key_offset
    lo = 0 if p.window_left is None else max(0, i0 + offset - p.window_left)
    hi = p.seqlen_k if p.window_right is None else min(p.seqlen_k, i1 - 1 + offset + p.window_right + 1)
    return lo, hi


def key_count(p: Problem, i0: int, block_m: int) -> int:
    """How many keys the query tile starting at `i0` visits (its cost, for scheduling)."""
    lo, hi = key_span(p, i0, min(i0 + block_m, p.seqlen_q))
    return max(0, hi - lo)


def tile_is_interior(p: Problem, i0: int, i1: int, j0: int, j1: int) -> bool:
    """True when every query of ``[i0, i1)`` may see every key of ``[j0, j1)``."""
    offset = p.key_offset
    if p.window_left is not None and j0 < i1 - 1 + offset - p.window_left:
        return False
    if p.window_right is not None and j1 - 1 > i0 + offset + p.window_right:
        return False
    return True


def allowed_tile(p: Problem, i0: int, i1: int, j0: int, j1: int, device) -> torch.Tensor:
    """Bool ``(i1 - i0, j1 - j0)``: may each query see each key (boundary tiles only)."""
    pos = torch.arange(i0 + p.key_offset, i1 + p.key_offset, device=device)[:, None]
    key = torch.arange(j0, j1, device=device)[None, :]
    allowed = torch.ones((i1 - i0, j1 - j0), dtype=torch.bool, device=device)
    if p.window_left is not None:
        allowed &= key >= pos - p.window_left
    if p.window_right is not None:
        allowed &= key <= pos + p.window_right
    return allowed


def alibi_distance(p: Problem, i0: int, i1: int, j0: int, j1: int, dtype, device) -> torch.Tensor:
    """``|p_i - j|`` as ``(i1 - i0, j1 - j0)`` in `dtype`."""
    pos = torch.arange(i0 + p.key_offset, i1 + p.key_offset, device=device, dtype=dtype)[:, None]
    key = torch.arange(j0, j1, device=device, dtype=dtype)[None, :]
    return (pos - key).abs_()
