// The merge of the split-KV decode kernel's splits (sm80/fa_decode.cu): the lse of a row over its splits and
// the sink, the combine kernel's body (DECODE_COMBINE=1, one block per row) and FUSED_COMBINE's merge by
// the last block of each program; both sum the splits' outs in the same order.
#pragma once

#if (defined(DECODE_COMBINE) && DECODE_COMBINE) || (defined(FUSED_COMBINE) && FUSED_COMBINE)
DEVI float warp_max(float x) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, m));
  return x;
}
DEVI float warp_sum(float x) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

constexpr int COMBINE_WARPS = 4;  // the launcher's variants.COMBINE_WARPS; the order the splits' outs are summed in

// One warp: row `grow`'s lse over the splits' partial lse and the sink (log2 units, -inf when no part saw
// the row), and in *base the shift of the splits' weights exp2(lse_s - base). As attnx.merge: fmaxf drops a
// NaN lse from the max, but its exp reaches the total, so the row stays NaN. Read through L2 (ld.global.cg):
// under FUSED_COMBINE other blocks of the same launch wrote them, and an SM's L1 is not coherent.
DEVI float merged_lse2(const DecodeParams& p, long long grow, float sink2, int lane, float* base) {
  float top = sink2;
  for (int s = lane; s < p.splits; s += 32) top = fmaxf(top, __ldcg(p.part_lse + (long long)s * p.rows + grow) * ATTNX_LOG2E);
  top = warp_max(top);
  const float shift = top == neg_inf() ? 0.f : top;
  float total = lane == 0 ? exp2_approx(sink2 - shift) : 0.f;
  for (int s = lane; s < p.splits; s += 32)
    total += exp2_approx(__ldcg(p.part_lse + (long long)s * p.rows + grow) * ATTNX_LOG2E - shift);
  total = warp_sum(total);
  const bool seen = !(total == 0.f);  // NaN counts as seen
  const float lse2 = seen ? shift + log2f(total) : neg_inf();
  *base = seen ? lse2 : 0.f;
  return lse2;
}
#endif

#if defined(FUSED_COMBINE) && FUSED_COMBINE
constexpr int MERGE_MAX_SPLITS = 128;  // launch_decode.MAX_SPLITS: the weights of 16 rows fit 8 KB

// The arrival counters of FUSED_COMBINE: one per program (batch, kv head, row chunk), after part_lse's
// splits x rows, zeroed by the launcher before each launch.
DEVI int* split_arrivals(const DecodeParams& p) {
  return reinterpret_cast<int*>(p.part_lse + (long long)p.splits * p.rows);
}

// Called by every thread of every split's block after its partials are stored: the block that arrives
// last for program `prog` merges the program's rows as attnx_decode_combine does (the same arithmetic in
// the same order, so the same bits), the others return. Weights go to shared memory (sW, 16 x 128
// floats over the drained ring); partials are read through L2 (ld.global.cg): other blocks wrote them.
template <bool BF16, int HD, int NW>
DEVI void merge_if_last(const DecodeParams& p, float* sW, int prog, int b, int hk, int r0, int group_rows) {
  __shared__ int is_last;
  __threadfence();  // this thread's partials are visible device-wide before the block arrives
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(split_arrivals(p) + prog, 1) == p.splits - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();  // every other split arrived after its own fence: their partials are visible now
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, Sq = p.seqlen_q;
  const int splits = min(p.splits, MERGE_MAX_SPLITS);
  const int rows = min(16, group_rows - r0);
  for (int row = warp; row < rows; row += NW) {
    const int gr = r0 + row, hq = gr / Sq, h = hk * p.group + hq;
    const long long grow = ((long long)b * p.heads_q + h) * Sq + (gr - hq * Sq);
    float base;
    const float lse2 = merged_lse2(p, grow, (p.sinks ? p.sinks[h] : neg_inf()) * ATTNX_LOG2E, lane, &base);
    for (int s = lane; s < splits; s += 32)
      sW[row * MERGE_MAX_SPLITS + s] = exp2_approx(__ldcg(p.part_lse + (long long)s * p.rows + grow) * ATTNX_LOG2E - base);
    if (lane == 0) p.lse[grow] = lse2 * ATTNX_LN2;
  }
  __syncthreads();
  const int dv4 = p.head_dim_v / 4;
  for (int idx = threadIdx.x; idx < rows * dv4; idx += NW * 32) {
    const int row = idx / dv4, c = idx - row * dv4;
    const int gr = r0 + row, hq = gr / Sq, h = hk * p.group + hq, i = gr - hq * Sq;
    const long long grow = ((long long)b * p.heads_q + h) * Sq + i;
    float4 sum[COMBINE_WARPS];  // split s goes to sum[s % 4], as warp s % 4 of the combine kernel adds it
#pragma unroll
    for (int w = 0; w < COMBINE_WARPS; ++w) sum[w] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 2
    for (int s0 = 0; s0 < splits; s0 += COMBINE_WARPS) {
#pragma unroll
      for (int w = 0; w < COMBINE_WARPS; ++w) {
        const int s = s0 + w;
        if (s < splits) {
          const float wt = sW[row * MERGE_MAX_SPLITS + s];
          const float4 x = __ldcg(reinterpret_cast<const float4*>(p.part_o + ((long long)s * p.rows + grow) * p.head_dim_v) + c);
          sum[w].x += wt * x.x;
          sum[w].y += wt * x.y;
          sum[w].z += wt * x.z;
          sum[w].w += wt * x.w;
        }
      }
    }
#pragma unroll
    for (int w = 1; w < COMBINE_WARPS; ++w) {
      sum[0].x += sum[w].x;
      sum[0].y += sum[w].y;
      sum[0].z += sum[w].z;
      sum[0].w += sum[w].w;
    }
    u16* o = (u16*)p.o + b * p.o_bs + h * p.o_hs + i * p.o_rs + 4 * c;
    *reinterpret_cast<uint2*>(o) = make_uint2(pack2<BF16>(sum[0].x, sum[0].y), pack2<BF16>(sum[0].z, sum[0].w));
  }
}
#endif

