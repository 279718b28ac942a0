// Split-KV decode forward (flash-decoding) for Ampere-class and Hopper GPUs, mma.sync only.
//
// One thread block per (split, batch, kv head, chunk of 16 rows). Its rows are the GQA group's
// query heads x the new queries (row r of a kv head = query head r / Sq, query r % Sq), one mma M
// tile, so every K/V byte of a split is read once per 16 rows (Llama-3 decode: once). Each warp
// owns every NUM_WARPS-th key block of the split with its own cp.async ring (KV_STAGES deep, waited
// on with __syncwarp only) and its own online softmax: the warps never meet inside the key loop and
// merge once at the end through shared memory. One split writes out/lse (sinks included); more
// write float32 partials (normalised out, natural lse) that attnx_decode_combine merges like
// attnx.merge (a sink is one more part of value 0; a NaN part keeps the row NaN).
//
// Key formats: dense (B, Hkv, Sk, D) through strides (both layouts), a cache with per-sequence
// lengths (seqlens_k, clamped to [0, capacity]) and a paged pool (num_pages, page_size, Hkv, D)
// read through page_table (B, max_pages); every table entry is clamped to [0, num_pages), so no
// index value can move a read outside the buffers.
//
// Compile-time knobs (NVRTC -D): IS_BF16, HEAD_DIM (padded tile: 64/128/256), BLOCK_N (keys per
// warp block: 16, 32 or 64), NUM_WARPS, SCORE_MOD (softcap/ALiBi/scale <= 0), KV_STAGES (2..4),
// EXACT_ALPHA (common/softmax.cuh: the rescale factor from the rounded product, default 0);
// KV_SWIZZLE (default 0): K/V rows unpadded with their 16-byte chunks XOR-swizzled (`kv_chunk`);
// PAGE_BATCH (default 0): where a block lies inside one page, lane j holds the table entry of the warp's
// block 32 c + j (and of the next 32 blocks), loaded 32 blocks ahead, so no copy waits on a table load;
// FUSED_COMBINE (default 0): with splits, the last block of a program to finish merges its splits' partials
// (an arrival counter per program after part_lse, zeroed by the launcher) instead of attnx_decode_combine;
// KV_BULK (default 0; sm_90 only, padded rows, BLOCK_N <= 32): each K and V row of a block is one bulk copy
// (cp.async.bulk, the TMA engine) issued by one lane and completing on the stage's mbarrier, in place of
// HEAD_DIM / 8 16-byte cp.async per row; rows past the sequence are zeroed with shared stores, columns past
// the head dims once at the start (no copy writes them); needs SHARED_BYTES (the barriers sit at its end);
// DECODE_COMBINE=1 builds only the combine kernel (its own specialisation: IS_BF16).
#include "common/mask.cuh"
#include "common/score_mod.cuh"
#include "common/softmax.cuh"
#include "sm80/ptx.cuh"
#if defined(KV_BULK) && KV_BULK
#include "sm90/ptx.cuh"
#endif

// The launcher (backends/cuda/launch_decode.py) mirrors this layout with a numpy record:
// 8-byte fields first, then 4-byte fields, same order.
struct DecodeParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;              // (B, Hq, Sq) natural log, sinks included
  float* part_o;           // splits > 1: (splits, rows, head_dim_v) normalised partial outs
  float* part_lse;         // splits > 1: (splits, rows) natural-log partial lse (no sink)
  const float* alibi;      // slopes or null
  const float* sinks;      // (Hq,) or null
  const int* seqlens_k;    // (B,) or null: every sequence holds `capacity` keys
  const int* page_table;   // (B, max_pages) with row stride pt_bs, or null
  long long q_bs, q_hs, q_rs;
  long long k_bs, k_hs, k_rs;  // paged: page, head and row-in-page strides
  long long v_bs, v_hs, v_rs;
  long long o_bs, o_hs, o_rs;
  long long alibi_bs, alibi_hs;
  long long pt_bs;
  int batch, heads_q, heads_kv, group, seqlen_q;
  int capacity;            // keys a sequence can hold (dense Sk, cache Smax, max_pages * page_size)
  int head_dim, head_dim_v;  // multiples of 8
  int window_left, window_right;
  int key_offset;          // aligned position of query 0 when !align_br
  int align_br;            // 1: bottom-right per sequence, offset = seqlen_k[b] - Sq
  int page_size, num_pages;
  int page_shift;          // log2(page_size) for powers of two, else -1 (a shift, not a division)
  int row_chunks;          // ceil(group * Sq / 16)
  int splits, split_keys;  // split s covers keys [s * split_keys, (s + 1) * split_keys)
  int rows;                // B * Hq * Sq: rows of lse and of each split's partials
  float scale, scale_log2, softcap, softcap_inv;
};

