"""Ring attention as one autograd Function: K/V travel around the ring, dK/dV travel back with them.

Forward, on rank r, step t = 0 .. P-1: hold the K/V block of rank ``r - t``, start sending it to
rank ``r + 1`` (and receiving the next one from ``r - 1``), compute the rank's queries against
it (`forward.forward_block`), then wait for the transfer. The partial results are merged
exactly through their lse, online, as `attnx.merge` does.

Backward, step t: rank r holds the dK/dV accumulators of block ``r - t`` (the block's owner starts
them at zero at step 0), starts the next K/V shift, adds its queries' share of the block's
gradients into the accumulators in place on a backend's backward kernel
(`block_backward.BlockBackward`: `attnx.attention_backward` with the global out and lse), then
swaps them for the next block's: they go to rank ``r + 1`` while rank ``r - 1``'s come in, piece
by piece into the same buffers (`exchange.Ring.shift_in_place`). The swap after the last step
brings every block's dK/dV home. The accumulators travel in float32 (float64 for float64
inputs), so P hops do not round them P times.

Memory per rank, beyond the saved tensors (q, k, v, out, lse) and dQ: the K/V block in hand, the
next one arriving and one block's dK/dV accumulators. The K/V transfer overlaps the compute;
the dK/dV swap does not (it moves one piece at a time), which keeps a second and third
K/V-sized pair of buffers out of the peak (docs/distributed.md, "Memory per rank").
``kv_pieces > 1`` runs `ring_pieces.PiecedRingAttention` instead: the same ring, one piece of
every block at a time, with no block-sized buffer in flight.
"""
from __future__ import annotations

import torch

from ..inputs import sinks_grad
from .block_backward import BlockBackward
from .buffers import as_bhsd, backward_setup, grad_like, key_accumulators, new_outputs, own_kv
from .exchange import Ring, travel
from .forward import finish, forward_block, new_partials
from .spec import RingSpec

TAG_KV, TAG_DKV = 10, 20  # message tags: k/v are TAG + 0/1


class RingAttention(torch.autograd.Function):
    """``apply(spec, q, k, v, sinks)`` -> ``(out, lse)`` of this rank's shard (``lse`` not differentiable)."""

    @staticmethod
    def forward(ctx, spec: RingSpec, q, k, v, sinks):
        qh = as_bhsd(spec.layout, q)
        kv = own_kv(spec, k, v)
        size, rank = spec.world_size, spec.rank
        ring = Ring(spec.group, rank, size, q.device) if size > 1 else None
        q_chunks = spec.chunks(rank)
        out, lse = new_outputs(spec, q, qh.shape[1], v.shape[-1])
        partials = new_partials(q_chunks, out)
        for src in travel(ring, kv, TAG_KV, rank, size):
            forward_block(spec, qh, kv[0], kv[1], q_chunks, spec.chunks(src), partials)
        finish(q_chunks, partials, sinks, out, lse)
        out = as_bhsd(spec.layout, out)  # back to the caller's layout
        ctx.spec = spec
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        spec: RingSpec = ctx.spec
        q, k, v, sinks, out, lse = ctx.saved_tensors
        qh, douth, delta, dq = backward_setup(spec, q, out, dout)
        blocks = BlockBackward(spec, qh, as_bhsd(spec.layout, out), douth, lse, delta, dq)
        kv = own_kv(spec, k, v)
        size, rank = spec.world_size, spec.rank
        ring = Ring(spec.group, rank, size, q.device) if size > 1 else None
        grads = None  # the dK/dV accumulators of the block in hand
        for step in range(size):
            # the block's owner starts its accumulators at zero; later steps hold the ones received
            if grads is None:
                grads = key_accumulators(kv[0], kv[1], dq.dtype)
            kv_pending = ring.shift(kv, TAG_KV) if step < size - 1 else None
            blocks.add(kv[0], kv[1], spec.chunks((rank - step) % size), *grads)
            if kv_pending is not None:
                kv = kv_pending.wait()  # the block in hand is released here
            if ring is not None:
                # on to the next rank, replaced by the next block's from the previous one (after the
                # last step: this rank's own block's, home)
                ring.shift_in_place(grads, TAG_DKV)
        del kv
        dsinks = sinks_grad(sinks, lse, delta).to(sinks.dtype) if ctx.needs_input_grad[4] else None
        return (None, grad_like(spec.layout, dq, q.dtype), grad_like(spec.layout, grads[0], k.dtype),
                grad_like(spec.layout, grads[1], v.dtype), dsinks)
