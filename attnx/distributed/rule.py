"""Which K/V exchange a call uses when ``exchange="auto"``: one size rule.

Both exchanges bring every rank the K/V of every other rank once in the forward (``P - 1``
shards received per rank). They differ in

* latency: the ring takes ``P - 1`` dependent hops, each hidden behind one block's compute only
  when that compute is long enough; the all-gather is one collective, overlapped with the
  rank's own block;
* bytes in training: the ring moves K/V again in the backward plus dK/dV ``P`` times; the
  all-gather keeps the gathered K/V and only reduce-scatters dK/dV (``P - 1`` shards);
* memory: the all-gather holds the whole K/V (``P`` shards) from forward to backward; the ring
  holds three shards at a time.

So the all-gather wins while the whole K/V is small: short sequences, or GQA-heavy shapes
where K/V are a fraction of q. A call that asks for ``kv_pieces > 1`` asks for the least
memory, which only the ring gives: ``"auto"`` then picks the ring, and ``"allgather"`` is
an error.
"""
from __future__ import annotations

import operator

from ..errors import InvalidArgumentError, InvalidTypeError

EXCHANGES = ("auto", "ring", "allgather")
# all-gather while the whole K/V of the group is at most this many bytes ...
ALLGATHER_MAX_BYTES = 32 << 20
# ... or at most the bytes of the rank's own query shard (GQA-heavy shapes)


def check_kv_pieces(kv_pieces, exchange: str) -> int:
    """`kv_pieces` as an int >= 1, compatible with `exchange` (typed errors otherwise)."""
    try:
        if isinstance(kv_pieces, bool):
            raise TypeError
        kv_pieces = operator.index(kv_pieces)
    except TypeError:
        raise InvalidTypeError(f"`kv_pieces` must be an int, got {kv_pieces!r}") from None
    if kv_pieces < 1:
        raise InvalidArgumentError(f"`kv_pieces` must be >= 1, got {kv_pieces}")
    if kv_pieces > 1 and exchange == "allgather":
        raise InvalidArgumentError(f"`kv_pieces={kv_pieces}` cuts the ring's K/V blocks into pieces, and "
                                   "`exchange=\"allgather\"` has no ring: use exchange=\"ring\" (or \"auto\")")
    return kv_pieces


def choose_exchange(world_size: int, q_bytes: int, kv_bytes: int) -> str:
    """``"allgather"`` if ``world_size * kv_bytes <= max(ALLGATHER_MAX_BYTES, q_bytes)``, else ``"ring"``.

    ``kv_bytes`` is the size of the rank's K and V shards together, ``q_bytes`` of its q shard.
    One rank needs no exchange at all (``"ring"``, which then sends nothing).
    """
    if world_size == 1:
        return "ring"
    return "allgather" if world_size * kv_bytes <= max(ALLGATHER_MAX_BYTES, q_bytes) else "ring"
