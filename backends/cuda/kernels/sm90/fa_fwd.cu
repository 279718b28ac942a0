// FlashAttention forward for Hopper (sm_90a): warp-specialised, TMA-fed, wgmma.
//
// One thread block of three warpgroups per 128 query rows of one (batch, head):
// - warpgroup 0, the producer, gives back most of its registers (setmaxnreg) and one of its
//   threads issues every tile load through the Tensor Memory Accelerator: Q once, then K and V
//   blocks through a STAGES-deep ring of shared-memory buffers whose "full" and "empty"
//   mbarriers hand each buffer between producer and consumers;
// - warpgroups 1 and 2, the consumers, own 64 query rows each: S = Q K^T by wgmma with both
//   operands in shared memory, the online softmax in registers (exp2, the scale folded into one
//   FFMA), O += P V by wgmma with P straight from registers.
// With OVERLAP a consumer issues block j's Q K^T before it waits for block j-1's P V, so the
// tensor cores work while it runs the softmax (FlashAttention-3's intra-warpgroup pipelining);
// with PINGPONG two named barriers make the consumers take turns issuing their GEMMs, so one's
// softmax runs under the other's GEMMs.
// Key blocks run from the last to the first, so the masked (diagonal, ragged-end) blocks come
// first; a block wholly inside the band (tested for the whole thread block, so the test is
// uniform and ptxas keeps the wgmma pipeline) skips the mask. Sequence ends need no care: TMA fills
// rows and columns outside the tensors with zeros and clips the output store.
// The shared-memory tiles are TMA's 128-byte swizzle: panels of 64 columns x rows, 1024-byte atoms.
//
// Compile-time knobs (NVRTC -D): IS_BF16, HEAD_DIM (tile: 64, 128, 192, 256), BLOCK_N (keys per
// block), SCORE_MOD (softcap / ALiBi / scale <= 0), KV_STAGES, OVERLAP, PINGPONG, EXACT_ALPHA (opt-in:
// the rescale factor from the rounded shifts, common/softmax.cuh `rescale_exponent`).
// VARLEN (opt-in, 0 by default; written offline, not yet run on a GPU): packed q and k/v
// (common/varlen.cuh), a VarlenParams after the tensor maps. The maps cover the packed tensors
// (rows = total tokens, batch dim 1); batch entry b of the grid is packed sequence b and its tiles
// start at the sequence's first rows, so a tile's rows past the sequence's end are the next
// sequence's: their scores are masked (key_visible), the V rows of the last key block past the end are
// zeroed before any P V reads them (0 x Inf would be NaN), and out and lse are stored row by row up to
// the sequence's end instead of by the TMA store. Everything it adds is under `#if VARLEN`, so VARLEN=0
// compiles to the cubin of the build without the knob.
#ifndef VARLEN
#define VARLEN 0
#endif
#include "common/mask.cuh"
#include "common/score_mod.cuh"
#include "common/softmax.cuh"
#include "sm90/ptx.cuh"
#include "sm90/wgmma_ops.cuh"
#if VARLEN
#include "common/varlen.cuh"
#endif

