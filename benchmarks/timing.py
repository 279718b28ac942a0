"""Timing done properly: warm-up, rotated inputs, CUDA events (GPU) or perf_counter (CPU), min and median.

`make_call` turns a peer's ``fn(q, k, v)`` into ``call(i)`` running forward (or
forward+backward) on the i-th copy of the inputs; rotating copies keeps caches
from flattering small problems.
"""
from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass

import torch

from .settings import Point

CACHE_BYTES = 64 << 20    # above the H100/H200 L2 (50 MiB) and typical CPU last-level caches
MAX_COPIES = 4


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    reps: int


def input_copies(point: Point) -> int:
    """How many input sets to rotate through so that consecutive calls miss in cache."""
    itemsize = torch.empty((), dtype=point.torch_dtype).element_size()
    one_set = itemsize * point.batch * point.head_dim * (2 * point.heads_q * point.seqlen_q
                                                         + 2 * point.heads_kv * point.seqlen_k)
    if one_set >= 2 * CACHE_BYTES or point.measure == "memory":
        return 1
    return max(2, min(MAX_COPIES, -(-2 * CACHE_BYTES // one_set)))


def make_inputs(point: Point, device: str, copies: int = 1, seed: int = 0) -> list:
    """`copies` fresh random (q, k, v, dout) sets; requires_grad for forward+backward points."""
    generator = torch.Generator(device=device).manual_seed(seed)
    grad = point.mode == "fwd+bwd"
    sets = []
    for _ in range(copies):
        def rand(*shape):
            return torch.randn(*shape, generator=generator, device=device, dtype=point.torch_dtype)
        q = rand(point.batch, point.heads_q, point.seqlen_q, point.head_dim).requires_grad_(grad)
        k = rand(point.batch, point.heads_kv, point.seqlen_k, point.head_dim).requires_grad_(grad)
        v = rand(point.batch, point.heads_kv, point.seqlen_k, point.head_dim).requires_grad_(grad)
        dout = rand(point.batch, point.heads_q, point.seqlen_q, point.head_dim) if grad else None
        sets.append((q, k, v, dout))
    return sets


def make_call(fn, point: Point, inputs: list):
    """``call(i)``: one forward (no grad) or forward+backward on input set ``i % len(inputs)``."""
    if point.mode == "fwd":
        def call(i):
            q, k, v, _ = inputs[i % len(inputs)]
            with torch.no_grad():
                return fn(q, k, v)
        return call

    def call(i):
        q, k, v, dout = inputs[i % len(inputs)]
        out = fn(q, k, v)
        out.backward(dout)
        q.grad = k.grad = v.grad = None
    return call


def time_cpu(call, warmup=1, min_reps=3, max_reps=10, budget_s=3.0) -> Timing:
    """Warm up, then repeat until `budget_s` is spent (at least `min_reps`); min and median in ms."""
    for i in range(warmup):
        t0 = time.perf_counter()
        call(i)
        warm_s = time.perf_counter() - t0
    if warmup and warm_s > budget_s / 2:  # slow calls: two repeats are all the budget allows
        min_reps = min(min_reps, 2)
    times = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        call(len(times) + warmup)
        times.append((time.perf_counter() - t0) * 1e3)
    return Timing(statistics.median(times), min(times), len(times))


def time_cuda(call, warmup=3, min_reps=5, max_reps=50, budget_s=1.0, slow_s=0.05) -> Timing:
    """CUDA events around each call after warm-up; median and min in ms.

    One call compiles/autotunes, a second sizes the repetitions to `budget_s`; calls slower
    than `slow_s` skip the remaining warm-up and get 3 repetitions (they are stable, and
    slow methods would otherwise eat the run's time budget).
    """
    def timed(i) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call(i)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    call(0)  # compile, autotune, allocate
    torch.cuda.synchronize()
    estimate_ms = timed(1)
    if estimate_ms / 1e3 > slow_s:
        times = [estimate_ms] + [timed(2 + i) for i in range(2)]
        return Timing(statistics.median(times), min(times), len(times))
    for i in range(max(0, warmup - 2)):
        call(2 + i)
    reps = int(max(min_reps, min(max_reps, budget_s / max(estimate_ms / 1e3, 1e-6))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        call(warmup + i)
        ends[i].record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return Timing(statistics.median(times), min(times), reps)


def time_do_bench(call, warmup_ms=25, rep_ms=100) -> Timing:
    """`triton.testing.do_bench` (L2 flushed before every call), as the FlashAttention papers report it."""
    from triton.testing import do_bench

    call(0)  # compile / autotune outside the timing
    torch.cuda.synchronize()
    count = itertools.count(1)
    times = do_bench(lambda: call(next(count)), warmup=warmup_ms, rep=rep_ms, return_mode="all")
    return Timing(statistics.median(times), min(times), len(times))


def measure_time(fn, point: Point, inputs: list, device: str, quick=False, timer=None) -> Timing:
    """Time `fn` at `point`; `timer(call) -> Timing` replaces the device's default clock."""
    call = make_call(fn, point, inputs)
    if timer is not None:
        return timer(call)
    if device == "cuda":
        return time_cuda(call, warmup=2 if quick else 3, min_reps=3 if quick else 5,
                         budget_s=0.1 if quick else 1.0)
    return time_cpu(call, warmup=1, min_reps=2 if quick else 3, max_reps=5 if quick else 10,
                    budget_s=0.2 if quick else 3.0)
