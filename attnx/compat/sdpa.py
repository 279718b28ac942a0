"""`scaled_dot_product_attention`: ``torch.nn.functional.scaled_dot_product_attention``, computed by attnx.

Same signature, shapes, broadcasting and errors as torch's function (torch 2.5+), so it
drops into code written for it; `use_attnx_for_sdpa` routes the calls of unmodified code.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..api import attention
from ..errors import InvalidTypeError
from .common import check_no_dropout
from .errors import CompatArgumentError


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


def _check_mask(attn_mask, query: torch.Tensor) -> None:
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor):
        raise InvalidTypeError(f"scaled_dot_product_attention: `attn_mask` must be a torch.Tensor or None, "
                               f"got {type(attn_mask).__name__}")
    if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        raise CompatArgumentError(
            "Expected attn_mask dtype to be bool or float or to match query dtype, but got attn_mask.dtype: "
            f"{attn_mask.dtype} and query.dtype: {query.dtype} instead.")
    if attn_mask.dim() < 2:
        raise CompatArgumentError(f"scaled_dot_product_attention: `attn_mask` must have at least 2 dims (L, S), "
                                  f"got shape {tuple(attn_mask.shape)}")


def _heads(hq: int, hk: int, hv: int, enable_gqa: bool) -> tuple[int, int]:
    """``(H, Hkv)``: output heads and the kv heads attnx reads (kv head ``h // (H / Hkv)``)."""
    if enable_gqa:
        if hk != hv or hk == 0 or hq % hk:
            raise CompatArgumentError(
                f"Number of heads in key and value must divide the number of heads in query (enable_gqa=True): "
                f"query {hq}, key {hk}, value {hv} heads")
        return hq, hk
    try:
        heads = torch.broadcast_shapes((hq,), (hk,), (hv,))[0]
    except RuntimeError:
        raise CompatArgumentError(
            f"query, key and value heads must be equal or 1 (broadcast) without enable_gqa=True: "
            f"got {hq}, {hk}, {hv}") from None
    if hk != hv:
        raise CompatArgumentError(f"key and value heads differ ({hk}, {hv}): attnx reads one kv head for both")
    return heads, hk


def _as_4d(t: torch.Tensor, batch: tuple, heads: int) -> torch.Tensor:
    """``t`` broadcast to ``(*batch, heads, L, E)``, flattened to ``(prod(batch), heads, L, E)`` (a view if 4-D)."""
    t = t.expand(*batch, heads, *t.shape[-2:])
    return t.reshape(math.prod(batch), heads, *t.shape[-2:])


def _mask_4d(attn_mask: Optional[torch.Tensor], batch: tuple, heads: int, seqlen_q: int, seqlen_k: int):
    if attn_mask is None or len(batch) == 1:
        return attn_mask  # attnx broadcasts masks of up to 4 dims to (B, H, L, S) as torch does
    target = (*batch, heads, seqlen_q, seqlen_k)
    try:
        return attn_mask.expand(target).reshape(math.prod(batch), heads, seqlen_q, seqlen_k)
    except RuntimeError:
        raise CompatArgumentError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                                  f"{target}") from None


def sdpa_call(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
              backend=None):
    """`scaled_dot_product_attention` with a forced attnx ``backend`` (None: the dispatcher chooses)."""
    check_no_dropout(dropout_p, "scaled_dot_product_attention")
    if not isinstance(is_causal, bool):
        raise InvalidTypeError(f"scaled_dot_product_attention: `is_causal` must be a bool, got {is_causal!r}")
    if not isinstance(enable_gqa, bool):
        raise InvalidTypeError(f"scaled_dot_product_attention: `enable_gqa` must be a bool, got {enable_gqa!r}")
    (bq, hq), (bk, hk), (bv, hv) = _split(query, "query"), _split(key, "key"), _split(value, "value")
    _check_mask(attn_mask, query)
    if is_causal and attn_mask is not None:
        raise CompatArgumentError("_scaled_dot_product_attention: Explicit attn_mask should not be set when "
                                  "is_causal=True")
    try:
        batch = torch.broadcast_shapes(bq, bk, bv)
    except RuntimeError as err:
        raise CompatArgumentError(f"scaled_dot_product_attention: batch dims do not broadcast: {err}") from None
    heads, heads_kv = _heads(hq, hk, hv, enable_gqa)
    batch4 = batch if batch else (1,)
    seqlen_q, seqlen_k = query.shape[-2], key.shape[-2]
    q = _as_4d(query, batch4, heads)
    k, v = _as_4d(key, batch4, heads_kv), _as_4d(value, batch4, heads_kv)
    mask = _mask_4d(attn_mask, batch4, heads, seqlen_q, seqlen_k)
    out = attention(q, k, v, causal=is_causal, offset=0 if is_causal else None, mask=mask, scale=scale,
                    backend=backend)
    # the output has the broadcast rank of the inputs: (*batch, H, L, Ev), or (H, L, Ev), or (L, Ev)
    shape = (*batch, heads, seqlen_q, value.shape[-1])
    rank = max(query.dim(), key.dim(), value.dim())
    return out.reshape(shape[len(shape) - rank:])


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                                 enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention``, computed by attnx.

    Args (as torch's):
        query: ``(N, ..., Hq, L, E)``; key ``(N, ..., H, S, E)``; value ``(N, ..., H, S, Ev)``. Batch
            dims broadcast; without ``enable_gqa`` the head dims broadcast too (1 = shared).
        attn_mask: bool (True = take part) or float added to the scores, broadcastable to
            ``(N, ..., Hq, L, S)``; float32 or the query's dtype.
        dropout_p: must be 0.0 (attnx has no dropout: anything else raises `CompatArgumentError`).
        is_causal: query ``i`` sees keys ``j <= i`` (top-left, also when ``L != S``); an error
            together with ``attn_mask``, as in torch.
        scale: score scale, default ``1 / sqrt(E)``.
        enable_gqa: ``Hq`` a multiple of ``H``; query head ``h`` reads kv head ``h // (Hq / H)``.

    Returns:
        ``(N, ..., Hq, L, Ev)`` in the query's dtype.

    One difference: a query row whose keys are all masked out gets ``0`` here, as attnx
    defines it (docs/semantics.md); torch gives ``0`` on the CPU (torch >= 2.5) but NaN on some
    GPU kernels and older versions.

    Equivalent PyTorch::

        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                                               is_causal=is_causal, scale=scale,
                                                               enable_gqa=enable_gqa)
    """
    return sdpa_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
