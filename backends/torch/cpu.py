"""The CPU flash kernel: ``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward.

The op returns ``(out, logsumexp)``; its logsumexp is the contract's ``lse`` for every row
that sees a key (float32 for fp16/bf16/float32 inputs, float64 for float64). It handles
GQA itself (k/v with fewer heads) and reads any strides whose last dimension is contiguous.
Where the contract and the kernel differ, this module adjusts:

* a row that sees no key: the kernel gives ``out = 0`` and ``lse = 0``; the contract
  ``lse = -inf`` (the backward gets 0 back, so such rows get zero gradients);
* float64: the contract's ``lse`` is float32, too coarse for a float64 backward, so the
  backward asks the kernel for the float64 one again (one more forward);
* non-finite ``q``/``k`` behind a hiding mask: `nonfinite` recomputes those batch entries;
* non-finite ``q``/``k`` anywhere else: the kernel (torch 2.13) turns a row whose scores are all
  NaN into a row that saw nothing (``out = 0``, ``lse = 0``) when there are fewer than 16 keys, and
  gives finite ``out`` rows for scores of ``+inf``; such calls leave an lse that is not finite or
  exactly 0 (`_suspect`), and only then are the batch entries with non-finite q/k recomputed.
"""
from __future__ import annotations

import functools
import itertools
import math

import torch

from attnx.autograd import alloc_out
from attnx.inputs import Grads, Inputs
from attnx.problem import Problem

from . import nonfinite
from .masks import KernelMask, dead_rows, kernel_mask

NEG_INF = float("-inf")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _operands(x: Inputs):
    return _last_dim_contiguous(x.q), _last_dim_contiguous(x.k), _last_dim_contiguous(x.v)


