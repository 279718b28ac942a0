"""Packed K/V blocks cut into pieces that travel the ring one after the other (``kv_pieces > 1``).

The packed counterpart of `kv_pieces`: piece j of a rank's block is the j-th of ``m`` slices
of **each** of its sequence pieces (``[j * L // m, (j + 1) * L // m)`` of a piece of ``L`` rows),
sequence after sequence as in the block, so a zigzag piece keeps every sequence's early and
late slice and stays balanced. Ranks hold a few rows more or less, so a piece travels padded
to the longest piece j of the group: one shape on every rank.
"""
from __future__ import annotations

import torch

from .kv_pieces import slices_with_rows
from .varlen_sharding import SeqChunk, VarlenLayout


class VarlenPieces:
    """Where piece j of every rank's block lies: its rows in the block, and its slots within the piece."""

    def __init__(self, layout: VarlenLayout, m: int):
        self._slots, self._runs = {}, {}  # (j, rank) -> piece slots, [(first row in the block, rows)]
        self.rows = {}  # piece j's padded rows (the longest over ranks), for the pieces that hold a row
        lengths = [c.length for rank in range(layout.world_size) for slot in layout.slots(rank) for c in slot]
        for j in slices_with_rows(m, lengths):
            longest = 0
            for rank in range(layout.world_size):
                slots = layout.slots(rank)
                piece_slots, runs, at = [[] for _ in slots], [], 0
                for b in range(layout.batch):
                    for s, slot in enumerate(slots):
                        kc = slot[b]
                        a, e = j * kc.length // m, (j + 1) * kc.length // m
                        piece_slots[s].append(SeqChunk(b, at, kc.position + a, e - a))
                        runs.append((kc.start + a, e - a))
                        at += e - a
                self._slots[(j, rank)], self._runs[(j, rank)] = piece_slots, runs
                longest = max(longest, at)
            self.rows[j] = longest

    def pieces(self) -> list[int]:
        """The pieces some rank holds rows of."""
        return [j for j, rows in self.rows.items() if rows]

    def slots(self, j: int, rank: int) -> list:
        """``slots[s][b]`` of piece j of rank `rank`'s block, ``start`` a row of the piece."""
        return self._slots[(j, rank)]

    def _index(self, j: int, rank: int, device) -> torch.Tensor:
        runs = [torch.arange(start, start + n, device=device) for start, n in self._runs[(j, rank)] if n]
        return torch.cat(runs) if runs else torch.zeros(0, dtype=torch.long, device=device)

    def take(self, j: int, rank: int, t: torch.Tensor) -> torch.Tensor:
        """Piece j of rank `rank`'s block `t` ``(T, H, W)`` as a new ``(rows[j], H, W)`` tensor, zero padded."""
        index = self._index(j, rank, t.device)
        piece = t.new_zeros((self.rows[j],) + tuple(t.shape[1:]))
        piece.narrow(0, 0, index.numel()).copy_(t.index_select(0, index))
        return piece

    def put(self, j: int, rank: int, block: torch.Tensor, piece: torch.Tensor) -> None:
        """Write `piece` (piece j of rank `rank`'s block) back into its rows of `block`."""
        index = self._index(j, rank, block.device)
        block.index_copy_(0, index, piece.narrow(0, 0, index.numel()))