// Keys of sequence b, clamped to what the buffers hold (an empty pool holds none).
DEVI int sequence_keys(const DecodeParams& p, int b) {
  if (p.page_table && p.num_pages <= 0) return 0;
  if (!p.seqlens_k) return p.capacity;
  return min(max(p.seqlens_k[b], 0), p.capacity);
}

#include "sm80/decode_merge.cuh"

#if !defined(DECODE_COMBINE) || !DECODE_COMBINE
#ifndef KV_SWIZZLE
#define KV_SWIZZLE 0
#endif
#ifndef PAGE_BATCH
#define PAGE_BATCH 0
#endif
#ifndef FUSED_COMBINE
#define FUSED_COMBINE 0
#endif
#ifndef KV_BULK
#define KV_BULK 0
#endif
#if KV_BULK && KV_SWIZZLE
#error "KV_BULK copies whole rows: its ring is padded, not swizzled"
#endif

#include "sm80/decode_loads.cuh"

template <bool BF16, int HD, int BN, int NW, bool MOD, int STAGES>
DEVI void decode_forward(const DecodeParams& p) {
  constexpr int THREADS = NW * 32;
  constexpr int NT = BN / 8;   // n-tiles of a warp's score tile
  constexpr int DT = HD / 8;   // n-tiles of the output
  constexpr int KS = HD / 16;  // k-steps of Q K^T
  constexpr int LD = HD + 8;
  constexpr int OLD = HD + 4;  // float row stride of the merge buffer
  constexpr bool Q_IN_REGS = HD <= 128;
  static_assert(BN % 16 == 0 && BN <= 64 && (BN * HD / 8) % 32 == 0, "a warp block is 16, 32 or 64 keys");
  static_assert(STAGES >= 2 && STAGES <= 4, "2..4 stages");

  extern __shared__ __align__(KV_SWIZZLE ? 128 : 16) u16 smem[];
  u16* sQ = smem;  // 16 x LD, then each warp's ring of STAGES x (K, V) blocks (128-byte aligned: 16 LD rows)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const u32 ring = smem_u32(sQ + 16 * LD + warp * STAGES * 2 * BN * kv_ld<HD>());
  constexpr u32 STAGE_BYTES = 2 * BN * kv_ld<HD>() * 2, V_BYTES = BN * kv_ld<HD>() * 2;
#if KV_BULK
  // each warp's STAGES barriers past the ring, the merge buffer and the fused merge's weights (which overlay
  // each other), as Variant.shared_bytes lays them out
  constexpr int RING_END = 16 * LD * 2 + NW * STAGES * STAGE_BYTES;
  constexpr int MERGE_END = NW * 16 * ((HD + 4) * 4 + 8), WEIGHTS_END = FUSED_COMBINE ? 16 * 128 * 4 : 0;
  constexpr int OVERLAID = RING_END > MERGE_END ? (RING_END > WEIGHTS_END ? RING_END : WEIGHTS_END)
                                                : (MERGE_END > WEIGHTS_END ? MERGE_END : WEIGHTS_END);
  constexpr int BARRIERS = (OVERLAID + 7) / 8 * 8;
  static_assert(BARRIERS + 8 * NW * STAGES == SHARED_BYTES, "the launcher's shared memory size");
  const u32 bars = smem_u32(smem) + BARRIERS + 8 * warp * STAGES;  // this warp's: stage s at bars + 8 s
#endif

  const int programs = p.batch * p.heads_kv * p.row_chunks;
  const int split = blockIdx.x / programs;
  const int prog = blockIdx.x - split * programs;
  const int bh = prog / p.row_chunks;  // b * Hkv + hk
  const int chunk = prog - bh * p.row_chunks;
  const int b = bh / p.heads_kv, hk = bh - b * p.heads_kv;
  const int Sq = p.seqlen_q, group_rows = p.group * Sq;
  const int Sk = sequence_keys(p, b);
  const Visibility vis{Sq, Sk, p.align_br ? Sk - Sq : p.key_offset, p.window_left, p.window_right};

  // the chunk's rows r0..r1 and the queries they hold (all of them when the chunk spans two heads)
  const int r0 = chunk * 16, r1 = min(r0 + 16, group_rows) - 1;
  int i_lo = 0, i_hi = Sq - 1;
  if (r0 / Sq == r1 / Sq) {
    i_lo = r0 - (r0 / Sq) * Sq;
    i_hi = r1 - (r1 / Sq) * Sq;
  }
  int key_lo, key_hi;
  keys_seen(vis, i_lo, i_hi, &key_lo, &key_hi);
  const int split_lo = split * p.split_keys;
  key_lo = max(key_lo, split_lo);
  key_hi = min(key_hi, split_lo + p.split_keys - 1);
  const int blk_first = key_lo / BN;
  const int blk_last = key_hi >= key_lo ? key_hi / BN : blk_first - 1;
  const int my_first = blk_first + warp;  // this warp's blocks: my_first + t * NW
  const int nt = my_first <= blk_last ? (blk_last - my_first) / NW + 1 : 0;

  // Q: 16 rows gathered from the group's heads (zero rows past the group)
  for (int c = tid; c < 16 * (HD / 8); c += THREADS) {
    const int r = c / (HD / 8), cc = c - r * (HD / 8), gr = r0 + r;
    const bool ok = gr < group_rows && cc * 8 < p.head_dim;
    const u16* src = (const u16*)p.q;
    if (ok) {
      const int hq = gr / Sq;
      src += b * p.q_bs + (hk * p.group + hq) * p.q_hs + (gr - hq * Sq) * p.q_rs + cc * 8;
    }
    cp_async16(smem_u32(sQ + r * LD + cc * 8), src, ok);
  }
  cp_commit();

  const bool paged = p.page_table != nullptr;
  const u16* kbase = (const u16*)p.k + hk * p.k_hs + (paged ? 0 : b * p.k_bs);
  const u16* vbase = (const u16*)p.v + hk * p.v_hs + (paged ? 0 : b * p.v_bs);
  int pg = 0, pr = 0;  // paged: the pool page/row of key `lane` of the next block to issue
  int pg2 = 0, pr2 = 0;  // ... and of key 32 + `lane` (64-key blocks)
  // PAGE_BATCH: entries from registers loaded 32 blocks ahead (`PageBatch`), else a block ahead
  const bool batched = PAGE_BATCH && paged && block_in_page<BN>(p);
  PageBatch pages;
  if (batched) pages.start<BN, NW>(p, b, my_first, nt, lane);
#if KV_BULK
  if (lane < STAGES) mbar_init(bars + 8 * lane, 1);  // one arrival (lane 0's, with the bytes) per block
  mbar_init_fence();
  // columns past the head dims: zero once (copies write head_dim / head_dim_v columns, rows past Sk whole)
  if (p.head_dim < HD || p.head_dim_v < HD) {
    for (int c = lane; c < STAGES * 2 * BN * (HD / 8); c += 32) {
      const int r = c / (HD / 8), cc = c - r * (HD / 8);  // row r of the warp's ring (K, V blocks in turn)
      const bool is_v = (r / BN) & 1;
      if (cc * 8 >= (is_v ? p.head_dim_v : p.head_dim))
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(ring + kv_chunk<HD>(r, cc)), "r"(0u)
                     : "memory");
    }
  }
  __syncwarp();
