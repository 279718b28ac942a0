"""FlashAttention-2 forward in Triton: grid (query block, batch x head), K/V streamed with online softmax.

Key blocks that the causal/window rule rules out entirely are never visited; only
the boundary blocks pay for positional masks. One write of out and lse at the end,
where a head's sink (docs/semantics.md) joins the softmax denominator.
"""
import triton
import triton.language as tl

# Sizes vary with every call: compiling a kernel per value of their "== 1" / "% 16" properties would
# recompile for new shapes. Strides stay specialised (their divisibility gives 16-byte loads).

from .kernels_common import KV_PAGED, LN2, LOG2E, block_range, dot, kv_offsets, load_rows, scores, seq_info, store_rows


@triton.jit
def _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                mask_base, stride_mask_m, stride_mask_n, slope, offs_m, offs_n, offs_d,
                lo, hi, split, gap, scale, softcap, key_offset, seqlen_q, seqlen_k, head_dim, head_dim_v,
                window_left, window_right, pt_row, kv_mode, page_size, num_pages, stride_kp, stride_vp,
                BLOCK_N: tl.constexpr, DENSE: tl.constexpr, BOUNDARY: tl.constexpr):
    # BOUNDARY visits [lo, split) then [gap_end, hi) in one loop (one copy of the body)
    for i in range(0, (hi - lo) // BLOCK_N):
        start_n = lo + i * BLOCK_N
        if BOUNDARY:
            start_n = tl.where(start_n < split, start_n, start_n + gap)
        offs_kn = start_n + offs_n
        if DENSE:  # never paged (configs.path_of)
            k_off = offs_kn.to(tl.int64) * stride_kn
            v_off = offs_kn.to(tl.int64) * stride_vn
        else:
            k_off, v_off = kv_offsets(offs_kn, seqlen_k, pt_row, kv_mode, page_size, num_pages, stride_kp,
                                      stride_kn, stride_vp, stride_vn)
        k_ptrs = k_base + k_off[:, None] + offs_d[None, :] * stride_kd
        v_ptrs = v_base + v_off[:, None] + offs_d[None, :] * stride_vd
        k = load_rows(k_ptrs, offs_kn, seqlen_k, offs_d, head_dim, DENSE, BOUNDARY)
        qk = dot(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32))
        s2, _ = scores(qk, offs_m[:, None], offs_kn[None, :], scale, softcap, slope, mask_base,
                       stride_mask_m, stride_mask_n, key_offset, seqlen_q, seqlen_k, window_left, window_right,
                       DENSE, BOUNDARY)
        # (a NaN score may or may not win the max; either way exp2 turns it into a NaN l_i and acc)
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        if BOUNDARY or not DENSE:
            # a row that has seen no key yet keeps m = -inf; subtract 0 instead (no NaN)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.math.exp2(s2 - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = load_rows(v_ptrs, offs_kn, seqlen_k, offs_d, head_dim_v, DENSE, BOUNDARY)
        acc = dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["heads_q", "group_size", "seqlen_q", "seqlen_k", "head_dim", "head_dim_v",
                            "key_offset", "window_left", "window_right", "has_sinks", "q_varlen", "kv_mode",
                            "align_br", "page_size", "total_q", "total_k", "num_pages", "seq_bucket",
                            "stride_lse_b", "stride_lse_h", "stride_pt_b"])
