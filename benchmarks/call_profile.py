"""Where one call's time goes: the host side of an eager decode call, the kernels of a training step.

    python -m benchmarks.call_profile decode [--device cuda] [--format cache|paged] [--calls 200]
    python -m benchmarks.call_profile training [--device cuda] [--seqlen 1024] [--head-dim 64]

* `decode`: one new token of a Llama-3-8B layer (32 query heads, 8 KV heads, d128, bf16, B = 1, 4k
  keys) through `attnx.attention` eagerly, as a user's loop without CUDA graphs calls it: the wall time
  per call, then a cProfile of `--calls` calls sorted by own time (on the H200, 2026-12-02, such a
  call on the cuda decode kernel took 0.15 ms of host time against 0.02 ms replayed from a graph).
* `training`: forward + backward of the paper setting's row (B x S = 16k tokens, 2048 / D heads, bf16)
  through `attnx.attention` (the dispatcher's pick) and through SDPA with cuDNN forced, each under
  `torch.profiler`: milliseconds per step and the device-time table by kernel (the attnx torch
  backend trailed SDPA-cuDNN at 1k tokens: 299 vs 368 TFLOP/s, d64; this says which kernels differ).

On a CPU both run (slowly) for the script's own test: decode through `blocked`, training through the
dispatcher and SDPA's math path, CPU time in the tables.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

import attnx


def _decode_call(device: str, fmt: str, keys: int):
    """A decode call's tensors and a no-argument function making it (fresh random inputs)."""
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    b, hq, hkv, d = 1, 32, 8, 128
    q = torch.randn(b, hq, 1, d, device=device, dtype=dtype, generator=gen)
    k = torch.randn(b, hkv, keys, d, device=device, dtype=dtype, generator=gen)
    v = torch.randn(b, hkv, keys, d, device=device, dtype=dtype, generator=gen)
    lengths = torch.full((b,), keys, dtype=torch.int32, device=device)
    kwargs = {"seqlens_k": lengths}
    if fmt == "paged":
        page = 16
        pages = keys // page
        k = k[0].transpose(0, 1).reshape(pages, page, hkv, d).contiguous()
        v = v[0].transpose(0, 1).reshape(pages, page, hkv, d).contiguous()
        kwargs["page_table"] = torch.arange(pages, dtype=torch.int32, device=device)[None]
    return q, k, v, kwargs


def profile_decode(device: str, fmt: str, calls: int, keys: int) -> str:
    q, k, v, kwargs = _decode_call(device, fmt, keys)
    pick = attnx.explain(q, k, v, **kwargs).chosen
    for _ in range(3):  # compiles and first-call caches stay out
        attnx.attention(q, k, v, **kwargs)
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        attnx.attention(q, k, v, **kwargs)
    _sync(device)
    per_call_ms = (time.perf_counter() - start) / calls * 1e3
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        attnx.attention(q, k, v, **kwargs)
    profiler.disable()
    _sync(device)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return (f"decode, {fmt}, B=1, {keys} keys, on {device}: the dispatcher picks {pick}; "
            f"{per_call_ms:.3f} ms per eager call (wall, {calls} calls)\n" + text.getvalue())


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _host_ms(fn, device: str, steps: int) -> float:
    """Host time per step: the loop's wall time before the closing synchronisation (the launches are
    queued, not waited for, so this is the Python and launch cost; it equals the step time when the
    host is the bottleneck)."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    host = time.perf_counter() - start
    _sync(device)
    return host / steps * 1e3


def _python_profile(fn, steps: int) -> str:
    """cProfile of `steps` calls of `fn`: where the host time goes, by function."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
    return text.getvalue()


def _step_table(fn, device: str, steps: int) -> tuple[float, str]:
    """(ms per step, the profiler's table by kernel) for `fn()` run `steps` times after a warm-up."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync(device)
    ms = (time.perf_counter() - start) / steps * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        _sync(device)
    sort = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    return ms, prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=70)


def profile_training(device: str, seqlen: int, head_dim: int, steps: int, tokens: int, causal: bool = False) -> str:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    heads, batch = 2048 // head_dim, max(1, tokens // seqlen)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device=device, dtype=dtype, generator=gen)
               .requires_grad_() for _ in range(3))
    dout = torch.randn(batch, heads, seqlen, head_dim, device=device, dtype=dtype, generator=gen)
    pick = attnx.explain(q, k, v, causal=causal).chosen

    def through_attnx():
        attnx.attention(q, k, v, causal=causal).backward(dout)

    def through_sdpa():
        kind = SDPBackend.CUDNN_ATTENTION if device == "cuda" else SDPBackend.MATH
        with sdpa_kernel(kind):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(dout)

    lines = [f"training step, B={batch} H={heads} S={seqlen} D={head_dim} {str(dtype)[6:]} causal={causal} "
             f"on {device}; attnx picks {pick}"]
    for name, fn in ((f"attnx ({pick})", through_attnx), ("SDPA (cuDNN)" if device == "cuda" else "SDPA (math)",
                                                          through_sdpa)):
        ms, table = _step_table(fn, device, steps)
        host = _host_ms(fn, device, 4 * steps)
        lines += [f"\n== {name}: {ms:.3f} ms per step, host {host:.3f} ms per step (queued, not waited for)", table]
    lines += ["\n== attnx step, Python profile", _python_profile(through_attnx, 4 * steps)]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("decode", "training"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--format", default="cache", choices=("cache", "paged"))
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--keys", type=int, default=4096)
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=16384, help="training: B x S")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--causal", action="store_true", help="training: causal steps")
    args = parser.parse_args(argv)
    if args.what == "decode":
        print(profile_decode(args.device, args.format, args.calls, args.keys))
    else:
        print(profile_training(args.device, args.seqlen, args.head_dim, args.steps, args.tokens, args.causal))
    return 0


if __name__ == "__main__":
    sys.exit(main())
