"""``flash_attn_with_kvcache``: decoding over a dense or paged KV cache, new keys appended in place first."""
from __future__ import annotations

import operator
from typing import Optional, Union

import torch

from ..api import attention
from ..errors import InvalidArgumentError, InvalidTypeError
from ..index_checks import check_append, check_pages
from ..memory_overlap import shares_memory
from ..problem import make_problem
from .errors import CompatArgumentError
from .flash_attn_args import options


def _cache_lengths(cache_seqlens, batch: int, device) -> Optional[torch.Tensor]:
    """int32 ``(batch,)`` lengths from flash-attn's int-or-tensor ``cache_seqlens`` (None stays None)."""
    if cache_seqlens is None:
        return None
    if isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype not in (torch.int32, torch.int64) or cache_seqlens.shape != (batch,):
            raise InvalidArgumentError(f"`cache_seqlens` must be an int or an int32 tensor of shape ({batch},), got "
                                       f"{cache_seqlens.dtype} {tuple(cache_seqlens.shape)}")
        _check_has_values("cache_seqlens", cache_seqlens)
        return cache_seqlens.to(device=device, dtype=torch.int32)
    if isinstance(cache_seqlens, bool):
        raise InvalidTypeError(f"`cache_seqlens` must be an int or a tensor, got {cache_seqlens!r}")
    try:
        length = operator.index(cache_seqlens)
    except TypeError:
        raise InvalidTypeError(f"`cache_seqlens` must be an int or a tensor, got {cache_seqlens!r}") from None
    return torch.full((batch,), length, dtype=torch.int32, device=device)


def _check_has_values(name: str, t: torch.Tensor) -> None:
    """An index tensor read on the host must hold values: a meta tensor has none."""
    if t.is_meta:
        raise InvalidArgumentError(f"flash_attn_with_kvcache: `{name}` is a meta tensor: its values are read on "
                                   f"the host, pass it on a real device")


def _slots(lengths: torch.Tensor, new: int, capacity: int) -> torch.Tensor:
    """Cache positions ``(batch, new)`` the new keys go to; every one must lie inside the cache."""
    if new:  # one host read; the error names the sequence that does not fit
        check_append("cache_seqlens", lengths.tolist(), [new] * lengths.shape[0], capacity)
    return lengths.long()[:, None] + torch.arange(new, device=lengths.device)


