"""One sequence's keys (or values) in a page pool, read a tile at a time.

`PagedKV` stands where the dense forward holds a ``(1, Hkv, S, D)`` tensor: a tile of keys
``[j0, j1)`` gathers only the pages holding them (`torch.index_select` into a per-worker
buffer), then converts them to the accumulation dtype where that differs. The sequence is
never gathered whole, so a paged decode reads each cached byte once, like a contiguous one.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class PagedBuffer(NamedTuple):
    """One worker's scratch for `keys` keys of a paged sequence."""

    keys: int
    gathered: torch.Tensor             # whole pages, in the pool's dtype
    converted: Optional[torch.Tensor]  # the tile in the accumulation dtype (None: it is the pool's)
    aligned: Optional[tuple]           # views of a chunk of `keys` keys starting on a page (made once)


class PagedKV:
    """Keys ``[0, length)`` of one sequence: ``pool[pages[j // page_size], j % page_size]``.

    `pages` were checked against the pool (`attnx.index_checks.read_indices`) before this is built.
    """

    def __init__(self, pool: torch.Tensor, pages: torch.Tensor, length: int):
        self.pool = pool                  # (num_pages, page_size, Hkv, D)
        self.pages = pages.long()         # (ceil(length / page_size),)
        self.page_size = pool.shape[1]
        self.shape = (1, pool.shape[2], length, pool.shape[3])  # as the dense (1, Hkv, S, D)
        self.dtype, self.device = pool.dtype, pool.device

    def buffer(self, acc: torch.dtype, keys: int) -> PagedBuffer:
        keys = min(keys, self.shape[2])
        heads, width = self.shape[1], self.shape[3]
        pages = -(-keys // self.page_size) + 1  # a tile starting mid-page spans one page more
        gathered = torch.empty(pages * self.page_size * heads * width, dtype=self.dtype, device=self.device)
        converted = None
        if self.dtype != acc:
            converted = torch.empty(keys * heads * width, dtype=acc, device=self.device)
        aligned = None
        if keys % self.page_size == 0:  # the usual chunk: whole pages, views made here once
            pages_view = gathered[: keys * heads * width].view(keys // self.page_size, *self.pool.shape[1:])
            rows = converted.view(keys, heads, width) if converted is not None else pages_view.flatten(0, 1)
            aligned = (pages_view, rows, rows.transpose(0, 1))
        return PagedBuffer(keys, gathered, converted, aligned)

    def tile(self, j0: int, j1: int, buffer: PagedBuffer) -> torch.Tensor:
        """Keys ``[j0, j1)`` (at most ``buffer.keys``) as ``(Hkv, j1 - j0, D)``, token-major in memory."""
        first, last = j0 // self.page_size, -(-j1 // self.page_size)
        if buffer.aligned is not None and j1 - j0 == buffer.keys and j0 % self.page_size == 0:
            pages_view, rows, keys_first = buffer.aligned
            torch.index_select(self.pool, 0, self.pages[first:last], out=pages_view)
            if buffer.converted is not None:
                rows.copy_(pages_view.flatten(0, 1))
            return keys_first
        page_shape = self.pool.shape[1:]
        gathered = buffer.gathered[: (last - first) * self.pool[0].numel()].view(last - first, *page_shape)
        torch.index_select(self.pool, 0, self.pages[first:last], out=gathered)
        start = j0 - first * self.page_size
        rows = gathered.flatten(0, 1)[start:start + j1 - j0]  # (keys, Hkv, D)
        if buffer.converted is not None:
            rows = buffer.converted[: rows.numel()].view(rows.shape).copy_(rows)
        return rows.transpose(0, 1)
