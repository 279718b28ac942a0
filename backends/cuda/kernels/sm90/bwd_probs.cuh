// The Hopper backward's elementwise step (kernels/sm90/fa_bwd.cu): P^T = exp2(S^T * scale - lse) and
// dS^T = P^T (dP^T - delta) [x softcap'] from the S^T and dP^T accumulators, packed as the 16-bit A
// operands of the dV, dK and dQ GEMMs; fused (`grads_any`), or with a score mod in two halves around the
// dP^T GEMM (`probs_modded_any`, then `grads_from_probs`).
#pragma once
#include "common/mask.cuh"
#include "common/score_mod.cuh"

namespace sm90_bwd {

// The fast path (no score mod): one step's probabilities and score gradients from S^T and dP^T,
// packed as the 16-bit A operands of the next GEMMs (accumulator and operand layouts coincide for
// 16-bit types; register j of k-step kk is row half j%2, 8-column chunk 2kk + j/2). Columns are
// queries, rows keys; the scale is folded into exp2's argument.
template <bool BF16, bool MASK, int BM>
DEVI void grads_block(const float (&st)[BM / 2], const float (&dpt)[BM / 2], u32 (&pa)[BM / 16][4],
                      u32 (&da)[BM / 16][4], const float* lse, const float* delta, const Visibility& vis,
                      float unit, int key0, int m0, int t4) {
#pragma unroll
  for (int kk = 0; kk < BM / 16; ++kk) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = 8 * kk + 4 * (j >> 1) + 2 * (j & 1);
      const int key = key0 + 8 * (j & 1);
      const int col = 16 * kk + 8 * (j >> 1) + 2 * t4;  // query inside the step
      const float2 l = *reinterpret_cast<const float2*>(lse + col);
      const float2 d = *reinterpret_cast<const float2*>(delta + col);
      float pr[2], ds[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int query = m0 + col + e;
        float pe = exp2_approx(fmaf(st[i + e], unit, -(e ? l.y : l.x)));
        if constexpr (MASK)
          if (query >= vis.seqlen_q || !key_visible(vis, query, key)) pe = 0.f;
        pr[e] = pe;
        ds[e] = pe * (dpt[i + e] - (e ? d.y : d.x));
      }
      pa[kk][j] = pack2<BF16>(pr[0], pr[1]);
      da[kk][j] = pack2<BF16>(ds[0], ds[1]);
    }
  }
}

// Masked or not: two whole copies, so no thread-dependent path sits among the wgmmas.
template <bool BF16, int BM>
DEVI void grads_any(bool masked, const float (&st)[BM / 2], const float (&dpt)[BM / 2], u32 (&pa)[BM / 16][4],
                    u32 (&da)[BM / 16][4], const float* lse, const float* delta, const Visibility& vis,
                    float unit, int key0, int m0, int t4) {
  if (masked)
    grads_block<BF16, true, BM>(st, dpt, pa, da, lse, delta, vis, unit, key0, m0, t4);
  else
    grads_block<BF16, false, BM>(st, dpt, pa, da, lse, delta, vis, unit, key0, m0, t4);
}

// The score-mod path in two halves, so tanh's temporaries never meet dP^T's registers (one
// fused pass spilled at d128): first S^T -> P^T in place (fp32) and the softcap derivative packed
// as f16x2 (exactly 1 without a softcap; else 11 bits, finer than the bf16 rounding of dS) ...
template <bool MASK, int BM>
DEVI void probs_modded(float (&st)[BM / 2], u32 (&dcap)[BM / 4], const float* lse, const Visibility& vis,
                       const ScoreMod& mod, int key0, int m0, int t4) {
#pragma unroll
  for (int i = 0; i < BM / 2; i += 2) {
    const int key = key0 + 8 * ((i >> 1) & 1);
    const int col = 8 * (i >> 2) + 2 * t4;
    const float2 l = *reinterpret_cast<const float2*>(lse + col);
    float dc[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int query = m0 + col + e;
      const float x = apply_score_mod(mod, st[i + e], query, key, &dc[e]);
      float pe = exp2_approx(fmaf(x, ATTNX_LOG2E, -(e ? l.y : l.x)));
      if constexpr (MASK)
        if (query >= vis.seqlen_q || !key_visible(vis, query, key)) pe = 0.f;
      st[i + e] = pe;
    }
    dcap[i / 2] = pack2<false>(dc[0], dc[1]);
  }
}

template <int BM>
DEVI void probs_modded_any(bool masked, float (&st)[BM / 2], u32 (&dcap)[BM / 4], const float* lse,
                           const Visibility& vis, const ScoreMod& mod, int key0, int m0, int t4) {
  if (masked)
    probs_modded<true, BM>(st, dcap, lse, vis, mod, key0, m0, t4);
  else
    probs_modded<false, BM>(st, dcap, lse, vis, mod, key0, m0, t4);
}

DEVI float2 unpack_f16x2(u32 v) {
  float2 r;
  asm("{\n.reg .f16 lo, hi;\nmov.b32 {lo, hi}, %2;\ncvt.f32.f16 %0, lo;\ncvt.f32.f16 %1, hi;\n}\n"
      : "=f"(r.x), "=f"(r.y)
      : "r"(v));
  return r;
}

// ... then, with dP^T, the packed operands: P^T and dS^T = P^T (dP^T - delta) softcap' (the softcap
// derivative from `dcap`).
template <bool BF16, int BM>
DEVI void grads_from_probs(const float (&pt)[BM / 2], const float (&dpt)[BM / 2], const u32 (&dcap)[BM / 4],
                           u32 (&pa)[BM / 16][4], u32 (&da)[BM / 16][4], const float* delta, int t4) {
#pragma unroll
  for (int kk = 0; kk < BM / 16; ++kk) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = 8 * kk + 4 * (j >> 1) + 2 * (j & 1);
      const int col = 16 * kk + 8 * (j >> 1) + 2 * t4;
      const float2 d = *reinterpret_cast<const float2*>(delta + col);
      const float2 c = unpack_f16x2(dcap[i / 2]);
      pa[kk][j] = pack2<BF16>(pt[i], pt[i + 1]);
      da[kk][j] = pack2<BF16>(pt[i] * (dpt[i] - d.x) * c.x, pt[i + 1] * (dpt[i + 1] - d.y) * c.y);
    }
  }
}

}  // namespace sm90_bwd
