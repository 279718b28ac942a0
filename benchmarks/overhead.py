"""Per-call cost of `attnx.attention` on the CPU, as users see it. Medians in µs.

(a) attnx's own work (validation, cached dispatch, autograd wiring) around a do-nothing
    backend registered for the run with `attnx.registered`;
(b) real small calls through attnx beside `torch.nn.functional.scaled_dot_product_attention`
    and beside the picked backend's `forward` called directly (attnx's share of the call);
(c) decode steps with a growing key length (Sk = 1000..1100, one key more per call, each sweep
    on a fresh dispatch cache): the priority order is kept per power-of-two length bucket and each
    new length asks it from the top (the chosen backend and any above it that decline), so the
    per-call cost stays flat;
(d) `attnx.plan(...)` once, then `plan.run(...)` per call.

    python benchmarks/overhead.py --out benchmarks/results/cpu-$(date -u +%F)   # --clock wall on a quiet machine
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/overhead.py`: import the package from the repo root
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attnx  # noqa: E402
from attnx.problem import length_bucket  # noqa: E402
from benchmarks.overhead_report import markdown  # noqa: E402
from benchmarks.probes import CLOCKS, NullBackend, SpyBackend, one_call_us, per_call_us  # noqa: E402

TARGET_US = 20.0
SHAPES = {"B=1 H=8 S=128 D=64": (1, 8, 128, 128, 64), "decode B=1 H=8 Sq=1 Sk=4096 D=64": (1, 8, 1, 4096, 64)}


def _qkv(b, h, sq, sk, d):
    return torch.randn(b, h, sq, d), torch.randn(b, h, sk, d), torch.randn(b, h, sk, d)


def dispatch_only(timing: dict) -> tuple[float, list[dict]]:
    """(a): attnx around a do-nothing backend; the backend's own call is subtracted."""
    q, k, v = _qkv(1, 8, 128, 128, 64)
    qg = q.clone().requires_grad_()
    mask = torch.rand(128, 128) > 0.1
    null = NullBackend(torch.randn_like(q), torch.randn(1, 8, 128), attnx.Grads(*(torch.randn_like(q),) * 3))
    p, x = attnx.make_call(q, k, v)
    with attnx.registered(null):
        name = null.name
        step = attnx.plan(q, k, v, backend=name)
        cases = {
            "plain `attention(q, k, v, backend=...)`": lambda: attnx.attention(q, k, v, backend=name),
            "`causal=True` and a bool mask": lambda: attnx.attention(q, k, v, causal=True, mask=mask, backend=name),
            "`layout=\"bshd\"`": lambda: attnx.attention(q, k, v, layout="bshd", backend=name),
            "`q.requires_grad` (autograd Function)": lambda: attnx.attention(qg, k, v, backend=name),
            "`plan.run(q, k, v)`": lambda: step.run(q, k, v),
        }
        measured = per_call_us({"backend": lambda: null.forward(p, x), **cases}, **timing)
        with attnx.use_backend(name):
            measured.update(per_call_us({"inside `use_backend(...)`": lambda: attnx.attention(q, k, v)}, **timing))
    base = measured.pop("backend")["median_us"]
    return base, [{"case": label, "us_per_call": m["median_us"], "min_us": m["min_us"],
                   "overhead_us": round(m["median_us"] - base, 2)} for label, m in measured.items()]


def real_calls(timing: dict) -> list[dict]:
    """(b) and (d): attnx (dispatcher's pick), its plan, the picked backend directly, torch SDPA."""
    rows = []
    for label, (b, h, sq, sk, d) in SHAPES.items():
        q, k, v = _qkv(b, h, sq, sk, d)
        picked = attnx.explain(q, k, v).chosen
        backend = attnx.get_backend(picked)
        p, x = attnx.make_call(q, k, v)
        step = attnx.plan(q, k, v)
        m = per_call_us({"attnx": lambda: attnx.attention(q, k, v), "plan": lambda: step.run(q, k, v),
                         "direct": lambda: backend.forward(p, x),
                         "sdpa": lambda: F.scaled_dot_product_attention(q, k, v)}, **timing)
        med = {key: val["median_us"] for key, val in m.items()}
        rows.append({"shape": label, "picked": picked, "attnx_us": med["attnx"], "plan_run_us": med["plan"],
                     "backend_direct_us": med["direct"], "sdpa_us": med["sdpa"],
                     "attnx_overhead_us": round(med["attnx"] - med["direct"], 2),
                     "plan_overhead_us": round(med["plan"] - med["direct"], 2),
                     "attnx_minus_sdpa_us": round(med["attnx"] - med["sdpa"], 2),
                     "min_us": {key: val["min_us"] for key, val in m.items()}})
    return rows


