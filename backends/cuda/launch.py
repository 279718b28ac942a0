"""Launcher: validates torch tensors, picks a specialisation, launches it on torch's stream.

Kernels read q/k/v/dout through (batch, head, row) strides with the last dim
contiguous; a tensor whose layout the kernels cannot read safely (last-dim stride
!= 1, strides or base not 16-byte aligned, head dim not a multiple of 8) is
copied into a zero-padded contiguous buffer first. Nothing is launched before
every pointer, stride and size has been checked, so no input makes a kernel read
or write out of bounds.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from attnx.autograd import alloc_out
from attnx.inputs import Grads, Inputs, sinks_grad
from attnx.limits import LOG2E, kernel_window, lse_log2

from .compile import get_kernel
from .families import family_for, nvrtc_arch
from .params import pack_params
from .variants import backward_variants, forward_rounds_rescale, forward_variant, head_dim_tile, max_shared

MAX_GRID = (1 << 31) - 1


def round8(n: int) -> int:
    return (n + 7) // 8 * 8


def _strides_ok(t: torch.Tensor) -> bool:
    """Last dim contiguous, every other stride (of a dim longer than 1) a multiple of 8 elements."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        return False
    return all(s % 8 == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)


def family_tile(p, kernel: str):
    """(family, head-dim tile) of `kernel` for problem `p`, or None where no family or tile has it (the
    family of p's GPU must list `kernel` among its sources)."""
    family = family_for(p.capability)
    if family is None or kernel not in family.sources:
        return None
    tile = head_dim_tile(round8(p.head_dim), round8(p.head_dim_v), family, kernel)
    return None if tile is None else (family, tile)


