// The Hopper backward's roles, tiles and work split (kernels/sm90/fa_bwd.cu): the compile-time
// knobs' defaults, the thread block's warpgroup roles and named barriers, how dQ is split between
// the consumers, the shared-memory layout, and which keys and query blocks a thread block walks.
#pragma once
#include "common/mask.cuh"
#include "sm90/ptx.cuh"

#ifndef DQ_ORDERED
#define DQ_ORDERED 0
#endif
// DQ_LATE (the table's since 2026-12-03; 0.99-1.08x the plain schedule on the H200): the dQ GEMM of step
// i is not waited for in step i; step i + 1 waits for it after its "full" barrier, issues S^T, adds dQ(i)
// to dq_accum while S^T's GEMM runs, then issues dP^T; so the reductions leave the tensor cores' idle gap.
#ifndef DQ_LATE
#define DQ_LATE 0
#endif
// DQ_TMA (with DQ_LATE; the table's since 2026-12-03, 1.07-1.20x DQ_LATE alone on the H200): the late dQ part
// goes to shared memory (two 64 x 32 fp32 boxes, 128-byte swizzle) and one thread adds it to dq_accum with
// TMA reduce-adds, so the consumers issue 16 shared stores instead of 16 global reductions between S^T's
// issue and dP^T's (FlashAttention-3's dQ path). With DQ_ORDERED (and without DQ_WRITER: 2026-12-03 run 12's
// twin): thread 128 adds both consumers' parts in the query block's turn and passes it once they completed,
// beside dP^T's GEMM.
#ifndef DQ_TMA
#define DQ_TMA 0
#endif
// DQ_WRITER (with DQ_TMA; the ordered twin's since 2026-12-03 run 13, opt-in over the table): the consumers
// only stage their dQ parts and hand them over through the dq_full / dq_empty mbarriers; one thread of the
// producer warpgroup's second warp adds them with the TMA reduce-adds (DQ_ORDERED: it waits for the turn before the parts arrive and passes it once they
// completed), so no turn wait, completion wait or staging barrier stands in a consumer's step.
#ifndef DQ_WRITER
#define DQ_WRITER 0
#endif
// DQ_ROTATE (with DQ_ORDERED; opt-in: correct, slower than unrotated on most rows, H200 2026-12-03 run 13): for problems where every query sees every key,
// M query blocks, N <= M key blocks all resident at once (the launcher checks all three: rotation_applies),
// key block n walks the query blocks from k n (k = M / N) cyclically, and query block m takes its adders in
// that walk's visit order: rank (min(m / k, N - 1) - n) mod N (dq_turn), so consecutive adders of a query
// block visit it at least k steps apart instead of in lockstep (NOTES.md "Ordered dQ through TMA").
#ifndef DQ_ROTATE
#define DQ_ROTATE 0
#endif

