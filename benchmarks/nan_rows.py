"""Which rows of a (B, H, S, D) tensor hold a NaN: the torch backend's lse fix-up cost, and cheaper ways.

    python -m benchmarks.nan_rows            # CPU: agreement only; on a GPU also the time of each way

The torch backend maps lse to NaN in every row that sees a NaN in q or in a visible key
(backends/torch/cuda.py `nan_rows_to_lse`), since torch's fused kernels leave those rows' lse finite.
On the H200 (2026-12-02, benchmarks/results/h200-2026-12-02-run2/profile-calls.log) its two
`amax(-1)` reductions took 168 us each for a B16 H32 S1k d64 bf16 tensor (~400 GB/s), 0.34 ms of a
1.80 ms training step that SDPA-cuDNN runs in 1.44 ms. Each candidate below gives the same boolean
rows on every input here, NaN and infinities included (`check`); the GPU timing then picks one.
Picked (H200, 2026-12-02, benchmarks/results/h200-2026-12-02-run3/nan-rows.log): abs-matvec, 66 us
against amax's 166 us (isnan-words 75 us); the torch backend's `_rows_with_nan` is that way now.
"""
from __future__ import annotations

import torch


def by_amax(t: torch.Tensor) -> torch.Tensor:
    """Today's way: max propagates NaN; one reduction over the last dim."""
    return torch.isnan(t.amax(-1))


def by_isnan_words(t: torch.Tensor) -> torch.Tensor:
    """isnan as bytes, read back 8 at a time as int64 words: the reduction sees D / 8 words per row."""
    flags = torch.isnan(t)
    d = t.shape[-1]
    if d % 8 or not flags.is_contiguous():
        return flags.any(-1)
    return flags.view(torch.int64).ne(0).any(-1)  # view over the last dim: (..., D / 8) words


def by_matvec(t: torch.Tensor) -> torch.Tensor:
    """|t| summed by a matrix-vector product: NaN stays NaN, no +inf - inf (absolute values); an
    overflow to inf is not NaN, so rows of huge finite values are not flagged."""
    ones = torch.ones(t.shape[-1], 1, dtype=t.dtype, device=t.device)
    return torch.isnan((t.abs().reshape(-1, t.shape[-1]) @ ones).reshape(t.shape[:-1]))


WAYS = {"amax": by_amax, "isnan-words": by_isnan_words, "abs-matvec": by_matvec}


def _inputs(device, dtype=torch.bfloat16, shape=(16, 32, 1024, 64)):
    gen = torch.Generator(device="cpu").manual_seed(0)
    t = torch.randn(shape, generator=gen).to(dtype)
    flat = t.view(-1, shape[-1])
    rows = torch.randperm(flat.shape[0], generator=gen)[:64]
    flat[rows[:16], 3] = float("nan")
    flat[rows[16:32], -1] = float("nan")
    flat[rows[32:40], 0] = float("inf")                   # inf alone: not NaN
    flat[rows[40:48], 1], flat[rows[40:48], 2] = float("inf"), float("-inf")  # +inf and -inf: not NaN
    flat[rows[48:56]] = torch.finfo(dtype).max            # huge finite values: not NaN
    flat[rows[56:64], 5] = float("nan")
    flat[rows[56:64], 6] = float("inf")
    return t.to(device)


def check(device) -> bool:
    t = _inputs(device)
    want = torch.isnan(t).any(-1)
    ok = True
    for name, way in WAYS.items():
        got = way(t)
        same = bool(torch.equal(got, want))
        ok &= same
        print(f"{name:12} {'same rows' if same else 'DIFFERENT rows'} ({int(got.sum())} of {int(want.sum())} NaN rows)")
    return ok


def time_ways(device) -> None:
    from .backward_check import bench

    for shape in ((16, 32, 1024, 64), (4, 16, 4096, 128)):
        t = _inputs(device, shape=shape)
        gb = t.numel() * t.element_size() / 1e9
        cells = []
        for name, way in WAYS.items():
            ms = bench(lambda: way(t))
            cells.append(f"{name} {ms * 1e3:7.1f} us ({gb / ms * 1e3:5.0f} GB/s)")
        print(f"{str(shape):22} " + " | ".join(cells), flush=True)


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ok = check(device)
    if device == "cuda":
        time_ways(device)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