namespace sm90 {

constexpr int BM = 128;             // query rows per thread block: 2 consumer warpgroups x 64
constexpr int THREADS = 384;        // producer + 2 consumers
constexpr int CONSUMER_WARPS = 8;   // arrivals that free a K or V buffer
constexpr int PRODUCER_REGS = 24;
constexpr int CONSUMER_REGS = 240;  // 128 x 24 + 256 x 240 <= 64K registers
constexpr int TURN_BARRIER = 1;     // named barriers 1, 2: pingpong turns; 3, 4: epilogue
constexpr int EPILOGUE_BARRIER = 3;
#if VARLEN
constexpr int ZERO_BARRIER = 5;     // both consumers: the last key block's V rows past the sequence are zero
#endif

// Byte offsets in the 1024-aligned dynamic shared memory.
template <int HD, int BN, int STAGES>
struct Layout {
  static constexpr int PANELS = HD / 64;  // 64 columns = 128 bytes, one swizzle atom wide
  static constexpr int Q_PANEL = BM * 128;
  static constexpr int KV_PANEL = BN * 128;
  static constexpr int KV_TILE = PANELS * KV_PANEL;
  static constexpr int Q = 0;
  static constexpr int K = Q + PANELS * Q_PANEL;
  static constexpr int V = K + STAGES * KV_TILE;
  static constexpr int BARRIERS = V + STAGES * KV_TILE;
  static constexpr int BYTES = BARRIERS + 8 * (1 + 4 * STAGES);
  // barriers: q_full, then per stage k_full, k_empty, v_full, v_empty
  static DEVI u32 q_full(u32 base) { return base + BARRIERS; }
  static DEVI u32 k_full(u32 base, int s) { return base + BARRIERS + 8 * (1 + s); }
  static DEVI u32 k_empty(u32 base, int s) { return base + BARRIERS + 8 * (1 + STAGES + s); }
  static DEVI u32 v_full(u32 base, int s) { return base + BARRIERS + 8 * (1 + 2 * STAGES + s); }
  static DEVI u32 v_empty(u32 base, int s) { return base + BARRIERS + 8 * (1 + 3 * STAGES + s); }
};

// What one thread block works on.
struct Tile {
  int b, h, hk;       // batch, query head, kv head
  int m0;             // first query row
  int n_first, n_last;  // key blocks some row of the tile sees (n_last < n_first: none)
#if VARLEN
  int q_start, k_start;  // the packed sequence's first rows in q / out / lse and in k / v
#endif
};

template <int BN>
DEVI Tile tile_of(const AttnParams& p, const Visibility& vis) {
  Tile t;
  const int nblk = p.num_blocks;
  const int bh = blockIdx.x / nblk;
  const int mb = nblk - 1 - (blockIdx.x - bh * nblk);  // heaviest (causal) query blocks first
  t.b = bh / p.heads_q;
  t.h = bh - t.b * p.heads_q;
  t.hk = t.h / p.group;
  t.m0 = mb * BM;
  int key_lo, key_hi;
  keys_seen(vis, t.m0, min(t.m0 + BM, vis.seqlen_q) - 1, &key_lo, &key_hi);
  t.n_first = key_lo / BN;
  t.n_last = key_hi >= key_lo ? key_hi / BN : t.n_first - 1;
  return t;
}

// ---- producer -------------------------------------------------------------------------------
template <int HD, int BN, int STAGES>
DEVI void produce(u32 base, const Tile& t, const TmaMap* tq, const TmaMap* tk, const TmaMap* tv) {
  using L = Layout<HD, BN, STAGES>;
  tma_prefetch(tq);
  tma_prefetch(tk);
  tma_prefetch(tv);
  mbar_arrive_expect_tx(L::q_full(base), L::PANELS * L::Q_PANEL);
#pragma unroll
  for (int pn = 0; pn < L::PANELS; ++pn)
#if VARLEN
    tma_load_4d(base + L::Q + pn * L::Q_PANEL, tq, pn * 64, t.q_start + t.m0, t.h, 0, L::q_full(base));
#else
    tma_load_4d(base + L::Q + pn * L::Q_PANEL, tq, pn * 64, t.m0, t.h, t.b, L::q_full(base));
#endif
  for (int i = 0, nb = t.n_last; nb >= t.n_first; ++i, --nb) {
    const int s = i % STAGES;
    const u32 free_parity = ((i / STAGES) & 1) ^ 1;
    mbar_wait(L::k_empty(base, s), free_parity);
    mbar_arrive_expect_tx(L::k_full(base, s), L::KV_TILE);
#pragma unroll
    for (int pn = 0; pn < L::PANELS; ++pn)
#if VARLEN
      tma_load_4d(base + L::K + s * L::KV_TILE + pn * L::KV_PANEL, tk, pn * 64, t.k_start + nb * BN, t.hk, 0,
                  L::k_full(base, s));
#else
      tma_load_4d(base + L::K + s * L::KV_TILE + pn * L::KV_PANEL, tk, pn * 64, nb * BN, t.hk, t.b,
                  L::k_full(base, s));
#endif
    mbar_wait(L::v_empty(base, s), free_parity);
    mbar_arrive_expect_tx(L::v_full(base, s), L::KV_TILE);
#pragma unroll
    for (int pn = 0; pn < L::PANELS; ++pn)
#if VARLEN
      tma_load_4d(base + L::V + s * L::KV_TILE + pn * L::KV_PANEL, tv, pn * 64, t.k_start + nb * BN, t.hk, 0,
                  L::v_full(base, s));
#else
      tma_load_4d(base + L::V + s * L::KV_TILE + pn * L::KV_PANEL, tv, pn * 64, nb * BN, t.hk, t.b,
                  L::v_full(base, s));
#endif
  }
}

// ---- consumer parts ---------------------------------------------------------------------------
// S = Q K^T for this warpgroup's 64 rows: HD/16 k-steps, 32 bytes apart inside a panel.
template <bool BF16, int HD, int BN>
DEVI void issue_qk(float (&s)[BN / 2], u32 q_rows, u32 k_tile) {
#pragma unroll
  for (int ks = 0; ks < HD / 16; ++ks) {
    const u64 a = smem_desc(q_rows + (ks / 4) * (BM * 128) + (ks % 4) * 32, 16, 1024);
    const u64 b = smem_desc(k_tile + (ks / 4) * (BN * 128) + (ks % 4) * 32, 16, 1024);
    wgmma_ss<BN, BF16>(s, a, b, ks > 0);
  }
}

// O += P V: BN/16 k-steps of 16 keys (2048 bytes apart); V is MN-major, panels BN*128 bytes apart.
template <bool BF16, int HD, int BN>
DEVI void issue_pv(float (&o)[HD / 2], const u32 (&pa)[BN / 16][4], u32 v_tile) {
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) wgmma_rs<HD, BF16>(o, pa[kk], smem_desc(v_tile + kk * 2048, BN * 128, 1024), 1);
}

