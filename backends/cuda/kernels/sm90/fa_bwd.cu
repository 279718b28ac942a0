// FlashAttention backward for Hopper (sm_90a): warp-specialised, TMA-fed, wgmma.
//
// One thread block of three warpgroups per 128 keys (BN) of one (batch, kv head); it walks
// every query block of every query head of its GQA group, so dK and dV are summed over the
// group in registers (no copies, no atomics):
// - warpgroup 0, the producer, gives back most of its registers; one of its threads loads K and
//   V once and then Q and dO of each step through a 2-stage TMA ring, its warp copies the step's
//   lse (log2 units, +inf past the sequence end) and delta rows beside them, and every lane
//   arrives on the stage's "full" barrier (the TMA bytes and 33 arrivals complete it);
// - warpgroups 1 and 2, the consumers, own 64 keys each. Per step of BM queries:
//     S^T = K Q^T, dP^T = V dO^T     wgmma, both operands in shared memory (K-major)
//     P^T = exp2(S^T - lse), dS^T = P^T (dP^T - delta) [x softcap'] in registers
//     dS^T -> shared memory (double-buffered), before the GEMMs below read its registers
//     dV += P^T dO, dK += dS^T Q     wgmma with A from registers (dO, Q MN-major); then a named
//                                    barrier joins the two consumers (both dS^T halves staged)
//     dQ += dS K                     wgmma, A (dS) and B (K) MN-major in shared memory, each
//                                    consumer one half (DqSplit: rows, columns or keys), added
//                                    to the fp32 dq_accum with red.global.add.v2 (or DQ_TMA)
// - at the end dK (times the scale) and dV go through the (now free) K and V tiles to TMA stores
//   that clip at Sk and at the head dims.
// The table's schedule (DQ_LATE) waits for each GEMM group before the next, except dQ's: a step's dQ is
// waited for at the next step's start and added to dq_accum (DQ_ORDERED: in its turn) while that step's
// S^T GEMM runs (DQ_TMA: staged in shared memory and added with TMA reduce-adds; with DQ_WRITER, the ordered
// twin's, by a thread of the producer warpgroup, so no consumer waits for a turn). Without it (the plain
// schedule) dQ is waited for and added at the end of its own step. The elementwise step is sm90/bwd_probs.cuh; the roles, dQ split, shared-memory layout, work split and the
// knobs' defaults are sm90/bwd_roles.cuh.
// A step whose tile is not wholly inside the causal/window band (tested for the whole thread
// block, so ptxas keeps the wgmma pipeline) masks per element; the others skip the mask.
// Rows and columns outside the tensors arrive from TMA as zeros; padded query rows get lse = +inf
// (P = 0), padded keys are masked (key_visible checks Sk).
//
// Compile-time knobs (NVRTC -D): IS_BF16, HEAD_DIM (tile: 64 or 128), BLOCK_M (queries per step:
// 64 or 128), BLOCK_N (keys per block, 128), SCORE_MOD, DQ_LATE, DQ_TMA, DQ_WRITER, DQ_ROTATE (their
// defaults and what each does: sm90/bwd_roles.cuh), DQ_ORDERED (with red or DQ_TMA: the dQ additions
// into each (batch, query head, query block) of dq_accum in one fixed order of key blocks, so dq is
// the same bits on every run; see "Ordered dQ" below), SHARED_BYTES (what the launcher reserves).
// Checked and timed on the H200 (2026-12-01): see backends/cuda/NOTES.md, "Hopper backward".
#include "common/mask.cuh"
#include "common/score_mod.cuh"
#include "sm90/ptx.cuh"
#include "sm90/wgmma_ops.cuh"
#include "sm90/dq_order.cuh"
#include "sm90/bwd_probs.cuh"
#include "sm90/bwd_roles.cuh"
#include "sm90/bwd_dq_add.cuh"

