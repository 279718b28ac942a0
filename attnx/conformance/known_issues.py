"""Known gaps that explain fuzz failures: the error model's (E*) and open defects' (R*).

A failure one of these explains is reported under its tag, not as a new failure
(`known_issue`); docs/reliability.md describes each.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .check import Result

LOW = ("float16", "bfloat16")
@dataclass(frozen=True)
class KnownIssue:
    """A failure explained by an open defect (R*) or a gap in the error model (E*): docs/reliability.md."""

    tag: str
    summary: str
    matches: Callable[[Result], bool]


def _numeric_failures(result: Result) -> Optional[set]:
    """The quantities over their bound, or None when anything else failed too (a crash, a layout, NaN)."""
    over = {n for n, e in result.errors.items() if not e <= result.bounds.get(n, math.inf)}
    if len(over) != len(result.failures) or not all(math.isfinite(result.errors[n]) for n in over):
        return None
    return over


def _within_ulps(result: Result, ulps: float = 2.0) -> bool:
    """Low precision, and every quantity over its bound by at most `ulps` units of the dtype's epsilon
    at the reference's largest value (the bound's 1e-3 slack is under one bf16 ulp once |value| > 0.13)."""
    if result.case.dtype not in LOW:
        return False
    over = _numeric_failures(result)
    if not over or "lse" in over:  # lse is float32 whatever the inputs: ulps of the input dtype say nothing
        return False
    eps = torch.finfo(result.case.torch_dtype).eps
    return all(result.errors[n] <= result.bounds[n] + ulps * eps * max(1.0, result.magnitudes.get(n, 0.0))
               for n in over)


def _large_logit_gradients(result: Result) -> bool:
    over = _numeric_failures(result)
    return bool(result.case.large_logits and result.case.grad and over and over <= {"dq", "dk", "dsinks"})


def _raised(result: Result, text: str) -> bool:
    return any(f.startswith("raised") and text in f.splitlines()[0] for f in result.failures)


KNOWN_ISSUES = (
    KnownIssue("R3", "naive backend: backward of a packed/cache/paged problem with no sequence (B = 0) raises "
                     "'element 0 of tensors does not require grad' (every backend's fp16/bf16 cases run the naive "
                     "backend for their bound)",
               lambda r: r.case.batch == 0 and not r.case.is_dense and r.case.grad
               and (r.backend == "naive" or r.case.dtype in LOW) and _raised(r, "does not require grad")),
    KnownIssue("R4", "ALiBi slopes of shape (B, 0) (no heads) cannot be reshaped: attnx/autograd.py backend_view "
                     "(packed/cache formats) and attnx/reference.py (the oracle) raise",
               lambda r: r.case.heads_q == 0 and r.case.alibi == "bh" and _raised(r, "cannot reshape tensor of 0")),
    KnownIssue("E1", "low-precision result within 2 ulps of the largest reference value above the bound: the "
                     "bound's absolute 1e-3 slack is below one bf16/fp16 ulp for values above ~0.13/1",
               _within_ulps),
    KnownIssue("E2", "fp16/bf16 gradients at |logits| = 1e4: FlashAttention's dP - rowsum(dO * O) cancels in "
                     "float32 and is multiplied by the (large) scale; the formula's own error does not see it",
               _large_logit_gradients),
)


def known_issue(result: Result) -> Optional[KnownIssue]:
    """The known issue that explains a failed result, or None (a new mismatch)."""
    if result.status != "fail":
        return None
    return next((k for k in KNOWN_ISSUES if k.matches(result)), None)
