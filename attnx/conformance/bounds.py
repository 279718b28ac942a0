"""Error bounds (docs/semantics.md, Accuracy), in one place.

All errors are max abs errors against a float64 evaluation of the formula on the same inputs.

* float64 inputs: out <= 1e-10.
* float32 inputs: out <= 1e-4 (5e-3 for a backend that declares ``uses_tf32 = True``), OR <= 2 x the
  error of the naive backend (float32 accumulation, the contract's accumulation rule) on the same
  inputs, whichever is larger; gradients likewise (the fixed part times ``max(1, max |reference|)``,
  below). The fixed part is what float32 gives on ordinary inputs; the naive part covers inputs where
  float32 itself cannot do better: large logits (scale * |q.k| in the tens: a logit's float32
  rounding, amplified by exp, reaches 1e-4 in out) and gradients whose ``dP - delta`` cancels
  exactly (one key: the reference gradient is 0, each float32 dot product is not). The naive error
  is computed only for a quantity over its fixed bound (`NAIVE_FACTOR`, `float32_naive_bound`), and
  never for the naive backend itself, which is held to the fixed bound. lse keeps its own rule.
* float16 / bfloat16: each quantity <= 2 x the error of the naive formula on the same low-dtype
  inputs + 1e-3, where that error is the larger of (a) the formula computed in the low dtype
  (``attention_reference(..., compute_dtype=low)``, gradients by autograd), as docs/semantics.md says, and
  (b) the naive backend (float32 accumulation, the contract's accumulation rule; FlashAttention-style
  backward with ``delta = rowsum(dout * out)``). (b) matters with large logits: there (a) is often
  exactly 0 (one-hot softmax snaps in fp16), while any float32-accumulating backward, the naive
  backend included, has ~4e-3 gradient error from ``scale`` (~250) amplifying float32 rounding.
* Gradients in float32/float64: the out tolerance times ``max(1, max |reference gradient|)``:
  gradients (dk, dv summed over many queries, dmask) are not bounded by 1 the way ``out`` is.
* dsinks: sinks are float32 for every input dtype, so their gradient's bound is at least 1e-6
  (times its size) also for float64 inputs.
* lse: 1e-6 (float64 inputs; lse is float32 for them), 1e-4 (float32), 1e-3 (float16/bfloat16),
  each plus ``2**-20 * max |lse|``: 16 float32 ulps, since a float32 lse cannot resolve 1e-3
  once |lse| passes 8192 (large-logit cases reach 1e4).
"""
from __future__ import annotations

import math

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)
SLACK_LOW = 1e-3
LSE_ABS = {torch.float64: 1e-6, torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-3}
LSE_REL = 2.0 ** -20
NAIVE_FACTOR = 2.0  # float32: a quantity over its fixed bound passes within this times the naive backend's error
NAIVE_RULE = "2x naive"  # Result.bound_rules' label for a bound that came from the naive backend


def high_precision_tolerance(dtype: torch.dtype, backend) -> float:
    if dtype == torch.float64:
        return 1e-10
    return 5e-3 if backend.uses_tf32 else 1e-4


def bound(name: str, dtype: torch.dtype, backend, ref: torch.Tensor, naive_low_err: float | None) -> float:
    """The bound for quantity `name` ("out", "lse", "dq", "dk", "dv", "dmask")."""
    finite = ref[torch.isfinite(ref)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    if name == "lse":
        return LSE_ABS[dtype] + LSE_REL * scale
    if dtype in LOW_PRECISION:
        if naive_low_err is None or not math.isfinite(naive_low_err):
            # the low-dtype naive formula overflowed: fall back to "no worse than the values' size"
            return 2 * scale + SLACK_LOW
        return 2 * naive_low_err + SLACK_LOW
    tol = high_precision_tolerance(dtype, backend)
    if name == "dsinks":  # sinks are float32 whatever the inputs' dtype: their gradient is float32 too
        tol = max(tol, 1e-6)
    return tol if name == "out" else tol * max(1.0, scale)


def uses_naive_float32(name: str, dtype: torch.dtype, backend_name: str) -> bool:
    """Whether quantity `name` of a float32 problem over its fixed bound may still pass within
    NAIVE_FACTOR x the naive backend's error on the same inputs (never for naive itself, nor lse)."""
    return dtype == torch.float32 and name != "lse" and backend_name != "naive"


def float32_naive_bound(fixed: float, naive_err: float | None) -> float:
    """The float32 bound once the naive backend's error is known: the larger of the fixed bound and
    NAIVE_FACTOR x that error (the fixed bound alone when the naive backend gave no finite error)."""
    if naive_err is None or not math.isfinite(naive_err):
        return fixed
    return max(fixed, NAIVE_FACTOR * naive_err)


def max_abs_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error; inf when `got` is non-finite where `ref` is finite or the infinities differ."""
    got = got.detach().to(torch.float64)
    ref = ref.detach().to(torch.float64)
    if got.shape != ref.shape:
        return math.inf
    both_finite = torch.isfinite(got) & torch.isfinite(ref)
    if not bool((torch.isfinite(got) == torch.isfinite(ref)).all()) or bool(torch.isnan(got).any()):
        return math.inf
    if not bool((got[~both_finite] == ref[~both_finite]).all()):  # -inf vs +inf
        return math.inf
    if not bool(both_finite.any()):
        return 0.0
    return float((got[both_finite] - ref[both_finite]).abs().max())
