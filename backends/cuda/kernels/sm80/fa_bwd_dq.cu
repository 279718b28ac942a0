// dQ of the deterministic FlashAttention-2 backward for Ampere-class GPUs (sm_80 .. sm_90): a
// separate pass beside the dK/dV kernel (fa_bwd.cu built with DQ_ATOMIC=0). One thread block
// owns BLOCK_M queries of one query head and walks the key blocks they can see, in order,
// recomputing S = Q K^T, P = exp2(S - lse), dP = dO V^T and dS = P (dP - delta); dQ = dS K is
// accumulated in fp32 registers and written once. No atomics and a fixed order of additions, so
// dQ is the same bit for bit on every run. Each warp owns 16 query rows (as in the forward):
// a row's lse and delta stay in registers and dS feeds dS K straight from the accumulator.
//
// Compile-time knobs (NVRTC -D): IS_BF16, HEAD_DIM (padded tile), BLOCK_M (= 16 * NUM_WARPS),
// BLOCK_N (keys per step), NUM_WARPS, SCORE_MOD (softcap and/or ALiBi, or a scale <= 0),
// KV_STAGES (2: the next K/V block loads while this one is used, one barrier per block).
#include "common/mask.cuh"
#include "common/score_mod.cuh"
#include "sm80/ptx.cuh"
#include "sm80/tiles.cuh"

