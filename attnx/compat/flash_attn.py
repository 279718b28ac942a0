"""flash-attn 2.x's Python API, computed by attnx: ``import attnx.compat.flash_attn as flash_attn``.

The functions keep flash-attn's names, argument names and order, defaults and return
values (see docs/integration.md for the few differences: no dropout, ``return_attn_probs``
gives ``(out, softmax_lse, None)``, a row that sees no key has ``lse = -inf``, and any
float dtype and device attnx supports is accepted). Gradients flow through every function,
`flash_attn_with_kvcache` included (flash-attn has no backward for it): to ``q``, the caches as
read, and the new ``k``/``v`` as if they had been concatenated to the cache.
"""
from __future__ import annotations

import torch

from ..api import attention
from ..errors import InvalidArgumentError, InvalidTypeError
from .flash_attn_args import options
from .kvcache import flash_attn_with_kvcache

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]


def _run(api: str, q, k, v, opts: dict, deterministic, return_attn_probs):
    if not isinstance(deterministic, bool) or not isinstance(return_attn_probs, bool):
        raise InvalidTypeError(f"{api}: `deterministic` and `return_attn_probs` must be bools")
    # flash-attn's default False is attnx's "no request of its own": torch's global switch still holds
    out, lse = attention(q, k, v, **opts, deterministic=deterministic, return_lse=True)
    return (out, lse, None) if return_attn_probs else out


def _dense(api, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
           return_attn_probs):
    opts = options(api, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap_value=softcap, alibi_slopes=alibi_slopes)
    return _run(api, q, k, v, dict(opts, layout="bshd"), deterministic, return_attn_probs)


def _varlen(api, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
            window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table=None):
    opts = options(api, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap_value=softcap, alibi_slopes=alibi_slopes)
    opts.update(cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q)
    if block_table is None:
        opts.update(cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)
    else:  # k, v are page pools; sequence b uses its first cu_seqlens_k[b+1] - cu_seqlens_k[b] keys
        opts.update(seqlens_k=_paged_lengths(api, cu_seqlens_k), page_table=block_table)
    return _run(api, q, k, v, opts, deterministic, return_attn_probs)


