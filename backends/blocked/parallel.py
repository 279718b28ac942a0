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
from typing import Callable, Sequence

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
    # grad mode is thread-local: a pool thread would otherwise record autograd history
    def run(chunk):
        with torch.no_grad():
            return work(chunk)
    return run


def map_tiles(p: Problem, starts: Sequence[int], work: Callable[[Sequence[int]], object]) -> list:
    """Run ``work(chunk)`` over round-robin chunks of the query-tile `starts`; one result per chunk."""
    workers = worker_count(p, len(starts))
    if workers == 1:
        return [_without_grad(work)(starts)]
    # round-robin: causal tiles grow with their index, so each worker gets a fair mix
    chunks = [starts[w::workers] for w in range(workers)]
    with _single_threaded_ops():
        return list(_pool(workers).map(_without_grad(work), chunks))
