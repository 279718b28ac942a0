// Which keys a query sees (docs/semantics.md): query i, at aligned position p_i = i + offset,
// sees key j iff j < Sk and p_i - left <= j <= p_i + right. Causal is right = 0. Unbounded
// sides arrive as attnx.limits.UNBOUNDED_WINDOW and every length and |offset| stays below
// attnx.limits.MAX_SEQLEN, so the sums below stay inside int32.
#pragma once
#include "common/seqlen.cuh"

struct Visibility {
  int seqlen_q, seqlen_k, offset;
  int left, right;  // window sides
};

DEVI Visibility visibility(const AttnParams& p) {
  const SeqInfo s = sequence_info(p);
  return Visibility{s.seqlen_q, s.seqlen_k, s.offset, p.window_left, p.window_right};
}

// May query `row` see key `col`? (Rows past seqlen_q are the caller's business.)
DEVI bool key_visible(const Visibility& vis, int row, int col) {
  const int pos = row + vis.offset;
  return col < vis.seqlen_k && col >= pos - vis.left && col <= pos + vis.right;
}

// Keys [*lo, *hi] that some query of rows [row_first, row_last] sees; *lo > *hi when none.
DEVI void keys_seen(const Visibility& vis, int row_first, int row_last, int* lo, int* hi) {
  *lo = max(0, row_first + vis.offset - vis.left);
  *hi = min(vis.seqlen_k - 1, row_last + vis.offset + vis.right);
}

// Queries [*lo, *hi] that see some key of [key_first, key_last]; *lo > *hi when none.
DEVI void queries_seeing(const Visibility& vis, int key_first, int key_last, int* lo, int* hi) {
  *lo = max(0, key_first - vis.right - vis.offset);
  *hi = min(vis.seqlen_q - 1, key_last + vis.left - vis.offset);
}

// Does every query of rows [m0, m0 + rows) see every key of [n0, n0 + cols)? Such tiles skip
// the per-element mask (rows past seqlen_q are not checked here).
DEVI bool tile_inside_band(const Visibility& vis, int m0, int rows, int n0, int cols) {
  return n0 + cols <= vis.seqlen_k && n0 >= m0 + rows - 1 + vis.offset - vis.left &&
         n0 + cols - 1 <= m0 + vis.offset + vis.right;
}
