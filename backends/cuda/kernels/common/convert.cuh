// fp32 -> 16-bit conversions every family shares.
#pragma once
#include "common/base.cuh"

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
