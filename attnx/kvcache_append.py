"""Checking and writing new keys/values into a `KVCache`'s storage (no host sync for dense new tokens).

`new_tokens` checks the new ``k``/``v`` against the cache (type, dtype, device, shape, room
left) and returns how many tokens each sequence gains, before anything is written.
`write_tokens` scatters them to each sequence's current length with index tensors built on
the device from the device lengths, so the append path does not wait for the GPU.
"""
from __future__ import annotations

from typing import Optional

import torch

from .errors import InvalidArgumentError, InvalidTypeError
from .index_checks import check_offsets, check_pages, validating
from .problem import check_strided

LAYOUTS = ("bhsd", "bshd")


class CacheCapacityError(InvalidArgumentError):
    """New tokens would pass a `KVCache`'s capacity (raised before anything is written)."""


def check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise InvalidArgumentError(f"`layout` must be 'bhsd' or 'bshd', got {layout!r}")


def packed_counts(cu_seqlens, batch: int, total: int, tensor: str = "q") -> list[int]:
    """New tokens per sequence from int32 ``cu_seqlens`` ``(batch + 1,)`` (one host read: a sync on a GPU).

    ``tensor`` names the packed tensor of ``total`` rows, for the message of a bad entry.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise InvalidTypeError(f"`cu_seqlens` must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    check_strided("cu_seqlens", cu_seqlens)
    if cu_seqlens.dtype != torch.int32:
        raise InvalidTypeError(f"`cu_seqlens` must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.is_meta:
        raise InvalidArgumentError("`cu_seqlens` must hold values (it is read on the host), got a meta tensor")
    if tuple(cu_seqlens.shape) != (batch + 1,):
        raise InvalidArgumentError(f"`cu_seqlens` must have shape ({batch + 1},) (batch + 1), "
                                   f"got {tuple(cu_seqlens.shape)}")
    values = cu_seqlens.tolist()
    check_offsets("cu_seqlens", values, total, tensor)
    return [b - a for a, b in zip(values, values[1:])]


def _check_tensor(name: str, t, cache) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    check_strided(name, t)
    if t.dtype != cache.dtype:
        raise InvalidTypeError(f"`{name}` must have the cache's dtype {cache.dtype}, got {t.dtype}")
    if t.device != cache.device:
        raise InvalidArgumentError(f"`{name}` must be on the cache's device {cache.device}, got {t.device}")


def _expected_shape(cache, layout: str, packed: bool, tokens: int, dim: int) -> tuple:
    if packed:
        return (tokens, cache.heads_kv, dim)
    if layout == "bhsd":
        return (cache.batch, cache.heads_kv, tokens, dim)
    return (cache.batch, tokens, cache.heads_kv, dim)


def _describe(layout: str, packed: bool) -> str:
    if packed:
        return "(total_new, Hkv, D)"
    return "(B, Hkv, new, D)" if layout == "bhsd" else "(B, new, Hkv, D)"


def new_tokens(cache, k, v, layout: str, cu_seqlens: Optional[torch.Tensor]) -> list[int]:
    """Tokens each sequence gains from ``k``/``v``; every check runs before any write."""
    check_layout(layout)
    _check_tensor("k", k, cache)
    _check_tensor("v", v, cache)
    packed = cu_seqlens is not None
    if k.dim() != (3 if packed else 4):
        raise InvalidArgumentError(f"`k` must be {_describe(layout, packed)}, got shape {tuple(k.shape)}")
    tokens = k.shape[0] if packed else k.shape[2 if layout == "bhsd" else 1]
    for name, t, dim in (("k", k, cache.head_dim), ("v", v, cache.head_dim_v)):
        want = _expected_shape(cache, layout, packed, tokens, dim)
        if tuple(t.shape) != want:
            raise InvalidArgumentError(f"`{name}` must have shape {want} {_describe(layout, packed)} for this "
                                       f"cache, got {tuple(t.shape)}")
    counts = packed_counts(cu_seqlens, cache.batch, tokens, "k") if packed else [tokens] * cache.batch
    used = cache.seqlens
    full = [b for b in range(cache.batch) if used[b] + counts[b] > cache.capacity]
    if full:
        b = full[0]
        raise CacheCapacityError(
            f"`k`/`v` would pass the cache's capacity of {cache.capacity} tokens per sequence: sequence {b} "
            f"holds {used[b]} and gains {counts[b]} ({len(full)} sequence(s) would overflow)")
    return counts


def _token_major(t: torch.Tensor, layout: str, packed: bool) -> torch.Tensor:
    """New tokens as ``(B, new, Hkv, D)`` (dense) or ``(total_new, Hkv, D)`` (packed) views."""
    return t if packed or layout == "bshd" else t.transpose(1, 2)


def _slots(cache, counts: list[int], packed: bool, cu_seqlens, device):
    """(sequence, position) index tensors of the new tokens, built on the device.

    Positions start at `cache.lengths` on the device, so a decode loop makes no host copy and can be
    captured in a CUDA graph; callers clamp them into the cache, so an edited length tensor cannot
    move a write outside it.
    """
    lengths = cache.lengths.long()
    if not packed:
        new = counts[0] if counts else 0
        seq = torch.arange(cache.batch, device=device)[:, None].expand(cache.batch, new)
        pos = lengths[:, None] + torch.arange(new, device=device)
        return seq, pos.clamp(0, cache.capacity - 1)
    total = sum(counts)
    cu = cu_seqlens.to(device=device).long()
    seq = torch.repeat_interleave(torch.arange(cache.batch, device=device), cu[1:] - cu[:-1], output_size=total)
    pos = lengths[seq] + torch.arange(total, device=device) - cu[seq]
    return seq, pos.clamp(0, cache.capacity - 1)


def _unaliased(t: torch.Tensor, cache) -> torch.Tensor:
    """``t``, copied first when it lies in the cache's own storage (new tokens sliced from the cache): the
    write would otherwise read positions it has already overwritten. A metadata check, no host sync."""
    if t.device.type == "meta" or not t.numel():
        return t
    storages = {cache.k.untyped_storage().data_ptr(), cache.v.untyped_storage().data_ptr()}
    return t.clone() if t.untyped_storage().data_ptr() in storages else t


def write_tokens(cache, k, v, layout: str, cu_seqlens, counts: list[int]) -> None:
    """Write checked new tokens at each sequence's current length (the lengths are not changed here)."""
    packed = cu_seqlens is not None
    if cache.batch == 0 or not sum(counts):
        return
    k_t, v_t = _token_major(_unaliased(k, cache), layout, packed), _token_major(_unaliased(v, cache), layout, packed)
    with torch.no_grad():
        used = cache.seqlens
        if not cache.paged and not packed and len(set(used)) == 1:
            start, stop = used[0], used[0] + counts[0]  # one length for all: one slice copy, no index tensors
            cache.k[:, start:stop].copy_(k_t)
            cache.v[:, start:stop].copy_(v_t)
            return
        seq, pos = _slots(cache, counts, packed, cu_seqlens, cache.device)
        if cache.paged:
            if validating():  # debugging mode: name a table entry outside the pool before writing
                ends = [n + c for n, c in zip(used, counts)]
                pages_used = torch.tensor([-(-n // cache.page_size) for n in ends])
                check_pages("page_table", cache.page_table.cpu(), pages_used, cache.k.shape[0])
            page = cache.page_table.long()[seq, torch.div(pos, cache.page_size, rounding_mode="floor")]
            # clamped: whatever an edited `page_table` holds, the write stays inside the pool
            index = (page.clamp(0, cache.k.shape[0] - 1), pos % cache.page_size)
        else:
            index = (seq, pos)
        cache.k.index_put_(index, k_t)
        cache.v.index_put_(index, v_t)