def attn_fwd(Q, K, V, Out, Lse, Mask, Slopes, Sinks, CuQ, CuK, SeqlensK, PageTable,
             stride_qb, stride_qh, stride_qm, stride_qd,
             stride_kb, stride_kh, stride_kn, stride_kd,
             stride_vb, stride_vh, stride_vn, stride_vd,
             stride_ob, stride_oh, stride_om, stride_od,
             stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
             stride_slope_b, stride_slope_h, stride_lse_b, stride_lse_h, stride_pt_b,
             heads_q, group_size, seqlen_q, seqlen_k, head_dim, head_dim_v,
             key_offset, window_left, window_right, scale, softcap, has_sinks,
             q_varlen, kv_mode, align_br, page_size, total_q, total_k, num_pages, seq_bucket,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DENSE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // heads_q).to(tl.int64)
    h = pid_bh % heads_q
    h_kv = (h // group_size).to(tl.int64)
    h = h.to(tl.int64)
    m0 = pid_m * BLOCK_M
    # the tensor formats (launch.format_args): this sequence's rows, keys and alignment
    q_start, seqlen_q, k_start, seqlen_k, key_offset = seq_info(
        b, CuQ, CuK, SeqlensK, seqlen_q, seqlen_k, key_offset, q_varlen, kv_mode, align_br, total_q, total_k)
    if m0 >= seqlen_q:  # the grid covers the longest sequence
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    q_base = Q + b * stride_qb + h * stride_qh + q_start.to(tl.int64) * stride_qm
    q_ptrs = q_base + offs_m.to(tl.int64)[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = load_rows(q_ptrs, offs_m, seqlen_q, offs_d, head_dim, DENSE, True)
    # paged: stride_kb/stride_vb step pages, found per key through the page table
    b_kv = tl.where(kv_mode == KV_PAGED, 0, b)
    k_base = K + b_kv * stride_kb + h_kv * stride_kh + k_start.to(tl.int64) * stride_kn
    v_base = V + b_kv * stride_vb + h_kv * stride_vh + k_start.to(tl.int64) * stride_vn
    pt_row = PageTable + b * stride_pt_b
    mask_base = Mask + b * stride_mask_b + h * stride_mask_h
    slope = 0.0
    if not DENSE:
        slope = tl.load(Slopes + b * stride_slope_b + h * stride_slope_h)

    # keys any row of this block may see, and the part no row needs masked
    last_row = tl.minimum(m0 + BLOCK_M, seqlen_q) - 1
    lo, full_lo, full_hi, end = block_range(
        m0 + key_offset - window_left,
        tl.minimum(seqlen_k, last_row + key_offset + window_right + 1),
        m0 + BLOCK_M - 1 + key_offset - window_left,
        tl.minimum(m0 + key_offset + window_right + 1, seqlen_k),
        BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if not DENSE:
        # one loop, every block masked: half the code to compile for the rarely-hot path
        full_lo = lo
        full_hi = lo
    else:
        # interior blocks need no positional mask; the boundary ones ([lo, full_lo) and [full_hi, end)) do
        acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                    mask_base, stride_mask_m, stride_mask_n, slope, offs_m, offs_n, offs_d,
                                    full_lo, full_hi, full_hi, 0, scale, softcap, key_offset, seqlen_q, seqlen_k,
                                    head_dim, head_dim_v, window_left, window_right, pt_row, kv_mode, page_size,
                                    num_pages, stride_kb, stride_vb, BLOCK_N, DENSE, False)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                mask_base, stride_mask_m, stride_mask_n, slope, offs_m, offs_n, offs_d,
                                lo, end - (full_hi - full_lo), full_lo, full_hi - full_lo, scale, softcap,
                                key_offset, seqlen_q, seqlen_k, head_dim, head_dim_v, window_left, window_right,
                                pt_row, kv_mode, page_size, num_pages, stride_kb, stride_vb, BLOCK_N, DENSE, True)

    if has_sinks != 0:
        # the sink is one more key of score sinks[h] (not scaled or modified) and value 0
        sink2 = tl.load(Sinks + h) * LOG2E
        m_new = tl.maximum(m_i, sink2)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.math.exp2(sink2 - m_use)
        acc = acc * alpha[:, None]
        m_i = m_use
    # l_i == 0: the row saw nothing (out 0, lse -inf); a NaN l_i (a NaN score) keeps the row NaN
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    rows = q_start.to(tl.int64) + offs_m
    o_ptrs = Out + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + offs_d[None, :] * stride_od
    store_rows(o_ptrs, out.to(Out.dtype.element_ty), offs_m, seqlen_q, offs_d, head_dim_v, DENSE)
    # lse is (B, Hq, Sq) for dense q, (Hq, total_q) for packed q (stride_lse_b 0)
    tl.store(Lse + b * stride_lse_b + h * stride_lse_h + rows, lse, mask=offs_m < seqlen_q)
