"""Backends that measure attnx rather than attention, and the clock the overhead benchmark reads.

`NullBackend` returns preallocated tensors, so a call through it times attnx's own
work; `SpyBackend` stands first in every priority order and declines every problem.
Both count how often the dispatcher asks them (`asks`): once per dispatch-cache miss.
Register them for a block only, with `attnx.registered` (which also retires every
cached decision, on entry and on exit).
"""
from __future__ import annotations

import statistics
import time

import attnx


class _Counting(attnx.Backend):
    asks = 0

    def reasons(self, p):
        self.asks += 1
        return super().reasons(p)


class NullBackend(_Counting):
    name = "overhead-null"
    description = "returns preallocated tensors: a call through it times attnx's own work"
    device_types = frozenset({"cpu"})
    supports_offset = True
    supports_sinks = True

    def __init__(self, out, lse, grads: attnx.Grads):
        self._out, self._lse, self._grads = out, lse, grads

    def forward(self, p, x):
        return self._out, self._lse

    def backward(self, p, x, out, lse, dout):
        return self._grads


class SpyBackend(_Counting):
    name = "overhead-spy"
    description = "declines every problem; asked first on every dispatch-cache miss"
    priority = {"*": 1 << 30}

    def extra_reasons(self, p):
        return ["an overhead probe: it only counts how often the dispatcher asks"]


CLOCKS = {"thread": time.thread_time, "wall": time.perf_counter}


def per_call_us(fns: dict, seconds: float = 0.05, repeats: int = 9, warmup: int = 20, clock: str = "thread") -> dict:
    """Median and min over `repeats` of the mean µs per call of each function, interleaved.

    Each repeat runs every function for about `seconds` (the count is fixed from a first
    estimate), one function after the other, so that load changes hit them alike.
    ``clock="thread"`` counts the calling thread's CPU time only (other processes on a busy
    machine do not count; run torch on one thread then), ``"wall"`` the elapsed time.
    """
    now = CLOCKS[clock]
    counts = {}
    for label, fn in fns.items():
        for _ in range(warmup):
            fn()
        start = now()
        for _ in range(warmup):
            fn()
        each = (now() - start) / warmup
        counts[label] = max(5, int(seconds / max(each, 1e-7)))
    samples: dict = {label: [] for label in fns}
    for _ in range(repeats):
        for label, fn in fns.items():
            calls = counts[label]
            start = now()
            for _ in range(calls):
                fn()
            samples[label].append((now() - start) / calls * 1e6)
    return {label: {"median_us": round(statistics.median(s), 2), "min_us": round(min(s), 2)}
            for label, s in samples.items()}


def one_call_us(fn, clock: str = "thread") -> float:
    now = CLOCKS[clock]
    start = now()
    fn()
    return (now() - start) * 1e6
