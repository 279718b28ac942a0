"""The torch backend against blocked and naive on the CPU: where each is fastest (sets their priorities).

    python benchmarks/torch_backend_cpu.py                       # every group, median of 5
    python benchmarks/torch_backend_cpu.py --groups dense decode --repeats 7

Each point runs `attnx.attention` forced onto each backend (and once through the
dispatcher, column "pick"), on the same inputs, interleaved repeat by repeat. Cells are the
minimum milliseconds over the repeats (the least disturbed run: on a shared, loaded CPU the
median mostly measures the neighbours; medians are in the JSON too); "-" = the backend
declines the problem or it is too big for naive. Results go to
``benchmarks/results/cpu-<date>/torch_backend_cpu.{json,md}``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import attnx  # noqa: E402

BACKENDS = ("torch", "blocked", "naive")
NAIVE_MAX_SCORES = 1 << 24   # naive materialises B*H*Sq*Sk scores (x3 for the backward)
MAX_REPEATS = 50
RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def point(group, b, hq, hkv, sq, sk, d, *, causal=False, window=None, mask=None, dtype="float32", grad=False):
    return dict(group=group, batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=sq, seqlen_k=sk, head_dim=d, causal=causal,
                window=window, mask=mask, dtype=dtype, grad=grad)


def points(groups) -> list[dict]:
    found = []
    if "small" in groups:  # naive's range: B*H*Sq*Sk <= 65,536
        for s in (16, 32, 64, 128):
            for grad in (False, True):
                found.append(point("small", 1, 4, 4, s, s, 64, causal=True, grad=grad))
    if "dense" in groups:
        for d, h in ((64, 4), (128, 2)):
            for s in (256, 512, 1024, 2048, 4096):
                for causal in (False, True):
                    for grad in (False, True):
                        found.append(point("dense", 8192 // s, h, h, s, s, d, causal=causal, grad=grad))
    if "gqa" in groups:
        for s in (256, 1024, 4096):
            for grad in (False, True):
                found.append(point("gqa", 1, 8, 2, s, s, 64, causal=True, grad=grad))
    if "decode" in groups:
        for sk in (128, 512, 2048, 8192, 32768):
            found.append(point("decode", 1, 8, 2, 1, sk, 64))
            found.append(point("decode", 4, 8, 2, 1, sk, 64))
    if "chunked" in groups:  # bottom-right causal with Sq < Sk: an additive mask for torch
        for sq, sk in ((64, 1024), (256, 2048), (512, 4096)):
            found.append(point("chunked", 1, 8, 2, sq, sk, 64, causal=True))
    if "window" in groups:  # sliding window (Mistral-style): torch needs a mask, blocked skips tiles
        for s in (512, 1024, 2048, 4096):
            for grad in (False, True):
                found.append(point("window", 1, 4, 4, s, s, 64, window=(255, 0), grad=grad))
    if "mask" in groups:  # a padding mask (B, 1, 1, Sk) and a full bool mask (B, 1, Sq, Sk)
        for s in (256, 1024, 2048):
            for kind in ("padding", "bool"):
                for grad in (False, True):
                    found.append(point("mask", 4, 4, 4, s, s, 64, causal=kind == "padding", mask=kind, grad=grad))
    if "bf16" in groups:
        for s in (512, 2048):
            for grad in (False, True):
                found.append(point("bf16", 2, 4, 4, s, s, 64, causal=True, dtype="bfloat16", grad=grad))
    return found


def make_inputs(pt: dict):
    dtype = getattr(torch, pt["dtype"])
    b, hq, hkv, sq, sk, d = (pt[n] for n in ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "head_dim"))
    q = torch.randn(b, hq, sq, d, dtype=dtype, requires_grad=pt["grad"])
    k, v = (torch.randn(b, hkv, sk, d, dtype=dtype, requires_grad=pt["grad"]) for _ in range(2))
    options = dict(causal=pt["causal"], window=pt["window"])
    if pt["mask"] == "padding":
        keep = torch.ones(b, 1, 1, sk, dtype=torch.bool)
        keep[:, :, :, : sk // 8] = False
        options["mask"] = keep
    elif pt["mask"] == "bool":
        options["mask"] = torch.rand(b, 1, sq, sk) > 0.2
    return q, k, v, options


def runner(q, k, v, options, backend, grad):
    dout = torch.randn(q.shape[0], q.shape[1], q.shape[2], v.shape[3], dtype=q.dtype)

    def call():
        out = attnx.attention(q, k, v, backend=backend, **options)
        if grad:
            torch.autograd.grad(out, (q, k, v), dout)
    return call


def measure(pt: dict, repeats: int) -> dict:
    q, k, v, options = make_inputs(pt)
    p = attnx.make_problem(q, k, v, **options)
    scores = pt["batch"] * pt["heads_q"] * pt["seqlen_q"] * pt["seqlen_k"]
    calls = {}
    for name in BACKENDS:
        if attnx.get_backend(name).reasons(p) or (name == "naive" and scores > NAIVE_MAX_SCORES):
            continue
        calls[name] = runner(q, k, v, options, name, pt["grad"])
    calls["pick"] = runner(q, k, v, options, None, pt["grad"])
    times = {name: [] for name in calls}
    slowest = 0.0
    for call in calls.values():  # warm up, and time the slowest
        start = time.perf_counter()
        call()
        slowest = max(slowest, time.perf_counter() - start)
    # small calls get more repeats: about a second per point, at most MAX_REPEATS
    repeats = max(repeats, min(MAX_REPEATS, int(1.0 / max(slowest, 1e-6))))
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    ms = {name: min(t) * 1e3 for name, t in times.items()}
    median_ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    picked = attnx.explain(q, k, v, **options).chosen
    return dict(pt, ms=ms, median_ms=median_ms, picked=picked, repeats=repeats)


def label(pt: dict) -> str:
    heads = f"H{pt['heads_q']}" + (f"/{pt['heads_kv']}" if pt["heads_kv"] != pt["heads_q"] else "")
    parts = [pt["dtype"], f"B{pt['batch']}", heads,
             f"S{pt['seqlen_q']}" + (f"x{pt['seqlen_k']}" if pt["seqlen_k"] != pt["seqlen_q"] else ""),
             f"D{pt['head_dim']}"]
    if pt["causal"]:
        parts.append("causal")
    if pt["window"]:
        parts.append(f"window{tuple(pt['window'])}")
    if pt["mask"]:
        parts.append(f"{pt['mask']}-mask")
    parts.append("fwd+bwd" if pt["grad"] else "fwd")
    return " ".join(parts)


def markdown(result: dict) -> str:
    lines = [f"# torch backend vs blocked and naive, CPU ({result['cores']} cores, {result['threads']} threads), "
             f"{result['date']}", "",
             f"`{result['command']}`  ", f"torch {result['torch']}, attnx {result['attnx']}; minimum of "
             f"{result['repeats']} or more interleaved runs (up to {MAX_REPEATS} for small calls), milliseconds "
             f"(medians in the JSON); load average at the start {result['load_average'][0]:.1f}; "
             "`-` = declined (or too big for naive); "
             "**bold** = fastest; pick = what the dispatcher chose.", ""]
    group = None
    for row in result["rows"]:
        if row["group"] != group:
            group = row["group"]
            lines += ["", f"## {group}", "", "| point | " + " | ".join(BACKENDS) + " | pick | torch / best other |",
                      "|---|" + "---|" * (len(BACKENDS) + 2)]
        ms = row["ms"]
        best = min((ms[n] for n in BACKENDS if n in ms), default=None)
        cells = []
        for name in BACKENDS:
            if name not in ms:
                cells.append("-")
            else:
                text = f"{ms[name]:.3g}"
                cells.append(f"**{text}**" if ms[name] == best else text)
        others = [ms[n] for n in BACKENDS if n in ms and n != "torch"]
        ratio = f"{ms['torch'] / min(others):.2f}" if "torch" in ms and others else "-"
        lines.append(f"| {label(row)} | " + " | ".join(cells) + f" | {row['picked']} ({ms['pick']:.3g}) | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    all_groups = ("small", "dense", "gqa", "decode", "chunked", "window", "mask", "bf16")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", nargs="+", default=list(all_groups), choices=all_groups)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="folder (default benchmarks/results/cpu-<today>)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    date = datetime.date.today().isoformat()
    out = pathlib.Path(args.out) if args.out else RESULTS / f"cpu-{date}"
    load_average = os.getloadavg()
    rows = []
    for pt in points(args.groups):
        row = measure(pt, args.repeats)
        rows.append(row)
        print(label(row), {n: round(t, 3) for n, t in row["ms"].items()}, "pick:", row["picked"], flush=True)
    result = {"benchmark": "torch_backend_cpu", "date": date, "torch": torch.__version__, "attnx": attnx.__version__,
              "threads": torch.get_num_threads(), "cores": os.cpu_count(),
              "cpu": platform.processor() or platform.machine(), "repeats": args.repeats,
              "load_average": load_average,
              "command": "python benchmarks/torch_backend_cpu.py "
              + " ".join(argv if argv is not None else sys.argv[1:]),
              "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "torch_backend_cpu.json").write_text(json.dumps(result, indent=1))
    (out / "torch_backend_cpu.md").write_text(markdown(result))
    print(f"wrote {out / 'torch_backend_cpu.md'}")
    return result


if __name__ == "__main__":
    main()
