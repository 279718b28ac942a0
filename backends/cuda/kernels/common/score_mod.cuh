// The score of docs/semantics.md from a raw dot product q.k: times the scale, then the
// softcap c * tanh(s / c), then the ALiBi bias -slope * |p_i - j|. Forward and backward
// both evaluate it here; the backward also needs the softcap's derivative.
#pragma once
#include "common/seqlen.cuh"

struct ScoreMod {
  float scale, softcap, softcap_inv;  // softcap 0 = off
  float slope;                        // ALiBi slope of this (batch, head), 0 = none
  int offset;                         // aligned position of query 0
};

DEVI ScoreMod score_mod(const AttnParams& p, int b, int h) {
  const float slope = p.alibi ? p.alibi[b * p.alibi_bs + h * p.alibi_hs] : 0.f;
  return ScoreMod{p.scale, p.softcap, p.softcap_inv, slope, sequence_info(p).offset};
}

// The modified score (natural units) of query `row` and key `col`; *dcap receives
// d score / d (scale * q.k), the softcap's derivative (1 without one).
DEVI float apply_score_mod(const ScoreMod& m, float qk, int row, int col, float* dcap) {
  float x = qk * m.scale;
  *dcap = 1.f;
  if (m.softcap > 0.f) {
    const float th = tanhf(x * m.softcap_inv);
    x = m.softcap * th;
    *dcap = 1.f - th * th;
  }
  return x - m.slope * fabsf((float)(row + m.offset - col));
}
