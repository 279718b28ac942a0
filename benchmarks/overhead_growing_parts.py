"""Where a growing decode step's host time goes: the default call beside its parts, CPU.

The row of `overhead_sidebyside.py` that misses its target most is the decode loop whose key length
grows by one per step (B=1 H=8 Sq=1 D=64, Sk 1000..1100). This times, in the same shuffled single-call
setting (every call follows another candidate's kernel, caches as cold as in a model), the layers
of that call one on top of the other, so that each difference is one layer's cost:

* ``sdpa``: ``F.scaled_dot_product_attention``; ``op``: the aten CPU flash op alone;
* ``op + nan check``: and the torch backend's check of lse for rows that met a NaN or an infinity;
* ``backend.forward``: the torch backend's whole forward, given a Problem and `Inputs`;
* ``attention, seen``: `attnx.attention` on a signature it ran before (a remembered `Run`);
* ``attention, new``: `attnx.attention` on a signature never seen (the call memo emptied before it,
  its sibling kept: what each step of one generation pays).

    python benchmarks/overhead_growing_parts.py [--seconds 20]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/overhead_growing_parts.py`: import the package from the repo root
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attnx  # noqa: E402
from attnx import call_memo  # noqa: E402
from attnx.inputs import Inputs  # noqa: E402
from attnx.problem import make_call  # noqa: E402
from backends.torch import cpu as torch_cpu  # noqa: E402
from backends.torch.backend import BACKEND  # noqa: E402

LENGTHS = range(1000, 1101)


def parts(q, kv) -> dict:
    """Label -> f(step): each layer of the default call at step `step` of the loop."""
    problems = [make_call(q, k, v, wants_lse=False)[0] for k, v in kv]
    op = torch_cpu._flash_cpu()

    def op_checked(i):
        out, lse = op(q, *kv[i], 0.0, False)
        torch_cpu._suspect(lse)
        return out

    return {"sdpa": lambda i: F.scaled_dot_product_attention(q, *kv[i]),
            "op": lambda i: op(q, *kv[i], 0.0, False),
            "op + nan check": op_checked,
            "backend.forward": lambda i: BACKEND.forward(problems[i], Inputs(q, *kv[i])),
            "attention, seen": lambda i: attnx.attention(q, *kv[i]),
            "attention, new": lambda i: attnx.attention(q, *kv[i])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    random.seed(0)
    q = torch.randn(1, 8, 1, 64)
    k_cache, v_cache = torch.randn(1, 8, LENGTHS[-1], 64), torch.randn(1, 8, LENGTHS[-1], 64)
    kv = [(k_cache[:, :, :n], v_cache[:, :, :n]) for n in LENGTHS]
    calls = parts(q, kv)
    for i in range(len(kv)):  # warm: code paths, every length's Run
        for fn in calls.values():
            fn(i)
    times = {label: [] for label in calls}
    labels = list(calls)
    now = time.thread_time
    end, r = time.perf_counter() + args.seconds, 0
    while time.perf_counter() < end:
        i = r % len(kv)
        random.shuffle(labels)
        for label in labels:
            saved = None
            if label == "attention, new":  # this step's signature forgotten, the other steps' kept
                saved = dict(call_memo._memo)
                call_memo._memo.clear()
            start = now()
            calls[label](i)
            times[label].append((now() - start) * 1e6)
            if saved is not None:
                call_memo._memo.clear()
                call_memo._memo.update(saved)
        r += 1
    sdpa = statistics.median(times["sdpa"])
    print(f"{r} rounds, thread CPU time, µs per call (median); one torch thread")
    print("| layer | µs | minus sdpa | sdpa / this |")
    print("|---|---|---|---|")
    for label, t in times.items():
        m = statistics.median(t)
        print(f"| {label} | {m:.1f} | {m - sdpa:+.1f} | {sdpa / m:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