# The op's own Python binding: a few µs less per call than going through torch.ops' packet
# (torch.ops where a build lacks the binding; `environment_reasons` checks the op exists).
_FLASH_CPU = getattr(torch, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLOAT64 = torch.float64


def _flash_cpu():
    return _FLASH_CPU or torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


# The kernel's own default scale per head dim D, ``1 / sqrt(D)`` in double: the value `Problem`
# resolves for ``scale=None`` (a table: one index instead of a square root on every call).
_DEFAULT_SCALES = (None,) + tuple(1.0 / math.sqrt(d) for d in range(1, 1025))


def _kernel_forward(p: Problem, q, k, v, km: KernelMask):
    return _flash_cpu()(q, k, v, 0.0, km.is_causal, attn_mask=km.mask, scale=p.scale)


def _in_caller_layout(p: Problem, out: torch.Tensor) -> bool:
    """True when the kernel's `out` is laid out as `alloc_out` would make it (contiguous in the caller's layout).

    The kernel writes its output in q's own layout, so a contiguous ``bhsd`` or ``bshd`` q gives one
    that can be returned as it is (no second buffer, no copy).
    """
    return (out.transpose(1, 2) if p.layout == "bshd" else out).is_contiguous()


def _caller_out(p: Problem, q: torch.Tensor, out_k: torch.Tensor) -> torch.Tensor:
    if _in_caller_layout(p, out_k):
        return out_k
    out = alloc_out(p, q)
    out.copy_(out_k)
    return out


# lse up to this many values is read back and checked in Python: one `tolist` costs less than the two
# ops and the read-back below right after a kernel (decode: 4 against 20 µs; measured, 2026-12-02)
_SMALL_LSE = 128
_flatten = itertools.chain.from_iterable
_isfinite = math.isfinite


def _suspect(lse: torch.Tensor) -> bool:
    """Whether `lse` (B, Hq, Sq) holds a NaN, an infinity or an exact 0: what the kernel leaves for rows
    that met a NaN or an infinity in q or k (a row that sees a key otherwise has a finite lse, 0 only by
    coincidence, which costs an exact check and no more)."""
    if lse.numel() <= _SMALL_LSE:
        values = list(_flatten(_flatten(lse.tolist())))
        return 0.0 in values or not _isfinite(sum(values))  # a sum that overflows: the exact check
    # x / x is 1 for every finite nonzero x, NaN for 0, an infinity or a NaN
    return not _isfinite(float(lse.div(lse).sum()))


def _fix_nonfinite(p: Problem, x: Inputs, q, k, out, lse) -> None:
    batches = nonfinite.bad_batches(q, k)
    if batches:
        nonfinite.fix_forward(p, x, out, lse, batches)


def _plain_rule(p: Problem) -> bool:
    """Full attention, or causal with Sq == Sk and no offset: the kernel's own `is_causal` (or nothing)
    says it, and without a mask no mask is built and every row sees a key."""
    right = p.window_right
    return p.window_left is None and (right is None or (right == 0 and p.seqlen_q == p.seqlen_k and not p.offset))


def _plain(p: Problem, x: Inputs) -> bool:
    return x.mask is None and _plain_rule(p)


def _default_scale(p: Problem) -> bool:
    return p.head_dim < 1025 and p.scale == _DEFAULT_SCALES[p.head_dim]


def dense_forward(p: Problem):
    """`forward` of `p` without a mask as ``f(q, k, v)`` where `_plain` holds it, else None
    (`Backend.dense_forward`: a remembered plain call runs it without building `Inputs`)."""
    return functools.partial(plain_forward, p) if _plain_rule(p) else None


def plain_forward(p: Problem, q, k, v):
    """`forward` where `_plain` holds: full attention or causal with Sq == Sk (top-left and bottom-right
    agree), no mask to build, every row sees a key, no -inf that could hide a NaN (`kernel_mask` gives the same).

    Every line here runs on every call, right after the previous kernel left the caches cold, where each
    torch binding call costs µs (benchmarks/results/cpu-2026-12-01-overhead4): `stride()` over `stride(-1)`,
    positional arguments where the scale is the kernel's default (its keyword parsing costs ~5 µs there).
    """
    qk, kk, vk = q, k, v
    if q.stride()[-1] != 1 or k.stride()[-1] != 1 or v.stride()[-1] != 1:
        qk, kk, vk = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    flash = _FLASH_CPU or _flash_cpu()
    is_causal = p.window_right is not None
    head_dim = p.head_dim
    if head_dim < 1025 and p.scale == _DEFAULT_SCALES[head_dim]:
        out_k, lse = flash(qk, kk, vk, 0.0, is_causal)
    else:
        out_k, lse = flash(qk, kk, vk, 0.0, is_causal, scale=p.scale)
    if p.dtype is _FLOAT64:
        lse = lse.float()  # the contract's lse is float32
    out = out_k if p.layout == "bhsd" and out_k.is_contiguous() else _caller_out(p, q, out_k)
    if _suspect(lse):
        _fix_nonfinite(p, Inputs(q, k, v), qk, kk, out, lse)
    return out, lse


def forward(p: Problem, x: Inputs):
    if _plain(p, x):
        return plain_forward(p, x.q, x.k, x.v)
    q, k, v = x.q, x.k, x.v
    if q.stride()[-1] != 1 or k.stride()[-1] != 1 or v.stride()[-1] != 1:
        q, k, v = _operands(x)
    km = kernel_mask(p, x.mask, q)
    out_k, lse_k = _kernel_forward(p, q, k, v, km)
    out = _caller_out(p, x.q, out_k)
    # the kernel's own buffer (float64 inputs: a float32 copy), written below; `.to` costs ~10 µs even as a no-op
    lse = lse_k.float() if p.dtype is _FLOAT64 else lse_k
    dead = None if km.mask is None else dead_rows(km, p.seqlen_q)  # top-left is_causal hides no whole row
    if dead is not None:
        # the kernel's lse is 0 there (out is already 0); a NaN row stays NaN
        lse.masked_fill_(dead & ~torch.isnan(lse), NEG_INF)
    if km.hides or _suspect(lse.masked_fill(lse == NEG_INF, 1.0) if dead is not None else lse):
        _fix_nonfinite(p, x, q, k, out, lse)
    return out, lse


def backward(p: Problem, x: Inputs, out, lse, dout) -> Grads:
    if _plain(p, x):
        return _plain_backward(p, x, out, lse, dout)
    q, k, v = _operands(x)
    km = kernel_mask(p, x.mask, q)
    lse = lse.masked_fill(lse == NEG_INF, 0.0)  # what the kernel wrote for rows that see no key
    met_nonfinite = not bool(torch.isfinite(lse).all())  # the forward's lse is NaN where q/k met a NaN
    if p.dtype == torch.float64:
        lse = _kernel_forward(p, q, k, v, km)[1]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _last_dim_contiguous(dout), q, k, v, _last_dim_contiguous(out), lse, 0.0, km.is_causal,
        attn_mask=km.mask, scale=p.scale)
    if km.hides or met_nonfinite:
        batches = nonfinite.bad_batches(q, k)
        if batches:
            nonfinite.fix_backward(p, x, dout, (dq, dk, dv), batches)
    return Grads(dq, dk, dv)


def _plain_backward(p: Problem, x: Inputs, out, lse, dout) -> Grads:
    """`backward` where `_plain` holds, in fewer torch calls (each costs µs on cold caches, which small
    calls feel): no row is dead, so lse holds no -inf to map; one sum tells whether
    it holds a NaN or an infinity (the forward's mark of non-finite q/k; a sum that overflows costs
    only the exact check of q and k); the scale is passed only when it is not the kernel's default."""
    q, k, v = _operands(x)
    is_causal = p.window_right is not None
    met_nonfinite = not math.isfinite(float(lse.sum()))
    if p.dtype is _FLOAT64:
        lse = _flash_cpu()(q, k, v, 0.0, is_causal, scale=p.scale)[1]
    args = (_last_dim_contiguous(dout), q, k, v, _last_dim_contiguous(out), lse, 0.0, is_causal)
    if _default_scale(p):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(*args)
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(*args, scale=p.scale)
    if met_nonfinite:
        batches = nonfinite.bad_batches(q, k)
        if batches:
            nonfinite.fix_backward(p, x, dout, (dq, dk, dv), batches)
    return Grads(dq, dk, dv)
