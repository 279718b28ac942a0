// FlashAttention-2 forward for Ampere-class GPUs (sm_80 .. sm_90): one query
// block per thread block, each warp owns MT x 16 query rows (no cross-warp
// reduction), K/V tiles streamed through shared memory with cp.async, online
// softmax in registers with exp2, fp32 accumulation, one write of out and lse (the
// sink, when the call has one, joins each row's sum at the end).
//
// Compile-time knobs (NVRTC -D): IS_BF16, HEAD_DIM (padded tile), BLOCK_M,
// BLOCK_N, NUM_WARPS, SCORE_MOD (softcap and/or ALiBi present, or a scale <= 0), KV_STAGES
// (2: K/V double-buffered, loads issued a block ahead, two barriers per block instead of four).
// EXACT_ALPHA (opt-in): the rescale factor from the rounded shifts (common/softmax.cuh `rescale_exponent`).
// VARLEN (opt-in, 0 by default): packed q and k/v (common/varlen.cuh). The kernel then takes a
// VarlenParams after the AttnParams; batch entry b of the grid is packed sequence b (its lengths,
// offset and first rows), blocks past its last row exit, lse is (Hq, total_q). VARLEN=0 compiles
// to the same cubin as before the knob (everything it adds is under `#if VARLEN`).
#ifndef VARLEN
#define VARLEN 0
#endif
#include "common/mask.cuh"
#include "common/score_mod.cuh"
#include "common/softmax.cuh"
#include "sm80/ptx.cuh"
#include "sm80/tiles.cuh"
#if VARLEN
#include "common/varlen.cuh"
#endif

