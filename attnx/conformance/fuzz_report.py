"""The fuzzer's reports (`python -m attnx.conformance.fuzz --report DIR`): every problem, the feature
coverage and the shrunk failures as regression records, as json and markdown."""
from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import math
import pathlib
import platform
import sys
from typing import TYPE_CHECKING, Iterable

import torch

import attnx

from .cases import Case
from .check import Result
from .known_issues import KNOWN_ISSUES, known_issue
from .regressions import regression_record

if TYPE_CHECKING:
    from .fuzz import FuzzRun


def coverage(cases: Iterable[Case]) -> dict:
    """How many problems exercised each feature value."""
    tally: collections.Counter = collections.Counter()
    for c in cases:
        tally[f"dtype {c.dtype}"] += 1
        tally[f"format {c.q_format}/{c.kv_format}"] += 1
        tally[f"layout {c.layout}"] += 1
        tally[f"memory {c.memory}"] += 1
        tally["gradients" if c.grad else "forward only"] += 1
        zero = [n for n in ("batch", "heads_q", "seqlen_q", "seqlen_k") if getattr(c, n) == 0]
        if zero:
            tally["zero-size " + zero[0]] += 1
        if c.heads_kv and c.heads_q != c.heads_kv:
            tally[f"GQA ratio {c.heads_q // c.heads_kv}"] += 1
        if c.head_dim != c.head_dim_v:
            tally["Dv != D"] += 1
        for label, d in (("D", c.head_dim), ("Dv", c.head_dim_v)):
            tally[f"{label} " + next(b for b, top in (("1-8", 8), ("9-32", 32), ("33-64", 64), ("65-128", 128),
                                                       ("129-256", 256), (">256", math.inf)) if d <= top)] += 1
        longest = max(c.seqlen_q, c.seqlen_k)
        tally["S " + next(b for b, top in (("0", 0), ("1-16", 16), ("17-64", 64), ("65-256", 256), (">256", math.inf))
                          if longest <= top)] += 1
        tally["Sq > Sk" if c.seqlen_q > c.seqlen_k else "Sq <= Sk"] += 1
        for flag in ("causal", "sinks", "nan", "large_logits", "masked_rows", "mask_grad"):
            if getattr(c, flag):
                tally[flag] += 1
        if c.window is not None:
            tally["window " + "/".join("N" if w is None else ("0" if w == 0 else "k") for w in c.window)] += 1
        if c.offset is not None:
            tally["offset " + ("0" if c.offset == 0 else "<0" if c.offset < 0 else ">0")] += 1
        if c.mask:
            tally[f"{c.mask} mask {c.mask_shape}"] += 1
        if c.mask_dtype:
            tally["mask dtype differs"] += 1
        if c.alibi:
            tally[f"alibi {c.alibi}"] += 1
        if c.softcap is not None:
            tally["softcap"] += 1
        if c.scale is not None:
            tally["explicit scale"] += 1
        if c.page_size is not None:
            tally["page size 1" if c.page_size == 1 else "page size > 1"] += 1
    return dict(sorted(tally.items()))


def _worst(result: Result) -> tuple[float, str]:
    ratios = [(result.errors[n] / result.bounds[n] if result.bounds[n] > 0 else math.inf, n)
              for n in result.errors if n in result.bounds]
    return max(ratios) if ratios else (0.0, "")


def _num(x: float):
    return x if math.isfinite(x) else str(x)


def meta(run: FuzzRun, count: int) -> dict:
    return {"backend": run.backend, "device": run.device, "seed": run.seed, "count": count,
            "space": dataclasses.asdict(run.space), "seconds": round(run.seconds, 2), "stopped": run.stopped,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "attnx": attnx.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name() if run.device.startswith("cuda") and torch.cuda.is_available()
            else None, "command": " ".join(sys.argv) if sys.argv and sys.argv[0].endswith("fuzz.py") else None}


