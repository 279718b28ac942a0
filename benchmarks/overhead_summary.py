"""Medians over repeated runs of benchmarks/overhead.py: one noisy machine needs several runs.

Each run folder holds the overhead.json that `overhead.py --out` wrote. Runs are grouped by a
label (``before=DIR,DIR after=DIR,DIR``); per group and row it reports the median over the runs
and the range (min-max) of each figure and of the SDPA/attnx speed ratio (1.0 = as fast as SDPA).

    python benchmarks/overhead_summary.py before=r/b1,r/b2 after=r/a1,r/a2 > summary.md
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def rows(record: dict) -> dict:
    """Row label -> (attnx µs, SDPA µs or None) of one run."""
    out = {f"attnx work, {row['case']}": (row["overhead_us"], None) for row in record["dispatch_only"]}
    for row in record["real_calls"]:
        out[f"{row['shape']}: attnx vs SDPA"] = (row["attnx_us"], row["sdpa_us"])
        out[f"{row['shape']}: plan.run vs SDPA"] = (row["plan_run_us"], row["sdpa_us"])
        out[f"{row['shape']}: backend alone vs SDPA"] = (row["backend_direct_us"], row["sdpa_us"])
    grow = record["growing_decode"]
    out["decode loop, Sk growing (median step): attnx vs SDPA"] = (grow["attnx"]["median_us"],
                                                                   grow["sdpa"]["median_us"])
    return out


def _spread(values: list) -> str:
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def summary(groups: dict) -> str:
    """Markdown: one table row per (row label, group)."""
    lines = ["| row | runs | attnx µs, median (range) | SDPA µs | SDPA / attnx (1.0 = as fast) |", "|---|---|---|---|---|"]
    per_group = {label: [rows(json.loads((Path(d) / "overhead.json").read_text())) for d in dirs]
                 for label, dirs in groups.items()}
    labels = list(next(iter(per_group.values()))[0])
    for row in labels:
        for label, runs in per_group.items():
            pairs = [run[row] for run in runs if row in run]
            ours = [a for a, _ in pairs]
            if pairs[0][1] is None:
                lines.append(f"| {row} | {label}: {len(pairs)} | {_spread(ours)} | — | — |")
                continue
            theirs = [b for _, b in pairs]
            ratios = [b / a for a, b in pairs]
            lines.append(f"| {row} | {label}: {len(pairs)} | {_spread(ours)} | {_spread(theirs)} | "
                         f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    groups = {}
    for arg in args:
        label, _, dirs = arg.partition("=")
        if not dirs:
            raise SystemExit(f"expected LABEL=DIR[,DIR...], got {arg!r}")
        groups[label] = dirs.split(",")
    if not groups:
        raise SystemExit(__doc__)
    print(summary(groups), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
