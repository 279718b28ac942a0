"""Turn (Problem, tensors) into kernel launches: argument packing, grids, config choice, autotuning.

Tensor formats are runtime arguments (`format_args`): one set of kernels serves dense, packed,
cache and paged tensors. Few query rows go to the split-KV decode kernel (`configs.use_decode`).
Imported only when the backend runs (it imports triton and the kernels).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

from attnx.autograd import alloc_out, sum_to_shape
from attnx.inputs import Grads, sinks_grad
from attnx.limits import kernel_window

from . import cache_fallback, configs, interpreter_fix
from .configs import DTYPE_NAMES, path_of
from .kernels_bwd import bwd_dkdv, bwd_dq, bwd_preprocess
from .kernels_decode import attn_decode, decode_combine
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
    if 0 in grid_of(cands[0].block_m, cands[0].block_n):
        return  # no sequence has a row (or a key) here: nothing to launch
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


KV_MODES = {"dense": 0, "varlen": 1, "cache": 2, "paged": 3}  # kernels_common.KV_*


class Format(NamedTuple):
    """The kernels' view of the call's tensor formats (runtime arguments: no variant per format)."""

    index: tuple        # CuQ, CuK, SeqlensK, PageTable: int32 tensors (one-element dummies when absent)
    q_strides: tuple    # (b, h, row, d) of q; also of out, dout and dq (packed: b stride 0)
    k_strides: tuple    # (b or page, h, row, d)
    v_strides: tuple
    lse_strides: tuple  # (b, h) of lse and delta; rows are contiguous
    stride_pt: int
    capacity: int       # keys a sequence may have: Sk (dense), the cache's, the page table's (0: empty pool)
    key_offset: int
    q_varlen: int
    kv_mode: int
    align_br: int       # 1: bottom-right per sequence (key_offset added to Sk_b - Sq_b)
    page_size: int
    total_q: int
    total_k: int
    num_pages: int


def _strides(t, packed: bool) -> tuple:
    """(b, h, row, d) strides of a (B, H, S, D) view, or of packed (T, H, D) with b stride 0."""
    return (0, t.stride(1), t.stride(0), t.stride(2)) if packed else tuple(t.stride())


@functools.lru_cache(maxsize=None)
def _no_index(device: torch.device) -> torch.Tensor:
    """Stands in for an absent index tensor (never read: its flag is off); one per device."""
    return torch.zeros(2, dtype=torch.int32, device=device)


def _index(t, device):
    if t is None:
        return _no_index(device)
    return t if t.is_contiguous() else t.contiguous()


def format_args(p, x) -> Format:
    """Strides, index tensors and flags for `p`'s formats; k/v may be packed, a cache or page pools."""
    q, k, v = x.q, x.k, x.v
    q_varlen = p.q_format == "varlen"
    kv_mode = KV_MODES[p.kv_format]
    if kv_mode == KV_MODES["paged"]:  # pools (pages, page_size, Hkv, D): b stride steps pages
        k_strides = (k.stride(0), k.stride(2), k.stride(1), k.stride(3))
        v_strides = (v.stride(0), v.stride(2), v.stride(1), v.stride(3))
    else:
        k_strides, v_strides = _strides(k, kv_mode == 1), _strides(v, kv_mode == 1)
    lse_strides = (0, q.shape[0]) if q_varlen else (p.heads_q * p.seqlen_q, p.seqlen_q)
    index = tuple(_index(t, q.device) for t in (x.cu_seqlens_q, x.cu_seqlens_k, x.seqlens_k, x.page_table))
    dense = p.is_dense
    return Format(index, _strides(q, q_varlen), k_strides, v_strides, lse_strides,
                  index[3].stride(0) if x.page_table is not None else 0,
                  0 if kv_mode == KV_MODES["paged"] and k.shape[0] == 0 else p.seqlen_k,
                  p.key_offset if dense or p.offset is not None else 0, int(q_varlen), kv_mode,
                  int(not dense and p.offset is None), p.page_size or 1,
                  q.shape[0] if q_varlen else 0, k.shape[0] if kv_mode == 1 else 0,
                  k.shape[0] if kv_mode == 3 else 1)


def _lse_empty(p, q):
    shape = (p.heads_q, q.shape[0]) if p.q_format == "varlen" else (p.batch, p.heads_q, p.seqlen_q)
    return torch.empty(shape, dtype=torch.float32, device=q.device)


@functools.lru_cache(maxsize=None)
def _sm_count(device_type: str, index) -> int:
    if device_type == "cpu":
        return configs.INTERPRETER_SMS
    return torch.cuda.get_device_properties(index).multi_processor_count


