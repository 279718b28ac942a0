"""Decode bandwidth of the triton backend beside torch SDPA on one GPU (K/V bytes read once per call).

    python -m attnx.backends.triton.bench_decode [--batch 8] [--seqlen 8192] [--sweep]

One new token per sequence against a full cache of ``seqlen`` keys (bf16, Llama-3-8B heads:
32 query heads, 8 kv heads, d128): dense q/k/v, a contiguous cache (``seqlens_k``) and paged
caches (page 16 and page 1), each timed eagerly (what a Python caller sees, launch overhead
included) and inside a CUDA graph (the kernels alone), as GB/s of K+V bytes. SDPA runs the dense
problem (``enable_gqa``) with its default choice and with flash and cuDNN forced. ``--sweep``
also times alternative decode tiles and programs-per-SM on the cache problem.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import attnx

from . import configs


def _bench(fn, graph: bool) -> float:
    import triton.testing

    fn()
    torch.cuda.synchronize()
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=100)
    return triton.testing.do_bench(fn, warmup=25, rep=100)


def _time(name, fn, nbytes, rows, modes=("eager", "graph")):
    row = {"name": name}
    for mode in modes:
        try:
            ms = _bench(fn, mode == "graph")
            row[mode + "_us"] = round(ms * 1e3, 1)
            row[mode + "_GBps"] = round(nbytes / (ms * 1e-3) / 1e9)
        except Exception as err:  # noqa: BLE001 - report and go on
            row[mode + "_error"] = f"{type(err).__name__}: {str(err)[:200]}"
    rows.append(row)
    print(json.dumps(row), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--heads-q", type=int, default=32)
    ap.add_argument("--heads-kv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    B, S, Hq, Hkv, D = args.batch, args.seqlen, args.heads_q, args.heads_kv, args.head_dim
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(B, Hq, 1, D, dtype=dt, device=dev)
    k = torch.randn(B, Hkv, S, D, dtype=dt, device=dev)
    v = torch.randn(B, Hkv, S, D, dtype=dt, device=dev)
    nbytes = 2 * k.numel() * k.element_size()
    lens = torch.full((B,), S, dtype=torch.int32, device=dev)
    props = torch.cuda.get_device_properties(dev)
    print(json.dumps({"device": props.name, "sms": props.multi_processor_count, "B": B, "S": S, "Hq": Hq,
                      "Hkv": Hkv, "D": D, "kv_bytes": nbytes}), flush=True)
    rows: list = []

    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    pools = {}
    for ps in (16, 1):
        pages = B * S // ps
        table = torch.randperm(pages, device=dev).to(torch.int32).reshape(B, S // ps)
        pool_k = torch.empty(pages, ps, Hkv, D, dtype=dt, device=dev)
        pool_v = torch.empty_like(pool_k)
        pool_k[table.flatten().long()] = k.transpose(1, 2).reshape(pages, ps, Hkv, D)
        pool_v[table.flatten().long()] = v.transpose(1, 2).reshape(pages, ps, Hkv, D)
        pools[ps] = (pool_k, pool_v, table)

    calls = {
        "triton dense": lambda: attnx.attention(q, k, v, backend="triton"),
        "triton cache": lambda: attnx.attention(q, k, v, seqlens_k=lens, backend="triton"),
        "triton paged16": lambda: attnx.attention(q, pools[16][0], pools[16][1], seqlens_k=lens,
                                                  page_table=pools[16][2], backend="triton"),
        "triton paged1": lambda: attnx.attention(q, pools[1][0], pools[1][1], seqlens_k=lens,
                                                 page_table=pools[1][2], backend="triton"),
    }
    for name, fn in calls.items():
        err = (fn().float() - ref.float()).abs().max().item()
        print(json.dumps({"check": name, "max_abs_diff_vs_sdpa": err}), flush=True)
        _time(name, fn, nbytes, rows)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _time("sdpa default", lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), nbytes, rows)
    for label, kind in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION),
                        ("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def run(kind=kind):
            with sdpa_kernel(kind):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        _time(label, run, nbytes, rows)

    if args.sweep:
        original_cfg, original_pps = configs.decode_config, configs.DECODE_PROGRAMS_PER_SM
        try:
            for bn, warps, stages in ((64, 4, 3), (32, 4, 4), (128, 4, 2), (64, 8, 3), (128, 8, 3), (64, 4, 4)):
                for pps in (2, 4):
                    configs.decode_config = (lambda fam, bd, dtype, c=configs.LaunchConfig(16, bn, warps, stages): c)
                    configs.DECODE_PROGRAMS_PER_SM = pps
                    _time(f"sweep cache n{bn} w{warps} s{stages} pps{pps}",
                          calls["triton cache"], nbytes, rows, modes=("graph",))
        finally:
            configs.decode_config, configs.DECODE_PROGRAMS_PER_SM = original_cfg, original_pps
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
