"""Running ring-attention workers in spawned processes for the gloo tests (shared by the dense and varlen files).

Each worker writes ``rank{r}.json`` (case name -> result) into its run's folder; `run_ranks`
spawns them, bounds their time and merges the files as ``{case: {rank: result}}``.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback


def init_gloo(rank: int, world: int, outdir: str) -> None:
    """Join the run's gloo group: a file rendezvous in its own folder, so no port can be taken in between."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="file://" + os.path.join(outdir, "rendezvous"), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))


def run_cases(rank: int, world: int, outdir: str, names, check) -> None:
    """A worker's whole life: join the group, run `check(name)` for each name, write, leave, exit.

    Every rank runs the same names in the same order with a barrier after each, so a case that
    fails on one rank cannot leave another waiting in the next case's communication.
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    init_gloo(rank, world, outdir)
    found = {}
    try:
        for name in names:
            start = time.perf_counter()
            try:
                check(name)
                found[name] = {"ok": True, "s": time.perf_counter() - start}
            except Exception:  # noqa: BLE001 - reported to the test
                found[name] = {"ok": False, "error": traceback.format_exc()}
            dist.barrier()
    except BaseException:  # noqa: BLE001 - the group itself failed: every case not yet run reports it
        error = traceback.format_exc()
        for name in names:
            found.setdefault(name, {"ok": False, "error": error})
    path = os.path.join(outdir, f"rank{rank}.json")
    with open(path + ".part", "w") as f:
        json.dump(found, f)
    os.replace(path + ".part", path)
    try:
        dist.destroy_process_group()
    finally:
        # End without interpreter finalisation: after a clean destroy_process_group and with both
        # ranks' results written, torch 2.13's shutdown of gloo aborted a worker about once in 25
        # runs ("terminate called without an active exception", SIGABRT; seen in CI on 2026-12-01).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


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


def results_once(cache: dict, worker, world: int, tmp_path_factory, timeout_s: float, what: str, folder: str) -> dict:
    """`run_ranks`'s results for `world`, spawned once per session and kept in `cache` (world -> results);
    a spawn that failed fails every later test of that size instead of spawning again."""
    import pytest

    if world in cache and cache[world] is None:
        pytest.fail(f"the {what} workers of world size {world} failed (see the first test of that size)")
    if world not in cache:
        cache[world] = None  # a spawn that fails is not repeated by every test
        outdir = str(tmp_path_factory.mktemp(f"{folder}{world}"))
        cache[world] = run_ranks(worker, world, outdir, timeout_s, what)
    return cache[world]


def assert_every_rank_ok(per_rank: dict) -> None:
    """One case's ``{rank: result}``: no rank failed (the failures' tracebacks, by rank, otherwise)."""
    failures = {r: res["error"] for r, res in per_rank.items() if not res["ok"]}
    assert not failures, "\n".join(f"rank {r}:\n{e}" for r, e in failures.items())
