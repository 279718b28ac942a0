"""Checks shared by the compatibility entry points: dropout, and a deterministic backward on request."""
from __future__ import annotations

import contextlib
import math

from .. import registry
from ..errors import InvalidTypeError, NoBackendError
from ..problem import make_problem
from ..selection import allowed_backends, use_backend
from .errors import CompatArgumentError


def check_no_dropout(dropout_p, api: str) -> None:
    """attnx has no dropout: ``dropout_p`` must be 0 (a clear error otherwise, never a silent no-op)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise InvalidTypeError(f"{api}: `dropout_p` must be a float, got {dropout_p!r}")
    if dropout_p != 0 or math.isnan(dropout_p):
        raise CompatArgumentError(
            f"{api}: dropout_p={dropout_p} is not supported: attnx computes exact attention without dropout. "
            "Pass dropout_p=0.0 (e.g. model.eval(), or an attention-dropout probability of 0 for training).")


def deterministic_backends(q, k, v, **options):
    """A context that restricts dispatch to backends whose backward is deterministic for this call.

    flash-attn's ``deterministic=True``. The backends allowed already (`attnx.use_backend`,
    ATTNX_BACKEND) are narrowed to those that accept the problem with a deterministic
    backward; without gradients to compute any backend will do.
    """
    p = make_problem(q, k, v, **options)
    if not p.needs_grad or p.is_empty:
        return contextlib.nullcontext()
    strict = p._replace(deterministic=True)
    allowed = allowed_backends()
    backends = {n: b for n, b in registry.registered_backends().items() if allowed is None or n in allowed}
    reasons = {n: b.reasons(strict) for n, b in backends.items()}
    names = [n for n, why in reasons.items() if not why]
    if not names:
        raise NoBackendError("deterministic=True: no allowed backend has a deterministic backward for this problem",
                             reasons)
    return use_backend(names)
