"""K and V read a tile at a time, in the accumulation dtype, without a whole converted copy.

K and V stay the caller's ``(B, Hkv, S, D)`` views. Where a GEMM can read them in place
(the accumulation dtype, a unit stride, batch and heads that merge into one stride) a tile
is a view; otherwise it is copied into a per-worker buffer first. The forward's products
copy a few keys at a time (`chunk_keys`), so the copy is still in the core's cache when
the GEMM reads it: bf16 decode measured about 25 % faster that way than converting whole
512-key tiles (benchmarks/cpu_decode.py). A paged sequence (`pages.PagedKV`) is always copied:
each tile gathers its own pages.
"""
from __future__ import annotations

from typing import Optional

import torch

from .pages import PagedKV

# elements of one converted chunk (512 KiB in float32): well inside a core's L2
CONVERT_ELEMENTS = 1 << 17
MIN_CHUNK_KEYS = 16


def needs_conversion(t: torch.Tensor, acc: torch.dtype) -> bool:
    """True when a ``(B, Hkv, S, D)`` tile of `t` must be copied before a GEMM sees it as ``(B*Hkv, S, D)``:
    another dtype, no unit stride for BLAS, or batch and heads that do not merge into one stride
    (or pages: always gathered)."""
    if isinstance(t, PagedKV):
        return True
    b, heads = t.shape[0], t.shape[1]
    merges = b == 1 or heads == 1 or t.stride(0) == heads * t.stride(1)
    return t.dtype != acc or (t.stride(-1) != 1 and t.stride(-2) != 1) or not merges


def chunk_keys(t: torch.Tensor) -> int:
    """Keys per converted chunk of `t` in the forward's products (accelerators: all, one launch per tile)."""
    if t.device.type != "cpu":
        return t.shape[2]
    return max(MIN_CHUNK_KEYS, CONVERT_ELEMENTS // (t.shape[0] * t.shape[1] * t.shape[3]))


class ConvertBuffer:
    """One worker's scratch for `keys` converted keys of one ``(B, Hkv, S, D)`` tensor.

    The views of a full chunk are made once: a chunk is a few dozen microseconds of work,
    so the Python-side cost of re-making them was a measurable share of a decode.
    """

    def __init__(self, t: torch.Tensor, acc: torch.dtype, keys: int):
        b, heads, _, width = t.shape
        self.keys = keys
        self.flat = torch.empty(b * heads * keys * width, dtype=acc, device=t.device)
        self.token_major = t.stride(2) > t.stride(1)  # keys outermost: copy in that order, one run
        self.full = self._views(b, heads, keys, width)

    def _views(self, b: int, heads: int, keys: int, width: int):
        flat = self.flat[: b * heads * keys * width]
        if self.token_major:
            dense = flat.view(keys, b, heads, width).permute(1, 2, 0, 3)
        else:
            dense = flat.view(b, heads, keys, width)
        return dense, dense.flatten(0, 1)

    def fill(self, part: torch.Tensor) -> torch.Tensor:
        """`part` ``(B, Hkv, keys, D)`` converted, as ``(B*Hkv, keys, D)``."""
        dense, merged = self.full if part.shape[2] == self.keys else self._views(*part.shape)
        dense.copy_(part)
        return merged


def buffer_for(t: torch.Tensor, acc: torch.dtype, keys: int):
    """Scratch for `keys` converted keys of `t` (None when its tiles are read in place)."""
    if isinstance(t, PagedKV):
        return t.buffer(acc, keys)
    if not needs_conversion(t, acc):
        return None
    return ConvertBuffer(t, acc, min(keys, t.shape[2]))


def tile(t: torch.Tensor, j0: int, j1: int, buffer) -> torch.Tensor:
    """Keys ``[j0, j1)`` of `t` as ``(B*Hkv, j1 - j0, D)``: a view, or a copy into `buffer` (from `buffer_for`).

    The copy keeps the source's order of keys and heads, so converting a token-major cache
    (``bshd``, a page pool) is one run through memory; BLAS reads the result through strides.
    """
    if isinstance(t, PagedKV):
        return t.tile(j0, j1, buffer)
    part = t.narrow(2, j0, j1 - j0)
    return part.flatten(0, 1) if buffer is None else buffer.fill(part)


def _chunks(t: torch.Tensor, j0: int, j1: int, buffer):
    step = j1 - j0 if buffer is None else buffer.keys
    for c0 in range(j0, j1, step):
        c1 = min(c0 + step, j1)
        yield c0 - j0, c1 - j0, tile(t, c0, c1, buffer)


def key_scores(q_tile: torch.Tensor, k: torch.Tensor, j0: int, j1: int, out: torch.Tensor,
               buffer, product: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``q_tile @ K[j0:j1]^T`` into `out` ``(B*Hkv, rows, j1 - j0)``, a buffer-full of keys at a time.

    Each chunk's product lands in `product` (a contiguous ``(B*Hkv, rows, chunk)`` scratch) and is
    copied into its columns: a GEMM writing a column slice of `out` directly loops over the batch.
    """
    for c0, c1, keys in _chunks(k, j0, j1, buffer):
        if c1 - c0 == j1 - j0 or product is None:
            torch.bmm(q_tile, keys.transpose(1, 2), out=out[:, :, c0:c1])
        else:
            part = product[: out.shape[0] * out.shape[1] * (c1 - c0)].view(out.shape[0], out.shape[1], c1 - c0)
            out[:, :, c0:c1].copy_(torch.bmm(q_tile, keys.transpose(1, 2), out=part))
    return out


def value_products(probs: torch.Tensor, v: torch.Tensor, j0: int, j1: int, buffer,
                   acc: Optional[torch.Tensor]) -> torch.Tensor:
    """``acc + probs @ V[j0:j1]`` in place (a new tensor when `acc` is None), a buffer-full at a time."""
    for c0, c1, values in _chunks(v, j0, j1, buffer):
        if acc is None:
            acc = torch.bmm(probs[:, :, c0:c1], values)
        else:
            acc.baddbmm_(probs[:, :, c0:c1], values)
    return acc
