"""The triton backend in the FlashAttention paper's setting, beside torch SDPA's backends and FlexAttention.

bf16, hidden 2048 (heads = 2048 / D), 16k tokens per batch (batch = 16384 / S).
TFLOP/s = 4 * B * H * S^2 * D / median time, halved for causal, x3.5 for forward + backward.
Also: peak extra memory at S=32k, 8 heads, d128, and what the compiler made of each kernel
(registers, spills, shared memory, whether the PTX uses wgmma).

    python benchmarks/triton_paper.py --out benchmarks/results/h200-2026-11-29/triton_paper
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import attnx  # noqa: E402

HIDDEN, TOKENS = 2048, 16384


def tflops(b, h, s, d, causal, mode, ms):
    flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0) * (3.5 if mode == "fwd+bwd" else 1.0)
    return flops / (ms * 1e-3) / 1e12


def triton_fn(q, k, v, causal):
    return attnx.attention(q, k, v, causal=causal, backend="triton")


def sdpa_fn(kind):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION}[kind]

    def fn(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fn


_FLEX = {}


def flex_fn(q, k, v, causal):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    key = (q.shape[2], causal)
    if key not in _FLEX:
        mask = None
        if causal:
            mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, q.shape[2], k.shape[2], device=q.device)
        _FLEX[key] = mask
    return _FLEX["fn"](q, k, v, block_mask=_FLEX[key])


def bench(fn, q, k, v, causal, mode):
    from triton.testing import do_bench

    if mode == "fwd":
        call = lambda: fn(q, k, v, causal)
    else:
        grad = torch.randn_like(q)

        def call():
            out = fn(q, k, v, causal)
            out.backward(grad)
    call()  # compile / autotune outside the timing
    torch.cuda.synchronize()
    return do_bench(call, warmup=10, rep=60, return_mode="median", grad_to_none=[q, k, v])


def peak_extra_mb(fn, causal=False):
    """Peak bytes allocated during one forward beyond the inputs, at S=32k, 8 heads, d128."""
    q, k, v = (torch.randn(1, 8, 32768, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fn(q, k, v, causal)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(q, k, v, causal)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e6


def inspect_kernels() -> list[dict]:
    """Registers, spills, shared memory and wgmma use of every triton-backend kernel compiled so far."""
    from attnx.backends.triton import launch

    rows = []
    for name, fn in list(launch.KERNEL_FNS.items()) + [("bwd_preprocess", launch.bwd_preprocess)]:
        for cache in getattr(fn, "device_caches", {}).values():
            kernels = cache[0] if isinstance(cache, tuple) else cache
            for compiled in kernels.values():
                try:
                    compiled._init_handles()
                except Exception:  # noqa: BLE001 - metadata only
                    pass
                meta = compiled.metadata
                consts = getattr(getattr(compiled, "src", None), "constants", {})
                ptx = compiled.asm.get("ptx", "")
                rows.append({"kernel": name, "num_warps": meta.num_warps, "num_stages": meta.num_stages,
                             "shared": meta.shared, "regs": getattr(compiled, "n_regs", None),
                             "spills": getattr(compiled, "n_spills", None), "wgmma": "wgmma" in ptx,
                             "mma_sync": "mma.sync" in ptx, "constants": str(consts)[:200]})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--dims", default="128,64")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--peers", default="triton,sdpa-flash,sdpa-efficient,sdpa-cudnn,flex")
    parser.add_argument("--flex-seqlens", default=None, help="FlexAttention only at these S (compiles per shape)")
    parser.add_argument("--flex-dims", default=None, help="FlexAttention only at these head dims")
    parser.add_argument("--causal", default="0,1")
    args = parser.parse_args()

    fns = {"triton": triton_fn, "sdpa-flash": sdpa_fn("flash"), "sdpa-efficient": sdpa_fn("efficient"),
           "sdpa-cudnn": sdpa_fn("cudnn"), "flex": flex_fn}
    peers = args.peers.split(",")
    flex_seqlens = None if args.flex_seqlens is None else {int(s) for s in args.flex_seqlens.split(",")}
    flex_dims = None if args.flex_dims is None else {int(x) for x in args.flex_dims.split(",")}
    rows = []
    for d in (int(x) for x in args.dims.split(",")):
        h = HIDDEN // d
        for causal in (bool(int(c)) for c in args.causal.split(",")):
            for s in (int(x) for x in args.seqlens.split(",")):
                b = TOKENS // s
                q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                for mode in args.modes.split(","):
                    row = {"d": d, "causal": causal, "s": s, "b": b, "h": h, "mode": mode}
                    for name in peers:
                        if name == "flex" and ((flex_seqlens is not None and s not in flex_seqlens)
                                               or (flex_dims is not None and d not in flex_dims)):
                            continue
                        try:
                            ms = bench(fns[name], q, k, v, causal, mode)
                            row[name] = round(tflops(b, h, s, d, causal, mode, ms), 1)
                        except Exception as err:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                            row[name] = None
                            row[name + "_error"] = f"{type(err).__name__}: {str(err)[:120]}"
                    rows.append(row)
                    if args.out:  # keep what is measured even if the run is cut short
                        Path(args.out).with_suffix(".partial.json").write_text(json.dumps(rows, indent=1))
                    print(" ".join(f"{key}={val}" for key, val in row.items() if not key.endswith("_error")), flush=True)
    memory = {}
    for name in ("triton", "sdpa-flash"):
        try:
            with torch.no_grad():
                memory[name] = round(peak_extra_mb(fns[name]), 1)
        except Exception as err:  # noqa: BLE001
            memory[name] = f"{type(err).__name__}: {str(err)[:120]}"
    kernels = inspect_kernels()
    meta = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": __import__("triton").__version__,
            "setting": "bf16, hidden 2048, batch = 16384 / S, median of triton.testing.do_bench"}
    result = {"meta": meta, "rows": rows, "peak_extra_mb_s32k_h8_d128_fwd": memory, "kernels": kernels}
    print(json.dumps({"memory": memory}), flush=True)
    for r in kernels:
        print(r, flush=True)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(result, indent=1))
        out.with_suffix(".md").write_text(markdown(result, peers))


def markdown(result, peers) -> str:
    meta = result["meta"]
    lines = [f"# triton backend, FlashAttention paper setting — {meta['device']}, {meta['date']}", "",
             f"{meta['setting']}; torch {meta['torch']}, triton {meta['triton']}. TFLOP/s (higher is better).", ""]
    lines.append("| D | causal | mode | S | " + " | ".join(peers) + " |")
    lines.append("|---" * (4 + len(peers)) + "|")
    for r in result["rows"]:
        cells = [str(r.get(p, "")) if r.get(p) is not None else "n/a" for p in peers]
        lines.append(f"| {r['d']} | {r['causal']} | {r['mode']} | {r['s']} | " + " | ".join(cells) + " |")
    lines += ["", "Peak extra memory, forward, S=32k, 8 heads, d128 (MB): "
              + ", ".join(f"{k} {v}" for k, v in result["peak_extra_mb_s32k_h8_d128_fwd"].items()), "",
              "| kernel | warps | stages | shared B | regs | spills | wgmma | constants |", "|---" * 8 + "|"]
    for k in result["kernels"]:
        lines.append(f"| {k['kernel']} | {k['num_warps']} | {k['num_stages']} | {k['shared']} | {k['regs']} | "
                     f"{k['spills']} | {k['wgmma']} | {k['constants']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
