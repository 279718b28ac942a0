"""The backward of one rank's queries against one K/V block, by FlashAttention's rule, in torch ops.

Given the *global* ``out`` and ``lse`` of the rank's queries, the gradients of one pair are
those of FlashAttention's backward: ``P = exp(S - lse)``, ``dV = P^T dO``,
``dS = P * (dO V^T - delta)`` with ``delta = rowsum(dO * out)``, ``dQ = dS K * scale``,
``dK = dS^T Q * scale`` (softcap multiplies ``dS`` by ``1 - tanh^2``). The ring runs each block
on a backend's own backward kernel (`block_backward`, through `attnx.attention_backward`); this
rule is the fallback for the pieces no backend takes with a given lse (float64 inputs by
default; ``backend="naive"``, whose backward recomputes its own normaliser).
"""
from __future__ import annotations

import torch

from .schedule import SOME, key_span, pairs, rows
from .spec import RingSpec

# score tiles: about this many elements (1 MiB of float32, cache-sized), and at least MIN_TILE
# rows x MIN_TILE columns per head (measured on a 2-core x86 CPU, fp32, D = 64)
TILE_ELEMENTS = 1 << 18
MIN_TILE = 128
INF = float("inf")


def backward_block(spec: RingSpec, q, k, v, dout, lse, delta, q_chunks, k_chunks, dq, dk, dv) -> bool:
    """Add the gradients of the queries `q` against the block `k`, `v` to `dq`, `dk`, `dv`.

    ``dout``, ``lse`` and ``delta = rowsum(dout * out)`` are the rank's (global ``out`` and ``lse``);
    the accumulators are in the accumulation dtype. Returns False when every pair was skipped.
    """
    computed = False
    acc = dq.dtype
    k_acc, v_acc = k.to(acc), v.to(acc)
    for _, qc, kc, seen in pairs(spec, q_chunks, k_chunks):
        computed = True
        _pair_backward(spec, rows(q, qc), rows(k_acc, kc), rows(v_acc, kc), rows(dout, qc),
                       lse.narrow(2, qc.start, qc.length), delta.narrow(2, qc.start, qc.length),
                       qc.position + spec.offset, kc.position, seen, rows(dq, qc), rows(dk, kc), rows(dv, kc))
    return computed


def _batched(t: torch.Tensor) -> torch.Tensor:
    """``(B, H, S, W)`` (a dim-2 slice of a contiguous tensor) as ``(B * H, S, W)``, a view."""
    return t.view(-1, t.shape[-2], t.shape[-1])


def _pair_backward(spec: RingSpec, q, k, v, dout, lse, delta, q_pos: int, k_pos: int, seen: str, dq, dk, dv):
    """FlashAttention's backward of one pair, over tiles of query rows x key columns.

    ``k``, ``v`` (already in the accumulation dtype) and the accumulators ``dk``, ``dv`` are
    dim-2 slices of contiguous ``(B, Hkv, S, W)`` tensors; dK/dV accumulate inside the GEMMs.
    Each row tile reads only the key columns its band can reach (`schedule.key_span`), so the
    diagonal pairs of a causal mask cost about half a full pair.
    """
    acc = dq.dtype
    batch, heads_q, rows, head_dim = q.shape
    heads_kv, keys, width_v = k.shape[1], k.shape[2], v.shape[-1]
    group = heads_q // heads_kv
    per_row = batch * heads_q
    block_n = min(keys, max(MIN_TILE, TILE_ELEMENTS // (per_row * MIN_TILE)))
    block_m = min(rows, max(MIN_TILE, TILE_ELEMENTS // (per_row * block_n)))
    slopes = None
    if spec.alibi_slopes is not None:
        slopes = spec.alibi_slopes.to(acc).reshape(-1, heads_kv, group, 1, 1)
    # the score scale (and 1 / softcap) folded into the query tile: one pass less over the scores
    q_scale = spec.scale if spec.softcap is None else spec.scale / spec.softcap
    k3, v3, dk3, dv3 = (_batched(t) for t in (k, v, dk, dv))
    for a in range(0, rows, block_m):
        n = min(block_m, rows - a)
        lo, hi = key_span(spec, q_pos + a, q_pos + a + n - 1, k_pos, keys, seen)
        if hi <= lo:
            continue

        def grouped(t, width):  # rows a..a+n of (B, Hq, S, width) -> (B * Hkv, G * n, width)
            return t.narrow(2, a, n).to(acc).reshape(batch * heads_kv, group * n, width)

        q_t, do_t = grouped(q, head_dim), grouped(dout, width_v)
        q_scaled = q_t * q_scale
        lse_t = grouped(lse.unsqueeze(-1), 1)
        # rows that saw no key have lse = -inf: +inf makes exp(s - lse) = 0 for them
        neg_lse = lse_t.masked_fill(lse_t == -INF, INF).neg_()
        neg_delta = grouped(delta.unsqueeze(-1), 1).neg()
        dq_t = torch.zeros_like(q_t)
        pos = torch.arange(q_pos + a, q_pos + a + n, device=q.device)[:, None]
        for j0 in range(lo, hi, block_n):
            cols = min(block_n, hi - j0)
            k_t, v_t = k3.narrow(1, j0, cols), v3.narrow(1, j0, cols)
            plain = spec.softcap is None and slopes is None and seen != SOME
            if plain:  # s - lse in one GEMM
                s = torch.baddbmm(neg_lse, q_scaled, k_t.transpose(1, 2))
            else:
                s = torch.bmm(q_scaled, k_t.transpose(1, 2))
            tanh = None
            if spec.softcap is not None:
                tanh = s.tanh_()
                s = tanh * spec.softcap
            if not plain:
                s5 = s.view(batch, heads_kv, group, n, cols)
                key_idx = torch.arange(k_pos + j0, k_pos + j0 + cols, device=q.device)[None, :]
                if slopes is not None:
                    s5.sub_(slopes * (pos - key_idx).abs().to(acc))
                if seen == SOME:
                    hidden = torch.zeros(n, cols, dtype=torch.bool, device=q.device)
                    if spec.window_left is not None:
                        hidden |= key_idx < pos - spec.window_left
                    if spec.window_right is not None:
                        hidden |= key_idx > pos + spec.window_right
                    s5.masked_fill_(hidden, -INF)
                s.add_(neg_lse)
            p = s.exp_()
            dv3.narrow(1, j0, cols).baddbmm_(p.transpose(1, 2), do_t)
            ds = torch.baddbmm(neg_delta, do_t, v_t.transpose(1, 2)).mul_(p)
            if tanh is not None:
                ds.mul_(tanh.square_().neg_().add_(1.0))
            dq_t.baddbmm_(ds, k_t, alpha=spec.scale)
            dk3.narrow(1, j0, cols).baddbmm_(ds.transpose(1, 2), q_t, alpha=spec.scale)
        dq.narrow(2, a, n).add_(dq_t.view(batch, heads_q, n, head_dim))
