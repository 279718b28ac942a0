"""Where `naive` stops beating `blocked` on this CPU: the data behind naive's rank (SMALL_SCORES).

    python benchmarks/crossover.py [--reps 15] [--threads 1]

Times both backends on problems of growing B*H*Sq*Sk (fp32, D=64), interleaved, and prints
time(naive) / time(blocked) per problem (below 1: naive is faster) beside the dispatcher's pick
(`attnx.explain`), so a rule that disagrees with the measurement shows. Uses each call's CPU
time (`time.thread_time`) with one thread by default, so other load on the machine does
not distort the ratio. Then decoding (Sq=1) with and without grouped-query heads.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402

import attnx  # noqa: E402

SHAPES = ((1, 64), (4, 64), (1, 128), (16, 64), (4, 128), (1, 256), (8, 128), (32, 64), (2, 256),
          (16, 128), (4, 256), (1, 512), (64, 128), (16, 256), (4, 512), (1, 1024))  # (B*H, S)


def _ratio(make_call, reps: int) -> tuple[float, float]:
    calls = {name: make_call(name) for name in ("naive", "blocked")}
    best = {}
    for name, call in calls.items():
        call()  # warm-up
        best[name] = float("inf")
    for _ in range(reps):
        for name, call in calls.items():
            start = time.thread_time()
            call()
            best[name] = min(best[name], time.thread_time() - start)
    return best["naive"], best["blocked"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{'B*H':>4} {'S':>5} {'scores':>8} {'mode':8} {'causal':6} {'naive ms':>9} {'blocked ms':>10} {'ratio':>6} "
          "pick")
    for heads, seqlen in SHAPES:
        for mode in ("fwd", "fwd+bwd"):
            for causal in (False, True):
                q, k, v = (torch.randn(1, heads, seqlen, 64, requires_grad=mode == "fwd+bwd") for _ in range(3))

                def make_call(backend, q=q, k=k, v=v, mode=mode, causal=causal):
                    if mode == "fwd":
                        return lambda: attnx.attention(q.detach(), k.detach(), v.detach(), causal=causal,
                                                       backend=backend)
                    return lambda: attnx.attention(q, k, v, causal=causal, backend=backend).sum().backward()
                naive, blocked = _ratio(make_call, args.reps)
                with torch.enable_grad():
                    pick = attnx.explain(q, k, v, causal=causal).chosen
                print(f"{heads:4d} {seqlen:5d} {heads * seqlen * seqlen:8d} {mode:8} {str(causal):6} "
                      f"{naive * 1e3:9.3f} {blocked * 1e3:10.3f} {naive / blocked:6.2f} {pick}", flush=True)
    print("\ndecode: Sq=1, Hq=8, D=64")
    for heads_kv in (2, 8):
        for seqlen_k in (512, 2048, 8192, 32768):
            q = torch.randn(1, 8, 1, 64)
            k, v = torch.randn(1, heads_kv, seqlen_k, 64), torch.randn(1, heads_kv, seqlen_k, 64)
            naive, blocked = _ratio(lambda backend: (lambda: attnx.attention(q, k, v, backend=backend)), args.reps)
            print(f"Hkv={heads_kv} Sk={seqlen_k:6d}: naive {naive * 1e3:8.3f} ms, blocked {blocked * 1e3:8.3f} ms, "
                  f"ratio {naive / blocked:5.2f}, pick {attnx.explain(q, k, v).chosen}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
