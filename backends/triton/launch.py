"""Turn (Problem, tensors) into kernel launches: argument packing, grids, config choice, autotuning.

Imported only when the backend runs (it imports triton and the kernels).
"""
from __future__ import annotations

import functools

import torch
import triton

from attnx.autograd import alloc_out, sum_to_shape
from attnx.inputs import Grads, sinks_grad
from attnx.limits import kernel_window

from . import configs, interpreter_fix
from .configs import DTYPE_NAMES, path_of
from .kernels_bwd import bwd_dkdv, bwd_dq, bwd_preprocess
from .kernels_fwd import attn_fwd

AUTOTUNE_MIN_SCORES = 1 << 26  # B*H*Sq*Sk below this: first candidate, no autotuning
KERNEL_FNS = {"fwd": attn_fwd, "bwd_dkdv": bwd_dkdv, "bwd_dq": bwd_dq}


@functools.lru_cache(maxsize=None)
def _autotuned(kernel: str, fam: str, path: str, bd: int, dtype: str):
    """An autotuner over the pruned candidates, keyed on head dims, causal-ness and a length bucket."""
    cands = configs.candidates(fam, kernel, path, bd, dtype)
    tri = [triton.Config({"BLOCK_M": c.block_m, "BLOCK_N": c.block_n, **_hip_knobs(c, fam)},
                         num_warps=c.num_warps, num_stages=c.num_stages) for c in cands]
    return triton.autotune(configs=tri, key=["head_dim", "head_dim_v", "seq_bucket", "window_right",
                                             "group_size"])(KERNEL_FNS[kernel])


def _hip_knobs(c, fam):
    opts = c.options(fam)
    return {k: v for k, v in opts.items() if k not in ("num_warps", "num_stages")}


def _launch(kernel: str, p, grid_of, args: list, bd: int, path: str):
    """Launch `kernel`: first candidate for small problems, the autotuner for large dense ones."""
    if p.device_type == "cpu":
        interpreter_fix.apply()
    fam = configs.family(p.vendor, p.arch)
    dtype = DTYPE_NAMES[p.dtype]
    consts = {"BLOCK_D": bd, "DENSE": path == "dense"}
    cands = configs.candidates(fam, kernel, path, bd, dtype)
    big = p.batch * p.heads_q * p.seqlen_q * p.seqlen_k >= AUTOTUNE_MIN_SCORES
    if len(cands) > 1 and big:
        tuned = _autotuned(kernel, fam, path, bd, dtype)
        tuned[lambda meta: grid_of(meta["BLOCK_M"], meta["BLOCK_N"])](*args, **consts)
        return
    c = cands[0]
    KERNEL_FNS[kernel][grid_of(c.block_m, c.block_n)](*args, BLOCK_M=c.block_m, BLOCK_N=c.block_n, **consts,
                                                      **c.options(fam))


def _seq_bucket(p) -> int:
    return triton.next_power_of_2(max(p.seqlen_q, p.seqlen_k, 16))


def _mask_arg(p, mask, device):
    """(float32 additive tensor, 4 strides): bool masks become 0/-inf, no mask a zero-stride zero.

    Conversion runs on the un-broadcast mask (the expanded dims sliced to size 1), so a
    (B, 1, 1, Sk) padding mask costs B*Sk elements, not B*H*Sq*Sk.
    """
    if mask is None:
        return torch.zeros(1, dtype=torch.float32, device=device), (0, 0, 0, 0)
    if mask.dtype != torch.float32:
        small = mask[tuple(slice(0, 1) if st == 0 else slice(None) for st in mask.stride())]
        if small.dtype == torch.bool:
            small = torch.zeros(small.shape, dtype=torch.float32, device=device).masked_fill_(~small, float("-inf"))
        else:
            small = small.float()
        mask = small.expand(mask.shape)
    return mask, tuple(mask.stride())


def _slopes_arg(alibi_slopes, device):
    if alibi_slopes is None:
        return torch.zeros(1, dtype=torch.float32, device=device), (0, 0)
    return alibi_slopes, tuple(alibi_slopes.stride())