// Per-thread softmax state of its two rows (row and row + 8 of its warp's 16).
struct Rows {
  float max[2];  // running max, score units (-inf: nothing seen)
  float sum[2];  // running sum of exp2, this thread's columns only
};

// One key block's scores -> unnormalised probabilities, packed as the 16-bit A operand of P V
// (for 16-bit types the accumulator and operand layouts coincide: each k-step of 16 keys is two
// 8-column chunks), and the factors that rescale the accumulator. The probabilities go to fresh
// registers; masking and score mods write the scores in place (more registers would spill).
template <bool BF16, bool MOD, bool MASK, int BN>
DEVI void softmax_block(float (&x)[BN / 2], u32 (&pa)[BN / 16][4], Rows& r, float (&alpha)[2],
                        const Visibility& vis, const ScoreMod& mod, float unit, int row0, int n0, int t4) {
  if constexpr (MOD) {
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      const int row = row0 + ((i >> 1) & 1) * 8;
      const int col = n0 + (i >> 2) * 8 + 2 * t4 + (i & 1);
      float dcap;
      x[i] = apply_score_mod(mod, x[i], row, col, &dcap) * ATTNX_LOG2E;
    }
  }
  if constexpr (MASK) {
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      const int row = row0 + ((i >> 1) & 1) * 8;
      const int col = n0 + (i >> 2) * 8 + 2 * t4 + (i & 1);
      if (!key_visible(vis, row, col)) x[i] = neg_inf();
    }
  }
  float shift[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float mx = r.max[half];
#pragma unroll
    for (int c = 0; c < BN / 8; ++c) mx = fmaxf(mx, fmaxf(x[4 * c + 2 * half], x[4 * c + 2 * half + 1]));
    mx = quad_max(mx);
    shift[half] = max_shift(mx, unit);
    alpha[half] = exp2_approx(rescale_exponent(r.max[half], unit, shift[half]));
    r.max[half] = mx;
  }
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // register j: chunk 2kk + j/2, row half j%2
      const int i = 8 * kk + 4 * (j >> 1) + 2 * (j & 1);
      const float p0 = exp2_approx(fmaf(x[i], unit, -shift[j & 1]));
      const float p1 = exp2_approx(fmaf(x[i + 1], unit, -shift[j & 1]));
      sum[j & 1] += p0 + p1;
      pa[kk][j] = pack2<BF16>(p0, p1);
    }
  }
  r.sum[0] = r.sum[0] * alpha[0] + sum[0];
  r.sum[1] = r.sum[1] * alpha[1] + sum[1];
}

// The softmax of a block, masked or not: two whole copies, so the code after the join (a wgmma
// wait in the pipelined loop) cannot be scheduled between the mask and the exponentials.
template <bool BF16, bool MOD, int BN>
DEVI void softmax_any(bool masked, float (&x)[BN / 2], u32 (&pa)[BN / 16][4], Rows& r, float (&alpha)[2],
                      const Visibility& vis, const ScoreMod& mod, float unit, int row0, int n0, int t4) {
  if (masked)
    softmax_block<BF16, MOD, true, BN>(x, pa, r, alpha, vis, mod, unit, row0, n0, t4);
  else
    softmax_block<BF16, MOD, false, BN>(x, pa, r, alpha, vis, mod, unit, row0, n0, t4);
}

