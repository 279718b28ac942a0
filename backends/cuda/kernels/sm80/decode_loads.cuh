// The split-KV decode kernel's K/V copies (sm80/fa_decode.cu): the ring's row layout, the 16-byte cp.async
// copy of a key block, the bulk-copy twin (KV_BULK), and the page-table lookups (a block ahead, or 32 blocks
// ahead with PAGE_BATCH). Included after fa_decode.cu's DecodeParams and knob defaults.
#pragma once

// Elements per K/V row in a ring stage, and the byte offset of 16-byte chunk cc of row r. Padded rows
// (HD + 8) keep ldmatrix free of bank conflicts but shift each global 128-byte line across two shared
// 128-byte lines, which cp.async turns into extra L2 sector reads (ncu on the H200: 1.5x the ideal
// sectors). KV_SWIZZLE: rows of HD elements, each line's chunks XOR-ed with the row's low 3 bits, so
// a global line lands on one shared line and ldmatrix's 8 rows still hit 8 different bank groups.
template <int HD>
DEVI constexpr int kv_ld() { return KV_SWIZZLE ? HD : HD + 8; }
template <int HD>
DEVI u32 kv_chunk(int r, int cc) {
#if KV_SWIZZLE
  static_assert(HD % 64 == 0, "swizzled rows are whole 128-byte lines");
  return (u32)(r * HD * 2 + ((cc & ~7) | ((cc ^ r) & 7)) * 16);
#else
  return (u32)(2 * (r * (HD + 8) + cc * 8));
#endif
}

// Copy key block [n0, n0 + BN) of K and V into one ring stage (rows at `kv_chunk`). Keys >= Sk and
// columns past the head dims are zero-filled without a read. Paged (entries from `lookup_page`, raw:
// clamped here, one block after their load was issued, so its latency hides behind a block's math):
// when a block lies inside one page (`block_in_page`), every lane holds that page and the row of key
// n0 in (pg, pr); otherwise lane j holds the page and row of key n0 + j in (pg, pr) and, for 64-key
// blocks, of key n0 + 32 + j in (pg2, pr2), shuffled to the copiers; copy i of a lane covers row
// r = (lane + 32 i) / CPR, whose register pair r / 32 is i / CPR for every lane (lane < 32): known
// at compile time.
template <int BN>
DEVI bool block_in_page(const DecodeParams& p) { return p.page_size % BN == 0; }  // (blocks start at n0 % BN == 0)

template <int HD, int BN>
DEVI void load_kv(u32 sK, u32 sV, const DecodeParams& p, const u16* kbase, const u16* vbase, int n0, int Sk,
                  int pg, int pr, int pg2, int pr2, int lane) {
  constexpr int CPR = HD / 8, CHUNKS = BN * CPR / 32;
  static_assert(BN <= 64, "two page registers per lane");
  const bool paged = p.page_table != nullptr;
  const bool one_page = paged && block_in_page<BN>(p);
  if (paged) {
    pg = min(max(pg, 0), p.num_pages - 1);
    if constexpr (BN > 32) pg2 = min(max(pg2, 0), p.num_pages - 1);
  }
#pragma unroll
  for (int i = 0; i < CHUNKS; ++i) {
    const int c = lane + 32 * i, r = c / CPR, cc = c % CPR;
    const int j = n0 + r;
    long long koff, voff;
    if (one_page) {
      koff = pg * p.k_bs + (pr + r) * p.k_rs;
      voff = pg * p.v_bs + (pr + r) * p.v_rs;
    } else if (paged) {
      if constexpr (BN > 32) {
        const bool hi = i / CPR != 0;
        const int page = __shfl_sync(0xffffffffu, hi ? pg2 : pg, r & 31);
        const int prow = __shfl_sync(0xffffffffu, hi ? pr2 : pr, r & 31);
        koff = page * p.k_bs + prow * p.k_rs;
        voff = page * p.v_bs + prow * p.v_rs;
      } else {
        const int page = __shfl_sync(0xffffffffu, pg, r), prow = __shfl_sync(0xffffffffu, pr, r);
        koff = page * p.k_bs + prow * p.k_rs;
        voff = page * p.v_bs + prow * p.v_rs;
      }
    } else {
      koff = j * p.k_rs;
      voff = j * p.v_rs;
    }
    const bool row_ok = j < Sk;
    const bool kok = row_ok && cc * 8 < p.head_dim, vok = row_ok && cc * 8 < p.head_dim_v;
    const u32 dst = kv_chunk<HD>(r, cc);
    cp_async16(sK + dst, kok ? kbase + koff + cc * 8 : kbase, kok);
    cp_async16(sV + dst, vok ? vbase + voff + cc * 8 : vbase, vok);
  }
}

