"""Pieces shared by the forward and backward kernels: block ranges, score modifiers, dots.

Scores are kept in the log2 domain (``s * log2(e)``) so softmax uses ``exp2``.
Index arguments (``q_idx``, ``k_idx``) are 2-D broadcastable tensors, so the same
helper serves the forward (rows = queries) and the dK/dV kernel (rows = keys).
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def lse_log2(lse):
    """``lse * log2(e)`` for recomputing P = exp2(s2 - lse2); +inf for rows that saw nothing (so P = 0).

    The kernel-side twin of `attnx.limits.lse_log2`; a NaN lse stays NaN (its row's gradients too).
    """
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit
def load_rows(ptrs, rows, n_rows, offs_d, dim, DENSE: tl.constexpr, BOUNDARY: tl.constexpr):
    """A (rows, BLOCK_D) tile, zeros outside ``rows < n_rows`` and ``offs_d < dim``.

    The dense path has a full head dim, and its interior blocks (BOUNDARY False) no row past
    the end either, so it masks rows only at boundaries; the general path masks both.
    """
    if DENSE:
        if BOUNDARY:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < dim), other=0.0)
    return x


@triton.jit
def store_rows(ptrs, x, rows, n_rows, offs_d, dim, DENSE: tl.constexpr):
    """Store a (rows, BLOCK_D) tile where ``rows < n_rows`` (and ``offs_d < dim`` on the general path)."""
    if DENSE:
        tl.store(ptrs, x, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < dim))


@triton.jit
def dot(a, b, acc):
    """Matrix product; float32 operands use exact IEEE products (no TF32)."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def tanh(x):
    # exp2-based and stable for large |x|; tl has no portable tanh across vendors
    e = tl.math.exp2(tl.abs(x) * (-2.0 * LOG2E))  # tensor first: the interpreter needs it
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def block_range(lo_raw, hi, full_lo_raw, full_hi_raw, BLOCK: tl.constexpr):
    """Align [lo_raw, hi) to BLOCK steps from lo and split it into masked/unmasked parts.

    Returns ``lo, full_lo, full_hi, end``: blocks in [lo, full_lo) and [full_hi, end)
    need positional masking, blocks in [full_lo, full_hi) need none.
    """
    lo = (tl.maximum(lo_raw, 0) // BLOCK) * BLOCK
    end = lo + ((tl.maximum(hi - lo, 0) + BLOCK - 1) // BLOCK) * BLOCK
    full_lo = lo + ((tl.maximum(full_lo_raw - lo, 0) + BLOCK - 1) // BLOCK) * BLOCK
    full_lo = tl.minimum(full_lo, end)
    full_hi = lo + (tl.maximum(full_hi_raw - lo, 0) // BLOCK) * BLOCK
    full_hi = tl.maximum(tl.minimum(full_hi, end), full_lo)
    return lo, full_lo, full_hi, end


@triton.jit
def scores(qk, q_idx, k_idx, scale, softcap, slope, mask_base, stride_mask_m, stride_mask_n,
           key_offset, seqlen_q, seqlen_k, window_left, window_right,
           DENSE: tl.constexpr, BOUNDARY: tl.constexpr):
    """Final scores in the log2 domain, -inf where a key may not be seen, and tanh for softcap's derivative.

    ``qk`` is the raw dot product; order (docs/semantics.md): scale -> softcap -> alibi -> mask -> window.
    The general path (DENSE False) always adds alibi (slope 0 when absent) and an additive float32
    mask (bool masks arrive as 0/-inf; no mask = a zero-stride zero), so it has no
    further variants.
    """
    if not DENSE:
        s = qk * scale
        t = s
        if softcap > 0.0:
            t = tanh(s / softcap)
            s = softcap * t
        pos = q_idx + key_offset
        s2 = s * LOG2E - (slope * LOG2E) * tl.abs(pos - k_idx).to(tl.float32)
        inside = (q_idx < seqlen_q) & (k_idx < seqlen_k)
        bias = tl.load(mask_base + q_idx.to(tl.int64) * stride_mask_m + k_idx.to(tl.int64) * stride_mask_n,
                       mask=inside, other=0.0)
        s2 = s2 + bias * LOG2E
    else:
        s2 = qk * (scale * LOG2E)
        t = s2
    if BOUNDARY:
        pos = q_idx + key_offset
        allowed = (k_idx < seqlen_k) & (k_idx >= pos - window_left) & (k_idx <= pos + window_right)
        s2 = tl.where(allowed, s2, float("-inf"))
    return s2, t
