"""The torch backend's NaN-row lse fix-up on CUDA in two Triton launches (`cuda.nan_rows_to_lse` runs it).

torch's fused kernels leave lse finite in rows that see a NaN (their out is NaN, as the contract says);
the contract's lse is NaN there, and the backward needs it (a row that sees a NaN key must make dk/dv
NaN at that key). The same marking in torch ops (`cuda.nan_rows_by_ops`, the reference the tests hold
this to) took a dozen launches, mostly host time: on the H200 (2026-12-02, B16 1k-token bf16 training
steps) 0.74-0.88x SDPA-cuDNN's step with them, 0.93-0.97x with these two kernels, 0.94-1.00x with no
fix-up at all (benchmarks/nan_fixup.py).

1. `_first_nan_key`: per (batch, kv head) and chunk of keys, the first key index holding a NaN (Sk if
   none), written to a small (B * Hkv, chunks) int32 table;
2. `_mark_lse`: per (batch, q head) and block of rows, whether the q row holds a NaN, then the first
   NaN key of its kv head (min over the chunks): seen under causal when it is <= the row (Sq == Sk,
   the only causal problems this path takes), else when there is one at all; lse is written NaN in
   place where either holds. `Q_ROWS=False` (lse kept only for the backward) skips the q rows: a NaN
   q row makes its own scores and probabilities NaN whatever its lse, so only keys need marking.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnx.backends.triton import cache_fallback

BLOCK_N = 64
BLOCK_M = 64
MAX_CHUNKS = 64  # key chunks per (batch, kv head): the second kernel reads them as one vector


@triton.jit
def _first_nan_key(k_ptr, first_ptr, heads_kv, seqlen_k, head_dim, chunk, chunks,
                   stride_b, stride_h, stride_s, stride_d,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0)
    c = tl.program_id(1)
    base = k_ptr + (bh // heads_kv).to(tl.int64) * stride_b + (bh % heads_kv).to(tl.int64) * stride_h
    cols = tl.arange(0, BLOCK_D)
    first = seqlen_k
    start = c * chunk
    end = tl.minimum(start + chunk, seqlen_k)
    for block in range(start, end, BLOCK_N):
        rows = block + tl.arange(0, BLOCK_N)
        inside = (rows[:, None] < end) & (cols[None, :] < head_dim)
        x = tl.load(base + rows[:, None].to(tl.int64) * stride_s + cols[None, :] * stride_d, mask=inside, other=0.0)
        x = x.to(tl.float32)  # (Triton's CPU interpreter compares 16-bit floats as raw bits)
        bad = tl.max((x != x).to(tl.int32), axis=1)
        first = tl.minimum(first, tl.min(tl.where(bad > 0, rows, seqlen_k), axis=0))
    tl.store(first_ptr + bh * chunks + c, first)


@triton.jit
def _mark_lse(q_ptr, first_ptr, lse_ptr, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, chunks,
              stride_b, stride_h, stride_s, stride_d,
              CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, CHUNKS: tl.constexpr,
              Q_ROWS: tl.constexpr = True):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads_q
    h = bh % heads_q
    group = heads_q // heads_kv
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if Q_ROWS:
        cols = tl.arange(0, BLOCK_D)
        base = q_ptr + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
        inside = (rows[:, None] < seqlen_q) & (cols[None, :] < head_dim)
        x = tl.load(base + rows[:, None].to(tl.int64) * stride_s + cols[None, :] * stride_d, mask=inside, other=0.0)
        x = x.to(tl.float32)
        q_bad = tl.max((x != x).to(tl.int32), axis=1) > 0
    else:
        q_bad = rows < 0
    part = tl.arange(0, CHUNKS)
    firsts = tl.load(first_ptr + (b * heads_kv + h // group) * chunks + part, mask=part < chunks, other=seqlen_k)
    first = tl.min(firsts, axis=0)
    if CAUSAL:
        seen = rows >= first
    else:
        seen = (rows * 0 + first) < seqlen_k
    nan = tl.full([BLOCK_M], float("nan"), tl.float32)
    tl.store(lse_ptr + bh.to(tl.int64) * seqlen_q + rows, nan, mask=(rows < seqlen_q) & (q_bad | seen))


@cache_fallback.survives_cache_errors
def mark_nan_rows(causal: bool, q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor,
                  q_rows: bool = True) -> torch.Tensor:
    """`lse` (float32, contiguous (B, Hq, Sq)) with NaN, in place, in every row whose q row holds a NaN or
    that sees a key holding one (all keys; keys 0..i under causal with Sq == Sk). q, k: (B, H, S, D).
    `q_rows=False` marks only the rows that see a NaN key (q is not read: half the bytes without GQA)."""
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    if lse.numel() == 0:
        return lse
    chunk = max(BLOCK_N, triton.cdiv(triton.cdiv(max(seqlen_k, 1), MAX_CHUNKS), BLOCK_N) * BLOCK_N)
    chunks = max(1, triton.cdiv(seqlen_k, chunk))
    first = torch.empty(batch * heads_kv * chunks, dtype=torch.int32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    _first_nan_key[(batch * heads_kv, chunks)](k, first, heads_kv, seqlen_k, head_dim, chunk, chunks, *k.stride(),
                                               BLOCK_N=BLOCK_N, BLOCK_D=block_d)
    grid = (triton.cdiv(seqlen_q, BLOCK_M), batch * heads_q)
    _mark_lse[grid](q, first, lse, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, chunks, *q.stride(),
                    CAUSAL=causal, BLOCK_M=BLOCK_M, BLOCK_D=block_d, CHUNKS=triton.next_power_of_2(chunks),
                    Q_ROWS=q_rows)
    return lse
