"""FlashAttention-2 backward in Triton: recompute probabilities from lse, never store scores.

Three launches, no atomics (so results are bitwise reproducible):
  1. ``bwd_preprocess``: delta = rowsum(dO * O);
  2. ``bwd_dkdv``: one program per key block and kv head, looping over the query heads
     of its group and the query blocks that can see it (GQA sums in registers);
  3. ``bwd_dq``: one program per query block and query head, looping over key blocks.
"""
import triton
import triton.language as tl

from .kernels_common import block_range, dot, load_rows, lse_log2, scores, seq_info, store_rows


@triton.jit(do_not_specialize=["heads_q", "seqlen_q", "head_dim_v", "q_varlen", "total_q", "stride_lse_b",
                            "stride_lse_h"])
def bwd_preprocess(Out, dOut, Delta, CuQ,
                   stride_ob, stride_oh, stride_om, stride_od,
                   stride_dob, stride_doh, stride_dom, stride_dod,
                   stride_lse_b, stride_lse_h,
                   heads_q, seqlen_q, head_dim_v, q_varlen, total_q,
                   BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // heads_q).to(tl.int64)
    h = (pid_bh % heads_q).to(tl.int64)
    # only the query side of the format matters here (kv_mode 0: no key index is read)
    q_start, seqlen_q, _, _, _ = seq_info(b, CuQ, CuQ, CuQ, seqlen_q, 0, 0, q_varlen, 0, 0, total_q, 0)
    if pid_m * BLOCK_M >= seqlen_q:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    inside = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < head_dim_v)
    rows = (q_start.to(tl.int64) + offs_m)[:, None]
    o = tl.load(Out + b * stride_ob + h * stride_oh + rows * stride_om + offs_d[None, :] * stride_od,
                mask=inside, other=0.0)
    do = tl.load(dOut + b * stride_dob + h * stride_doh + rows * stride_dom + offs_d[None, :] * stride_dod,
                 mask=inside, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    # delta has lse's layout: (B, Hq, Sq) or (Hq, total_q)
    tl.store(Delta + b * stride_lse_b + h * stride_lse_h + q_start + offs_m, delta, mask=offs_m < seqlen_q)


@triton.jit
def _dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dmask_base,
                 stride_qm, stride_qd, stride_dom, stride_dod,
                 mask_base, stride_mask_m, stride_mask_n, slope, offs_n, offs_m, offs_d,
                 lo, hi, split, gap, scale, softcap, key_offset, seqlen_q, seqlen_k, head_dim, head_dim_v,
                 window_left, window_right, store_dmask,
                 BLOCK_M: tl.constexpr, DENSE: tl.constexpr, BOUNDARY: tl.constexpr):
    # transposed formulation (rows = keys) so dV += P^T dO and dK += dS^T Q need no transposes of P
    for i in range(0, (hi - lo) // BLOCK_M):
        start_m = lo + i * BLOCK_M
        if BOUNDARY:
            start_m = tl.where(start_m < split, start_m, start_m + gap)
        offs_qm = start_m + offs_m
        rows = offs_qm.to(tl.int64)[:, None]
        q_ptrs = q_base + rows * stride_qm + offs_d[None, :] * stride_qd
        do_ptrs = do_base + rows * stride_dom + offs_d[None, :] * stride_dod
        q = load_rows(q_ptrs, offs_qm, seqlen_q, offs_d, head_dim, DENSE, BOUNDARY)
        do = load_rows(do_ptrs, offs_qm, seqlen_q, offs_d, head_dim_v, DENSE, BOUNDARY)
        # rows past Sq and rows that saw no key get lse = +inf, hence P = 0
        lse2 = lse_log2(tl.load(lse_base + offs_qm, mask=offs_qm < seqlen_q, other=float("inf")))
        delta = tl.load(delta_base + offs_qm, mask=offs_qm < seqlen_q, other=0.0)
        qk_t = dot(k, tl.trans(q), tl.zeros([k.shape[0], BLOCK_M], dtype=tl.float32))
        s2_t, t_t = scores(qk_t, offs_qm[None, :], offs_n[:, None], scale, softcap, slope, mask_base,
                           stride_mask_m, stride_mask_n, key_offset, seqlen_q, seqlen_k, window_left, window_right,
                           DENSE, BOUNDARY)
        p_t = tl.math.exp2(s2_t - lse2[None, :])
        dv = dot(p_t.to(do.dtype), do, dv)
        dp_t = dot(v, tl.trans(do), tl.zeros([k.shape[0], BLOCK_M], dtype=tl.float32))
        ds_t = p_t * (dp_t - delta[None, :])
        if not DENSE:
            if store_dmask != 0:
                # gradient of an additive mask = gradient of the final score
                dm_ptrs = dmask_base + offs_qm.to(tl.int64)[None, :] * seqlen_k + offs_n[:, None]
                tl.store(dm_ptrs, ds_t, mask=(offs_qm[None, :] < seqlen_q) & (offs_n[:, None] < seqlen_k))
            if softcap > 0.0:
                ds_t = ds_t * (1.0 - t_t * t_t)
        dk = dot(ds_t.to(q.dtype), q, dk)
    return dk, dv


@triton.jit(do_not_specialize=["heads_q", "heads_kv", "group_size", "seqlen_q", "seqlen_k", "head_dim",
                            "head_dim_v", "key_offset", "window_left", "window_right", "store_dmask",
                            "q_varlen", "kv_mode", "align_br", "total_q", "total_k", "seq_bucket",
                            "stride_lse_b", "stride_lse_h"])
def bwd_dkdv(Q, K, V, dOut, Lse, Delta, dK, dV, Mask, Slopes, dMask, CuQ, CuK, SeqlensK,
             stride_qb, stride_qh, stride_qm, stride_qd,
             stride_kb, stride_kh, stride_kn, stride_kd,
             stride_vb, stride_vh, stride_vn, stride_vd,
             stride_dob, stride_doh, stride_dom, stride_dod,
             stride_dkb, stride_dkh, stride_dkn, stride_dkd,
             stride_dvb, stride_dvh, stride_dvn, stride_dvd,
             stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
             stride_slope_b, stride_slope_h, stride_lse_b, stride_lse_h,
             heads_q, heads_kv, group_size, seqlen_q, seqlen_k, head_dim, head_dim_v,
             key_offset, window_left, window_right, scale, softcap, store_dmask,
             q_varlen, kv_mode, align_br, total_q, total_k, seq_bucket,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DENSE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // heads_kv).to(tl.int64)
    h_kv = (pid_bh % heads_kv).to(tl.int64)
    n0 = pid_n * BLOCK_N
    # packed and cache formats (never paged here: launch.py gathers pages into a cache first)
    q_start, seqlen_q, k_start, seqlen_k, key_offset = seq_info(
        b, CuQ, CuK, SeqlensK, seqlen_q, seqlen_k, key_offset, q_varlen, kv_mode, align_br, total_q, total_k)
    if n0 >= seqlen_k:  # (keys past a cache's length keep the zeros launch.py allocated)
        return
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    cols = (k_start.to(tl.int64) + offs_n)[:, None]
    k_ptrs = K + b * stride_kb + h_kv * stride_kh + cols * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = V + b * stride_vb + h_kv * stride_vh + cols * stride_vn + offs_d[None, :] * stride_vd
    k = load_rows(k_ptrs, offs_n, seqlen_k, offs_d, head_dim, DENSE, True)
    v = load_rows(v_ptrs, offs_n, seqlen_k, offs_d, head_dim_v, DENSE, True)

    # queries that may see a key of this block: p_i - left <= j <= p_i + right
    last_key = tl.minimum(n0 + BLOCK_N, seqlen_k) - 1
    lo, full_lo, full_hi, end = block_range(
        n0 - window_right - key_offset,
        tl.minimum(seqlen_q, last_key + window_left - key_offset + 1),
        n0 + BLOCK_N - 1 - key_offset - window_right,
        tl.minimum(n0 + window_left - key_offset + 1, seqlen_q),
        BLOCK_M)
    if not DENSE:
        # one loop, every block masked: half the code to compile for the rarely-hot path
        full_lo = lo
        full_hi = lo
    # (keys past Sk in a partial block only touch dK/dV rows that are never stored)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(0, group_size):
        h = h_kv * group_size + g
        q_base = Q + b * stride_qb + h * stride_qh + q_start.to(tl.int64) * stride_qm
        do_base = dOut + b * stride_dob + h * stride_doh + q_start.to(tl.int64) * stride_dom
        lse_base = Lse + b * stride_lse_b + h * stride_lse_h + q_start
        delta_base = Delta + b * stride_lse_b + h * stride_lse_h + q_start
        dmask_base = dMask + (b * heads_q + h) * seqlen_q * seqlen_k
        mask_base = Mask + b * stride_mask_b + h * stride_mask_h
        slope = 0.0
        if not DENSE:
            slope = tl.load(Slopes + b * stride_slope_b + h * stride_slope_h)
        else:  # interior blocks (the general path has none)
            dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dmask_base,
                                  stride_qm, stride_qd, stride_dom, stride_dod,
                                  mask_base, stride_mask_m, stride_mask_n, slope, offs_n, offs_m, offs_d,
                                  full_lo, full_hi, full_hi, 0, scale, softcap, key_offset, seqlen_q, seqlen_k,
                                  head_dim, head_dim_v, window_left, window_right, store_dmask,
                                  BLOCK_M, DENSE, False)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dmask_base,
                              stride_qm, stride_qd, stride_dom, stride_dod,
                              mask_base, stride_mask_m, stride_mask_n, slope, offs_n, offs_m, offs_d,
                              lo, end - (full_hi - full_lo), full_lo, full_hi - full_lo, scale, softcap,
                              key_offset, seqlen_q, seqlen_k, head_dim, head_dim_v, window_left, window_right,
                              store_dmask, BLOCK_M, DENSE, True)

    dk = dk * scale
    dk_ptrs = dK + b * stride_dkb + h_kv * stride_dkh + cols * stride_dkn + offs_d[None, :] * stride_dkd
    dv_ptrs = dV + b * stride_dvb + h_kv * stride_dvh + cols * stride_dvn + offs_d[None, :] * stride_dvd
    store_rows(dk_ptrs, dk.to(dK.dtype.element_ty), offs_n, seqlen_k, offs_d, head_dim, DENSE)
    store_rows(dv_ptrs, dv.to(dV.dtype.element_ty), offs_n, seqlen_k, offs_d, head_dim_v, DENSE)


