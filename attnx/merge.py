"""`merge`: exact attention over a union of disjoint key sets from the parts' ``(out, lse)``."""
from __future__ import annotations

from typing import Sequence

import torch

from .errors import InvalidArgumentError, InvalidTypeError
from .problem import FLOAT_DTYPES, check_strided

_LAYOUTS = ("bhsd", "bshd", "varlen")


def _lse_as_out(lse: torch.Tensor, layout: str) -> torch.Tensor:
    """``lse`` reshaped to broadcast against ``out`` (a trailing dim of 1)."""
    if layout == "bhsd":
        return lse.unsqueeze(-1)                      # (B, H, S) -> (B, H, S, 1)
    if layout == "bshd":
        return lse.transpose(1, 2).unsqueeze(-1)      # (B, H, S) -> (B, S, H, 1)
    return lse.transpose(0, 1).unsqueeze(-1)          # (H, T) -> (T, H, 1)


def merge(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor], *, layout: str = "bhsd"):
    """Combine partial attention results over disjoint key sets into the exact result.

    ``outs[i]``/``lses[i]`` are what `attnx.attention(..., return_lse=True)` returned for
    the same queries against the i-th key set. Returns ``(out, lse)``: ``lse`` is the
    log-sum-exp of the parts, and ``out`` their average weighted by ``exp(lse_i - lse)``;
    a row no part saw gives ``out = 0``, ``lse = -inf``, and a part's row with ``lse = -inf`` adds
    nothing whatever its ``out`` holds (NaN or garbage in an unwritten workspace). A NaN ``lse``
    propagates and ``+inf`` gives NaN (flash-attn 2 returns ``+inf`` for a row without keys: map
    it to ``-inf`` before merging such parts, as vLLM does). Differentiable in every input.
    ``layout`` is the outs' layout: ``"bhsd"``, ``"bshd"`` or ``"varlen"`` (``(T, H, Dv)``
    with lse ``(H, T)``). Used by split-KV decoding, ring attention and shared prefixes.

    Equivalent PyTorch::

        lse = torch.logsumexp(torch.stack(lses), dim=0)
        out = sum(torch.exp(l - lse)[..., None] * o for o, l in zip(outs, lses))  # bhsd
    """
    outs, lses = _checked_parts(outs, lses, layout)
    acc = torch.float64 if outs[0].dtype == torch.float64 else torch.float32
    stacked = torch.stack([l.to(acc) for l in lses])
    # log-sum-exp written out so rows no part saw (every lse -inf) give -inf with zero, not NaN, gradients
    top = stacked.amax(dim=0)
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    total = torch.exp(stacked - top).sum(dim=0)
    seen = total != 0  # NaN counts as seen, so it propagates
    lse = torch.where(seen, top + torch.log(torch.where(seen, total, torch.ones_like(total))),
                      torch.full_like(total, float("-inf")))
    # weights exp(l - top) / total, not exp(l - lse): l - top is exact where parts' lses are close, while
    # lse = top + log(total) rounds to lse's ulp (about 1e-3 at lse = 1e4 in float32)
    total = torch.where(seen, total, torch.ones_like(total))
    out = None
    for o, l in zip(outs, lses):
        l = l.to(acc)
        # a part's row with lse = -inf saw no key: it adds nothing, whatever its out holds (an unwritten
        # split-KV workspace, NaN or inf), where 0 * NaN would give NaN (and NaN gradients)
        o = torch.where(_lse_as_out(l == float("-inf"), layout), torch.zeros((), dtype=acc, device=o.device), o.to(acc))
        term = _lse_as_out(torch.exp(l - top) / total, layout) * o
        out = term if out is None else out + term
    return out.to(outs[0].dtype), lse


_RANKS = {"bhsd": (4, 3), "bshd": (4, 3), "varlen": (3, 2)}  # layout -> (out rank, lse rank)


def _as_list(name: str, parts) -> list:
    """`parts` (a list or tuple of tensors, one per part) as a list; a lone tensor is an error, not parts."""
    if isinstance(parts, (torch.Tensor, str, bytes)) or parts is None:
        raise InvalidTypeError(f"`{name}` must be a list of tensors (one per part), got {type(parts).__name__}")
    try:
        return list(parts)
    except TypeError:
        raise InvalidTypeError(f"`{name}` must be a list of tensors (one per part), got {type(parts).__name__}") \
            from None


def _checked_parts(outs, lses, layout) -> tuple[list, list]:
    """Every argument of `merge` checked, with a typed error naming it, before any arithmetic."""
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise InvalidArgumentError(f"`layout` must be one of {', '.join(_LAYOUTS)}, got {layout!r}")
    outs, lses = _as_list("outs", outs), _as_list("lses", lses)
    if not outs or len(outs) != len(lses):
        raise InvalidArgumentError(f"`outs` and `lses` must be non-empty and of one length, got {len(outs)} "
                                   f"and {len(lses)}")
    out_rank, lse_rank = _RANKS[layout]
    for i, (o, l) in enumerate(zip(outs, lses)):
        for name, t, rank in (("outs", o, out_rank), ("lses", l, lse_rank)):
            if not isinstance(t, torch.Tensor):
                raise InvalidTypeError(f"part {i}: `{name}` must hold tensors, got {type(t).__name__}")
            check_strided(name, t)
            if t.dtype not in FLOAT_DTYPES:
                raise InvalidTypeError(f"part {i}: `{name}` must hold float16, bfloat16, float32 or float64 "
                                       f"tensors, got {t.dtype}")
            if t.dim() != rank:
                raise InvalidArgumentError(f"part {i}: `{name}` must hold {rank}-D tensors in layout {layout!r}, "
                                           f"got shape {tuple(t.shape)}")
            if t.device != outs[0].device:
                raise InvalidArgumentError(f"part {i}: `{name}` must be on {outs[0].device} (part 0's out), "
                                           f"got {t.device}")
        if o.shape != outs[0].shape or l.shape != lses[0].shape or o.dtype != outs[0].dtype:
            raise InvalidArgumentError(f"part {i}: shapes or dtype differ from part 0 ({tuple(o.shape)} vs "
                                       f"{tuple(outs[0].shape)}, {tuple(l.shape)} vs {tuple(lses[0].shape)})")
        if _lse_as_out(l, layout).shape[:-1] != o.shape[:-1]:
            raise InvalidArgumentError(f"part {i}: lse {tuple(l.shape)} does not match out {tuple(o.shape)} "
                                       f"in layout {layout!r}")
    return outs, lses
