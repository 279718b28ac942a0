// Lengths and alignment of the sequence a thread block works on (docs/semantics.md:
// query i sits at aligned position i + offset). Dense batches share one set, read from
// the parameters; this is the one place a kernel learns them. Packed (varlen) sequences learn
// theirs from cu_seqlens in common/varlen.cuh (the Ampere forward built with VARLEN=1).
#pragma once
#include "common/base.cuh"
#include "common/params.cuh"

struct SeqInfo {
  int seqlen_q, seqlen_k;
  int offset;  // aligned position of query 0
};

DEVI SeqInfo sequence_info(const AttnParams& p) { return SeqInfo{p.seqlen_q, p.seqlen_k, p.key_offset}; }
