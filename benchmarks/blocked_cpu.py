"""The blocked backend against torch's own CPU SDPA, forward and forward+backward.

    python benchmarks/blocked_cpu.py                    # B=1, H=8, S=4096, D=64, float32
    python benchmarks/blocked_cpu.py --tiles 256x512 128x512 --repeats 7

Both run on the same inputs, interleaved repeat by repeat (a loaded machine slows
both alike); the table shows medians of wall time and blocked / SDPA. Results go
to ``benchmarks/results/blocked_cpu.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import attnx  # noqa: E402

BACKEND = attnx.get_backend("blocked")
force_tile_sizes = BACKEND.force_tile_sizes

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "blocked_cpu.json"


def parse_tiles(text: str):
    if text == "default":
        return None
    block_m, block_n = text.lower().split("x")
    return int(block_m), int(block_n)


def make_calls(q, k, v, dout, causal, backward):
    qg, kg, vg = (t.detach().clone().requires_grad_(backward) for t in (q, k, v))

    def blocked():
        out = attnx.attention(qg, kg, vg, causal=causal, backend="blocked")
        if backward:
            torch.autograd.grad(out, (qg, kg, vg), dout)

    def sdpa():
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        if backward:
            torch.autograd.grad(out, (qg, kg, vg), dout)

    return blocked, sdpa


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(blocked, sdpa, repeats: int, tiles):
    context = force_tile_sizes(*tiles) if tiles else force_tile_sizes()
    with context:
        blocked()
        sdpa()
        pairs = [(timed(blocked), timed(sdpa)) for _ in range(repeats)]
    blocked_s = statistics.median(b for b, _ in pairs)
    sdpa_s = statistics.median(s for _, s in pairs)
    return blocked_s, sdpa_s


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64", "bfloat16", "float16"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiles", nargs="+", default=["default"], help="BLOCK_MxBLOCK_N list, or 'default'")
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=("fwd", "fwd+bwd"))
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    shape = (args.batch, args.heads, args.seqlen, args.head_dim)
    q, k, v, dout = (torch.randn(shape, dtype=dtype) for _ in range(4))
    rows = []
    print(f"blocked vs SDPA on CPU, B={args.batch} H={args.heads} S={args.seqlen} D={args.head_dim} {args.dtype}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'mode':8s} {'causal':6s} {'tiles (fwd,bwd)':16s} {'blocked ms':>11s} {'sdpa ms':>9s} {'ratio':>6s}")
    for mode in args.modes:
        for causal in (False, True):
            p = attnx.make_problem(q, k, v, causal=causal)
            for tiles_text in args.tiles:
                tiles = parse_tiles(tiles_text)
                used = tiles or tuple(BACKEND.tile_sizes(p))
                used_backward = tiles or tuple(BACKEND.tile_sizes(p, backward=True))
                blocked, sdpa = make_calls(q, k, v, dout, causal, mode == "fwd+bwd")
                blocked_s, sdpa_s = measure(blocked, sdpa, args.repeats, tiles)
                row = {"mode": mode, "causal": causal, "block_m": used[0], "block_n": used[1],
                       "backward_tiles": list(used_backward) if mode == "fwd+bwd" else None,
                       "forced_tiles": tiles is not None, "blocked_ms": blocked_s * 1e3, "sdpa_ms": sdpa_s * 1e3,
                       "ratio": blocked_s / sdpa_s}
                rows.append(row)
                label = f"{used[0]}x{used[1]}" + (f",{used_backward[0]}x{used_backward[1]}" if mode == "fwd+bwd" else "")
                print(f"{mode:8s} {str(causal):6s} {label:16s} {row['blocked_ms']:11.1f} "
                      f"{row['sdpa_ms']:9.1f} {row['ratio']:6.2f}", flush=True)
    result = {
        "benchmark": "blocked_cpu", "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "load_average": os.getloadavg(), "shape_bhsd": shape, "dtype": args.dtype, "repeats": args.repeats,
        "rows": rows,
    }
    output = pathlib.Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1))
    print(f"wrote {output}")
    return result


if __name__ == "__main__":
    main()
