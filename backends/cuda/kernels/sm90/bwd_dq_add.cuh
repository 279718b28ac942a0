// How the Hopper backward's consumers add a dQ part to dq_accum (sm90/fa_bwd.cu): `red.global.add` per
// element pair (the plain and DQ_LATE schedules), in a fixed order of key blocks (DQ_ORDERED), or staged in
// shared memory for TMA reduce-adds (DQ_TMA; with DQ_ORDERED in turn, by thread 128 or, DQ_WRITER, by a writer).
#pragma once
#include "sm90/bwd_roles.cuh"
#include "sm90/dq_order.cuh"

namespace sm90_bwd {

// This consumer's dQ part (rows of 64 queries x DQ_N columns, accumulator layout) added to dq_accum
// with vector reductions; rows past Sq skipped.
template <int DQ_N>
DEVI void red_dq(const float (&dq)[DQ_N / 2], float* dq_head, int dq_row, int row0, int col0, int seqlen_q) {
#pragma unroll
  for (int c = 0; c < DQ_N / 8; ++c)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + half * 8;
      const int col = col0 + c * 8;
      if (row < seqlen_q)
        red_add_v2(dq_head + (long long)row * dq_row + col, dq[4 * c + 2 * half], dq[4 * c + 2 * half + 1]);
    }
}

// DQ_TMA: this consumer's 64 x 64 dQ part (accumulator layout) into its two staging boxes of 64 rows x 32 fp32
// columns, each row 128 bytes with its 16-byte chunks XOR-ed by the row's low 3 bits (TMA's 128-byte swizzle).
template <int DQ_N>
DEVI void stage_dq_boxes(const float (&dq)[DQ_N / 2], u32 stage, int warp_in_group, int lane) {
  static_assert(DQ_N == 64, "two 32-column boxes per consumer part");
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int c = 0; c < 8; ++c)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = warp_in_group * 16 + g + 8 * half, col = 8 * c + 2 * t4;
      const int box = col >> 5, cb = col & 31;
      const u32 addr = stage + box * (64 * 32 * 4) + r * 128 + ((((cb >> 2) ^ (r & 7))) << 4) + (cb & 3) * 4;
      st_shared_v2(addr, dq[4 * c + 2 * half], dq[4 * c + 2 * half + 1]);
    }
}

// DQ_ORDERED: the turn counter of query block m0 / BM (head hq) and this key block's turn in it.
template <int BM>
DEVI int* dq_turn(const AttnParams& p, const Visibility& vis, const Work& w, int* dq_sem, int hq, int m0,
                  int* turn) {
  int* sem = dq_sem + ((long long)w.b * p.heads_q + hq) * ((p.seqlen_q + BM - 1) / BM) + m0 / BM;
  if constexpr (DQ_ROTATE) {  // every key block adds to every query block, in the rotated walk's visit order
    const int n = p.num_blocks, first = min(m0 / BM / rotation_stride(p, BM), n - 1);
    *turn = (first - w.n0 / BN + n) % n;
    return sem;
  }
  int k_lo, k_hi;
  keys_seen(vis, m0, min(m0 + BM, vis.seqlen_q) - 1, &k_lo, &k_hi);
  *turn = k_hi / BN - w.n0 / BN;
  return sem;
}

// DQ_ORDERED: this consumer's dQ part of query block m0 / BM (head hq) added in its turn: after the key
// blocks above this one that see the block; then the turn passes on. Both consumers call it together.
template <int HD, int BM>
DEVI void red_dq_in_turn(const float (&dq)[DqSplit<HD, BM>::N / 2], const AttnParams& p, const Visibility& vis,
                         const Work& w, int* dq_sem, int hq, int m0, int row0, int col0, int consumer) {
  using Split = DqSplit<HD, BM>;
  float* dq_head = p.dq_accum + ((long long)w.b * p.heads_q + hq) * p.seqlen_q * p.dq_row;
  int turn;
  int* sem = dq_turn<BM>(p, vis, w, dq_sem, hq, m0, &turn);
  if (turn > 0) {  // uniform: skip the wait (and its barrier) when first
    if (threadIdx.x == 128) wait_turn(sem, turn);
    named_sync(ORDER_BARRIER, 256);  // acquire (one thread) + barrier: every adder after the turn
  }
  if constexpr (Split::HOW == Split::BY_KEYS)
    if (consumer == 1) named_sync(BATON_BARRIER, 256);  // both add to the same elements: 0 first
  red_dq<Split::N>(dq, dq_head, p.dq_row, row0, col0, vis.seqlen_q);
  if constexpr (Split::HOW == Split::BY_KEYS)
    if (consumer == 0) named_arrive(BATON_BARRIER, 256);
  named_sync(ORDER_BARRIER, 256);  // every reduction of this block issued before the release
  if (threadIdx.x == 128) pass_turn(sem);
}

