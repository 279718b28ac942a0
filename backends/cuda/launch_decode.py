"""Launcher of the cuda backend's split-KV decode forward (kernels/sm80/fa_decode.cu, both families).

`CudaBackend` runs it for every forward-only call it accepts with cache or paged keys, and for dense
calls of up to `MAX_SEQLEN_Q` queries (`runs_decode`); `decode_reasons` declines what it cannot do.
Checked on the H200 2026-12-02 (`python -m benchmarks.cuda_decode check`: 118/118 cases; sanitizer
clean; timings in benchmarks/results/h200-2026-12-02, backends/cuda/NOTES.md "Split-KV decode").

One kernel block per (split, batch, kv head, 16 rows of the GQA group's heads x queries); splits
write float32 partials that `attnx_decode_combine` merges (as `attnx.merge`; one block per row), or, with
`Variant.fused_combine`, the last block of each program to finish (arrival counters after the partial lse,
zeroed here before each launch). The number of splits
follows FlashAttention-2's heuristic (fill the GPU's block slots) from the SM count and the cache
capacity, so a decoding loop over one cache keeps one decision. Everything the kernels index with
is checked or clamped here or in the kernel: lengths to [0, capacity], page entries to
[0, num_pages), tensors the kernel cannot read in place are copied (`launch.kernel_operand`).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import numpy as np
import torch

from attnx.autograd import alloc_out
from attnx.errors import InvalidArgumentError
from attnx.inputs import Inputs
from attnx.limits import kernel_window

from .families import family_for, nvrtc_arch
from .launch import (MAX_GRID, _check_grid, _strides, _strides_ok, _vector, family_tile, kernel_operand, round8,
                     score_mod)
from .variants import DECODE_BLOCK_KEYS, Variant, decode_combine_variant, decode_variants, max_shared

MAX_SEQLEN_Q = 16     # query rows per sequence the kernel is built for (one 16-row mma tile per head)
ROWS_PER_BLOCK = 16   # rows of the GQA group (heads x queries) per kernel block
MAX_SPLITS = 128
MIN_SPLIT_KEYS = 256  # fewer keys per split than this cost more in the combine than they gain
FILL = 0.8            # no split once the blocks fill this much of one wave
ONE_WAVE = 0.95       # splits that fill one wave this much win over fewer (H200, 2026-12-02, B = 1, 8 kv heads:
#                       33 splits = 264 blocks on 264 slots beat the 85 % rule's 29 by 1-4 %, contiguous and paged)

# the kernels' DecodeParams (fa_decode.cu): 8-byte fields, then 4-byte fields, in the C order
_POINTERS = ("q", "k", "v", "o", "lse", "part_o", "part_lse", "alibi", "sinks", "seqlens_k", "page_table")
_STRIDES = ("q_bs", "q_hs", "q_rs", "k_bs", "k_hs", "k_rs", "v_bs", "v_hs", "v_rs", "o_bs", "o_hs", "o_rs",
            "alibi_bs", "alibi_hs", "pt_bs")
_INTS = ("batch", "heads_q", "heads_kv", "group", "seqlen_q", "capacity", "head_dim", "head_dim_v",
         "window_left", "window_right", "key_offset", "align_br", "page_size", "num_pages", "page_shift",
         "row_chunks", "splits", "split_keys", "rows")
_FLOATS = ("scale", "scale_log2", "softcap", "softcap_inv")
DECODE_PARAMS_DTYPE = np.dtype([(n, np.uint64) for n in _POINTERS] + [(n, np.int64) for n in _STRIDES]
                               + [(n, np.int32) for n in _INTS] + [(n, np.float32) for n in _FLOATS], align=True)


_FIELDS = DECODE_PARAMS_DTYPE.names


def pack_decode_params(**values):
    """A by-value `DecodeParams` argument; fields not given are zero (null pointers). Built from one tuple
    in field order (a decode step's host time is mostly this launcher)."""
    unknown = values.keys() - set(_FIELDS)
    if unknown:
        raise KeyError(f"no DecodeParams fields {sorted(unknown)}")
    return np.array(tuple(values.get(name, 0) for name in _FIELDS), DECODE_PARAMS_DTYPE)[()]


def blocks_per_sm(variant: Variant, capability) -> int:
    """Decode blocks one SM holds at once (shared memory bound; registers allow more)."""
    return max(1, min(4, max_shared(capability) // (variant.shared_bytes() + 1024)))


def num_splits(programs: int, slots: int, capacity: int, split_unit: int) -> int:
    """Key splits for `programs` blocks over `capacity` keys on `slots` block slots (FlashAttention-2's
    `num_splits_heuristic`, and one wave first): none once the blocks fill `FILL` of a wave; the splits
    that fill one wave to `ONE_WAVE` when there are such; all it may take (up to `MAX_SPLITS`, at least
    `MIN_SPLIT_KEYS` keys each) when even those stay inside one wave (short keys at small batches: every
    split is parallelism no tail pays for; the H200 at B = 1, 4k: 16 splits 1.04-1.10x faster than the 13
    the 85 % rule gave, run 14); otherwise the fewest whose last wave is >= 85 % as full as the best."""
    if programs <= 0 or programs >= FILL * slots:
        return 1
    most = max(1, min(MAX_SPLITS, capacity // max(MIN_SPLIT_KEYS, split_unit)))
    one_wave = min(most, slots // programs)
    if programs * one_wave >= ONE_WAVE * slots or programs * most <= slots:
        return one_wave
    eff = []
    for s in range(1, most + 1):
        waves = programs * s / slots
        eff.append(waves / math.ceil(waves))
    best = max(eff)
    return next(s for s, e in enumerate(eff, start=1) if e >= 0.85 * best)


def page_shift(page_size: int) -> int:
    """log2(page_size) for powers of two (the kernel then shifts instead of dividing), else -1."""
    return page_size.bit_length() - 1 if page_size > 0 and page_size & (page_size - 1) == 0 else -1


def runs_decode(p) -> bool:
    """Whether `CudaBackend` runs `p` on this kernel: cache and paged keys always (the forward kernels
    take dense keys only), dense ones for forward-only calls of at most `MAX_SEQLEN_Q` queries, where
    one 128-query tile per head would waste most of its rows."""
    if p.kv_format != "dense":
        return True
    return (not p.needs_grad and p.q_format == "dense" and p.mask_kind is None and 1 <= p.seqlen_q <= MAX_SEQLEN_Q
            and decode_variant_for(p) is not None)


def decode_reasons(p) -> list[str]:
    """Why the kernel cannot run `p` with cache or paged keys (the backend's declarations cover dtype,
    masks, q's format and the backward: `CudaBackend.backward_formats`)."""
    reasons = []
    if p.seqlen_q > MAX_SEQLEN_Q:
        reasons.append(f"cache and paged keys take at most {MAX_SEQLEN_Q} queries per sequence here "
                       f"(the decode kernel's tile), got {p.seqlen_q}")
    elif p.batch * p.heads_kv * -(-(p.group_size * p.seqlen_q) // ROWS_PER_BLOCK) > MAX_GRID:
        reasons.append("too many decode blocks for one launch")
    if decode_variant_for(p) is None:
        reasons.append(f"no decode tile for head dims {p.head_dim}/{p.head_dim_v} on {p.arch}")
    return reasons


def ring_format(p) -> str:
    """The key format the decode kernel's K/V ring is declared for (`variants.DECODE_KV_BULK`,
    `DECODE_KV_SWIZZLE`): `p.kv_format`, except pools whose pages do not hold whole key blocks ("paged-rows":
    the kernel looks up a page per key there)."""
    if p.kv_format == "paged" and (p.page_size or 0) % DECODE_BLOCK_KEYS:
        return "paged-rows"
    return p.kv_format


@functools.lru_cache(maxsize=1024)
def decode_candidates_for(p) -> tuple:
    """The decode kernels `pick_decode_variant` chooses among for `p`, best first (empty: no tile)."""
    found = family_tile(p, "decode")
    if found is None:
        return ()
    family, tile = found
    return tuple(decode_variants(family, p.dtype == torch.bfloat16, tile, score_mod(p), max_shared(p.capability),
                                 ring_format(p)))


def decode_variant_for(p) -> Optional[Variant]:
    """The first decode candidate for `p` (whether the kernel has a tile for it), or None."""
    found = decode_candidates_for(p)
    return found[0] if found else None


WAVE_TIE = 0.05  # candidates whose grids fill the block slots within this of the best count as equal


@functools.lru_cache(maxsize=1024)
def pick_decode_variant(p, capacity: int, sm_count: int, splits: Optional[int]) -> Optional[Variant]:
    """The candidate whose grid (after its key splits) fills the GPU's block slots best -- the fraction of
    the slots its waves occupy, the last one included -- the earlier one on ties: fewer stages (more
    blocks per SM) where splits can fill a wave, more stages where a large batch leaves a tail."""
    found = decode_candidates_for(p)
    if len(found) < 2:
        return found[0] if found else None
    fills = []
    for v in found:
        grid = _split_plan(p, v, capacity, sm_count, splits)[3]
        slots = sm_count * blocks_per_sm(v, p.capability)
        fills.append(grid / (math.ceil(grid / slots) * slots) if grid else 1.0)
    best = max(fills)
    return next(v for v, fill in zip(found, fills) if fill >= best - WAVE_TIE)


class DecodeLaunch(NamedTuple):
    """Everything one decode call launches, prepared on the host (no GPU needed to build it)."""
    variant: Variant
    combine: Optional[Variant]  # None with one split or a fused combine
    args: np.void               # DecodeParams
    grid: int                   # decode blocks: splits x batch x kv heads x row chunks
    combine_grid: int
    splits: int
    out: torch.Tensor           # in the caller's layout (a bhsd view)
    out_k: torch.Tensor         # what the kernels write (out itself when it can)
    lse: torch.Tensor
    keep: tuple                 # tensors the record points into


def _check(p) -> None:
    if p.q_format != "dense" or p.kv_format not in ("dense", "cache", "paged"):
        raise InvalidArgumentError(f"the decode kernel takes dense q with dense, cache or paged keys, got "
                                   f"q {p.q_format}, kv {p.kv_format}")
    if p.mask_kind is not None:
        raise InvalidArgumentError("the decode kernel takes no mask tensor")
    if p.dtype not in (torch.float16, torch.bfloat16):
        raise InvalidArgumentError(f"the decode kernel runs float16/bfloat16, got {p.dtype}")
    if not 0 <= p.seqlen_q <= MAX_SEQLEN_Q:  # 0 queries against a cache: empty outputs, nothing launched
        raise InvalidArgumentError(f"the decode kernel takes 0..{MAX_SEQLEN_Q} queries, got {p.seqlen_q}")


@functools.lru_cache(maxsize=1024)
def _split_plan(p, variant: Variant, capacity: int, sm_count: int, splits: Optional[int]):
    """(row chunks, splits, keys per split, grid, combine variant or None): a decode loop over one cache asks
    the same question every layer and step, so the answer is kept."""
    row_chunks = -(-(p.group_size * p.seqlen_q) // ROWS_PER_BLOCK)
    programs = p.batch * p.heads_kv * row_chunks
    unit = variant.warps * variant.block_n  # a split is whole rounds of every warp's key block
    if splits is None:
        splits = num_splits(programs, sm_count * blocks_per_sm(variant, p.capability), capacity, unit)
    splits = max(1, min(int(splits), MAX_SPLITS, max(1, -(-capacity // unit)), max(1, MAX_GRID // max(programs, 1))))
    split_keys = -(-max(capacity, 1) // splits)
    split_keys = -(-split_keys // unit) * unit
    splits = max(1, -(-capacity // split_keys))
    grid = splits * programs
    _check_grid(grid)
    separate = splits > 1 and not variant.fused_combine
    combine = decode_combine_variant(family_for(p.capability), p.dtype == torch.bfloat16) if separate else None
    return row_chunks, splits, split_keys, grid, combine


def prepare(p, x: Inputs, sm_count: int, *, splits: Optional[int] = None,
            variant: Optional[Variant] = None) -> DecodeLaunch:
    """The launches of one decode call on backend-view inputs `x` (see `attnx.inputs.Inputs`).

    `splits` overrides the heuristic (checks run both paths), `variant` the tile table. Builds the
    outputs, the workspace and the parameter record; launches nothing.
    """
    _check(p)
    if variant is None and decode_variant_for(p) is None:
        raise InvalidArgumentError(f"no decode tile for head dims {p.head_dim}/{p.head_dim_v} on {p.arch}")
    d, dv = round8(p.head_dim), round8(p.head_dim_v)
    q, k, v = kernel_operand(x.q, d), kernel_operand(x.k, d), kernel_operand(x.v, dv)
    slopes, sinks = _vector(x.alibi_slopes), _vector(x.sinks)
    out = alloc_out(p, q)
    out_k = out if (dv == p.head_dim_v and _strides_ok(out) and out.data_ptr() % 16 == 0) else \
        q.new_empty(p.batch, p.heads_q, p.seqlen_q, dv)
    lse = torch.empty(p.batch, p.heads_q, p.seqlen_q, device=q.device, dtype=torch.float32)

    fields = {}
    keep = [q, k, v, out_k, lse]
    if p.kv_format == "paged":
        # pools (num_pages, page_size, Hkv, D): page, head, row-in-page strides (0 for dims of size 1)
        num_pages = k.shape[0]
        table = x.page_table if x.page_table.stride(-1) == 1 else x.page_table.contiguous()
        keep.append(table)
        kb, kr, kh = (s if n > 1 else 0 for s, n in zip(k.stride()[:3], k.shape[:3]))
        vb, vr, vh = (s if n > 1 else 0 for s, n in zip(v.stride()[:3], v.shape[:3]))
        capacity = table.shape[1] * p.page_size if num_pages > 0 else 0
        fields.update(page_table=table.data_ptr(), pt_bs=table.stride(0) if table.shape[0] > 1 else 0,
                      page_size=p.page_size, num_pages=num_pages, page_shift=page_shift(p.page_size))
    else:
        (kb, kh, kr), (vb, vh, vr) = _strides(k), _strides(v)
        capacity = k.shape[2]
    if x.seqlens_k is not None:
        lengths = x.seqlens_k.to(torch.int32).contiguous()
        keep.append(lengths)
        fields.update(seqlens_k=lengths.data_ptr())
    if slopes is not None:
        fields.update(alibi=slopes.data_ptr(), alibi_bs=slopes.stride(0) if p.batch > 1 else 0,
                      alibi_hs=slopes.stride(1))
        keep.append(slopes)
    if sinks is not None:
        fields.update(sinks=sinks.data_ptr())
        keep.append(sinks)

    rows = p.batch * p.heads_q * p.seqlen_q
    variant = variant or pick_decode_variant(p, capacity, sm_count, splits)
    row_chunks, splits, split_keys, grid, combine = _split_plan(p, variant, capacity, sm_count, splits)
    if splits > 1:
        part_o = torch.empty(splits, rows, dv, device=q.device, dtype=torch.float32)
        if variant.fused_combine:  # + one arrival counter per program (int32 bits), zero before the launch
            programs = grid // splits
            part_lse = torch.empty(splits * rows + programs, device=q.device, dtype=torch.float32)
            part_lse[splits * rows:].zero_()
        else:
            part_lse = torch.empty(splits, rows, device=q.device, dtype=torch.float32)
        keep += [part_o, part_lse]
        fields.update(part_o=part_o.data_ptr(), part_lse=part_lse.data_ptr())

    left, right = kernel_window(p)
    (qb, qh, qr), (ob, oh, orow) = _strides(q), _strides(out_k)
    align_br = int(p.offset is None and p.kv_format != "dense")
    args = pack_decode_params(
        q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), o=out_k.data_ptr(), lse=lse.data_ptr(),
        q_bs=qb, q_hs=qh, q_rs=qr, k_bs=kb, k_hs=kh, k_rs=kr, v_bs=vb, v_hs=vh, v_rs=vr,
        o_bs=ob, o_hs=oh, o_rs=orow, batch=p.batch, heads_q=p.heads_q, heads_kv=p.heads_kv, group=p.group_size,
        seqlen_q=p.seqlen_q, capacity=capacity, head_dim=d, head_dim_v=dv, window_left=left, window_right=right,
        key_offset=p.key_offset if not align_br else 0, align_br=align_br, row_chunks=row_chunks, splits=splits,
        split_keys=split_keys, rows=rows, scale=p.scale, scale_log2=p.scale * 1.4426950408889634,
        softcap=p.softcap or 0.0, softcap_inv=1.0 / p.softcap if p.softcap else 0.0, **fields)
    combine_grid = rows if combine is not None else 0  # one block per row (none when fused)
    return DecodeLaunch(variant, combine, args, grid, combine_grid, splits, out, out_k, lse, tuple(keep))


def forward(p, x: Inputs, *, splits: Optional[int] = None, variant: Optional[Variant] = None,
            poison: bool = False):
    """(out, lse) of one decode call (backend-view inputs); `poison` fills out and lse with NaN first, so
    an element the kernels fail to write shows up in a check."""
    from .compile import get_kernel
    from .launch import _device_index, _launch

    device_index = _device_index(x.q)
    sm_count = torch.cuda.get_device_properties(device_index).multi_processor_count
    plan = prepare(p, x, sm_count, splits=splits, variant=variant)
    if poison:
        plan.out_k.fill_(float("nan"))
        plan.lse.fill_(float("nan"))
    if plan.grid > 0:
        arch = nvrtc_arch(p.capability)
        kernel = get_kernel(plan.variant, arch, device_index)
        _launch(kernel, plan.grid, plan.variant.threads, plan.variant.shared_bytes(), (plan.args,), device_index)
        if plan.combine is not None:
            combine = get_kernel(plan.combine, arch, device_index)
            _launch(combine, plan.combine_grid, plan.combine.threads, 0, (plan.args,), device_index)
    if plan.out_k is not plan.out:
        plan.out.copy_(plan.out_k[..., : p.head_dim_v])
    return plan.out, plan.lse
