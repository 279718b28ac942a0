"""Pieces shared by the forward and backward kernels: block ranges, score modifiers, dots.

Scores are kept in the log2 domain (``s * log2(e)``) so softmax uses ``exp2``.
Index arguments (``q_idx``, ``k_idx``) are 2-D broadcastable tensors, so the same
helper serves the forward (rows = queries) and the dK/dV kernel (rows = keys).
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# kv_mode, a runtime argument (no variant per format): how sequence b's keys are found
KV_DENSE = tl.constexpr(0)    # (B, Hkv, Sk, D): every sequence has Sk keys
KV_VARLEN = tl.constexpr(1)   # packed (total_k, Hkv, D): keys cu_seqlens_k[b]:cu_seqlens_k[b+1]
KV_CACHE = tl.constexpr(2)    # (B, Hkv, capacity, D): the first seqlens_k[b] keys
KV_PAGED = tl.constexpr(3)    # page pools (pages, page_size, Hkv, D) through page_table[b]


@triton.jit
def _clamp(x, lo, hi):
    return tl.minimum(tl.maximum(x, lo), hi)


@triton.jit
def seq_info(b, CuQ, CuK, SeqlensK, seqlen_q, seqlen_k, key_offset, q_varlen, kv_mode, align_br,
             total_q, total_k):
    """Sequence b's ``(q_start, seqlen_q, k_start, seqlen_k, key_offset)``.

    Dense q/kv give ``(0, seqlen_q, 0, seqlen_k, key_offset)`` unchanged. Packed formats read
    ``cu_seqlens`` and caches ``seqlens_k``; the values are clamped to the buffers (packed
    starts/ends into ``[0, total]`` rising, cache lengths into ``[0, capacity]``), so whatever an
    index tensor holds no row outside the tensors is read or written. ``align_br`` 1 makes the
    alignment bottom-right per sequence (``key_offset + Sk_b - Sq_b``).
    """
    is_qv = q_varlen != 0
    q_start = _clamp(tl.load(CuQ + b, mask=is_qv, other=0), 0, total_q)
    q_end = _clamp(tl.load(CuQ + b + 1, mask=is_qv, other=0), q_start, total_q)
    q_len = tl.where(is_qv, q_end - q_start, seqlen_q)
    is_kv = kv_mode == KV_VARLEN
    k_start = _clamp(tl.load(CuK + b, mask=is_kv, other=0), 0, total_k)
    k_end = _clamp(tl.load(CuK + b + 1, mask=is_kv, other=0), k_start, total_k)
    is_cache = kv_mode >= KV_CACHE
    cached = _clamp(tl.load(SeqlensK + b, mask=is_cache, other=0), 0, seqlen_k)
    k_len = tl.where(is_kv, k_end - k_start, tl.where(is_cache, cached, seqlen_k))
    offset = key_offset + align_br * (k_len - q_len)
    return q_start, q_len, k_start, k_len, offset


@triton.jit
def kv_offsets(offs_kn, n_keys, pt_row, kv_mode, page_size, num_pages, stride_kp, stride_kn, stride_vp,
               stride_vn):
    """Element offsets (int64) of keys ``offs_kn`` of one sequence in K and V.

    Paged: key j is row ``j % page_size`` of page ``page_table[b, j // page_size]`` (the table
    read only for keys below ``n_keys``, pages clamped into the pool); otherwise row j from the
    sequence's base pointer.
    """
    if kv_mode == KV_PAGED:
        page = tl.load(pt_row + offs_kn // page_size, mask=offs_kn < n_keys, other=0)
        page = _clamp(page, 0, num_pages - 1).to(tl.int64)
        within = (offs_kn % page_size).to(tl.int64)
        k_off = page * stride_kp + within * stride_kn
        v_off = page * stride_vp + within * stride_vn
    else:
        rows = offs_kn.to(tl.int64)
        k_off = rows * stride_kn
        v_off = rows * stride_vn
    return k_off, v_off


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
