"""Launcher of the forwards built for packed (varlen) q and k/v: the Hopper one (kernels/sm90/fa_fwd.cu,
VARLEN=1: TMA and wgmma) on sm_90 where cuda-bindings encodes its tensor maps, else the Ampere one
(kernels/sm80/fa_fwd.cu, VARLEN=1: cp.async and mma.sync), which every family can run.

Dispatched: `CudaBackend` declares ("varlen", "varlen") for the forward and sends those problems here
(`varlen_reasons` from `extra_reasons`, `forward`); `CudaBackend.rank` places the Hopper kernel above
triton and the Ampere one below it. Checked on the H200 2026-12-02 (`python -m benchmarks.cuda_varlen
check`, both kernels: 49/49 against float64, compute-sanitizer memcheck clean on garbage cu_seqlens).
Speed there (bf16, 16k packed tokens, `time --hopper`): the Hopper kernel 0.98-1.03x the dense Hopper
forward's TFLOP/s (0.88x for 16 x 1k causal sequences at d128) and 0.99-1.74x triton's varlen kernel; the
Ampere one 0.71-0.86x triton's (NOTES.md "Varlen forward", "Hopper varlen forward").

Gradients (`backward`): the Ampere backward built for packed sequences (kernels/sm80/fa_bwd.cu, VARLEN=1), on
both families; delta, lse and the fp32 dQ accumulator are (Hq, total_q[, D]); not deterministic (dQ
through atomics), so deterministic problems decline.

The kernel takes the usual `AttnParams` (packed tensors: batch strides 0) and a `VarlenParams` record
(cu_seqlens pointers, the packed lengths, the alignment). The grid is B x Hq x the query blocks of the
longest sequence (`Problem.seqlen_q`, i.e. max_seqlen_q); a block past its sequence's end exits. The
kernel clamps every cu_seqlens value into [0, total], so no index value reads or writes outside the
buffers; rows that no (clamped) sequence covers are left as they are (bad cu_seqlens: wrong numbers,
as documented for triton).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import numpy as np
import torch

from attnx.autograd import alloc_out
from attnx.errors import InvalidArgumentError
from attnx.inputs import Grads, Inputs, sinks_grad
from attnx.limits import MAX_SEQLEN, lse_log2

from .families import AMPERE, family_for, nvrtc_arch
from . import launch
from .launch import _check_grid, _common, _strides_ok, _vector, kernel_operand, round8, score_mod
from .params import pack_params
from . import tensor_maps
from .variants import (Variant, forward_rounds_rescale, head_dim_tile, hopper_varlen_variant, max_shared,
                       varlen_backward_variants, varlen_forward_variant)

# common/varlen.cuh VarlenParams: 8-byte fields, then 4-byte fields, in the C order
VARLEN_PARAMS_DTYPE = np.dtype([("cu_seqlens_q", np.uint64), ("cu_seqlens_k", np.uint64), ("total_q", np.int32),
                                ("total_k", np.int32), ("align_br", np.int32)], align=True)


def pack_varlen_params(**values):
    """A by-value `VarlenParams` argument; fields not given are zero."""
    record = np.zeros((), VARLEN_PARAMS_DTYPE)
    for name, value in values.items():
        record[name] = value
    return record[()]


def hopper_runs(p) -> bool:
    """Whether `p`'s GPU runs the Hopper varlen forward: a family with TMA maps, and cuda-bindings to encode them."""
    family = family_for(p.capability)
    return family is not None and family.tensor_maps and tensor_maps.tensor_maps_available()


@functools.lru_cache(maxsize=1024)
def varlen_variant_for(p) -> Optional[Variant]:
    """The VARLEN=1 forward for `p` on its GPU (`hopper_runs`: the Hopper tile set; else the Ampere one), or
    None. With EXACT_ALPHA from `EXACT_ALPHA_MIN_KEYS` keys in the longest sequence, as the dense launchers
    (the fused rescale's lse drift passes 1e-3 near 1M keys; NVRTC: same spills as without it; not run on a
    GPU yet, the H200 check's sequences are shorter)."""
    family = family_for(p.capability)
    if family is None:
        return None
    hopper = hopper_runs(p)
    tile = head_dim_tile(round8(p.head_dim), round8(p.head_dim_v), family if hopper else AMPERE, "fwd")
    if tile is None:
        return None
    build = hopper_varlen_variant if hopper else varlen_forward_variant
    v = build(p.dtype == torch.bfloat16, tile, score_mod(p), max_shared(p.capability))
    return v._replace(exact_alpha=True) if v is not None and forward_rounds_rescale(p.seqlen_k) else v


