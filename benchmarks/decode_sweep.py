"""The split-KV decode kernel's tile sweep: `python -m benchmarks.cuda_decode sweep [--exact-alpha]`.

Every candidate of `variants.decode_sweep_variants` (the launcher's table first) is checked against
float64 on `cuda_decode.tile_cases` (a failing one is refused, never timed), then timed per
(B, keys, format) of a Llama-3-8B decode step from CUDA-graph replays beside cuDNN on the dense
problem; the best per row, then a summary. `--dry-run` lists candidates and splits on the CPU.
`--splits 0,48,66` times each candidate at those key-split counts too (0: the launcher's heuristic;
a forced count is clamped as the launcher clamps it), labelled `tile/sN`: B = 1 decoding ran 0.85x
cuDNN with the heuristic's 29 splits (2 blocks per SM, 8 programs), so more splits are the question.
"""
from __future__ import annotations

import time

import torch

from .cuda_decode import check, kernel_forward, tile_cases, tile_label, tile_variant
from .decode_timing import format_keys, format_kind, graphed, llama_decode_inputs


def _sweep_problem(b, s, fmt, head_dim, arch="sm_90"):
    from attnx.problem import Problem

    kind, page_size = format_kind(fmt)
    return Problem.create(dtype=torch.bfloat16, batch=b, heads_q=32, heads_kv=8, seqlen_q=1, seqlen_k=s,
                          head_dim=head_dim, device="cuda", vendor="nvidia", arch=arch, kv_format=kind,
                          page_size=page_size)


def sweep_plan(tiles, batches, lengths, formats, head_dim=128, sm_count=132, arch="sm_90") -> None:
    """--dry-run (CPU): each candidate's shared memory, blocks per SM and split unit, and the
    splits the launcher would pick per row (as for an H200)."""
    from attnx.backends.cuda import launch_decode

    for v in tiles:
        p = _sweep_problem(batches[0], lengths[0], formats[0], head_dim, arch)
        tv = tile_variant(p, v)
        plans = []
        for b in batches:
            for s in lengths:
                q = _sweep_problem(b, s, formats[0], head_dim, arch)
                plans.append(f"B{b}/{s // 1024}k:{launch_decode._split_plan(q, tv, s, sm_count, None)[1]}")
        print(f"{tile_label(v):<11} {tv.shared_bytes():>7} B shared  {launch_decode.blocks_per_sm(tv, p.capability)} "
              f"blocks/SM  split unit {tv.warps * tv.block_n:>4} keys  splits {' '.join(plans)}", flush=True)


def _lse_error(q, k, lse, seq=0) -> float:
    """Max abs error of `lse` (B, Hq, 1) on sequence `seq` against float64 (every key visible)."""
    group = q.shape[1] // k.shape[1]
    kf = k[seq].double().repeat_interleave(group, 0)
    ref = torch.logsumexp(q[seq].double() @ kf.transpose(-1, -2) * q.shape[-1] ** -0.5, -1)
    return float((lse[seq].double() - ref).abs().max())


