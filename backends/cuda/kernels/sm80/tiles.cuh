// Global <-> shared tile copies of the Ampere-class kernels: rows padded by 16 bytes in
// shared memory (ldmatrix conflict-free without a swizzle), zero fill at the edges.
#pragma once
#include "sm80/ptx.cuh"

// Copy a ROWS x HD tile (row stride LD = HD + 8 elements in shared memory, which
// makes ldmatrix conflict-free) from global rows row0.. with zero fill past
// `nrows` rows and past `ncols` columns (ncols is a multiple of 8).
template <int ROWS, int HD, int THREADS>
DEVI void load_tile(u16* s, const u16* g, long long row_stride, int row0, int nrows, int ncols, int tid) {
  constexpr int CPR = HD / 8;
  constexpr int LD = HD + 8;
  // each thread keeps one column chunk and steps down the rows: few live registers
  constexpr int RPP = THREADS / CPR;  // rows per pass
  constexpr int PASSES = (ROWS + RPP - 1) / RPP;
  const int r = tid / CPR, cc = tid % CPR;
  if (THREADS % CPR != 0 && r >= RPP) return;
  const int rows_left = nrows - row0 - r;
  const bool col_ok = cc * 8 < ncols;
  const u16* src = g + (long long)(row0 + r) * row_stride + cc * 8;
  const u32 dst = smem_u32(s + r * LD + cc * 8);
#pragma unroll
  for (int i = 0; i < PASSES; ++i) {
    if (ROWS % RPP == 0 || r + i * RPP < ROWS) {
      const bool ok = col_ok && i * RPP < rows_left;
      cp_async16(dst + i * RPP * LD * 2, ok ? src + (long long)i * RPP * row_stride : g, ok);
    }
  }
}

// Store a ROWS x HD tile staged in shared memory (row stride LD) to global memory
// with 16-byte stores, rows < nrows and columns < ncols only.
template <int ROWS, int HD, int THREADS>
DEVI void store_tile(u16* g, long long row_stride, const u16* s, int row0, int nrows, int ncols, int tid) {
  constexpr int CPR = HD / 8;
  constexpr int LD = HD + 8;
  constexpr int RPP = THREADS / CPR;
  constexpr int PASSES = (ROWS + RPP - 1) / RPP;
  const int r = tid / CPR, cc = tid % CPR;
  if ((THREADS % CPR != 0 && r >= RPP) || cc * 8 >= ncols) return;
  const int rows_left = nrows - row0 - r;
  u16* dst = g + (long long)(row0 + r) * row_stride + cc * 8;
#pragma unroll
  for (int i = 0; i < PASSES; ++i) {
    if ((ROWS % RPP == 0 || r + i * RPP < ROWS) && i * RPP < rows_left) {
      const uint4 val = *reinterpret_cast<const uint4*>(s + (r + i * RPP) * LD + cc * 8);
      *reinterpret_cast<uint4*>(dst + (long long)i * RPP * row_stride) = val;
    }
  }
}
