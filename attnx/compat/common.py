"""Checks shared by the compatibility entry points: float arguments and dropout."""
from __future__ import annotations

import math
import numbers

import torch

from ..errors import InvalidTypeError
from .errors import CompatArgumentError


def real_as_float(value):
    """``value`` as a Python float when it is a real number (Python, NumPy, a 0-dim real tensor); else unchanged.

    torch's and flash-attn's float arguments take all of these; attnx's own checks take Python floats.
    """
    if type(value) is float:
        return value
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
        return float(value)
    return float(value) if isinstance(value, numbers.Real) else value


def as_float(value, name: str, api: str) -> float:
    """``value`` as a Python float, accepting what torch's and flash-attn's float arguments accept.

    Python and NumPy numbers (``np.float32(0.5)``, ints, bools) and 0-dim real tensors (read with
    one host sync, as torch's own argument parser does); anything else is an `InvalidTypeError`.
    """
    converted = real_as_float(value)
    if type(converted) is not float:
        raise InvalidTypeError(f"{api}: `{name}` must be a float, got {value!r}")
    return converted


def check_no_dropout(dropout_p, api: str) -> None:
    """attnx has no dropout: ``dropout_p`` must be 0 (a clear error otherwise, never a silent no-op)."""
    dropout_p = as_float(dropout_p, "dropout_p", api)
    if dropout_p != 0 or math.isnan(dropout_p):
        raise CompatArgumentError(
            f"{api}: dropout_p={dropout_p} is not supported: attnx computes exact attention without dropout. "
            "Pass dropout_p=0.0 (e.g. model.eval(), or an attention-dropout probability of 0 for training).")
