"""Conformance reports: a markdown table for people and JSON for tools."""
from __future__ import annotations

import collections
import json
import pathlib
import platform

import torch

import attnx

from .check import Result


def counts(results: list[Result]) -> dict:
    tally = collections.Counter(r.status for r in results)
    found = {"cases": len(results), "pass": tally["pass"], "fail": tally["fail"], "declined": tally["declined"]}
    if tally["ran"]:  # --calls-only: made the calls, compared nothing
        found["ran"] = tally["ran"]
    return found


def report_paths(path) -> tuple[pathlib.Path, pathlib.Path]:
    """PATH -> (PATH.md, PATH.json); a trailing .md or .json on PATH is dropped first."""
    path = pathlib.Path(path)
    if path.suffix in (".md", ".json"):
        path = path.with_suffix("")
    return path.with_name(path.name + ".md"), path.with_name(path.name + ".json")


def _meta(backend: str, profile: str, device: str, seconds: float) -> dict:
    return {"backend": backend, "profile": profile, "device": device, "seconds": round(seconds, 2),
            "attnx": attnx.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else None}


def write_json(results: list[Result], path, meta: dict) -> None:
    payload = {"meta": meta, "summary": counts(results), "results": [r.as_dict() for r in results]}
    pathlib.Path(path).write_text(json.dumps(payload, indent=1))


def _fmt(x: float) -> str:
    return f"{x:.2e}"


def markdown(results: list[Result], meta: dict) -> str:
    c = counts(results)
    lines = [f"# attnx conformance: {meta['backend']} ({meta['profile']}, {meta['device']})", "",
             f"{c['cases']} cases: {c['pass']} pass, {c['fail']} fail, {c['declined']} declined "
             f"in {meta['seconds']:.1f} s (torch {meta['torch']}{', ' + meta['gpu'] if meta.get('gpu') else ''}).", ""]
    failed = [r for r in results if r.status == "fail"]
    if failed:
        lines += ["## Failures", ""]
        lines += [f"- `{r.case.id}`: " + " | ".join(f.splitlines()[0] for f in r.failures) for r in failed]
        lines.append("")
    lines += ["## Cases", "", "Errors are max abs errors vs float64; each cell is `error / bound` (`(2x naive)`: a float32 "
              "bound of 2 x the naive backend's error on the same inputs).", "",
              "| case | status | out | lse | dq | dk | dv | dmask | s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        cells = []
        for name in ("out", "lse", "dq", "dk", "dv", "dmask"):
            rule = f" ({r.bound_rules[name]})" if name in r.bound_rules else ""  # float32: 2 x naive's error or its rounding
            cells.append(f"{_fmt(r.errors[name])} / {_fmt(r.bounds[name])}{rule}" if name in r.errors else "")
        status = r.status if r.status != "declined" else "declined: " + "; ".join(r.reasons)
        lines.append(f"| `{r.case.id}` | {status} | " + " | ".join(cells) + f" | {r.seconds:.2f} |")
    return "\n".join(lines) + "\n"


def write_reports(results: list[Result], path, meta: dict) -> tuple[pathlib.Path, pathlib.Path]:
    md_path, json_path = report_paths(path)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(markdown(results, meta))
    write_json(results, json_path, meta)
    return md_path, json_path
