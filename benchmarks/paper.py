"""Named attnx backends in the FlashAttention paper's setting, beside torch SDPA's kernels and FlexAttention.

bf16, hidden 2048 (H = 2048 / D), 16k tokens per batch (B = 16384 / S), S = 512..16k, causal or
not, forward and forward + backward; TFLOP/s = 4·B·H·S²·D / time, halved for causal, x3.5 with
the backward; the median of `triton.testing.do_bench` (L2 flushed before every call). Writes
OUT.json and OUT.md: the shared harness's rows, tables and dispatcher check (peers.py,
runner.py, report.py), then each backend's kernel report (kernels.py).

The committed H200 results are reproduced with:

    python -m benchmarks.paper --backend cuda --sdpa flash,cudnn --flex-seqlens 16384 \\
        --out benchmarks/results/h200-2026-11-29/cuda_paper
    python -m benchmarks.paper --backend triton --head-dims 128,64 --sdpa flash,cudnn --flex-seqlens 16384 \\
        --flex-dims 128 --memory --out benchmarks/results/h200-2026-11-29/triton_paper
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/paper.py`: import the package from the repo root
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402

from benchmarks import report, settings  # noqa: E402
from benchmarks.kernels import kernel_report  # noqa: E402
from benchmarks.peers import AttnxPeer, FlexPeer, SdpaPeer  # noqa: E402
from benchmarks.progress import Progress  # noqa: E402
from benchmarks.run import device_name, versions  # noqa: E402
from benchmarks.runner import Budget, Runner, dispatch_check  # noqa: E402
from benchmarks.timing import time_do_bench  # noqa: E402


def _ints(text):
    return None if text is None else [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.paper", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True, help="attnx backend(s) to measure, comma list (e.g. cuda,triton)")
    parser.add_argument("--out", type=Path, required=True, help="write OUT.json and OUT.md")
    parser.add_argument("--sdpa", default="flash,efficient,cudnn", help="torch SDPA kernels beside them ('' for none)")
    parser.add_argument("--no-flex", action="store_true", help="leave FlexAttention out")
    parser.add_argument("--flex-seqlens", default=None, help="FlexAttention only at these S (it compiles per shape)")
    parser.add_argument("--flex-dims", default=None, help="FlexAttention only at these head dims")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--causal", default="0,1", help="0 = not causal, 1 = causal")
    parser.add_argument("--dtype", default="bf16", choices=tuple(settings.DTYPES))
    parser.add_argument("--memory", action="store_true",
                        help="also peak extra memory of one forward at S=32k, B=1, H=8, D=128")
    parser.add_argument("--warmup-ms", type=float, default=25.0)
    parser.add_argument("--rep-ms", type=float, default=100.0)
    parser.add_argument("--max-seconds", type=float, default=None, help="wall-clock budget (default none)")
    parser.add_argument("--max-call-seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the paper setting needs a CUDA device")
    return args


def points(args) -> list[settings.Point]:
    chosen = settings.paper(head_dims=tuple(_ints(args.head_dims)), dtypes=(args.dtype,), seqlens=_ints(args.seqlens),
                            modes=tuple(args.modes.split(",")), causals=tuple(bool(c) for c in _ints(args.causal)))
    if args.memory:
        chosen += settings.fixed_tokens("memory", args.dtype, 1024, 1, [32768], (128,), "memory", modes=("fwd",),
                                        causals=(False,))
    return chosen


def peers(args) -> list:
    backends = [b for b in args.backend.split(",") if b]
    chosen = [AttnxPeer(b) for b in backends] + [SdpaPeer(k) for k in args.sdpa.split(",") if k]
    if not args.no_flex:
        FlexPeer.static_shapes = True  # the best kernel per shape, as the paper setting compares
        chosen.append(FlexPeer(_ints(args.flex_seqlens), _ints(args.flex_dims)))
    return chosen


def main(argv=None) -> int:
    args = parse_args(argv)
    backends = [b for b in args.backend.split(",") if b]
    chosen_points, chosen_peers = points(args), peers(args)
    progress = Progress(len(chosen_points) * len(chosen_peers), title="paper")
    runner = Runner("cuda", chosen_peers, Budget(args.max_seconds, args.max_call_seconds), progress=progress,
                    timer=lambda call: time_do_bench(call, args.warmup_ms, args.rep_ms))
    started = time.monotonic()
    runner.run(chosen_points)
    progress.close()
    command = "python -m benchmarks.paper " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = {"device": "cuda", "device_name": device_name("cuda"), "date": datetime.date.today().isoformat(),
            "command": command, "versions": versions(), "attnx_backends": backends,
            "statistic": "median of triton.testing.do_bench (L2 flushed before each call)",
            "seconds": round(time.monotonic() - started, 1)}
    write(args.out, meta, runner.rows, runner.picks, {b: kernel_report(b) for b in backends})
    return 0


def write(out: Path, meta: dict, rows: list[dict], picks: list[dict], kernels: dict) -> None:
    """OUT.json and OUT.md: the harness's record and tables, then each backend's kernel report."""
    checks = dispatch_check(rows, picks)
    out.parent.mkdir(parents=True, exist_ok=True)
    report.write_json(out.with_suffix(".json"), meta, rows, checks, picks, {"kernels": kernels})
    text = report.markdown(meta, rows, checks, picks, [])
    for backend, kernel_rows in kernels.items():
        text += "\n" + "\n".join([f"## {backend} kernels compiled in this run", ""] + report.dict_table(kernel_rows))
    out.with_suffix(".md").write_text(text)
    print(report.console_table(rows, checks))
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    sys.exit(main())