template <bool BF16, int HD, int BM, int BN, int NW, bool MOD, int STAGES>
#if VARLEN
DEVI void attention_forward(const AttnParams& p, const VarlenParams& packed) {
#else
DEVI void attention_forward(const AttnParams& p) {
#endif
  constexpr int THREADS = NW * 32;
  constexpr int MT = BM / (16 * NW);  // 16-row m-tiles per warp
  constexpr int NT = BN / 8;          // n-tiles of the score tile
  constexpr int DT = HD / 8;          // n-tiles of the output tile
  constexpr int KS = HD / 16;         // k-steps of Q K^T
  constexpr int LD = HD + 8;
  constexpr bool Q_IN_REGS = MT * KS * 4 <= 32;
  static_assert(MT >= 1 && BM == MT * 16 * NW, "BLOCK_M must be a multiple of 16 * NUM_WARPS");
  static_assert(NT % 2 == 0 && DT % 2 == 0, "tiles must be multiples of 16");

  extern __shared__ __align__(16) u16 smem[];
  u16* sQ = smem;
  u16* sK = sQ + BM * LD;
  u16* sV = sK + STAGES * BN * LD;  // STAGES buffers each of K and V
  static_assert(STAGES == 1 || STAGES == 2, "one or two K/V buffers");

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int nblk = p.num_blocks;
  const int bh = blockIdx.x / nblk;
  const int mb = nblk - 1 - (blockIdx.x - bh * nblk);  // heaviest (causal) blocks first
  const int b = bh / p.heads_q, h = bh - b * p.heads_q, hk = h / p.group;
  const int m0 = mb * BM;
#if VARLEN
  // packed sequence b: the grid covers the longest; rows past this one's end are the next one's
  const PackedSeq seq = packed_sequence(packed, p.key_offset, b);
  if (m0 >= seq.info.seqlen_q) return;
  const Visibility vis{seq.info.seqlen_q, seq.info.seqlen_k, seq.info.offset, p.window_left, p.window_right};
  const int Sq = vis.seqlen_q, Sk = vis.seqlen_k;  // every load below stops at these rows

  const u16* q = (const u16*)p.q + seq.q_start * p.q_rs + h * p.q_hs;
  const u16* k = (const u16*)p.k + seq.k_start * p.k_rs + hk * p.k_hs;
  const u16* v = (const u16*)p.v + seq.k_start * p.v_rs + hk * p.v_hs;
#else
  const Visibility vis = visibility(p);
  const int Sq = vis.seqlen_q, Sk = vis.seqlen_k;

  const u16* q = (const u16*)p.q + b * p.q_bs + h * p.q_hs;
  const u16* k = (const u16*)p.k + b * p.k_bs + hk * p.k_hs;
  const u16* v = (const u16*)p.v + b * p.v_bs + hk * p.v_hs;
#endif

  // key blocks that any row of this query block can see
  int key_lo, key_hi;
  keys_seen(vis, m0, min(m0 + BM, Sq) - 1, &key_lo, &key_hi);
  const int n_first = key_lo / BN;
  const int n_last = key_hi >= key_lo ? key_hi / BN : n_first - 1;

  load_tile<BM, HD, THREADS>(sQ, q, p.q_rs, m0, Sq, p.head_dim, tid);
  if (n_first <= n_last) load_tile<BN, HD, THREADS>(sK, k, p.k_rs, n_first * BN, Sk, p.head_dim, tid);
  cp_commit();
  if (n_first <= n_last) load_tile<BN, HD, THREADS>(sV, v, p.v_rs, n_first * BN, Sk, p.head_dim_v, tid);
  cp_commit();

  // log2 units per score unit: without a score mod the scores stay raw q.k (scale > 0 there)
  const float unit = MOD ? 1.f : p.scale_log2;
#if VARLEN
  ScoreMod mod = score_mod(p, b, h);  // ALiBi slopes are (B, Hq): per sequence
  mod.offset = seq.info.offset;
#else
  const ScoreMod mod = score_mod(p, b, h);
#endif

  float acc[MT][DT][4];
  float row_max[MT][2], row_sum[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][dt][i] = 0.f;
    row_max[mt][0] = row_max[mt][1] = neg_inf();
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }
  u32 qfrag[Q_IN_REGS ? MT : 1][Q_IN_REGS ? KS : 1][4];

  const int warp_row0 = warp * MT * 16;
  const u32 sQ_a = smem_u32(sQ), sK_a = smem_u32(sK), sV_a = smem_u32(sV);
  // lane offsets for ldmatrix: A operand (rows, k halves), B non-trans, B trans
  const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_col = (lane >> 4) * 8;
  const int bn_row = (lane & 7) + (lane >> 4) * 8, bn_col = ((lane >> 3) & 1) * 8;
  const int bt_row = (lane & 7) + ((lane >> 3) & 1) * 8, bt_col = (lane >> 4) * 8;

  for (int nb = n_first; nb <= n_last; ++nb) {
    const int n0 = nb * BN;
    const int stage = STAGES == 2 ? (nb - n_first) & 1 : 0;
    const u32 sKc_a = sK_a + stage * (BN * LD * 2), sVc_a = sV_a + stage * (BN * LD * 2);
    cp_wait<1>();
    __syncthreads();  // Q and this K block are in shared memory
    if constexpr (STAGES == 2) {
      // the other buffers were last read in the previous iteration, before the barrier above
      if (nb < n_last) load_tile<BN, HD, THREADS>(sK + (stage ^ 1) * BN * LD, k, p.k_rs, n0 + BN, Sk, p.head_dim, tid);
      cp_commit();
      if (nb < n_last) load_tile<BN, HD, THREADS>(sV + (stage ^ 1) * BN * LD, v, p.v_rs, n0 + BN, Sk, p.head_dim_v, tid);
      cp_commit();
    }

    float s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[mt][nt][i] = 0.f;

    if constexpr (Q_IN_REGS) {
      if (nb == n_first) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int ks = 0; ks < KS; ++ks)
            ldsm_x4(qfrag[mt][ks], (sQ_a + 2 * ((warp_row0 + mt * 16 + a_row) * LD + ks * 16 + a_col)));
      }
    }
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      u32 a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (Q_IN_REGS) {
#pragma unroll
          for (int i = 0; i < 4; ++i) a[mt][i] = qfrag[mt][ks][i];
        } else {
          ldsm_x4(a[mt], (sQ_a + 2 * ((warp_row0 + mt * 16 + a_row) * LD + ks * 16 + a_col)));
        }
      }
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        u32 bf[4];
        ldsm_x4(bf, (sKc_a + 2 * ((np * 16 + bn_row) * LD + ks * 16 + bn_col)));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<BF16>(s[mt][2 * np], a[mt], bf[0], bf[1]);
          mma16816<BF16>(s[mt][2 * np + 1], a[mt], bf[2], bf[3]);
        }
      }
    }
    if constexpr (STAGES == 1) {
      __syncthreads();  // every warp is done with this K block
      if (nb < n_last) load_tile<BN, HD, THREADS>(sK, k, p.k_rs, n0 + BN, Sk, p.head_dim, tid);
      cp_commit();
    }

    // Scores: raw q.k (no score mod: the scale is folded into exp2 below) or, with softcap /
    // ALiBi, the modified score in log2 units. Tiles wholly inside the window skip the mask.
    const bool need_mask = !tile_inside_band(vis, m0, BM, n0, BN);
    if constexpr (MOD) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int row = m0 + warp_row0 + mt * 16 + g + (i >> 1) * 8;
            const int col = n0 + nt * 8 + 2 * t4 + (i & 1);
            float dcap;  // unused here
            s[mt][nt][i] = apply_score_mod(mod, s[mt][nt][i], row, col, &dcap) * ATTNX_LOG2E;
          }
    }
    if (need_mask) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int row = m0 + warp_row0 + mt * 16 + g + (i >> 1) * 8;
            const int col = n0 + nt * 8 + 2 * t4 + (i & 1);
            if (!key_visible(vis, row, col)) s[mt][nt][i] = neg_inf();
          }
    }

    // online softmax: each row lives in the 4 lanes of a quad; row_max is in score units
    float alphas[MT][2];
    bool rescale = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = row_max[mt][r];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
        mx = quad_max(mx);
        const float m_scaled = max_shift(mx, unit);
        const float alpha = exp2_approx(rescale_exponent(row_max[mt][r], unit, m_scaled));
        row_max[mt][r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const float p0 = exp2_approx(fmaf(s[mt][nt][2 * r], unit, -m_scaled));
          const float p1 = exp2_approx(fmaf(s[mt][nt][2 * r + 1], unit, -m_scaled));
          s[mt][nt][2 * r] = p0;
          s[mt][nt][2 * r + 1] = p1;
          sum += p0 + p1;
        }
        row_sum[mt][r] = row_sum[mt][r] * alpha + sum;
        alphas[mt][r] = alpha;
        rescale |= alpha != 1.f;
      }
    // rescale the accumulator only when some row max of this warp moved (rare after a few blocks)
    if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[mt][dt][i] *= alphas[mt][i >> 1];
    }

    cp_wait<STAGES == 2 ? 2 : 1>();
    __syncthreads();  // this V block is in shared memory
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      u32 a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        a[mt][0] = pack2<BF16>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = pack2<BF16>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = pack2<BF16>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = pack2<BF16>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        u32 bf[4];
        ldsm_x4_t(bf, (sVc_a + 2 * ((kk * 16 + bt_row) * LD + dp * 16 + bt_col)));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<BF16>(acc[mt][2 * dp], a[mt], bf[0], bf[1]);
          mma16816<BF16>(acc[mt][2 * dp + 1], a[mt], bf[2], bf[3]);
        }
      }
    }
    if constexpr (STAGES == 1) {
      __syncthreads();  // every warp is done with this V block
      if (nb < n_last) load_tile<BN, HD, THREADS>(sV, v, p.v_rs, n0 + BN, Sk, p.head_dim_v, tid);
      cp_commit();
    }
  }

  cp_wait<0>();
  __syncthreads();  // sQ is reused to stage the output
