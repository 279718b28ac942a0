"""Launcher of the deterministic backward (issue 11): not yet run on a GPU, not dispatched.

The Ampere-class backward (kernels/sm80/fa_bwd.cu) adds dQ with fp32 atomics from every key block,
so its dQ differs in the last bits from run to run. Here the same kernel is built without that dQ
(`Variant.atomic_dq=False`: dK and dV only, which it always wrote once) and a second kernel
(kernels/sm80/fa_bwd_dq.cu) computes dQ per query block, walking its key blocks in a fixed order and
writing each element once. Both families run it (the Hopper family's backward is the Ampere kernel).
`CudaBackend.deterministic` stays False, so the dispatcher never comes here, until a GPU has run
`benchmarks/cuda_deterministic.py check` (backends/cuda/NOTES.md, "Deterministic backward").
"""
from __future__ import annotations

import math

import torch

from attnx.errors import InvalidArgumentError
from attnx.inputs import Grads, Inputs, sinks_grad
from attnx.limits import lse_log2

from .compile import get_kernel
from .families import family_for, nvrtc_arch
from .launch import _check_grid, _common, _device_index, _launch, _strides, _vector, kernel_operand, round8, score_mod
from .params import pack_params
from .variants import Variant, deterministic_backward_variants, head_dim_tile, max_shared


def launches_for(p) -> tuple[Variant, ...] | None:
    """The dK/dV pass(es) and the dQ pass of problem `p`, or None where no tile fits."""
    family = family_for(p.capability)
    if family is None:
        return None
    tile = head_dim_tile(round8(p.head_dim), round8(p.head_dim_v), family, "bwd")
    if tile is None:
        return None
    return deterministic_backward_variants(family, p.dtype == torch.bfloat16, tile, score_mod(p),
                                           max_shared(p.capability))


def backward(p, x: Inputs, out, lse, dout, *, poison: bool = False, kinds=("bwd", "bwd_dq"),
             dq_pass: Variant | None = None) -> Grads:
    """dq, dk, dv (and dsinks) of one attention call, the same bits on every run.

    `out` and `lse` are the forward's (lse natural-log, including the sinks). `poison` fills dk, dv and
    the fp32 dq buffer with NaN before the launches, so an element a kernel fails to write shows up.
    `kinds` launches only those kernel kinds (benchmarks time the dQ pass alone with ``("bwd_dq",)``);
    `dq_pass` overrides the dQ pass's tile (benchmarks compare tiles).
    """
    launches = launches_for(p)
    if launches is None:
        raise InvalidArgumentError(f"the deterministic cuda backward has no tile for head dims "
                                   f"{p.head_dim}/{p.head_dim_v} on {p.arch}")
    *dkdv_passes, table_dq_pass = launches
    dq_pass = dq_pass or table_dq_pass
    device_index = _device_index(x.q)
    d, dvw = round8(p.head_dim), round8(p.head_dim_v)
    delta = (dout.float() * out.float()).sum(-1).contiguous()  # rowsum(dout * out), (B, Hq, Sq)
    lse2 = lse_log2(lse)
    q, k, v, dout_k = kernel_operand(x.q, d), kernel_operand(x.k, d), kernel_operand(x.v, dvw), \
        kernel_operand(dout, dvw)
    x = x.replace(alibi_slopes=_vector(x.alibi_slopes))
    # every element of dq_accum is written once by the dQ pass (no zero fill needed)
    dq_accum = torch.empty(p.batch, p.heads_q, p.seqlen_q, d, device=q.device, dtype=torch.float32)
    dk = q.new_empty(p.batch, p.heads_kv, p.seqlen_k, d)
    dv = q.new_empty(p.batch, p.heads_kv, p.seqlen_k, dvw)
    if poison:
        for t in (dq_accum, dk, dv):
            t.fill_(float("nan"))
    key_blocks = math.ceil(p.seqlen_k / dkdv_passes[0].block_n)
    query_blocks = math.ceil(p.seqlen_q / dq_pass.block_m)
    dkdv_grid = p.batch * p.heads_kv * key_blocks
    dq_grid = p.batch * p.heads_q * query_blocks
    _check_grid(max(dkdv_grid, dq_grid))
    (qb, qh, qr), (kb, kh, kr), (vb, vh, vr), (ob, oh, orow) = map(_strides, (q, k, v, dout_k))
    (dkb, dkh, dkr), (dvb, dvh, dvr) = _strides(dk), _strides(dv)
    fields = dict(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), dout=dout_k.data_ptr(),
                  lse=lse2.data_ptr(), delta=delta.data_ptr(), dq_accum=dq_accum.data_ptr(),
                  dk=dk.data_ptr(), dv=dv.data_ptr(),
                  q_bs=qb, q_hs=qh, q_rs=qr, k_bs=kb, k_hs=kh, k_rs=kr, v_bs=vb, v_hs=vh, v_rs=vr,
                  o_bs=ob, o_hs=oh, o_rs=orow, dk_bs=dkb, dk_hs=dkh, dk_rs=dkr, dv_bs=dvb, dv_hs=dvh,
                  dv_rs=dvr, dq_row=d, **_common(p, x.replace(sinks=None)))
    arch = nvrtc_arch(p.capability)
    # num_blocks: key blocks per kv head for the dK/dV passes, query blocks per query head for dQ
    for variant, grid, blocks in [(v_, dkdv_grid, key_blocks) for v_ in dkdv_passes] + \
            [(dq_pass, dq_grid, query_blocks)]:
        if grid > 0 and variant.kernel in kinds:
            kernel = get_kernel(variant, arch, device_index)
            _launch(kernel, grid, variant.threads, variant.shared_bytes(),
                    (pack_params(num_blocks=blocks, **fields),), device_index)
    dq = (dq_accum[..., : p.head_dim] * p.scale).to(p.dtype)
    dsinks = sinks_grad(x.sinks, lse, delta) if x.sinks is not None else None
    return Grads(dq, dk[..., : p.head_dim], dv[..., : p.head_dim_v], None, dsinks)