namespace sm90_bwd {

// ---- producer (one warp) ----------------------------------------------------------------------
template <int HD, int BM>
DEVI void produce(const AttnParams& p, const Work& w, u32 base, float* lse_s, float* delta_s, const TmaMap* tq,
                  const TmaMap* tk, const TmaMap* tv, const TmaMap* tdo) {
  using L = Layout<HD, BM>;
  const int lane = threadIdx.x & 31;
  if (lane == 0) {
    tma_prefetch(tq);
    tma_prefetch(tk);
    tma_prefetch(tv);
    tma_prefetch(tdo);
    mbar_arrive_expect_tx(L::kv_full(base), 2 * L::KV_TILE);
#pragma unroll
    for (int pn = 0; pn < L::PANELS; ++pn) {
      tma_load_4d(base + L::K + pn * L::KV_PANEL, tk, pn * 64, w.n0, w.hk, w.b, L::kv_full(base));
      tma_load_4d(base + L::V + pn * L::KV_PANEL, tv, pn * 64, w.n0, w.hk, w.b, L::kv_full(base));
    }
  }
  for (int i = 0; i < w.steps; ++i) {
    const int s = i & 1;
    const int hq = step_head(p, w, i), m0 = step_m0<BM>(w, i);
    mbar_wait(L::empty(base, s), ((i >> 1) & 1) ^ 1);
    if (lane == 0) {
      mbar_arrive_expect_tx(L::full(base, s), 2 * L::QD_TILE);
#pragma unroll
      for (int pn = 0; pn < L::PANELS; ++pn) {
        tma_load_4d(base + L::Q + s * L::QD_TILE + pn * L::QD_PANEL, tq, pn * 64, m0, hq, w.b, L::full(base, s));
        tma_load_4d(base + L::DO + s * L::QD_TILE + pn * L::QD_PANEL, tdo, pn * 64, m0, hq, w.b, L::full(base, s));
      }
    }
    const long long rows = ((long long)w.b * p.heads_q + hq) * p.seqlen_q;
    for (int r = lane; r < BM; r += 32) {
      const bool inside = m0 + r < p.seqlen_q;
      lse_s[s * BM + r] = inside ? p.lse[rows + m0 + r] : pos_inf();  // P = 0 on padded rows
      delta_s[s * BM + r] = inside ? p.delta[rows + m0 + r] : 0.f;
    }
    mbar_arrive(L::full(base, s));  // release: the copies above are visible to the consumers' wait
  }
}

// ---- consumer parts ---------------------------------------------------------------------------
// C^T = A B^T for this warpgroup's 64 rows of A (keys) and the BM rows of B (queries), both
// K-major over HD columns: S^T = K Q^T and dP^T = V dO^T.
template <bool BF16, int HD, int BM>
DEVI void issue_rows_by_queries(float (&c)[BM / 2], u32 a_rows, u32 b_tile) {
#pragma unroll
  for (int ks = 0; ks < HD / 16; ++ks) {
    const u64 a = smem_desc(a_rows + (ks / 4) * (BN * 128) + (ks % 4) * 32, 16, 1024);
    const u64 b = smem_desc(b_tile + (ks / 4) * (BM * 128) + (ks % 4) * 32, 16, 1024);
    wgmma_ss<BM, BF16>(c, a, b, ks > 0);
  }
}

// acc += A B with A (64 keys x BM queries) from registers and B (BM queries x HD) MN-major:
// dV += P^T dO, dK += dS^T Q. k-steps of 16 queries are 2048 bytes apart inside a panel.
template <bool BF16, int HD, int BM>
DEVI void issue_from_registers(float (&acc)[HD / 2], const u32 (&a)[BM / 16][4], u32 b_tile) {
#pragma unroll
  for (int kk = 0; kk < BM / 16; ++kk) wgmma_rs<HD, BF16>(acc, a[kk], smem_desc(b_tile + kk * 2048, BM * 128, 1024), 1);
}

// dQ part = dS K over KEYS keys: A = 64 queries of dS^T (MN-major, one panel), B = DQ_N columns
// of K (MN-major, whole panels), both starting at the first of those keys.
template <bool BF16, int DQ_N, int KEYS>
DEVI void issue_dq(float (&dq)[DQ_N / 2], u32 ds_panel, u32 k_panel) {
#pragma unroll
  for (int kk = 0; kk < KEYS / 16; ++kk)
    wgmma_ss_mn<DQ_N, BF16>(dq, smem_desc(ds_panel + kk * 2048, BN * 128, 1024),
                            smem_desc(k_panel + kk * 2048, BN * 128, 1024), kk > 0);
}

// This consumer's dQ part of a step (one pass of DqSplit's N columns): its half of dS K by DqSplit.
template <bool BF16, int HD, int BM>
DEVI void issue_step_dq(float (&dq)[DqSplit<HD, BM>::N / 2], u32 ds_tile, u32 base, u32 k_rows, int consumer) {
  using L = Layout<HD, BM>;
  using Split = DqSplit<HD, BM>;
  if constexpr (Split::HOW == Split::BY_ROWS)
    issue_dq<BF16, Split::N, Split::KEYS>(dq, ds_tile + consumer * L::DS_PANEL, base + L::K);
  else if constexpr (Split::HOW == Split::BY_COLUMNS)
    issue_dq<BF16, Split::N, Split::KEYS>(dq, ds_tile, base + L::K + consumer * L::KV_PANEL);
  else
    issue_dq<BF16, Split::N, Split::KEYS>(dq, ds_tile + consumer * 64 * 128, k_rows);
}

// 128-byte swizzle of TMA tiles: the 16-byte chunk index is xor-ed with the row inside its 8-row atom.
DEVI u32 swizzled(u32 panel, int row, int col) {
  return panel + row * 128 + ((u32)((col >> 3) ^ (row & 7)) << 4) + (col & 7) * 2;
}

// dS^T of this warpgroup's 64 keys -> its rows of the step's dS^T buffer (panels of 64 queries).
template <int BM>
DEVI void stage_ds(const u32 (&da)[BM / 16][4], u32 ds_tile, int key_row, int t4) {
#pragma unroll
  for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = key_row + 8 * (j & 1);
      const int col = 16 * kk + 8 * (j >> 1) + 2 * t4;
      const u32 addr = swizzled(ds_tile + (col / 64) * (BN * 128), row, col % 64);
      asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(da[kk][j]) : "memory");
    }
}

