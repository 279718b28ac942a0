"""flash-attn 2.x argument conventions turned into `attnx.attention` options.

* ``window_size=(left, right)``: a negative side is unbounded (flash-attn's ``-1``);
* ``softcap=0.0`` (or below) means no softcap;
* ``softmax_scale=None`` is ``1 / sqrt(headdim)``; float arguments take NumPy numbers too, as flash-attn;
* ``causal`` and windows are aligned bottom-right, attnx's default (``offset=None``);
* ``alibi_slopes``: ``(nheads,)`` or ``(batch, nheads)`` float32, as attnx takes them.
"""
from __future__ import annotations

import operator

from ..errors import InvalidTypeError
from .common import as_float, check_no_dropout, real_as_float


def window(window_size) -> tuple:
    """``(left, right)`` with None for flash-attn's negative (unbounded) sides."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise InvalidTypeError(f"`window_size` must be a (left, right) pair, got {window_size!r}")
    sides = []
    for side in window_size:
        try:
            side = operator.index(side)
        except TypeError:
            raise InvalidTypeError(f"`window_size` sides must be ints, got {window_size!r}") from None
        sides.append(None if side < 0 else side)
    return tuple(sides)


def softcap(value, api: str):
    """None for flash-attn's ``softcap <= 0`` (deactivated), else the cap (any real number, as flash-attn takes)."""
    value = as_float(value, "softcap", api)
    return None if value <= 0 else value


def options(api: str, *, dropout_p, softmax_scale, causal, window_size, softcap_value, alibi_slopes) -> dict:
    """`attnx.attention` keyword options for one flash-attn call (after checking ``dropout_p``)."""
    check_no_dropout(dropout_p, api)
    if not isinstance(causal, bool):
        raise InvalidTypeError(f"{api}: `causal` must be a bool, got {causal!r}")
    left, right = window(window_size)
    return dict(causal=causal, window=None if (left, right) == (None, None) else (left, right),
                scale=None if softmax_scale is None else real_as_float(softmax_scale),
                softcap=softcap(softcap_value, api), alibi_slopes=alibi_slopes)