def growing_decode(lengths: range, sweeps: int, clock: str) -> dict:
    """(c): one call per length, Sk growing by one; each sweep starts on a fresh dispatch cache.

    Registering a probe changes the registry, which retires every cached decision, and the
    probe counts the dispatcher's questions: one per cache miss.
    """
    q = torch.randn(1, 8, 1, 64)
    k_cache, v_cache = torch.randn(1, 8, lengths[-1], 64), torch.randn(1, 8, lengths[-1], 64)
    kv = {sk: (k_cache[:, :, :sk], v_cache[:, :, :sk]) for sk in lengths}  # the cache's first sk keys (views)
    calls = {"null": lambda sk: attnx.attention(q, *kv[sk], backend=NullBackend.name),
             "attnx": lambda sk: attnx.attention(q, *kv[sk]),
             "sdpa": lambda sk: F.scaled_dot_product_attention(q, *kv[sk])}

    def probe(name):  # a forced backend is the only one asked; otherwise the spy is asked first
        return NullBackend(torch.randn_like(q), torch.randn(1, 8, 1), attnx.Grads()) if name == "null" else SpyBackend()

    times = {name: {sk: [] for sk in lengths} for name in calls}
    asks = {name: [] for name in calls}
    with attnx.registered(probe("null")):
        for sk in lengths[:20]:  # warm the code paths (not the cache: each sweep starts cold)
            for call in calls.values():
                call(sk)
    for _ in range(sweeps):
        for name, call in calls.items():
            with attnx.registered(probe(name)) as counter:
                for sk in lengths:
                    times[name][sk].append(one_call_us(lambda: call(sk), clock))
            asks[name].append(counter.asks)
    out = {"lengths": [lengths[0], lengths[-1]], "sweeps": sweeps,
           "picked": attnx.explain(q, k_cache[:, :, :lengths[0]], v_cache[:, :, :lengths[0]]).chosen}
    for name in calls:
        out[name] = _summary({sk: statistics.median(t) for sk, t in times[name].items()}, asks[name])
    return out


def _summary(per_length: dict, asks: list) -> dict:
    """Medians over the lengths, per length bucket, and the first call of each bucket (a cache miss)."""
    values = list(per_length.values())
    buckets: dict = {}
    for sk, us in per_length.items():
        buckets.setdefault(length_bucket(sk), []).append((sk, us))
    return {"median_us": round(statistics.median(values), 2),
            "p90_us": round(statistics.quantiles(values, n=10)[-1], 2), "max_us": round(max(values), 2),
            "median_us_by_bucket": {b: round(statistics.median(us for _, us in v), 2) for b, v in buckets.items()},
            "first_call_of_bucket_us": {v[0][0]: round(v[0][1], 2) for v in buckets.values()},
            "backend_asks_per_sweep": statistics.median(asks),
            "per_length_us": {sk: round(us, 2) for sk, us in per_length.items()}}

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for overhead.json and overhead.md")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's choice)")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="thread",
                        help="thread: CPU time of this thread (other load does not count); wall: elapsed time")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--seconds", type=float, default=0.05, help="per repeat and function")
    parser.add_argument("--sweeps", type=int, default=25, help="growing-Sk sweeps (c)")
    parser.add_argument("--quick", action="store_true", help="a few repeats only (smoke test)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    timing = ({"seconds": 0.002, "repeats": 2, "warmup": 3} if args.quick
              else {"seconds": args.seconds, "repeats": args.repeats})
    timing["clock"] = args.clock
    sweeps = 1 if args.quick else args.sweeps
    torch.manual_seed(0)
    load = [round(x, 2) for x in os.getloadavg()]  # other work on the machine shows up as noise
    base, dispatch = dispatch_only(timing)
    real = real_calls(timing)
    growing = growing_decode(range(1000, 1101), sweeps, args.clock)
    record = {"date": datetime.date.today().isoformat(), "machine": platform.platform(), "load_average": load,
              "cpu": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread(s)",
              "torch": torch.__version__, "attnx": attnx.__version__, "target_us": TARGET_US,
              "statistic": f"{args.clock} clock; median of {timing['repeats']} interleaved repeats of "
                           f"~{timing['seconds']} s each (growing Sk: median over {sweeps} sweeps of single calls)",
              "backend_call_us": base, "dispatch_only": dispatch, "real_calls": real, "growing_decode": growing}
    print(markdown(record))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "overhead.json").write_text(json.dumps(record, indent=1) + "\n")
        (args.out / "overhead.md").write_text(markdown(record))
        print(f"wrote {args.out / 'overhead.json'} and {args.out / 'overhead.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
