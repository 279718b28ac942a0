"""The cuda backend in the FlashAttention paper's setting, beside torch SDPA's backends and FlexAttention.

bf16, hidden 2048, heads = 2048 / D, batch = 16384 / S; TFLOP/s = 4 * B * H * S^2 * D / time,
halved for causal, x3.5 for forward + backward. Medians of triton.testing.do_bench.

    python benchmarks/cuda_paper.py --out benchmarks/results/h200-2026-11-29/cuda_paper
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import attnx  # noqa: E402
from attnx.autograd import run  # noqa: E402
from attnx.problem import make_problem  # noqa: E402
from attnx.registry import _import_builtin_backends  # noqa: E402

_import_builtin_backends()
CUDA = importlib.import_module("attnx.backends.cuda")


def tflops(b, h, s, d, causal, mode, ms):
    f = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0) * (3.5 if mode == "fwd+bwd" else 1.0)
    return f / (ms * 1e-3) / 1e12


def attnx_cuda(q, k, v, causal):
    p = make_problem(q, k, v, causal=causal)
    return run(p, CUDA.BACKEND, q, k, v, None, None)[0]


def sdpa(kind):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[kind]

    def fn(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fn


_flex_cache = {}


def flex(q, k, v, causal):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if "fn" not in _flex_cache:
        _flex_cache["fn"] = torch.compile(flex_attention, dynamic=False)
    key = (q.shape[-2], causal)
    if key not in _flex_cache:
        mask = None
        if causal:
            mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, q.shape[-2], k.shape[-2])
        _flex_cache[key] = mask
    return _flex_cache["fn"](q, k, v, block_mask=_flex_cache[key])


def bench(fn, q, k, v, causal, mode):
    from triton.testing import do_bench
    if mode == "fwd":
        with torch.no_grad():
            return do_bench(lambda: fn(q, k, v, causal), warmup=25, rep=100, return_mode="median")
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    dout = torch.randn_like(q)

    def step():
        fn(qg, kg, vg, causal).backward(dout)
    return do_bench(step, warmup=25, rep=100, grad_to_none=[qg, kg, vg], return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--peers", default="sdpa-flash,sdpa-cudnn,flex")
    ap.add_argument("--flex-seqlens", default="2048,16384")
    ap.add_argument("--forward-stages", type=int, default=None,
                    help="A/B only: force this many K/V buffers in the d<=128 forward tiles")
    ap.add_argument("--modes", default="fwd,fwd+bwd")
    args = ap.parse_args()
    if args.forward_stages:
        tiles = importlib.import_module("attnx.backends.cuda.variants").FORWARD_TILES
        for d in (32, 64, 96, 128):
            tiles[d] = ((128, 64, 4, args.forward_stages),)
    impls = {"attnx-cuda": attnx_cuda, "sdpa-flash": sdpa("flash"), "sdpa-cudnn": sdpa("cudnn"), "flex": flex}
    chosen = ["attnx-cuda"] + [n for n in args.peers.split(",") if n]
    flex_seqlens = {int(s) for s in args.flex_seqlens.split(",") if s}
    rows = []
    for d in (int(x) for x in args.head_dims.split(",")):
        for s in (int(x) for x in args.seqlens.split(",")):
            b, h = 16384 // s, 2048 // d
            gen = torch.Generator(device="cuda").manual_seed(s + d)
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
            for causal in (False, True):
                for mode in args.modes.split(","):
                    for name in chosen:
                        if name == "flex" and s not in flex_seqlens:
                            continue
                        try:
                            ms = bench(impls[name], q, k, v, causal, mode)
                            t = tflops(b, h, s, d, causal, mode, ms)
                        except Exception as err:  # a peer missing on this build is reported, not fatal
                            ms, t = None, None
                            print(f"{name} d{d} S{s} causal={causal} {mode}: {type(err).__name__}: {err}"[:300])
                        rows.append(dict(impl=name, head_dim=d, seqlen=s, batch=b, heads=h, causal=causal,
                                         mode=mode, ms=ms, tflops=t))
                        if t is not None:
                            print(f"{name:11s} d{d:<4d} S{s:<6d} causal={causal!s:5s} {mode:8s} {ms:8.3f} ms "
                                  f"{t:6.1f} TFLOP/s", flush=True)
    meta = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(),
                torch=torch.__version__, cupy=importlib.import_module("cupy").__version__,
                setting="bf16, hidden 2048, H=2048/D, B=16384/S; TFLOP/s=4BHS^2D/t, /2 causal, x3.5 fwd+bwd; "
                        "median of triton.testing.do_bench")
    kernels = CUDA.compile_time_report()
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows, kernels=kernels), indent=1))
        lines = [f"# attnx cuda backend, FlashAttention paper setting ({meta['date']}, {meta['device']})", "",
                 meta["setting"] + f"; torch {meta['torch']}, cupy {meta['cupy']}", ""]
        for mode in ("fwd", "fwd+bwd"):
            for causal in (False, True):
                lines += [f"## {mode}, causal={causal} (TFLOP/s)", "", "| D | S | " + " | ".join(chosen) + " |",
                          "|---|---|" + "---|" * len(chosen)]
                for d in sorted({r["head_dim"] for r in rows}):
                    for s in sorted({r["seqlen"] for r in rows}):
                        cells = []
                        for name in chosen:
                            hit = [r for r in rows if (r["impl"], r["head_dim"], r["seqlen"], r["causal"],
                                                       r["mode"]) == (name, d, s, causal, mode)]
                            cells.append(f"{hit[0]['tflops']:.0f}" if hit and hit[0]["tflops"] else "-")
                        lines.append(f"| {d} | {s} | " + " | ".join(cells) + " |")
                lines.append("")
        lines += ["## kernels loaded", "", "| variant | registers | local bytes | seconds to load |", "|---|---|---|---|"]
        lines += [f"| {k['variant']} | {k['registers']} | {k['local_bytes']} | {k['seconds']} |" for k in kernels]
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    for k in kernels:
        print(k)


if __name__ == "__main__":
    main()
