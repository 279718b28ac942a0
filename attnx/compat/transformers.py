"""Hugging Face transformers: ``attn_implementation="attnx"`` after one `register()` call.

`register` adds an attention function to transformers' ``AttentionInterface`` and the
``sdpa`` mask builder under the same name to its ``AttentionMaskInterface`` (boolean
masks, True = attend, or None where plain causal attention is exact), so models
get the masks they would hand to ``sdpa``: padding, sliding windows (Mistral, Gemma-2),
cached generation. The function maps transformers' arguments onto `attnx.attention`:
GQA without repeating k/v, ``softcap`` (Gemma-2), ``s_aux`` attention sinks (gpt-oss),
T5-style ``position_bias``. transformers is imported only when `register` is called.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..api import attention
from ..errors import InvalidTypeError
from ..registry import get_backend
from .common import check_no_dropout


def _combine_position_bias(position_bias: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """``position_bias`` plus the mask as one additive mask (what transformers' sdpa path builds)."""
    if mask is None:
        return position_bias
    if mask.dtype == torch.bool:
        return position_bias.masked_fill(~mask, float("-inf"))
    return position_bias + mask


def attnx_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                            scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                            position_bias: Optional[torch.Tensor] = None, softcap: Optional[float] = None,
                            s_aux: Optional[torch.Tensor] = None, backend: Optional[str] = None, **kwargs):
    """transformers' attention-function signature, computed by `attnx.attention`.

    ``query`` ``(B, Hq, Sq, D)``, ``key``/``value`` ``(B, Hkv, Sk, D)``; returns ``(out, None)`` with
    ``out`` ``(B, Sq, Hq, Dv)``. Masking follows transformers' ``sdpa`` integration: the mask when
    one is given, else causal (``module.is_causal`` or ``is_causal``) for more than one query.

    Equivalent PyTorch (transformers' ``sdpa`` path)::

        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             is_causal=attention_mask is None and query.shape[2] > 1,
                                             enable_gqa=True).transpose(1, 2)
    """
    check_no_dropout(dropout, "attnx attention (transformers)")
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q_length = query.shape[2]
    causal = bool(q_length > 1 and attention_mask is None and is_causal)
    if causal and key.shape[2] > q_length:
        # as transformers' sdpa path: a static cache's prefill, its unused slots beyond the prompt
        key, value = key[:, :, :q_length], value[:, :, :q_length]
        if position_bias is not None:
            position_bias = position_bias[..., :q_length]
    mask = attention_mask
    if position_bias is not None:
        mask = _combine_position_bias(position_bias, mask)
    if query.shape[0] != key.shape[0]:  # a batch of 1 on one side broadcasts, as SDPA does
        batch = max(query.shape[0], key.shape[0])
        query, key, value = (t.expand(batch, *t.shape[1:]) for t in (query, key, value))
    sinks = None if s_aux is None else s_aux.float()
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=causal, mask=mask,
                    scale=scaling, softcap=softcap, sinks=sinks, layout="bshd", backend=backend)
    return out, None


def register(name: str = "attnx", backend: Optional[str] = None) -> str:
    """Register attnx with transformers as ``attn_implementation=name``; returns the name.

    ``backend`` forces one attnx backend for every call (default: the dispatcher chooses).
    Registering the same name again replaces the earlier registration.

    Example::

        import attnx.compat.transformers
        attnx.compat.transformers.register()
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="attnx")

    Equivalent PyTorch (what it replaces)::

        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if not isinstance(name, str) or not name:
        raise InvalidTypeError(f"`name` must be a non-empty str, got {name!r}")
    if backend is not None:
        get_backend(backend)
    function = attnx_attention_forward if backend is None else functools.partial(attnx_attention_forward,
                                                                                 backend=backend)
    AttentionInterface.register(name, function)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    return name
