"""Which backends and device to test here, and running a list of cases."""
from __future__ import annotations

import os
from typing import Callable, Iterable, Optional

import torch

import attnx
from attnx.problem import Problem

from .cases import Case, generate_cases
from .check import Result, run_case


def default_device(backend) -> str:
    """cuda when the backend runs there and a GPU is present; else cpu (also under TRITON_INTERPRET=1)."""
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if not interpreting and torch.cuda.is_available() and "cuda" in backend.device_types:
        return "cuda"
    if "cpu" in backend.device_types or interpreting:
        return "cpu"
    return "cuda"


def device_problem(backend, device: str) -> Optional[str]:
    """Why `backend` cannot be tested on `device` at all, or None."""
    if not backend.available:
        return f"backend {backend.name!r} is unavailable here: " + "; ".join(backend.unavailable_reasons)
    kind = torch.device(device).type
    if kind == "cuda" and not torch.cuda.is_available():
        return "no CUDA device on this machine"
    if kind not in backend.device_types:
        return f"backend {backend.name!r} does not run on {kind} (declares {', '.join(sorted(backend.device_types))})"
    return None


def available_backends() -> list[str]:
    """Registered backends that can run on this machine, on their default device."""
    names = []
    for name, backend in attnx.registered_backends().items():
        if device_problem(backend, default_device(backend)) is None:
            names.append(name)
    return names


def declarations_on(backend, device: Optional[str] = None):
    """`backend`'s declarations on `device` (default: the CPU's): what the grid is generated from.

    A backend whose declarations differ by device (`Backend.device_declarations`) gets the grid of
    what it computes there; the device's classes are those of any problem on it.
    """
    probe = Problem.create(device=device or "cpu", dtype=torch.float32, batch=1, heads_q=1, seqlen_q=1, head_dim=1)
    return backend.declarations(probe.device_classes)


def select_cases(backend_name: str, profile: str, *, max_seqlen: Optional[int] = None,
                 match: Optional[str] = None, device: Optional[str] = None) -> list[Case]:
    """The grid generated from a backend's declarations on `device` (default: the CPU's), optionally
    without cases longer than `max_seqlen` or whose id lacks the substring `match`."""
    cases = generate_cases(declarations_on(attnx.get_backend(backend_name), device), profile)
    if max_seqlen is not None:
        cases = [c for c in cases if max(c.seqlen_q, c.seqlen_k) <= max_seqlen]
    if match:
        cases = [c for c in cases if match in c.id]
    return cases


def run_cases(backend_name: str, cases: Iterable[Case], device: str, *, allow_extra_declines: bool = False,
              progress: Optional[Callable[[Result], None]] = None, calls_only: bool = False) -> list[Result]:
    results = []
    for case in cases:
        result = run_case(backend_name, case, device, allow_extra_declines=allow_extra_declines,
                          calls_only=calls_only)
        results.append(result)
        if progress is not None:
            progress(result)
    return results
