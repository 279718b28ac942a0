"""The one place where a backend's forward and backward become a differentiable op.

`run_forward` / `run_backward` turn the caller's tensors into the views backends
receive (`backend_view`) and the backend's results back into the caller's layout;
the eager autograd Function below and the torch.compile custom ops
(`compile_ops.py`) both call them, so neither knows the list of tensors.
"""
from __future__ import annotations

import torch

from .inputs import Grads, Inputs
from .problem import Problem


def alloc_out(p: Problem, q: torch.Tensor) -> torch.Tensor:
    """An uninitialised output for a backend to fill.

    Dense q: contiguous in the caller's layout, returned as a ``(B, H, S, Dv)`` view.
    Varlen q: ``(total_q, Hq, Dv)``.
    """
    if p.q_format == "varlen":
        return q.new_empty((q.shape[0], p.heads_q, p.head_dim_v))
    if p.layout == "bshd":
        return q.new_empty((p.batch, p.seqlen_q, p.heads_q, p.head_dim_v)).transpose(1, 2)
    return q.new_empty((p.batch, p.heads_q, p.seqlen_q, p.head_dim_v))


def lse_shape(p: Problem, q: torch.Tensor) -> tuple:
    """``(B, Hq, Sq)`` for dense q, ``(Hq, total_q)`` for varlen q."""
    if p.q_format == "varlen":
        return (p.heads_q, q.shape[0])
    return (p.batch, p.heads_q, p.seqlen_q)


def sum_to_shape(grad: torch.Tensor, shape: tuple) -> torch.Tensor:
    """Sum `grad` over the dimensions where a tensor of `shape` was broadcast."""
    dims = tuple(i for i, (g, s) in enumerate(zip(grad.shape, shape)) if s == 1 and g != 1)
    return grad.sum(dims, keepdim=True) if dims else grad


def _swap_bshd(p: Problem, x: Inputs, q: bool = True, kv: bool = True) -> Inputs:
    """Dense ``bshd`` tensors as ``(B, H, S, D)`` views (the swap is its own inverse)."""
    if p.layout != "bshd":
        return x
    changes = {}
    if q and p.q_format == "dense":
        changes["q"] = x.q.transpose(1, 2)
    if kv and p.kv_format in ("dense", "cache"):
        changes["k"], changes["v"] = x.k.transpose(1, 2), x.v.transpose(1, 2)
    return x.replace(**changes) if changes else x


def backend_view(p: Problem, x: Inputs) -> Inputs:
    """The caller's tensors as backends receive them (see `Inputs`)."""
    if p.layout == "bhsd" and x.mask is None and x.alibi_slopes is None:
        return x  # already as backends want them (the common small call: nothing to look at)
    x = _swap_bshd(p, x)
    changes = {}
    if x.mask is not None:
        changes["mask"] = x.mask.reshape(p.mask_shape).expand(p.batch, p.heads_q, p.seqlen_q, p.seqlen_k)
    if x.alibi_slopes is not None:
        slopes = x.alibi_slopes
        changes["alibi_slopes"] = slopes.reshape(slopes.shape[0] if slopes.dim() == 2 else 1, p.heads_q).expand(p.batch, p.heads_q)
    return x.replace(**changes) if changes else x


def _caller_out(p: Problem, out: torch.Tensor) -> torch.Tensor:
    return out.transpose(1, 2) if p.layout == "bshd" and p.q_format == "dense" else out


def run_forward(p: Problem, backend, x: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of `backend` on the caller's tensors, ``out`` in the caller's layout."""
    out, lse = backend.forward(p, backend_view(p, x))
    return _caller_out(p, out), lse


def run_backward(p: Problem, backend, x: Inputs, out, lse, dout) -> Grads:
    """`Grads` of the caller's tensors (``dmask`` in the mask's own shape)."""
    view = backend_view(p, x)
    grads = backend.backward(p, view, _caller_out(p, out), lse, _caller_out(p, dout))
    swapped = _swap_bshd(p, Inputs(grads.dq, grads.dk, grads.dv))
    dmask = grads.dmask.reshape(x.mask.shape) if grads.dmask is not None else None
    return Grads(swapped.q, swapped.k, swapped.v, dmask, grads.dsinks)


class _AttentionFunction(torch.autograd.Function):
    """``apply(p, backend, names, *tensors)`` -> ``(out, lse)``: `tensors` are the `Inputs` fields `names`
    (those that are not None: autograd unwraps every argument of every call, so the absent ones are
    left out); gradients for `Inputs.DIFFERENTIABLE`."""

    @staticmethod
    def forward(ctx, p, backend, names, *tensors):
        x = Inputs(**dict(zip(names, tensors)))
        out, lse = run_forward(p, backend, x)
        ctx.save_for_backward(*tensors, out, lse)
        ctx.problem, ctx.backend, ctx.names = p, backend, names
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        *tensors, out, lse = ctx.saved_tensors
        names = ctx.names
        grads = run_backward(ctx.problem, ctx.backend, Inputs(**dict(zip(names, tensors))), out, lse, dout)
        wanted = ctx.needs_input_grad
        return (None, None, None) + tuple(
            grads.of(name) if wanted[3 + i] and name in Inputs.DIFFERENTIABLE else None
            for i, name in enumerate(names))


def run(p: Problem, backend, x: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `backend` on the caller's tensors, through autograd when `p` needs gradients."""
    if p.needs_grad:
        names = x.present()
        return _AttentionFunction.apply(p, backend, names, *(getattr(x, name) for name in names))
    if p.layout == "bhsd" and x.mask is None and x.alibi_slopes is None:
        return backend.forward(p, x)  # `backend_view` and `_caller_out` are the identity here
    return run_forward(p, backend, x)
