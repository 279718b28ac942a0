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
