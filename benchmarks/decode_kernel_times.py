"""Where a graph-replayed decode step's time goes on the GPU: each kernel's device time against the
replay's wall time (the rest is launch gaps between the kernels of the graph and the tail of each).

    python -m benchmarks.decode_kernel_times [--batches 1,8] [--lengths 32768,131072] [--formats cache,paged16]

Llama-3-8B decode (32 query heads, 8 KV heads, d128, bf16, one new token): cuDNN on the dense cache,
the cuda backend's split-KV decode kernel on a contiguous cache and a page-16 cache. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch

from .backward_check import bench
from .decode_timing import graphed, llama_decode_inputs, paged_copy

REPLAYS = 20


def kernel_times(replay) -> dict:
    """Mean device microseconds per replay of each kernel `replay` runs (torch.profiler, CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    # L2 flushed before each replay as do_bench does (K/V of B = 1, 32k would otherwise sit in its 50 MB)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as flush_only:
        flush.zero_()
        torch.cuda.synchronize()
    flush_names = {e.name for e in flush_only.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            flush.zero_()
            replay()
        torch.cuda.synchronize()
    per_kernel = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.name not in flush_names:
            per_kernel[event.name] += event.device_time / REPLAYS
    return dict(per_kernel)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--lengths", default="32768,131072")
    parser.add_argument("--formats", default="cache,paged16", help="the cuda kernel's key formats (cache, paged16)")
    parser.add_argument("--no-cudnn", action="store_true", help="skip cuDNN's kernel (profiling ours alone)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attnx.autograd import backend_view
    from attnx.backends.cuda import launch_decode
    from attnx.problem import make_call

    major, minor = torch.cuda.get_device_capability()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batches = [int(b) for b in args.batches.split(",")]
    lengths = [int(s) for s in args.lengths.split(",")]
    print(f"{'B':>3} {'Sk':>7} {'what':<14} {'replay us':>9} {'kernels us':>10} {'gap us':>7}  kernels (us each)")
    for b, s, gbytes, q, k, v, lens in llama_decode_inputs(batches, lengths, max_gb=40):
        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        runs = [] if args.no_cudnn else [("cudnn dense", cudnn)]
        for fmt in args.formats.split(","):
            kk, vv, kw = k, v, dict(seqlens_k=lens)
            if fmt == "paged16":
                kk, vv, table = paged_copy(k, v, 16)
                kw["page_table"] = table
            p, x = make_call(q, kk, vv, grad_inputs=(), **kw)
            p = p._replace(arch=f"sm_{major}{minor}")
            xv = backend_view(p, x)
            splits = launch_decode.prepare(p, xv, sms).splits
            runs.append((f"{fmt} s{splits}", lambda p=p, xv=xv: launch_decode.forward(p, xv)))
        for what, fn in runs:
            replay = graphed(fn)
            if replay is None:
                continue
            wall_us = bench(replay) * 1e3
            times = kernel_times(replay)
            busy = sum(times.values())
            detail = ", ".join(f"{name[:40]} {t:.1f}" for name, t in sorted(times.items(), key=lambda kv: -kv[1]))
            print(f"{b:>3} {s:>7} {what:<14} {wall_us:9.1f} {busy:10.1f} {wall_us - busy:7.1f}  {detail}",
                  flush=True)
        runs = kk = vv = None
    return 0


if __name__ == "__main__":
    sys.exit(main())