@cache_fallback.survives_cache_errors
@interpreter_fix.serialised(attn_fwd)
def forward(p, x):
    q, k, v = x.q, x.k, x.v
    bd, path, mask_t, mask_strides, slopes_t, slope_strides = _common(p, q, x.mask, x.alibi_slopes)
    sinks_t, has_sinks = _sinks_arg(x.sinks, q.device)
    f = format_args(p, x)
    out = alloc_out(p, q)
    lse = _lse_empty(p, q)
    if configs.use_decode(p):
        _decode(p, x, f, out, lse, bd, slopes_t, slope_strides, sinks_t, has_sinks)
        return out, lse
    left, right = kernel_window(p)
    out_strides = _strides(out, p.q_format == "varlen")
    args = [q, k, v, out, lse, mask_t, slopes_t, sinks_t, *f.index, *f.q_strides, *f.k_strides, *f.v_strides,
            *out_strides, *mask_strides, *slope_strides, *f.lse_strides, f.stride_pt, p.heads_q, p.group_size,
            p.seqlen_q, f.capacity, p.head_dim, p.head_dim_v, f.key_offset, left, right, p.scale,
            p.softcap or 0.0, has_sinks, f.q_varlen, f.kv_mode, f.align_br, f.page_size, f.total_q, f.total_k,
            f.num_pages, _seq_bucket(p)]
    grid_of = lambda bm, bn: (triton.cdiv(p.seqlen_q, bm), p.batch * p.heads_q)
    _launch("fwd", p, grid_of, args, bd, path)
    return out, lse