// DQ_TMA, one thread: both consumers' staged parts (boxes of 64 rows x 32 columns from `stage0`) added to query
// block m0 / BM of head hq, one bulk group per consumer. Split by keys both add to the same elements: IN_ORDER
// (the ordered dQ) completes consumer 0's before consumer 1's are issued.
template <int HD, int BM, int PART_BYTES, int BOX_BYTES, bool IN_ORDER>
DEVI void tma_add_parts(const TmaMap* tdq, u32 stage0, const AttnParams& p, const Work& w, int hq, int m0) {
  using Split = DqSplit<HD, BM>;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
#pragma unroll
    for (int box = 0; box < 2; ++box)
      tma_reduce_add_3d(tdq, stage0 + c * PART_BYTES + box * BOX_BYTES, Split::col0(c) + 32 * box,
                        m0 + Split::row0(c), w.b * p.heads_q + hq);
    tma_store_commit();
    if constexpr (IN_ORDER && Split::HOW == Split::BY_KEYS)
      if (c == 0) bulk_wait_all();
  }
}

// DQ_ORDERED with DQ_TMA: both consumers' staged parts (stores fenced for the async proxy) added by thread 128 in
// the query block's turn, four boxes of 64 rows x 32 columns (split by keys: consumer 0's completed before
// consumer 1's are issued, as both add to the same elements). Both consumers call it together. The turn passes
// in pass_dq_turn, once the additions have completed: the caller places that after dP^T's issue, so the wait
// for completion overlaps a GEMM instead of holding the warpgroup.
template <int HD, int BM, int PART_BYTES, int BOX_BYTES>
DEVI void tma_dq_in_turn(const TmaMap* tdq, u32 stage0, const AttnParams& p, const Visibility& vis, const Work& w,
                         int* dq_sem, int hq, int m0) {
  using Split = DqSplit<HD, BM>;
  int turn;
  int* sem = dq_turn<BM>(p, vis, w, dq_sem, hq, m0, &turn);
  if (threadIdx.x == 128 && turn > 0) wait_turn(sem, turn);
  named_sync(ORDER_BARRIER, 256);  // both parts staged; the turn acquired (one thread) before any addition
  if (threadIdx.x == 128) {
    fence_async_global();  // the acquire before the async proxy's additions
    tma_add_parts<HD, BM, PART_BYTES, BOX_BYTES, true>(tdq, stage0, p, w, hq, m0);
  }
}
// Thread 128, after tma_dq_in_turn for the same query block: the additions complete (writes included), ordered
// before the release that gives the next key block its turn. The staging is free after the next barrier.
template <int BM>
DEVI void pass_dq_turn(const AttnParams& p, const Visibility& vis, const Work& w, int* dq_sem, int hq, int m0) {
  int turn;
  int* sem = dq_turn<BM>(p, vis, w, dq_sem, hq, m0, &turn);
  bulk_wait_all();
  fence_async_global();
  pass_turn(sem);
}

// DQ_WRITER, one thread of the producer warpgroup: per step, the consumers' staged parts (dq_full: 8 warps
// arrived) added through TMA; dq_empty once the additions have read them. DQ_ORDERED: the turn is awaited before
// the parts arrive (its round trips overlap the consumers' step) and passed once the additions completed.
template <int HD, int BM, bool ORD, int PART_BYTES, int BOX_BYTES>
DEVI void write_dq_tma(const AttnParams& p, const Visibility& vis, const Work& w, u32 stage0, u32 dq_full,
                       u32 dq_empty, const TmaMap* tdq, int* dq_sem) {
  for (int j = 0; j < w.steps; ++j) {
    const int hq = step_head(p, w, j), m0 = step_m0<BM>(w, j);
    int turn = 0;
    int* sem = nullptr;
    if constexpr (ORD) {
      sem = dq_turn<BM>(p, vis, w, dq_sem, hq, m0, &turn);
      if (turn > 0) wait_turn(sem, turn);
    }
    mbar_wait(dq_full, j & 1);
    if constexpr (ORD) fence_async_global();  // the acquire before the async proxy's additions
    tma_add_parts<HD, BM, PART_BYTES, BOX_BYTES, ORD>(tdq, stage0, p, w, hq, m0);
    tma_store_wait_read();
    mbar_arrive(dq_empty);
    if constexpr (ORD) {
      bulk_wait_all();
      fence_async_global();
      release_turn(sem);
    }
  }
  bulk_wait_all();  // the additions themselves, before the thread block may end
}

}  // namespace sm90_bwd
