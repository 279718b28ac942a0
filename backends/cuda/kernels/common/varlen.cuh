// Packed (varlen) sequences, docs/semantics.md "Tensor formats": sequence b's queries are rows
// cu_seqlens_q[b]:cu_seqlens_q[b+1] of q (total_q, Hq, D) and its keys rows cu_seqlens_k[b]:
// cu_seqlens_k[b+1] of k/v (total_k, Hkv, D). A kernel built with VARLEN=1 takes VarlenParams as a
// second by-value argument, so the dense build's signature is untouched. Every start and end is
// clamped into [0, total] (ends never below their start), so whatever cu_seqlens holds no row
// outside the buffers is read or written (bad values give wrong numbers, as in the triton kernels).
#pragma once
#include "common/seqlen.cuh"

// The launcher (backends/cuda/launch_varlen.py) mirrors this layout with a numpy aligned record.
struct VarlenParams {
  const int* cu_seqlens_q;  // (B + 1,)
  const int* cu_seqlens_k;  // (B + 1,)
  int total_q, total_k;     // rows of packed q (and out, lse) and of packed k/v
  int align_br;             // 1: bottom-right per sequence, offset Sk_b - Sq_b (AttnParams.key_offset 0)
};

// Where sequence b lies in the packed tensors, and its lengths and alignment (the SeqInfo that
// seqlen.cuh's sequence_info gives a dense batch). Only what differs from the call's AttnParams is
// returned: the kernels keep reading everything else from the parameter bank, which costs no register.
struct PackedSeq {
  int q_start, k_start;  // first rows in packed q / out / lse and in packed k / v
  SeqInfo info;
};

DEVI int clamp_index(int x, int lo, int hi) { return min(max(x, lo), hi); }

DEVI PackedSeq packed_sequence(const VarlenParams& vp, int key_offset, int b) {
  const int q0 = clamp_index(vp.cu_seqlens_q[b], 0, vp.total_q);
  const int q1 = clamp_index(vp.cu_seqlens_q[b + 1], q0, vp.total_q);
  const int k0 = clamp_index(vp.cu_seqlens_k[b], 0, vp.total_k);
  const int k1 = clamp_index(vp.cu_seqlens_k[b + 1], k0, vp.total_k);
  // lengths are below total < attnx.limits.MAX_SEQLEN (the launcher checks): int32 as in mask.cuh
  const int offset = key_offset + (vp.align_br ? (k1 - k0) - (q1 - q0) : 0);
  return PackedSeq{q0, k0, SeqInfo{q1 - q0, k1 - k0, offset}};
}
