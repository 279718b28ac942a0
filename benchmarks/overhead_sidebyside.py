"""Default `attnx.attention` beside the best of {every attnx backend, every torch SDPA kernel}, CPU.

The speed target of the drop-in work: on every row, the default call at least 0.98x the fastest
way to compute the same function. Each row's candidates are the default call, the call forced
onto each attnx backend that accepts the problem, and `F.scaled_dot_product_attention` as is and
inside `sdpa_kernel(...)` for each CPU kernel (flash, math). Candidates run as single calls in a
fresh random order every round, so each call follows some other kernel (caches as cold as in a
model) and load changes hit all alike; a cell is the median over the rounds (thread CPU time by
default: time other processes take from this thread does not count). A short screening pass runs
every candidate first; those more than `SCREEN_MARGIN` slower than the fastest there (naive,
blocked and SDPA's math kernel, by 1.6x or more) keep their screening medians and stay out of the
main rounds, so that their large buffers do not evict the caches the close candidates are timed
on. The ratio is best / default (1.0 = as fast as the best); its range is that ratio over five
consecutive slices of the main rounds.

Rows: a small call, a decode step, two decode loops whose key length grows by one per step
(every step a new signature: the first time each length is seen, and lengths seen before, as
a server sees them again for the next request), and four larger calls.

    python benchmarks/overhead_sidebyside.py --out benchmarks/results/cpu-$(date -u +%F)-overhead4
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/overhead_sidebyside.py`: import the package from the repo root
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import attnx  # noqa: E402
from attnx import call_memo  # noqa: E402
from benchmarks.probes import CLOCKS  # noqa: E402
from benchmarks.report import dict_table  # noqa: E402

SDPA_KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
TARGET = 0.98
GROWING = range(1000, 1101)   # key lengths of the decode loops (B=1 H=8 Sq=1 D=64)
# label: (B, H, Sq, Sk, D, causal), seconds of rounds
ROWS = {"B=1 H=8 S=128 D=64": ((1, 8, 128, 128, 64, False), 40),
        "decode B=1 H=8 Sq=1 Sk=4096 D=64": ((1, 8, 1, 4096, 64, False), 40),
        "B=2 H=4 S=512 D=64": ((2, 4, 512, 512, 64, False), 30),
        "B=2 H=4 S=512 D=64 causal": ((2, 4, 512, 512, 64, True), 30),
        "B=8 H=4 S=1024 D=64": ((8, 4, 1024, 1024, 64, False), 40),
        "B=8 H=4 S=1024 D=64 causal": ((8, 4, 1024, 1024, 64, True), 40)}
SCREEN_SHARE = 0.15   # of a row's seconds, for the screening pass
SCREEN_MARGIN = 1.25  # candidates slower than this times the fastest in screening leave the main rounds
NAIVE_MAX_SCORES = 1 << 22  # naive forms B*H*Sq*Sk scores: slower than the rest by far beyond this


def _sdpa(kernel=None, causal=False):
    if kernel is None:
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def call(q, k, v):
        with sdpa_kernel(kernel):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return call


def candidates(q, k, v, causal: bool) -> dict:
    """Label -> f(q, k, v): the default call, each accepting attnx backend, each SDPA kernel.

    SDPA's ``is_causal`` is top-left; attnx's ``causal`` bottom-right: the same function only when
    Sq == Sk (every causal row here)."""
    out = {"attnx": lambda q, k, v: attnx.attention(q, k, v, causal=causal)}
    reasons = attnx.explain(q, k, v, causal=causal).reasons
    b, h, sq, _ = q.shape
    for name, why in reasons.items():
        if not why and not (name == "naive" and b * h * sq * k.shape[2] > NAIVE_MAX_SCORES):
            out[f"attnx[{name}]"] = (lambda name: lambda q, k, v: attnx.attention(q, k, v, causal=causal,
                                                                                    backend=name))(name)
    out["sdpa"] = _sdpa(None, causal)
    for label, kernel in SDPA_KERNELS.items():
        out[f"sdpa[{label}]"] = _sdpa(kernel, causal)
    return out


def rounds(calls: dict, args_of, seconds: float, clock: str, max_rounds: int = 100000) -> dict:
    """Label -> list of µs per single call, one per round (a round calls each once, shuffled)."""
    now = CLOCKS[clock]
    labels = list(calls)
    times = {label: [] for label in labels}
    for label in labels:  # warm: code paths, the dispatch cache, the call memo
        for _ in range(3):
            calls[label](*args_of(0))
    end = time.perf_counter() + seconds
    r = 0
    while time.perf_counter() < end and r < max_rounds:
        args = args_of(r)
        random.shuffle(labels)
        for label in labels:
            fn = calls[label]
            start = now()
            fn(*args)
            times[label].append((now() - start) * 1e6)
        r += 1
    return times


def screened_rounds(calls: dict, args_of, seconds: float, clock: str) -> tuple[dict, dict]:
    """(main-round times of the close candidates, screening medians of the others)."""
    screen = rounds(calls, args_of, seconds * SCREEN_SHARE, clock)
    med = {label: statistics.median(t) for label, t in screen.items()}
    fastest = min(med.values())
    close = {label: fn for label, fn in calls.items()
             if label in ("attnx", "sdpa") or med[label] <= SCREEN_MARGIN * fastest}
    far = {label: m for label, m in med.items() if label not in close}
    return rounds(close, args_of, seconds * (1 - SCREEN_SHARE), clock), far


def summarise(timed: tuple) -> dict:
    """Medians, the best other candidate, and best / default overall and over five slices of the rounds."""
    times, far = timed
    med = {label: statistics.median(t) for label, t in times.items()}
    others = {label: m for label, m in med.items() if label != "attnx"}
    best = min(others, key=others.get)
    n = len(times["attnx"])
    cuts = [round(i * n / 5) for i in range(6)]
    slices = [statistics.median(times[best][a:b]) / statistics.median(times["attnx"][a:b])
              for a, b in zip(cuts, cuts[1:]) if b > a]
    return {"rounds": n, "median_us": {label: round(m, 2) for label, m in med.items()},
            "screened_out_median_us": {label: round(m, 2) for label, m in far.items()}, "best": best,
            "ratio": round(med[best] / med["attnx"], 4),
            "ratio_range": [round(min(slices), 4), round(max(slices), 4)],
            "sdpa_ratio": round(med["sdpa"] / med["attnx"], 4)}


def dense_row(shape: tuple, seconds: float, clock: str) -> dict:
    b, h, sq, sk, d, causal = shape
    q, k, v = torch.randn(b, h, sq, d), torch.randn(b, h, sk, d), torch.randn(b, h, sk, d)
    picked = attnx.explain(q, k, v, causal=causal).chosen
    return {"picked": picked, **summarise(screened_rounds(candidates(q, k, v, causal), lambda r: (q, k, v), seconds, clock))}


def growing_row(seconds: float, clock: str, first_time: bool) -> dict:
    """A decode step whose Sk grows by one per step over `GROWING`, views of one cache (a new signature
    each step). `first_time`: the call memo is emptied at the start of each sweep, so every attnx call
    validates in full, as in one generation; otherwise lengths were seen before (a later request)."""
    q = torch.randn(1, 8, 1, 64)
    k_cache, v_cache = torch.randn(1, 8, GROWING[-1], 64), torch.randn(1, 8, GROWING[-1], 64)
    kv = [(k_cache[:, :, :sk], v_cache[:, :, :sk]) for sk in GROWING]

    def args_of(r):
        step = r % len(kv)
        if first_time and step == 0:
            call_memo.clear()
        return (q, *kv[step])
    calls = candidates(q, *kv[0], False)
    picked = attnx.explain(q, *kv[0]).chosen
    return {"picked": picked, **summarise(screened_rounds(calls, args_of, seconds, clock))}


def markdown(record: dict) -> str:
    lines = [f"# Default `attnx.attention` beside the best candidate — {record['cpu']} — {record['date']}", "",
             f"torch {record['torch']}, attnx {record['attnx']}; {record['statistic']}; load average at the "
             f"start {record['load_average']}, at the end {record['load_average_end']}. Microseconds per call; "
             f"ratio = best / default (target >= {TARGET}); range = the ratio over five slices of the rounds.",
             ""]
    rows = []
    for label, r in record["rows"].items():
        m = r["median_us"]
        rows.append({"row": label, "pick": r["picked"], "attnx": m["attnx"], "best other": f"{r['best']} {m[r['best']]}",
                     "best / attnx": r["ratio"], "range": f"{r['ratio_range'][0]}-{r['ratio_range'][1]}",
                     "SDPA / attnx": r["sdpa_ratio"], "met": "yes" if r["ratio"] >= TARGET else "no",
                     "rounds": r["rounds"]})
    lines += dict_table(rows)
    lines += ["## Every candidate (median µs; in parentheses: screening pass only, too slow for the main rounds)", ""]
    lines += dict_table([{"row": label, **r["median_us"], **{k: f"({m})" for k, m in r["screened_out_median_us"].items()}}
                         for label, r in record["rows"].items()])
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for sidebyside.json and sidebyside.md")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's choice)")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="thread",
                        help="thread: CPU time of this thread (other load does not count); wall: elapsed time")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every row's seconds")
    parser.add_argument("--rows", nargs="*", default=None, help="labels (substrings) of the rows to run")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    random.seed(0)
    load = [round(x, 2) for x in os.getloadavg()]
    plan = {label: (lambda shape=shape, s=s: dense_row(shape, s * args.scale, args.clock))
            for label, (shape, s) in ROWS.items()}
    grow = "decode loop B=1 H=8 Sq=1 D=64, Sk 1000..1100 growing by one"
    plan = {**dict(list(plan.items())[:2]),
            f"{grow}, each length the first time": lambda: growing_row(60 * args.scale, args.clock, True),
            f"{grow}, lengths seen before": lambda: growing_row(40 * args.scale, args.clock, False),
            **dict(list(plan.items())[2:])}
    results = {}
    for label, run in plan.items():
        if args.rows and not any(part in label for part in args.rows):
            continue
        results[label] = run()
        r = results[label]
        print(f"{label}: attnx {r['median_us']['attnx']} µs, best {r['best']} {r['median_us'][r['best']]} µs, "
              f"ratio {r['ratio']} ({r['ratio_range'][0]}-{r['ratio_range'][1]})", flush=True)
    record = {"date": datetime.date.today().isoformat(), "utc": datetime.datetime.utcnow().strftime("%H:%M"),
              "machine": platform.platform(), "load_average": load,
              "load_average_end": [round(x, 2) for x in os.getloadavg()],
              "cpu": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread(s)",
              "torch": torch.__version__, "attnx": attnx.__version__,
              "statistic": f"{args.clock} clock; single calls, all candidates once per round in a random order; "
                           "median over the rounds",
              "command": "python benchmarks/overhead_sidebyside.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "rows": results}
    print(markdown(record))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sidebyside.json").write_text(json.dumps(record, indent=1) + "\n")
        (args.out / "sidebyside.md").write_text(markdown(record) + "\n")
        print(f"wrote {args.out / 'sidebyside.json'} and {args.out / 'sidebyside.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
