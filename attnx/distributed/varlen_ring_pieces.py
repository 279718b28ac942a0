"""Packed ring attention with K/V in pieces (``kv_pieces > 1``): `varlen_ring`'s ring, one piece at a time.

As the dense `ring_pieces`: piece j (`varlen_pieces.VarlenPieces`) of every rank's block goes
all the way round the ring, computed against as it passes (one `varlen_calls` plan per piece
and source rank), before piece j + 1 leaves; in the backward its dK/dV accumulators travel with
it and come home after the P-th shift. A rank holds two pieces of other ranks' K/V and one of
accumulators, never a block.
"""
from __future__ import annotations

import torch

from ..inputs import sinks_grad
from .exchange import Ring, travel
from .varlen_block import BlockBackward
from .varlen_calls import VarlenSpec, plan_calls
from .varlen_pieces import VarlenPieces
from .varlen_ring import _backward_setup, _finish, _outputs

TAG_KV, TAG_DKV = 70, 80  # message tags: k/v are TAG + 0/1


class VarlenPiecedRingAttention(torch.autograd.Function):
    """``apply(spec, q, k, v, sinks)`` -> ``(out, lse)`` of this rank's packed shard, K/V travelling in pieces."""

    @staticmethod
    def forward(ctx, spec: VarlenSpec, q, k, v, sinks):
        size, rank = spec.ring.world_size, spec.ring.rank
        ring = Ring(spec.ring.group, rank, size, q.device)
        cut = VarlenPieces(spec.keys, spec.ring.kv_pieces)
        q_slots = spec.query_slots(rank)
        calls = {(j, src): plan_calls(spec, q_slots, cut.slots(j, src), q.device)
                 for j in cut.pieces() for src in range(size)}

        def blocks():
            for j in cut.pieces():
                kv = [cut.take(j, rank, k), cut.take(j, rank, v)]
                for src in travel(ring, kv, TAG_KV, rank, size):
                    yield calls[(j, src)], kv[0], kv[1]

        acc, out = _outputs(spec, q, v, blocks())
        out, lse = _finish(acc, out, q, sinks)
        ctx.spec, ctx.cut, ctx.calls = spec, cut, calls
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        spec: VarlenSpec = ctx.spec
        cut: VarlenPieces = ctx.cut
        q, k, v, sinks, out, lse = ctx.saved_tensors
        size, rank = spec.ring.world_size, spec.ring.rank
        delta, dq = _backward_setup(spec, q, out, dout)
        blocks = BlockBackward(spec, q, out, dout, lse, delta, dq)
        ring = Ring(spec.ring.group, rank, size, q.device)
        dk, dv = (torch.zeros(t.shape, dtype=dq.dtype, device=t.device) for t in (k, v))
        for j in cut.pieces():
            kv = [cut.take(j, rank, k), cut.take(j, rank, v)]
            grads = [torch.zeros(t.shape, dtype=dq.dtype, device=t.device) for t in kv]
            for step in range(size):
                kv_pending = ring.shift(kv, TAG_KV) if step < size - 1 else None
                blocks.add(kv[0], kv[1], ctx.calls[(j, (rank - step) % size)], *grads)
                if kv_pending is not None:
                    kv = kv_pending.wait()
                grads = ring.shift(grads, TAG_DKV).wait()  # on to the next rank (after the last step: home)
            cut.put(j, rank, dk, grads[0])
            cut.put(j, rank, dv, grads[1])
        dsinks = sinks_grad(sinks, lse, delta).to(sinks.dtype) if ctx.needs_input_grad[4] else None
        return None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks
