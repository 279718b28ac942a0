"""A small conformance subset on every available backend (``python -m attnx.doctor --selftest``)."""
from __future__ import annotations

import time

from .conformance.runner import available_backends, default_device, run_cases, select_cases
from .registry import get_backend

# Short sequences keep the selftest to seconds per backend, also under the Triton interpreter.
SELFTEST_MAX_SEQLEN = 128
SELFTEST_CASES = 12


def _spread(cases: list, count: int) -> list:
    """`count` cases spread evenly over the grid, so every part of it is sampled."""
    if len(cases) <= count:
        return cases
    step = len(cases) / count
    return [cases[int(i * step)] for i in range(count)]


def run_selftest() -> dict:
    """{backend name: {"passed", "summary", "failures"}} for every backend that can run here."""
    results = {}
    for name in available_backends():
        backend = get_backend(name)
        device = default_device(backend)
        cases = _spread(select_cases(name, "quick", max_seqlen=SELFTEST_MAX_SEQLEN, device=device), SELFTEST_CASES)
        start = time.perf_counter()
        outcome = run_cases(name, cases, device)
        failed = [r for r in outcome if r.status == "fail"]
        ran = sum(r.status == "pass" for r in outcome)
        declined = sum(r.status == "declined" for r in outcome)
        results[name] = {
            "passed": not failed,
            "summary": f"{ran} passed, {len(failed)} failed, {declined} declined on {device} "
                       f"in {time.perf_counter() - start:.1f}s",
            "failures": [f"{r.case.id}: {r.summary()}" for r in failed],
        }
    return results
