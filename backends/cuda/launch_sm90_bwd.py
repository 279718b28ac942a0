"""Launcher of the Hopper family's backward (kernels/sm90/fa_bwd.cu).

`CudaBackend.backward` runs it on sm_90 for head dims up to 128 (checked against float64 and timed on
the H200 2026-12-01: backends/cuda/NOTES.md, "Hopper backward"); larger head dims run the Ampere
backward. Like the Hopper forward it reads
q, k, v and dout through TMA tensor maps (both layouts in place, GQA heads by coordinate, zero fill
past the sequence ends and head dims) and writes dk, dv with clipped TMA stores; dq is added in
float32 to `dq_accum` and converted once here, as in the Ampere launcher. delta and the sinks'
gradient are the same torch ops as there.
Deterministic problems get the variant with `dq_ordered`: dQ is added into each query block in a fixed
order of key blocks, so dq is the same bits on every run (148/148 cases over reruns on the H200,
2026-12-03 run 13: a writer thread adds through TMA in turn, 0.98-1.11x the default's time); it takes one
more kernel argument before the dQ map, the zeroed int32 turn counters (B, Hq, ceil(Sq / BM)) allocated
here. The opt-in `dq_rotate` (DQ_ROTATE: correct, slower on 5 of 8 timed rows with the writer, run 13)
rotates each key block's walk where `rotation_applies`; elsewhere the same variant runs without it.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from attnx.errors import InvalidArgumentError
from attnx.inputs import Grads, Inputs
from attnx.limits import kernel_window

from .compile import get_kernel
from .families import nvrtc_arch
from .launch import (_check_grid, _common, _device_index, _launch, backward_grads, backward_operands, family_tile,
                     score_mod)
from .params import pack_params
from .tensor_maps import MAP_DTYPE, dq_reduce_map, tensor_map
from .variants import Variant, hopper_backward_variant, max_shared

STORE_ROWS = 64  # each consumer warpgroup stores its 64 keys of dk and dv


def backward_variant_for(p) -> Variant | None:
    """The Hopper backward's specialisation for problem `p`, or None where it has no tile (head dims > 128)."""
    found = family_tile(p, "bwd_wgmma")
    if found is None:
        return None
    family, tile = found
    return hopper_backward_variant(family, p.dtype == torch.bfloat16, tile, score_mod(p), max_shared(p.capability))


def rotation_applies(p, block_m: int, block_n: int, sm_count: int) -> bool:
    """Whether the ordered dQ's rotated walk (`dq_rotate`, DQ_ROTATE) is right and safe for `p`: every query sees
    every key (no causal mask or window cuts any: then every key block adds to every query block), at least as
    many query blocks as key blocks (the rotation's stride M / N >= 1), and no more key blocks per head than
    SMs (one block per SM: a head's blocks all resident at once, which its turns then need)."""
    left, right = kernel_window(p)
    query_blocks, key_blocks = math.ceil(p.seqlen_q / block_m), math.ceil(p.seqlen_k / block_n)
    sees_all = p.seqlen_q - 1 + p.key_offset - left <= 0 and p.key_offset + right >= p.seqlen_k - 1
    return sees_all and 1 <= key_blocks <= min(query_blocks, sm_count)


def backward(p, x: Inputs, out, lse, dout, variant: Variant | None = None, *, poison: bool = False) -> Grads:
    """dq, dk, dv (and dsinks) of one attention call on the Hopper backward.

    `out` and `lse` are the forward's (lse natural-log, including the sinks); `variant` overrides
    the tile table (benchmarks); `poison` fills dk and dv with NaN before the launch, so an element
    the kernel fails to write shows up in a check.
    """
    variant = variant or backward_variant_for(p)
    if variant is None:
        raise InvalidArgumentError(f"the Hopper backward has no tile for head dims {p.head_dim}/{p.head_dim_v} "
                                   f"on {p.arch} (it runs on sm_90 only, head dims up to 128)")
    device_index = _device_index(x.q)
    if variant.dq_rotate and not rotation_applies(p, variant.block_m, variant.block_n,
                                                  torch.cuda.get_device_properties(device_index).multi_processor_count):
        variant = variant._replace(dq_rotate=False)  # (a schedule for problems where every query sees every key)
    b = backward_operands(p, x, out, lse, dout)
    # dq_accum rows are whole head-dim tiles: the kernel adds every column of its tile
    dq_accum = torch.zeros(p.batch, p.heads_q, p.seqlen_q, variant.head_dim, device=b.q.device, dtype=torch.float32)
    if poison:
        b.dk.fill_(float("nan"))
        b.dv.fill_(float("nan"))
    blocks_per_head = math.ceil(p.seqlen_k / variant.block_n)
    grid = p.batch * p.heads_kv * blocks_per_head
    _check_grid(grid)
    args = pack_params(lse=b.lse2.data_ptr(), delta=b.delta.data_ptr(), dq_accum=dq_accum.data_ptr(),
                       num_blocks=blocks_per_head, dq_row=variant.head_dim, **_common(p, b.x.replace(sinks=None)))
    maps = (tensor_map(b.q, variant.block_m), tensor_map(b.k, variant.block_n), tensor_map(b.v, variant.block_n),
            tensor_map(b.dout, variant.block_m), tensor_map(b.dk, STORE_ROWS), tensor_map(b.dv, STORE_ROWS))
    extra = ()
    if variant.dq_ordered:
        # one turn counter per (batch, query head, query block), counting the key blocks that added to it
        turns = torch.zeros(p.batch * p.heads_q * math.ceil(p.seqlen_q / variant.block_m), device=b.q.device,
                            dtype=torch.int32)
        extra = (np.uint64(turns.data_ptr()),)
    if variant.dq_tma:  # the late dQ parts added through TMA reduce-adds (no query: a map never read)
        extra += (dq_reduce_map(dq_accum) if dq_accum.numel() else np.zeros((), MAP_DTYPE)[()],)
    if grid > 0:
        kernel = get_kernel(variant, nvrtc_arch(p.capability), device_index)
        _launch(kernel, grid, variant.threads, variant.shared_bytes(), (args, *maps, *extra), device_index)
    return backward_grads(p, b, lse, dq_accum)
