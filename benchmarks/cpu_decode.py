"""CPU decode: attnx's cache and paged formats (the `blocked` backend) against torch's CPU SDPA.

    python benchmarks/cpu_decode.py                                  # the issue #10 grid
    python benchmarks/cpu_decode.py --batches 1 --lengths 32768 --dtypes bfloat16 --repeats 21

One new token per sequence (Llama-3-8B shape by default: 32 query heads, 8 KV heads, d128)
against a full cache of `length` tokens, three ways on the same numbers:

- ``cache``: ``attnx.attention(q (B,1,Hq,D), k_cache (B,L,Hkv,D), v_cache, seqlens_k, layout="bshd")``;
- ``paged``: the same keys in a shuffled pool of pages (``--page-size``, 16 like vLLM) with a page table;
- ``sdpa``: ``F.scaled_dot_product_attention(q, k, v, enable_gqa=True)`` on the dense ``(B,Hkv,L,D)``
  equivalent, contiguous (SDPA's best case).

The calls are interleaved repeat by repeat, their order rotating, so load from other jobs on a
shared machine falls on all of them alike; the table gives medians (and the quartiles in the
JSON). Outputs are compared with SDPA's before timing. ``--out`` writes ``<out>.md`` and
``<out>.json``.
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


def make_case(batch: int, length: int, heads_q: int, heads_kv: int, head_dim: int, page_size: int, dtype,
              seed: int = 0) -> dict:
    """The three calls of one case, on the same keys and values."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 1, heads_q, head_dim, generator=gen).to(dtype)
    k_cache = torch.randn(batch, length, heads_kv, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(batch, length, heads_kv, head_dim, generator=gen).to(dtype)
    lengths = torch.full((batch,), length, dtype=torch.int32)
    # pool: every sequence's pages, stored in a shuffled order
    pages_per_seq = -(-length // page_size)
    order = torch.randperm(batch * pages_per_seq, generator=gen)
    table = torch.empty(batch * pages_per_seq, dtype=torch.int32)
    table[order] = torch.arange(batch * pages_per_seq, dtype=torch.int32)
    table = table.view(batch, pages_per_seq)
    padded = pages_per_seq * page_size

    def pool_of(cache):
        pages = torch.zeros(batch, padded, heads_kv, head_dim, dtype=dtype)
        pages[:, :length] = cache
        return pages.view(batch * pages_per_seq, page_size, heads_kv, head_dim)[order].contiguous()

    pool_k, pool_v = pool_of(k_cache), pool_of(v_cache)
    q_dense = q.transpose(1, 2).contiguous()
    k_dense, v_dense = (t.transpose(1, 2).contiguous() for t in (k_cache, v_cache))

    def cache():
        return attnx.attention(q, k_cache, v_cache, seqlens_k=lengths, layout="bshd")

    def paged():
        return attnx.attention(q, pool_k, pool_v, seqlens_k=lengths, page_table=table, layout="bshd")

    def sdpa():
        return F.scaled_dot_product_attention(q_dense, k_dense, v_dense, enable_gqa=True).transpose(1, 2)

    return {"cache": cache, "paged": paged, "sdpa": sdpa}


def check_outputs(calls: dict, dtype) -> dict:
    """Max abs difference of each attnx call from SDPA's output (both round to `dtype`)."""
    with torch.no_grad():
        want = calls["sdpa"]().float()
        return {name: float((fn().float() - want).abs().max()) for name, fn in calls.items() if name != "sdpa"}


def time_interleaved(calls: dict, repeats: int) -> dict:
    names = list(calls)
    times = {name: [] for name in names}
    with torch.no_grad():
        for fn in calls.values():  # warm-up
            fn()
        for r in range(repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:
                start = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - start)
    return times


def summary(samples: list) -> dict:
    q1, median, q3 = statistics.quantiles(samples, n=4) if len(samples) > 1 else (samples[0],) * 3
    return {"median_ms": median * 1e3, "q1_ms": q1 * 1e3, "q3_ms": q3 * 1e3}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--heads-q", type=int, default=32)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=pathlib.Path, default=None, help="write <out>.md and <out>.json")
    args = parser.parse_args(argv)

    load_start = os.getloadavg()[0]
    rows = []
    header = "| dtype | B | cache length | cache ms | paged ms | SDPA ms | cache / SDPA | paged / SDPA |"
    lines = [header, "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    print(header, flush=True)
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for batch in args.batches:
            for length in args.lengths:
                calls = make_case(batch, length, args.heads_q, args.heads_kv, args.head_dim, args.page_size, dtype)
                errors = check_outputs(calls, dtype)
                stats = {name: summary(t) for name, t in time_interleaved(calls, args.repeats).items()}
                del calls
                med = {name: s["median_ms"] for name, s in stats.items()}
                line = (f"| {dtype_name} | {batch} | {length} | {med['cache']:.1f} | {med['paged']:.1f} | "
                        f"{med['sdpa']:.1f} | {med['cache'] / med['sdpa']:.2f} | {med['paged'] / med['sdpa']:.2f} |")
                print(line, flush=True)
                lines.append(line)
                rows.append({"dtype": dtype_name, "batch": batch, "length": length, "times": stats,
                             "max_abs_diff_vs_sdpa": errors})
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "load_average_1m_start_end": [load_start, os.getloadavg()[0]],
            "heads_q": args.heads_q, "heads_kv": args.heads_kv, "head_dim": args.head_dim,
            "page_size": args.page_size, "repeats": args.repeats}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n"
        args.out.parent.joinpath(args.out.name + ".json").write_text(report)
        intro = ["# CPU decode: attnx cache / paged (blocked) against SDPA", "",
                 f"{meta['date']}, torch {meta['torch']}, {meta['cpus']} CPUs ({meta['torch_threads']} torch threads), "
                 f"1-minute load average {meta['load_average_1m_start_end'][0]:.1f} at the start and "
                 f"{meta['load_average_1m_start_end'][1]:.1f} at the end (a shared machine). One new token, "
                 f"{args.heads_q} query heads, {args.heads_kv} KV heads, d{args.head_dim}, page size "
                 f"{args.page_size}; medians of {args.repeats} interleaved repeats "
                 "(`python benchmarks/cpu_decode.py`; quartiles and output checks in the JSON).", ""]
        args.out.parent.joinpath(args.out.name + ".md").write_text("\n".join(intro + lines) + "\n")


if __name__ == "__main__":
    main()