def _paged_lengths(api: str, cu_seqlens_k) -> torch.Tensor:
    """The key count of each sequence from ``cu_seqlens_k``, int32 ``(batch + 1,)`` as without ``block_table``."""
    if not isinstance(cu_seqlens_k, torch.Tensor):
        raise InvalidTypeError(f"{api}: `cu_seqlens_k` must be a torch.Tensor, got {type(cu_seqlens_k).__name__}")
    if cu_seqlens_k.dtype != torch.int32:
        raise InvalidTypeError(f"{api}: `cu_seqlens_k` must be int32, got {cu_seqlens_k.dtype}")
    if cu_seqlens_k.dim() != 1 or cu_seqlens_k.shape[0] < 1:
        raise InvalidArgumentError(f"{api}: `cu_seqlens_k` must be (batch + 1,), got shape {tuple(cu_seqlens_k.shape)}")
    return cu_seqlens_k[1:] - cu_seqlens_k[:-1]


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn.flash_attn_func``: q ``(batch, seqlen_q, nheads, d)``, k/v ``(batch, seqlen_k, nheads_k, d)``.

    ``causal`` and ``window_size`` are aligned bottom-right (query ``i`` sits at key position
    ``i + seqlen_k - seqlen_q``); ``window_size=(-1, -1)`` is no window, ``softcap=0.0`` no
    softcap, ``alibi_slopes`` float32 ``(nheads,)`` or ``(batch, nheads)``. ``dropout_p`` must be 0;
    ``deterministic=True`` runs only a backward that gives bitwise-identical gradients run to run
    (as ``attnx.attention(..., deterministic=True)``; False, the default, still honours
    ``torch.use_deterministic_algorithms(True)``).

    Returns ``out`` ``(batch, seqlen_q, nheads, d)``, or ``(out, softmax_lse, None)`` with
    ``return_attn_probs=True`` (lse float32 ``(batch, nheads, seqlen_q)``).

    Equivalent PyTorch (no window, ALiBi or softcap)::

        s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(nheads // nheads_k, 2)) * scale
        if causal:
            seen = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).tril(seqlen_k - seqlen_q)
            s = s.masked_fill(~seen, float("-inf"))
        out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.repeat_interleave(nheads // nheads_k, 2))
    """
    return _dense("flash_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                  deterministic, return_attn_probs)


def _unpack(api: str, name: str, packed, dim: int, parts: int):
    """The `parts` tensors packed along `dim` of `packed`, after checking it is a tensor with that many there."""
    if not isinstance(packed, torch.Tensor):
        raise InvalidTypeError(f"{api}: `{name}` must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dim() <= dim or packed.shape[dim] != parts:
        raise InvalidArgumentError(f"{api}: `{name}` must have {parts} at dim {dim} "
                                   f"({', '.join('qkv'[3 - parts:])}), got shape {tuple(packed.shape)}")
    return packed.unbind(dim=dim)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn.flash_attn_kvpacked_func``: kv ``(batch, seqlen_k, 2, nheads_k, d)``; else as `flash_attn_func`.

    Equivalent PyTorch: ``flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], ...)`` (gradients flow into ``kv``).
    """
    k, v = _unpack("flash_attn_kvpacked_func", "kv", kv, 2, 2)
    return _dense("flash_attn_kvpacked_func", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                  alibi_slopes, deterministic, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn.flash_attn_qkvpacked_func``: qkv ``(batch, seqlen, 3, nheads, d)``; else as `flash_attn_func`.

    Equivalent PyTorch: ``flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], ...)``.
    """
    q, k, v = _unpack("flash_attn_qkvpacked_func", "qkv", qkv, 2, 3)
    return _dense("flash_attn_qkvpacked_func", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                  alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """``flash_attn.flash_attn_varlen_func``: q ``(total_q, nheads, d)``, k/v ``(total_k, nheads_k, d)``.

    ``cu_seqlens_q``/``cu_seqlens_k``: int32 ``(batch + 1,)``; sequence ``b`` is rows
    ``cu[b]:cu[b + 1]``; causal/window aligned bottom-right per sequence. With ``block_table``
    (int32 ``(batch, max_blocks)``), k/v are page pools ``(num_blocks, block_size, nheads_k, d)``
    and sequence ``b`` reads its first ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` keys from its pages.

    Returns ``out`` ``(total_q, nheads, d)``, or ``(out, softmax_lse, None)`` (lse ``(nheads, total_q)``).

    Equivalent PyTorch: `flash_attn_func` on each sequence ``q[cu_q[b]:cu_q[b+1]][None]`` and
    ``k[cu_k[b]:cu_k[b+1]][None]``, outputs concatenated along the tokens.
    """
    return _varlen("flash_attn_varlen_func", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs, block_table)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn.flash_attn_varlen_kvpacked_func``: kv ``(total_k, 2, nheads_k, d)``, else `flash_attn_varlen_func`.

    Equivalent PyTorch: ``flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], ...)``.
    """
    k, v = _unpack("flash_attn_varlen_kvpacked_func", "kv", kv, 1, 2)
    return _varlen("flash_attn_varlen_kvpacked_func", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """``flash_attn.flash_attn_varlen_qkvpacked_func``: qkv ``(total, 3, nheads, d)``, one ``cu_seqlens`` for q and k/v.

    Equivalent PyTorch: ``flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens,
    max_seqlen, max_seqlen, ...)``.
    """
    q, k, v = _unpack("flash_attn_varlen_qkvpacked_func", "qkv", qkv, 1, 3)
    return _varlen("flash_attn_varlen_qkvpacked_func", q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                   dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)
