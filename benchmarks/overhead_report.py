"""The overhead benchmark's record as markdown (written to overhead.md and printed)."""
from __future__ import annotations

from .report import dict_table

GROWING = (("null", "attnx, do-nothing backend"), ("attnx", "attnx, dispatcher's pick"), ("sdpa", "torch SDPA"))


def _pairs(prefix: str, values: dict) -> str:
    return ", ".join(f"{prefix}{key}: {us}" for key, us in values.items())


def markdown(r: dict) -> str:
    own = [row["overhead_us"] for row in r["dispatch_only"]]
    verdict = "met" if max(own) < r["target_us"] else "NOT met"
    lines = [f"# attnx per-call overhead — {r['cpu']} — {r['date']}", "",
             f"torch {r['torch']}, attnx {r['attnx']}; {r['statistic']}; load average at the start "
             f"{r['load_average']}. Microseconds per call.", "",
             f"## (a) attnx's own work around a do-nothing backend (its call, {r['backend_call_us']} µs, subtracted)",
             ""]
    lines += dict_table([{"call": row["case"], "µs per call": row["us_per_call"], "attnx µs": row["overhead_us"]}
                         for row in r["dispatch_only"]])
    lines += [f"Cached decision: {min(own)} - {max(own)} µs of attnx work per call (target < {r['target_us']:.0f} "
              f"µs: {verdict}).", "",
              "## (b, d) real calls: attnx (dispatcher's pick), a plan, the picked backend alone, torch SDPA", ""]
    lines += dict_table([{"shape": row["shape"], "picked": row["picked"], "attnx": row["attnx_us"],
                          "plan.run": row["plan_run_us"], "backend alone": row["backend_direct_us"],
                          "torch SDPA": row["sdpa_us"], "attnx - backend": row["attnx_overhead_us"],
                          "plan - backend": row["plan_overhead_us"], "attnx - SDPA": row["attnx_minus_sdpa_us"]}
                         for row in r["real_calls"]])
    g = r["growing_decode"]
    lo, hi = g["lengths"]
    lines += [f"## (c) decode steps, Sk = {lo}..{hi}, one key more per call (B=1 H=8 Sq=1 D=64; pick: "
              f"{g['picked']})", "",
              f"One call per length, each sweep on a fresh dispatch cache; per length the median over {g['sweeps']} "
              "sweeps, then the median (p90) over the lengths. The priority order is cached per power-of-two "
              "length bucket and each new length asks it from the top (the chosen backend and any above it).", ""]
    rows = []
    for name, label in GROWING:
        s = g[name]
        rows.append({"calls": label, "median": s["median_us"], "p90": s["p90_us"],
                     "median by length bucket": _pairs("≤", s["median_us_by_bucket"]),
                     "first call of a bucket": _pairs("Sk=", s["first_call_of_bucket_us"]),
                     "backend asks per sweep": "—" if name == "sdpa" else s["backend_asks_per_sweep"]})
    return "\n".join(lines + dict_table(rows))
