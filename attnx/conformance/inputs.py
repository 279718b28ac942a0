"""Fresh, seeded inputs for one case, and their float64 / low-precision twins for the oracles.

Every tensor is drawn on the CPU from the case's own generator (so a case gets the same
numbers on every device) and then moved to the target device. q, k and v are *views* of
leaf tensors laid out as the case's ``memory`` says (sliced with an odd storage offset,
stored in the other layout, strided last dim, or broadcast over the batch); gradients are
compared on those views, which are the tensors the caller hands to attnx.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import formats
from .cases import DTYPES, Case

LARGE_LOGIT = 1e4


@dataclass
class Inputs:
    """Leaves (what autograd accumulates into) and the views passed to attnx."""

    leaves: dict                 # name -> leaf tensor ("q", "k", "v", "mask", "sinks")
    views: dict                  # name -> the tensor passed to attnx (q, k, v, mask, sinks)
    alibi_slopes: Optional[torch.Tensor]
    scale: Optional[float]
    dout: Optional[torch.Tensor]  # in the case's layout (the format's out shape), dtype of q
    index: dict                  # format keyword arguments (cu_seqlens_q, page_table, ...)
    packing: Optional[formats.Packing]  # how a non-dense case was packed, for the oracle


def shape_in_layout(case: Case, heads: int, seqlen: int, dim: int) -> tuple:
    return (case.batch, heads, seqlen, dim) if case.layout == "bhsd" else (case.batch, seqlen, heads, dim)


def _memory_view(case: Case, shape: tuple, draw: Callable) -> tuple[torch.Tensor, Callable]:
    """A leaf holding the values, and the function that views it as `shape`."""
    b, x, y, d = shape
    if case.memory == "sliced":       # padded rows and columns, storage offset not a multiple of 4
        return draw((b, x, y + 1, d + 8)), lambda t: t[:, :, 1:, 3:3 + d]
    if case.memory == "transposed":   # stored in the other layout
        return draw((b, y, x, d)), lambda t: t.transpose(1, 2)
    if case.memory == "strided":      # last dim not unit-stride
        return draw((b, x, y, 2 * d)), lambda t: t[..., ::2]
    if case.memory == "expanded":     # one batch entry broadcast (stride 0)
        return draw((1, x, y, d)), lambda t: t.expand(b, x, y, d)
    return draw(shape), lambda t: t


def _mask_shape(case: Case) -> tuple:
    b, h, sq, sk = case.batch, case.heads_q, case.seqlen_q, case.seqlen_k
    return {"full": (b, h, sq, sk), "heads": (1, h, sq, sk), "keys": (b, 1, 1, sk), "2d": (sq, sk),
            "1d": (sk,)}[case.mask_shape]


def _make_mask(case: Case, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    shape = _mask_shape(case)
    if case.mask == "bool":
        mask = torch.rand(shape, generator=gen) < 0.8
    else:
        mask = torch.randn(shape, generator=gen, dtype=torch.float64) * 2
        mask[torch.rand(shape, generator=gen) < 0.05] = float("-inf")   # some padding-style -inf entries
    if case.masked_rows:
        blocked = False if case.mask == "bool" else float("-inf")
        if case.mask_shape in ("keys", "1d"):
            mask[0] = blocked                         # batch 0 (every query, for 1d) sees no key
            if case.mask_shape == "1d":
                mask[:] = blocked
        else:
            rows = mask.reshape(-1, shape[-2], shape[-1])
            pick = torch.rand(rows.shape[:2], generator=gen) < 0.25
            pick[..., 0] = True                       # at least one row per (b, h)
            rows[pick] = blocked
    return mask if case.mask == "bool" else mask.to(dtype)


def make_inputs(case: Case, device) -> tuple[Inputs, Callable]:
    """Inputs on `device`, and a function giving twins of them in another dtype (for the oracles)."""
    gen = torch.Generator().manual_seed(case.seed)
    dtype = case.torch_dtype

    def draw(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)

    packing = None if case.is_dense else formats.plan_packing(case, gen)
    layouts = {}
    if packing is None:
        for name, heads, seqlen, dim in (("q", case.heads_q, case.seqlen_q, case.head_dim),
                                         ("k", case.heads_kv, case.seqlen_k, case.head_dim),
                                         ("v", case.heads_kv, case.seqlen_k, case.head_dim_v)):
            layouts[name] = _memory_view(case, shape_in_layout(case, heads, seqlen, dim), draw)
    else:
        for name, shape in formats.packed_shapes(case, packing).items():
            layouts[name] = draw(shape), (lambda t: t)
    leaves = {name: leaf for name, (leaf, _) in layouts.items()}
    view_fns = {name: fn for name, (_, fn) in layouts.items()}
    if case.nan:  # one key of batch 0, kv head 0: the rows that see it (and only those) must be NaN
        key = view_fns["k"](leaves["k"])
        key = key if case.layout == "bhsd" else key.transpose(1, 2)
        key[0, 0, min(3, case.seqlen_k - 1), 0] = float("nan")
    if case.mask:
        leaves["mask"] = _make_mask(case, gen, DTYPES[case.mask_dtype] if case.mask_dtype else dtype)
        view_fns["mask"] = lambda t: t
    if case.sinks:
        leaves["sinks"] = torch.randn((case.heads_q,), generator=gen) * 2
        view_fns["sinks"] = lambda t: t
    alibi = None
    if case.alibi:
        shape = (case.heads_q,) if case.alibi == "h" else (case.batch, case.heads_q)
        alibi = (torch.rand(shape, generator=gen) * 0.5 + 0.01).to(device)
    scale = case.scale
    if case.large_logits:
        # the scale that makes the largest |q . k| score exactly LARGE_LOGIT
        q64, k64 = (view_fns[n](leaves[n]).double() for n in ("q", "k"))
        if case.layout == "bshd":
            q64, k64 = q64.transpose(1, 2), k64.transpose(1, 2)
        k64 = k64.repeat_interleave(case.heads_q // case.heads_kv, dim=1)
        scale = LARGE_LOGIT / float((q64 @ k64.transpose(-2, -1)).abs().max())
    dout = None
    if case.grad:
        shape = (formats.out_shape(case, packing) if packing is not None
                 else shape_in_layout(case, case.heads_q, case.seqlen_q, case.head_dim_v))
        dout = draw(shape).to(device)
    leaves = {n: t.to(device) for n, t in leaves.items()}

    def twin(dtype_: Optional[torch.dtype], requires_grad: bool) -> tuple[dict, dict]:
        """(leaves, views) as fresh leaf copies in `dtype_` (None = same dtype); bool masks stay bool."""
        new_leaves = {}
        for name, leaf in leaves.items():
            t = leaf.detach().clone()
            if dtype_ is not None and t.dtype != torch.bool:
                t = t.to(dtype_)
            wants_grad = requires_grad and (name != "mask" or case.mask_grad)
            new_leaves[name] = t.requires_grad_(wants_grad)
        views = {name: view_fns[name](t) for name, t in new_leaves.items()}
        for t in views.values():
            if t.requires_grad and not t.is_leaf:
                t.retain_grad()
        return new_leaves, views

    leaves_used, views = twin(None, case.grad)
    index = {} if packing is None else formats.index_tensors(case, packing, device)
    return Inputs(leaves_used, views, alibi, scale, dout, index, packing), twin
