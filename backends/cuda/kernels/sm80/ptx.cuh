// Shared pieces of the attnx CUDA kernels: inline-PTX wrappers for cp.async,
// ldmatrix, mma.sync m16n8k16 and conversions, and the tile loader.
// No CUDA headers are included on purpose: NVRTC compiles this file with no
// include path, so the kernels build the same way everywhere (CuPy, CI).
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define DEVI __device__ __forceinline__

#define ATTNX_LOG2E 1.4426950408889634f
#define ATTNX_LN2 0.6931471805599453f

DEVI float neg_inf() { return __int_as_float(0xff800000u); }
DEVI float pos_inf() { return __int_as_float(0x7f800000u); }

// 32-bit shared-memory address of a generic pointer into shared memory.
DEVI u32 smem_u32(const void* ptr) {
  u32 addr;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(addr) : "l"(ptr));
  return addr;
}

// 16-byte async copy global -> shared; when !valid nothing is read and the
// destination is zero-filled (src-size 0), so tile edges need no branches.
DEVI void cp_async16(u32 dst, const void* src, bool valid) {
  int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
DEVI void cp_async4(u32 dst, const void* src, bool valid) {
  int bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
DEVI void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
DEVI void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

DEVI void ldsm_x4(u32* r, u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
DEVI void ldsm_x4_t(u32* r, u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// c += a * b for one m16n8k16 tile, fp32 accumulation.
template <bool BF16>
DEVI void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats -> one register of two 16-bit values (lo in the low half).
template <bool BF16>
DEVI u32 pack2(float lo, float hi) {
  u32 r;
  if constexpr (BF16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

// Two adjacent fp32 atomic adds (8-byte aligned address): one vector reduction on sm_90+.
DEVI void atomic_add2(float* addr, float a, float b) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(addr), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(addr, a);
  atomicAdd(addr + 1, b);
#endif
}

DEVI float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

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

// Is key `col` visible from query `row` (aligned position row + offset)?
DEVI bool key_visible(int row, int col, int seqlen_k, int offset, int window_left, int window_right) {
  const int pos = row + offset;
  return col < seqlen_k && col >= pos - window_left && col <= pos + window_right;
}