// A 64 x N accumulator (rows of this warpgroup) times `scale` -> 16-bit, swizzled, into `rows`
// (the warpgroup's first row of a BN-row tile: panels BN * 128 bytes apart).
template <bool BF16, int HD>
DEVI void write_rows(const float (&acc)[HD / 2], float scale, u32 rows, int warp_in_group, int lane) {
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int c = 0; c < HD / 8; ++c)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp_in_group * 16 + g + half * 8;
      const u32 addr = swizzled(rows + (c / 8) * (BN * 128), row, (c % 8) * 8 + 2 * t4);
      const u32 packed = pack2<BF16>(acc[4 * c + 2 * half] * scale, acc[4 * c + 2 * half + 1] * scale);
      asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(packed) : "memory");
    }
}

template <bool BF16, int HD, int BM, bool MOD, bool ORD>
DEVI void consume(const AttnParams& p, const Work& w, const Visibility& vis, u32 base, const float* lse_s,
                  const float* delta_s, const TmaMap* tdk, const TmaMap* tdv, const TmaMap* tdq, int* dq_sem) {
  using L = Layout<HD, BM>;
  using Split = DqSplit<HD, BM>;
  constexpr int DQ_N = Split::N;
  const int consumer = threadIdx.x / 128 - 1;
  const int warp_in_group = (threadIdx.x / 32) & 3, lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int key_row = consumer * 64 + warp_in_group * 16 + g;  // and key_row + 8, inside the block
  const u32 k_rows = base + L::K + consumer * 64 * 128;
  const u32 v_rows = base + L::V + consumer * 64 * 128;
  const int dq_row0 = Split::row0(consumer), dq_col0 = Split::col0(consumer);

  float dk[HD / 2], dv[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) dk[i] = dv[i] = 0.f;
#if DQ_LATE
  // the previous step's dQ part (its GEMM may still run) and its query head and block
  float dq_late[DQ_N / 2];
  int late_hq = 0, late_m0 = 0;
  int handed = 0;  // DQ_WRITER: parts handed to the writer so far
  const auto add_late_dq = [&]() {  // (after a wait for its GEMM)
    fence_regs(dq_late);
    if constexpr (DQ_WRITER) {
      // the staging is free once the writer's additions of the previous parts have read it
      mbar_wait(L::dq_empty(base), (handed & 1) ^ 1);
      stage_dq_boxes<DQ_N>(dq_late, base + L::DQT + consumer * L::DQT_PART, warp_in_group, lane);
      fence_async_shared();
      __syncwarp();
      if (lane == 0) mbar_arrive(L::dq_full(base));
      ++handed;
    } else if constexpr (DQ_TMA && ORD) {
      // the staging is free: the previous additions completed before their turn passed (pass_late_turn),
      // and a barrier of both consumers followed
      stage_dq_boxes<DQ_N>(dq_late, base + L::DQT + consumer * L::DQT_PART, warp_in_group, lane);
      fence_async_shared();
      tma_dq_in_turn<HD, BM, L::DQT_PART, L::DQT_BOX>(tdq, base + L::DQT, p, vis, w, dq_sem, late_hq, late_m0);
    } else if constexpr (DQ_TMA) {
      // the staging is free once the previous reduce-adds have read it (the issuer waits, the barrier tells
      // the others); written, made visible to the async proxy, then one thread adds both boxes
      const u32 stage = base + L::DQT + consumer * L::DQT_PART;
      const bool issuer = warp_in_group == 0 && lane == 0;
      if (issuer) tma_store_wait_read();
      named_sync(DQ_STAGE_BARRIER + consumer, 128);
      stage_dq_boxes<DQ_N>(dq_late, stage, warp_in_group, lane);
      fence_async_shared();
      named_sync(DQ_STAGE_BARRIER + consumer, 128);
      if (issuer) {
#pragma unroll
        for (int box = 0; box < 2; ++box)
          tma_reduce_add_3d(tdq, stage + box * L::DQT_BOX, dq_col0 + 32 * box, late_m0 + dq_row0,
                            w.b * p.heads_q + late_hq);
        tma_store_commit();
      }
    } else if constexpr (ORD) {
      red_dq_in_turn<HD, BM>(dq_late, p, vis, w, dq_sem, late_hq, late_m0, late_m0 + dq_row0 + warp_in_group * 16 + g,
                             dq_col0 + 2 * t4, consumer);
    } else {
      float* dq_head = p.dq_accum + ((long long)w.b * p.heads_q + late_hq) * p.seqlen_q * p.dq_row;
      red_dq<DQ_N>(dq_late, dq_head, p.dq_row, late_m0 + dq_row0 + warp_in_group * 16 + g, dq_col0 + 2 * t4,
                   vis.seqlen_q);
    }
  };
  // DQ_ORDERED with DQ_TMA: the turn of the part add_late_dq added passes once its additions completed
  const auto pass_late_turn = [&]() {
    if constexpr (DQ_TMA && ORD && !DQ_WRITER)
      if (threadIdx.x == 128) pass_dq_turn<BM>(p, vis, w, dq_sem, late_hq, late_m0);
  };
#endif

  if (w.steps > 0) mbar_wait(L::kv_full(base), 0);
  for (int i = 0; i < w.steps; ++i) {
    const int s = i & 1;
    const int hq = step_head(p, w, i), m0 = step_m0<BM>(w, i);
    const u32 q_tile = base + L::Q + s * L::QD_TILE, do_tile = base + L::DO + s * L::QD_TILE;
    const u32 ds_tile = base + L::DS + s * L::DS_TILE;
    const ScoreMod mod = score_mod(p, w.b, hq);  // read only by the MOD specialisation

    float st[BM / 2], dpt[BM / 2];
    u32 pa[BM / 16][4], da[BM / 16][4];
    const bool masked = m0 + BM > vis.seqlen_q || !tile_inside_band(vis, m0, BM, w.n0, BN);
    const float* lse = lse_s + s * BM;
    const float* delta = delta_s + s * BM;
    mbar_wait(L::full(base, s), (i >> 1) & 1);
    if constexpr (!MOD) {
#if DQ_LATE
      wgmma_wait<0>();  // the previous step's dQ (waited for here: after S^T's issue ptxas serialised, C7514)
#endif
      wgmma_fence();
      issue_rows_by_queries<BF16, HD, BM>(st, k_rows, q_tile);
#if DQ_LATE
      // under S^T's GEMM; before dP^T's is issued (with its accumulators live too, ptxas spilled)
      wgmma_commit();
      if (i > 0) add_late_dq();
      wgmma_fence();
#endif
      issue_rows_by_queries<BF16, HD, BM>(dpt, v_rows, do_tile);
      wgmma_commit();
#if DQ_LATE
      if (i > 0) pass_late_turn();  // beside dP^T's GEMM
#endif
      wgmma_wait<0>();
      fence_regs(st);
      fence_regs(dpt);
      grads_any<BF16, BM>(masked, st, dpt, pa, da, lse, delta, vis, p.scale_log2, w.n0 + key_row, m0, t4);
    } else {
      // dP^T issued after P^T keeps tanh's temporaries away from its accumulators
#if DQ_LATE
      wgmma_wait<0>();  // the previous step's dQ
#endif
      wgmma_fence();
      issue_rows_by_queries<BF16, HD, BM>(st, k_rows, q_tile);
      wgmma_commit();
#if DQ_LATE
      if (i > 0) add_late_dq();  // under S^T's GEMM
#endif
      wgmma_wait<0>();
      fence_regs(st);
      u32 dcap[BM / 4];
      probs_modded_any<BM>(masked, st, dcap, lse, vis, mod, w.n0 + key_row, m0, t4);
      wgmma_fence();
      issue_rows_by_queries<BF16, HD, BM>(dpt, v_rows, do_tile);
      wgmma_commit();
#if DQ_LATE
      if (i > 0) pass_late_turn();  // beside dP^T's GEMM
#endif
      wgmma_wait<0>();
      fence_regs(dpt);
      grads_from_probs<BF16, BM>(st, dpt, dcap, pa, da, delta, t4);
    }

    // dS^T to shared memory before the GEMMs that read `da` are issued: the PTX ISA makes any access
    // to the A-fragment registers of a pending wgmma undefined (wgmma.wait_group), reads included.
    // Buffer s is free: the other consumer's dQ of step i - 2, its last reader, finished before that
    // consumer reached barrier 1 at step i - 1 (split by keys each consumer reads only its own rows).
    stage_ds<BM>(da, ds_tile, key_row, t4);

    wgmma_fence();  // also orders the reads of `da` above before the wgmma reads them
    issue_from_registers<BF16, HD, BM>(dv, pa, do_tile);
    issue_from_registers<BF16, HD, BM>(dk, da, q_tile);
    wgmma_commit();

    // both consumers' dS^T in shared memory
    fence_async_shared();
    named_sync(STEP_BARRIER, 256);

#if DQ_LATE
    {
      wgmma_fence();  // (orders this step's reductions of dq_late before the GEMM overwrites it)
      issue_step_dq<BF16, HD, BM>(dq_late, ds_tile, base, k_rows, consumer);
      wgmma_commit();
      wgmma_wait<1>();  // dV's and dK's GEMMs are done (dQ's may run on): stage s is free
      fence_regs(dk);
      fence_regs(dv);
      fence_regs(pa);
      fence_regs(da);
      mbar_arrive(L::empty(base, s));
      late_hq = hq;
      late_m0 = m0;
      continue;
    }
#endif
    float dq[DQ_N / 2];
    wgmma_fence();
    issue_step_dq<BF16, HD, BM>(dq, ds_tile, base, k_rows, consumer);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(dq);
    fence_regs(dk);
    fence_regs(dv);
    fence_regs(pa);
    fence_regs(da);
    mbar_arrive(L::empty(base, s));  // this thread is done with Q, dO, lse, delta of stage s

    float* dq_head = p.dq_accum + ((long long)w.b * p.heads_q + hq) * p.seqlen_q * p.dq_row;
    if constexpr (ORD) {
      red_dq_in_turn<HD, BM>(dq, p, vis, w, dq_sem, hq, m0, m0 + dq_row0 + warp_in_group * 16 + g,
                             dq_col0 + 2 * t4, consumer);
    } else {  // (the loop as it was, not red_dq: the plain schedule's builds stay byte-identical)
#pragma unroll
      for (int c = 0; c < DQ_N / 8; ++c)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = m0 + dq_row0 + warp_in_group * 16 + g + half * 8;
          const int col = dq_col0 + c * 8 + 2 * t4;
          if (row < vis.seqlen_q) red_add_v2(dq_head + (long long)row * p.dq_row + col, dq[4 * c + 2 * half],
                                             dq[4 * c + 2 * half + 1]);
        }
    }
  }