#if VARLEN
  float* lse = p.lse + (long long)h * packed.total_q + seq.q_start;  // (Hq, total_q)
#else
  float* lse = p.lse + (long long)bh * Sq;
#endif
  const float sink = sink_logit(p, h);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float inv, row_lse;
      softmax_finish(row_max[mt][r] * unit, quad_sum(row_sum[mt][r]), sink, &inv, &row_lse);
      const int srow = warp_row0 + mt * 16 + g + r * 8;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        *reinterpret_cast<u32*>(sQ + srow * LD + dt * 8 + 2 * t4) =
            pack2<BF16>(acc[mt][dt][2 * r] * inv, acc[mt][dt][2 * r + 1] * inv);
      }
      const int row = m0 + srow;
      if (t4 == 0 && row < Sq) lse[row] = row_lse;
    }
  __syncthreads();
#if VARLEN
  u16* o = (u16*)p.o + seq.q_start * p.o_rs + h * p.o_hs;
#else
  u16* o = (u16*)p.o + b * p.o_bs + h * p.o_hs;
#endif
  store_tile<BM, HD, THREADS>(o, p.o_rs, sQ, m0, Sq, p.head_dim_v, tid);
}

#if VARLEN
extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32) attnx_fwd(const AttnParams p, const VarlenParams vp) {
  attention_forward<IS_BF16 != 0, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, SCORE_MOD != 0, KV_STAGES>(p, vp);
}
#else
extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32) attnx_fwd(const AttnParams p) {
  attention_forward<IS_BF16 != 0, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, SCORE_MOD != 0, KV_STAGES>(p);
}
#endif