template <int HD>
DEVI void rescale(float (&o)[HD / 2], const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) o[i] *= alpha[(i >> 1) & 1];
}

// Out rows of this warpgroup (o x inv) -> its 64-row slice of the (now free) Q tile, in the swizzled
// layout the TMA store reads; then one thread stores each 64-column panel at (row, head, batch).
template <bool BF16, int HD>
DEVI void store_out_tile(const TmaMap* to, const float (&o)[HD / 2], const float (&inv)[2], u32 q_rows, int row0,
                         int h, int b, int consumer, int warp_in_group, int lane) {
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int c = 0; c < HD / 8; ++c) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp_in_group * 16 + g + half * 8;  // inside the warpgroup's 64 rows
      const int col = (c % 8) * 8 + 2 * t4;              // inside the 64-column panel
      const u32 chunk = (u32)((col >> 3) ^ (row & 7));    // 128-byte swizzle: 16-byte chunk ^ row
      const u32 addr = q_rows + (c / 8) * (BM * 128) + row * 128 + chunk * 16 + (col & 7) * 2;
      const u32 packed = pack2<BF16>(o[4 * c + 2 * half] * inv[half], o[4 * c + 2 * half + 1] * inv[half]);
      asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(packed) : "memory");
    }
  }
  fence_async_shared();
  named_sync(EPILOGUE_BARRIER + consumer, 128);
  if (warp_in_group == 0 && lane == 0) {
#pragma unroll
    for (int pn = 0; pn < HD / 64; ++pn)
      tma_store_4d(to, q_rows + pn * (BM * 128), pn * 64, row0, h, b);
    tma_store_commit();
    tma_store_wait_read();
  }
}

// The tile's out through `store_out_tile`, lse straight from registers.
template <bool BF16, int HD>
DEVI void write_out(const AttnParams& p, const Tile& t, const TmaMap* to, float (&o)[HD / 2], const Rows& r,
                    float unit, u32 q_rows, int consumer, int warp_in_group, int lane) {
  const int g = lane >> 2, t4 = lane & 3;
  const float sink = sink_logit(p, t.h);
  float inv[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float row_lse;
    softmax_finish(r.max[half] * unit, quad_sum(r.sum[half]), sink, &inv[half], &row_lse);
    const int row = t.m0 + consumer * 64 + warp_in_group * 16 + g + half * 8;
    if (t4 == 0 && row < p.seqlen_q) p.lse[((long long)t.b * p.heads_q + t.h) * p.seqlen_q + row] = row_lse;
  }
  store_out_tile<BF16, HD>(to, o, inv, q_rows, t.m0 + consumer * 64, t.h, t.b, consumer, warp_in_group, lane);
}

#if VARLEN
// Packed out and lse (Hq, total_q) up to the sequence's last row. (Its lse loop repeats `write_out`'s with
// the packed index: sharing it changed the dense builds' code, checked byte for byte, 2026-12-02.) A warpgroup whose 64 rows all belong
// to the sequence takes the TMA store (uniform over its 128 threads, as the epilogue barrier needs);
// the last one stores row by row from registers: a 64-row box would write into the next sequence's rows.
template <bool BF16, int HD>
DEVI void write_out_rows(const AttnParams& p, const VarlenParams& vp, const Tile& t, int seqlen_q, const TmaMap* to,
                         float (&o)[HD / 2], const Rows& r, float unit, u32 q_rows, int consumer, int warp_in_group,
                         int lane) {
  const int g = lane >> 2, t4 = lane & 3;
  const float sink = sink_logit(p, t.h);
  float inv[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float row_lse;
    softmax_finish(r.max[half] * unit, quad_sum(r.sum[half]), sink, &inv[half], &row_lse);
    const int row = t.m0 + consumer * 64 + warp_in_group * 16 + g + half * 8;
    if (t4 == 0 && row < seqlen_q) p.lse[(long long)t.h * vp.total_q + t.q_start + row] = row_lse;
  }
  if (t.m0 + consumer * 64 + 64 <= seqlen_q) {
    store_out_tile<BF16, HD>(to, o, inv, q_rows, t.q_start + t.m0 + consumer * 64, t.h, 0, consumer, warp_in_group,
                             lane);
    return;
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = t.m0 + consumer * 64 + warp_in_group * 16 + g + half * 8;
    if (row >= seqlen_q) continue;
    u16* out_row = (u16*)p.o + (long long)(t.q_start + row) * p.o_rs + (long long)t.h * p.o_hs;
#pragma unroll
    for (int c = 0; c < HD / 8; ++c) {
      const int col = c * 8 + 2 * t4;
      if (col < p.head_dim_v)
        *reinterpret_cast<u32*>(out_row + col) =
            pack2<BF16>(o[4 * c + 2 * half] * inv[half], o[4 * c + 2 * half + 1] * inv[half]);
    }
  }
}

