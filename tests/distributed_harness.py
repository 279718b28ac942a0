"""Running ring-attention workers in spawned processes for the gloo tests (shared by the dense and varlen files).

Each worker writes ``rank{r}.json`` (case name -> result) into its run's folder; `run_ranks`
spawns them, bounds their time and merges the files as ``{case: {rank: result}}``.
"""
from __future__ import annotations

import datetime
import json
import os
import time


def init_gloo(rank: int, world: int, outdir: str) -> None:
    """Join the run's gloo group: a file rendezvous in its own folder, so no port can be taken in between."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="file://" + os.path.join(outdir, "rendezvous"), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))


def run_ranks(worker, world: int, outdir: str, timeout_s: float, what: str) -> dict:
    """Spawn `worker(rank, world, outdir)` on `world` processes; their merged results, or an error past `timeout_s`."""
    import torch.multiprocessing as mp

    context = mp.start_processes(worker, args=(world, outdir), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} workers (world size {world}) ran past {timeout_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
    merged: dict = {}
    for rank in range(world):
        with open(os.path.join(outdir, f"rank{rank}.json")) as f:
            for name, result in json.load(f).items():
                merged.setdefault(name, {})[rank] = result
    return merged
