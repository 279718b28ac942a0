"""How a sequence is cut across P ranks, and the helpers that shard and gather tensors.

Two shardings of a sequence of ``S`` tokens over ``P`` ranks (every rank holds ``S / P`` rows):

* ``"contiguous"``: rank ``r`` holds tokens ``[r * S/P, (r + 1) * S/P)``.
* ``"zigzag"`` (load-balanced for causal masks): the sequence is cut into ``2P`` chunks of
  ``S / 2P`` tokens and rank ``r`` holds chunks ``r`` and ``2P - 1 - r``, in that order. Under a
  causal mask every rank then has the same amount of work: one early chunk (little to see) and
  one late chunk (much to see).

A rank's shard is described by its `Chunk`s: where each chunk starts in the shard and which
global token it starts at. Everything else in `attnx.distributed` reads positions from them.
"""
from __future__ import annotations

import operator
from typing import NamedTuple, Optional, Sequence

import torch

from ..errors import InvalidArgumentError, InvalidTypeError

SHARDINGS = ("zigzag", "contiguous")


class Chunk(NamedTuple):
    """A run of consecutive global tokens inside one rank's shard."""

    start: int     # first row of the chunk in the rank's shard
    position: int  # global index of that token
    length: int


def check_sharding(sharding) -> str:
    if sharding not in SHARDINGS:
        raise InvalidArgumentError(f"`sharding` must be one of {', '.join(SHARDINGS)}, got {sharding!r}")
    return sharding


def _index(name: str, value) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise InvalidTypeError(f"`{name}` must be an int, got {value!r}") from None