// Rows [first, BN) of a V tile (every panel) set to zero by the `threads` consumer threads (`tid` among them).
template <int HD, int BN>
DEVI void zero_rows(u32 v_tile, int first, int tid, int threads) {
  constexpr int PANELS = HD / 64;
  const int chunks = PANELS * (BN - first) * 8;  // 16-byte chunks: 8 per 128-byte row
  for (int i = tid; i < chunks; i += threads) {
    const int pn = i / ((BN - first) * 8), rest = i - pn * (BN - first) * 8;
    const u32 addr = v_tile + pn * (BN * 128) + (first + rest / 8) * 128 + (rest % 8) * 16;
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0u) : "memory");
  }
}
#endif

template <bool BF16, int HD, int BN, bool MOD, int STAGES, bool kOverlap, bool kPingpong>
#if VARLEN
DEVI void consume(const AttnParams& p, const Tile& t, const Visibility& vis, u32 base, const TmaMap* to,
                  const VarlenParams& vp) {
#else
DEVI void consume(const AttnParams& p, const Tile& t, const Visibility& vis, u32 base, const TmaMap* to) {
#endif
  using L = Layout<HD, BN, STAGES>;
  const int consumer = threadIdx.x / 128 - 1;
  const int warp_in_group = (threadIdx.x / 32) & 3, lane = threadIdx.x & 31;
  const int t4 = lane & 3;
  const int row0 = t.m0 + consumer * 64 + warp_in_group * 16 + (lane >> 2);  // and row0 + 8
  const u32 q_rows = base + L::Q + consumer * 64 * 128;
  const float unit = MOD ? 1.f : p.scale_log2;  // log2 units per score unit
#if VARLEN
  ScoreMod mod = score_mod(p, t.b, t.h);  // ALiBi slopes are (B, Hq): per sequence
  mod.offset = vis.offset;
#else
  const ScoreMod mod = score_mod(p, t.b, t.h);
#endif

  float o[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) o[i] = 0.f;
  Rows r{{neg_inf(), neg_inf()}, {0.f, 0.f}};
  const int n_blocks = t.n_last - t.n_first + 1;

  auto my_turn = [&]() {
    if constexpr (kPingpong) named_sync(TURN_BARRIER + consumer, 256);
  };
  auto their_turn = [&](int) {
    // no thread-dependent condition here: ptxas would see a divergent path among the wgmmas and
    // serialise them; the second consumer's last hand-over is taken after the loop instead
    if constexpr (kPingpong) named_arrive(TURN_BARRIER + (1 - consumer), 256);
  };
  if constexpr (kPingpong)
    if (consumer == 1 && n_blocks > 0) named_arrive(TURN_BARRIER + 0, 256);  // the first consumer starts

  if (n_blocks > 0) mbar_wait(L::q_full(base), 0);
#if VARLEN
  // The last key block (the first processed, in stage 0) reaches past the sequence's keys: its rows
  // there are the next sequence's, zeroed once both consumers can see them (uniform over the block).
  if (n_blocks > 0 && (t.n_last + 1) * BN > vis.seqlen_k) {
    mbar_wait(L::v_full(base, 0), 0);
    zero_rows<HD, BN>(base + L::V, max(vis.seqlen_k - t.n_last * BN, 0), threadIdx.x - 128, 256);
    fence_async_shared();  // generic-proxy stores, read by wgmma (async proxy)
    named_sync(ZERO_BARRIER, 256);
  }
#endif
  if constexpr (!kOverlap) {
    for (int i = 0; i < n_blocks; ++i) {
      const int nb = t.n_last - i, s = i % STAGES;
      const u32 parity = (i / STAGES) & 1;
      float sc[BN / 2];
      u32 pa[BN / 16][4];
      mbar_wait(L::k_full(base, s), parity);
      my_turn();
      wgmma_fence();
      issue_qk<BF16, HD, BN>(sc, q_rows, base + L::K + s * L::KV_TILE);
      wgmma_commit();
      their_turn(i);
      wgmma_wait<0>();
      fence_regs(sc);
      if (lane == 0) mbar_arrive(L::k_empty(base, s));
      float alpha[2];
      const bool masked = !tile_inside_band(vis, t.m0, BM, nb * BN, BN);
      softmax_any<BF16, MOD, BN>(masked, sc, pa, r, alpha, vis, mod, unit, row0, nb * BN, t4);
      rescale<HD>(o, alpha);
      mbar_wait(L::v_full(base, s), parity);
      wgmma_fence();
      issue_pv<BF16, HD, BN>(o, pa, base + L::V + s * L::KV_TILE);
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(o);
      if (lane == 0) mbar_arrive(L::v_empty(base, s));
    }
  } else if (n_blocks > 0) {
    // Block 0: S, softmax. Then step i issues S of block i and P V of block i-1 together and runs
    // block i's softmax under that P V. P alternates between two register sets: with one set the
    // next P would be copied into the registers the P V in flight reads, and ptxas, coalescing the
    // copy, would hoist the wait for that P V above the softmax (NOTES.md).
    u32 pa[BN / 16][4], pb[BN / 16][4];
    {
      float sc[BN / 2];
      mbar_wait(L::k_full(base, 0), 0);
      my_turn();
      wgmma_fence();
      issue_qk<BF16, HD, BN>(sc, q_rows, base + L::K);
      wgmma_commit();
      their_turn(0);
      wgmma_wait<0>();
      fence_regs(sc);
      if (lane == 0) mbar_arrive(L::k_empty(base, 0));
      float alpha[2];
      const int n0 = t.n_last * BN;
      softmax_any<BF16, MOD, BN>(!tile_inside_band(vis, t.m0, BM, n0, BN), sc, pa, r, alpha, vis, mod, unit,
                                 row0, n0, t4);
    }
    float alpha[2] = {1.f, 1.f};  // rescales O for the block whose P V comes next
    auto step = [&](int i, u32 (&p_in)[BN / 16][4], u32 (&p_out)[BN / 16][4]) {
      const int nb = t.n_last - i, s = i % STAGES, prev = (i - 1) % STAGES;
      const u32 parity = (i / STAGES) & 1, prev_parity = ((i - 1) / STAGES) & 1;
      float sc[BN / 2];
      mbar_wait(L::k_full(base, s), parity);
      mbar_wait(L::v_full(base, prev), prev_parity);
      rescale<HD>(o, alpha);  // O's last P V finished at the previous wait
      my_turn();
      wgmma_fence();
      issue_qk<BF16, HD, BN>(sc, q_rows, base + L::K + s * L::KV_TILE);
      wgmma_commit();
      issue_pv<BF16, HD, BN>(o, p_in, base + L::V + prev * L::KV_TILE);
      wgmma_commit();
      their_turn(i);
      wgmma_wait<1>();  // S is ready; P V may still run
      fence_regs(sc);
      if (lane == 0) mbar_arrive(L::k_empty(base, s));
      const bool masked = !tile_inside_band(vis, t.m0, BM, nb * BN, BN);
      softmax_any<BF16, MOD, BN>(masked, sc, p_out, r, alpha, vis, mod, unit, row0, nb * BN, t4);
      wgmma_wait<0>();
      fence_regs(o);
      fence_regs(p_in);  // read by the P V until the wait: not to be reused before it
      if (lane == 0) mbar_arrive(L::v_empty(base, prev));
    };
    int i = 1;
    for (; i + 1 < n_blocks; i += 2) {
      step(i, pa, pb);
      step(i + 1, pb, pa);
    }
    const bool odd_tail = i < n_blocks;  // the last P is then in pb
    if (odd_tail) step(i, pa, pb);
    rescale<HD>(o, alpha);
    const int last = (n_blocks - 1) % STAGES;
    mbar_wait(L::v_full(base, last), ((n_blocks - 1) / STAGES) & 1);
    wgmma_fence();
    if (odd_tail)
      issue_pv<BF16, HD, BN>(o, pb, base + L::V + last * L::KV_TILE);
    else
      issue_pv<BF16, HD, BN>(o, pa, base + L::V + last * L::KV_TILE);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(o);
    if (lane == 0) mbar_arrive(L::v_empty(base, last));
  }
  if constexpr (kPingpong)
    if (consumer == 0 && n_blocks > 0) named_sync(TURN_BARRIER + 0, 256);  // the second consumer's last turn
#if VARLEN
  write_out_rows<BF16, HD>(p, vp, t, vis.seqlen_q, to, o, r, unit, q_rows, consumer, warp_in_group, lane);
#else
  write_out<BF16, HD>(p, t, to, o, r, unit, q_rows, consumer, warp_in_group, lane);
#endif
}

template <bool BF16, int HD, int BN, bool MOD, int STAGES, bool kOverlap, bool kPingpong>
#if VARLEN
DEVI void attention_forward(const AttnParams& p, const TmaMap* tq, const TmaMap* tk, const TmaMap* tv,
                            const TmaMap* to, const VarlenParams& vp) {
#else
DEVI void attention_forward(const AttnParams& p, const TmaMap* tq, const TmaMap* tk, const TmaMap* tv,
                            const TmaMap* to) {
#endif
  using L = Layout<HD, BN, STAGES>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const u32 raw = smem_u32(smem_raw);
  const u32 base = (raw + 1023) & ~1023u;  // swizzle atoms need 1024-byte alignment

#if VARLEN
  // packed sequence b: the grid covers the longest; a tile past this one's last row leaves at once
  const PackedSeq seq = packed_sequence(vp, p.key_offset, blockIdx.x / p.num_blocks / p.heads_q);
  const Visibility vis{seq.info.seqlen_q, seq.info.seqlen_k, seq.info.offset, p.window_left, p.window_right};
  Tile t = tile_of<BN>(p, vis);
  if (t.m0 >= vis.seqlen_q) return;  // (the whole block, before any barrier)
  t.q_start = seq.q_start;
  t.k_start = seq.k_start;
#else
  const Visibility vis = visibility(p);
  const Tile t = tile_of<BN>(p, vis);
#endif
  if (threadIdx.x == 0) {
    mbar_init(L::q_full(base), 1);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(L::k_full(base, s), 1);
      mbar_init(L::v_full(base, s), 1);
      mbar_init(L::k_empty(base, s), CONSUMER_WARPS);
      mbar_init(L::v_empty(base, s), CONSUMER_WARPS);
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (threadIdx.x < 128) {
    regs_dealloc<PRODUCER_REGS>();
    if (threadIdx.x == 0 && t.n_last >= t.n_first) produce<HD, BN, STAGES>(base, t, tq, tk, tv);
  } else {
    regs_alloc<CONSUMER_REGS>();
#if VARLEN
    consume<BF16, HD, BN, MOD, STAGES, kOverlap, kPingpong>(p, t, vis, base, to, vp);
#else
    consume<BF16, HD, BN, MOD, STAGES, kOverlap, kPingpong>(p, t, vis, base, to);
#endif
  }
}

}  // namespace sm90

#if VARLEN
extern "C" __global__ void __launch_bounds__(sm90::THREADS, 1)
    attnx_fwd(const AttnParams p, const __grid_constant__ TmaMap tq, const __grid_constant__ TmaMap tk,
              const __grid_constant__ TmaMap tv, const __grid_constant__ TmaMap to, const VarlenParams vp) {
  sm90::attention_forward<IS_BF16 != 0, HEAD_DIM, BLOCK_N, SCORE_MOD != 0, KV_STAGES, OVERLAP != 0, PINGPONG != 0>(
      p, &tq, &tk, &tv, &to, vp);
}
#else
extern "C" __global__ void __launch_bounds__(sm90::THREADS, 1)
    attnx_fwd(const AttnParams p, const __grid_constant__ TmaMap tq, const __grid_constant__ TmaMap tk,
              const __grid_constant__ TmaMap tv, const __grid_constant__ TmaMap to) {
  sm90::attention_forward<IS_BF16 != 0, HEAD_DIM, BLOCK_N, SCORE_MOD != 0, KV_STAGES, OVERLAP != 0, PINGPONG != 0>(
      p, &tq, &tk, &tv, &to);
}
#endif
