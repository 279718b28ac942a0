// Kernel parameters, passed by value as one struct. The launcher (params.py)
// builds the same layout with a numpy aligned structured dtype: keep the two in
// the same order (8-byte fields first, then 4-byte fields). The order also moves
// ptxas's register allocation of the d128 forward, which sits at 255 registers:
// fields added later went where that kernel kept (nearly) no spills.
#pragma once

struct AttnParams {
  // 8-byte fields
  const void* q;
  const void* k;
  const void* v;
  void* o;            // forward: out; backward: unused
  float* lse;         // forward: written (natural log); backward: lse * log2(e), +inf for empty rows
  const float* alibi; // (B, Hq) slopes or null
  const void* dout;   // backward only
  const float* delta; // backward only: rowsum(dout * out), (B, Hq, Sq)
  float* dq_accum;    // backward only: fp32 (B, Hq, Sq, dq_row) accumulated with atomics
  void* dk;           // backward only
  void* dv;           // backward only
  long long q_bs, q_hs, q_rs;
  long long k_bs, k_hs, k_rs;
  long long v_bs, v_hs, v_rs;
  long long o_bs, o_hs, o_rs;    // out (forward) or dout (backward)
  long long dk_bs, dk_hs, dk_rs;
  long long dv_bs, dv_hs, dv_rs;
  long long alibi_bs, alibi_hs;
  const float* sinks; // (Hq,) sink logits or null (forward only: the backward needs none)
  // 4-byte fields
  int batch, heads_q, heads_kv, group;
  int seqlen_q, seqlen_k;
  int head_dim, head_dim_v;      // multiples of 8 (the launcher pads others)
  int window_left, window_right; // attnx.limits.UNBOUNDED_WINDOW for an unbounded side
  int num_blocks;                // query blocks (forward) or key blocks (backward) per head
  int dq_row;                    // row length of dq_accum
  float scale;                   // softmax scale
  float scale_log2;              // scale * log2(e)
  float softcap;                 // 0 = off
  float softcap_inv;
  int key_offset;                // aligned position of query 0 (query i sits at i + key_offset)
};
