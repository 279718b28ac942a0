"""Packed (varlen) ring attention as autograd Functions: the ring and the all-gather exchange.

The schedule is the dense ring's (`ring.py`, `allgather.py`), with packed shards: rank r's
K/V block holds its pieces of every sequence, so blocks of different ranks may differ by a few
rows; they travel padded to the longest K/V shard of the group (`VarlenLayout.max_tokens`), and the
dK/dV accumulators likewise, so every transfer has one shape on every rank. The local calls are
`varlen_block` (one varlen call per group of pieces, `varlen_calls`).
"""
from __future__ import annotations

import torch

from ..inputs import sinks_grad
from ..reference import accumulation_dtype
from .exchange import Ring, all_gather_start, reduce_scatter, travel
from .varlen_block import Accumulator, BlockBackward, forward_block
from .varlen_calls import VarlenSpec, plan_block

TAG_KV, TAG_DKV = 30, 40  # message tags: k/v are TAG + 0/1


def _padded(spec: VarlenSpec, t: torch.Tensor) -> torch.Tensor:
    """`t` ``(T_rank, H, D)`` as a contiguous ``(T_max, H, D)`` block, zero rows after its own."""
    block = t.new_zeros((spec.keys.max_tokens(),) + tuple(t.shape[1:]))
    block.narrow(0, 0, t.shape[0]).copy_(t)
    return block


def _outputs(spec: VarlenSpec, q, v, blocks) -> tuple:
    """Run the forward over every block (``blocks`` yields ``(its calls, k, v)``); ``(out, lse)`` of the shard."""
    tokens, heads = q.shape[0], q.shape[1]
    acc_dtype = accumulation_dtype(q.dtype)
    out = q.new_zeros((tokens, heads, v.shape[-1]), dtype=acc_dtype)
    acc = Accumulator(out, q.new_full((tokens, heads), -float("inf"), dtype=acc_dtype))
    for calls, k_block, v_block in blocks:
        forward_block(spec, q, k_block, v_block, calls, acc)
    return acc, out


def _finish(acc: Accumulator, out, q, sinks):
    acc.add_sinks(sinks)
    return out.to(q.dtype), acc.lse.t().to(torch.float32).contiguous()


def _backward_setup(spec: VarlenSpec, q, out, dout):
    acc = accumulation_dtype(q.dtype)
    delta = (dout.to(acc) * out.to(acc)).sum(dim=-1).t()  # (Hq, T)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    return delta, dq


class VarlenRingAttention(torch.autograd.Function):
    """``apply(spec, q, k, v, sinks)`` -> ``(out, lse)`` of this rank's packed shard (``lse`` not differentiable)."""

    @staticmethod
    def forward(ctx, spec: VarlenSpec, q, k, v, sinks):
        ring_spec = spec.ring
        size, rank = ring_spec.world_size, ring_spec.rank
        ring = Ring(ring_spec.group, rank, size, q.device) if size > 1 else None
        calls = {src: plan_block(spec, rank, src, q.device) for src in range(size)}

        def blocks():
            kv = [_padded(spec, k), _padded(spec, v)]
            for src in travel(ring, kv, TAG_KV, rank, size):
                yield calls[src], kv[0], kv[1]

        acc, out = _outputs(spec, q, v, blocks())
        out, lse = _finish(acc, out, q, sinks)
        ctx.spec, ctx.calls = spec, calls
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        spec: VarlenSpec = ctx.spec
        q, k, v, sinks, out, lse = ctx.saved_tensors
        size, rank = spec.ring.world_size, spec.ring.rank
        delta, dq = _backward_setup(spec, q, out, dout)
        blocks = BlockBackward(spec, q, out, dout, lse, delta, dq)
        ring = Ring(spec.ring.group, rank, size, q.device) if size > 1 else None
        kv = [_padded(spec, k), _padded(spec, v)]
        grads = [torch.zeros(t.shape, dtype=dq.dtype, device=t.device) for t in kv]
        for step in range(size):
            kv_pending = ring.shift(kv, TAG_KV) if step < size - 1 else None
            blocks.add(kv[0], kv[1], ctx.calls[(rank - step) % size], *grads)
            if kv_pending is not None:
                kv = kv_pending.wait()
            if ring is not None:  # on to the next rank; the next block's come in (after the last step: home)
                ring.shift_in_place(grads, TAG_DKV)
        tokens = k.shape[0]
        dsinks = sinks_grad(sinks, lse, delta).to(sinks.dtype) if ctx.needs_input_grad[4] else None
        return (None, dq.to(q.dtype), grads[0].narrow(0, 0, tokens).to(k.dtype),
                grads[1].narrow(0, 0, tokens).to(v.dtype), dsinks)


class VarlenAllGatherAttention(torch.autograd.Function):
    """The all-gather exchange for packed shards: every rank gathers the whole (padded) K/V once."""

    @staticmethod
    def forward(ctx, spec: VarlenSpec, q, k, v, sinks):
        ring_spec = spec.ring
        size, rank = ring_spec.world_size, ring_spec.rank
        calls = {src: plan_block(spec, rank, src, q.device) for src in range(size)}
        kv = [_padded(spec, k), _padded(spec, v)]
        pending = [all_gather_start(t, ring_spec.group, size) for t in kv]
        gathered = []

        def blocks():
            yield calls[rank], kv[0], kv[1]  # while gathering
            gathered.extend(p.wait() for p in pending)
            keys, values = gathered
            for src in range(size):
                if src != rank:
                    yield calls[src], keys[src], values[src]

        acc, out = _outputs(spec, q, v, blocks())
        out, lse = _finish(acc, out, q, sinks)
        ctx.spec, ctx.calls = spec, calls
        ctx.save_for_backward(q, k, v, sinks, out, lse, *gathered[0], *gathered[1])
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        spec: VarlenSpec = ctx.spec
        q, k, v, sinks, out, lse, *gathered = ctx.saved_tensors
        size = spec.ring.world_size
        keys, values = gathered[:size], gathered[size:]
        delta, dq = _backward_setup(spec, q, out, dout)
        blocks = BlockBackward(spec, q, out, dout, lse, delta, dq)
        dks, dvs = [], []
        for src in range(size):
            dk = torch.zeros(keys[src].shape, dtype=dq.dtype, device=q.device)
            dv = torch.zeros(values[src].shape, dtype=dq.dtype, device=q.device)
            blocks.add(keys[src], values[src], ctx.calls[src], dk, dv)
            dks.append(dk)
            dvs.append(dv)
        dk, dv = reduce_scatter(dks, spec.ring.group), reduce_scatter(dvs, spec.ring.group)
        tokens = k.shape[0]
        dsinks = sinks_grad(sinks, lse, delta).to(sinks.dtype) if ctx.needs_input_grad[4] else None
        return (None, dq.to(q.dtype), dk.narrow(0, 0, tokens).to(k.dtype), dv.narrow(0, 0, tokens).to(v.dtype),
                dsinks)
