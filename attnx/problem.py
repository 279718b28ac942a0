"""The frozen record of one attention call, and the validation that builds it.

`Problem` holds the call's signature (no tensors), so dispatch decisions can be
cached on it. `make_problem` checks every argument of SPEC.md and raises a typed
error naming the argument before any kernel runs.
"""
from __future__ import annotations

import math
import operator
from typing import NamedTuple, Optional

import torch

from .capability import device_arch
from .errors import InvalidArgumentError, InvalidTypeError

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
LAYOUTS = ("bhsd", "bshd")


class Problem(NamedTuple):
    """Signature of an attention call; every backend decides from it alone.

    Sizes are in the ``bhsd`` sense whatever the layout. ``window_left`` and
    ``window_right`` already include ``causal`` (``None`` = unbounded).
    """

    device_type: str          # "cpu", "cuda", "mps", ...
    vendor: str               # "cpu", "nvidia", "amd", "apple", "other"
    arch: str                 # "sm_90", "gfx942", "cpu", ...
    dtype: torch.dtype
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    head_dim_v: int
    layout: str
    causal: bool
    window_left: Optional[int]
    window_right: Optional[int]
    mask_kind: Optional[str]  # None, "bool" or "additive"
    mask_shape: Optional[tuple]  # the mask's shape left-padded to 4-D
    mask_requires_grad: bool
    has_alibi: bool
    softcap: Optional[float]
    scale: float
    needs_grad: bool
    # torch.use_deterministic_algorithms(True) while gradients are needed: the backward
    # must give bitwise-identical results run to run (no floating-point atomics)
    deterministic: bool = False

    @property
    def capability(self) -> Optional[tuple[int, int]]:
        """NVIDIA compute capability as (major, minor), else None."""
        if self.arch.startswith("sm_"):
            digits = self.arch[3:].rstrip("a")
            return int(digits[:-1]), int(digits[-1])
        return None

    @property
    def is_causal_only(self) -> bool:
        """True when the only positional mask is the causal one."""
        return self.window_left is None and self.window_right == 0

    @property
    def has_window(self) -> bool:
        return self.window_left is not None or self.window_right is not None

    @property
    def group_size(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def key_offset(self) -> int:
        """Aligned position of query i is ``i + key_offset`` (bottom-right alignment)."""
        return self.seqlen_k - self.seqlen_q


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise InvalidArgumentError(f"`{name}` must be 4-D (B, H, S, D) or (B, S, H, D), got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise InvalidTypeError(f"`{name}` must be float16, bfloat16, float32 or float64, got {t.dtype}")


def _window_side(name: str, value) -> Optional[int]:
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)  # ints, numpy integers, 0-d integer tensors
    except TypeError:
        raise InvalidTypeError(f"`window` {name} must be an int >= 0 or None, got {value!r}") from None
    if value < 0:
        raise InvalidArgumentError(f"`window` {name} must be >= 0 or None, got {value}")
    return value


def _broadcastable(shape: tuple, target: tuple) -> bool:
    if len(shape) > len(target):
        return False
    for have, want in zip(reversed(shape), reversed(target)):
        if have != want and have != 1:
            return False
    return True


def make_problem(q, k, v, causal=False, window=None, mask=None, scale=None,
                 softcap=None, alibi_slopes=None, layout="bhsd") -> Problem:
    """Validate the arguments of `attnx.attention` and describe the call."""
    _check_tensor("q", q)
    _check_tensor("k", k)
    _check_tensor("v", v)
    if layout not in LAYOUTS:
        raise InvalidArgumentError(f"`layout` must be 'bhsd' or 'bshd', got {layout!r}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise InvalidTypeError(f"`q`, `k` and `v` must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    device = q.device
    if k.device != device or v.device != device:
        raise InvalidArgumentError(f"`q`, `k` and `v` must be on one device, got {device}, {k.device}, {v.device}")
    if layout == "bhsd":
        batch, heads_q, seqlen_q, head_dim = q.shape
        kb, heads_kv, seqlen_k, kd = k.shape
        vb, vh, vs, head_dim_v = v.shape
    else:
        batch, seqlen_q, heads_q, head_dim = q.shape
        kb, seqlen_k, heads_kv, kd = k.shape
        vb, vs, vh, head_dim_v = v.shape
    if kb != batch or vb != batch:
        raise InvalidArgumentError(f"batch sizes of `q`, `k`, `v` differ: {batch}, {kb}, {vb}")
    if min(batch, heads_q, seqlen_q, head_dim, heads_kv, seqlen_k, head_dim_v) < 1:
        empty = next(n for n, t in (("q", q), ("k", k), ("v", v)) if t.numel() == 0)
        raise InvalidArgumentError(
            f"`{empty}` has a zero-size dimension: every size must be >= 1; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)} ({layout})")
    if kd != head_dim:
        raise InvalidArgumentError(f"`k` head dim must equal `q` head dim {head_dim}, got {kd}")
    if vh != heads_kv or vs != seqlen_k:
        raise InvalidArgumentError(
            f"`v` must have the heads and sequence length of `k` ({heads_kv}, {seqlen_k}), got ({vh}, {vs})")
    if heads_q % heads_kv:
        raise InvalidArgumentError(f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv})")

    if not isinstance(causal, bool):
        raise InvalidTypeError(f"`causal` must be a bool, got {causal!r}")
    window_left = window_right = None
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise InvalidTypeError(f"`window` must be a (left, right) pair, got {window!r}")
        window_left = _window_side("left", window[0])
        window_right = _window_side("right", window[1])
    if causal:
        window_right = 0 if window_right is None else min(window_right, 0)

    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    else:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise InvalidTypeError(f"`scale` must be a float, got {scale!r}")
        scale = float(scale)
        if not math.isfinite(scale):
            raise InvalidArgumentError(f"`scale` must be finite, got {scale}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise InvalidTypeError(f"`softcap` must be a float > 0 or None, got {softcap!r}")
        softcap = float(softcap)
        if not (softcap > 0 and math.isfinite(softcap)):
            raise InvalidArgumentError(f"`softcap` must be a finite float > 0 or None, got {softcap}")

    mask_kind = mask_shape = None
    mask_requires_grad = False
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise InvalidTypeError(f"`mask` must be a torch.Tensor or None, got {type(mask).__name__}")
        if mask.dtype == torch.bool:
            mask_kind = "bool"
        elif mask.dtype.is_floating_point:
            mask_kind = "additive"
            mask_requires_grad = mask.requires_grad
        else:
            raise InvalidTypeError(f"`mask` must be bool (True = may attend) or floating (additive), got {mask.dtype}")
        if mask.device != device:
            raise InvalidArgumentError(f"`mask` must be on {device}, got {mask.device}")
        target = (batch, heads_q, seqlen_q, seqlen_k)
        if not _broadcastable(tuple(mask.shape), target):
            raise InvalidArgumentError(
                f"`mask` of shape {tuple(mask.shape)} does not broadcast to (B, Hq, Sq, Sk) = {target}")
        mask_shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)

    has_alibi = alibi_slopes is not None
    if has_alibi:
        if not isinstance(alibi_slopes, torch.Tensor):
            raise InvalidTypeError(f"`alibi_slopes` must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
        if alibi_slopes.dtype != torch.float32:
            raise InvalidTypeError(f"`alibi_slopes` must be float32, got {alibi_slopes.dtype}")
        if tuple(alibi_slopes.shape) not in ((heads_q,), (batch, heads_q)):
            raise InvalidArgumentError(
                f"`alibi_slopes` must have shape (Hq,) = ({heads_q},) or (B, Hq) = ({batch}, {heads_q}), "
                f"got {tuple(alibi_slopes.shape)}")
        if alibi_slopes.device != device:
            raise InvalidArgumentError(f"`alibi_slopes` must be on {device}, got {alibi_slopes.device}")

    grad_enabled = torch.is_grad_enabled()
    mask_requires_grad = mask_requires_grad and grad_enabled
    needs_grad = grad_enabled and (q.requires_grad or k.requires_grad or v.requires_grad or mask_requires_grad)
    vendor, arch = device_arch(device)
    deterministic = needs_grad and torch.are_deterministic_algorithms_enabled()
    return Problem(device.type, vendor, arch, q.dtype, batch, heads_q, heads_kv, seqlen_q, seqlen_k,
                   head_dim, head_dim_v, layout, causal, window_left, window_right, mask_kind, mask_shape,
                   mask_requires_grad, has_alibi, softcap, scale, needs_grad, deterministic)
