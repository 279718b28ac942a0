"""The frozen signature of one attention call, and the one constructor that validates it.

`Problem` holds the call's signature (no tensors), so dispatch decisions can be
cached on it. `Problem.create` is the only way to build one (keyword-only; it folds
``causal`` into the window, resolves the default scale and checks every scalar
option). `make_call` checks the tensors of `attnx.attention` against the contract
in docs/semantics.md, raising a typed error naming the argument before any kernel
runs, and returns the `Problem` with the call's `Inputs`.
"""
from __future__ import annotations

import math
import numbers
import operator
from typing import NamedTuple, Optional

import torch

from . import call_memo, index_checks
from .capability import device_arch
from .errors import InvalidArgumentError, InvalidTypeError
from .inputs import Inputs
from .limits import MAX_SEQLEN

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
LAYOUTS = ("bhsd", "bshd")
Q_FORMATS = ("dense", "varlen")
KV_FORMATS = ("dense", "varlen", "cache", "paged")
# (q format, kv format) pairs the contract defines; dense q reads one kv sequence per batch entry
FORMAT_PAIRS = frozenset({("dense", "dense"), ("dense", "cache"), ("dense", "paged"),
                          ("varlen", "varlen"), ("varlen", "cache"), ("varlen", "paged")})


def length_bucket(n: int) -> int:
    """The power of two at or above ``n`` (0 for 0): sizes in one bucket share a dispatch decision."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


class Problem(NamedTuple):
    """Signature of an attention call; every backend decides from it alone.

    Sizes are in the ``bhsd`` sense whatever the layout. For the varlen, cache and
    paged formats ``batch`` is the number of sequences and ``seqlen_q``/``seqlen_k``
    the longest query sequence and the key capacity. ``window_left``/``window_right``
    already include ``causal`` (``None`` = unbounded). ``offset`` is the aligned
    position of query 0 (``None``: bottom-right, ``Sk - Sq`` per sequence).
    Build one with `Problem.create`.
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
    offset: Optional[int]
    mask_kind: Optional[str]     # None, "bool" or "additive"
    mask_shape: Optional[tuple]  # the mask's shape left-padded to 4-D
    mask_requires_grad: bool
    has_alibi: bool
    has_sinks: bool
    softcap: Optional[float]
    scale: float
    needs_grad: bool
    # deterministic=True or torch.use_deterministic_algorithms(True) while gradients are needed:
    # the backward must give bitwise-identical results run to run (no floating-point atomics)
    deterministic: bool
    q_format: str
    kv_format: str
    page_size: Optional[int]     # paged kv only
    # whether the caller uses lse (return_lse, or a backward): False lets a backend skip computing it
    # (its forward may then return None for lse); True by default, always with gradients
    wants_lse: bool = True
    # whether the caller receives lse (return_lse): False when only a backward uses it, so a row's lse
    # matters only through the probabilities it makes (a NaN q row makes its own NaN there)
    returns_lse: bool = True

    @classmethod
    def create(cls, *, dtype: torch.dtype, batch: int, heads_q: int, seqlen_q: int, head_dim: int,
               heads_kv: Optional[int] = None, seqlen_k: Optional[int] = None, head_dim_v: Optional[int] = None,
               device=None, vendor: Optional[str] = None, arch: Optional[str] = None, layout: str = "bhsd",
               causal=False, window=None, offset=None, mask_kind: Optional[str] = None,
               mask_shape: Optional[tuple] = None, mask_requires_grad: bool = False, alibi: bool = False,
               sinks: bool = False, softcap=None, scale=None, needs_grad: bool = False,
               deterministic: Optional[bool] = None, q_format: str = "dense", kv_format: str = "dense",
               page_size: Optional[int] = None, wants_lse: bool = True) -> "Problem":
        """The one constructor: checks and normalises every scalar option.

        ``device`` is a torch device or string (default CPU); ``vendor``/``arch`` override
        what it would report (to describe a GPU that is not here). ``deterministic``
        defaults to torch's setting when gradients are needed.
        """
        device_type, vendor, arch = _device_fields(device, vendor, arch)
        if layout not in LAYOUTS:
            raise InvalidArgumentError(f"`layout` must be 'bhsd' or 'bshd', got {layout!r}")
        if (q_format, kv_format) not in FORMAT_PAIRS:
            raise InvalidArgumentError(f"tensor formats q={q_format!r}, k/v={kv_format!r} are not a valid pair")
        heads_kv = heads_q if heads_kv is None else heads_kv
        seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        if heads_kv > 0 and heads_q % heads_kv:
            raise InvalidArgumentError(f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv})")
        if heads_kv == 0 and heads_q:
            raise InvalidArgumentError(f"{heads_q} query heads need at least one key/value head")
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
        if offset is not None:
            offset = _offset(offset, seqlen_q, seqlen_k, q_format, kv_format)
        if scale is None:
            scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
        else:
            scale = _finite_float("scale", scale)
        if softcap is not None:
            softcap = _finite_float("softcap", softcap)
            if softcap <= 0:
                raise InvalidArgumentError(f"`softcap` must be a finite float > 0 or None, got {softcap}")
        if deterministic is None:
            deterministic = needs_grad and torch.are_deterministic_algorithms_enabled()
        return cls(device_type=device_type, vendor=vendor, arch=arch, dtype=dtype, batch=batch, heads_q=heads_q,
                   heads_kv=heads_kv, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim,
                   head_dim_v=head_dim_v, layout=layout, causal=causal, window_left=window_left,
                   window_right=window_right, offset=offset, mask_kind=mask_kind, mask_shape=mask_shape,
                   mask_requires_grad=bool(mask_requires_grad and needs_grad), has_alibi=bool(alibi),
                   has_sinks=bool(sinks), softcap=softcap, scale=scale, needs_grad=bool(needs_grad),
                   deterministic=bool(deterministic and needs_grad), q_format=q_format, kv_format=kv_format,
                   page_size=page_size, wants_lse=bool(wants_lse or needs_grad), returns_lse=bool(wants_lse))

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
        return self.heads_q // self.heads_kv if self.heads_kv else 1

    @property
    def key_offset(self) -> int:
        """Aligned position of query 0 for the dense format: query ``i`` sits at ``i + key_offset``."""
        return self.seqlen_k - self.seqlen_q if self.offset is None else self.offset

    @property
    def is_dense(self) -> bool:
        return self.q_format == "dense" and self.kv_format == "dense"

    @property
    def is_empty(self) -> bool:
        """No sequence, no head, or (dense) no query or key: the result needs no kernel."""
        if self.batch == 0 or self.heads_q == 0:
            return True
        return self.is_dense and (self.seqlen_q == 0 or self.seqlen_k == 0)

    @property
    def device_classes(self) -> tuple[str, ...]:
        """Keys a backend's priority table is looked up by, most specific first."""
        return (f"{self.device_type}:{self.arch}", f"{self.device_type}:{self.vendor}", self.device_type, "*")

    def with_seqlen_k(self, seqlen_k: int) -> "Problem":
        """This problem with another key length: a dense call's next decode step, which validates as
        this one did (`call_memo.sibling`). Built as a tuple of the same fields (``_replace`` costs ~1 µs)."""
        return _tuple_new(Problem, self[:_SEQLEN_K] + (seqlen_k,) + self[_SEQLEN_K + 1:])

    def bucketed(self) -> "Problem":
        """The problem's dispatch key: lengths and offset rounded to powers of two.

        Priorities are decided on it (so they are constant within a bucket); the dispatcher keeps
        a bucket's order and asks it for each new exact problem, from the top (a decode loop's
        growing Sk asks the chosen backend, and any above it, once per token).
        """
        offset = self.offset
        if offset is not None:
            offset = length_bucket(offset) if offset >= 0 else -length_bucket(-offset)
        mask_shape = self.mask_shape and tuple(length_bucket(n) for n in self.mask_shape)
        return self._replace(seqlen_q=length_bucket(self.seqlen_q), seqlen_k=length_bucket(self.seqlen_k),
                             offset=offset, mask_shape=mask_shape)