def _common(p, q, mask, alibi_slopes):
    bd = configs.block_d(p.head_dim, p.head_dim_v)
    mask_t, mask_strides = _mask_arg(p, mask, q.device)
    slopes_t, slope_strides = _slopes_arg(alibi_slopes, q.device)
    return bd, path_of(p), mask_t, mask_strides, slopes_t, slope_strides


def _sinks_arg(sinks, device):
    """(float32 (Hq,) tensor, flag): no sinks is a one-element dummy the kernel never reads."""
    if sinks is None:
        return torch.zeros(1, dtype=torch.float32, device=device), 0
    return sinks.float().contiguous(), 1


def forward(p, x):
    q, k, v = x.q, x.k, x.v
    bd, path, mask_t, mask_strides, slopes_t, slope_strides = _common(p, q, x.mask, x.alibi_slopes)
    sinks_t, has_sinks = _sinks_arg(x.sinks, q.device)
    out = alloc_out(p, q)
    lse = torch.empty((p.batch, p.heads_q, p.seqlen_q), dtype=torch.float32, device=q.device)
    left, right = kernel_window(p)
    args = [q, k, v, out, lse, mask_t, slopes_t, sinks_t, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            *mask_strides, *slope_strides, p.heads_q, p.group_size, p.seqlen_q, p.seqlen_k, p.head_dim,
            p.head_dim_v, p.key_offset, left, right, p.scale, p.softcap or 0.0, has_sinks, _seq_bucket(p)]
    grid_of = lambda bm, bn: (triton.cdiv(p.seqlen_q, bm), p.batch * p.heads_q)
    _launch("fwd", p, grid_of, args, bd, path)
    return out, lse


def backward(p, x, out, lse, dout) -> Grads:
    q, k, v, mask = x.q, x.k, x.v, x.mask
    bd, path, mask_t, mask_strides, slopes_t, slope_strides = _common(p, q, mask, x.alibi_slopes)
    # lse includes the sink, so P (hence dq, dk, dv) needs nothing more from it
    lse = lse.float().contiguous()
    delta = torch.empty_like(lse)
    if p.device_type == "cpu":
        interpreter_fix.apply()
    bwd_preprocess[(triton.cdiv(p.seqlen_q, configs.PREPROCESS_BLOCK_M), p.batch * p.heads_q)](
        out, dout, delta, *out.stride(), *dout.stride(), p.heads_q, p.seqlen_q, p.head_dim_v,
        BLOCK_M=configs.PREPROCESS_BLOCK_M, BLOCK_D=bd)

    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    store_dmask = int(p.mask_requires_grad)
    # keys outside a query's window are never visited, so their mask gradient must start at 0
    dmask_full = (torch.zeros((p.batch, p.heads_q, p.seqlen_q, p.seqlen_k), dtype=torch.float32, device=q.device)
                  if store_dmask else torch.empty(1, dtype=torch.float32, device=q.device))
    left, right = kernel_window(p)
    tail = [p.head_dim, p.head_dim_v, p.key_offset, left, right, p.scale, p.softcap or 0.0]
    args = [q, k, v, dout, lse, delta, dk, dv, mask_t, slopes_t, dmask_full, *q.stride(), *k.stride(),
            *v.stride(), *dout.stride(), *dk.stride(), *dv.stride(), *mask_strides, *slope_strides,
            p.heads_q, p.heads_kv, p.group_size, p.seqlen_q, p.seqlen_k, *tail, store_dmask, _seq_bucket(p)]
    _launch("bwd_dkdv", p, lambda bm, bn: (triton.cdiv(p.seqlen_k, bn), p.batch * p.heads_kv), args, bd, path)
    args = [q, k, v, dout, lse, delta, dq, mask_t, slopes_t, *q.stride(), *k.stride(), *v.stride(),
            *dout.stride(), *dq.stride(), *mask_strides, *slope_strides, p.heads_q, p.group_size, p.seqlen_q,
            p.seqlen_k, *tail, _seq_bucket(p)]
    _launch("bwd_dq", p, lambda bm, bn: (triton.cdiv(p.seqlen_q, bm), p.batch * p.heads_q), args, bd, path)
    dmask = sum_to_shape(dmask_full, p.mask_shape).to(mask.dtype) if store_dmask else None
    dsinks = sinks_grad(x.sinks, lse, delta) if x.sinks is not None else None
    return Grads(dq, dk, dv, dmask, dsinks)