def _decode(p, x, f: Format, out, lse, bd, slopes_t, slope_strides, sinks_t, has_sinks) -> None:
    """Split-KV decode: one program per (split, batch, kv head, row chunk), then the combine kernel."""
    q, k, v = x.q, x.k, x.v
    fam = configs.family(p.vendor, p.arch)
    if p.device_type == "cpu":
        interpreter_fix.apply()
    cfg = configs.decode_config(fam, bd, DTYPE_NAMES[p.dtype])
    row_chunks = triton.cdiv(p.group_size * p.seqlen_q, configs.DECODE_BLOCK_R)
    programs = p.batch * p.heads_kv * row_chunks
    part_rows = lse.numel()
    if programs == 0 or part_rows == 0:
        return
    splits = configs.decode_splits(fam, _sm_count(q.device.type, q.device.index), programs, p.seqlen_k)
    if splits > 1:
        part_out = torch.empty((splits, part_rows, p.head_dim_v), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((splits, part_rows), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = lse  # not read or written with one split
    left, right = kernel_window(p)
    out_strides = _strides(out, p.q_format == "varlen")
    attn_decode[(splits, programs)](
        q, k, v, out, lse, part_out, part_lse, slopes_t, sinks_t, *f.index, *f.q_strides, *f.k_strides,
        *f.v_strides, *out_strides, *slope_strides, *f.lse_strides, f.stride_pt, p.heads_q, p.heads_kv,
        p.group_size, p.seqlen_q, f.capacity, p.head_dim, p.head_dim_v, f.key_offset, left, right, p.scale,
        p.softcap or 0.0, has_sinks, f.q_varlen, f.kv_mode, f.align_br, f.page_size, f.total_q, f.total_k,
        f.num_pages, splits, row_chunks, part_rows,
        BLOCK_R=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=bd, **cfg.options(fam))
    if splits == 1:
        return
    comb = configs.combine_config(fam)
    rows_per_head = f.total_q if f.q_varlen else p.seqlen_q
    decode_combine[(triton.cdiv(part_rows, comb.block_m), triton.cdiv(p.head_dim_v, comb.block_n))](
        out, lse, part_out, part_lse, sinks_t, *out_strides, p.heads_q, rows_per_head, part_rows, p.head_dim_v,
        splits, has_sinks, BLOCK_R=comb.block_m, BLOCK_D=comb.block_n, **comb.options(fam))


def _paged_as_cache(p, x):
    """A paged call as a cache call: each sequence's pages gathered into (B, Hkv, capacity, D), and the
    pool rows they came from (B * capacity), for the backward (which scatters gradients back)."""
    k, v, table = x.k, x.v, x.page_table
    batch, max_pages = table.shape
    ps = p.page_size
    pages = table.long().clamp(0, max(k.shape[0] - 1, 0))
    rows = (pages[:, :, None] * ps + torch.arange(ps, device=k.device)).reshape(batch, max_pages * ps)
    if k.shape[0] == 0:  # an empty pool: every length is 0, nothing is read
        rows = rows.clamp(max=0)
        gather = lambda t: t.new_zeros((batch, max_pages * ps) + t.shape[2:])
    else:
        gather = lambda t: t.flatten(0, 1)[rows]
    k_c, v_c = (gather(t).transpose(1, 2) for t in (k, v))
    return p._replace(kv_format="cache", page_size=None), x.replace(k=k_c, v=v_c, page_table=None), rows


@cache_fallback.survives_cache_errors
@interpreter_fix.serialised(attn_fwd)
def backward(p, x, out, lse, dout) -> Grads:
    if p.kv_format == "paged":
        p_c, x_c, rows = _paged_as_cache(p, x)
        g = backward(p_c, x_c, out, lse, dout)
        dk, dv = (torch.zeros_like(t) for t in (x.k, x.v))
        for pool, grad in ((dk, g.dk), (dv, g.dv)):
            if pool.numel():
                pool.flatten(0, 1).index_put_((rows.flatten(),), grad.transpose(1, 2).flatten(0, 1), accumulate=True)
        return Grads(g.dq, dk, dv, g.dmask, g.dsinks)
    q, k, v, mask = x.q, x.k, x.v, x.mask
    bd, path, mask_t, mask_strides, slopes_t, slope_strides = _common(p, q, mask, x.alibi_slopes)
    f = format_args(p, x)
    varlen_q = p.q_format == "varlen"
    # lse includes the sink, so P (hence dq, dk, dv) needs nothing more from it
    lse = lse.float().contiguous()
    delta = torch.empty_like(lse)
    if p.device_type == "cpu":
        interpreter_fix.apply()
    out_strides, dout_strides = _strides(out, varlen_q), _strides(dout, varlen_q)
    pre_grid = (triton.cdiv(p.seqlen_q, configs.PREPROCESS_BLOCK_M), p.batch * p.heads_q)
    if 0 not in pre_grid:
        bwd_preprocess[pre_grid](out, dout, delta, f.index[0], *out_strides, *dout_strides, *f.lse_strides,
                                 p.heads_q, p.seqlen_q, p.head_dim_v, f.q_varlen, f.total_q,
                                 BLOCK_M=configs.PREPROCESS_BLOCK_M, BLOCK_D=bd)

    # packed and cache formats may leave rows no sequence covers (cache keys past a length): zeros there
    alloc = torch.empty_like if p.is_dense else torch.zeros_like
    dq, dk, dv = alloc(q), alloc(k), alloc(v)
    store_dmask = int(p.mask_requires_grad)
    # keys outside a query's window are never visited, so their mask gradient must start at 0
    dmask_full = (torch.zeros((p.batch, p.heads_q, p.seqlen_q, p.seqlen_k), dtype=torch.float32, device=q.device)
                  if store_dmask else torch.empty(1, dtype=torch.float32, device=q.device))
    left, right = kernel_window(p)
    tail = [p.head_dim, p.head_dim_v, f.key_offset, left, right, p.scale, p.softcap or 0.0]
    fmt = [f.q_varlen, f.kv_mode, f.align_br, f.total_q, f.total_k, _seq_bucket(p)]
    kv_packed = f.kv_mode == 1
    args = [q, k, v, dout, lse, delta, dk, dv, mask_t, slopes_t, dmask_full, *f.index[:3], *f.q_strides,
            *f.k_strides, *f.v_strides, *dout_strides, *_strides(dk, kv_packed), *_strides(dv, kv_packed),
            *mask_strides, *slope_strides, *f.lse_strides, p.heads_q, p.heads_kv, p.group_size, p.seqlen_q,
            p.seqlen_k, *tail, store_dmask, *fmt]
    _launch("bwd_dkdv", p, lambda bm, bn: (triton.cdiv(p.seqlen_k, bn), p.batch * p.heads_kv), args, bd, path)
    args = [q, k, v, dout, lse, delta, dq, mask_t, slopes_t, *f.index[:3], *f.q_strides, *f.k_strides,
            *f.v_strides, *dout_strides, *_strides(dq, varlen_q), *mask_strides, *slope_strides, *f.lse_strides,
            p.heads_q, p.group_size, p.seqlen_q, p.seqlen_k, *tail, *fmt]
    _launch("bwd_dq", p, lambda bm, bn: (triton.cdiv(p.seqlen_q, bm), p.batch * p.heads_q), args, bd, path)
    dmask = sum_to_shape(dmask_full, p.mask_shape).to(mask.dtype) if store_dmask else None
    dsinks = None
    if x.sinks is not None:  # (no query row at all: sinks_grad cannot reshape an empty lse; the sum is 0)
        dsinks = sinks_grad(x.sinks, lse, delta) if lse.numel() else torch.zeros_like(x.sinks, dtype=torch.float32)
    return Grads(dq, dk, dv, dmask, dsinks)