_SEQLEN_K = Problem._fields.index("seqlen_k")
_tuple_new = tuple.__new__


# -- scalar options ---------------------------------------------------------------------
def _device_fields(device, vendor, arch) -> tuple[str, str, str]:
    if vendor is not None and arch is not None and isinstance(device, torch.device):
        return device.type, vendor, arch  # the hot path: make_call knows all three
    device = torch.device("cpu" if device is None else device)
    if vendor is None or arch is None:
        found_vendor, found_arch = device_arch(device)
        vendor, arch = vendor or found_vendor, arch or found_arch
    return device.type, vendor, arch


def _integer(name: str, value) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)  # ints, numpy integers, 0-d integer tensors
    except TypeError:
        raise InvalidTypeError(f"{name} must be an int, got {value!r}") from None


_WIDEST_WINDOW = 1 << 62  # far beyond any position (lengths and |offset| < 2**28 for kernels, int64 anyway)


def _window_side(name: str, value) -> Optional[int]:
    if value is None:
        return None
    value = _integer(f"`window` {name}", value)
    if value < 0:
        raise InvalidArgumentError(f"`window` {name} must be >= 0 or None, got {value}")
    # a side past every position is the same window as any other such side: kept within int64, where
    # the backends do their position arithmetic (2**70 raised OverflowError there)
    return min(value, _WIDEST_WINDOW)


