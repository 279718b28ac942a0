"""Pages of a shared pool handed to a `KVCache`'s sequences as they grow, and taken back on reset.

The bookkeeping (free list, each sequence's pages) lives on the host; the device page table
gets only the new entries, copied without waiting for the device (pinned memory on a GPU).
"""
from __future__ import annotations

import torch


def pages_for(length: int, page_size: int) -> int:
    return -(-length // page_size)


class PageAllocator:
    """Free pages of a pool of ``num_pages`` and the pages each of ``batch`` sequences holds, in order."""

    def __init__(self, num_pages: int, batch: int, page_size: int):
        self.page_size = page_size
        self.free = list(range(num_pages - 1, -1, -1))  # pop() hands out the lowest page first
        self.owned: list[list[int]] = [[] for _ in range(batch)]

    def shortfall(self, lengths: list[int]) -> int:
        """Pages missing for every sequence to hold ``lengths`` tokens, beyond the free ones (0: they fit).

        Pages that sequences shrinking to ``lengths`` give back count as free (`set_lengths` shrinks
        before it grows)."""
        need = released = 0
        for n, own in zip(lengths, self.owned):
            change = pages_for(n, self.page_size) - len(own)
            if change > 0:
                need += change
            else:
                released -= change
        return max(0, need - len(self.free) - released)

    def grow(self, table: torch.Tensor, lengths: list[int]) -> None:
        """Give each sequence the pages ``lengths`` needs and write them into ``table`` (check `shortfall` first)."""
        index, pages = [], []
        for b, n in enumerate(lengths):
            own = self.owned[b]
            while len(own) < pages_for(n, self.page_size):
                page = self.free.pop()
                index.append(b * table.shape[1] + len(own))
                pages.append(page)
                own.append(page)
        if index:
            _write_entries(table, index, pages)

    def shrink(self, b: int, length: int) -> None:
        """Return sequence ``b``'s pages past ``length`` tokens to the pool (table entries left as they are)."""
        own = self.owned[b]
        keep = pages_for(length, self.page_size)
        self.free.extend(reversed(own[keep:]))
        del own[keep:]


def _write_entries(table: torch.Tensor, index: list[int], pages: list[int]) -> None:
    flat_index = torch.tensor(index, dtype=torch.int64)
    values = torch.tensor(pages, dtype=torch.int32)
    if table.device.type == "cuda":  # pinned + non_blocking: the host does not wait for queued kernels
        flat_index = flat_index.pin_memory().to(table.device, non_blocking=True)
        values = values.pin_memory().to(table.device, non_blocking=True)
    else:
        flat_index, values = flat_index.to(table.device), values.to(table.device)
    table.view(-1).index_copy_(0, flat_index, values)