#if DQ_LATE
  wgmma_wait<0>();  // the last step's dQ
  if (w.steps > 0) {
    add_late_dq();
    pass_late_turn();
  }
#endif
  // Every wgmma that reads K or V (the other consumer's dQ reads all of K) is done: the tiles
  // become the staging buffers of dK and dV.
  named_sync(STEP_BARRIER, 256);
  write_rows<BF16, HD>(dk, p.scale, k_rows, warp_in_group, lane);
  write_rows<BF16, HD>(dv, 1.f, v_rows, warp_in_group, lane);
  fence_async_shared();
  named_sync(STORE_BARRIER + consumer, 128);
  if (warp_in_group == 0 && lane == 0) {
    // the block's coordinates read again (volatile): held across the loop they cost a spill slot
    u32 block;
    asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(block));
    const int bhk = block / p.num_blocks, n0 = key_block_of<ORD>(block - bhk * p.num_blocks, p.num_blocks) * BN;
    const int b = bhk / p.heads_kv, hk = bhk - b * p.heads_kv;
#pragma unroll
    for (int pn = 0; pn < HD / 64; ++pn) {
      tma_store_4d(tdk, k_rows + pn * L::KV_PANEL, pn * 64, n0 + consumer * 64, hk, b);
      tma_store_4d(tdv, v_rows + pn * L::KV_PANEL, pn * 64, n0 + consumer * 64, hk, b);
    }
    tma_store_commit();
    tma_store_wait_read();
  }
}

