"""Checks shared by the compatibility entry points: dropout."""
from __future__ import annotations

import math

from ..errors import InvalidTypeError
from .errors import CompatArgumentError


def check_no_dropout(dropout_p, api: str) -> None:
    """attnx has no dropout: ``dropout_p`` must be 0 (a clear error otherwise, never a silent no-op)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise InvalidTypeError(f"{api}: `dropout_p` must be a float, got {dropout_p!r}")
    if dropout_p != 0 or math.isnan(dropout_p):
        raise CompatArgumentError(
            f"{api}: dropout_p={dropout_p} is not supported: attnx computes exact attention without dropout. "
            "Pass dropout_p=0.0 (e.g. model.eval(), or an attention-dropout probability of 0 for training).")
