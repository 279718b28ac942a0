"""Per-rank peak memory of ring attention (forward + backward) for P = 1, 2, 4 at a fixed total length.

    python -m benchmarks.ring_memory --out benchmarks/results/cpu-2026-12-01

Methods: the ring with whole K/V blocks (the default), the ring with K/V in pieces
(``kv_pieces``, `--kv-pieces`) and the all-gather exchange. Each P runs as P spawned
processes (gloo, a file rendezvous). Every rank builds its own shards of
q, k, v and dout (``S / P`` rows each), then measures one ``ring_attention`` forward + backward
the way benchmarks/memory.py measures a call on the CPU: torch's CPU allocations are invisible
to tracemalloc, so the rank resets the kernel's high-water mark (``/proc/self/clear_refs``)
after building its inputs and reports ``VmHWM - VmRSS`` around the call: the peak of what the
call allocated beyond its inputs (outputs, gradients, K/V buffers in flight, tiles), as the
process's resident memory saw it. glibc is told to return freed blocks to the system at once
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``) so resident memory follows the live
tensors. P = 1 also measures plain `attnx.attention` for comparison.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
# what each measured method passes to ring_attention ("ring_pieces" also gets --kv-pieces)
METHODS = {"ring": dict(exchange="ring"), "ring_pieces": dict(exchange="ring"), "allgather": dict(exchange="allgather")}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _measure(call) -> tuple[int, float]:
    """(peak resident bytes during `call()` beyond the resident bytes before it, seconds)."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current VmRSS
    before = _status("VmRSS:")
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    # VmRSS can fall below `before` between the reset and the call's first allocation (the kernel
    # updates VmHWM lazily, background threads free memory): a call's peak beyond its start is >= 0
    return max(0, _status("VmHWM:") - before), seconds


