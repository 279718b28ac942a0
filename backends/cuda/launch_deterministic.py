"""Launcher of the deterministic backward: `CudaBackend.backward` for `deterministic` problems.

The Ampere-class backward (kernels/sm80/fa_bwd.cu) adds dQ with fp32 atomics from every key block,
so its dQ differs in the last bits from run to run. Here the same kernel is built without that dQ
(`Variant.atomic_dq=False`: dK and dV only, which it always wrote once) and a second kernel
(kernels/sm80/fa_bwd_dq.cu) computes dQ per query block, walking its key blocks in a fixed order and
writing each element once. Both families run it (on sm_90 the Ampere kernels built for sm_90a).
Checked on the H200 2026-12-01 (`benchmarks/cuda_deterministic.py check`: float64 bounds and
bitwise-equal reruns, 105 cases); backends/cuda/NOTES.md, "Deterministic backward", has its cost.
"""
from __future__ import annotations

import math

import torch

from attnx.errors import InvalidArgumentError
from attnx.inputs import Grads, Inputs

from .compile import get_kernel
from .families import nvrtc_arch
from .launch import (_check_grid, _common, _device_index, _launch, backward_fields, backward_grads, backward_operands,
                     family_tile, round8, score_mod)
from .params import pack_params
from .variants import Variant, deterministic_backward_variants, max_shared


def launches_for(p) -> tuple[Variant, ...] | None:
    """The dK/dV pass(es) and the dQ pass of problem `p`, or None where no tile fits."""
    found = family_tile(p, "bwd")
    if found is None:
        return None
    family, tile = found
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
    d = round8(p.head_dim)
    b = backward_operands(p, x, out, lse, dout)
    # every element of dq_accum is written once by the dQ pass (no zero fill needed)
    dq_accum = torch.empty(p.batch, p.heads_q, p.seqlen_q, d, device=b.q.device, dtype=torch.float32)
    if poison:
        for t in (dq_accum, b.dk, b.dv):
            t.fill_(float("nan"))
    key_blocks = math.ceil(p.seqlen_k / dkdv_passes[0].block_n)
    query_blocks = math.ceil(p.seqlen_q / dq_pass.block_m)
    dkdv_grid = p.batch * p.heads_kv * key_blocks
    dq_grid = p.batch * p.heads_q * query_blocks
    _check_grid(max(dkdv_grid, dq_grid))
    fields = dict(backward_fields(b, dq_accum), dq_row=d, **_common(p, b.x.replace(sinks=None)))
    arch = nvrtc_arch(p.capability)
    # num_blocks: key blocks per kv head for the dK/dV passes, query blocks per query head for dQ
    for variant, grid, blocks in [(v_, dkdv_grid, key_blocks) for v_ in dkdv_passes] + \
            [(dq_pass, dq_grid, query_blocks)]:
        if grid > 0 and variant.kernel in kinds:
            kernel = get_kernel(variant, arch, device_index)
            _launch(kernel, grid, variant.threads, variant.shared_bytes(),
                    (pack_params(num_blocks=blocks, **fields),), device_index)
    return backward_grads(p, b, lse, dq_accum)