def _check_caches(k_cache, v_cache) -> None:
    """``k_cache``/``v_cache``: 4-D tensors, ``(batch_cache, seqlen_cache, nheads_k, d)`` or page pools."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(cache, torch.Tensor):
            raise InvalidTypeError(f"flash_attn_with_kvcache: `{name}` must be a torch.Tensor, got "
                                   f"{type(cache).__name__}")
        if cache.dim() != 4:
            raise InvalidArgumentError(f"flash_attn_with_kvcache: `{name}` must be (batch_cache, seqlen_cache, "
                                       f"nheads_k, d) or (num_blocks, block_size, nheads_k, d), got shape "
                                       f"{tuple(cache.shape)}")


def _check_inputs(q, k_cache, v_cache, k, v, cache_batch_idx) -> None:
    """`q`, new `k`/`v` and `cache_batch_idx` checked before anything reads or writes them."""
    if not isinstance(q, torch.Tensor):
        raise InvalidTypeError(f"flash_attn_with_kvcache: `q` must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 4:
        raise InvalidArgumentError(f"flash_attn_with_kvcache: `q` must be (batch, seqlen_q, nheads, d), got "
                                   f"shape {tuple(q.shape)}")
    if k is not None:  # the caches are indexed to write the new keys: check them first
        _check_caches(k_cache, v_cache)
    elif not all(isinstance(c, torch.Tensor) and c.dim() == 4 for c in (k_cache, v_cache)):
        return  # attention names `k`/`v` (the caches) with its own checks
    for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError(f"flash_attn_with_kvcache: `{name}` must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != cache.dtype:  # flash-attn refuses it too; a silent cast would round float64 keys
            raise InvalidArgumentError(f"flash_attn_with_kvcache: `{name}` must have the cache's dtype "
                                       f"{cache.dtype}, got {t.dtype}")
        if (t.dim() != 4 or t.shape[0] != q.shape[0] or t.shape[2] != cache.shape[2] or t.shape[1] != k.shape[1]
                or t.shape[3] != cache.shape[3]):
            raise InvalidArgumentError(
                f"flash_attn_with_kvcache: `{name}` must be (batch, seqlen_new, nheads_k, d) with q's batch "
                f"{q.shape[0]}, the new keys' length and the cache's {cache.shape[2]} heads of dim {cache.shape[3]}, "
                f"got {tuple(t.shape)}")
    if k is not None and shares_memory(k_cache, v_cache):
        raise InvalidArgumentError("flash_attn_with_kvcache: `k_cache` and `v_cache` share memory (one tensor, or "
                                   "overlapping views of one buffer): the new values would overwrite the new keys")
    if cache_batch_idx is not None:
        if not isinstance(cache_batch_idx, torch.Tensor) or cache_batch_idx.dtype not in (torch.int32, torch.int64):
            raise InvalidTypeError("flash_attn_with_kvcache: `cache_batch_idx` must be an int32 tensor, got "
                                   f"{getattr(cache_batch_idx, 'dtype', type(cache_batch_idx).__name__)}")
        if tuple(cache_batch_idx.shape) != (q.shape[0],):
            raise InvalidArgumentError(f"flash_attn_with_kvcache: `cache_batch_idx` must have shape ({q.shape[0]},), "
                                       f"got {tuple(cache_batch_idx.shape)}")
        _check_has_values("cache_batch_idx", cache_batch_idx)
        rows = cache_batch_idx.tolist()  # one host read, as `cache_seqlens` already takes
        if any(r < 0 or r >= k_cache.shape[0] for r in rows):
            raise InvalidArgumentError(f"flash_attn_with_kvcache: `cache_batch_idx` must name cache rows in "
                                       f"[0, {k_cache.shape[0]}), got {rows}")


def _rows_view(cache: torch.Tensor, batch: int) -> torch.Tensor:
    """A view shaped like ``cache[cache_batch_idx]`` (``batch`` rows), for validating without copying."""
    return cache[:1].expand(batch, *cache.shape[1:])


def _check_num_splits(num_splits) -> None:
    """``num_splits``: an int >= 0 (NumPy ints too), accepted and ignored."""
    try:
        valid = not isinstance(num_splits, bool) and operator.index(num_splits) >= 0
    except TypeError:
        valid = False
    if not valid:
        raise InvalidTypeError(f"flash_attn_with_kvcache: `num_splits` must be an int >= 0, got {num_splits!r}")


def _check_block_table(block_table, batch: int) -> None:
    """A paged cache's ``block_table``: int32 ``(batch, max_blocks)`` (checked before anything is written)."""
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32:
        raise InvalidTypeError(f"flash_attn_with_kvcache: `block_table` (attnx's `page_table`) must be an int32 "
                               f"tensor, got {getattr(block_table, 'dtype', type(block_table).__name__)}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise InvalidArgumentError(f"flash_attn_with_kvcache: `block_table` must be (batch, max_blocks) with "
                                   f"batch {batch}, got {tuple(block_table.shape)}")