template <bool BF16, int HD, int BM, int BN, int NW, bool MOD, int STAGES>
DEVI void attention_backward_dq(const AttnParams& p) {
  constexpr int THREADS = NW * 32;
  constexpr int NT = BN / 8;   // n-tiles over the keys of one step
  constexpr int DT = HD / 8;   // n-tiles of dQ
  constexpr int KS = HD / 16;  // k-steps of Q K^T and dO V^T
  constexpr int LD = HD + 8;
  constexpr bool FRAGS_IN_REGS = KS <= 4;  // Q and dO operands kept in registers (head dims <= 64)
  static_assert(BM == 16 * NW, "each warp owns 16 query rows");
  static_assert(NT % 2 == 0 && DT % 2 == 0, "tiles must be multiples of 16");
  static_assert(STAGES == 1 || STAGES == 2, "one or two K/V buffers");

  extern __shared__ __align__(16) u16 smem[];
  u16* sQ = smem;
  u16* sdO = sQ + BM * LD;
  u16* sK = sdO + BM * LD;          // STAGES buffers
  u16* sV = sK + STAGES * BN * LD;  // STAGES buffers

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int nblk = p.num_blocks;  // query blocks per head
  const int bh = blockIdx.x / nblk;
  const int mb = nblk - 1 - (blockIdx.x - bh * nblk);  // heaviest (causal) blocks first
  const int b = bh / p.heads_q, h = bh - b * p.heads_q, hk = h / p.group;
  const int m0 = mb * BM;
  const Visibility vis = visibility(p);
  const int Sq = vis.seqlen_q, Sk = vis.seqlen_k;

  const u16* q = (const u16*)p.q + b * p.q_bs + h * p.q_hs;
  const u16* dout = (const u16*)p.dout + b * p.o_bs + h * p.o_hs;
  const u16* k = (const u16*)p.k + b * p.k_bs + hk * p.k_hs;
  const u16* v = (const u16*)p.v + b * p.v_bs + hk * p.v_hs;

  // key blocks that any row of this query block can see (the forward's walk)
  int key_lo, key_hi;
  keys_seen(vis, m0, min(m0 + BM, Sq) - 1, &key_lo, &key_hi);
  const int n_first = key_lo / BN;
  const int n_last = key_hi >= key_lo ? key_hi / BN : n_first - 1;

  load_tile<BM, HD, THREADS>(sQ, q, p.q_rs, m0, Sq, p.head_dim, tid);
  load_tile<BM, HD, THREADS>(sdO, dout, p.o_rs, m0, Sq, p.head_dim_v, tid);
  if (n_first <= n_last) {
    load_tile<BN, HD, THREADS>(sK, k, p.k_rs, n_first * BN, Sk, p.head_dim, tid);
    load_tile<BN, HD, THREADS>(sV, v, p.v_rs, n_first * BN, Sk, p.head_dim_v, tid);
  }
  cp_commit();

  // this thread's two rows: lse in log2 units (+inf where the row saw nothing, and past Sq, so P = 0)
  const int warp_row0 = warp * 16;
  const long long row_base = ((long long)b * p.heads_q + h) * Sq;
  float lse2[2], delta[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = m0 + warp_row0 + g + r * 8;
    lse2[r] = row < Sq ? p.lse[row_base + row] : pos_inf();
    delta[r] = row < Sq ? p.delta[row_base + row] : 0.f;
  }

  // log2 units per score unit: without a score mod the scores stay raw q.k (scale > 0 there)
  const float unit = MOD ? ATTNX_LOG2E : p.scale_log2;
  const ScoreMod mod = score_mod(p, b, h);  // read only by the MOD specialisation

  float acc[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[dt][i] = 0.f;
  u32 qfrag[FRAGS_IN_REGS ? KS : 1][4], ofrag[FRAGS_IN_REGS ? KS : 1][4];

  const u32 sQ_a = smem_u32(sQ), sdO_a = smem_u32(sdO), sK_a = smem_u32(sK), sV_a = smem_u32(sV);
  // lane offsets for ldmatrix: A operand (rows, k halves), B non-trans, B trans
  const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_col = (lane >> 4) * 8;
  const int bn_row = (lane & 7) + (lane >> 4) * 8, bn_col = ((lane >> 3) & 1) * 8;
  const int bt_row = (lane & 7) + ((lane >> 3) & 1) * 8, bt_col = (lane >> 4) * 8;

  for (int nb = n_first; nb <= n_last; ++nb) {
    const int n0 = nb * BN;
    const int stage = STAGES == 2 ? (nb - n_first) & 1 : 0;
    const u32 sKc_a = sK_a + stage * (BN * LD * 2), sVc_a = sV_a + stage * (BN * LD * 2);
    cp_wait<0>();
    __syncthreads();  // this K/V block is in shared memory, and every warp is done with the previous one
    if constexpr (STAGES == 2) {
      if (nb < n_last) {
        load_tile<BN, HD, THREADS>(sK + (stage ^ 1) * BN * LD, k, p.k_rs, n0 + BN, Sk, p.head_dim, tid);
        load_tile<BN, HD, THREADS>(sV + (stage ^ 1) * BN * LD, v, p.v_rs, n0 + BN, Sk, p.head_dim_v, tid);
      }
      cp_commit();
    }
    if constexpr (FRAGS_IN_REGS) {
      if (nb == n_first) {
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          ldsm_x4(qfrag[ks], (sQ_a + 2 * ((warp_row0 + a_row) * LD + ks * 16 + a_col)));
          ldsm_x4(ofrag[ks], (sdO_a + 2 * ((warp_row0 + a_row) * LD + ks * 16 + a_col)));
        }
      }
    }

    // S = Q K^T for this warp's 16 rows
    float s[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[nt][i] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      u32 a[4];
      if constexpr (FRAGS_IN_REGS) {
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = qfrag[ks][i];
      } else {
        ldsm_x4(a, (sQ_a + 2 * ((warp_row0 + a_row) * LD + ks * 16 + a_col)));
      }
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        u32 bf[4];
        ldsm_x4(bf, (sKc_a + 2 * ((np * 16 + bn_row) * LD + ks * 16 + bn_col)));
        mma16816<BF16>(s[2 * np], a, bf[0], bf[1]);
        mma16816<BF16>(s[2 * np + 1], a, bf[2], bf[3]);
      }
    }

    // P = exp2(score - lse), times the softcap derivative (it multiplies dS); tiles wholly inside
    // the band skip the mask
    const bool need_mask = m0 + BM > Sq || !tile_inside_band(vis, m0, BM, n0, BN);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float x = s[nt][i];
        float dcap = 1.f;
        if constexpr (MOD) {
          const int row = m0 + warp_row0 + g + (i >> 1) * 8;
          const int col = n0 + nt * 8 + 2 * t4 + (i & 1);
          x = apply_score_mod(mod, x, row, col, &dcap);
        }
        s[nt][i] = exp2_approx(fmaf(x, unit, -lse2[i >> 1])) * dcap;
      }
    if (need_mask) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = m0 + warp_row0 + g + (i >> 1) * 8;
          const int col = n0 + nt * 8 + 2 * t4 + (i & 1);
          if (row >= Sq || !key_visible(vis, row, col)) s[nt][i] = 0.f;
        }
    }

    // dP = dO V^T
    float dp[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) dp[nt][i] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      u32 a[4];
      if constexpr (FRAGS_IN_REGS) {
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = ofrag[ks][i];
      } else {
        ldsm_x4(a, (sdO_a + 2 * ((warp_row0 + a_row) * LD + ks * 16 + a_col)));
      }
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        u32 bf[4];
        ldsm_x4(bf, (sVc_a + 2 * ((np * 16 + bn_row) * LD + ks * 16 + bn_col)));
        mma16816<BF16>(dp[2 * np], a, bf[0], bf[1]);
        mma16816<BF16>(dp[2 * np + 1], a, bf[2], bf[3]);
      }
    }

    // dQ += dS K with dS = P (dP - delta), fed from the accumulator registers as the forward's P
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      float ds[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) ds[j][i] = s[2 * kk + j][i] * (dp[2 * kk + j][i] - delta[i >> 1]);
      u32 a[4];
      a[0] = pack2<BF16>(ds[0][0], ds[0][1]);
      a[1] = pack2<BF16>(ds[0][2], ds[0][3]);
      a[2] = pack2<BF16>(ds[1][0], ds[1][1]);
      a[3] = pack2<BF16>(ds[1][2], ds[1][3]);
