"""Work around Triton's CPU interpreter multiplying bfloat16 dot operands as raw uint16 bits.

The interpreter stores bf16 as uint16 and its `create_dot` hands those bits straight to
numpy (seen with triton 3.9). Applied once, at the first launch under TRITON_INTERPRET=1;
compiled kernels are untouched.
"""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def apply() -> None:
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    convert = getattr(interpreter, "_convert_float", None)
    if builder is None or convert is None or getattr(builder.create_dot, "_attnx_bf16", False):
        return
    import numpy as np
    import triton.language as tl

    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            def to_f32(h):
                if h.dtype.scalar != tl.bfloat16:
                    return h
                data = convert(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
                return interpreter.TensorHandle(data, tl.float32)
            a, b = to_f32(a), to_f32(b)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot._attnx_bf16 = True
    builder.create_dot = create_dot
