"""The all-gather variant as one autograd Function: every rank gathers the whole K/V once.

Forward: start gathering every rank's K/V (asynchronously), compute the rank's queries against
its own block meanwhile, then against every other block as it is there. The gathered K/V are
kept for the backward, which computes dK/dV of every block for the rank's queries and sums each
block's on its owner with one reduce-scatter. Moves fewer bytes than the ring in training (no
K/V in the backward) and takes one collective instead of P - 1 dependent hops, at the price of
holding the whole K/V on every rank: `rule.choose_exchange` says when.
"""
from __future__ import annotations

import torch

from ..inputs import sinks_grad
from .block_backward import BlockBackward
from .buffers import as_bhsd, backward_setup, grad_like, key_accumulators, new_outputs, own_kv
from .exchange import all_gather_start, reduce_scatter
from .forward import finish, forward_block, new_partials
from .spec import RingSpec


class AllGatherAttention(torch.autograd.Function):
    """``apply(spec, q, k, v, sinks)`` -> ``(out, lse)`` of this rank's shard (``lse`` not differentiable)."""

    @staticmethod
    def forward(ctx, spec: RingSpec, q, k, v, sinks):
        qh = as_bhsd(spec.layout, q)
        kv = own_kv(spec, k, v)
        rank, size = spec.rank, spec.world_size
        pending = [all_gather_start(t, spec.group, size) for t in kv]
        q_chunks = spec.chunks(rank)
        out, lse = new_outputs(spec, q, qh.shape[1], v.shape[-1])
        partials = new_partials(q_chunks, out)
        forward_block(spec, qh, kv[0], kv[1], q_chunks, spec.chunks(rank), partials)  # while gathering
        keys, values = (p.wait() for p in pending)
        for src in range(size):
            if src != rank:
                forward_block(spec, qh, keys[src], values[src], q_chunks, spec.chunks(src), partials)
        finish(q_chunks, partials, sinks, out, lse)
        out = as_bhsd(spec.layout, out)
        ctx.spec = spec
        ctx.save_for_backward(q, k, v, sinks, out, lse, *keys, *values)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        spec: RingSpec = ctx.spec
        q, k, v, sinks, out, lse, *gathered = ctx.saved_tensors
        size = spec.world_size
        keys, values = gathered[:size], gathered[size:]
        qh, douth, delta, dq = backward_setup(spec, q, out, dout)
        blocks = BlockBackward(spec, qh, as_bhsd(spec.layout, out), douth, lse, delta, dq)
        dks, dvs = [], []
        for src in range(size):
            dk, dv = key_accumulators(keys[src], values[src], dq.dtype)
            if blocks.computes(spec.chunks(src)):
                blocks.add(keys[src], values[src], spec.chunks(src), dk, dv)
            dks.append(dk)
            dvs.append(dv)
        dk, dv = reduce_scatter(dks, spec.group), reduce_scatter(dvs, spec.group)
        dsinks = sinks_grad(sinks, lse, delta).to(sinks.dtype) if ctx.needs_input_grad[4] else None
        return (None, grad_like(spec.layout, dq, q.dtype), grad_like(spec.layout, dk, k.dtype),
                grad_like(spec.layout, dv, v.dtype), dsinks)
