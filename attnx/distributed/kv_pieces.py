"""K/V blocks cut into pieces that travel the ring one after the other (``kv_pieces > 1``).

With whole blocks a rank holds, besides its own K/V, the block in hand and the next one
arriving (the price of overlapping each transfer with compute), and in the backward a block's
dK/dV accumulators. Cut into ``m`` pieces, piece j goes all the way round the ring before piece
j + 1 leaves: a rank holds two pieces of other ranks' K/V and one piece of accumulators
instead, and each piece's transfer still overlaps the compute on the piece in hand. The cost:
``m`` times as many messages and local calls, each ``1/m`` the size.

Piece j is the j-th of ``m`` slices of **every** chunk of the block (rows
``[c.start + j * L // m, c.start + (j + 1) * L // m)`` of a chunk of ``L`` rows), laid end to
end: a zigzag piece keeps one early and one late slice, so each rank's work per piece is as
balanced as per block. Chunks lie at the same rows on every rank, so a piece has one shape on
every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sharding import Chunk
from .spec import RingSpec


@dataclass(frozen=True)
class Piece:
    """Piece `index` of a block: ``runs`` (first row in the block, rows), one per chunk, end to end."""

    index: int
    runs: tuple
    offsets: tuple  # each run's first row within its chunk

    @property
    def rows(self) -> int:
        return sum(n for _, n in self.runs)

    def chunks(self, spec: RingSpec, src: int) -> tuple:
        """The piece of rank `src`'s block as chunks of the piece tensor, at the global positions of `src`'s rows."""
        found, at = [], 0
        for c, (_, n), a in zip(spec.chunks(src), self.runs, self.offsets):
            if n:
                found.append(Chunk(at, c.position + a, n))
            at += n
        return tuple(found)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The piece's rows of a ``(B, H, S, W)`` block, as a contiguous ``(B, H, rows, W)`` tensor."""
        parts = [t.narrow(2, start, n) for start, n in self.runs if n]
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=2)

    def put(self, block: torch.Tensor, piece: torch.Tensor) -> None:
        """Write `piece` back into its rows of `block` (``(B, H, S, W)``)."""
        at = 0
        for start, n in self.runs:
            block.narrow(2, start, n).copy_(piece.narrow(2, at, n))
            at += n


def slices_with_rows(m: int, lengths) -> list[int]:
    """The slices j of ``m`` (``[j * L // m, (j + 1) * L // m)`` of a run of ``L`` rows) that hold a row
    of some run of `lengths`, in order, found without looking at every j (``m`` may be huge):
    row i of a run of ``L`` rows lies in slice ``ceil((i + 1) * m / L) - 1``."""
    found = set()
    for length in set(lengths):
        if length >= m:
            return list(range(m))
        found.update(-(-(i + 1) * m // length) - 1 for i in range(length))
    return sorted(found)


def kv_pieces(spec: RingSpec) -> list[Piece]:
    """The non-empty pieces of the ring's blocks (``spec.kv_pieces`` slices of each chunk)."""
    m, found = spec.kv_pieces, []
    for j in slices_with_rows(m, [c.length for c in spec.chunks(spec.rank)]):
        runs, offsets = [], []
        for c in spec.chunks(spec.rank):
            a, e = j * c.length // m, (j + 1) * c.length // m
            runs.append((c.start + a, e - a))
            offsets.append(a)
        piece = Piece(j, tuple(runs), tuple(offsets))
        if piece.rows:
            found.append(piece)
    return found