#if defined(DECODE_COMBINE) && DECODE_COMBINE
constexpr int COMBINE_MAX_DV = 256;  // the widest decode tile

// One block per row, its 4 warps over the splits: lse = logsumexp of the splits' lse and the sink
// (every warp computes it); warp w sums the outs of splits w, w + 4, ... weighted by exp(lse_s - lse),
// and the 4 sums meet in shared memory. (One warp per row read the splits one after another: at B = 1
// its 8 blocks took 5.9 us of a 56 us decode step on the H200.) As attnx.merge: no part saw the row ->
// out 0, lse -inf (the sink with one); a NaN part -> NaN row (`merged_lse2`).
template <bool BF16>
DEVI void decode_combine(const DecodeParams& p) {
  __shared__ float4 warp_out[COMBINE_WARPS][COMBINE_MAX_DV / 4];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int grow = blockIdx.x;  // the grid is one block per row
  if (grow >= p.rows) return;   // (the whole block)
  const int Sq = p.seqlen_q;
  const int bh = grow / Sq, i = grow - bh * Sq;
  const int b = bh / p.heads_q, h = bh - b * p.heads_q;
  float base;
  const float lse2 = merged_lse2(p, grow, (p.sinks ? p.sinks[h] : neg_inf()) * ATTNX_LOG2E, lane, &base);

  const int dv4 = min(p.head_dim_v, COMBINE_MAX_DV) / 4;
  for (int c = lane; c < dv4; c += 32) {
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int s = warp; s < p.splits; s += COMBINE_WARPS) {
      const long long prow = (long long)s * p.rows + grow;
      const float wt = exp2_approx(p.part_lse[prow] * ATTNX_LOG2E - base);
      const float4 x = *reinterpret_cast<const float4*>(p.part_o + prow * p.head_dim_v + 4 * c);
      sum.x += wt * x.x;
      sum.y += wt * x.y;
      sum.z += wt * x.z;
      sum.w += wt * x.w;
    }
    warp_out[warp][c] = sum;
  }
  __syncthreads();
  u16* o = (u16*)p.o + b * p.o_bs + h * p.o_hs + i * p.o_rs;
  for (int c = threadIdx.x; c < dv4; c += COMBINE_WARPS * 32) {
    float4 sum = warp_out[0][c];
#pragma unroll
    for (int w = 1; w < COMBINE_WARPS; ++w) {
      const float4 x = warp_out[w][c];
      sum.x += x.x;
      sum.y += x.y;
      sum.z += x.z;
      sum.w += x.w;
    }
    *reinterpret_cast<uint2*>(o + 4 * c) = make_uint2(pack2<BF16>(sum.x, sum.y), pack2<BF16>(sum.z, sum.w));
  }
  if (threadIdx.x == 0) p.lse[grow] = lse2 * ATTNX_LN2;
}
#endif