template <bool BF16, int HD, int BM, bool MOD, bool ORD>
DEVI void attention_backward(const AttnParams& p, const TmaMap* tq, const TmaMap* tk, const TmaMap* tv,
                             const TmaMap* tdo, const TmaMap* tdk, const TmaMap* tdv, const TmaMap* tdq,
                             int* dq_sem) {
  using L = Layout<HD, BM>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const u32 raw = smem_u32(smem_raw);
  const u32 base = (raw + 1023) & ~1023u;  // swizzle atoms need 1024-byte alignment
  unsigned char* aligned = smem_raw + (base - raw);
  float* lse_s = reinterpret_cast<float*>(aligned + L::LSE);
  float* delta_s = reinterpret_cast<float*>(aligned + L::DELTA);

  const Visibility vis = visibility(p);
  const Work w = work_of<BM, ORD>(p, vis);
  if (threadIdx.x == 0) {
    mbar_init(L::kv_full(base), 1);
    for (int s = 0; s < 2; ++s) {
      mbar_init(L::full(base, s), FULL_ARRIVALS);
      mbar_init(L::empty(base, s), CONSUMER_THREADS);
    }
    mbar_init(L::dq_full(base), CONSUMER_WARPS);
    mbar_init(L::dq_empty(base), 1);
    mbar_init_fence();
  }
  __syncthreads();

  if (threadIdx.x < 128) {
    regs_dealloc<PRODUCER_REGS>();
    if (threadIdx.x < 32 && w.steps > 0) produce<HD, BM>(p, w, base, lse_s, delta_s, tq, tk, tv, tdo);
    if constexpr (DQ_WRITER)
      if (threadIdx.x == 32 && w.steps > 0)
        write_dq_tma<HD, BM, ORD, L::DQT_PART, L::DQT_BOX>(p, vis, w, base + L::DQT, L::dq_full(base),
                                                            L::dq_empty(base), tdq, dq_sem);
  } else {
    regs_alloc<CONSUMER_REGS>();
    consume<BF16, HD, BM, MOD, ORD>(p, w, vis, base, lse_s, delta_s, tdk, tdv, tdq, dq_sem);
  }
}

}  // namespace sm90_bwd

