"""The Hopper (sm_90a) forward of the cuda backend: correctness of each kernel configuration, then speed.

    python -m benchmarks.hopper_forward check   # every configuration against the float64 formula
    python -m benchmarks.hopper_forward time    # paper setting (bf16, 16k tokens) beside cuDNN, SDPA-flash, triton

A configuration is a tile-table entry with its pipelining flags switched (`--configs`), so one
run on the device compares them; `check` prints one line per case and stops at the first
failure. Needs an sm_90 GPU, CuPy and cuda-bindings.
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

import attnx
from attnx.problem import make_call

# (B, Hq, Hkv, Sq, Sk, D, Dv, options) -- ragged ends, GQA, Sq != Sk both ways, every feature
CASES = [
    (2, 4, 4, 256, 256, 128, 128, {}),
    (2, 4, 4, 256, 256, 128, 128, {"causal": True}),
    (1, 8, 2, 300, 1000, 128, 128, {"causal": True}),
    (1, 4, 4, 1000, 300, 64, 64, {"causal": True}),
    (2, 4, 1, 77, 129, 64, 64, {"window": (32, 16), "layout": "bshd"}),
    (1, 4, 4, 513, 513, 256, 256, {"causal": True, "softcap": 30.0, "alibi": True}),
    (1, 4, 4, 200, 333, 192, 192, {"sinks": True, "dtype": torch.float16}),
    (1, 2, 2, 129, 1, 96, 96, {}),
    (1, 2, 2, 1, 4000, 128, 128, {"causal": True}),
    (1, 4, 4, 256, 256, 40, 24, {"causal": True}),
    (1, 4, 4, 100, 400, 128, 128, {"causal": True, "offset": 0}),
    (1, 4, 4, 190, 190, 64, 64, {"scale": -0.05}),
    (1, 3, 3, 4096, 4096, 128, 128, {"causal": True}),
    (1, 3, 3, 700, 4096, 128, 128, {}),
    (2, 2, 2, 1000, 1000, 256, 256, {"window": (300, 0)}),
]


def _inputs(case, device="cuda"):
    b, hq, hk, sq, sk, d, dv, opts = case
    opts = dict(opts)
    dtype = opts.pop("dtype", torch.bfloat16)
    layout = opts.get("layout", "bhsd")

    def make(h, s, width):
        shape = (b, s, h, width) if layout == "bshd" else (b, h, s, width)
        return torch.randn(shape, device=device, dtype=dtype)

    q, k, v = make(hq, sq, d), make(hk, sk, d), make(hk, sk, dv)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = torch.rand(hq, device=device) * 0.1
    if opts.pop("sinks", False):
        opts["sinks"] = torch.randn(hq, device=device)
    return q, k, v, opts


def _variant(p, overlap=None, pingpong=None, block_n=None):
    """The tile table's variant for `p`, with its flags / block_n replaced where given."""
    from attnx.backends.cuda.launch_sm90 import forward_variant_for
    from attnx.backends.cuda.variants import max_shared

    v = forward_variant_for(p)
    if overlap is None:
        return v
    v = v._replace(overlap=overlap, pingpong=pingpong)
    wider = v._replace(block_n=block_n or v.block_n)
    return wider if wider.shared_bytes() <= max_shared(p.capability) else v  # a block_n that does not fit: default


def _run(q, k, v, opts, variant_of):
    from attnx.autograd import backend_view
    from attnx.backends.cuda.launch_sm90 import forward

    p, x = make_call(q, k, v, grad_inputs=(), **opts)
    return forward(p, backend_view(p, x), variant_of(p))


def check(configs) -> bool:
    torch.manual_seed(0)
    ok = True
    for cfg in configs:
        for case in CASES:
            q, k, v, opts = _inputs(case)
            out, lse = _run(q, k, v, opts, lambda p: _variant(p, *cfg))
            if opts.get("layout") == "bshd":  # the launcher returns (B, H, S, D) views
                out = out.transpose(1, 2)
            ref_opts = opts  # alibi slopes and sinks are float32 in every call
            ref, ref_lse = attnx.attention(q.double(), k.double(), v.double(), backend="naive", return_lse=True,
                                           **ref_opts)
            err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            finite = torch.isfinite(ref_lse)
            lse_err = (lse.double() - ref_lse)[finite].abs().max().item() if finite.any() else 0.0
            same_inf = bool((lse[~finite] == ref_lse[~finite].float()).all())
            good = (not math.isnan(err)) and err < 1.5e-2 and lse_err < 2e-3 and same_inf and \
                bool(torch.isfinite(out).all())
            print(f"{'ok ' if good else 'BAD'} cfg={cfg} case={case[:7]} {case[7]} rel_err={err:.2e} "
                  f"lse_err={lse_err:.1e}", flush=True)
            ok &= good
    return ok


def _tflops(b, h, s, d, causal, ms):
    return 4 * b * h * s * s * d / (2 if causal else 1) / (ms * 1e-3) / 1e12


def time_all(configs, seqlens=(16384,), head_dims=(128, 64)) -> None:
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for d in head_dims:
        for s in seqlens:
            b, h = max(1, 16384 // s), 2048 // d
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            for causal in (False, True):
                found = {}
                for name, kind in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
                    def sdpa(kind=kind):
                        with sdpa_kernel(kind):
                            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    found[name] = triton.testing.do_bench(sdpa, warmup=50, rep=200, return_mode="median")
                found["triton"] = triton.testing.do_bench(
                    lambda: attnx.attention(q, k, v, causal=causal, backend="triton"), warmup=50, rep=200,
                    return_mode="median")
                for cfg in configs:
                    found[f"sm90{cfg}"] = triton.testing.do_bench(
                        lambda: _run(q, k, v, {"causal": causal}, lambda p: _variant(p, *cfg)), warmup=50, rep=200,
                        return_mode="median")
                base = found["cudnn"]
                for name, ms in found.items():
                    rows.append((d, s, causal, name, ms, _tflops(b, h, s, d, causal, ms), base / ms))
    print(f"{'d':>4} {'S':>6} {'causal':>6} {'kernel':<28} {'ms':>8} {'TFLOP/s':>8} {'x cuDNN':>8}")
    for d, s, causal, name, ms, tf, ratio in rows:
        print(f"{d:>4} {s:>6} {causal!s:>6} {name:<28} {ms:8.3f} {tf:8.1f} {ratio:8.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("what", choices=("check", "time"))
    parser.add_argument("--configs", default="table,00",
                        help="'table' (the shipped tiles) or overlap/pingpong flags, e.g. 11,10 (optionally :block_n)")
    parser.add_argument("--seqlens", default="16384")
    parser.add_argument("--head-dims", default="128,64")
    args = parser.parse_args(argv)
    configs = []
    for item in args.configs.split(","):
        if item == "table":  # the shipped tile table as it is
            configs.append(())
            continue
        flags, _, bn = item.partition(":")
        configs.append((flags[0] == "1", flags[1] == "1", int(bn) if bn else None))
    if args.what == "check":
        return 0 if check(configs) else 1
    time_all(configs, tuple(int(s) for s in args.seqlens.split(",")), tuple(int(d) for d in args.head_dims.split(",")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