#pragma unroll
      for (int dc = 0; dc < DT / 2; ++dc) {
        u32 bf[4];
        ldsm_x4_t(bf, (sKc_a + 2 * ((kk * 16 + bt_row) * LD + dc * 16 + bt_col)));
        mma16816<BF16>(acc[2 * dc], a, bf[0], bf[1]);
        mma16816<BF16>(acc[2 * dc + 1], a, bf[2], bf[3]);
      }
    }
    if constexpr (STAGES == 1) {
      __syncthreads();  // every warp is done with this K/V block
      if (nb < n_last) {
        load_tile<BN, HD, THREADS>(sK, k, p.k_rs, n0 + BN, Sk, p.head_dim, tid);
        load_tile<BN, HD, THREADS>(sV, v, p.v_rs, n0 + BN, Sk, p.head_dim_v, tid);
      }
      cp_commit();
    }
  }
  cp_wait<0>();  // (a block that sees no key still has its Q/dO copies in flight)

  // dQ (unscaled, fp32: the launcher multiplies by the scale and converts, as for the atomic dQ),
  // each element written once; the rows of a query block that sees no key get zeros. The block's
  // coordinates are derived again here, not kept live across the loop (that spilled at d32).
  const int bh_again = blockIdx.x / nblk;  // = b * heads_q + h
  const int m0_again = (nblk - 1 - (blockIdx.x - bh_again * nblk)) * BM;
  float* dq = p.dq_accum + (long long)bh_again * Sq * p.dq_row;
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = m0_again + warp_row0 + g + r * 8;
      const int col = dt * 8 + 2 * t4;
      if (row < Sq && col < p.head_dim) {
        float2 val;
        val.x = acc[dt][2 * r];
        val.y = acc[dt][2 * r + 1];
        *reinterpret_cast<float2*>(dq + (long long)row * p.dq_row + col) = val;
      }
    }
}

extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32) attnx_bwd_dq(const AttnParams p) {
  attention_backward_dq<IS_BF16 != 0, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, SCORE_MOD != 0, KV_STAGES>(p);
}