#endif
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nt) {
      const int n0 = (my_first + s * NW) * BN;
      if (batched)
        pages.take<BN, NW>(p, b, my_first, s, nt, lane, &pg, &pr);
      else if (paged)
        lookup_page<BN>(p, b, n0, Sk, lane, &pg, &pr, &pg2, &pr2);
#if KV_BULK
      load_kv_bulk<HD, BN>(ring + s * STAGE_BYTES, ring + s * STAGE_BYTES + V_BYTES, bars + 8 * s, p, kbase, vbase,
                           n0, Sk, pg, pr, lane);
#else
      load_kv<HD, BN>(ring + s * STAGE_BYTES, ring + s * STAGE_BYTES + V_BYTES, p, kbase, vbase, n0, Sk, pg, pr,
                      pg2, pr2, lane);
#endif
    }
    cp_commit();
  }
  // the table entries of the first block the loop issues, read a block ahead from here on
  if (paged && !batched && STAGES - 1 < nt)
    lookup_page<BN>(p, b, (my_first + (STAGES - 1) * NW) * BN, Sk, lane, &pg, &pr, &pg2, &pr2);

  // this thread's two rows (g, g + 8): query index, head; padded rows copy row i_lo's visibility
  int row_q[2], row_h[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int gr = r0 + g + 8 * r;
    const bool valid = gr < group_rows;
    row_h[r] = hk * p.group + (valid ? gr / Sq : 0);
    row_q[r] = valid ? gr - (gr / Sq) * Sq : i_lo;
  }
  ScoreMod mods[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float slope = p.alibi ? p.alibi[b * p.alibi_bs + row_h[r] * p.alibi_hs] : 0.f;
    mods[r] = ScoreMod{p.scale, p.softcap, p.softcap_inv, slope, vis.offset};
  }
  const float unit = MOD ? 1.f : p.scale_log2;
  // every row of the chunk sees every key of a block inside this band: no mask there
  const int band_rows = i_hi - i_lo + 1;

  cp_wait<STAGES - 1>();
  __syncthreads();  // Q is in shared memory (the warps' first blocks may still be in flight)

  const u32 sQ_a = smem_u32(sQ);
  const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_col = (lane >> 4) * 8;
  const int bn_row = (lane & 7) + (lane >> 4) * 8, bn_col = ((lane >> 3) & 1) * 8;
  const int bt_row = (lane & 7) + ((lane >> 3) & 1) * 8, bt_col = (lane >> 4) * 8;
  u32 qfrag[Q_IN_REGS ? KS : 1][4];
  if constexpr (Q_IN_REGS) {
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) ldsm_x4(qfrag[ks], sQ_a + 2 * (a_row * LD + ks * 16 + a_col));
  }

  float acc[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[dt][i] = 0.f;
  float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.f, 0.f};

  for (int t = 0; t < nt; ++t) {
#if KV_BULK
    mbar_wait(bars + 8 * (t % STAGES), (t / STAGES) & 1);  // block t's copied rows have landed (its zeroed
                                                           // rows, stored at issue, by the __syncwarp below)
#else
    cp_wait<STAGES - 2>();  // this lane's copies of block t have landed
#endif
    __syncwarp();           // ... every lane's too; the stage refilled below was last read at t - 1
    {
      const int tn = t + STAGES - 1;
      if (tn < nt) {
        const u32 st = ring + (tn % STAGES) * STAGE_BYTES;
        if (batched) pages.take<BN, NW>(p, b, my_first, tn, nt, lane, &pg, &pr);
#if KV_BULK
        load_kv_bulk<HD, BN>(st, st + V_BYTES, bars + 8 * (tn % STAGES), p, kbase, vbase, (my_first + tn * NW) * BN,
                             Sk, pg, pr, lane);
#else
        load_kv<HD, BN>(st, st + V_BYTES, p, kbase, vbase, (my_first + tn * NW) * BN, Sk, pg, pr, pg2, pr2, lane);
#endif
      }
      cp_commit();
      // the next block's table entries: their latency hides behind this block's math
      if (paged && !batched && tn + 1 < nt)
        lookup_page<BN>(p, b, (my_first + (tn + 1) * NW) * BN, Sk, lane, &pg, &pr, &pg2, &pr2);
    }
    const u32 sK_a = ring + (t % STAGES) * STAGE_BYTES, sV_a = sK_a + V_BYTES;
    const int n0 = (my_first + t * NW) * BN;

    float s[NT][4];
#pragma unroll
    for (int nt8 = 0; nt8 < NT; ++nt8)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[nt8][i] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      u32 a[4];
      if constexpr (Q_IN_REGS) {
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = qfrag[ks][i];
      } else {
        ldsm_x4(a, sQ_a + 2 * (a_row * LD + ks * 16 + a_col));
      }
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        u32 bf[4];
        ldsm_x4(bf, sK_a + kv_chunk<HD>(np * 16 + bn_row, ks * 2 + bn_col / 8));
        mma16816<BF16>(s[2 * np], a, bf[0], bf[1]);
        mma16816<BF16>(s[2 * np + 1], a, bf[2], bf[3]);
      }
    }

    if constexpr (MOD) {
#pragma unroll
      for (int nt8 = 0; nt8 < NT; ++nt8)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int col = n0 + nt8 * 8 + 2 * t4 + (i & 1);
          float dcap;  // unused
          s[nt8][i] = apply_score_mod(mods[i >> 1], s[nt8][i], row_q[i >> 1], col, &dcap) * ATTNX_LOG2E;
        }
    }
    if (!tile_inside_band(vis, i_lo, band_rows, n0, BN)) {
#pragma unroll
      for (int nt8 = 0; nt8 < NT; ++nt8)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int col = n0 + nt8 * 8 + 2 * t4 + (i & 1);
          if (!key_visible(vis, row_q[i >> 1], col)) s[nt8][i] = neg_inf();
        }
    }

    // online softmax of this warp's keys; a row lives in the 4 lanes of a quad
    float alphas[2];
    bool rescale = false;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = row_max[r];
