// The online softmax's per-row arithmetic, in base 2 (exp2 is the hardware's). A row's
// running max is kept in score units; `unit` converts to log2 units (log2(e), or
// scale * log2(e) where the kernel folds a positive scale into the exponent).
// Rows of an mma.sync or wgmma accumulator are spread over the 4 lanes of a quad.
#pragma once
#include "common/params.cuh"
#include "common/base.cuh"

DEVI float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
DEVI float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The exponent shift of a row whose max (score units) is `row_max`: 0 while it has seen
// nothing, so exp2(-inf - shift) is 0 and not NaN. fmaxf drops NaN, so a NaN score never
// becomes the max; its exp2 is NaN and the NaN reaches the row's sum (see softmax_finish).
DEVI float max_shift(float row_max, float unit) { return row_max == neg_inf() ? 0.f : row_max * unit; }

// The exponent of the factor that takes a row's running sum (and accumulator) from the old max to the
// new one, whose shift is `shift` (max_shift of the new max). The old p values were exp2(x * unit -
// max_shift(old_max, unit)), a rounded shift, so the factor must use the rounded old shift. Written as
// `old_max * unit - shift`, NVRTC's default -fmad=true fuses it into one FFMA whose product is not
// rounded: while the max stays, the factor is 2^(old_max * unit - round(old_max * unit)) != 1, a bias
// of up to half an ulp of the shift per key block that compounds over the blocks (lse 2.7e-3 off at
// 8192 blocks on the H200, out unaffected: benchmarks/lse_precision.py). EXACT_ALPHA=1 rounds the
// product first (the factor is then exactly 1 while the max stays; -inf old max: exp2(-inf) = 0).
#ifndef EXACT_ALPHA
#define EXACT_ALPHA 0
#endif
DEVI float rescale_exponent(float old_max, float unit, float shift) {
#if EXACT_ALPHA
  return __fmul_rn(old_max, unit) - shift;
#else
  return old_max * unit - shift;
#endif
}

// The sink logit of head h (natural units), -inf when the call has none.
DEVI float sink_logit(const AttnParams& p, int h) { return p.sinks ? p.sinks[h] : neg_inf(); }

// End of a row: `max_log2` the running max in log2 units, `sum` the quad-reduced sum of
// exp2(score - max), `sink` the sink logit (a key of that score and value 0, docs/semantics.md).
// *out_scale multiplies the accumulator; *lse is natural-log and includes the sink.
// A row that saw no key (sum exactly 0) gives out 0 and lse = sink (-inf without one). A NaN
// sum is not 0: the row's out and lse come out NaN.
DEVI void softmax_finish(float max_log2, float sum, float sink, float* out_scale, float* lse) {
  if (sum == 0.f) {
    *out_scale = 0.f;
    *lse = sink;
    return;
  }
  const float sink_log2 = sink * ATTNX_LOG2E;
  const float top = fmaxf(max_log2, sink_log2);        // the sink may exceed every score
  const float keep = exp2_approx(max_log2 - top);       // 1 unless the sink is the max
  const float total = sum * keep + exp2_approx(sink_log2 - top);  // exp2(-inf) = 0 without a sink
  *out_scale = keep / total;
  *lse = (top + log2f(total)) * ATTNX_LN2;
}
