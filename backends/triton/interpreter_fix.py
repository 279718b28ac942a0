"""Work around two bfloat16 faults of Triton's CPU interpreter (seen with triton 3.9).

It stores bf16 as uint16 and (1) its `create_dot` hands those bits straight to numpy,
(2) its float32 -> bf16 cast truncates instead of rounding to nearest even as GPUs do,
which doubles the rounding error the conformance bounds are measured against.
Applied once, at the first launch under TRITON_INTERPRET=1; compiled kernels are untouched.

`serialised` also makes interpreted launches one at a time: the interpreter keeps a launch's state
in module globals (the grid, a patched `triton.language`), so two threads launching at once fail
(`InterpreterError('x >= grid_dim[0]')`, docs/reliability.md R2). Compiled launches take no lock.
"""
from __future__ import annotations

import functools
import threading

# re-entrant: the paged backward calls the backward again from inside its own launch section
_INTERPRETER_LOCK = threading.RLock()


def interpreted(kernel) -> bool:
    """True when `kernel` (a @triton.jit function) runs on Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def serialised(kernel):
    """Decorator: `fn` runs under one process-wide lock when `kernel` is interpreted, else as it is."""
    def wrap(fn):
        if not interpreted(kernel):
            return fn

        @functools.wraps(fn)
        def locked(*args, **kwargs):
            with _INTERPRETER_LOCK:
                return fn(*args, **kwargs)
        return locked
    return wrap


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

    original_cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            nan = np.isnan(src.data)
            rounded = np.where(nan, np.uint16(0x7FC0), rounded).astype(np.uint16)
            return interpreter.TensorHandle(rounded.reshape(np.shape(src.data)), dst_type.scalar)
        return original_cast(self, src, dst_type)

    builder.cast_impl = cast_impl
    for name in ("create_fp_trunc",):
        setattr(builder, name, lambda self, src, dst_type: self.cast_impl(src, dst_type))