def kernel_operand(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` itself when the kernels can read it in place, else a contiguous copy zero-padded to `width`."""
    if t.shape[-1] == width and _strides_ok(t) and t.data_ptr() % 16 == 0:
        return t
    padded = t.new_zeros(*t.shape[:-1], width)
    padded[..., : t.shape[-1]].copy_(t)
    return padded


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, head, row) strides in elements, 0 for dims of size 1."""
    return tuple(s if n > 1 else 0 for s, n in zip(t.stride()[:3], t.shape[:3]))


def _vector(t):
    """A float32 vector the kernels index with unit stride in its last dim (or None)."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _common(p, x: Inputs) -> dict:
    left, right = kernel_window(p)
    fields = dict(batch=p.batch, heads_q=p.heads_q, heads_kv=p.heads_kv, group=p.group_size,
                  seqlen_q=p.seqlen_q, seqlen_k=p.seqlen_k, key_offset=p.key_offset, head_dim=round8(p.head_dim),
                  head_dim_v=round8(p.head_dim_v), window_left=left, window_right=right,
                  scale=p.scale, scale_log2=p.scale * LOG2E,
                  softcap=p.softcap or 0.0, softcap_inv=1.0 / p.softcap if p.softcap else 0.0)
    if x.alibi_slopes is not None:
        fields.update(alibi=x.alibi_slopes.data_ptr(), alibi_bs=x.alibi_slopes.stride(0) if p.batch > 1 else 0,
                      alibi_hs=x.alibi_slopes.stride(1))
    if x.sinks is not None:
        fields.update(sinks=x.sinks.data_ptr())
    return fields


def score_mod(p) -> bool:
    """The general score path: softcap, ALiBi, or a scale <= 0 (the fast path folds a positive scale into exp2)."""
    return p.softcap is not None or p.has_alibi or p.scale <= 0


_streams: dict = {}


def _launch(kernel, grid: int, threads: int, smem: int, args: tuple, device_index: int) -> None:
    """Launch on torch's current stream of the device; `args` are the kernel's by-value arguments."""
    import cupy

    handle = torch.cuda.current_stream(device_index).cuda_stream
    stream = _streams.get((handle, device_index))
    if stream is None:
        stream = _streams[(handle, device_index)] = cupy.cuda.ExternalStream(handle, device_index)
    with cupy.cuda.Device(device_index), stream:
        kernel((grid, 1, 1), (threads, 1, 1), args, shared_mem=smem)


def _check_grid(blocks: int) -> None:
    if blocks > MAX_GRID:
        raise ValueError(f"problem too large for one launch ({blocks} thread blocks)")


def _device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def forward(p, x: Inputs):
    """(out, lse) of one attention call; out in the caller's layout via alloc_out, lse including the sinks."""
    family = family_for(p.capability)
    if family.tensor_maps:
        from . import launch_sm90

        return launch_sm90.forward(p, x)
    device_index = _device_index(x.q)
    d, dv = round8(p.head_dim), round8(p.head_dim_v)
    variant = forward_variant(family, p.dtype == torch.bfloat16, head_dim_tile(d, dv, family, "fwd"), score_mod(p),
                              max_shared(p.capability), exact_alpha=forward_rounds_rescale(p.seqlen_k))
    q, k, v = kernel_operand(x.q, d), kernel_operand(x.k, d), kernel_operand(x.v, dv)
    x = x.replace(alibi_slopes=_vector(x.alibi_slopes), sinks=_vector(x.sinks))
    out = alloc_out(p, q)
    out_k = out if (dv == p.head_dim_v and _strides_ok(out) and out.data_ptr() % 16 == 0) else \
        q.new_empty(p.batch, p.heads_q, p.seqlen_q, dv)
    lse = torch.empty(p.batch, p.heads_q, p.seqlen_q, device=q.device, dtype=torch.float32)
    blocks_per_head = math.ceil(p.seqlen_q / variant.block_m)
    grid = p.batch * p.heads_q * blocks_per_head
    _check_grid(grid)
    (qb, qh, qr), (kb, kh, kr), (vb, vh, vr), (ob, oh, orow) = map(_strides, (q, k, v, out_k))
    args = pack_params(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), o=out_k.data_ptr(), lse=lse.data_ptr(),
                       q_bs=qb, q_hs=qh, q_rs=qr, k_bs=kb, k_hs=kh, k_rs=kr, v_bs=vb, v_hs=vh, v_rs=vr,
                       o_bs=ob, o_hs=oh, o_rs=orow, num_blocks=blocks_per_head, **_common(p, x))
    kernel = get_kernel(variant, nvrtc_arch(p.capability), device_index)
    _launch(kernel, grid, variant.threads, variant.shared_bytes(), (args,), device_index)
    if out_k is not out:
        out.copy_(out_k[..., : p.head_dim_v])
    return out, lse


class BackwardOperands(NamedTuple):
    """What every backward launcher (here, launch_deterministic, launch_sm90_bwd) starts from."""
    x: Inputs  # the call's inputs, the ALiBi slopes as a unit-stride vector
    delta: torch.Tensor  # rowsum(dout * out), float32 (B, Hq, Sq)
    lse2: torch.Tensor  # the forward's lse in log2
    q: torch.Tensor  # q, k, v, dout as kernel operands (head dims rounded up to 8)
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    dk: torch.Tensor  # dK and dV for the kernels to write (uninitialised), head dims rounded up to 8
    dv: torch.Tensor


def backward_operands(p, x: Inputs, out, lse, dout) -> BackwardOperands:
    """delta, lse in log2, the kernel operands and dk/dv of one backward call (see `BackwardOperands`)."""
    d, dvw = round8(p.head_dim), round8(p.head_dim_v)
    delta = (dout.float() * out.float()).sum(-1).contiguous()  # rowsum(dout * out), (B, Hq, Sq)
    lse2 = lse_log2(lse)
    q, k, v, dout_k = kernel_operand(x.q, d), kernel_operand(x.k, d), kernel_operand(x.v, dvw), \
        kernel_operand(dout, dvw)
    x = x.replace(alibi_slopes=_vector(x.alibi_slopes))
    dk = q.new_empty(p.batch, p.heads_kv, p.seqlen_k, d)
    dv = q.new_empty(p.batch, p.heads_kv, p.seqlen_k, dvw)
    return BackwardOperands(x, delta, lse2, q, k, v, dout_k, dk, dv)


def backward_fields(b: BackwardOperands, dq_accum) -> dict:
    """The pointers and strides of the Ampere-class backward kernels' parameters (sm80/fa_bwd.cu, fa_bwd_dq.cu)."""
    (qb, qh, qr), (kb, kh, kr), (vb, vh, vr), (ob, oh, orow) = map(_strides, (b.q, b.k, b.v, b.dout))
    (dkb, dkh, dkr), (dvb, dvh, dvr) = _strides(b.dk), _strides(b.dv)
    return dict(q=b.q.data_ptr(), k=b.k.data_ptr(), v=b.v.data_ptr(), dout=b.dout.data_ptr(),
                lse=b.lse2.data_ptr(), delta=b.delta.data_ptr(), dq_accum=dq_accum.data_ptr(),
                dk=b.dk.data_ptr(), dv=b.dv.data_ptr(),
                q_bs=qb, q_hs=qh, q_rs=qr, k_bs=kb, k_hs=kh, k_rs=kr, v_bs=vb, v_hs=vh, v_rs=vr,
                o_bs=ob, o_hs=oh, o_rs=orow, dk_bs=dkb, dk_hs=dkh, dk_rs=dkr, dv_bs=dvb, dv_hs=dvh, dv_rs=dvr)


def backward_grads(p, b: BackwardOperands, lse, dq_accum) -> Grads:
    """dq (the fp32 accumulator scaled, in the call's dtype), dk, dv cut to the head dims, dsinks from lse and delta."""
    dq = (dq_accum[..., : p.head_dim] * p.scale).to(p.dtype)
    dsinks = sinks_grad(b.x.sinks, lse, b.delta) if b.x.sinks is not None else None
    return Grads(dq, b.dk[..., : p.head_dim], b.dv[..., : p.head_dim_v], None, dsinks)


def backward(p, x: Inputs, out, lse, dout) -> Grads:
    """FlashAttention-2 backward, dQ through fp32 atomics; dsinks from lse and delta."""
    device_index = _device_index(x.q)
    family = family_for(p.capability)
    d, dvw = round8(p.head_dim), round8(p.head_dim_v)
    passes = backward_variants(family, p.dtype == torch.bfloat16, head_dim_tile(d, dvw, family, "bwd"), score_mod(p),
                               max_shared(p.capability))
    b = backward_operands(p, x, out, lse, dout)
    dq_accum = torch.zeros(p.batch, p.heads_q, p.seqlen_q, d, device=b.q.device, dtype=torch.float32)
    blocks_per_head = math.ceil(p.seqlen_k / passes[0].block_n)
    grid = p.batch * p.heads_kv * blocks_per_head
    _check_grid(grid)
    args = pack_params(**backward_fields(b, dq_accum), num_blocks=blocks_per_head, dq_row=d,
                       **_common(p, b.x.replace(sinks=None)))
    arch = nvrtc_arch(p.capability)
    for variant in passes:
        kernel = get_kernel(variant, arch, device_index)
        _launch(kernel, grid, variant.threads, variant.shared_bytes(), (args,), device_index)
    return backward_grads(p, b, lse, dq_accum)
