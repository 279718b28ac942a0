"""Ring attention with K/V in pieces (``kv_pieces > 1``): the ring of `ring.py`, one piece at a time.

Forward, for each piece j (`kv_pieces.Piece`), steps t = 0 .. P-1: rank r holds piece j of rank
``r - t``'s block, starts sending it on (and receiving the next rank's piece j), computes its
queries against it and merges the result (any split of the keys merges exactly through the
lse), then waits. Backward: the same, with piece j's dK/dV accumulators travelling with it
(started at zero by the block's owner; the P-th shift brings them home, where they are written
into the block's dK/dV). Nothing K/V-sized but the rank's own shards, outputs and gradients is
ever held: memory per rank falls as 1/P from one rank on (docs/distributed.md).
"""
from __future__ import annotations

import torch

from ..inputs import sinks_grad
from .block_backward import BlockBackward
from .buffers import as_bhsd, backward_setup, empty_bhsd, grad_like, new_outputs
from .exchange import Ring, travel
from .forward import finish, forward_block, new_partials
from .kv_pieces import kv_pieces
from .spec import RingSpec

TAG_KV, TAG_DKV = 50, 60  # message tags: k/v are TAG + 0/1


class PiecedRingAttention(torch.autograd.Function):
    """``apply(spec, q, k, v, sinks)`` -> ``(out, lse)`` of this rank's shard, K/V travelling in pieces."""

    @staticmethod
    def forward(ctx, spec: RingSpec, q, k, v, sinks):
        qh, kh, vh = (as_bhsd(spec.layout, t) for t in (q, k, v))
        size, rank = spec.world_size, spec.rank
        ring = Ring(spec.group, rank, size, q.device)
        q_chunks = spec.chunks(rank)
        out, lse = new_outputs(spec, q, qh.shape[1], v.shape[-1])
        partials = new_partials(q_chunks, out)
        for piece in kv_pieces(spec):
            kv = [piece.take(kh), piece.take(vh)]
            for src in travel(ring, kv, TAG_KV, rank, size):
                forward_block(spec, qh, kv[0], kv[1], q_chunks, piece.chunks(spec, src), partials)
        finish(q_chunks, partials, sinks, out, lse)
        out = as_bhsd(spec.layout, out)
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
        kh, vh = as_bhsd(spec.layout, k), as_bhsd(spec.layout, v)
        size, rank = spec.world_size, spec.rank
        ring = Ring(spec.group, rank, size, q.device)
        # the block's gradients, in the caller's layout (for float32 they are returned as they are)
        dk, dv = (empty_bhsd(spec.layout, t, t.shape[1], t.shape[2], t.shape[3], dq.dtype) for t in (kh, vh))
        for piece in kv_pieces(spec):
            kv = [piece.take(kh), piece.take(vh)]
            grads = [torch.zeros(t.shape, dtype=dq.dtype, device=t.device) for t in kv]
            for step in range(size):
                kv_pending = ring.shift(kv, TAG_KV) if step < size - 1 else None
                blocks.add(kv[0], kv[1], piece.chunks(spec, (rank - step) % size), *grads)
                if kv_pending is not None:
                    kv = kv_pending.wait()
                grads = ring.shift(grads, TAG_DKV).wait()  # on to the next rank (after the last step: home)
            piece.put(dk, grads[0])
            piece.put(dv, grads[1])
        dsinks = sinks_grad(sinks, lse, delta).to(sinks.dtype) if ctx.needs_input_grad[4] else None
        return (None, grad_like(spec.layout, dq, q.dtype), grad_like(spec.layout, dk, k.dtype),
                grad_like(spec.layout, dv, v.dtype), dsinks)