def report_json(run: FuzzRun, count: int) -> dict:
    rows = []
    for r in run.results:
        ratio, name = _worst(r)
        row = {"id": r.case.key, "status": r.status, "worst": name, "ratio": _num(round(ratio, 4)),
               "seconds": round(r.seconds, 3)}
        if r.status != "pass":
            issue = known_issue(r)
            row["known"] = issue.tag if issue else None
            row["detail"] = r.as_dict()
        rows.append(row)
    regressions = [regression_record(run.backend, f.minimal, seed=run.seed, original=f.original)
                   for f in run.findings]
    return {"meta": meta(run, count), "summary": run.counts,
            "known_issues": {k.tag: k.summary for k in KNOWN_ISSUES},
            "coverage": coverage(r.case for r in run.results if r.status != "declined"),
            "findings": [{"kinds": sorted(f.kinds), "shrink_steps": f.shrink_steps,
                          "shrink_seconds": round(f.shrink_seconds, 1), "minimal": f.minimal.as_dict(),
                          "original": f.original.as_dict()} for f in run.findings],
            "regressions": regressions, "results": rows}


def report_markdown(run: FuzzRun, count: int) -> str:
    m, c = meta(run, count), run.counts
    lines = [f"# attnx fuzz: {run.backend} on {run.device}", "",
             f"{c['problems']} problems (seed {run.seed}, space `{run.space.name}`: {run.space.describe()}): "
             f"{c['pass']} pass, {c['fail']} fail ({c['new']} new, {c['known']} explained by known issues), "
             f"{c['declined']} declined, in {run.seconds:.1f} s "
             f"({m['date']}; torch {m['torch']}{', ' + m['gpu'] if m['gpu'] else ''}).", ""]
    if run.stopped:
        lines += [f"Stopped early: {run.stopped}.", ""]
    lines += ["Each problem: out, lse and every gradient against the float64 formula, bounds of "
              "docs/semantics.md (Accuracy); NaN where the formula is finite never passes.", ""]
    if run.findings:
        lines += ["## Shrunk failures", ""]
        for f in run.findings:
            lines.append(f"- `{f.minimal.case.id}` ({f.shrink_steps} shrink steps): "
                         + " | ".join(x.splitlines()[0] for x in f.minimal.failures))
            lines.append(f"  - first seen as `{f.original.case.id}`: "
                         + " | ".join(x.splitlines()[0] for x in f.original.failures))
        lines.append("")
    failed = run.new_failures()
    if failed:
        lines += [f"## New failures ({len(failed)})", ""]
        lines += [f"- `{r.case.key}`: " + " | ".join(x.splitlines()[0] for x in r.failures) for r in failed[:200]]
        lines.append("")
    if c["known"]:
        lines += [f"## Failures explained by known issues ({c['known']})", ""]
        for issue in KNOWN_ISSUES:
            hits = [r for r in run.results if known_issue(r) is issue]
            if hits:
                lines.append(f"- **{issue.tag}** ({len(hits)}): {issue.summary}; e.g. `{hits[0].case.key}`: "
                             + " | ".join(x.splitlines()[0] for x in hits[0].failures))
        lines.append("")
    declined = [r for r in run.results if r.status == "declined"]
    if declined:
        reasons = collections.Counter("; ".join(r.reasons) for r in declined)
        lines += ["## Declined (not counted)", ""] + [f"- {n} x {why}" for why, n in reasons.most_common()] + [""]
    lines += ["## Coverage", "", "| feature | problems |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in coverage(r.case for r in run.results if r.status != "declined").items()]
    ranked = sorted((r for r in run.results if r.status == "pass"), key=lambda r: -_worst(r)[0])[:15]
    lines += ["", "## Closest to the bound", "", "| problem | quantity | error / bound |", "| --- | --- | --- |"]
    lines += [f"| `{r.case.key}` | {_worst(r)[1]} | {_worst(r)[0]:.3f} |" for r in ranked]
    slow = sorted(run.results, key=lambda r: -r.seconds)[:5]
    lines += ["", "## Slowest", ""] + [f"- `{r.case.key}`: {r.seconds:.2f} s" for r in slow]
    return "\n".join(lines) + "\n"


def write_report(run: FuzzRun, count: int, directory) -> tuple[pathlib.Path, pathlib.Path]:
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"fuzz-{run.backend}-{run.device.replace(':', '')}-seed{run.seed}"
    md, js = directory / f"{stem}.md", directory / f"{stem}.json"
    md.write_text(report_markdown(run, count))
    js.write_text(json.dumps(report_json(run, count), indent=1))
    return md, js