def sweep(tiles, batches, lengths, formats, max_gb: float, head_dim: int = 128, rep: int = 50,
          split_counts=(0,)) -> bool:
    """The decode tile sweep (Llama-3-8B decode: 32 q heads, 8 kv heads, bf16, one new token): every candidate
    checked first on `tile_cases` against float64 (a failing one is refused, never timed), then each row
    (B, keys, format) times every candidate from a CUDA-graph replay through `launch_decode.forward(...,
    variant=)`: GB/s of K+V beside cuDNN's on the dense problem; the best per row, then a summary. Cache rows
    also print each candidate's lse error on sequence 0 against float64 (EXACT_ALPHA's effect)."""
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attnx.autograd import backend_view
    from attnx.backends.cuda import launch_decode
    from attnx.problem import make_call

    major, minor = torch.cuda.get_device_capability()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    arch = f"sm_{major}{minor}"
    start = time.perf_counter()
    passed = []
    for v in tiles:
        print(f"== check {tile_label(v)} on {len(tile_cases(head_dim))} cases", flush=True)
        try:
            good = check(tile_cases(head_dim), kernel_forward, "cuda", tile=v)
        except Exception as err:  # noqa: BLE001 - a candidate that cannot run is refused
            good = False
            print(f"  {type(err).__name__}: {err}")
        if good:
            passed.append(v)
        else:
            print(f"REFUSED {tile_label(v)}: its check failed; not timed", flush=True)
    print(f"checks done in {time.perf_counter() - start:.0f} s: {len(passed)} of {len(tiles)} candidates pass",
          flush=True)
    if not passed:
        return False

    def quick(fn):
        try:
            return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")
        except Exception as err:  # noqa: BLE001
            print(f"  ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})", flush=True)
            return float("nan")

    table = {}
    timed_as = [(cand, n) for cand in passed for n in split_counts]
    labels = [_label(cand, n, split_counts) for cand, n in timed_as]
    print(f"{'B':>3} {'Sk':>7} {'format':<8} {'tile':<11} {'KB':>4} {'/SM':>3} {'splits':>6} {'ms':>8} {'GB/s':>7} "
          f"{'xcuDNN':>6} {'lse err':>8}", flush=True)
    for b, s, gbytes, q, k, v, lens in llama_decode_inputs(batches, lengths, max_gb, head_dim):

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        replay = graphed(cudnn)
        ms = quick(replay) if replay is not None else float("nan")
        ref_gbps = gbytes / ms * 1e3
        print(f"{b:>3} {s:>7} {'dense':<8} {'cudnn':<11} {'':>4} {'':>3} {'':>6} {ms:8.3f} {ref_gbps:7.0f}",
              flush=True)
        for fmt in formats:
            kk, vv, kw = format_keys(fmt, k, v, lens)
            p, x = make_call(q, kk, vv, grad_inputs=(), **kw)
            p = p._replace(arch=arch)
            xv = backend_view(p, x)
            row = table.setdefault((b, s, fmt), {"cudnn": ref_gbps})
            for (cand, forced), label in zip(timed_as, labels):
                try:
                    tv = tile_variant(p, cand)
                except ValueError as err:
                    print(f"{b:>3} {s:>7} {fmt:<8} {label:<11} skipped: {err}", flush=True)
                    continue
                n = forced or None
                splits = launch_decode.prepare(p, xv, sms, variant=tv, splits=n).splits
                replay = graphed(lambda: launch_decode.forward(p, xv, variant=tv, splits=n))
                ms = quick(replay) if replay is not None else float("nan")
                gbps = gbytes / ms * 1e3
                err = ""
                if fmt == "cache":
                    err = f"{_lse_error(q, k, launch_decode.forward(p, xv, variant=tv, splits=n)[1]):8.1e}"
                row[label] = gbps
                print(f"{b:>3} {s:>7} {fmt:<8} {label:<11} {tv.shared_bytes() // 1024:>4} "
                      f"{launch_decode.blocks_per_sm(tv, p.capability):>3} {splits:>6} {ms:8.3f} {gbps:7.0f} "
                      f"{gbps / ref_gbps:6.2f} {err:>8}", flush=True)
            timed = {t: g for t, g in row.items() if t != "cudnn" and g == g}
            if timed:
                best = max(timed, key=timed.get)
                print(f"{b:>3} {s:>7} {fmt:<8} BEST {best} {timed[best]:.0f} GB/s = {timed[best] / ref_gbps:.2f}x "
                      f"cuDNN, {timed[best] / timed.get(labels[0], float('nan')):.2f}x "
                      f"{labels[0]}", flush=True)
            kk = vv = x = xv = None
        q = k = v = lens = None  # (llama_decode_inputs frees them before the next step's)
    _sweep_summary(table, labels)
    print(f"sweep done in {time.perf_counter() - start:.0f} s")
    return len(passed) == len(tiles)


def _label(tile, splits: int, split_counts) -> str:
    """The candidate's name in the tables: the tile, plus `/sN` when several split counts are timed."""
    if len(split_counts) == 1 and not split_counts[0]:
        return tile_label(tile)
    return f"{tile_label(tile)}/s{splits}" if splits else f"{tile_label(tile)}/auto"


def _sweep_summary(table, labels) -> None:
    """GB/s per row x candidate (x cuDNN), the best per row, and the candidates that win every row or lose
    nowhere by more than 2 %."""
    if not table:
        return
    print("\nsummary: GB/s (x cuDNN) per row; * = best of the row")
    print(f"{'row':<20} {'cudnn':>6} " + " ".join(f"{t:>13}" for t in labels))
    wins = {t: 0 for t in labels}
    near = {t: 0 for t in labels}
    for (b, s, fmt), row in table.items():
        timed = {t: row[t] for t in labels if t in row and row[t] == row[t]}
        best = max(timed, key=timed.get) if timed else None
        if best:
            wins[best] += 1
        for t, g in timed.items():
            near[t] += g >= 0.98 * timed[best]
        cells = " ".join(f"{row.get(t, float('nan')):6.0f}({row.get(t, float('nan')) / row['cudnn']:4.2f})"
                         + ("*" if t == best else " ") for t in labels)
        keys = f"{s // 1024}k" if s % 1024 == 0 else str(s)
        print(f"{f'B{b} {keys} {fmt}':<20} {row['cudnn']:6.0f} {cells}")
    print("best in rows: " + ", ".join(f"{t} {n}" for t, n in wins.items() if n) + f" (of {len(table)})")
    print("within 2 % of the best: " + ", ".join(f"{t} {n}" for t, n in near.items()))