def _write_index(k_cache, k, lengths, block_table, cache_batch_idx) -> tuple:
    """The cache index ``(batch, new)`` the new keys go to, ``lengths[b] + i``; every slot checked inside the cache."""
    batch, new = k.shape[:2]
    if block_table is None:
        rows = (torch.arange(batch, device=k.device) if cache_batch_idx is None else cache_batch_idx.long())
        slots = _slots(lengths, new, k_cache.shape[1])
        return rows[:, None].expand(batch, new), slots
    page_size = k_cache.shape[1]
    slots = _slots(lengths, new, block_table.shape[1] * page_size)
    # the pages each sequence will read, new ones included, inside the pool (a -1 would write elsewhere)
    check_pages("block_table", block_table, (lengths.long() + new + page_size - 1) // page_size, k_cache.shape[0])
    pages = torch.gather(block_table.long(), 1, slots // page_size)
    return pages, slots % page_size


def _append(k_cache, v_cache, k, v, index: tuple) -> None:
    """Write ``k``/``v`` ``(batch, new, Hkv, d)`` into the caches at ``index`` (`_write_index`), in place."""
    with torch.no_grad():
        k_cache[index] = k.to(k_cache.dtype)
        v_cache[index] = v.to(v_cache.dtype)


def _with_new_keys(k_cache, v_cache, k, v, index: tuple) -> tuple:
    """The caches as attention reads them: after `_append`, and differentiable in the new ``k``/``v``.

    The in-place write is not recorded by autograd; when the new keys need gradients, attention reads an
    out-of-place copy holding the same values (``index_put``), so gradients reach ``k``/``v`` (a copy of the
    cache per call, only then).
    """
    if not torch.is_grad_enabled() or not (k.requires_grad or v.requires_grad):
        return k_cache, v_cache
    return k_cache.index_put(index, k.to(k_cache.dtype)), v_cache.index_put(index, v.to(v_cache.dtype))


def _whole_pages(block_table: torch.Tensor, k_cache, batch: int, device) -> Optional[torch.Tensor]:
    """Lengths for a paged cache given no ``cache_seqlens``: every page of the table (None if ``k_cache`` is bad)."""
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        return None  # attention names the bad cache
    return torch.full((batch,), block_table.shape[1] * k_cache.shape[1], dtype=torch.int32, device=device)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
                            cache_batch_idx: Optional[torch.Tensor] = None,
                            cache_leftpad: Optional[torch.Tensor] = None,
                            block_table: Optional[torch.Tensor] = None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None,
                            num_splits=0, return_softmax_lse=False):
    """``flash_attn.flash_attn_with_kvcache``: attention of new queries over a KV cache.

    Args (as flash-attn's):
        q: ``(batch, seqlen_q, nheads, d)``.
        k_cache, v_cache: ``(batch_cache, seqlen_cache, nheads_k, d)``, or page pools
            ``(num_blocks, block_size, nheads_k, d)`` with ``block_table`` int32 ``(batch, max_blocks)``.
        k, v: optional ``(batch, seqlen_new, nheads_k, d)``: written into the caches *in place* at
            positions ``cache_seqlens[b] + i`` before attending (the caches must have room).
        cache_seqlens: int or int32 ``(batch,)``: keys already in the cache (None: the whole cache).
            Sequence ``b`` attends to its first ``cache_seqlens[b] + seqlen_new`` keys.
        cache_batch_idx: int32 ``(batch,)``: which cache row each sequence uses (dense caches).
        causal, window_size, softcap, alibi_slopes, softmax_scale: as `flash_attn_func`, aligned
            bottom-right per sequence.
        num_splits: accepted and ignored (attnx's dispatcher picks the kernel).
        return_softmax_lse: also return lse, float32 ``(batch, nheads, seqlen_q)``.

    Gradients (flash-attn has no backward here) reach ``q``, the caches as read and the new ``k``/``v``,
    as if ``k``/``v`` had been concatenated to the cache.

    Not supported (a clear error): rotary embedding (``rotary_cos``/``rotary_sin``: apply it to
    q and k first) and ``cache_leftpad``.

    Equivalent PyTorch (dense cache, every sequence of length ``n = cache_seqlens + seqlen_new``)::

        k_cache[:, cache_seqlens:n] = k; v_cache[:, cache_seqlens:n] = v
        out = flash_attn_func(q, k_cache[:, :n], v_cache[:, :n], causal=causal)
    """
    if rotary_cos is not None or rotary_sin is not None:
        raise CompatArgumentError("flash_attn_with_kvcache: rotary embedding (rotary_cos/rotary_sin) is not "
                                  "supported by attnx; apply it to q and k before the call")
    if cache_leftpad is not None:
        raise CompatArgumentError("flash_attn_with_kvcache: cache_leftpad is not supported by attnx")
    if (k is None) != (v is None):
        raise InvalidArgumentError("flash_attn_with_kvcache: give both `k` and `v`, or neither")
    _check_num_splits(num_splits)
    if block_table is not None and cache_batch_idx is not None:
        raise CompatArgumentError("flash_attn_with_kvcache: cache_batch_idx is not supported with a paged cache")
    opts = options("flash_attn_with_kvcache", dropout_p=0.0, softmax_scale=softmax_scale, causal=causal,
                   window_size=window_size, softcap_value=softcap, alibi_slopes=alibi_slopes)
    opts["layout"] = "bshd"
    _check_inputs(q, k_cache, v_cache, k, v, cache_batch_idx)
    batch = q.shape[0]
    if block_table is not None:
        _check_block_table(block_table, batch)
    lengths = _cache_lengths(cache_seqlens, batch, q.device)
    if k is not None and lengths is None:
        raise InvalidArgumentError("flash_attn_with_kvcache: `cache_seqlens` says where the new `k`/`v` go")
    seen = lengths if k is None else lengths + k.shape[1]  # the keys each sequence attends to
    if block_table is not None:
        opts.update(seqlens_k=_whole_pages(block_table, k_cache, batch, q.device) if seen is None else seen,
                    page_table=block_table)
    elif seen is not None:
        opts["seqlens_k"] = seen
    if k is not None:
        index = _write_index(k_cache, k, lengths, block_table, cache_batch_idx)
        # every check attention makes, before the caches are written: a call that raises leaves them as they were
        by_rows = cache_batch_idx is not None and block_table is None
        make_problem(q, *((_rows_view(k_cache, batch), _rows_view(v_cache, batch)) if by_rows
                          else (k_cache, v_cache)), **opts)
        _append(k_cache, v_cache, k, v, index)
        k_cache, v_cache = _with_new_keys(k_cache, v_cache, k, v, index)
    if cache_batch_idx is not None and block_table is None:
        k_cache, v_cache = k_cache[cache_batch_idx.long()], v_cache[cache_batch_idx.long()]
    out, lse = attention(q, k_cache, v_cache, **opts, return_lse=True)
    return (out, lse) if return_softmax_lse else out
