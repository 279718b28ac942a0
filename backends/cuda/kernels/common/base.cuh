// Basics every attnx CUDA kernel family shares: integer types, the inline qualifier,
// float constants and the exp2 of the softmax. No CUDA headers are included on purpose:
// NVRTC compiles the kernels with no include path, so they build the same way everywhere
// (CuPy at run time, cuda-bindings in CI).
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define DEVI __device__ __forceinline__

#define ATTNX_LOG2E 1.4426950408889634f
#define ATTNX_LN2 0.6931471805599453f

DEVI float neg_inf() { return __int_as_float(0xff800000u); }
DEVI float pos_inf() { return __int_as_float(0x7f800000u); }

// 2^x on the special-function unit; 2^-inf = 0 and 2^NaN = NaN.
DEVI float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 32-bit shared-memory address of a generic pointer into shared memory.
DEVI u32 smem_u32(const void* ptr) {
  u32 addr;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(addr) : "l"(ptr));
  return addr;
}
