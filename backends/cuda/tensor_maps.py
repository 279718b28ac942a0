"""TMA tensor maps (the driver's CUtensorMap) of the Hopper family's operands.

Each (B, H, S, D) operand becomes a rank-4 map with dims (D, S, H, B) innermost first, its
strides in bytes, a box of 64 columns x `rows` rows and the 128-byte swizzle the kernel's
wgmma descriptors expect. The driver encodes maps on the host (`cuTensorMapEncodeTiled`);
elements outside the dims read as zeros and are never written, so sequence ends and head
dims below the tile need no care in the kernel. Maps depend only on address, shape, strides
and box, so a small cache keyed by them is always right.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

BOX_COLUMNS = 64           # 64 x 2 bytes: one 128-byte swizzle span
MAP_DTYPE = np.dtype([("words", np.uint64, (16,))], align=True)
_CACHE_LIMIT = 512
_cache: dict = {}
_lock = threading.Lock()


def tensor_maps_available() -> bool:
    """Whether cuda-bindings' driver module, which encodes the maps, imports."""
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False
    return True


def _map_dtype(dtype: torch.dtype):
    from cuda.bindings import driver

    kinds = {torch.bfloat16: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
             torch.float16: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16}
    return kinds[dtype]


def _byte_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """Strides (bytes) of the row, head and batch dims; a dim of length 1 gets any legal value."""
    size = t.element_size()
    found = []
    for dim in (2, 1, 0):
        stride = t.stride(dim) * size
        found.append(stride if t.shape[dim] > 1 else max(16, (stride + 15) // 16 * 16))
    return tuple(found)


def operand_ok(t: torch.Tensor) -> bool:
    """Can TMA read `t` (B, H, S, D) in place: last dim contiguous, 16-byte aligned base and strides."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        return False
    if t.data_ptr() % 16:
        return False
    return all(s % 16 == 0 and s < (1 << 40) for s in _byte_strides(t))


def tensor_map(t: torch.Tensor, rows: int):
    """The tensor map of (B, H, S, D) tensor `t` with boxes of `rows` x 64 columns, as a kernel argument."""
    key = (t.data_ptr(), tuple(t.shape), _byte_strides(t), t.dtype, rows)
    return _cached(key, lambda: _encode_operand(t, rows))


DQ_BOX = (32, 64)  # DQ_TMA's fp32 boxes: 32 columns (128 bytes, one swizzle span) x 64 rows


def dq_reduce_map(dq_accum: torch.Tensor):
    """The fp32 map the Hopper backward's DQ_TMA adds dQ parts through: contiguous (B, H, S, D) `dq_accum` as
    dims (D, S, B * H), boxes of 32 columns x 64 rows, 128-byte swizzle. Rows past S are not written."""
    if not dq_accum.is_contiguous() or dq_accum.dtype != torch.float32:
        raise ValueError("dq_accum must be contiguous float32")
    return _cached((dq_accum.data_ptr(), tuple(dq_accum.shape), "dq_reduce"), lambda: _encode_dq(dq_accum))


def _cached(key, encode):
    """The map of `key` from the cache, or `encode()`d and kept (first in, first out past _CACHE_LIMIT)."""
    with _lock:
        found = _cache.get(key)
    if found is not None:
        return found
    arg = encode()
    with _lock:
        if len(_cache) >= _CACHE_LIMIT:
            _cache.pop(next(iter(_cache)))
        _cache[key] = arg
    return arg


def _record(encoded):
    record = np.zeros((), MAP_DTYPE)
    record["words"] = np.array([int(w) for w in encoded.opaque], dtype=np.uint64)
    return record[()]


def _encode_operand(t: torch.Tensor, rows: int):
    from cuda.bindings import driver

    b, h, s, d = t.shape
    dims = [driver.cuuint64_t(int(n)) for n in (d, s, h, b)]
    strides = [driver.cuuint64_t(int(n)) for n in _byte_strides(t)]
    box = [driver.cuuint32_t(n) for n in (BOX_COLUMNS, rows, 1, 1)]
    unit = [driver.cuuint32_t(1)] * 4
    err, encoded = driver.cuTensorMapEncodeTiled(
        _map_dtype(t.dtype), 4, t.data_ptr(), dims, strides, box, unit,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err}) for a tensor of shape {tuple(t.shape)}, "
                           f"strides {tuple(t.stride())}")
    return _record(encoded)


def _encode_dq(dq_accum: torch.Tensor):
    from cuda.bindings import driver

    b, h, s, d = dq_accum.shape
    dims = [driver.cuuint64_t(int(n)) for n in (d, max(s, 1), max(b * h, 1))]
    strides = [driver.cuuint64_t(int(n)) for n in (d * 4, max(s, 1) * d * 4)]
    box = [driver.cuuint32_t(n) for n in (*DQ_BOX, 1)]
    unit = [driver.cuuint32_t(1)] * 3
    err, encoded = driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, dq_accum.data_ptr(), dims, strides, box, unit,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err}) for dq_accum of shape {tuple(dq_accum.shape)}")
    return _record(encoded)