@triton.jit
def _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
               mask_base, stride_mask_m, stride_mask_n, slope, offs_m, offs_n, offs_d,
               lo, hi, split, gap, scale, softcap, key_offset, seqlen_q, seqlen_k, head_dim, head_dim_v,
               window_left, window_right,
               BLOCK_N: tl.constexpr, DENSE: tl.constexpr, BOUNDARY: tl.constexpr):
    for i in range(0, (hi - lo) // BLOCK_N):
        start_n = lo + i * BLOCK_N
        if BOUNDARY:
            start_n = tl.where(start_n < split, start_n, start_n + gap)
        offs_kn = start_n + offs_n
        cols = offs_kn.to(tl.int64)[:, None]
        k_ptrs = k_base + cols * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = v_base + cols * stride_vn + offs_d[None, :] * stride_vd
        k = load_rows(k_ptrs, offs_kn, seqlen_k, offs_d, head_dim, DENSE, BOUNDARY)
        v = load_rows(v_ptrs, offs_kn, seqlen_k, offs_d, head_dim_v, DENSE, BOUNDARY)
        qk = dot(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32))
        s2, t = scores(qk, offs_m[:, None], offs_kn[None, :], scale, softcap, slope, mask_base,
                       stride_mask_m, stride_mask_n, key_offset, seqlen_q, seqlen_k, window_left, window_right,
                       DENSE, BOUNDARY)
        p = tl.math.exp2(s2 - lse2[:, None])
        dp = dot(do, tl.trans(v), tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32))
        ds = p * (dp - delta[:, None])
        if not DENSE:
            if softcap > 0.0:
                ds = ds * (1.0 - t * t)
        dq = dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit(do_not_specialize=["heads_q", "group_size", "seqlen_q", "seqlen_k", "head_dim", "head_dim_v",
                            "key_offset", "window_left", "window_right", "q_varlen", "kv_mode", "align_br",
                            "total_q", "total_k", "seq_bucket"])
