"""Launcher of the Hopper family's forward: TMA tensor maps in, 128 query rows per thread block.

The kernel reads q, k, v and writes out through tensor maps (`tensor_maps.py`), so any
(B, H, S, D) strides TMA accepts run in place (both layouts, GQA heads by index); a tensor
TMA cannot read (last dim not contiguous, a stride or base not 16-byte aligned, a head dim
not a multiple of 8) is first copied into a zero-padded contiguous buffer, as in the Ampere
launcher. lse is written per row. Everything is checked before the launch.
"""
from __future__ import annotations

import math

import torch

from attnx.autograd import alloc_out
from attnx.inputs import Inputs

from .compile import get_kernel
from .families import family_for, nvrtc_arch
from .launch import _check_grid, _common, _device_index, _launch, _vector, kernel_operand, round8, score_mod
from .params import pack_params
from .tensor_maps import operand_ok, tensor_map
from .variants import Variant, forward_rounds_rescale, forward_variant, head_dim_tile, max_shared


def forward_variant_for(p) -> Variant | None:
    family = family_for(p.capability)
    tile = head_dim_tile(round8(p.head_dim), round8(p.head_dim_v), family, "fwd")
    if tile is None:
        return None
    return forward_variant(family, p.dtype == torch.bfloat16, tile, score_mod(p), max_shared(p.capability),
                           exact_alpha=forward_rounds_rescale(p.seqlen_k))


def forward(p, x: Inputs, variant: Variant | None = None):
    """(out, lse) of one attention call on the Hopper forward; `variant` overrides the tile table (benchmarks)."""
    device_index = _device_index(x.q)
    variant = variant or forward_variant_for(p)
    d, dv = round8(p.head_dim), round8(p.head_dim_v)
    q, k, v = kernel_operand(x.q, d), kernel_operand(x.k, d), kernel_operand(x.v, dv)
    x = x.replace(alibi_slopes=_vector(x.alibi_slopes), sinks=_vector(x.sinks))
    out = alloc_out(p, q)
    out_k = out if (dv == p.head_dim_v and operand_ok(out)) else q.new_empty(p.batch, p.heads_q, p.seqlen_q, dv)
    lse = torch.empty(p.batch, p.heads_q, p.seqlen_q, device=q.device, dtype=torch.float32)
    blocks_per_head = math.ceil(p.seqlen_q / variant.block_m)
    grid = p.batch * p.heads_q * blocks_per_head
    _check_grid(grid)
    args = pack_params(lse=lse.data_ptr(), num_blocks=blocks_per_head, **_common(p, x))
    maps = (tensor_map(q, variant.block_m), tensor_map(k, variant.block_n), tensor_map(v, variant.block_n),
            tensor_map(out_k, variant.block_m // 2))  # each consumer warpgroup stores its 64 rows
    kernel = get_kernel(variant, nvrtc_arch(p.capability), device_index)
    _launch(kernel, grid, variant.threads, variant.shared_bytes(), (args, *maps), device_index)
    if out_k is not out:
        out.copy_(out_k[..., : p.head_dim_v])
    return out, lse
