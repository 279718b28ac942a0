"""Problems of plain dense calls already validated: `make_call`'s fast path for repeated calls.

A plain call gives q, k and v (plain ``torch.Tensor``s) and at most ``layout``, ``causal``, a
float ``scale`` and ``deterministic`` (a bool or None): no mask, window, offset, softcap, ALiBi,
sinks or index tensors. Everything `make_call` checks for such a call, and every field of its
`Problem`, is a function of the key below (shapes, dtypes, devices, the options, and the
gradient state autograd decides, with whether the backward must be deterministic: the call's
``deterministic=True`` or ``torch.use_deterministic_algorithms``), so a key seen before maps to
the same `Problem` without validating again. Only calls that passed validation are remembered: a bad call never
matches one (its key differs in the shape, dtype, device or option that makes it bad).

From a key's second call on, `attnx.attention` replaces its `Problem` by a `Run`: the Problem,
the backend that ran it and the dispatch state it was chosen under (the `use_backend` /
ATTNX_BACKEND restriction and the registry's generation). A later call whose dispatch state is
unchanged runs that backend without the options dict, `make_call` or the dispatcher; one dict
lookup serves every path (a decode loop whose Sk grows never repeats a key and pays for no Run).

Such a decode step is a sibling (`sibling`): its key differs from a validated one only in k's and
v's sequence length, so it takes that Problem with ``seqlen_k`` replaced, without validating again,
and the dispatcher decides for it as for any new problem.

Why: a small CPU call (B=1, H=8, S=128, D=64) spends about 300 µs in the kernel, which leaves
the caches cold for the Python that follows; full validation then costs 25-35 µs, the lookup
below a few (benchmarks/results/cpu-2026-12-01-overhead2 and -overhead3).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

_LIMIT = 1024
_memo: dict = {}  # key -> its Problem (validated) or, from its second call on, a Run (holding the Problem)
_Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled  # (module-level names: one lookup each on the hot path)


class Run(NamedTuple):
    """What ran a remembered plain call, and the dispatch state that decision holds for."""

    problem: object          # the call's `Problem` (never empty: empty calls need no backend)
    forced: Optional[str]    # the call's `backend` argument
    allowed: Optional[tuple]  # `selection.allowed_backends()` when it was chosen
    generation: int          # `registry.generation()` when it was chosen
    backend: object          # the backend object `dispatch.choose` returned
    # bhsd without gradients: the whole call as ``direct(q, k, v) -> (out, lse)`` (`Backend.dense_forward`,
    # else `backend.forward` with an `Inputs`); None: `autograd.run`
    direct: Optional[Callable]


_NOT_PLAIN = (None, None)


def lookup(q, k, v, layout, causal, scale, deterministic=None, wants_lse=True, backend=None) -> tuple:
    """``(key, entry)`` of a call whose other arguments are all None, or ``(None, None)`` when it is
    not plain: its memo key and what is remembered for it (its `Problem`, a `Run` the caller
    checks, or None). One frame for both: `attnx.attention` runs this on every plain call.

    The key holds the forced `backend` name (None or a str) too: a call site forcing a backend and
    one that does not, alternating on one signature, each keep their own Run."""
    if type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor:
        return _NOT_PLAIN  # subclasses (Parameters, fake or wrapper tensors) take the full path
    if causal is not True and causal is not False:
        return _NOT_PLAIN
    if scale is not None and type(scale) is not float:
        return _NOT_PLAIN
    if type(layout) is not str:
        return _NOT_PLAIN
    if deterministic is not None and deterministic is not True and deterministic is not False:
        return _NOT_PLAIN  # (the full path raises its typed error)
    grads = None
    if _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        # what `make_call` makes of `deterministic`: False and None leave torch's switch in charge
        grads = (q.requires_grad, k.requires_grad, v.requires_grad,
                 deterministic is True or torch.are_deterministic_algorithms_enabled())
    # the tensors' layouts too: a sparse q of a remembered shape must meet the full path's typed error
    key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, q.layout, k.layout,
           v.layout, layout, causal, scale, grads, wants_lse is True, backend)
    return key, _memo.get(key)


# -- siblings: a call never seen whose key differs from a validated one only in k's and v's length ----------
_siblings: dict = {}  # sibling key -> a `Problem` validated for a key of that family (any key length)


def _sibling_key(key: tuple) -> Optional[tuple]:
    """The key without k's and v's sequence length: the one field a decode step changes. None unless k and
    v are 4-D with one length (any other pair takes the full path, which raises for a mismatch)."""
    k_shape, v_shape = key[1], key[2]
    if len(k_shape) != 4 or len(v_shape) != 4:
        return None
    seq, heads = (1, 2) if key[12] == "bshd" else (2, 1)
    if v_shape[seq] != k_shape[seq]:
        return None
    return (key[0], k_shape[0], k_shape[heads], k_shape[3], v_shape[0], v_shape[heads], v_shape[3]) + key[3:]


def sibling(key: tuple):
    """The `Problem` of a key never seen whose sibling (`_sibling_key`) was validated, else None.

    Of a plain call's k and v lengths `make_call` checks only that they are equal, and the `Problem`
    holds them only as ``seqlen_k``: the sibling's Problem with that field replaced is what validating
    again would give (tests/test_call_overhead_siblings.py compares them)."""
    sibling_key = _sibling_key(key)
    known = None if sibling_key is None else _siblings.get(sibling_key)
    if known is None:
        return None
    seqlen_k = key[1][1 if key[12] == "bshd" else 2]
    return known if known.seqlen_k == seqlen_k else known.with_seqlen_k(seqlen_k)


def remember_validated(key: tuple, problem) -> None:
    """Remember the `Problem` `make_call` validated for a plain call's key, for its siblings too."""
    remember(key, problem)
    sibling_key = _sibling_key(key)
    if sibling_key is not None:
        if len(_siblings) >= _LIMIT:
            _siblings.clear()
        _siblings[sibling_key] = problem


def problem_of(entry):
    """The `Problem` of a remembered entry (a Problem, or a Run holding one); None for None."""
    return entry.problem if type(entry) is Run else entry


def recall(key: tuple):
    """The `Problem` validated for this key before, or None."""
    return problem_of(_memo.get(key))


def remember(key: tuple, entry) -> None:
    """Remember a key's `Problem`, or the `Run` that ran it (which replaces the Problem)."""
    if len(_memo) >= _LIMIT:
        _memo.clear()
    _memo[key] = entry


def runs() -> list:
    """The remembered `Run`s (for tests and benchmarks)."""
    return [entry for entry in list(_memo.values()) if type(entry) is Run]


def clear() -> None:
    _memo.clear()
    _siblings.clear()
