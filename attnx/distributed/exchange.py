"""Moving K/V blocks between ranks: ring shifts by batched isend/irecv, all-gather, reduce-scatter.

A ring shift sends tensors to the next rank and receives same-shaped ones from the previous
rank in one `torch.distributed.batch_isend_irecv`. It returns at once with a `Pending`; the
caller computes on the block it holds and calls `Pending.wait` only when it needs the next
one, so the transfer overlaps the local block's compute (gloo runs transfers on its own
threads; on CUDA they are issued on a separate stream, which the compute stream waits for
in `wait`). `Ring.shift_in_place` trades that overlap for memory: tensors are replaced piece by
piece by the previous rank's, with one piece in flight.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .group import global_rank

_STREAMS: dict = {}
# `Ring.shift_in_place`: pieces per tensor, and the smallest piece (a round trip each)
SWAP_PIECES = 8
SWAP_MIN_PIECE_BYTES = 1 << 18


def comm_stream(device: torch.device) -> Optional["torch.cuda.Stream"]:
    """The CUDA stream ring transfers are issued on (one per device), None off CUDA."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(device=index)
    return _STREAMS[index]


def travel(ring: Optional["Ring"], blocks: list, tag: int, rank: int, world_size: int):
    """The forward's walk round the ring: yields, for step t = 0 .. P-1, the rank ``(rank - t) % P``
    whose block `blocks` (a list of tensors) holds then. The shift of the block in hand to the next
    rank starts before each yield and is waited for after it, so the transfer overlaps what the
    caller computes; `blocks` is refilled in place with the arriving tensors (the ones sent are
    released there). `ring` may be None for one rank."""
    for step in range(world_size):
        pending = ring.shift(blocks, tag) if step < world_size - 1 else None
        yield (rank - step) % world_size
        if pending is not None:
            blocks[:] = pending.wait()


class Pending:
    """Transfers in flight; `wait` returns the received tensors once they have arrived."""

    def __init__(self, works, sent, received, stream):
        self._works, self._sent, self.received, self._stream = works, sent, received, stream

    def wait(self) -> list[torch.Tensor]:
        for work in self._works:
            work.wait()
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        self._works, self._sent = [], []  # the send buffers may be reused from here on
        return self.received


class Ring:
    """Point-to-point shifts around the ranks of `group`: rank r sends to r + 1, receives from r - 1."""

    def __init__(self, group, rank: int, world_size: int, device: torch.device):
        self.group = group
        self.next = global_rank(group, (rank + 1) % world_size)
        self.prev = global_rank(group, (rank - 1) % world_size)
        self.stream = comm_stream(device)

    def shift(self, tensors: Sequence[torch.Tensor], tag: int, out: Optional[Sequence[torch.Tensor]] = None) -> Pending:
        """Send `tensors` (contiguous) to the next rank, receive their likes from the previous one.

        Tensor ``i`` travels with tag ``tag + i`` (gloo matches messages by tag; NCCL by order,
        which is the same on every rank). `out` are receive buffers to reuse, if given.
        """
        received = [torch.empty_like(t) for t in tensors] if out is None else list(out)
        ops = []
        for i, (send, recv) in enumerate(zip(tensors, received)):
            ops.append(dist.P2POp(dist.isend, send, self.next, self.group, tag + i))
            ops.append(dist.P2POp(dist.irecv, recv, self.prev, self.group, tag + i))
        if self.stream is None:
            works = dist.batch_isend_irecv(ops)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))  # the sends are written
            with torch.cuda.stream(self.stream):
                works = dist.batch_isend_irecv(ops)
            for t in list(tensors) + received:
                t.record_stream(self.stream)
        return Pending(works, list(tensors), received, self.stream)


    def shift_in_place(self, tensors: Sequence[torch.Tensor], tag: int) -> None:
        """`shift` that overwrites each of `tensors` (contiguous) with what the previous rank sends.

        The tensors travel in about `SWAP_PIECES` pieces each (of at least `SWAP_MIN_PIECE_BYTES`),
        one after the other, through one scratch
        piece: the memory in flight is one piece, not a second copy of every tensor (the cost:
        the pieces' round trips in sequence, not overlapped with compute).
        """
        for i, t in enumerate(tensors):
            flat = t.view(-1)
            step = max(-(-flat.numel() // SWAP_PIECES), SWAP_MIN_PIECE_BYTES // t.element_size(), 1)
            scratch = torch.empty(min(step, flat.numel()), dtype=t.dtype, device=t.device)
            for a in range(0, flat.numel(), step):
                n = min(step, flat.numel() - a)
                piece, landing = flat.narrow(0, a, n), scratch.narrow(0, 0, n)
                self.shift([piece], tag + i, out=[landing]).wait()
                piece.copy_(landing)


def all_gather_start(t: torch.Tensor, group, world_size: int) -> Pending:
    """Every rank's `t` (contiguous), gathered asynchronously: ``wait()`` returns them in rank order."""
    gathered = [torch.empty_like(t) for _ in range(world_size)]
    work = dist.all_gather(gathered, t, group=group, async_op=True)
    return Pending([work], [t], gathered, None)


def reduce_scatter(blocks: Sequence[torch.Tensor], group) -> torch.Tensor:
    """``sum over ranks of blocks[r]`` on rank r: each rank's block summed from every rank."""
    out = torch.empty_like(blocks[0])
    dist.reduce_scatter(out, [b.contiguous() for b in blocks], group=group)
    return out
