// FlashAttention-2 backward for Ampere-class GPUs (sm_80 .. sm_90), recomputing
// the probabilities from lse. One thread block owns BLOCK_N keys of one kv head
// and walks every query block of every query head of its group (GQA without
// copies, and dK/dV need no atomics); each warp owns 16 key rows, so the
// transposed products S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q
// reuse the accumulator registers as operands. dQ += dS K goes through shared
// memory (dS^T) and fp32 atomics into dq_accum.
//
// Compile-time knobs (NVRTC -D): IS_BF16, HEAD_DIM, BLOCK_N (keys per block,
// = 16 * NUM_WARPS), BLOCK_M (queries per step), NUM_WARPS, SCORE_MOD,
// DO_DV, DO_DK (large head dims run two passes so each keeps one accumulator),
// DQ_ATOMIC (1: the dK pass adds dQ as above; 0: dK/dV only, for the deterministic
// backward, whose dQ is the separate pass sm80/fa_bwd_dq.cu).
// Sinks need nothing here: lse includes them, and their gradient is a torch op.
// VARLEN (default 0): packed q and k/v (common/varlen.cuh), a VarlenParams second argument: batch entry b
// of the grid is packed sequence b (batch strides 0; its rows start at its first row), a key block past
// the sequence's keys exits, and lse, delta and dq_accum are (Hq, total_q[, D]). Everything it adds is
// under `#if VARLEN`, so VARLEN=0 compiles to the cubin of the build without the knob.
#ifndef VARLEN
#define VARLEN 0
#endif
#include "common/mask.cuh"
#include "common/score_mod.cuh"
#include "sm80/ptx.cuh"
#include "sm80/tiles.cuh"
#if VARLEN
#include "common/varlen.cuh"
#endif

