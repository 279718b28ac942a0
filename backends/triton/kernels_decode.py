"""Split-KV forward for few query rows (decode, speculative verification, short chunks): flash-decoding.

``attn_decode``: grid (split, batch x kv head x row chunk). One program takes the query rows
of a whole GQA group (``group_size * Sq`` rows, in chunks of ``BLOCK_R``) against one slice of
one sequence's keys, so each K/V byte is read once per row chunk instead of once per query
head, and a sequence's keys are spread over ``num_splits`` programs when batch x kv heads
cannot fill the GPU (`configs.decode_splits`). Every tensor format works through runtime
arguments (`kernels_common.seq_info`, `kernels_common.kv_offsets`): dense, packed, cache and
paged keys, dense or packed queries.

With one split the program writes the final ``out``/``lse`` (sinks in its epilogue). With
more, each writes a float32 partial (normalised out, base-2 lse) and ``decode_combine`` merges
them as `attnx.merge` does, the sink joining there as one more part of value 0.
"""
import triton
import triton.language as tl

from .kernels_common import KV_PAGED, LN2, LOG2E, dot, seq_info, tanh


@triton.jit
def _decode_blocks(acc, l_i, m_i, q, k_base, v_base, pt_row, start, stop, page_size, num_pages,
                   stride_kp, stride_kn, stride_kd, stride_vp, stride_vn, stride_vd, offs_d, d_k, d_v,
                   pos, slope2, scale, softcap, window_left, window_right,
                   BLOCK_N: tl.constexpr, PAGED: tl.constexpr):
    """Keys [start, stop) of one sequence into the online softmax of the program's rows.

    Contiguous keys (dense, packed, cache): pointers step BLOCK_N rows per block. Paged: each
    block's rows come from the page table (read only below `stop`; pages clamped into the pool),
    the entries of block n + 1 loaded during block n and clamped only when used, so no K/V load
    waits on a table load issued just before it.
    """
    offs_n = tl.arange(0, BLOCK_N)
    k_ptrs = k_base + (start + offs_n).to(tl.int64)[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = v_base + (start + offs_n).to(tl.int64)[:, None] * stride_vn + offs_d[None, :] * stride_vd
    k_step = BLOCK_N * stride_kn  # (a key row's stride times 16..64 stays far inside int32)
    v_step = BLOCK_N * stride_vn
    if PAGED:
        entries = tl.load(pt_row + (start + offs_n) // page_size, mask=start + offs_n < stop, other=0)
    for n in range(0, (tl.maximum(stop - start, 0) + BLOCK_N - 1) // BLOCK_N):
        offs_kn = start + n * BLOCK_N + offs_n
        inside = offs_kn < stop
        if PAGED:
            page = tl.minimum(tl.maximum(entries, 0), num_pages - 1).to(tl.int64)
            following = offs_kn + BLOCK_N
            entries = tl.load(pt_row + following // page_size, mask=following < stop, other=0)
            within = (offs_kn % page_size).to(tl.int64)
            k_ptrs = k_base + (page * stride_kp + within * stride_kn)[:, None] + offs_d[None, :] * stride_kd
            v_ptrs = v_base + (page * stride_vp + within * stride_vn)[:, None] + offs_d[None, :] * stride_vd
        k = tl.load(k_ptrs, mask=inside[:, None] & d_k, other=0.0)
        qk = dot(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32))
        # docs/semantics.md order: scale -> softcap -> alibi -> window
        s = qk * scale
        if softcap > 0.0:
            s = softcap * tanh(s / softcap)
        s2 = s * LOG2E - slope2[:, None] * tl.abs(pos[:, None] - offs_kn[None, :]).to(tl.float32)
        allowed = (inside[None, :] & (offs_kn[None, :] >= pos[:, None] - window_left)
                   & (offs_kn[None, :] <= pos[:, None] + window_right))
        s2 = tl.where(allowed, s2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s2 - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptrs, mask=inside[:, None] & d_v, other=0.0)
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
        if not PAGED:
            k_ptrs += k_step
            v_ptrs += v_step
    return acc, l_i, m_i


# head_dim/head_dim_v stay specialised: a multiple of 16 lets the masked loads run 16 bytes wide
# (and pipeline); the few head dims in use cost a compile each.
@triton.jit(do_not_specialize=["heads_q", "heads_kv", "group_size", "seqlen_q", "seqlen_k", "key_offset", "window_left", "window_right", "has_sinks", "q_varlen",
                            "kv_mode", "align_br", "page_size", "total_q", "total_k", "num_pages", "num_splits",
                            "row_chunks", "part_rows", "stride_lse_b", "stride_lse_h", "stride_pt_b"])
def attn_decode(Q, K, V, Out, Lse, PartOut, PartLse, Slopes, Sinks, CuQ, CuK, SeqlensK, PageTable,
                stride_qb, stride_qh, stride_qm, stride_qd,
                stride_kb, stride_kh, stride_kn, stride_kd,
                stride_vb, stride_vh, stride_vn, stride_vd,
                stride_ob, stride_oh, stride_om, stride_od,
                stride_slope_b, stride_slope_h, stride_lse_b, stride_lse_h, stride_pt_b,
                heads_q, heads_kv, group_size, seqlen_q, seqlen_k, head_dim, head_dim_v,
                key_offset, window_left, window_right, scale, softcap, has_sinks,
                q_varlen, kv_mode, align_br, page_size, total_q, total_k, num_pages,
                num_splits, row_chunks, part_rows,
                BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    split = tl.program_id(0)
    pid = tl.program_id(1)
    chunk = pid % row_chunks
    bh = pid // row_chunks
    b = (bh // heads_kv).to(tl.int64)
    h_kv = (bh % heads_kv).to(tl.int64)
    q_start, sq, k_start, sk, offset = seq_info(
        b, CuQ, CuK, SeqlensK, seqlen_q, seqlen_k, key_offset, q_varlen, kv_mode, align_br, total_q, total_k)
    if sq == 0:  # a packed sequence without queries: no row to write
        return

    # rows of this chunk: (query head g of the group, query i), g major
    rows = chunk * BLOCK_R + tl.arange(0, BLOCK_R)
    g = rows // seqlen_q
    i = rows % seqlen_q
    row_ok = (g < group_size) & (i < sq)
    h = h_kv * group_size + g.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    q_rows = q_start.to(tl.int64) + i
    q_ptrs = Q + b * stride_qb + h[:, None] * stride_qh + q_rows[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < head_dim), other=0.0)
    slope2 = tl.load(Slopes + b * stride_slope_b + h * stride_slope_h, mask=row_ok, other=0.0) * LOG2E
    pos = i + offset

    # keys any row may see, cut into num_splits runs of whole blocks; this program takes one
    lo = tl.maximum(offset - window_left, 0)
    hi = tl.minimum(sk, sq - 1 + offset + window_right + 1)
    n_blocks = (tl.maximum(hi - lo, 0) + BLOCK_N - 1) // BLOCK_N
    per_split = (n_blocks + num_splits - 1) // num_splits
    start = lo + split * per_split * BLOCK_N
    stop = tl.minimum(start + per_split * BLOCK_N, hi)

    b_kv = tl.where(kv_mode == KV_PAGED, 0, b)
    k_base = K + b_kv * stride_kb + h_kv * stride_kh + k_start.to(tl.int64) * stride_kn
    v_base = V + b_kv * stride_vb + h_kv * stride_vh + k_start.to(tl.int64) * stride_vn
    pt_row = PageTable + b * stride_pt_b
    d_k = offs_d[None, :] < head_dim
    d_v = offs_d[None, :] < head_dim_v

    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    # two copies of the key loop (one variant): neither has a branch on the format inside
    if kv_mode == KV_PAGED:
        acc, l_i, m_i = _decode_blocks(acc, l_i, m_i, q, k_base, v_base, pt_row, start, stop, page_size, num_pages,
                                       stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, offs_d,
                                       d_k, d_v, pos, slope2, scale, softcap, window_left, window_right,
                                       BLOCK_N, True)
    else:
        acc, l_i, m_i = _decode_blocks(acc, l_i, m_i, q, k_base, v_base, pt_row, start, stop, page_size, num_pages,
                                       stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, offs_d,
                                       d_k, d_v, pos, slope2, scale, softcap, window_left, window_right,
                                       BLOCK_N, False)

    # the row's place in lse's layout: (B, Hq, Sq) or (Hq, total_q); partials use the same index
    lse_row = b * stride_lse_b + h * stride_lse_h + q_rows
    if num_splits == 1:
        if has_sinks != 0:
            sink2 = tl.load(Sinks + h, mask=row_ok, other=float("-inf")) * LOG2E
            m_new = tl.maximum(m_i, sink2)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.math.exp2(sink2 - m_use)
            acc = acc * alpha[:, None]
            m_i = m_use
        # l_i == 0: saw nothing (out 0, lse -inf); a NaN l_i keeps the row NaN
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
        o_ptrs = Out + b * stride_ob + h[:, None] * stride_oh + q_rows[:, None] * stride_om + offs_d[None, :] * stride_od
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_v)
        tl.store(Lse + lse_row, lse, mask=row_ok)
    else:
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
        part = split.to(tl.int64) * part_rows + lse_row
        tl.store(PartOut + part[:, None] * head_dim_v + offs_d[None, :], out, mask=row_ok[:, None] & d_v)
        tl.store(PartLse + part, lse2, mask=row_ok)


@triton.jit(do_not_specialize=["heads_q", "rows_per_head", "part_rows", "num_splits", "has_sinks"])
def decode_combine(Out, Lse, PartOut, PartLse, Sinks,
                   stride_ob, stride_oh, stride_om, stride_od,
                   heads_q, rows_per_head, part_rows, head_dim_v, num_splits, has_sinks,
                   BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Merge the splits of ``part_rows`` rows (lse's layout: ``r = (b * Hq + h) * S + i``).

    Packed queries are the case b = 0, S = total_q (every token is some sequence's row).
    Grid: (row blocks, head-dim blocks of BLOCK_D).
    """
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = r < part_rows
    i = r % rows_per_head
    h = (r // rows_per_head) % heads_q
    b = (r // rows_per_head // heads_q).to(tl.int64)
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    for s in range(0, num_splits):
        m = tl.maximum(m, tl.load(PartLse + s * part_rows + r, mask=ok, other=float("-inf")))
    sink2 = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    if has_sinks != 0:
        sink2 = tl.load(Sinks + h, mask=ok, other=float("-inf")) * LOG2E
        m = tl.maximum(m, sink2)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    l_sum = tl.math.exp2(sink2 - m_use)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    d_ok = offs_d[None, :] < head_dim_v
    for s in range(0, num_splits):
        part = s * part_rows + r.to(tl.int64)
        lse_s = tl.load(PartLse + part, mask=ok, other=float("-inf"))
        w = tl.math.exp2(lse_s - m_use)
        l_sum += w
        o = tl.load(PartOut + part[:, None] * head_dim_v + offs_d[None, :], mask=ok[:, None] & d_ok, other=0.0)
        # a part that saw nothing has weight 0 and out 0; a NaN part makes the row NaN
        acc += w[:, None] * o
    empty = l_sum == 0.0
    out = acc / tl.where(empty, 1.0, l_sum)[:, None]
    lse = tl.where(empty, float("-inf"), (m_use + tl.math.log2(tl.where(empty, 1.0, l_sum))) * LN2)
    o_ptrs = (Out + (b * stride_ob + h.to(tl.int64) * stride_oh + i.to(tl.int64) * stride_om)[:, None]
              + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=ok[:, None] & d_ok)
    if tl.program_id(1) == 0:
        tl.store(Lse + r, lse, mask=ok)
