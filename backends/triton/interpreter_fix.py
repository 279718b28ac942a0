"""Work around faults of Triton's CPU interpreter: two bfloat16 ones (triton 3.9), `__index__` (3.6).

It stores bf16 as uint16 and (1) its `create_dot` hands those bits straight to numpy,
(2) its float32 -> bf16 cast truncates instead of rounding to nearest even as GPUs do,
which doubles the rounding error the conformance bounds are measured against.
Applied once, at the first launch under TRITON_INTERPRET=1; compiled kernels are untouched.

`serialised` also makes interpreted launches one at a time: the interpreter keeps a launch's state
in module globals (the grid, a patched `triton.language`), so two threads launching at once fail
(`InterpreterError('x >= grid_dim[0]')`, docs/reliability.md R2). Compiled launches take no lock.

`_fix_index` (seen with triton 3.6.0 and NumPy 2.4.6): the interpreter keeps every scalar, kernel
arguments included, as a 1-element array (shape (1,)) and gives `tl.tensor` the method
`__index__ = int(self.handle.data)`. Recent NumPy no longer converts arrays of ndim > 0 to Python
scalars (a DeprecationWarning since 1.25, a TypeError in 2.4.6), so every `range(...)` / `tl.range(...)` whose bound is a runtime value
(all our key/query loops, the combine's split loop) raised "only 0-dimensional arrays can be converted
to Python scalars". Triton 3.9's interpreter squeezes first; we install the same `__index__` where a
probe shows the interpreter's own one fails. No kernel construct avoids it: in the interpreter every
runtime loop bound is such a tensor, and the one loop form that does not call `__index__` (`while`,
through `__bool__`) becomes scf.while on GPUs, which Triton's software pipeliner does not pipeline
(no cp.async/TMA prefetch of the next K/V block). A shim costs compiled kernels nothing.
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


def _squeezed_index(self) -> int:
    return int(self.handle.data.squeeze())


def _index_of_one_element_fails(interpreter) -> bool:
    """True when the interpreter's own `tl.tensor.__index__` fails on a scalar (a shape (1,) array)."""
    import numpy as np

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    scope_cls = getattr(interpreter, "_LangPatchScope", None)
    if patch is None:
        return False

    class Probe:  # a stand-in for tl.tensor: the patch sets its attributes on this class only
        pass

    try:
        patch(Probe, scope_cls()) if scope_cls is not None else patch(Probe)
        index = Probe.__index__
    except Exception:  # an interpreter laid out differently: leave it alone
        return False
    probe = Probe()
    probe.handle = type("Handle", (), {"data": np.array([3], dtype=np.int32)})()
    try:
        return index(probe) != 3
    except TypeError:
        return True


def _fix_index(interpreter) -> None:
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_attnx_index", False) or not _index_of_one_element_fails(interpreter):
        return

    def _patch_lang_tensor(tensor, *args, **kwargs):
        original(tensor, *args, **kwargs)
        # set after the original's scope recorded the pre-launch value, so its restore removes this too
        tensor.__index__ = _squeezed_index

    _patch_lang_tensor._attnx_index = True
    interpreter._patch_lang_tensor = _patch_lang_tensor


@functools.lru_cache(maxsize=None)
def apply() -> None:
    from triton.runtime import interpreter

    _fix_index(interpreter)
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