// DQ_ORDERED adds one argument: the turn counters, int32 (B, Hq, ceil(Sq / BLOCK_M)), zeroed; DQ_TMA one: the
// fp32 map of dq_accum (dims HD, Sq, B * Hq; boxes 32 x 64; 128-byte swizzle).
extern "C" __global__ void __launch_bounds__(sm90_bwd::THREADS, 1)
    attnx_bwd_wgmma(const AttnParams p, const __grid_constant__ TmaMap tq, const __grid_constant__ TmaMap tk,
                    const __grid_constant__ TmaMap tv, const __grid_constant__ TmaMap tdo,
                    const __grid_constant__ TmaMap tdk, const __grid_constant__ TmaMap tdv
#if DQ_ORDERED
                    , int* dq_sem
#endif
#if DQ_TMA
                    , const __grid_constant__ TmaMap tdq
#endif
    ) {
  static_assert(BLOCK_N == sm90_bwd::BN, "the kernel's roles fix 128 keys per block");
  static_assert(sm90_bwd::Layout<HEAD_DIM, BLOCK_M>::BYTES + 1024 == SHARED_BYTES,
                "variants.py's shared_bytes() disagrees with the kernel's layout");
  static_assert(!DQ_TMA || DQ_LATE, "DQ_TMA replaces DQ_LATE's atomic reductions");
  static_assert(!DQ_ROTATE || DQ_ORDERED, "DQ_ROTATE is a walk for the ordered dQ's turns");
  static_assert(!DQ_WRITER || DQ_TMA, "DQ_WRITER moves DQ_TMA's additions (and turns) to a writer");
#if !DQ_ORDERED
  int* const dq_sem = nullptr;
#endif
#if DQ_TMA
  const TmaMap* const dq_map = &tdq;
#else
  const TmaMap* const dq_map = nullptr;
#endif
  sm90_bwd::attention_backward<IS_BF16 != 0, HEAD_DIM, BLOCK_M, SCORE_MOD != 0, DQ_ORDERED != 0>(
      p, &tq, &tk, &tv, &tdo, &tdk, &tdv, dq_map, dq_sem);
}
