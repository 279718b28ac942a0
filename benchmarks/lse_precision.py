"""A CPU model of the forward kernels' row sum and lse, in float32 and in the kernels' order of operations.

    python -m benchmarks.lse_precision [--seqlen N] [--rows R] [--seed S] [--causal]

Why: on the H200 (2026-12-02, benchmarks/results/h200-2026-12-02/huge.md) the cuda backend's Hopper
forward returned lse 2.7e-3 (causal 2.1e-3) off a float64 reference at B = H = 1, S = 2**20, D = 128,
bf16, q ~ N(0, 3^2), while triton was 4e-6 off and out matched triton's error. The inputs are drawn as
benchmarks/huge.py draws them (CPU generator, so the numbers differ from the GPU's draw, not their
statistics); R query rows spread over S are modelled against every key.

Columns (lse abs error against float64, per row):
* kernel      sm90/fa_fwd.cu `softmax_block` as compiled (sm80/fa_fwd.cu does the same per row): key
              blocks of 128 from the last to the first; running max in score units, shift = max * unit
              (float32, unit = scale * log2 e); alpha = exp2(old_max * unit - shift) where NVRTC's default
              -fmad=true contracts the product into the FFMA, so the product is not rounded (fma below);
              p = exp2(fma(x, unit, -shift)); each of the 4 threads of a row sums (p0 + p1) of its 2 columns
              of each 8-column chunk, chunks 0..15 in order, then r.sum = fma(r.sum, alpha, partial);
              quad_sum ((t0 + t1) + (t2 + t3)); lse = (shift + log2(total)) * ln2 (softmax_finish, no sink).
* kahan       the kernel with a Kahan-compensated running sum per thread (c rescaled by alpha too).
* alpha-fix   the kernel with alpha = exp2(round(old_max * unit) - shift): the product rounded as the
              shift that produced the old p values was (EXACT_ALPHA=1 in the kernels).
* triton      backends/triton/kernels_fwd.py: s2 = qk * (scale * log2 e) in float32, blocks first to last,
              m = max(s2), p = exp2(s2 - m), alpha = exp2(m_old - m_new), l = fma(l, alpha, tl.sum(p))
              with tl.sum taken as a pairwise tree over the 128 keys (BLOCK_N 128 assumed).
* predicted   the first-order effect of the contracted alpha on the kernel column: every block multiplies
              the sum so far by 2^(m * unit - round(m * unit)), m the max before it (1 would be exact);
              ln2 * the sum over blocks of that exponent, each weighted by the share of the final sum
              already accumulated before it.

Arithmetic: numpy float32 is IEEE round-to-nearest like the GPU's FADD/FMUL/FFMA; an FFMA is modelled as
the exact float64 product (24 x 24 bits fit in 53) plus the addend rounded to float64, then to float32
(the double rounding is off by at most one float32 ulp, rarely). The scores are a float32 matmul of the
bf16 inputs (torch on the CPU; wgmma's summation order differs, which at D = 128 moves a score by a few
float32 ulps, uncorrelated with the effect modelled). exp2 is numpy's float32 exp2 (correctly rounded
or nearly); the GPU's ex2.approx.ftz.f32 is within ~2 ulp of it, an error that is not systematic per row.
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

BLOCK = 128          # keys per block (sm90 d128: BLOCK_N 128; triton BLOCK_N 128 assumed)
HEAD_DIM = 128
Q_STD = 3.0          # benchmarks/huge.py's Q_STD
CHUNKS, PAIR_THREADS = 16, 4   # 8-column chunks per block; threads per row (a quad)
LOG2E = 1.4426950408889634
F32 = np.float32
COLUMNS = ("kernel", "kahan", "alpha-fix", "triton")


def draw(seqlen: int, seed: int):
    """q, k as benchmarks/huge.py's make_inputs draws them (B = H = 1; v and dout are not needed)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(seqlen, HEAD_DIM, generator=gen, dtype=torch.bfloat16).mul_(Q_STD)
    k = torch.randn(seqlen, HEAD_DIM, generator=gen, dtype=torch.bfloat16)
    return q, k