def varlen_reasons(p) -> list[str]:
    """Why the kernel cannot run `p` (an empty list: it can): `CudaBackend.extra_reasons` for packed problems.

    Its limits are a head-dim tile (`varlen_variant_for`; every tile up to 256 fits on every covered GPU) and
    one launch's grid, B x Hq x ceil(max_seqlen_q / block_m) <= MAX_GRID. Without cuda-bindings sm_90 runs
    the Ampere kernel, so no reason comes from TMA. Gradients: a backward tile, not deterministic, no ALiBi
    yet. Formats, masks and dtypes are the backend's declarations too; they are repeated here for callers
    that ask this function alone (`prepare`, which the benchmarks call directly)."""
    reasons = []
    if (p.q_format, p.kv_format) != ("varlen", "varlen"):
        reasons.append(f"the varlen kernel takes packed q and k/v, got q {p.q_format}, kv {p.kv_format}")
    if p.needs_grad and p.deterministic:
        reasons.append("the varlen backward adds dQ with atomics: no deterministic varlen backward")
    elif p.needs_grad and varlen_backward_for(p) is None:
        reasons.append(f"no varlen backward tile for head dims {p.head_dim}/{p.head_dim_v} on {p.arch}")
    if p.mask_kind is not None:
        reasons.append("the varlen kernel takes no mask tensor")
    if p.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"the varlen kernel runs float16/bfloat16, got {p.dtype}")
    variant = varlen_variant_for(p)
    if variant is None:
        reasons.append(f"no varlen forward tile for head dims {p.head_dim}/{p.head_dim_v} on {p.arch}")
    elif p.batch * p.heads_q * math.ceil(p.seqlen_q / variant.block_m) > launch.MAX_GRID:
        reasons.append("too many query blocks for one launch (sequences x heads x blocks of the longest)")
    return reasons


@functools.lru_cache(maxsize=1024)
def varlen_backward_for(p) -> Optional[tuple]:
    """The passes of the VARLEN=1 Ampere backward for `p` on its GPU (`variants.varlen_backward_variants`), or None."""
    family = family_for(p.capability)
    if family is None:
        return None
    tile = head_dim_tile(round8(p.head_dim), round8(p.head_dim_v), family, "bwd")
    return varlen_backward_variants(family, p.dtype == torch.bfloat16, tile, score_mod(p), max_shared(p.capability))


def runs_varlen(p) -> bool:
    """Whether this kernel runs `p` (`CudaBackend.forward` sends every packed-q problem here)."""
    return not varlen_reasons(p)


class VarlenLaunch(NamedTuple):
    """Everything one varlen forward launches, prepared on the host (no GPU needed to build it)."""
    variant: Variant
    args: np.void        # AttnParams
    varlen: np.void      # VarlenParams
    grid: int            # B x Hq x query blocks of the longest sequence
    out: torch.Tensor    # (total_q, Hq, Dv)
    out_k: torch.Tensor  # what the kernel writes (out itself when it can): (total_q, Hq, round8(Dv))
    lse: torch.Tensor    # (Hq, total_q)
    keep: tuple          # tensors the records point into