namespace sm90_bwd {

constexpr int BN = 128;             // keys per thread block: 2 consumer warpgroups x 64
constexpr int THREADS = 384;        // producer + 2 consumers
constexpr int CONSUMER_WARPS = 8;   // arrivals that hand the staged dQ parts to the writer (DQ_WRITER)
// Every consumer thread arrives to free a Q/dO/lse/delta stage (not one lane per warp after a
// __syncwarp: as valid, but compute-sanitizer's racecheck then reports the producer's next lse/delta
// stores as racing with the other lanes' reads; H200, 2026-12-01).
constexpr int CONSUMER_THREADS = 256;
constexpr int FULL_ARRIVALS = 33;   // the producer's expect_tx arrival + its warp's 32 after the lse/delta copy
constexpr int PRODUCER_REGS = 24;
constexpr int CONSUMER_REGS = 240;  // 128 x 24 + 256 x 240 <= 64K registers
constexpr int STEP_BARRIER = 1;     // named barriers: 1 both consumers (256); 2, 3 one consumer's epilogue
constexpr int STORE_BARRIER = 2;
// DQ_ORDERED: 4 both consumers (256) around one query block's turn; 5 (split by keys) consumer 0's
// additions before consumer 1's. (An enum: namespace-scope constants here become symbols of the cubin.)
// DQ_TMA: 8, 9 one consumer's dQ staging (free, then written).
enum : int { ORDER_BARRIER = 4, BATON_BARRIER = 5, DQ_STAGE_BARRIER = 8 };

// dQ = dS K split between the two consumers: BM = 128, by rows (each one 64-query dS^T panel,
// N = HD); BM = 64, by columns where the head dim has two panels (each one 64-column K panel),
// else by keys (each its own 64 keys, both adding to the same dQ elements).
template <int HD, int BM>
struct DqSplit {
  enum { BY_ROWS, BY_COLUMNS, BY_KEYS };
  static constexpr int HOW = BM == 128 ? BY_ROWS : HD >= 128 ? BY_COLUMNS : BY_KEYS;
  static constexpr int N = HOW == BY_COLUMNS ? HD / 2 : HD;  // dQ columns per consumer
  static constexpr int KEYS = HOW == BY_KEYS ? 64 : BN;       // k extent of each consumer's GEMM
  static_assert(N % 64 == 0, "MN-major wgmma operands are whole 64-column panels");
  static_assert(BM == 64 || BM == 128, "a step is one or two dS^T panels");
  static DEVI int row0(int consumer) { return HOW == BY_ROWS ? consumer * 64 : 0; }
  static DEVI int col0(int consumer) { return HOW == BY_COLUMNS ? consumer * N : 0; }
};

// Byte offsets in the 1024-aligned dynamic shared memory (every tile a multiple of 1024 bytes).
template <int HD, int BM>
struct Layout {
  static constexpr int PANELS = HD / 64;          // 64 columns = 128 bytes, one swizzle atom wide
  static constexpr int KV_PANEL = BN * 128;
  static constexpr int KV_TILE = PANELS * KV_PANEL;
  static constexpr int QD_PANEL = BM * 128;       // Q and dO
  static constexpr int QD_TILE = PANELS * QD_PANEL;
  static constexpr int DS_PANEL = BN * 128;       // dS^T: keys x 64 queries per panel
  static constexpr int DS_TILE = (BM / 64) * DS_PANEL;
  static constexpr int K = 0;
  static constexpr int V = K + KV_TILE;
  static constexpr int Q = V + KV_TILE;           // 2 stages
  static constexpr int DO = Q + 2 * QD_TILE;      // 2 stages
  static constexpr int DS = DO + 2 * QD_TILE;     // 2 buffers
  // DQ_TMA: 2 consumer parts of two boxes of 64 rows x 32 fp32 columns (128-byte swizzle, 1024-aligned).
  // (An enum: each static constexpr member is a symbol of the cubin, and the builds without DQ_TMA keep
  // their bytes.)
  enum : int { DQT_BOX = 64 * 32 * 4, DQT_PART = DQ_TMA ? 2 * DQT_BOX : 0, DQT = DS + 2 * DS_TILE };
  static constexpr int LSE = DQT + 2 * DQT_PART;  // 2 stages x BM floats
  static constexpr int DELTA = LSE + 2 * BM * 4;  // 2 stages x BM floats
  static constexpr int BARRIERS = DELTA + 2 * BM * 4;
  static constexpr int BYTES = BARRIERS + 8 * 7;
  // barriers: kv_full, per stage full, empty, then dq_full, dq_empty (DQ_WRITER)
  static DEVI u32 kv_full(u32 base) { return base + BARRIERS; }
  static DEVI u32 full(u32 base, int s) { return base + BARRIERS + 8 * (1 + s); }
  static DEVI u32 empty(u32 base, int s) { return base + BARRIERS + 8 * (3 + s); }
  static DEVI u32 dq_full(u32 base) { return base + BARRIERS + 8 * 5; }
  static DEVI u32 dq_empty(u32 base) { return base + BARRIERS + 8 * 6; }
};

// What one thread block works on: keys [n0, n0 + BN) of kv head hk, and `steps` steps of
// (query head, query block), query heads outer.
struct Work {
  int b, hk, n0;
  int m_first, m_count;  // query blocks some query of which sees a key of the block
  int steps;             // m_count x group
  int rot;               // DQ_ROTATE: the walk's first query block inside each head (else unused)
};

// DQ_ROTATE: query blocks per key block of the rotation (k = M / N >= 1, checked by the launcher).
DEVI int rotation_stride(const AttnParams& p, int block_m) {
  return ((p.seqlen_q + block_m - 1) / block_m) / p.num_blocks;
}

// Key block of thread block `block` inside its (batch, kv head): DQ_ORDERED runs them from the last
// to the first (the order of its dQ turns: a thread block only waits for ones launched before it).
template <bool ORD>
DEVI int key_block_of(int rank, int nblk) {
  return ORD ? nblk - 1 - rank : rank;
}

template <int BM, bool ORD>
DEVI Work work_of(const AttnParams& p, const Visibility& vis) {
  Work w;
  const int nblk = p.num_blocks;
  const int bhk = blockIdx.x / nblk;
  // causal: the low key blocks, seen by most queries, first (DQ_ORDERED: last, see key_block_of)
  const int nb = key_block_of<ORD>(blockIdx.x - bhk * nblk, nblk);
  w.b = bhk / p.heads_kv;
  w.hk = bhk - w.b * p.heads_kv;
  w.n0 = nb * BN;
  int q_lo, q_hi;
  queries_seeing(vis, w.n0, min(w.n0 + BN, vis.seqlen_k) - 1, &q_lo, &q_hi);
  w.m_first = q_lo / BM;
  w.m_count = q_hi >= q_lo ? q_hi / BM - w.m_first + 1 : 0;
  w.steps = w.m_count * p.group;
  if constexpr (DQ_ROTATE) w.rot = w.m_count > 0 ? rotation_stride(p, BM) * nb % w.m_count : 0;
  return w;
}

DEVI int step_head(const AttnParams& p, const Work& w, int i) { return w.hk * p.group + i / w.m_count; }
template <int BM>
DEVI int step_m0(const Work& w, int i) {
  if constexpr (DQ_ROTATE) {
    int j = i % w.m_count + w.rot;
    return (w.m_first + (j >= w.m_count ? j - w.m_count : j)) * BM;
  }
  return (w.m_first + i % w.m_count) * BM;
}

}  // namespace sm90_bwd
