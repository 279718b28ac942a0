"""blocked: the FlashAttention algorithm in plain PyTorch ops, on any torch device.

Queries and keys are processed in tiles with an online softmax (forward) and an
lse-based recomputation (backward), so memory grows with ``S * D``, never
``Sq * Sk``. Every feature of docs/semantics.md (explicit alignment offsets and
attention sinks included) is supported on every dtype and head dim. The varlen,
cache and paged formats run the same tiles per sequence (forward: every sequence's
tiles share the workers, `sequences.py`; backward: `attnx.formats.per_sequence_backward`),
so memory stays linear there too.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from attnx.autograd import alloc_out, lse_shape
from attnx.backend import Backend
from attnx.formats import per_sequence_backward
from attnx.inputs import Grads, Inputs
from attnx.problem import FORMAT_PAIRS, Problem

from .backward import blocked_backward
from .forward import blocked_forward
from .sequences import sequences_forward
from .tiles import TileSizes, check_tile_size, default_tile_sizes


class BlockedBackend(Backend):
    name = "blocked"
    description = ("FlashAttention's tiled online-softmax algorithm in torch ops; any device, dtype, head dim "
                   "and mask; memory grows with S*D, not Sq*Sk")
    device_types = frozenset({"cpu", "cuda", "mps", "xpu"})
    deterministic = True
    supports_offset = True
    supports_sinks = True
    formats = FORMAT_PAIRS
    # behind naive for small CPU problems (naive ranks itself 30 there), behind the GPU kernels
    priority = {"*": 20}

    def __init__(self):
        self._forced = TileSizes(None, None)

    def extra_reasons(self, p: Problem) -> list[str]:
        import torch

        if p.device_type == "mps" and p.dtype == torch.float64:
            return ["float64 is not supported on mps"]
        return []

    # -- tile sizes ---------------------------------------------------------------------
    def tile_sizes(self, p: Problem, backward: bool = False) -> TileSizes:
        """The tiles used for `p` (forward, or `backward`): forced ones (`force_tile_sizes`) over the defaults."""
        default = default_tile_sizes(p, backward)
        block_m = self._forced.block_m or default.block_m
        block_n = self._forced.block_n or default.block_n
        return TileSizes(min(block_m, p.seqlen_q), min(block_n, p.seqlen_k))

    @contextlib.contextmanager
    def force_tile_sizes(self, block_m: Optional[int] = None, block_n: Optional[int] = None):
        """Context manager: use `block_m` query rows and `block_n` keys per tile (None = default).

        The setting is process-wide while the block runs (the backward pass runs
        inside it too when ``.backward()`` is called within the block)::

            with attnx.backends.blocked.BACKEND.force_tile_sizes(block_m=128, block_n=256):
                out = attnx.attention(q, k, v, backend="blocked")
        """
        forced = TileSizes(check_tile_size("block_m", block_m), check_tile_size("block_n", block_n))
        previous, self._forced = self._forced, forced
        try:
            yield forced
        finally:
            self._forced = previous

    # -- compute ------------------------------------------------------------------------
    def forward(self, p: Problem, x: Inputs):
        if p.is_dense:
            return blocked_forward(p, x, self.tile_sizes(p))
        lse = torch.empty(lse_shape(p, x.q), dtype=torch.float32, device=x.q.device)
        # every sequence's tiles in one pool; pages gathered a tile at a time
        return sequences_forward(p, x, self.tile_sizes, alloc_out(p, x.q), lse)

    def backward(self, p: Problem, x: Inputs, out, lse, dout) -> Grads:
        if p.is_dense:
            return blocked_backward(p, x, out, lse, dout, self.tile_sizes(p, backward=True))
        return per_sequence_backward(p, x, out, lse, dout, self.backward)


BACKEND = BlockedBackend()