def _offset(value, seqlen_q: int, seqlen_k: int, q_format: str, kv_format: str) -> Optional[int]:
    """None (bottom-right) or an int; an int equal to the dense bottom-right offset is stored as None."""
    if value is None:
        return None
    value = _integer("`offset`", value)
    if abs(value) >= MAX_SEQLEN:
        raise InvalidArgumentError(f"`offset` must lie in (-2**28, 2**28), got {value}")
    if q_format == "dense" and kv_format == "dense" and value == seqlen_k - seqlen_q:
        return None
    return value


def _finite_float(name: str, value) -> float:
    # any real number (numpy scalars too, as torch's SDPA takes them); not a bool, a tensor or a str
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or isinstance(value, torch.Tensor):
        raise InvalidTypeError(f"`{name}` must be a float, got {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an int beyond float's range
        raise InvalidArgumentError(f"`{name}` must be finite, got an int of {value.bit_length()} bits") from None
    if not math.isfinite(value):
        raise InvalidArgumentError(f"`{name}` must be finite, got {value}")
    return value


# -- tensors --------------------------------------------------------------------------------
_STRIDED = torch.strided


def check_strided(name: str, t: torch.Tensor) -> None:
    """A dense (strided) tensor: sparse, nested or mkldnn tensors get the typed error, not a kernel's."""
    if t.layout is not _STRIDED or t.is_nested:
        kind = "a nested tensor" if t.is_nested else f"layout {t.layout}"
        raise InvalidTypeError(f"`{name}` must be a dense (strided) torch.Tensor, got {kind}")


def _check_tensor(name: str, t, rank: int, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    check_strided(name, t)
    if t.dim() != rank:
        raise InvalidArgumentError(f"`{name}` must be {rank}-D {what}, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise InvalidTypeError(f"`{name}` must be float16, bfloat16, float32 or float64, got {t.dtype}")


def _check_index(name: str, t, length: Optional[int], device) -> int:
    """An int32 1-D (length given) or 2-D index tensor on `device`; returns its first dim."""
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    check_strided(name, t)
    if t.dtype != torch.int32:
        raise InvalidTypeError(f"`{name}` must be int32, got {t.dtype}")
    want_rank = 1 if length is not None or name != "page_table" else 2
    if t.dim() != want_rank:
        raise InvalidArgumentError(f"`{name}` must be {want_rank}-D, got shape {tuple(t.shape)}")
    if length is not None and t.shape[0] != length:
        raise InvalidArgumentError(f"`{name}` must have {length} entries, got {t.shape[0]}")
    if t.device != device:
        raise InvalidArgumentError(f"`{name}` must be on {device}, got {t.device}")
    return t.shape[0]


def _broadcastable(shape: tuple, target: tuple) -> bool:
    if len(shape) > len(target):
        return False
    return all(have in (want, 1) for have, want in zip(reversed(shape), reversed(target)))


def _max_length(name: str, given, cu: torch.Tensor) -> int:
    if given is not None:
        given = _integer(f"`{name}`", given)
        if given < 0:
            raise InvalidArgumentError(f"`{name}` must be >= 0, got {given}")
        return given
    if cu.is_meta:
        raise InvalidArgumentError(f"`{name}` is needed for packed sequences whose offsets are meta tensors "
                                   f"(their values cannot be read): pass it")
    # one host sync; at least 0 whatever the offsets hold (falling ones are refused where values are read)
    return max(int(cu.long().diff().max().item()), 0) if cu.numel() > 1 else 0


def _unused_length(name: str, given, needs: str) -> None:
    """A longest length given for a format that has none to describe: an error, not silently ignored."""
    if given is not None:
        raise InvalidArgumentError(f"`{name}` describes {needs}; this call has none (got {name}={given!r})")


class _Sizes(NamedTuple):
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    head_dim_v: int
    page_size: Optional[int]


def _sizes(x: Inputs, layout: str, q_format: str, kv_format: str, max_seqlen_q, max_seqlen_k) -> _Sizes:
    """Every size of the call, with the shape checks of each tensor format."""
    q, k, v = x.q, x.k, x.v
    bshd = layout == "bshd"
    if q_format == "varlen":
        _check_tensor("q", q, 3, "(total_q, Hq, D)")
        _, heads_q, head_dim = q.shape
        batch = _check_index("cu_seqlens_q", x.cu_seqlens_q, None, q.device) - 1
        if batch < 0:
            raise InvalidArgumentError("`cu_seqlens_q` needs at least one entry (B + 1 offsets)")
        seqlen_q = _max_length("max_seqlen_q", max_seqlen_q, x.cu_seqlens_q)
    else:
        _check_tensor("q", q, 4, "(B, H, S, D) or (B, S, H, D)")
        batch, seqlen_q, heads_q, head_dim = q.shape if bshd else (q.shape[0], q.shape[2], q.shape[1], q.shape[3])
        _unused_length("max_seqlen_q", max_seqlen_q, "packed queries (`cu_seqlens_q`)")
    if kv_format != "varlen":
        _unused_length("max_seqlen_k", max_seqlen_k, "packed keys (`cu_seqlens_k`)")
    page_size = None
    if kv_format == "varlen":
        for name, t in (("k", k), ("v", v)):
            _check_tensor(name, t, 3, "(total_k, Hkv, D)")
        _check_index("cu_seqlens_k", x.cu_seqlens_k, batch + 1, q.device)
        if k.shape[0] != v.shape[0]:
            raise InvalidArgumentError(f"`k` and `v` must hold the same tokens, got {k.shape[0]} and {v.shape[0]}")
        seqlen_k = _max_length("max_seqlen_k", max_seqlen_k, x.cu_seqlens_k)
        (_, heads_kv, kd), (_, vh, head_dim_v) = k.shape, v.shape
    elif kv_format == "paged":
        for name, t in (("k", k), ("v", v)):
            _check_tensor(name, t, 4, "page pool (num_pages, page_size, Hkv, D)")
        pages, page_size, heads_kv, kd = k.shape
        vp, vps, vh, head_dim_v = v.shape
        if (vp, vps) != (pages, page_size):
            raise InvalidArgumentError(f"`k` and `v` pools differ in pages: {tuple(k.shape)} and {tuple(v.shape)}")
        if page_size < 1:
            raise InvalidArgumentError("`k`/`v` pages must hold at least one token")
        if _check_index("page_table", x.page_table, None, q.device) != batch:
            raise InvalidArgumentError(f"`page_table` must have one row per sequence ({batch}), "
                                       f"got {x.page_table.shape[0]}")
        seqlen_k = x.page_table.shape[1] * page_size
    else:
        for name, t in (("k", k), ("v", v)):
            _check_tensor(name, t, 4, "(B, H, S, D) or (B, S, H, D)")
        (kb, seqlen_k, heads_kv, kd) = k.shape if bshd else (k.shape[0], k.shape[2], k.shape[1], k.shape[3])
        (vb, vs, vh, head_dim_v) = v.shape if bshd else (v.shape[0], v.shape[2], v.shape[1], v.shape[3])
        if kb != batch or vb != batch:
            raise InvalidArgumentError(f"batch sizes of `q`, `k`, `v` differ: {batch}, {kb}, {vb}")
        if vs != seqlen_k:
            raise InvalidArgumentError(f"`v` must have the sequence length of `k` ({seqlen_k}), got {vs}")
    if kv_format in ("cache", "paged"):
        _check_index("seqlens_k", x.seqlens_k, batch, q.device)
    if kd != head_dim:
        raise InvalidArgumentError(f"`k` head dim must equal `q` head dim {head_dim}, got {kd}")
    if vh != heads_kv:
        raise InvalidArgumentError(f"`v` must have the heads of `k` ({heads_kv}), got {vh}")
    if head_dim < 1 or head_dim_v < 1:
        raise InvalidArgumentError(f"head dims must be >= 1, got D={head_dim}, Dv={head_dim_v}")
    if heads_kv == 0 and heads_q == 0:
        heads_kv = 0
    elif heads_kv == 0 or heads_q % heads_kv:
        raise InvalidArgumentError(f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv})")
    return _Sizes(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, head_dim_v, page_size)


def _formats(x: Inputs) -> tuple[str, str]:
    q_format = "varlen" if x.cu_seqlens_q is not None else "dense"
    if x.cu_seqlens_k is not None:
        kv_format = "varlen"
    elif x.page_table is not None:
        kv_format = "paged"
    elif x.seqlens_k is not None:
        kv_format = "cache"
    else:
        kv_format = "dense"
    if (q_format, kv_format) not in FORMAT_PAIRS:
        raise InvalidArgumentError(
            "`cu_seqlens_q` (packed queries) needs packed keys (`cu_seqlens_k`) or a cache (`seqlens_k`, "
            "`page_table`); `cu_seqlens_k` needs `cu_seqlens_q`")
    if kv_format == "paged" and x.seqlens_k is None:
        raise InvalidArgumentError("a paged cache (`page_table`) needs `seqlens_k`, the used length of each sequence")
    if x.cu_seqlens_k is not None and (x.page_table is not None or x.seqlens_k is not None):
        raise InvalidArgumentError("give packed keys (`cu_seqlens_k`) or a cache (`seqlens_k`/`page_table`), not both")
    return q_format, kv_format


def _mask_fields(mask, target: tuple, device, dense: bool):
    if mask is None:
        return None, None
    if not isinstance(mask, torch.Tensor):
        raise InvalidTypeError(f"`mask` must be a torch.Tensor or None, got {type(mask).__name__}")
    check_strided("mask", mask)
    if not dense:
        raise InvalidArgumentError("`mask` needs dense q, k and v (not the varlen, cache or paged formats)")
    if mask.dtype == torch.bool:
        kind = "bool"
    elif mask.dtype.is_floating_point:
        kind = "additive"
    else:
        raise InvalidTypeError(f"`mask` must be bool (True = may attend) or floating (additive), got {mask.dtype}")
    if mask.device != device:
        raise InvalidArgumentError(f"`mask` must be on {device}, got {mask.device}")
    if not _broadcastable(tuple(mask.shape), target):
        raise InvalidArgumentError(f"`mask` of shape {tuple(mask.shape)} does not broadcast to (B, Hq, Sq, Sk) = {target}")
    return kind, (1,) * (4 - mask.dim()) + tuple(mask.shape)


def _check_vector(name: str, t, shapes: tuple, device, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"`{name}` must be a torch.Tensor or None, got {type(t).__name__}")
    check_strided(name, t)
    if t.dtype != torch.float32:
        raise InvalidTypeError(f"`{name}` must be float32, got {t.dtype}")
    if tuple(t.shape) not in shapes:
        raise InvalidArgumentError(f"`{name}` must have shape {what}, got {tuple(t.shape)}")
    if t.device != device:
        raise InvalidArgumentError(f"`{name}` must be on {device}, got {t.device}")


_NO_GRADS = frozenset()


def grad_names(x: Inputs) -> frozenset:
    """Names of the inputs autograd needs gradients for (none while grad mode is off)."""
    if not torch.is_grad_enabled():
        return _NO_GRADS
    names = []
    for name in Inputs.DIFFERENTIABLE:  # a plain loop: torch.compile traces this function
        t = getattr(x, name)
        if t is not None and t.requires_grad and t.is_floating_point():
            names.append(name)
    return frozenset(names) if names else _NO_GRADS


_COMPUTE = object()  # make_call's default: compute the memo key here


def make_call(q, k, v, *, causal=False, window=None, offset=None, mask=None, scale=None, softcap=None,
              alibi_slopes=None, sinks=None, layout="bhsd", cu_seqlens_q=None, cu_seqlens_k=None,
              max_seqlen_q=None, max_seqlen_k=None, seqlens_k=None, page_table=None, deterministic=None,
              grad_inputs=None, memo_key=_COMPUTE, wants_lse=True) -> tuple[Problem, Inputs]:
    """Validate the arguments of `attnx.attention`; return its `Problem` and `Inputs`.

    ``grad_inputs`` names the inputs that need gradients (default: `grad_names`; the
    torch.compile ops pass what they recorded while tracing). ``memo_key``: the call's
    `call_memo.lookup` key, when the caller has looked it up already and found nothing (None: not
    a plain call); the validated `Problem` is remembered under it. ``wants_lse=False``: the caller
    will not use lse (`Problem.wants_lse`; the memo key says it too).
    """
    if wants_lse is not True and wants_lse is not False:
        raise InvalidTypeError(f"`wants_lse` must be a bool, got {wants_lse!r}")
    if memo_key is _COMPUTE:
        memo_key = None
        if (mask is None and window is None and offset is None and softcap is None and alibi_slopes is None
                and sinks is None and cu_seqlens_q is None and cu_seqlens_k is None and max_seqlen_q is None
                and max_seqlen_k is None and seqlens_k is None and page_table is None and grad_inputs is None):
            try:
                memo_key, known = call_memo.lookup(q, k, v, layout, causal, scale, deterministic, wants_lse)
            except RuntimeError:  # a tensor without sizes (nested): the checks below raise the typed error
                memo_key = known = None
            if known is not None:  # a plain call validated before (see call_memo.py)
                return call_memo.problem_of(known), Inputs(q, k, v)
    if layout not in LAYOUTS:
        raise InvalidArgumentError(f"`layout` must be 'bhsd' or 'bshd', got {layout!r}")
    if deterministic is not None and not isinstance(deterministic, bool):
        raise InvalidTypeError(f"`deterministic` must be True, False or None, got {deterministic!r}")
    x = Inputs(q, k, v, mask, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqlens_k, page_table)
    q_format, kv_format = _formats(x)
    # q, k and v on different devices, before the index tensors are held to q's device (an index tensor on
    # k's device would otherwise be blamed for q's); a non-tensor gets its typed error in `_sizes`
    if (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
            and (k.device != q.device or v.device != q.device)):
        raise InvalidArgumentError(f"`q`, `k` and `v` must be on one device, got {q.device}, {k.device}, {v.device}")
    sizes = _sizes(x, layout, q_format, kv_format, max_seqlen_q, max_seqlen_k)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise InvalidTypeError(f"`q`, `k` and `v` must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    device = q.device
    dense = q_format == "dense" and kv_format == "dense"
    target = (sizes.batch, sizes.heads_q, sizes.seqlen_q, sizes.seqlen_k)
    mask_kind, mask_shape = _mask_fields(mask, target, device, dense)
    if alibi_slopes is not None:
        _check_vector("alibi_slopes", alibi_slopes, ((sizes.heads_q,), (sizes.batch, sizes.heads_q)), device,
                      f"(Hq,) = ({sizes.heads_q},) or (B, Hq) = ({sizes.batch}, {sizes.heads_q})")
    if sinks is not None:
        _check_vector("sinks", sinks, ((sizes.heads_q,),), device, f"(Hq,) = ({sizes.heads_q},)")
    wanted = grad_names(x) if grad_inputs is None else frozenset(grad_inputs)
    mask_grad = mask_kind == "additive" and "mask" in wanted
    vendor, arch = device_arch(device)
    p = Problem.create(
        device=device, vendor=vendor, arch=arch, dtype=q.dtype, batch=sizes.batch, heads_q=sizes.heads_q,
        heads_kv=sizes.heads_kv, seqlen_q=sizes.seqlen_q, seqlen_k=sizes.seqlen_k, head_dim=sizes.head_dim,
        head_dim_v=sizes.head_dim_v, page_size=sizes.page_size, layout=layout, causal=causal,
        window=window, offset=offset, mask_kind=mask_kind, mask_shape=mask_shape, mask_requires_grad=mask_grad,
        alibi=alibi_slopes is not None, sinks=sinks is not None, softcap=softcap, scale=scale,
        needs_grad=bool(wanted), q_format=q_format, kv_format=kv_format, wants_lse=wants_lse,
        deterministic=deterministic or None)  # False asks for nothing: torch's global switch still holds
    if not p.is_dense and index_checks.validating():  # a debugging mode: reads the values (a host sync)
        index_checks.read_indices(p, x, check_longest=True)
    if memo_key is not None:
        call_memo.remember_validated(memo_key, p)
    return p, x


def make_problem(q, k, v, **options) -> Problem:
    """The `Problem` of `attnx.attention(q, k, v, return_lse=True, **options)` (same keyword arguments;
    ``wants_lse=False`` gives that of a call without ``return_lse`` and gradients)."""
    return make_call(q, k, v, **options)[0]
