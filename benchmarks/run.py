"""Run every available attnx backend beside torch's attention, write tables, JSON and plots.

    python -m benchmarks.run                       # this machine's default settings
    python -m benchmarks.run --quick               # smoke run, < 1 minute on a 2-core CPU
    python benchmarks/run.py --setting paper --device cuda --out DIR --max-seconds 360

Results land in ``benchmarks/results/<device>-<date>/`` (results.json, results.md, *.png).
Running another setting into the same folder merges with the settings already there.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/run.py`: import the package from the repo root
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402

import attnx  # noqa: E402
from benchmarks import plots, report, settings  # noqa: E402
from benchmarks.peers import FlexPeer, all_peers, attnx_backend_names  # noqa: E402
from benchmarks.progress import Progress  # noqa: E402
from benchmarks.runner import Budget, Runner, dispatch_check  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    cpu = platform.processor() or platform.machine()
    return f"{cpu} CPU, {os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s)"


def device_slug(device: str) -> str:
    """'h200' for an NVIDIA H200, 'cpu' for the CPU: the results folder's prefix."""
    if device != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name().lower().replace("nvidia", "").strip()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-").split("-")[0] or "cuda"


def versions() -> str:
    from attnx.capability import package_version

    parts = [f"attnx {attnx.__version__}", f"torch {torch.__version__}"]
    if torch.version.cuda:
        parts.append(f"CUDA {torch.version.cuda}")
    for dist in ("triton", "cupy-cuda13x", "cupy-cuda12x"):
        if package_version(dist):
            parts.append(f"{dist} {package_version(dist)}")
    return ", ".join(parts)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument("--setting", action="append", choices=settings.SETTINGS,
                        help="setting to run (repeatable); default: paper+memory on cuda, cpu+memory on cpu")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny version of each setting (smoke test)")
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results/<device>-<date>)")
    parser.add_argument("--head-dims", default="128,64",
                        help="head dims of the paper/cpu settings, run in this order (e.g. 128,64,256)")
    parser.add_argument("--dtypes", default=None, help="dtypes of the paper/cpu settings (e.g. bf16,fp16)")
    parser.add_argument("--peers", default=None, help="only peers whose name contains one of these (comma list)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="wall-clock budget; points after it are recorded as skipped "
                             "(default: 540 on cuda, none on cpu; 0 = none)")
    parser.add_argument("--max-call-seconds", type=float, default=None,
                        help="skip a peer whose next call is expected to take longer (default 3 cuda, 30 cpu)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice; 1 with --quick, which is a smoke test)")
    parser.add_argument("--flex-static", action="store_true",
                        help="compile FlexAttention per shape (fastest kernels, long compiles) instead of dynamic")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--rebuild", type=Path, metavar="DIR",
                        help="measure nothing: rewrite DIR's results.md, dispatcher check and plots from its JSON")
    parser.add_argument("--repick", action="store_true",
                        help="with --rebuild: ask the current dispatcher again for its pick at every point "
                             "(run on the device the results came from)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    return args


def _merge_previous(json_path: Path, names: list[str]) -> tuple[list, list, dict]:
    """Rows of settings not rerun now, from a results.json already in the folder."""
    if not json_path.exists():
        return [], [], {}
    old = json.loads(json_path.read_text())
    keep = [r for r in old.get("rows", []) if r["setting"] not in names]
    picks = [p for p in old.get("picks", []) if p["setting"] not in names]
    commands = {k: v for k, v in old.get("meta", {}).get("commands", {}).items() if k not in names}
    return keep, picks, commands


def repick(picks: list[dict], device: str) -> list[dict]:
    """The dispatcher's pick for each point again, as the current attnx would decide it."""
    fresh = []
    for pick in picks:
        point = settings.Point(**{k: pick[k] for k in settings.Point.__dataclass_fields__})
        def shaped(heads, seqlen):  # zero-stride views: make_problem needs shapes, not memory
            one = torch.zeros((), dtype=point.torch_dtype, device=device)
            tensor = one.expand(point.batch, heads, seqlen, point.head_dim)
            return tensor.requires_grad_() if point.mode == "fwd+bwd" else tensor
        q, k, v = (shaped(point.heads_q, point.seqlen_q), shaped(point.heads_kv, point.seqlen_k),
                   shaped(point.heads_kv, point.seqlen_k))
        with torch.enable_grad():
            fresh.append({**pick, "picked": attnx.explain(q, k, v, causal=point.causal).chosen})
    return fresh


def rebuild(folder: Path, with_plots=True, refresh_picks=False) -> int:
    """Rewrite results.md, the dispatcher check and the plots of `folder` from its results.json."""
    data = json.loads((folder / "results.json").read_text())
    rows, picks, meta = data["rows"], data["picks"], data["meta"]
    if refresh_picks:
        picks = repick(picks, meta["device"])
    checks = dispatch_check(rows, picks)
    report.write_json(folder / "results.json", meta, rows, checks, picks)
    plot_paths = plots.make_plots(rows, folder, meta["device_name"]) if with_plots else []
    (folder / "results.md").write_text(report.markdown(meta, rows, checks, picks, [str(p) for p in plot_paths]))
    print(report.console_table(rows, checks))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rebuild:
        return rebuild(args.rebuild, not args.no_plots, args.repick)
    device = args.device
    threads = args.threads or (1 if args.quick else None)
    if threads:
        torch.set_num_threads(threads)
    names = args.setting or settings.default_settings(device)
    head_dims = tuple(int(d) for d in args.head_dims.split(","))
    dtypes = args.dtypes.split(",") if args.dtypes else None
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    out = args.out or RESULTS / f"{device_slug(device)}{'-quick' if args.quick else ''}-{date}"
    out.mkdir(parents=True, exist_ok=True)

    max_seconds = args.max_seconds if args.max_seconds is not None else (540.0 if device == "cuda" else None)
    default_call = {("cuda", True): 0.5, ("cuda", False): 3.0, ("cpu", True): 2.0, ("cpu", False): 30.0}
    max_call = args.max_call_seconds or default_call[(device, args.quick)]
    budget = Budget(max_seconds or None, max_call)

    peers = all_peers(device)
    FlexPeer.static_shapes = args.flex_static
    if args.peers:
        wanted = [w.strip() for w in args.peers.split(",") if w.strip()]
        peers = [p for p in peers if any(w in p.name for w in wanted)]
    points = [p for name in names for p in settings.build(name, device, args.quick, head_dims, dtypes)]
    print(f"attnx benchmarks on {device_name(device)}: settings {', '.join(names)}, {len(points)} points x "
          f"{len(peers)} methods ({', '.join(p.name for p in peers)}) -> {out}", file=sys.stderr)

    progress = Progress(len(points) * len(peers), title="bench")
    runner = Runner(device, peers, budget, args.quick, progress)
    started = time.monotonic()
    runner.run(points)
    progress.close()

    old_rows, old_picks, commands = _merge_previous(out / "results.json", names)
    command = "python -m benchmarks.run " + " ".join(argv if argv is not None else sys.argv[1:])
    commands.update({name: command for name in names})
    rows, picks = old_rows + runner.rows, old_picks + runner.picks
    checks = dispatch_check(rows, picks)
    meta = {"device": device, "device_name": device_name(device), "date": date, "command": command.strip(),
            "commands": commands, "versions": versions(), "attnx_backends": attnx_backend_names(),
            "statistic": ("median of CUDA-event timings" if device == "cuda"
                          else "min of repeated runs (median also in JSON)"),
            "quick": args.quick, "seconds": round(time.monotonic() - started, 1),
            "load_average": [round(x, 2) for x in os.getloadavg()], "threads": torch.get_num_threads()}
    report.write_json(out / "results.json", meta, rows, checks, picks)
    plot_paths = [] if args.no_plots else plots.make_plots(rows, out, meta["device_name"])
    (out / "results.md").write_text(report.markdown(meta, rows, checks, picks, [str(p) for p in plot_paths]))
    print(report.console_table(runner.rows, dispatch_check(runner.rows, runner.picks)))
    print(f"wrote {out / 'results.md'}, {out / 'results.json'} and {len(plot_paths)} plots "
          f"in {meta['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
