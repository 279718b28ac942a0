// Hopper (sm_90a) primitives as inline PTX: mbarriers, TMA tile copies, wgmma fences and
// shared-memory descriptors, setmaxnreg, named barriers. Kept free of CUDA headers like the
// rest of the kernels (NVRTC compiles them with no include path).
#pragma once
#include "common/base.cuh"
#include "common/convert.cuh"

// A CUtensorMap (cuTensorMapEncodeTiled on the host), passed by value as __grid_constant__.
struct __align__(64) TmaMap {
  u64 words[16];
};

// ---- mbarriers --------------------------------------------------------------------------
DEVI void mbar_init(u32 bar, u32 arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}
// Make initialised barriers visible to the async (TMA) proxy before first use.
DEVI void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

// One arrival that also announces `bytes` of TMA traffic completing on this barrier.
DEVI void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
DEVI void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Wait until the phase of parity `parity` completed. A fresh barrier counts its (virtual)
// previous phase, of parity 1, as complete: producers start waiting on "empty" with parity 1.
DEVI void mbar_wait(u32 bar, u32 parity) {
  u32 done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// ---- TMA --------------------------------------------------------------------------------
DEVI void tma_prefetch(const TmaMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"((u64)map) : "memory");
}
// Box at coordinates (c0 innermost .. c3) of a rank-4 map into shared memory; completes on `bar`.
// Elements outside the tensor arrive as zeros.
DEVI void tma_load_4d(u32 dst, const TmaMap* map, int c0, int c1, int c2, int c3, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"((u64)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
// Box from shared memory to the tensor; elements outside the tensor are not written.
DEVI void tma_store_4d(const TmaMap* map, u32 src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   (u64)map),
               "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}
// `src` (one box of the fp32 map, 1024-aligned, laid out with the map's swizzle) added element-wise to global
// memory at (c0, c1, c2) by TMA's reduce-add; elements outside the map's dims are not written.
DEVI void tma_reduce_add_3d(const TmaMap* map, u32 src, int c0, int c1, int c2) {
  asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n"
               ::"l"((u64)map), "r"(src), "r"(c0), "r"(c1), "r"(c2) : "memory");
}
DEVI void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Wait until the committed stores have read their shared memory (it may then be reused or freed).
DEVI void tma_store_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Orders this thread's generic-proxy global accesses with its async-proxy (TMA) ones, both ways: the
// ordered dQ's turn (a generic acquire/release) around its TMA reduce-adds.
DEVI void fence_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }
// Ordinary shared-memory stores become visible to the async proxy (TMA, wgmma) only after this.
DEVI void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---- wgmma ------------------------------------------------------------------------------
DEVI void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
DEVI void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
DEVI void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keep the compiler from moving reads/writes of registers an in-flight wgmma owns across this point.
template <int N>
DEVI void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
DEVI void fence_regs(u32 (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// Shared-memory matrix descriptor for the 128-byte swizzle TMA writes (atoms of 8 rows x 128 B,
// 1024-byte aligned). `leading` (bytes): K-major operands ignore it; for an MN-major operand it is
// the stride between 64-element column panels. `stride` (bytes): between 8-row groups.
DEVI u64 smem_desc(u32 addr, u32 leading, u32 stride) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((leading >> 4) & 0x3FFF) << 16) |
         ((u64)((stride >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// ---- registers and named barriers ---------------------------------------------------------
template <int N>
DEVI void regs_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
DEVI void regs_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
DEVI void named_sync(int id, int threads) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory"); }
DEVI void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- global reductions (the backward's dQ) -------------------------------------------------
// Two fp32 adds to consecutive (8-byte aligned) floats in one vector reduction (sm_90).
DEVI void red_add_v2(float* addr, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(addr), "f"(a), "f"(b) : "memory");
}

// ---- bulk groups ------------------------------------------------------------------------------
// This thread's committed bulk operations have completed, writes included.
DEVI void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
DEVI void st_shared_v2(u32 addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(a), "f"(b) : "memory");
}
