"""`scaled_dot_product_attention`: ``torch.nn.functional.scaled_dot_product_attention``, computed by attnx.

Same signature, shapes, broadcasting and errors as torch's function (torch 2.5+), so it
drops into code written for it; `use_attnx_for_sdpa` routes the calls of unmodified code.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.nn.attention.bias import CausalBias, CausalVariant

from ..api import attention
from ..errors import InvalidArgumentError, InvalidTypeError
from .common import check_no_dropout, real_as_float
from .errors import CompatArgumentError, CompatTypeError


def _split(t: torch.Tensor, name: str) -> tuple[tuple, int]:
    """``(batch dims, heads)`` of a ``(..., H, L, E)`` tensor; 2-D tensors have one head and no batch."""
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"scaled_dot_product_attention: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() < 2:
        raise CompatArgumentError(f"scaled_dot_product_attention: `{name}` must have at least 2 dims (L, E), "
                                  f"got shape {tuple(t.shape)}")
    if t.dim() == 2:
        return (), 1
    return tuple(t.shape[:-3]), t.shape[-3]


def _check_mask(attn_mask, query: torch.Tensor, rank: int) -> Optional[torch.Tensor]:
    """``attn_mask`` checked, with at least 2 dims (a 1-D ``(S,)`` or 0-D mask broadcasts as in torch's docs).

    As in torch, the mask broadcasts to the scores, of the inputs' ``rank``: it may not add dims.
    """
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor):
        raise InvalidTypeError(f"scaled_dot_product_attention: `attn_mask` must be a torch.Tensor or None, "
                               f"got {type(attn_mask).__name__}")
    if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        raise CompatArgumentError(
            "Expected attn_mask dtype to be bool or float or to match query dtype, but got attn_mask.dtype: "
            f"{attn_mask.dtype} and query.dtype: {query.dtype} instead.")
    if attn_mask.dim() > max(rank, 2):
        raise CompatArgumentError(f"scaled_dot_product_attention: `attn_mask` of shape {tuple(attn_mask.shape)} "
                                  f"has more dims than the attention scores ({rank})")
    if attn_mask.dim() < 2:
        return attn_mask.reshape(1, -1) if attn_mask.dim() == 1 else attn_mask.reshape(1, 1)
    return attn_mask


def _causal_bias(attn_mask, is_causal: bool, seqlen_q: int, seqlen_k: int) -> tuple:
    """``(attn_mask, is_causal, offset)`` with torch's ``CausalBias`` masks turned into attnx's causal rule.

    ``causal_upper_left(L, S)`` is ``is_causal=True`` (``offset=0``); ``causal_lower_right(L, S)``
    aligns the triangle bottom-right (``offset=None``, attnx's default). torch computes these through
    ``CausalBias.__torch_function__``; read as a plain float mask, their data is not the mask.
    """
    if not isinstance(attn_mask, CausalBias):
        return attn_mask, is_causal, 0 if is_causal else None
    if is_causal:
        raise CompatArgumentError("scaled_dot_product_attention: `attn_mask` is a CausalBias, which should not be "
                                  "used with is_causal=True")
    if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (seqlen_q, seqlen_k):
        raise CompatArgumentError(f"scaled_dot_product_attention: `attn_mask` is a CausalBias for ({attn_mask.seq_len_q}, "
                                  f"{attn_mask.seq_len_kv}) scores, got L = {seqlen_q} queries and S = {seqlen_k} keys")
    return None, True, None if attn_mask.variant == CausalVariant.LOWER_RIGHT else 0


def _heads(hq: int, hk: int, hv: int, enable_gqa: bool) -> tuple[int, int]:
    """``(H, Hkv)``: output heads and the kv heads attnx reads (kv head ``h // (H / Hkv)``).

    As torch: with ``enable_gqa`` key and value heads each divide the query heads (query head ``h``
    reads key head ``h // (hq / hk)`` and value head ``h // (hq / hv)``); without it the three head
    counts broadcast. Key and value are brought to one count, ``Hkv``, by `_kv_4d`.
    """
    if enable_gqa:
        if hk == 0 or hv == 0 or hq % hk or hq % hv:
            raise CompatArgumentError(
                f"Number of heads in key and value must divide the number of heads in query (enable_gqa=True): "
                f"query {hq}, key {hk}, value {hv} heads")
        return hq, math.lcm(hk, hv)
    try:
        heads = torch.broadcast_shapes((hq,), (hk,), (hv,))[0]
    except RuntimeError:
        raise CompatArgumentError(
            f"query, key and value heads must be equal or 1 (broadcast) without enable_gqa=True: "
            f"got {hq}, {hk}, {hv}") from None
    return heads, hk if hk == hv else heads


def _as_4d(t: torch.Tensor, batch: tuple, heads: int) -> torch.Tensor:
    """``t`` broadcast to ``(*batch, heads, L, E)``, flattened to ``(prod(batch), heads, L, E)`` (a view if 4-D)."""
    t = t.expand(*batch, heads, *t.shape[-2:])
    return t.reshape(math.prod(batch), heads, *t.shape[-2:])


def _kv_4d(t: torch.Tensor, heads_t: int, batch: tuple, heads_kv: int) -> torch.Tensor:
    """Key or value with ``heads_t`` heads as ``(prod(batch), heads_kv, S, E)``: broadcast, or each head repeated
    ``heads_kv / heads_t`` times (GQA with different key and value head counts: a copy)."""
    if heads_t not in (1, heads_kv):
        t = t.repeat_interleave(heads_kv // heads_t, dim=-3)
    return _as_4d(t, batch, heads_kv)


def _pad_head_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """``(q, k, v)`` with a zero column added to empty head dims (torch computes ``E = 0`` or ``Ev = 0``; attnx
    needs dims >= 1): ``E = 0`` gives every score 0, as torch's; ``Ev = 0`` is cut from the output again."""
    if q.shape[-1] == 0 and k.shape[-1] == 0:
        q, k = torch.nn.functional.pad(q, (0, 1)), torch.nn.functional.pad(k, (0, 1))
    if v.shape[-1] == 0:
        v = torch.nn.functional.pad(v, (0, 1))
    return q, k, v


def _mask_4d(attn_mask: Optional[torch.Tensor], batch: tuple, heads: int, seqlen_q: int, seqlen_k: int):
    """The mask for the flattened ``(prod(batch), heads, L, S)`` problem (as given when there is one batch dim)."""
    if attn_mask is None or len(batch) == 1:
        return attn_mask  # attnx broadcasts masks of up to 4 dims to (B, H, L, S) as torch does
    target = (*batch, heads, seqlen_q, seqlen_k)
    try:
        return attn_mask.expand(target).reshape(math.prod(batch), heads, seqlen_q, seqlen_k)
    except RuntimeError:
        raise CompatArgumentError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                                  f"{target}") from None


def _attention(q, k, v, is_causal: bool, offset, mask, scale, backend):
    """`attnx.attention` on the 4-D tensors; argument errors torch raises as RuntimeError become compat errors."""
    try:
        return attention(q, k, v, causal=is_causal, offset=offset, mask=mask, scale=scale, backend=backend)
    except (CompatArgumentError, CompatTypeError):
        raise
    except InvalidArgumentError as err:  # shapes that do not fit (torch: RuntimeError)
        raise CompatArgumentError(f"scaled_dot_product_attention: {err}") from err
    except InvalidTypeError as err:  # mixed or integer dtypes (torch: RuntimeError)
        raise CompatTypeError(f"scaled_dot_product_attention: {err}") from err


def sdpa_call(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
              backend=None):
    """`scaled_dot_product_attention` with a forced attnx ``backend`` (None: the dispatcher chooses)."""
    check_no_dropout(dropout_p, "scaled_dot_product_attention")
    if not isinstance(is_causal, bool):
        raise InvalidTypeError(f"scaled_dot_product_attention: `is_causal` must be a bool, got {is_causal!r}")
    if not isinstance(enable_gqa, bool):
        raise InvalidTypeError(f"scaled_dot_product_attention: `enable_gqa` must be a bool, got {enable_gqa!r}")
    if scale is not None and type(scale) is not float:
        scale = real_as_float(scale)  # attnx's check names anything else
    (bq, hq), (bk, hk), (bv, hv) = _split(query, "query"), _split(key, "key"), _split(value, "value")
    seqlen_q, seqlen_k, dim_v = query.shape[-2], key.shape[-2], value.shape[-1]
    attn_mask, is_causal, offset = _causal_bias(attn_mask, is_causal, seqlen_q, seqlen_k)
    rank = max(query.dim(), key.dim(), value.dim())
    attn_mask = _check_mask(attn_mask, query, rank)
    if is_causal and attn_mask is not None:
        raise CompatArgumentError("_scaled_dot_product_attention: Explicit attn_mask should not be set when "
                                  "is_causal=True")
    try:
        batch = torch.broadcast_shapes(bq, bk, bv)
    except RuntimeError as err:
        raise CompatArgumentError(f"scaled_dot_product_attention: batch dims do not broadcast: {err}") from None
    heads, heads_kv = _heads(hq, hk, hv, enable_gqa)
    batch4 = batch if batch else (1,)
    q = _as_4d(query, batch4, heads)
    k, v = _kv_4d(key, hk, batch4, heads_kv), _kv_4d(value, hv, batch4, heads_kv)
    if q.shape[-1] == 0 or dim_v == 0:
        q, k, v = _pad_head_dims(q, k, v)
    mask = _mask_4d(attn_mask, batch4, heads, seqlen_q, seqlen_k)
    out = _attention(q, k, v, is_causal, offset, mask, scale, backend)
    if dim_v == 0:
        out = out[..., :0]
    # the output has the broadcast rank of the inputs: (*batch, H, L, Ev), or (H, L, Ev), or (L, Ev)
    shape = (*batch, heads, seqlen_q, dim_v)
    return out.reshape(shape[len(shape) - rank:])


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                                 enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention``, computed by attnx.

    Args (as torch's):
        query: ``(N, ..., Hq, L, E)``; key ``(N, ..., H, S, E)``; value ``(N, ..., H, S, Ev)``. Batch
            dims broadcast; without ``enable_gqa`` the head dims broadcast too (1 = shared).
        attn_mask: bool (True = take part) or float added to the scores, broadcastable to
            ``(N, ..., Hq, L, S)`` without adding dims (a 1-D ``(S,)`` mask included); float32 or the
            query's dtype.
        dropout_p: must be 0.0 (attnx has no dropout: anything else raises `CompatArgumentError`).
        is_causal: query ``i`` sees keys ``j <= i`` (top-left, also when ``L != S``); an error
            together with ``attn_mask``, as in torch. torch's ``causal_upper_left(L, S)`` and
            ``causal_lower_right(L, S)`` masks (``torch.nn.attention.bias``) are that rule aligned
            top-left and bottom-right.
        scale: score scale, default ``1 / sqrt(E)``. ``scale`` and ``dropout_p`` take any real
            number torch takes (Python, NumPy, a 0-dim tensor).
        enable_gqa: ``Hq`` a multiple of key's and of value's heads; query head ``h`` reads key head
            ``h // (Hq / H)`` (value heads alike: key and value may have different head counts).

    Returns:
        ``(N, ..., Hq, L, Ev)`` in the query's dtype.

    One difference: a query row whose keys are all masked out gets ``0`` here, as attnx
    defines it (docs/semantics.md); torch gives ``0`` on the CPU (torch >= 2.5) but NaN on some
    GPU kernels and older versions. Argument errors torch raises as ``RuntimeError`` are
    `CompatArgumentError` (shapes, values) or `CompatTypeError` (mixed or integer dtypes): both
    ``RuntimeError`` and attnx's typed errors. A ``scale`` that is NaN or infinite is an error here
    (torch computes NaN/inf scores with it).

    Equivalent PyTorch::

        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                                               is_causal=is_causal, scale=scale,
                                                               enable_gqa=enable_gqa)
    """
    return sdpa_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
