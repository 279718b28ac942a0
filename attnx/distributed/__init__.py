"""Context parallelism: exact attention over a sequence sharded across ranks (torch.distributed).

    out = attnx.distributed.ring_attention(q_shard, k_shard, v_shard, causal=True)

Each rank holds a shard of the sequence; K/V blocks travel around the ring of ranks (or are
gathered once, for small K/V) and the partial results are merged exactly through their lse.
`shard`, `unshard`, `gather` and `shard_positions` cut a sequence for P ranks and put it back
together; `shard_varlen`, `unshard_varlen`, `gather_varlen` and `shard_positions_varlen` do the
same for packed (varlen) batches, every sequence cut across the ranks. docs/distributed.md has a runnable torchrun example.
"""
from .api import ring_attention
from .rule import ALLGATHER_MAX_BYTES, EXCHANGES, choose_exchange
from .sharding import SHARDINGS, gather, shard, shard_positions, unshard
from .varlen_sharding import gather_varlen, shard_positions_varlen, shard_varlen, unshard_varlen

__all__ = ["ring_attention", "shard", "unshard", "gather", "shard_positions", "choose_exchange", "SHARDINGS",
           "EXCHANGES", "ALLGATHER_MAX_BYTES", "shard_varlen", "unshard_varlen", "gather_varlen",
           "shard_positions_varlen"]