def _worker(rank: int, world: int, rendezvous: str, cfg: dict, outdir: str) -> None:
    import torch.distributed as dist

    import attnx
    from attnx.distributed import ring_attention

    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    batch, dim, seq = cfg["batch"], cfg["head_dim"], cfg["seqlen"]
    heads, heads_kv = cfg["heads"]
    local = seq // world
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(batch, heads, local, dim, generator=g).requires_grad_()
    k = torch.randn(batch, heads_kv, local, dim, generator=g).requires_grad_()
    v = torch.randn(batch, heads_kv, local, dim, generator=g).requires_grad_()
    dout = torch.randn(batch, heads, local, dim, generator=g)
    input_bytes = sum(t.numel() * t.element_size() for t in (q, k, v, dout))
    found = {"rank": rank, "world": world, "heads": [heads, heads_kv], "input_bytes": input_bytes}

    def ring(method):
        options = dict(METHODS[method], kv_pieces=cfg["kv_pieces"]) if method == "ring_pieces" else METHODS[method]

        def call():
            ring_attention(q, k, v, causal=cfg["causal"], sharding="zigzag", **options).backward(dout)
        return call

    methods = [m for m in cfg["methods"] if m == "ring" or world > 1]  # one rank: nothing travels, only the ring
    for method in methods:
        ring(method)()  # warm-up: dispatch decisions, gloo buffers
        q.grad = k.grad = v.grad = None
    for _ in range(cfg.get("repeat", 1)):  # methods interleaved, so drifting load touches each alike
        for method in methods:
            dist.barrier()
            peak, seconds = _measure(ring(method))
            q.grad = k.grad = v.grad = None
            entry = found.setdefault(method, {"peak_bytes": 0, "seconds": float("inf"), "all_seconds": []})
            entry["peak_bytes"] = max(entry["peak_bytes"], peak)
            entry["seconds"] = min(entry["seconds"], seconds)
            entry["all_seconds"].append(seconds)
    dist.barrier()
    if world == 1:
        def plain():
            attnx.attention(q, k, v, causal=cfg["causal"]).backward(dout)
        plain()
        q.grad = k.grad = v.grad = None
        peak, seconds = _measure(plain)
        found["attnx.attention"] = {"peak_bytes": peak, "seconds": seconds}
    with open(os.path.join(outdir, f"h{heads}x{heads_kv}_p{world}_rank{rank}.json"), "w") as f:
        json.dump(found, f)
    dist.destroy_process_group()
    # no interpreter finalisation: torch 2.13's gloo shutdown at exit aborted a worker about once
    # in 25 runs (SIGABRT) after a clean destroy_process_group; the results are written by now
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(cfg: dict, outdir: Path) -> dict:
    import tempfile

    import torch.multiprocessing as mp

    os.environ.update(MALLOC_ENV)  # read by glibc when each spawned process starts
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for heads, heads_kv in cfg["problems"]:
            for world in cfg["worlds"]:
                # a file rendezvous per run: no TCP port that another process could take meanwhile
                rendezvous = os.path.join(tmp, f"rendezvous_h{heads}x{heads_kv}_p{world}")
                mp.start_processes(_worker, args=(world, rendezvous, dict(cfg, heads=(heads, heads_kv)), tmp),
                                   nprocs=world, start_method="spawn")
                for rank in range(world):
                    rows.append(json.loads(Path(tmp, f"h{heads}x{heads_kv}_p{world}_rank{rank}.json").read_text()))
    return {"config": cfg, "ranks": rows}


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def report(result: dict) -> str:
    cfg = result["config"]
    lines = [f"# Ring attention: per-rank peak memory, CPU — {cfg['date']}", "",
             f"Command: `{cfg['command']}`  ",
             f"Machine: {cfg['machine']}, {cfg['cores']} cores, {cfg['threads']} torch thread per rank (shared with "
             f"other jobs while measured: times are indicative only); torch {cfg['torch']}; gloo on 127.0.0.1  ",
             f"Problem: fp32, B={cfg['batch']}, D={cfg['head_dim']}, S={cfg['seqlen']:,} tokens in total, "
             f"causal={cfg['causal']}, zigzag sharding; one forward + backward.", "",
             f"Seconds: one forward + backward, the slowest rank; the fastest of {cfg.get('repeat', 1)} "
             "(methods interleaved). CPU timings with gloo on one host are not GPU timings: they show the "
             "cost of more messages and calls, not of NVLink or NCCL.", "",
             "Peak = the most resident memory the call (forward + backward) added beyond its inputs "
             "(VmHWM - VmRSS, the high-water mark reset just before the call): outputs, saved tensors, "
             "gradients, K/V and dK/dV blocks in flight, tiles. Inputs = the rank's q, k, v and dout shards. "
             "Max over ranks. \"/ P=1\" = peak / ring peak at P = 1 (ideal: 1/P).", "",
             "Total = inputs + peak: what the rank holds at the peak, its shards included.", "",
             f"Methods: `ring` (whole K/V blocks travel, the default), `ring_pieces` (`kv_pieces={cfg['kv_pieces']}`: "
             "each block travels in that many pieces, one piece all the way round the ring before the next), "
             "`allgather` (every rank gathers the whole K/V once). With one rank nothing travels: only `ring` runs.", "",
             "Reading it: every rank holds its output, dQ and its block's dK/dV (shards: they fall as 1/P). With "
             "whole blocks and P >= 2 it also holds the K/V block in hand and the next one arriving (and in the "
             "backward the dK/dV accumulators of the block in hand), the price of overlapping each transfer with "
             "compute: the peak falls less than 1/P from P = 1 to 2. In pieces, those are two pieces of K/V and one "
             "of accumulators, so the peak falls about as 1/P from P = 1 on; the transfers still overlap the "
             "compute, piece by piece, for more messages and local calls. The all-gather variant keeps the whole "
             "K/V, and dK/dV of every block in its backward, so it falls slowly, as its size rule expects "
             "(docs/distributed.md).", ""]
    groups: dict = {}
    for row in result["ranks"]:
        groups.setdefault(tuple(row["heads"]), {}).setdefault(row["world"], []).append(row)
    for (heads, heads_kv), by_world in groups.items():
        kind = "MHA" if heads == heads_kv else "GQA"
        lines += [f"## Hq = {heads}, Hkv = {heads_kv} ({kind})", "",
                  "| P | method | inputs per rank (MiB) | peak per rank (MiB) | / P=1 | total (MiB) | / P=1 | "
                  "ideal 1/P | seconds |",
                  "|---|---|---|---|---|---|---|---|---|"]
        base = max(r["ring"]["peak_bytes"] for r in by_world[1]) if 1 in by_world else None
        base_total = base + by_world[1][0]["input_bytes"] if base is not None else None
        for world in sorted(by_world):
            ranks = by_world[world]
            for method in ("ring", "ring_pieces", "allgather", "attnx.attention"):
                if method not in ranks[0]:
                    continue
                peak = max(r[method]["peak_bytes"] for r in ranks)
                seconds = max(r[method]["seconds"] for r in ranks)
                total = peak + ranks[0]["input_bytes"]
                ratio = f"{peak / base:.2f}" if base else "-"
                total_ratio = f"{total / base_total:.2f}" if base_total else "-"
                label = {"attnx.attention": "none: `attnx.attention`, one process",
                         "ring_pieces": f"ring, kv_pieces={cfg['kv_pieces']}"}.get(method, method)
                lines.append(f"| {world} | {label} | {_mib(ranks[0]['input_bytes'])} | {_mib(peak)} | {ratio} | "
                             f"{_mib(total)} | {total_ratio} | {1 / world:.2f} | {seconds:.1f} |")
        lines += ["", "Every rank (MiB): " + "; ".join(
            f"P={w} " + ", ".join(f"{m} " + " / ".join(_mib(r[m]['peak_bytes']) for r in by_world[w])
                                  for m in ("ring", "ring_pieces", "allgather") if m in by_world[w][0])
            for w in sorted(by_world)), ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--problems", nargs="+", default=["4x4", "8x2"], help="Hq x Hkv of each problem")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--kv-pieces", type=int, default=8, help="kv_pieces of the ring_pieces method")
    parser.add_argument("--repeat", type=int, default=1,
                        help="measure each method this many times, interleaved: the highest peak, the fastest seconds")
    parser.add_argument("--full", action="store_true", help="not causal")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--name", default="ring_memory", help="file name (without suffix) of the results in --out")
    parser.add_argument("--from-json", type=Path, default=None, help="only re-render the report of a results JSON")
    args = parser.parse_args(argv)
    if args.from_json is not None:
        print(report(json.loads(args.from_json.read_text())))
        return
    cores = os.cpu_count() or 1
    problems = [[int(n) for n in p.split("x")] for p in args.problems]
    cfg = dict(seqlen=args.seqlen, batch=args.batch, problems=problems, head_dim=args.head_dim, worlds=args.worlds,
               methods=args.methods, kv_pieces=args.kv_pieces, repeat=args.repeat, causal=not args.full, threads=1, cores=cores, machine=platform.machine(),
               torch=torch.__version__,
               date=datetime.date.today().isoformat(),
               command="python -m benchmarks.ring_memory " + " ".join(argv if argv is not None else
                                                                     __import__("sys").argv[1:]))
    result = run(cfg, args.out)
    text = report(result)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / f"{args.name}.md").write_text(text)


if __name__ == "__main__":
    main()
