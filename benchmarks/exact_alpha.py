"""What EXACT_ALPHA (common/softmax.cuh) costs: the forward and decode kernels with it beside their twins
without it, in one run, and the lse each gives on one long row set against float64 (the forward rounds
from `variants.EXACT_ALPHA_MIN_KEYS` keys on, the decode kernel always).

    python -m benchmarks.exact_alpha            # needs CuPy, cuda-bindings and an sm_90 GPU

Forward: the paper setting (bf16, 16k tokens per batch, 2,048 / head_dim heads), d64/d128, S 4k/16k,
causal 0/1, TFLOP/s of each twin and their ratio. Decode: Llama-3-8B shape (32 query heads, 8 kv heads,
d128), one token against a contiguous cache, B 1/8, 32k/128k, GB/s of K+V. Each twin timed twice, in the
order A B B A. lse: one head, d128, S = 256k, 64 sampled rows against the float64 formula (rows spread
over the sequence, causal), each twin.
"""
from __future__ import annotations

import math

import torch

from attnx.autograd import backend_view
from attnx.problem import make_call

from .backward_check import bench


def _abba(twins: dict, run, work: float) -> dict:
    """work / ms of each twin, the mean of two medians timed in the order A B B A: the run of 2026-12-02
    timed each row once, the EXACT_ALPHA twin first, so an order effect was not ruled out."""
    (a, va), (b, vb) = twins.items()
    times = {a: [], b: []}
    for name, variant in ((a, va), (b, vb), (b, vb), (a, va)):
        times[name].append(bench(lambda: run(variant)))
    return {name: work / (sum(ms) / len(ms)) for name, ms in times.items()}


def _forward_row(d: int, s: int, causal: bool):
    from attnx.backends.cuda import launch_sm90

    heads, batch = 2048 // d, max(1, 16384 // s)
    q, k, v = (torch.randn(batch, heads, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    p, x = make_call(q, k, v, causal=causal, grad_inputs=())
    p = p._replace(arch="sm_90")
    xv = backend_view(p, x)
    exact = launch_sm90.forward_variant_for(p)._replace(exact_alpha=True)
    flops = 4 * batch * heads * s * s * d / (2 if causal else 1)
    return _abba({"exact": exact, "fused": exact._replace(exact_alpha=False)},
                 lambda variant: launch_sm90.forward(p, xv, variant), flops / 1e9)


def _decode_row(batch: int, length: int):
    from attnx.backends.cuda import launch_decode

    q = torch.randn(batch, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, 8, length, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    p, x = make_call(q, k, v, seqlens_k=lens, grad_inputs=())
    p = p._replace(arch="sm_90")
    xv = backend_view(p, x)
    exact = launch_decode.decode_variant_for(p)
    gb = 2 * batch * 8 * length * 128 * 2 / 1e9
    return _abba({"exact": exact, "fused": exact._replace(exact_alpha=False)},
                 lambda variant: launch_decode.forward(p, xv, variant=variant), gb * 1e3)


def _lse_errors(s: int = 1 << 18, rows: int = 64):
    from attnx.backends.cuda import launch_sm90

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 1, s, 128, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
    p, x = make_call(q, k, v, causal=True, grad_inputs=())
    p = p._replace(arch="sm_90")
    xv = backend_view(p, x)
    pick = torch.linspace(s // 64, s - 1, rows, device="cuda").long()
    scores = (q[0, 0, pick].double() @ k[0, 0].double().T) / math.sqrt(128)
    scores = scores.masked_fill(torch.arange(s, device="cuda")[None] > pick[:, None], float("-inf"))
    want = torch.logsumexp(scores, -1)
    exact = launch_sm90.forward_variant_for(p)._replace(exact_alpha=True)
    errs = {}
    for name, variant in (("exact", exact), ("fused", exact._replace(exact_alpha=False))):
        _, lse = launch_sm90.forward(p, xv, variant)
        errs[name] = (lse[0, 0, pick].double() - want).abs().max().item()
    return errs


def main() -> int:
    torch.manual_seed(0)
    print("forward (TFLOP/s)      EXACT_ALPHA=1  =0      ratio")
    worst = 1.0
    for d in (64, 128):
        for s in (4096, 16384):
            for causal in (False, True):
                r = _forward_row(d, s, causal)
                worst = min(worst, r["exact"] / r["fused"])
                print(f"d{d:<4} S{s:<6} causal={int(causal)}  {r['exact']:8.1f} {r['fused']:8.1f}  {r['exact'] / r['fused']:.3f}",
                      flush=True)
    print("decode cache (GB/s)    EXACT_ALPHA=1  =0      ratio")
    for batch in (1, 8):
        for length in (32768, 131072):
            r = _decode_row(batch, length)
            worst = min(worst, r["exact"] / r["fused"])
            print(f"B{batch:<3} {length // 1024}k              {r['exact']:8.0f} {r['fused']:8.0f}  {r['exact'] / r['fused']:.3f}",
                  flush=True)
    e = _lse_errors()
    print(f"lse, causal S=256k d128, 64 rows vs float64: EXACT_ALPHA=1 {e['exact']:.2e}, =0 {e['fused']:.2e}")
    print(f"worst speed ratio (1 over 0): {worst:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
