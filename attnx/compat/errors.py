"""The errors the compatibility entry points raise where torch or flash-attn raise a RuntimeError."""
from __future__ import annotations

from ..errors import InvalidArgumentError, InvalidTypeError


class CompatArgumentError(InvalidArgumentError, RuntimeError):
    """An argument the mirrored API rejects (torch's SDPA raises RuntimeError for these).

    Both an `attnx.InvalidArgumentError` (a ValueError) and a ``RuntimeError``, so code
    written against torch (``except RuntimeError``) and code written against attnx both
    catch it.
    """


class CompatTypeError(InvalidTypeError, RuntimeError):
    """A tensor dtype the mirrored API rejects with a RuntimeError (mixed or integer dtypes in SDPA).

    Both an `attnx.InvalidTypeError` (a TypeError) and a ``RuntimeError``, for the same reason
    as `CompatArgumentError`.
    """
