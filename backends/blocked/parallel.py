"""CPU parallelism: query tiles shared among threads, each running single-threaded torch ops.

Per-op intra-op threading splits every small op across cores and synchronises after
each; on a loaded machine a descheduled thread stalls every barrier (measured 3-10x
slower than one thread). Coarse work items, as PyTorch's own CPU flash attention
uses, avoid that: each worker takes whole query tiles, and torch's intra-op pool is
set to one thread while they run (the ops release the GIL).
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from queue import Empty, SimpleQueue
from typing import Callable, Iterable, Optional, Sequence

import torch

from attnx.problem import Problem

# Below this many scores per call, thread hand-off costs more than it saves (torch's
# elementwise ops do not split tensors under 32768 elements either). Above it the pool
# always wins: with threaded ops a 2-head, 512-token forward+backward took over a
# second on a loaded 2-core machine, against 10 ms through the pool.
MIN_PARALLEL_SCORES = 1 << 16


class _State:
    """The worker pools and the lock around torch's thread count (reset in a forked child,
    where the pool threads no longer exist)."""

    lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="attnx-blocked")


def _after_fork_in_child() -> None:
    _pool.cache_clear()
    _State.lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def _single_threaded_ops():
    with _State.lock:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


def worker_count(p: Problem, tile_count: int) -> int:
    """How many threads run the query tiles of `p` (1 = the caller alone, torch ops threaded)."""
    if p.device_type != "cpu" or tile_count < 2:
        return 1
    if p.batch * p.heads_q * p.seqlen_q * p.seqlen_k < MIN_PARALLEL_SCORES:
        return 1
    return max(1, min(torch.get_num_threads(), tile_count))


def _without_grad(work: Callable):
    # grad and inference modes are thread-local: a pool thread would otherwise record autograd
    # history, or refuse to write the caller's inference-mode tensors
    inference = torch.is_inference_mode_enabled()

    def run(chunk):
        with torch.inference_mode(inference), torch.no_grad():
            return work(chunk)
    return run


def map_tiles(p: Problem, starts: Sequence[int], work: Callable[[Iterable[int]], object],
              cost: Optional[Callable[[int], int]] = None) -> list:
    """Run `work` over the query-tile `starts` on the workers; one result per worker.

    Each worker calls ``work(tiles)`` once with an iterator that hands out tiles from
    one shared queue, most costly first (`cost`), so a worker that the OS deschedules
    on a loaded machine does not hold the others up, and per-worker state (scratch
    buffers, dK/dV accumulators) is allocated once per worker.
    """
    workers = worker_count(p, len(starts))
    if workers == 1:
        return [_without_grad(work)(starts)]
    queue: SimpleQueue = SimpleQueue()
    for start in (sorted(starts, key=cost, reverse=True) if cost else starts):
        queue.put(start)

    def tiles_from_queue():
        while True:
            try:
                yield queue.get_nowait()
            except Empty:
                return

    with _single_threaded_ops():
        return list(_pool(workers).map(_without_grad(work), [tiles_from_queue() for _ in range(workers)]))
