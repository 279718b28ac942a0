"""Packed (varlen) batches across ranks: every sequence cut into pieces, each rank holding its pieces of all.

A packed batch is ``x`` of ``(total_tokens, ...)`` with int32 ``cu_seqlens`` ``(B + 1,)``. For P
ranks every sequence of ``L`` tokens is cut into ``n`` pieces (``n = 2P`` zigzag, ``P``
contiguous), piece ``c`` being tokens ``[c * L // n, (c + 1) * L // n)``; rank r holds piece r
(contiguous) or pieces r and 2P-1-r (zigzag) of every sequence, sequence after sequence, with
its own ``cu_seqlens`` (its share of each sequence). A sequence shorter than ``n`` leaves some
pieces empty; an empty sequence is empty everywhere. `VarlenLayout` is that cut, for every rank,
from the global lengths alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..errors import InvalidArgumentError, InvalidTypeError
from ..index_checks import check_offsets
from .sharding import _rank_and_world, check_sharding, piece_indices, pieces


@dataclass(frozen=True)
class SeqChunk:
    """One piece of one sequence in a rank's packed shard."""

    seq: int       # which sequence of the batch
    start: int     # first row in the rank's shard
    position: int  # index of that token within its sequence
    length: int


def piece_bounds(length: int, n: int) -> list[int]:
    """Token boundaries of the `n` pieces of a sequence of `length` tokens: piece c is ``[b[c], b[c + 1])``."""
    return [c * length // n for c in range(n + 1)]


class VarlenLayout:
    """Where every piece of every sequence lies, on every rank, for global sequence lengths `lengths`."""

    def __init__(self, lengths: Sequence[int], world_size: int, sharding: str):
        self.lengths = tuple(int(n) for n in lengths)
        self.world_size, self.sharding = world_size, sharding
        self._slots, self._tokens = [], []
        n = pieces(world_size, sharding)
        bounds = [piece_bounds(length, n) for length in self.lengths]
        for rank in range(world_size):
            indices = piece_indices(rank, world_size, sharding)
            slots: list[list[SeqChunk]] = [[] for _ in indices]
            row = 0
            for b, cut in enumerate(bounds):
                for s, piece in enumerate(indices):
                    a, e = cut[piece], cut[piece + 1]
                    slots[s].append(SeqChunk(b, row, a, e - a))
                    row += e - a
            self._slots.append(slots)
            self._tokens.append(row)

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def slots(self, rank: int) -> list[list[SeqChunk]]:
        """``slots[s][b]``: rank `rank`'s s-th piece of sequence b (zigzag: s = 0 early, 1 late)."""
        return self._slots[rank]

    def tokens(self, rank: int) -> int:
        """Rows of rank `rank`'s shard."""
        return self._tokens[rank]

    def max_tokens(self) -> int:
        return max(self._tokens)

    def local_lengths(self, rank: int) -> list[int]:
        """Rank `rank`'s share of each sequence."""
        return [sum(slot[b].length for slot in self._slots[rank]) for b in range(self.batch)]

    def cu_seqlens(self, rank: int) -> list[int]:
        cu = [0]
        for n in self.local_lengths(rank):
            cu.append(cu[-1] + n)
        return cu


def read_cu_seqlens(name: str, cu, total: Optional[int], tensor: str) -> list[int]:
    """The values of an int32/int64 ``(B + 1,)`` tensor rising from 0 to `total`, the rows of `tensor` (one host sync).

    ``total=None``: to wherever they end (the whole batch's offsets, no tensor beside them). A bad
    entry raises `InvalidArgumentError` naming it (`attnx.index_checks.check_offsets`).
    """
    if not isinstance(cu, torch.Tensor):
        raise InvalidTypeError(f"`{name}` must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1 or cu.numel() < 1:
        raise InvalidArgumentError(f"`{name}` must be a 1-D int32 tensor of B + 1 offsets, got "
                                   f"{str(cu.dtype).replace('torch.', '')} of shape {tuple(cu.shape)}")
    if cu.device.type == "meta":
        raise InvalidArgumentError(f"`{name}` is on the meta device: its offsets cannot be read")
    values = cu.tolist()
    check_offsets(name, values, values[-1] if total is None else total, tensor)
    return values


def _lengths(cu: list[int]) -> list[int]:
    return [b - a for a, b in zip(cu, cu[1:])]


def _packed(x, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise InvalidTypeError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise InvalidArgumentError(f"`{name}` must be packed along dim 0, got a 0-D tensor")


def _rows(x: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    parts = [x.narrow(0, a, n) for a, n in ranges if n]
    if not parts:
        return x.narrow(0, 0, 0)
    return parts[0] if len(parts) == 1 else torch.cat(parts, 0)


def shard_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, rank: int, world_size: int, *,
                 sharding: str = "zigzag") -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s shard of a packed batch: ``(x_shard, cu_seqlens_shard)`` (int32, on cu_seqlens' device).

    `x` is ``(total_tokens, ...)`` (q, k, v, dout, position ids), `cu_seqlens` its ``(B + 1,)``
    offsets. Every sequence is cut into ``2P`` (zigzag) or ``P`` (contiguous) pieces; the shard
    holds this rank's piece(s) of every sequence, in order. Differentiable.

    Equivalent PyTorch (zigzag; ``n = 2 * world_size``)::

        parts = []
        for a, e in zip(cu[:-1], cu[1:]):
            L = e - a
            for c in (rank, n - 1 - rank):
                parts.append(x[a + c * L // n: a + (c + 1) * L // n])
        x_shard = torch.cat(parts)   # cu_seqlens_shard: the running sum of each sequence's share
    """
    rank, world_size = _rank_and_world(rank, world_size)
    check_sharding(sharding)
    _packed(x)
    cu = read_cu_seqlens("cu_seqlens", cu_seqlens, x.shape[0], "x")
    layout = VarlenLayout(_lengths(cu), world_size, sharding)
    ranges = sorted((c.start, cu[c.seq] + c.position, c.length) for slot in layout.slots(rank) for c in slot)
    shard = _rows(x, [(a, n) for _, a, n in ranges])
    return shard, torch.tensor(layout.cu_seqlens(rank), dtype=torch.int32, device=cu_seqlens.device)


def _layout_from_shards(cus: list[list[int]], sharding: str, what: str) -> VarlenLayout:
    """The layout whose shards have the local lengths `cus` describe; a typed error if they were cut otherwise."""
    if len({len(cu) for cu in cus}) > 1:
        raise InvalidArgumentError(f"every rank's {what} must describe one batch: got "
                                   + ", ".join(str(len(cu) - 1) for cu in cus) + " sequences")
    local = [_lengths(cu) for cu in cus]
    totals = [sum(column) for column in zip(*local)] if local[0] else []
    layout = VarlenLayout(totals, len(cus), sharding)
    for rank, mine in enumerate(local):
        if layout.local_lengths(rank) != mine:
            raise InvalidArgumentError(
                f"rank {rank}'s {what} give it {mine} tokens of the sequences, but {sharding} sharding of "
                f"sequences of {list(totals)} tokens over {len(cus)} ranks gives it {layout.local_lengths(rank)} "
                "(cut the batch with attnx.distributed.shard_varlen)")
    return layout


def unshard_varlen(shards: Sequence[torch.Tensor], cu_seqlens: Sequence[torch.Tensor], *,
                   sharding: str = "zigzag") -> tuple[torch.Tensor, torch.Tensor]:
    """The packed batch ``(x, cu_seqlens)`` from every rank's ``shards[r]``, ``cu_seqlens[r]`` (`shard_varlen`'s inverse).

    Equivalent PyTorch: for each sequence b, for each piece c = 0 .. n-1, the rows of piece c
    of sequence b from the rank that holds it (rank c, or 2P-1-c for the late zigzag pieces).
    """
    shards, cus = list(shards), list(cu_seqlens)
    check_sharding(sharding)
    if not shards or len(shards) != len(cus):
        raise InvalidArgumentError(f"give one cu_seqlens per shard, got {len(shards)} shards and {len(cus)}")
    for s in shards:
        _packed(s, "shards")
    values = [read_cu_seqlens(f"cu_seqlens[{r}]", cu, s.shape[0], f"shards[{r}]")
              for r, (s, cu) in enumerate(zip(shards, cus))]
    layout = _layout_from_shards(values, sharding, "cu_seqlens")
    where = {}  # (sequence, piece) -> (rank, chunk)
    for rank in range(len(shards)):
        for piece, slot in zip(piece_indices(rank, len(shards), sharding), layout.slots(rank)):
            for c in slot:
                where[c.seq, piece] = (rank, c)
    parts = []
    for b in range(layout.batch):
        for piece in range(pieces(len(shards), sharding)):
            rank, c = where[b, piece]
            if c.length:
                parts.append(shards[rank].narrow(0, c.start, c.length))
    full = torch.cat(parts, 0) if parts else shards[0].narrow(0, 0, 0)
    cu = [0]
    for n in layout.lengths:
        cu.append(cu[-1] + n)
    return full, torch.tensor(cu, dtype=torch.int32, device=cus[0].device)


def shard_positions_varlen(cu_seqlens: torch.Tensor, rank: int, world_size: int, *, sharding: str = "zigzag",
                           device=None) -> torch.Tensor:
    """Index within its sequence (int64, one per row) of each row of rank `rank`'s shard (for RoPE).

    `cu_seqlens` describes the **whole** packed batch. Equivalent PyTorch::

        within = torch.cat([torch.arange(e - a) for a, e in zip(cu[:-1], cu[1:])])
        shard_varlen(within, cu, rank, world_size, sharding=sharding)[0]
    """
    rank, world_size = _rank_and_world(rank, world_size)
    check_sharding(sharding)
    # the whole batch's offsets, no tensor beside them: they end where they end
    cu = read_cu_seqlens("cu_seqlens", cu_seqlens, None, "cu_seqlens")
    layout = VarlenLayout(_lengths(cu), world_size, sharding)
    chunks = sorted((c for slot in layout.slots(rank) for c in slot), key=lambda c: c.start)
    parts = [torch.arange(c.position, c.position + c.length, device=device) for c in chunks if c.length]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)


def gather_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, *, group=None,
                  sharding: str = "zigzag") -> tuple[torch.Tensor, torch.Tensor]:
    """The whole packed batch ``(x, cu_seqlens)`` on every rank from each rank's shard (a collective, not differentiable).

    Shards may differ in length by a few rows; they travel padded to the longest. Equivalent
    PyTorch: all-gather every rank's ``x`` and ``cu_seqlens``, then `unshard_varlen`. The ranks
    first all-gather a few ints (number of sequences, ``x``'s shape after dim 0, dtype, device
    type, `sharding`): a rank's bad arguments, or shards that differ between ranks, raise a typed
    error on every rank instead of a hang or a crash in the all-gather.
    """
    import torch.distributed as dist

    from .agreement import agree_or_raise, code
    from .group import resolve_group, signature_device
    from .sharding import SHARDINGS

    group, _, world_size = resolve_group(group)
    names = ("number of sequences", "shape after dim 0", "dtype", "device type", "sharding")
    error, fields, mine, device = None, dict.fromkeys(names, 0), None, torch.device("cpu")
    try:
        check_sharding(sharding)
        _packed(x)
        mine = read_cu_seqlens("cu_seqlens", cu_seqlens, x.shape[0], "x")
        device = _collective_device(group, x)
        fields = dict(zip(names, (len(mine), code(tuple(x.shape[1:])), code(x.dtype), code(x.device.type),
                                  SHARDINGS.index(sharding))))
    except Exception as e:  # noqa: BLE001 - told to the others first: none waits in, or dies of, an all-gather
        error = e
    if world_size > 1:
        agree_or_raise(group, world_size, error, fields, "gather_varlen", signature_device(group))
    elif error is not None:
        raise error
    cus = [torch.empty(len(mine), dtype=torch.int64, device=device) for _ in range(world_size)]
    dist.all_gather(cus, torch.tensor(mine, dtype=torch.int64, device=device), group=group)
    values = [cu.tolist() for cu in cus]
    longest = max(cu[-1] for cu in values)
    padded = x.new_zeros((longest,) + tuple(x.shape[1:]))
    padded.narrow(0, 0, x.shape[0]).copy_(x)
    received = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(received, padded, group=group)
    shards = [t.narrow(0, 0, cu[-1]) for t, cu in zip(received, values)]
    return unshard_varlen(shards, [torch.tensor(cu, dtype=torch.int32, device=cu_seqlens.device) for cu in values],
                          sharding=sharding)


def _collective_device(group, x: torch.Tensor) -> torch.device:
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend(group)).lower():
        return x.device if x.device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


__all__ = ["SeqChunk", "VarlenLayout", "piece_bounds", "read_cu_seqlens", "shard_varlen", "unshard_varlen",
           "shard_positions_varlen", "gather_varlen"]