def bwd_dq(Q, K, V, dOut, Lse, Delta, dQ, Mask, Slopes, CuQ, CuK, SeqlensK,
           stride_qb, stride_qh, stride_qm, stride_qd,
           stride_kb, stride_kh, stride_kn, stride_kd,
           stride_vb, stride_vh, stride_vn, stride_vd,
           stride_dob, stride_doh, stride_dom, stride_dod,
           stride_dqb, stride_dqh, stride_dqm, stride_dqd,
           stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
           stride_slope_b, stride_slope_h, stride_lse_b, stride_lse_h,
           heads_q, group_size, seqlen_q, seqlen_k, head_dim, head_dim_v,
           key_offset, window_left, window_right, scale, softcap,
           q_varlen, kv_mode, align_br, total_q, total_k, seq_bucket,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DENSE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // heads_q).to(tl.int64)
    h = pid_bh % heads_q
    h_kv = (h // group_size).to(tl.int64)
    h = h.to(tl.int64)
    m0 = pid_m * BLOCK_M
    q_start, seqlen_q, k_start, seqlen_k, key_offset = seq_info(
        b, CuQ, CuK, SeqlensK, seqlen_q, seqlen_k, key_offset, q_varlen, kv_mode, align_br, total_q, total_k)
    if m0 >= seqlen_q:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = (q_start.to(tl.int64) + offs_m)[:, None]
    q_ptrs = Q + b * stride_qb + h * stride_qh + rows * stride_qm + offs_d[None, :] * stride_qd
    do_ptrs = dOut + b * stride_dob + h * stride_doh + rows * stride_dom + offs_d[None, :] * stride_dod
    q = load_rows(q_ptrs, offs_m, seqlen_q, offs_d, head_dim, DENSE, True)
    do = load_rows(do_ptrs, offs_m, seqlen_q, offs_d, head_dim_v, DENSE, True)
    row_base = b * stride_lse_b + h * stride_lse_h + q_start
    lse2 = lse_log2(tl.load(Lse + row_base + offs_m, mask=offs_m < seqlen_q, other=float("inf")))
    delta = tl.load(Delta + row_base + offs_m, mask=offs_m < seqlen_q, other=0.0)
    k_base = K + b * stride_kb + h_kv * stride_kh + k_start.to(tl.int64) * stride_kn
    v_base = V + b * stride_vb + h_kv * stride_vh + k_start.to(tl.int64) * stride_vn
    mask_base = Mask + b * stride_mask_b + h * stride_mask_h
    slope = 0.0
    if not DENSE:
        slope = tl.load(Slopes + b * stride_slope_b + h * stride_slope_h)

    last_row = tl.minimum(m0 + BLOCK_M, seqlen_q) - 1
    lo, full_lo, full_hi, end = block_range(
        m0 + key_offset - window_left,
        tl.minimum(seqlen_k, last_row + key_offset + window_right + 1),
        m0 + BLOCK_M - 1 + key_offset - window_left,
        tl.minimum(m0 + key_offset + window_right + 1, seqlen_k),
        BLOCK_N)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if not DENSE:
        full_lo = lo
        full_hi = lo
    else:
        dq = _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                        mask_base, stride_mask_m, stride_mask_n, slope, offs_m, offs_n, offs_d,
                        full_lo, full_hi, full_hi, 0, scale, softcap, key_offset, seqlen_q, seqlen_k,
                        head_dim, head_dim_v, window_left, window_right, BLOCK_N, DENSE, False)
    dq = _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                    mask_base, stride_mask_m, stride_mask_n, slope, offs_m, offs_n, offs_d,
                    lo, end - (full_hi - full_lo), full_lo, full_hi - full_lo, scale, softcap, key_offset,
                    seqlen_q, seqlen_k, head_dim, head_dim_v, window_left, window_right,
                    BLOCK_N, DENSE, True)
    dq = dq * scale
    dq_ptrs = dQ + b * stride_dqb + h * stride_dqh + rows * stride_dqm + offs_d[None, :] * stride_dqd
    store_rows(dq_ptrs, dq.to(dQ.dtype.element_ty), offs_m, seqlen_q, offs_d, head_dim, DENSE)