def _rank_and_world(rank, world_size) -> tuple[int, int]:
    rank, world_size = _index("rank", rank), _index("world_size", world_size)
    if world_size < 1:
        raise InvalidArgumentError(f"`world_size` must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise InvalidArgumentError(f"`rank` must lie in [0, {world_size}), got {rank}")
    return rank, world_size


def pieces(world_size: int, sharding: str) -> int:
    """How many equal pieces the sequence is cut into: ``2P`` (zigzag) or ``P`` (contiguous)."""
    return 2 * world_size if sharding == "zigzag" else world_size


def piece_indices(rank: int, world_size: int, sharding: str) -> tuple[int, ...]:
    """Which of the `pieces` rank `rank` holds, in shard order."""
    return (rank,) if sharding == "contiguous" else (rank, 2 * world_size - 1 - rank)


def shard_chunks(rank: int, world_size: int, shard_len: int, sharding: str) -> tuple[Chunk, ...]:
    """The chunks of rank `rank`'s shard of ``shard_len`` rows (``shard_len`` even for zigzag)."""
    indices = piece_indices(rank, world_size, sharding)
    size = shard_len // len(indices)
    return tuple(Chunk(n * size, piece * size, size) for n, piece in enumerate(indices))


def check_shard_length(length: int, sharding: str) -> None:
    """A zigzag shard holds two equal chunks, so its length must be even."""
    if sharding == "zigzag" and length % 2:
        raise InvalidArgumentError(f"a zigzag shard holds two equal chunks: its length {length} must be even")


def _check_split(x, dim, world_size: int, sharding: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise InvalidTypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    dim = _index("dim", dim)
    if not -x.dim() <= dim < x.dim():
        raise InvalidArgumentError(f"`dim` {dim} out of range for a {x.dim()}-D tensor")
    dim %= x.dim()
    n = pieces(world_size, check_sharding(sharding))
    if x.shape[dim] % n:
        raise InvalidArgumentError(f"{sharding} sharding over {world_size} ranks cuts the sequence into {n} equal "
                                   f"pieces: its length {x.shape[dim]} (dim {dim}) must be a multiple of {n}")
    return dim


def shard(x: torch.Tensor, rank: int, world_size: int, *, sharding: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """Rank `rank`'s shard of the full sequence `x` (sequence along `dim`).

    ``dim`` is 2 for ``bhsd`` tensors, 1 for ``bshd`` (and for ``(B, S)`` position ids).
    Contiguous sharding returns a view; zigzag a new tensor.

    Equivalent PyTorch (zigzag)::

        parts = x.chunk(2 * world_size, dim)
        torch.cat([parts[rank], parts[2 * world_size - 1 - rank]], dim)
    """
    rank, world_size = _rank_and_world(rank, world_size)
    dim = _check_split(x, dim, world_size, sharding)
    shard_len = x.shape[dim] // world_size
    parts = [x.narrow(dim, c.position, c.length) for c in shard_chunks(rank, world_size, shard_len, sharding)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unshard(shards: Sequence[torch.Tensor], *, sharding: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """The full sequence from every rank's shard, ``shards[r]`` being rank r's (inverse of `shard`).

    Equivalent PyTorch (zigzag, P = len(shards))::

        halves = [s.chunk(2, dim) for s in shards]
        torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)
    """
    shards = list(shards)
    check_sharding(sharding)
    if not shards or not all(isinstance(s, torch.Tensor) for s in shards):
        raise InvalidTypeError("`shards` must be a non-empty sequence of tensors")
    world_size = len(shards)
    dim = _check_split(shards[0], dim, 1, "contiguous")
    check_shard_length(shards[0].shape[dim], sharding)
    if any(s.shape != shards[0].shape for s in shards):
        raise InvalidArgumentError("every shard must have one shape, got "
                                   + ", ".join(str(tuple(s.shape)) for s in shards))
    shard_len = shards[0].shape[dim]
    ordered: list[Optional[torch.Tensor]] = [None] * pieces(world_size, sharding)
    for rank, s in enumerate(shards):
        chunks = shard_chunks(rank, world_size, shard_len, sharding)
        for piece, c in zip(piece_indices(rank, world_size, sharding), chunks):
            ordered[piece] = s.narrow(dim, c.start, c.length)
    return torch.cat(ordered, dim)


def shard_positions(rank: int, world_size: int, seqlen: int, *, sharding: str = "zigzag",
                    device=None) -> torch.Tensor:
    """Global token indices (int64, ``(seqlen // world_size,)``) of rank `rank`'s rows.

    What rotary embeddings or position ids of the shard need. Equivalent PyTorch::

        shard(torch.arange(seqlen), rank, world_size, sharding=sharding, dim=0)
    """
    rank, world_size = _rank_and_world(rank, world_size)
    seqlen = _index("seqlen", seqlen)
    n = pieces(world_size, check_sharding(sharding))
    if seqlen < 0 or seqlen % n:
        raise InvalidArgumentError(f"`seqlen` must be a multiple of {n} for {sharding} sharding over "
                                   f"{world_size} ranks, got {seqlen}")
    chunks = shard_chunks(rank, world_size, seqlen // world_size, sharding)
    return torch.cat([torch.arange(c.position, c.position + c.length, device=device) for c in chunks])


def gather(x: torch.Tensor, *, group=None, sharding: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """The full sequence on every rank from each rank's shard `x` (a collective; not differentiable).

    The ranks first all-gather a few ints (shape, dtype, device type, `dim`, `sharding`): a rank's
    bad arguments, or shards that differ between ranks, raise `InvalidArgumentError` (or the
    rank's own typed error) on every rank instead of a hang or a crash in the all-gather.

    Equivalent PyTorch::

        shards = [torch.empty_like(x) for _ in range(world_size)]
        torch.distributed.all_gather(shards, x.contiguous(), group)
        unshard(shards, sharding=sharding, dim=dim)
    """
    import torch.distributed as dist

    from .agreement import agree_or_raise, code
    from .group import resolve_group, signature_device

    group, _, world_size = resolve_group(group)
    error, fields = None, {}
    try:
        dim = _check_split(x, dim, 1, "contiguous")
        check_shard_length(x.shape[dim], check_sharding(sharding))
        fields = dict(shape=code(tuple(x.shape)), dtype=code(x.dtype), device=code(x.device.type),
                      dim=dim, sharding=SHARDINGS.index(sharding))
    except Exception as e:  # noqa: BLE001 - told to the others first: none waits in, or dies of, the all-gather
        error, fields = e, dict.fromkeys(("shape", "dtype", "device", "dim", "sharding"), 0)
    if world_size > 1:
        agree_or_raise(group, world_size, error, fields, "gather", signature_device(group))
    elif error is not None:
        raise error
    x = x.contiguous()
    shards = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(shards, x, group=group)
    return unshard(shards, sharding=sharding, dim=dim)