#pragma unroll
      for (int nt8 = 0; nt8 < NT; ++nt8) mx = fmaxf(mx, fmaxf(s[nt8][2 * r], s[nt8][2 * r + 1]));
      mx = quad_max(mx);
      const float m_scaled = max_shift(mx, unit);
      const float alpha = exp2_approx(rescale_exponent(row_max[r], unit, m_scaled));  // EXACT_ALPHA
      row_max[r] = mx;
      float sum = 0.f;
#pragma unroll
      for (int nt8 = 0; nt8 < NT; ++nt8) {
        const float p0 = exp2_approx(fmaf(s[nt8][2 * r], unit, -m_scaled));
        const float p1 = exp2_approx(fmaf(s[nt8][2 * r + 1], unit, -m_scaled));
        s[nt8][2 * r] = p0;
        s[nt8][2 * r + 1] = p1;
        sum += p0 + p1;
      }
      row_sum[r] = row_sum[r] * alpha + sum;
      alphas[r] = alpha;
      rescale |= alpha != 1.f;
    }
    if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[dt][i] *= alphas[i >> 1];
    }

#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      u32 a[4];
      a[0] = pack2<BF16>(s[2 * kk][0], s[2 * kk][1]);
      a[1] = pack2<BF16>(s[2 * kk][2], s[2 * kk][3]);
      a[2] = pack2<BF16>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = pack2<BF16>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        u32 bf[4];
        ldsm_x4_t(bf, sV_a + kv_chunk<HD>(kk * 16 + bt_row, dp * 2 + bt_col / 8));
        mma16816<BF16>(acc[2 * dp], a, bf[0], bf[1]);
        mma16816<BF16>(acc[2 * dp + 1], a, bf[2], bf[3]);
      }
    }
  }

  // merge the warps once: each parks (max in log2 units, sum, unnormalised out) in shared memory
  cp_wait<0>();
  __syncthreads();  // every ring is drained and read: the merge buffer overlays them
  float* sO = reinterpret_cast<float*>(smem);  // NW x 16 x OLD
  float* sM = sO + NW * 16 * OLD;              // NW x 16
  float* sL = sM + NW * 16;                    // NW x 16
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    const float l = quad_sum(row_sum[r]);
    if (t4 == 0) {
      sM[warp * 16 + row] = row_max[r] * unit;  // -inf: this warp saw no key of the row
      sL[warp * 16 + row] = l;
    }
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
      *reinterpret_cast<float2*>(sO + (warp * 16 + row) * OLD + dt * 8 + 2 * t4) =
          make_float2(acc[dt][2 * r], acc[dt][2 * r + 1]);
  }
  __syncthreads();

  const int dv = p.head_dim_v;
  for (int idx = tid; idx < 16 * (HD / 4); idx += THREADS) {
    const int row = idx / (HD / 4), c = (idx - row * (HD / 4)) * 4;
    const int gr = r0 + row;
    if (gr >= group_rows || c >= dv) continue;
    float top = neg_inf();
#pragma unroll
    for (int w = 0; w < NW; ++w) top = fmaxf(top, sM[w * 16 + row]);
    const float shift = top == neg_inf() ? 0.f : top;
    float sum = 0.f, o0 = 0.f, o1 = 0.f, o2 = 0.f, o3 = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float wt = exp2_approx(sM[w * 16 + row] - shift);  // 0 for a warp that saw nothing
      const float4 ow = *reinterpret_cast<const float4*>(sO + (w * 16 + row) * OLD + c);
      sum += wt * sL[w * 16 + row];  // a NaN sum stays NaN (0 * NaN)
      o0 += wt * ow.x;
      o1 += wt * ow.y;
      o2 += wt * ow.z;
      o3 += wt * ow.w;
    }
    const int hq = gr / Sq, h = hk * p.group + hq, i = gr - hq * Sq;
    const long long grow = ((long long)b * p.heads_q + h) * Sq + i;
    float inv, row_lse;
    if (p.splits == 1) {
      softmax_finish(shift, sum, p.sinks ? p.sinks[h] : neg_inf(), &inv, &row_lse);
      u16* o = (u16*)p.o + b * p.o_bs + h * p.o_hs + i * p.o_rs + c;
      *reinterpret_cast<uint2*>(o) = make_uint2(pack2<BF16>(o0 * inv, o1 * inv), pack2<BF16>(o2 * inv, o3 * inv));
      if (c == 0) p.lse[grow] = row_lse;
    } else {
      softmax_finish(shift, sum, neg_inf(), &inv, &row_lse);  // the sink joins in the combine
      const long long prow = split * (long long)p.rows + grow;
      *reinterpret_cast<float4*>(p.part_o + prow * dv + c) = make_float4(o0 * inv, o1 * inv, o2 * inv, o3 * inv);
      if (c == 0) p.part_lse[prow] = row_lse;
    }
  }
#if FUSED_COMBINE
  if (p.splits > 1) merge_if_last<BF16, HD, NW>(p, reinterpret_cast<float*>(smem), prog, b, hk, r0, group_rows);
#endif
}

extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32) attnx_decode(const DecodeParams p) {
  decode_forward<IS_BF16 != 0, HEAD_DIM, BLOCK_N, NUM_WARPS, SCORE_MOD != 0, KV_STAGES>(p);
}

#else  // DECODE_COMBINE

extern "C" __global__ void __launch_bounds__(128) attnx_decode_combine(const DecodeParams p) {
  decode_combine<IS_BF16 != 0>(p);
}

#endif