template <bool BF16, int HD, int BN, int BM, int NW, bool MOD, bool WITH_DV, bool WITH_DK, bool WITH_DQ>
#if VARLEN
DEVI void attention_backward(const AttnParams& p, const VarlenParams& vp) {
#else
DEVI void attention_backward(const AttnParams& p) {
#endif
  constexpr int THREADS = NW * 32;
  constexpr int NTQ = BM / 8;  // n-tiles over the queries of one step
  constexpr int DT = HD / 8;
  constexpr int KS = HD / 16;
  constexpr int LD = HD + 8;
  constexpr int LDS = BM + 8;  // dS^T row stride
  // dQ columns per warp task: the widest that still gives every warp a task
  constexpr int DQC = (HD % 64 == 0 && (BM / 16) * (HD / 64) >= NW) ? 64
                      : (HD % 32 == 0 && (BM / 16) * (HD / 32) >= NW) ? 32 : 16;
  constexpr int DQ_TASKS = (BM / 16) * (HD / DQC);
  static_assert(BN == 16 * NW, "each warp owns 16 keys");
  static_assert(BM % 16 == 0 && HD % 16 == 0, "tiles must be multiples of 16");

  extern __shared__ __align__(16) u16 smem[];
  u16* sK = smem;
  u16* sV = sK + BN * LD;
  u16* sQbuf = sV + BN * LD;          // 2 stages
  u16* sdObuf = sQbuf + 2 * BM * LD;  // 2 stages
  u16* sdS = sdObuf + 2 * BM * LD;
  float* sLse = reinterpret_cast<float*>(sdS + (WITH_DQ ? BN * LDS : 0));  // 2 stages
  float* sDelta = sLse + 2 * BM;                            // 2 stages

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int nblk = p.num_blocks;
  const int bhk = blockIdx.x / nblk;
  const int nb = blockIdx.x - bhk * nblk;
  const int b = bhk / p.heads_kv, hk = bhk - b * p.heads_kv;
  const int n0 = nb * BN;
#if VARLEN
  // packed sequence b: the grid covers the longest; a key block past this one's keys leaves at once
  const PackedSeq seq = packed_sequence(vp, p.key_offset, b);
  const Visibility vis{seq.info.seqlen_q, seq.info.seqlen_k, seq.info.offset, p.window_left, p.window_right};
  if (n0 >= vis.seqlen_k) return;  // (the whole block, before any barrier)
  const long long q_first = seq.q_start, k_first = seq.k_start;  // rows before the sequence (batch strides 0)
  // first row of (query head hq, this sequence) in lse, delta (Hq, total_q) and dq_accum (Hq, total_q, D)
  auto row_base = [&](int hq) { return (long long)hq * vp.total_q + q_first; };
#else
  const Visibility vis = visibility(p);
  constexpr long long q_first = 0, k_first = 0;
  auto row_base = [&](int hq) { return ((long long)b * p.heads_q + hq) * vis.seqlen_q; };
#endif
  const int Sq = vis.seqlen_q, Sk = vis.seqlen_k;
  const int G = p.group;

  const u16* k = (const u16*)p.k + b * p.k_bs + hk * p.k_hs + k_first * p.k_rs;
  const u16* v = (const u16*)p.v + b * p.v_bs + hk * p.v_hs + k_first * p.v_rs;

  // query blocks that can see a key of this block
  int q_lo, q_hi;
  queries_seeing(vis, n0, min(n0 + BN, Sk) - 1, &q_lo, &q_hi);
  const int m_first = q_lo / BM;
  const int m_count = q_hi >= q_lo ? q_hi / BM - m_first + 1 : 0;
  const int steps = m_count * G;

  load_tile<BN, HD, THREADS>(sK, k, p.k_rs, n0, Sk, p.head_dim, tid);
  load_tile<BN, HD, THREADS>(sV, v, p.v_rs, n0, Sk, p.head_dim_v, tid);

  auto prefetch = [&](int step) {
    const int stage = step & 1;
    const int hq = hk * G + step / m_count;
    const int m0 = (m_first + step % m_count) * BM;
    const u16* q = (const u16*)p.q + b * p.q_bs + hq * p.q_hs + q_first * p.q_rs;
    const u16* dout = (const u16*)p.dout + b * p.o_bs + hq * p.o_hs + q_first * p.o_rs;
    load_tile<BM, HD, THREADS>(sQbuf + stage * BM * LD, q, p.q_rs, m0, Sq, p.head_dim, tid);
    load_tile<BM, HD, THREADS>(sdObuf + stage * BM * LD, dout, p.o_rs, m0, Sq, p.head_dim_v, tid);
    const long long rows = row_base(hq);
    for (int j = tid; j < 2 * BM; j += THREADS) {
      const int r = j % BM;
      const bool ok = m0 + r < Sq;
      const float* src = j < BM ? p.lse : p.delta;
      float* dst = (j < BM ? sLse : sDelta) + stage * BM + r;
      cp_async4(smem_u32(dst), ok ? src + rows + m0 + r : src, ok);
    }
  };

  float dv_acc[WITH_DV ? DT : 1][4];
  float dk_acc[WITH_DK ? DT : 1][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (WITH_DV) dv_acc[dt][i] = 0.f;
      if constexpr (WITH_DK) dk_acc[dt][i] = 0.f;
    }

  const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_col = (lane >> 4) * 8;
  const int bn_row = (lane & 7) + (lane >> 4) * 8, bn_col = ((lane >> 3) & 1) * 8;
  const int bt_row = (lane & 7) + ((lane >> 3) & 1) * 8, bt_col = (lane >> 4) * 8;
  const int warp_key0 = warp * 16;
  // log2 units per score unit: without a score mod the scores stay raw q.k (scale > 0 there)
  const float unit = MOD ? ATTNX_LOG2E : p.scale_log2;
  const u32 sK_a = smem_u32(sK), sV_a = smem_u32(sV), sdS_a = smem_u32(sdS);

  if (steps > 0) prefetch(0);
  cp_commit();

  for (int step = 0; step < steps; ++step) {
    if (step + 1 < steps) {
      prefetch(step + 1);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    __syncthreads();  // this step's Q, dO, lse, delta (and K, V) are in shared memory

    const int stage = step & 1;
    const int hq = hk * G + step / m_count;
    const int m0 = (m_first + step % m_count) * BM;
    const u16* sQ = sQbuf + stage * BM * LD;
    const u32 sQ_a = smem_u32(sQ), sdO_a = smem_u32(sdObuf + stage * BM * LD);
    const float* lse2 = sLse + stage * BM;
    const float* delta = sDelta + stage * BM;
#if VARLEN
    ScoreMod mod = score_mod(p, b, hq);  // read only by the MOD specialisation; ALiBi slopes are (B, Hq)
    mod.offset = vis.offset;             // ALiBi distances from this sequence's alignment
#else
    const ScoreMod mod = score_mod(p, b, hq);  // read only by the MOD specialisation
#endif

    // S^T = K Q^T for this warp's 16 keys
    float s[NTQ][4];
#pragma unroll
    for (int nt = 0; nt < NTQ; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[nt][i] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      u32 a[4];
      ldsm_x4(a, (sK_a + 2 * ((warp_key0 + a_row) * LD + ks * 16 + a_col)));
#pragma unroll
      for (int np = 0; np < NTQ / 2; ++np) {
        u32 bf[4];
        ldsm_x4(bf, (sQ_a + 2 * ((np * 16 + bn_row) * LD + ks * 16 + bn_col)));
        mma16816<BF16>(s[2 * np], a, bf[0], bf[1]);
        mma16816<BF16>(s[2 * np + 1], a, bf[2], bf[3]);
      }
    }

    // P^T = exp2(score - lse): raw q.k scaled inside exp2 (no score mod), or the modified
    // score in log2 units; tiles wholly inside the window skip the mask
    const bool need_mask = m0 + BM > Sq || !tile_inside_band(vis, m0, BM, n0, BN);
    float dcap[MOD ? NTQ : 1][4];
#pragma unroll
    for (int nt = 0; nt < NTQ; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int qcol = nt * 8 + 2 * t4 + (i & 1);
        float x = s[nt][i];
        if constexpr (MOD) {
          const int key = n0 + warp_key0 + g + (i >> 1) * 8;
          x = apply_score_mod(mod, x, m0 + qcol, key, &dcap[nt][i]);
        }
        s[nt][i] = exp2_approx(fmaf(x, unit, -lse2[qcol]));
      }
    if (need_mask) {
#pragma unroll
      for (int nt = 0; nt < NTQ; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int key = n0 + warp_key0 + g + (i >> 1) * 8;
          const int query = m0 + nt * 8 + 2 * t4 + (i & 1);
          if (query >= Sq || !key_visible(vis, query, key)) s[nt][i] = 0.f;
        }
    }

    if constexpr (WITH_DV) {
      // dV += P^T dO
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        u32 a[4];
        a[0] = pack2<BF16>(s[2 * kk][0], s[2 * kk][1]);
        a[1] = pack2<BF16>(s[2 * kk][2], s[2 * kk][3]);
        a[2] = pack2<BF16>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        a[3] = pack2<BF16>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
        for (int dp = 0; dp < DT / 2; ++dp) {
          u32 bf[4];
          ldsm_x4_t(bf, (sdO_a + 2 * ((kk * 16 + bt_row) * LD + dp * 16 + bt_col)));
          mma16816<BF16>(dv_acc[2 * dp], a, bf[0], bf[1]);
          mma16816<BF16>(dv_acc[2 * dp + 1], a, bf[2], bf[3]);
        }
      }
    }

    if constexpr (WITH_DK) {
      // dP^T = V dO^T
      float dpt[NTQ][4];
#pragma unroll
      for (int nt = 0; nt < NTQ; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) dpt[nt][i] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        u32 a[4];
        ldsm_x4(a, (sV_a + 2 * ((warp_key0 + a_row) * LD + ks * 16 + a_col)));
#pragma unroll
        for (int np = 0; np < NTQ / 2; ++np) {
          u32 bf[4];
          ldsm_x4(bf, (sdO_a + 2 * ((np * 16 + bn_row) * LD + ks * 16 + bn_col)));
          mma16816<BF16>(dpt[2 * np], a, bf[0], bf[1]);
          mma16816<BF16>(dpt[2 * np + 1], a, bf[2], bf[3]);
        }
      }
      // dS^T = P^T (dP^T - delta), times the softcap derivative
#pragma unroll
      for (int nt = 0; nt < NTQ; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float ds = s[nt][i] * (dpt[nt][i] - delta[nt * 8 + 2 * t4 + (i & 1)]);
          if constexpr (MOD) ds *= dcap[nt][i];
          s[nt][i] = ds;
        }
      // dK += dS^T Q, and stage dS^T for dQ
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        u32 a[4];
        a[0] = pack2<BF16>(s[2 * kk][0], s[2 * kk][1]);
        a[1] = pack2<BF16>(s[2 * kk][2], s[2 * kk][3]);
        a[2] = pack2<BF16>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        a[3] = pack2<BF16>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        if constexpr (WITH_DQ) {
          const int r0 = warp_key0 + g;
          const int c0 = kk * 16 + 2 * t4;
          *reinterpret_cast<u32*>(sdS + r0 * LDS + c0) = a[0];
          *reinterpret_cast<u32*>(sdS + (r0 + 8) * LDS + c0) = a[1];
          *reinterpret_cast<u32*>(sdS + r0 * LDS + c0 + 8) = a[2];
          *reinterpret_cast<u32*>(sdS + (r0 + 8) * LDS + c0 + 8) = a[3];
        }
#pragma unroll
        for (int dp = 0; dp < DT / 2; ++dp) {
          u32 bf[4];
          ldsm_x4_t(bf, (sQ_a + 2 * ((kk * 16 + bt_row) * LD + dp * 16 + bt_col)));
          mma16816<BF16>(dk_acc[2 * dp], a, bf[0], bf[1]);
          mma16816<BF16>(dk_acc[2 * dp + 1], a, bf[2], bf[3]);
        }
      }
      __syncthreads();  // dS^T of every warp is staged; every warp is done with this stage

      // dQ[m0.., :] += dS K, split in (16 queries x DQC columns) tasks over the warps
      if constexpr (WITH_DQ) {
        float* dq = p.dq_accum + row_base(hq) * p.dq_row;
        for (int task = warp; task < DQ_TASKS; task += NW) {
          const int mt = task / (HD / DQC);
          const int dc = task - mt * (HD / DQC);
          float acc[DQC / 8][4];
#pragma unroll
          for (int j = 0; j < DQC / 8; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
#pragma unroll
          for (int kk = 0; kk < BN / 16; ++kk) {
            u32 a[4];
            // A = dS (queries x keys) read transposed from dS^T
            ldsm_x4_t(a, (sdS_a + 2 * ((kk * 16 + bn_row) * LDS + mt * 16 + bn_col)));
#pragma unroll
            for (int dp = 0; dp < DQC / 16; ++dp) {
              u32 bf[4];
              ldsm_x4_t(bf, (sK_a + 2 * ((kk * 16 + bt_row) * LD + dc * DQC + dp * 16 + bt_col)));
              mma16816<BF16>(acc[2 * dp], a, bf[0], bf[1]);
              mma16816<BF16>(acc[2 * dp + 1], a, bf[2], bf[3]);
            }
          }
#pragma unroll
          for (int j = 0; j < DQC / 8; ++j)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int row = m0 + mt * 16 + g + r * 8;
              const int col = dc * DQC + j * 8 + 2 * t4;
              if (row < Sq && col < p.head_dim) atomic_add2(dq + (long long)row * p.dq_row + col, acc[j][2 * r],
                                                            acc[j][2 * r + 1]);
            }
        }
      }
    } else {
      __syncthreads();  // every warp is done with this stage before it is refilled
    }
  }

  cp_wait<0>();
  __syncthreads();  // sK / sV are reused to stage dK / dV
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int srow = warp_key0 + g + r * 8;
      if constexpr (WITH_DK)
        *reinterpret_cast<u32*>(sK + srow * LD + dt * 8 + 2 * t4) =
            pack2<BF16>(dk_acc[dt][2 * r] * p.scale, dk_acc[dt][2 * r + 1] * p.scale);
      if constexpr (WITH_DV)
        *reinterpret_cast<u32*>(sV + srow * LD + dt * 8 + 2 * t4) =
            pack2<BF16>(dv_acc[dt][2 * r], dv_acc[dt][2 * r + 1]);
    }
  __syncthreads();
  if constexpr (WITH_DK) {
    u16* dk = (u16*)p.dk + b * p.dk_bs + hk * p.dk_hs + k_first * p.dk_rs;
    store_tile<BN, HD, THREADS>(dk, p.dk_rs, sK, n0, Sk, p.head_dim, tid);
  }
  if constexpr (WITH_DV) {
    u16* dv = (u16*)p.dv + b * p.dv_bs + hk * p.dv_hs + k_first * p.dv_rs;
    store_tile<BN, HD, THREADS>(dv, p.dv_rs, sV, n0, Sk, p.head_dim_v, tid);
  }
}

#if VARLEN
extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32) attnx_bwd(const AttnParams p, const VarlenParams vp) {
  attention_backward<IS_BF16 != 0, HEAD_DIM, BLOCK_N, BLOCK_M, NUM_WARPS, SCORE_MOD != 0, DO_DV != 0,
                     DO_DK != 0, DQ_ATOMIC != 0>(p, vp);
}
#else
extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32) attnx_bwd(const AttnParams p) {
  attention_backward<IS_BF16 != 0, HEAD_DIM, BLOCK_N, BLOCK_M, NUM_WARPS, SCORE_MOD != 0, DO_DV != 0,
                     DO_DK != 0, DQ_ATOMIC != 0>(p);
}
#endif
