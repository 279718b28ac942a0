"""Per-call overhead of `attnx.attention` around a backend: validation, cached dispatch, autograd wiring.

A do-nothing backend (returns preallocated tensors) is registered and forced, so the
time measured is attnx's own work. Prints a table and writes JSON beside the other
results. Usage: python benchmarks/overhead.py [--out DIR]
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import statistics
import time

import torch

import attnx


class _NullBackend(attnx.Backend):
    name = "null-overhead-probe"
    description = "returns preallocated tensors; measures attnx's own per-call cost"
    device_types = frozenset({"cpu"})

    def __init__(self, out, lse, grads):
        self._out, self._lse, self._grads = out, lse, grads

    def forward(self, p, q, k, v, mask, alibi_slopes):
        return self._out, self._lse

    def backward(self, p, q, k, v, mask, alibi_slopes, out, lse, dout):
        return self._grads + (None,)


def _per_call_us(fn, calls: int, repeats: int) -> float:
    for _ in range(200):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=None, help="folder for overhead.json")
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()

    q = torch.randn(1, 8, 128, 64)
    k, v = torch.randn_like(q), torch.randn_like(q)
    mask = torch.rand(128, 128) > 0.1
    out, lse = torch.randn_like(q), torch.randn(1, 8, 128)
    null = attnx.register_backend(_NullBackend(out, lse, (torch.randn_like(q),) * 3))
    qg = q.clone().requires_grad_()
    rows = []
    try:
        baseline = _per_call_us(lambda: null.forward(None, q, k, v, None, None), args.calls, 5)
        cases = {
            "plain": lambda: attnx.attention(q, k, v, backend=null.name),
            "causal + bool mask": lambda: attnx.attention(q, k, v, causal=True, mask=mask, backend=null.name),
            "bshd layout": lambda: attnx.attention(q, k, v, layout="bshd", backend=null.name),
            "use_backend context": lambda: attnx.attention(q, k, v),
            "requires_grad (autograd wiring)": lambda: attnx.attention(qg, k, v, backend=null.name),
        }
        for label, fn in cases.items():
            if label == "use_backend context":
                with attnx.use_backend(null.name):
                    per_call = _per_call_us(fn, args.calls, 5)
            else:
                per_call = _per_call_us(fn, args.calls, 5)
            rows.append({"case": label, "us_per_call": round(per_call, 2),
                         "overhead_us": round(per_call - baseline, 2)})
    finally:
        attnx.registry._BACKENDS.pop(null.name, None)
        attnx.dispatch.clear_cache()

    print(f"attnx per-call overhead (median of 5 x {args.calls} calls), {platform.processor() or platform.machine()}")
    print(f"{'case':36s} {'us/call':>9s} {'overhead us':>12s}")
    for row in rows:
        print(f"{row['case']:36s} {row['us_per_call']:9.2f} {row['overhead_us']:12.2f}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        record = {"date": datetime.date.today().isoformat(), "machine": platform.platform(),
                  "torch": torch.__version__, "backend_call_us": round(baseline, 2), "rows": rows}
        (args.out / "overhead.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
