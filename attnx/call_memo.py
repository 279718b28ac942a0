"""Problems of plain dense calls already validated: `make_call`'s fast path for repeated calls.

A plain call gives q, k and v (plain ``torch.Tensor``s) and at most ``layout``, ``causal`` and a
float ``scale``: no mask, window, offset, softcap, ALiBi, sinks or index tensors. Everything
`make_call` checks for such a call, and every field of its `Problem`, is a function of the key
below (shapes, dtypes, devices, the three options, and the gradient state autograd and
``torch.use_deterministic_algorithms`` decide), so a key seen before maps to the same `Problem`
without validating again. Only calls that passed validation are remembered: a bad call never
matches one (its key differs in the shape, dtype, device or option that makes it bad).

Why: a small CPU call (B=1, H=8, S=128, D=64) spends about 300 µs in the kernel, which leaves
the caches cold for the Python that follows; full validation then costs 25-35 µs, the lookup
below a few (benchmarks/results/cpu-2026-12-01-overhead2).
"""
from __future__ import annotations

from typing import Optional

import torch

_LIMIT = 1024
_memo: dict = {}
_Tensor = torch.Tensor


def plain_key(q, k, v, layout, causal, scale, rest: tuple) -> Optional[tuple]:
    """The memo key of a plain call, or None when the call is not plain (`rest`: every other argument)."""
    if type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor:
        return None  # subclasses (Parameters, fake or wrapper tensors) take the full path
    if causal is not True and causal is not False:
        return None
    if scale is not None and type(scale) is not float:
        return None
    if type(layout) is not str:
        return None
    for arg in rest:
        if arg is not None:
            return None
    grads = None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        grads = (q.requires_grad, k.requires_grad, v.requires_grad, torch.are_deterministic_algorithms_enabled())
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, layout, causal,
            scale, grads)


def recall(key: tuple):
    """The `Problem` validated for this key before, or None."""
    return _memo.get(key)


def remember(key: tuple, problem) -> None:
    if len(_memo) >= _LIMIT:
        _memo.clear()
    _memo[key] = problem


def clear() -> None:
    _memo.clear()
