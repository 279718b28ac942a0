"""The torch backend's NaN-row lse fix-up: the ways, checked equal, then timed inside a training step.

    python -m benchmarks.nan_fixup check             # every way against the ops (CPU: Triton's interpreter)
    python -m benchmarks.nan_fixup time              # on a GPU: 1k-token training steps, each way vs SDPA

`backends/torch/cuda.py` `nan_rows_to_lse` in torch ops was the gap between a 1k-token training step
through attnx and the same step through SDPA-cuDNN on the H200 (2026-12-02 run 4: 2.05 / 1.75 / 2.10 ms
per step against 1.43 / 1.19 / 0.93 for d64, d128, d128 causal; 1.60 / 1.31 / 1.09 with the fix-up
skipped, which is wrong: benchmarks/results/h200-2026-12-02-run4/README.md), mostly host time. Ways,
each giving the same lse bit for bit (`check`):

* ``ops``: `nan_rows_by_ops` (about a dozen launches; the reference).
* ``isnan-any``: ``isnan(t).any(-1)`` per tensor, GQA by broadcasting instead of `repeat_interleave`,
  causal by the first NaN key's index: 8 launches, no matrix product.
* ``triton``: two Triton launches (`backends/torch/nan_rows_triton.py`), lse marked in place; the
  backend runs this one on CUDA since run 5 (2026-12-02: 0.93-0.97x SDPA's step against 0.74-0.88x).
* ``triton-keys``: the same kernels marking only rows that see a NaN key (q not read), what the backend
  runs since 2026-12-03 when the caller does not receive lse (`Problem.returns_lse`): a NaN q row's
  scores, so its probabilities in the backward, are NaN whatever its lse.
* ``none``: no fix-up (wrong; the floor the others are measured against).

`check` runs every way with and without the q rows against the ops.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import attnx
from attnx.backends.torch import cuda as torch_cuda
from attnx.backends.torch.cuda import nan_rows_by_ops, uses_is_causal


def by_isnan_any(p, q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, q_rows: bool = True) -> torch.Tensor:
    key_nan = torch.isnan(k).any(-1)                                          # (B, Hkv, Sk)
    if uses_is_causal(p):  # row i sees keys 0..i (Sq == Sk): NaN from the first NaN key on
        first = torch.where(key_nan, torch.arange(k.shape[2], device=k.device), k.shape[2]).amin(-1)
        seen = torch.arange(q.shape[2], device=q.device) >= first[..., None, None]  # (B, Hkv, 1, Sq)
    else:
        seen = key_nan.any(-1)[..., None, None]                                    # (B, Hkv, 1, 1)
    shape = (q.shape[0], k.shape[1], q.shape[1] // k.shape[1], q.shape[2])
    rows = torch.isnan(q).any(-1).unflatten(1, shape[1:3]) if q_rows else torch.zeros(shape, dtype=torch.bool,
                                                                                       device=q.device)
    return lse.masked_fill((rows | seen).flatten(1, 2), float("nan"))


def by_triton(p, q, k, lse, q_rows: bool = True):
    from attnx.backends.torch.nan_rows_triton import mark_nan_rows

    return mark_nan_rows(uses_is_causal(p), q, k, lse.contiguous(), q_rows)


WAYS = {"ops": nan_rows_by_ops, "isnan-any": by_isnan_any, "triton": by_triton}


def _cases():
    """(causal, heads_q, heads_kv, seqlen, head_dim, NaN spots): GQA, causal, NaN in q and in keys at the
    first, middle and last positions, infinities (not NaN), no NaN at all."""
    for causal in (False, True):
        for heads_q, heads_kv in ((4, 4), (8, 2)):
            for seqlen, head_dim in ((1, 16), (70, 24), (300, 64), (129, 128)):
                yield causal, heads_q, heads_kv, seqlen, head_dim


def check(device: str) -> bool:
    gen = torch.Generator().manual_seed(0)
    ok = True
    for causal, hq, hkv, s, d in _cases():
        for dtype in (torch.bfloat16, torch.float32):
            q, k, v = torch.randn(2, hq, s, d, generator=gen), torch.randn(2, hkv, s, d, generator=gen), None
            spots = torch.randint(0, s, (6,), generator=gen).tolist()
            q[0, hq - 1, spots[0], d // 2] = float("nan")
            k[1, 0, spots[1], 0] = float("nan")
            k[1, hkv - 1, spots[2], d - 1] = float("nan")
            k[0, 0, spots[3], 0] = float("inf")
            q[1, 0, spots[4], 0], q[1, 0, spots[4], d - 1] = float("inf"), float("-inf")
            q, k = q.to(device, dtype), k.to(device, dtype)
            v = torch.empty_like(k)
            p = attnx.make_problem(q, k, v, causal=causal)
            lse = torch.randn(2, hq, s, generator=gen).to(device)
            for q_rows in (True, False):
                want = nan_rows_by_ops(p, q, k, lse.clone(), q_rows)
                for name, way in WAYS.items():
                    got = way(p, q, k, lse.clone(), q_rows)
                    same = torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(
                        torch.nan_to_num(got, nan=0.0), torch.nan_to_num(want, nan=0.0))
                    if not same:
                        ok = False
                        print(f"DIFFERS {name}: causal={causal} Hq={hq} Hkv={hkv} S={s} D={d} {dtype} "
                              f"q_rows={q_rows}")
    print("every way gives the ops' lse" if ok else "some way differs")
    return ok


def _step_ms(fn, steps: int) -> tuple[float, float]:
    """(wall ms per step, host ms per step queued without waiting) after a warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps * 1e3
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    host = (time.perf_counter() - start) / steps * 1e3
    torch.cuda.synchronize()
    return wall, host


def time_ways(steps: int) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    print(f"{'D':>4} {'causal':>6} {'way':>10} {'ms/step':>8} {'host ms':>8} {'x SDPA':>7}")
    for head_dim, causal in ((64, False), (128, False), (128, True)):
        heads, batch, seqlen = 2048 // head_dim, 16, 1024
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                   .requires_grad_() for _ in range(3))
        dout = torch.randn_like(q)

        def sdpa():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(dout)

        base, base_host = _step_ms(sdpa, steps)
        print(f"{head_dim:>4} {causal!s:>6} {'SDPA':>10} {base:8.3f} {base_host:8.3f} {1.0:7.2f}")
        original = torch_cuda.nan_rows_to_lse
        ways = {**WAYS, "triton-keys": lambda p, q_, k_, lse: by_triton(p, q_, k_, lse, q_rows=False),
                "none": lambda p, q_, k_, lse: lse}
        for name, way in ways.items():
            torch_cuda.nan_rows_to_lse = way
            try:
                ms, host = _step_ms(lambda: attnx.attention(q, k, v, causal=causal).backward(dout), steps)
            finally:
                torch_cuda.nan_rows_to_lse = original
            print(f"{head_dim:>4} {causal!s:>6} {name:>10} {ms:8.3f} {host:8.3f} {base / ms:7.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("check", "time"))
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # read when the Triton kernels are defined (backends/torch/nan_rows_triton.py)
        os.environ["TRITON_INTERPRET"] = "1"
    if args.what == "check":
        return 0 if check(device) else 1
    if device != "cuda":
        print("time needs a GPU")
        return 2
    if not check(device):
        return 1
    time_ways(args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
