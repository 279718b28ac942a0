"""The kernels' `AttnParams` struct (kernels/common/params.cuh) as a numpy aligned record.

CuPy passes a numpy structured scalar to a kernel by value, byte for byte, so the
field order and types here must match the C struct exactly.
"""
from __future__ import annotations

import numpy as np

_POINTERS = ("q", "k", "v", "o", "lse", "alibi", "dout", "delta", "dq_accum", "dk", "dv")
_STRIDES = ("q_bs", "q_hs", "q_rs", "k_bs", "k_hs", "k_rs", "v_bs", "v_hs", "v_rs", "o_bs", "o_hs", "o_rs",
            "dk_bs", "dk_hs", "dk_rs", "dv_bs", "dv_hs", "dv_rs", "alibi_bs", "alibi_hs")
_INTS = ("batch", "heads_q", "heads_kv", "group", "seqlen_q", "seqlen_k", "head_dim", "head_dim_v",
         "window_left", "window_right", "num_blocks", "dq_row")
_FLOATS = ("scale", "scale_log2", "softcap", "softcap_inv")

FIELDS = ([(n, np.uint64) for n in _POINTERS] + [(n, np.int64) for n in _STRIDES] + [("sinks", np.uint64)]
          + [(n, np.int32) for n in _INTS] + [(n, np.float32) for n in _FLOATS] + [("key_offset", np.int32)])
PARAMS_DTYPE = np.dtype(FIELDS, align=True)


def pack_params(**values):
    """A by-value kernel argument; fields not given are zero (null pointers, flags off)."""
    record = np.zeros((), PARAMS_DTYPE)
    for name, value in values.items():
        record[name] = value
    return record[()]