#if KV_BULK
// One bulk copy (the TMA engine) of `bytes` from global `src` to shared `dst`, completing on mbarrier `bar`.
DEVI void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// KV_BULK: key block [n0, n0 + BN) into one ring stage, a row per copy: copy c of the warp (lane + 32 i)
// is K row c (c < BN) or V row c - BN, HEAD_DIM-padded rows at `kv_chunk(r, 0)`. Lane 0 announces the
// bytes of the rows inside the sequence on the stage's barrier `bar`; a row at or past Sk is zeroed here
// (never read from global: past a cache's capacity there is nothing to read). Page entries as load_kv's.
template <int HD, int BN>
DEVI void load_kv_bulk(u32 sK, u32 sV, u32 bar, const DecodeParams& p, const u16* kbase, const u16* vbase, int n0,
                       int Sk, int pg, int pr, int lane) {
  static_assert(BN <= 32 && (2 * BN) % 32 == 0, "a copy per row: 16- or 32-key blocks");
  const bool paged = p.page_table != nullptr;
  const bool one_page = paged && block_in_page<BN>(p);
  if (paged) pg = min(max(pg, 0), p.num_pages - 1);
  const int kbytes = 2 * p.head_dim, vbytes = 2 * p.head_dim_v;
  const int inside = min(max(Sk - n0, 0), BN);
  if (lane == 0) mbar_arrive_expect_tx(bar, (u32)(inside * (kbytes + vbytes)));
#pragma unroll
  for (int i = 0; i < 2 * BN / 32; ++i) {
    const int c = lane + 32 * i;
    const bool is_v = c >= BN;
    const int r = is_v ? c - BN : c;
    long long off;
    if (one_page) {
      off = pg * (is_v ? p.v_bs : p.k_bs) + (pr + r) * (is_v ? p.v_rs : p.k_rs);
    } else if (paged) {
      const int page = __shfl_sync(0xffffffffu, pg, r), prow = __shfl_sync(0xffffffffu, pr, r);
      off = page * (is_v ? p.v_bs : p.k_bs) + prow * (is_v ? p.v_rs : p.k_rs);
    } else {
      off = (long long)(n0 + r) * (is_v ? p.v_rs : p.k_rs);
    }
    const u32 dst = (is_v ? sV : sK) + kv_chunk<HD>(r, 0);
    if (n0 + r < Sk) {
      bulk_copy(dst, (is_v ? vbase : kbase) + off, (u32)(is_v ? vbytes : kbytes), bar);
    } else {
#pragma unroll
      for (int cc = 0; cc < HD / 8; ++cc)
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(dst + 16 * cc), "r"(0u) : "memory");
    }
  }
}
#endif

// The raw table entry of key j's page (0 at and past Sk) and j's row in the page.
DEVI void lookup_key(const DecodeParams& p, int b, int j, int Sk, int* pg, int* pr) {
  int page = 0, row = 0;
  if (j < Sk) {
    // < max_pages: j < Sk <= capacity = max_pages * page_size
    const int idx = p.page_shift >= 0 ? j >> p.page_shift : j / p.page_size;
    page = p.page_table[b * p.pt_bs + idx];
    row = j - idx * p.page_size;
  }
  *pg = page;
  *pr = row;
}

// Where a block lies inside one page: key n0's entry in every lane. Otherwise key n0 + lane's (lanes
// < BN) and, for 64-key blocks, key n0 + 32 + lane's in (pg2, pr2). `load_kv` clamps the entries.
template <int BN>
DEVI void lookup_page(const DecodeParams& p, int b, int n0, int Sk, int lane, int* pg, int* pr, int* pg2,
                      int* pr2) {
  if (block_in_page<BN>(p)) {
    lookup_key(p, b, n0, Sk, pg, pr);
    return;
  }
  lookup_key(p, b, lane < BN ? n0 + lane : Sk, Sk, pg, pr);
  if constexpr (BN > 32) lookup_key(p, b, n0 + 32 + lane, Sk, pg2, pr2);
}

// PAGE_BATCH, blocks inside one page: the raw entries of a warp's blocks, 32 to a register (lane j holds
// block 32 c + j's), loaded 32 blocks before their use; blocks are taken in order, each once. Written for
// B = 1, where a lookup one block ahead looked exposed (paged 16 at 0.90x the cache at 4k keys on the
// H200); measured there not faster (0.91x), so opt-in (variants.DECODE_PAGE_BATCH).
struct PageBatch {
  int cur = 0, next = 0;  // entries of batches c and c + 1

  // the raw entry of block bi (0 past the warp's nt blocks: never used) of a warp whose blocks start at
  // key (first + bi * NW) * BN
  template <int BN, int NW>
  DEVI static int entry(const DecodeParams& p, int b, int first, int bi, int nt) {
    if (bi >= nt) return 0;
    const int n0 = (first + bi * NW) * BN;  // < Sk <= capacity: the index is < max_pages
    return p.page_table[b * p.pt_bs + (p.page_shift >= 0 ? n0 >> p.page_shift : n0 / p.page_size)];
  }
  template <int BN, int NW>
  DEVI void start(const DecodeParams& p, int b, int first, int nt, int lane) {
    cur = entry<BN, NW>(p, b, first, lane, nt);
    next = entry<BN, NW>(p, b, first, 32 + lane, nt);
  }
  // block bi's entry and its first key's row in the page (warp-uniform bi: every lane takes part)
  template <int BN, int NW>
  DEVI void take(const DecodeParams& p, int b, int first, int bi, int nt, int lane, int* pg, int* pr) {
    if ((bi & 31) == 0 && bi > 0) {
      cur = next;
      next = entry<BN, NW>(p, b, first, bi + 32 + lane, nt);
    }
    *pg = __shfl_sync(0xffffffffu, cur, bi & 31);
    const int n0 = (first + bi * NW) * BN;
    *pr = n0 - (p.page_shift >= 0 ? n0 >> p.page_shift : n0 / p.page_size) * p.page_size;
  }
};