def sample_rows(seqlen: int, rows: int) -> np.ndarray:
    """`rows` query positions spread over the sequence, first and last included (as huge.py's 64)."""
    return np.unique(np.arange(rows) * (seqlen - 1) // max(rows - 1, 1))


def scores(q, k, rows, chunk=1 << 16):
    """(float32 raw q.k, float64 q.k) of the sampled rows against every key."""
    qr = q[torch.as_tensor(rows)]
    q32, q64 = qr.float(), qr.double()
    s32 = np.empty((len(rows), k.shape[0]), np.float32)
    s64 = np.empty((len(rows), k.shape[0]), np.float64)
    for j in range(0, k.shape[0], chunk):
        kc = k[j:j + chunk]
        s32[:, j:j + chunk] = (q32 @ kc.float().T).numpy()
        s64[:, j:j + chunk] = (q64 @ kc.double().T).numpy()
    return s32, s64


def fma32(a, b, c):
    """float32 fma(a, b, c): exact product in float64, one add, rounded to float32."""
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(F32)


def reference_lse(s64, scale, rows, causal):
    s = s64 * scale
    if causal:
        s = np.where(np.arange(s.shape[1])[None, :] > rows[:, None], -np.inf, s)
    m = s.max(1)
    return m + np.log(np.exp(s - m[:, None]).sum(1))


def blocks_of(s32, rows, causal, reverse):
    """(R, nblk, 128) float32 scores per key block in processing order (-inf masked, and past the end),
    and how many blocks each row visits (the first `n` of its order)."""
    r, n = s32.shape
    nblk = -(-n // BLOCK)
    x = np.full((r, nblk * BLOCK), -np.inf, np.float32)
    x[:, :n] = s32
    if causal:
        x[np.arange(nblk * BLOCK)[None, :] > rows[:, None]] = -np.inf
    x = x.reshape(r, nblk, BLOCK)
    seen = (rows // BLOCK + 1) if causal else np.full(r, nblk)
    if reverse:  # the Hopper kernel walks from the last visible block (the diagonal one) down to block 0
        out = np.full_like(x, -np.inf)
        for i in range(r):
            out[i, :seen[i]] = x[i, :seen[i]][::-1]
        x = out
    return x, seen


def kernel_lse(s32, rows, scale, causal, kahan=False, exact_alpha=False):
    """The sm90 forward's lse of each row (see the module docstring), in float32."""
    unit = F32(scale * LOG2E)              # p.scale_log2: float32 of the double product (launch.py)
    x, seen = blocks_of(s32, rows, causal, reverse=True)
    r, nblk, _ = x.shape
    mx = np.maximum.accumulate(x.max(2), axis=1)                      # running max after each block (exact)
    old = np.concatenate([np.full((r, 1), -np.inf, np.float32), mx[:, :-1]], axis=1)
    finite = mx != -np.inf
    shift = np.where(finite, mx * unit, F32(0)).astype(F32)           # max_shift
    with np.errstate(invalid="ignore", over="ignore"):
        if exact_alpha:   # round(old * unit) - shift: 0 while the max stays, so alpha = 1 exactly
            arg = (old * unit).astype(F32) - shift
        else:             # FFMA: old * unit unrounded, minus the rounded shift
            arg = fma32(old, unit, -shift)
        alpha = np.exp2(arg.astype(F32)).astype(F32)
        alpha = np.where(old == -np.inf, F32(0), alpha).astype(F32)   # exp2(-inf) = 0
        p = np.exp2(fma32(x, unit, -shift[:, :, None])).astype(F32)   # (R, nblk, 128)
    # column c*8 + 2*t4 + e of a block is element e of thread t4's pair in chunk c
    p = p.reshape(r, nblk, CHUNKS, PAIR_THREADS, 2)
    pairs = (p[..., 0] + p[..., 1]).astype(F32)                        # p0 + p1
    part = pairs[:, :, 0, :].copy()                                    # 0.f + (p0 + p1) is exact
    for c in range(1, CHUNKS):
        part = (part + pairs[:, :, c, :]).astype(F32)                  # (R, nblk, 4): sum[half] in order
    total = np.zeros((r, PAIR_THREADS), np.float32)
    comp = np.zeros((r, PAIR_THREADS), np.float32)
    for b in range(nblk):
        a = alpha[:, b:b + 1]
        live = (b < seen)[:, None]
        if kahan:
            s = (total * a).astype(F32)
            c = (comp * a).astype(F32)
            y = (part[:, b, :] - c).astype(F32)
            t = (s + y).astype(F32)
            comp = np.where(live, ((t - s).astype(F32) - y).astype(F32), comp)
            total = np.where(live, t, total)
        else:
            total = np.where(live, fma32(total, a, part[:, b, :]), total)
    if kahan:
        total = (total - comp).astype(F32)
    quad = ((total[:, 0] + total[:, 1]).astype(F32) + (total[:, 2] + total[:, 3]).astype(F32)).astype(F32)
    last = shift[np.arange(r), seen - 1]
    lse = ((last + np.log2(quad).astype(F32)).astype(F32) * F32(math.log(2))).astype(F32)
    # first order: each block's factor 2^(old * unit - round(old * unit)) while the max stays; a block's
    # factor reaches the part of the sum accumulated before it
    visited = np.arange(nblk)[None, :] < seen[:, None]
    with np.errstate(invalid="ignore"):
        rounding = old.astype(np.float64) * np.float64(unit) - (old * unit).astype(F32).astype(np.float64)
    err_exp = np.where(np.isfinite(old) & visited, rounding, 0.0)
    exact = part.sum(2).astype(np.float64) * np.exp2(shift.astype(np.float64) - last[:, None])
    share = np.cumsum(np.where(visited, exact, 0.0), 1)
    share /= share[:, -1:]
    prev_share = np.concatenate([np.zeros((r, 1)), share[:, :-1]], 1)
    predicted = math.log(2) * (err_exp * prev_share).sum(1)
    return lse.astype(np.float64), predicted


def tree_sum32(p):
    """Pairwise sum of the last axis (a power of two long) in float32."""
    while p.shape[-1] > 1:
        p = (p[..., 0::2] + p[..., 1::2]).astype(F32)
    return p[..., 0]


def triton_lse(s32, rows, scale, causal):
    unit = F32(F32(scale) * F32(LOG2E))
    x, seen = blocks_of(s32, rows, causal, reverse=False)
    r, nblk, _ = x.shape
    s2 = (x * unit).astype(F32)
    mx = np.maximum.accumulate(s2.max(2), axis=1)
    old = np.concatenate([np.full((r, 1), -np.inf, np.float32), mx[:, :-1]], axis=1)
    use = np.where(mx == -np.inf, F32(0), mx).astype(F32)
    with np.errstate(invalid="ignore", over="ignore"):
        alpha = np.where(old == -np.inf, F32(0), np.exp2((old - use).astype(F32))).astype(F32)
        bsum = tree_sum32(np.exp2((s2 - use[:, :, None]).astype(F32)).astype(F32))
    l = np.zeros(r, np.float32)
    for b in range(nblk):
        l = np.where(b < seen, fma32(l, alpha[:, b], bsum[:, b]), l)
    m = use[np.arange(r), seen - 1]
    return ((m + np.log2(l).astype(F32)).astype(F32) * F32(math.log(2))).astype(np.float64)


def model(seqlen=1 << 20, rows=8, seed=0, causal=False):
    """Per row: position, reference lse, and {column: lse abs error}, plus the predicted kernel error."""
    q, k = draw(seqlen, seed)
    pos = sample_rows(seqlen, rows)
    s32, s64 = scores(q, k, pos)
    del q, k
    scale = HEAD_DIM ** -0.5
    ref = reference_lse(s64, scale, pos, causal)
    got = {}
    got["kernel"], predicted = kernel_lse(s32, pos, scale, causal)
    got["kahan"], _ = kernel_lse(s32, pos, scale, causal, kahan=True)
    got["alpha-fix"], _ = kernel_lse(s32, pos, scale, causal, exact_alpha=True)
    got["triton"] = triton_lse(s32, pos, scale, causal)
    err = {c: got[c] - ref for c in COLUMNS}
    return pos, ref, err, predicted


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=1 << 20)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--causal", action="store_true")
    a = ap.parse_args(argv)
    start = time.perf_counter()
    pos, ref, err, predicted = model(a.seqlen, a.rows, a.seed, a.causal)
    print(f"S={a.seqlen} D={HEAD_DIM} bf16 q~N(0,{Q_STD:g}^2) seed {a.seed}{' causal' if a.causal else ''}: "
          f"lse - float64 reference ({time.perf_counter() - start:.1f} s)")
    print(f"| row | lse | {' | '.join(COLUMNS)} | predicted |")
    print("|" + " --- |" * (len(COLUMNS) + 3))
    for i, p in enumerate(pos):
        cells = " | ".join(f"{err[c][i]:+.1e}" for c in COLUMNS)
        print(f"| {p} | {ref[i]:.3f} | {cells} | {predicted[i]:+.1e} |")
    worst = " | ".join(f"{np.abs(err[c]).max():.1e}" for c in COLUMNS)
    print(f"| max abs | | {worst} | {np.abs(predicted).max():.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
