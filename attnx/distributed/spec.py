"""`RingSpec`: everything about a ring call except its tensors, fixed once checked."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .sharding import Chunk, shard_chunks


@dataclass(frozen=True)
class RingSpec:
    """The checked options of one `ring_attention` call (identical on every rank).

    ``window_left``/``window_right`` already include ``causal`` (None = unbounded), as in
    `attnx.Problem`; ``offset`` is the aligned position of global query 0 (``p_g = g + offset``
    for global token g).
    """

    group: object
    rank: int
    world_size: int
    sharding: str
    layout: str
    shard_len: int
    scale: float
    softcap: Optional[float]
    window_left: Optional[int]
    window_right: Optional[int]
    offset: int
    alibi_slopes: Optional[torch.Tensor]
    backend: Optional[str]
    exchange: str
    kv_pieces: int = 1  # the ring's K/V (and dK/dV) travel in this many pieces, one after the other
    # the blocks' backward must be deterministic (deterministic=True or torch's switch, with gradients),
    # fixed at the forward as `attnx.attention` fixes it; every local call gets it
    deterministic: bool = False

    def chunks(self, rank: int) -> tuple[Chunk, ...]:
        """The chunks of rank `rank`'s shard."""
        return shard_chunks(rank, self.world_size, self.shard_len, self.sharding)

