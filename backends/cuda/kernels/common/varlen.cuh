// Packed (varlen) sequences, docs/semantics.md "Tensor formats": sequence b's queries are rows
// cu_seqlens_q[b]:cu_seqlens_q[b+1] of q (total_q, Hq, D) and its keys rows cu_seqlens_k[b]:
// cu_seqlens_k[b+1] of k/v (total_k, Hkv, D). A kernel built with VARLEN=1 takes this struct as a
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

// One packed sequence seen as a dense batch of one: q/k/v/out at its first rows (batch strides 0),
// its own lengths and offset, so seqlen.cuh's sequence_info (visibility, masks, ALiBi) and the dense
// tile bounds apply unchanged: loads stop at the sequence's last row and never reach the next one's.
struct PackedSequence {
  AttnParams p;
  int q_start;  // its first row in packed q, out and lse
};

DEVI int clamp_index(int x, int lo, int hi) { return min(max(x, lo), hi); }

DEVI PackedSequence packed_sequence(const AttnParams& call, const VarlenParams& vp, int b) {
  const int q0 = clamp_index(vp.cu_seqlens_q[b], 0, vp.total_q);
  const int q1 = clamp_index(vp.cu_seqlens_q[b + 1], q0, vp.total_q);
  const int k0 = clamp_index(vp.cu_seqlens_k[b], 0, vp.total_k);
  const int k1 = clamp_index(vp.cu_seqlens_k[b + 1], k0, vp.total_k);
  PackedSequence s{call, q0};
  s.p.q = (const u16*)call.q + q0 * call.q_rs;
  s.p.k = (const u16*)call.k + k0 * call.k_rs;
  s.p.v = (const u16*)call.v + k0 * call.v_rs;
  s.p.o = (u16*)call.o + q0 * call.o_rs;
  s.p.q_bs = s.p.k_bs = s.p.v_bs = s.p.o_bs = 0;
  s.p.seqlen_q = q1 - q0;
  s.p.seqlen_k = k1 - k0;
  // lengths are below total < attnx.limits.MAX_SEQLEN (the launcher checks), so this stays in int32
  s.p.key_offset = call.key_offset + (vp.align_br ? (k1 - k0) - (q1 - q0) : 0);
  return s;
}