def _packed_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, head, row) strides of a packed (total, H, D) tensor: no batch dim (0); 0 for dims of size 1."""
    return 0, t.stride(1) if t.shape[1] > 1 else 0, t.stride(0) if t.shape[0] > 1 else 0


def _index(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def prepare(p, x: Inputs, *, variant: Optional[Variant] = None) -> VarlenLaunch:
    """The launch of one varlen forward on backend-view inputs `x`; `variant` overrides the tile. Builds the
    outputs and both records; launches nothing."""
    reasons = [r for r in varlen_reasons(p) if variant is None or "tile" not in r]
    if reasons:
        raise InvalidArgumentError("; ".join(reasons))
    variant = variant or varlen_variant_for(p)
    d, dv = round8(p.head_dim), round8(p.head_dim_v)
    total_q, total_k = x.q.shape[0], x.k.shape[0]
    if max(total_q, total_k) >= MAX_SEQLEN:  # the kernel's positions (and per-sequence offsets) are int32
        raise InvalidArgumentError(f"packed lengths {total_q}/{total_k} at or above {MAX_SEQLEN}")
    q, k, v = kernel_operand(x.q, d), kernel_operand(x.k, d), kernel_operand(x.v, dv)
    if total_k == 0:  # no keys anywhere: one zero row the kernel never reads (a TMA map cannot be empty)
        k, v = k.new_zeros(1, *k.shape[1:]), v.new_zeros(1, *v.shape[1:])
    x = x.replace(alibi_slopes=_vector(x.alibi_slopes), sinks=_vector(x.sinks))
    out = alloc_out(p, q)
    out_k = out if (dv == p.head_dim_v and _strides_ok(out) and out.data_ptr() % 16 == 0) else \
        q.new_empty(total_q, p.heads_q, dv)
    lse = torch.empty(p.heads_q, total_q, device=q.device, dtype=torch.float32)
    cu_q, cu_k = _index(x.cu_seqlens_q), _index(x.cu_seqlens_k)

    blocks_per_head = math.ceil(p.seqlen_q / variant.block_m)
    grid = p.batch * p.heads_q * blocks_per_head
    _check_grid(grid)
    (qb, qh, qr), (kb, kh, kr), (vb, vh, vr), (ob, oh, orow) = map(_packed_strides, (q, k, v, out_k))
    fields = _common(p, x)
    fields["key_offset"] = p.offset if p.offset is not None else 0  # (align_br adds Sk_b - Sq_b per sequence)
    args = pack_params(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), o=out_k.data_ptr(), lse=lse.data_ptr(),
                       q_bs=qb, q_hs=qh, q_rs=qr, k_bs=kb, k_hs=kh, k_rs=kr, v_bs=vb, v_hs=vh, v_rs=vr,
                       o_bs=ob, o_hs=oh, o_rs=orow, num_blocks=blocks_per_head, **fields)
    varlen = pack_varlen_params(cu_seqlens_q=cu_q.data_ptr(), cu_seqlens_k=cu_k.data_ptr(), total_q=total_q,
                                total_k=total_k, align_br=int(p.offset is None))
    keep = tuple(t for t in (q, k, v, out_k, lse, cu_q, cu_k, x.alibi_slopes, x.sinks) if t is not None)
    return VarlenLaunch(variant, args, varlen, grid, out, out_k, lse, keep)


def hopper_maps(plan: VarlenLaunch) -> tuple:
    """The Hopper varlen forward's TMA maps (`variants.hopper_varlen_variant`): q, k, v and out as
    (1, H, total, D) views of the packed tensors (out's map stores the 64-row groups inside a sequence; the
    kernel stores a sequence's last rows one by one). TMA needs 16-byte aligned rows and heads: `kernel_operand` copies what is
    not, and a head dim below 8 is padded, as for the dense Hopper launcher."""
    q, k, v, out_k = plan.keep[:4]
    views = [t.unsqueeze(0).transpose(1, 2) for t in (q, k, v, out_k)]
    bad = [name for name, t in zip("qkvo", views) if not tensor_maps.operand_ok(t)]
    if bad:
        raise InvalidArgumentError(f"the Hopper varlen forward cannot read {', '.join(bad)} through TMA "
                                   "(a stride or the base not 16-byte aligned)")
    rows = plan.variant.block_m
    return (tensor_maps.tensor_map(views[0], rows), tensor_maps.tensor_map(views[1], plan.variant.block_n),
            tensor_maps.tensor_map(views[2], plan.variant.block_n), tensor_maps.tensor_map(views[3], rows // 2))


def forward(p, x: Inputs, *, variant: Optional[Variant] = None, poison: bool = False):
    """(out (total_q, Hq, Dv), lse (Hq, total_q)) of one varlen forward; `poison` fills both with NaN first,
    so an element the kernel fails to write shows up in a check."""
    from .compile import get_kernel
    from .launch import _device_index, _launch

    device_index = _device_index(x.q)
    plan = prepare(p, x, variant=variant)
    if poison:
        plan.out_k.fill_(float("nan"))
        plan.lse.fill_(float("nan"))
    if plan.grid > 0:
        kernel = get_kernel(plan.variant, nvrtc_arch(p.capability), device_index)
        operands = (plan.args, *hopper_maps(plan), plan.varlen) if plan.variant.hopper_forward else \
            (plan.args, plan.varlen)
        _launch(kernel, plan.grid, plan.variant.threads, plan.variant.shared_bytes(), operands, device_index)
    if plan.out_k is not plan.out:
        plan.out.copy_(plan.out_k[..., : p.head_dim_v])
    return plan.out, plan.lse


def backward(p, x: Inputs, out, lse, dout) -> Grads:
    """Gradients of one varlen call (`out`, `dout` (total_q, Hq, Dv), `lse` (Hq, total_q)): the Ampere backward
    built for packed sequences, dQ through fp32 atomics into (Hq, total_q, D); dsinks from lse and delta.
    Rows of k/v no sequence covers get zero gradients."""
    from .compile import get_kernel
    from .launch import _device_index, _launch

    reasons = varlen_reasons(p)
    if reasons:
        raise InvalidArgumentError("; ".join(reasons))
    passes = varlen_backward_for(p)
    device_index = _device_index(x.q)
    d, dvw = round8(p.head_dim), round8(p.head_dim_v)
    total_q, total_k = x.q.shape[0], x.k.shape[0]
    if max(total_q, total_k) >= MAX_SEQLEN:
        raise InvalidArgumentError(f"packed lengths {total_q}/{total_k} at or above {MAX_SEQLEN}")
    q, k, v, dout_k = (kernel_operand(x.q, d), kernel_operand(x.k, d), kernel_operand(x.v, dvw),
                       kernel_operand(dout, dvw))
    delta = (dout.float() * out.float()).sum(-1).t().contiguous()  # rowsum(dout * out), (Hq, total_q)
    lse2 = lse_log2(lse).contiguous()
    dq_accum = torch.zeros(p.heads_q, total_q, d, device=q.device, dtype=torch.float32)
    dk = torch.zeros(total_k, p.heads_kv, d, device=q.device, dtype=q.dtype)
    dv = torch.zeros(total_k, p.heads_kv, dvw, device=q.device, dtype=q.dtype)
    xk = x.replace(alibi_slopes=_vector(x.alibi_slopes), sinks=None)
    blocks_per_head = math.ceil(p.seqlen_k / passes[0].block_n)  # of the longest sequence's keys
    grid = p.batch * p.heads_kv * blocks_per_head
    _check_grid(grid)
    (qb, qh, qr), (kb, kh, kr), (vb, vh, vr), (ob, oh, orow), (dkb, dkh, dkr), (dvb, dvh, dvr) = map(
        _packed_strides, (q, k, v, dout_k, dk, dv))
    fields = _common(p, xk)
    fields["key_offset"] = p.offset if p.offset is not None else 0
    args = pack_params(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), dout=dout_k.data_ptr(), lse=lse2.data_ptr(),
                       delta=delta.data_ptr(), dq_accum=dq_accum.data_ptr(), dk=dk.data_ptr(), dv=dv.data_ptr(),
                       q_bs=qb, q_hs=qh, q_rs=qr, k_bs=kb, k_hs=kh, k_rs=kr, v_bs=vb, v_hs=vh, v_rs=vr,
                       o_bs=ob, o_hs=oh, o_rs=orow, dk_bs=dkb, dk_hs=dkh, dk_rs=dkr, dv_bs=dvb, dv_hs=dvh, dv_rs=dvr,
                       num_blocks=blocks_per_head, dq_row=d, **fields)
    cu_q, cu_k = _index(x.cu_seqlens_q), _index(x.cu_seqlens_k)  # (held until the launches are queued)
    varlen = pack_varlen_params(cu_seqlens_q=cu_q.data_ptr(), cu_seqlens_k=cu_k.data_ptr(), total_q=total_q,
                                total_k=total_k, align_br=int(p.offset is None))
    if grid > 0:
        arch = nvrtc_arch(p.capability)
        for variant in passes:
            kernel = get_kernel(variant, arch, device_index)
            _launch(kernel, grid, variant.threads, variant.shared_bytes(), (args, varlen), device_index)
    dq = (dq_accum[..., : p.head_dim] * p.scale).transpose(0, 1).to(p.dtype)
    dsinks = sinks_grad(x.sinks, lse, delta) if x.sinks is not None else None
    return Grads(dq, dk[..., : p.head_dim], dv[..., : p.head_dim_v], None, dsinks)
