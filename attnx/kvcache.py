"""`KVCache`: a key/value cache to allocate, append to and attend over (contiguous or paged).

The object owns the tensors of attnx's cache formats (docs/semantics.md, "Tensor formats"):
key/value storage, int32 ``lengths`` ``(B,)`` on the cache's device and, for a paged cache,
an int32 ``page_table`` ``(B, max_pages)``. `KVCache.inputs` hands them to `attnx.attention` or
`attnx.plan`; `KVCache.attend` appends new keys/values and attends in one call (new queries sit
at the end of each sequence: bottom-right alignment per sequence); `KVCache.plan` decides once
for a decode loop.

Host synchronisation: the object keeps a host copy of the lengths, updated only by its own
methods, so appending dense new tokens never reads device memory (capacity checked on the
host copy, write positions computed on the device). What reads the device: the constructor
(given tensor lengths or a page table), `set_lengths` with a tensor, packed new tokens
(`cu_seqlens` read once), and the `naive`/`blocked` backends, which read index tensors on the
host by design (triton does not).
"""
from __future__ import annotations

import operator
from typing import Optional

import torch

from .api import Plan, _check_backend as check_backend, _check_return_lse as check_return_lse, attention, plan
from . import index_checks
from .dispatch import choose
from .errors import InvalidArgumentError, InvalidTypeError
from .kvcache_append import CacheCapacityError, check_layout, new_tokens, packed_counts, write_tokens
from .kvcache_pages import PageAllocator
from .memory_overlap import overlaps_itself, shares_memory
from .problem import FLOAT_DTYPES, check_strided, make_problem
from .registry import get_backend

__all__ = ["KVCache", "CachePlan", "CacheCapacityError"]

# arguments of `attention` the cache provides itself
_FROM_CACHE = ("seqlens_k", "page_table", "cu_seqlens_k", "max_seqlen_k", "cu_seqlens_q", "layout", "backend",
               "return_lse")
_TENSOR_OPTIONS = ("alibi_slopes", "sinks")


def _count(name: str, value, minimum: int) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise InvalidTypeError(f"`{name}` must be an int, got {value!r}") from None
    if value < minimum:
        raise InvalidArgumentError(f"`{name}` must be >= {minimum}, got {value}")
    return value


def _check_storage(k, v) -> None:
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
        check_strided(name, t)
        if t.dtype not in FLOAT_DTYPES:
            raise InvalidTypeError(f"`{name}` must be float16, bfloat16, float32 or float64, got {t.dtype}")
        if t.dim() != 4:
            raise InvalidArgumentError(f"`{name}` must be 4-D storage, got shape {tuple(t.shape)}")
        if overlaps_itself(t):
            raise InvalidArgumentError(f"`{name}` must not overlap itself (an expanded view, stride 0 where a dim "
                                       f"has more than one entry: strides {t.stride()}): appends would write one "
                                       "slot for several positions; pass a copy (`.contiguous()`)")
    if v.dtype != k.dtype:
        raise InvalidTypeError(f"`v` must have the dtype of `k` ({k.dtype}), got {v.dtype}")
    if v.device != k.device:
        raise InvalidArgumentError(f"`v` must be on the device of `k` ({k.device}), got {v.device}")
    if v.shape[:3] != k.shape[:3]:
        raise InvalidArgumentError(f"`v` must match `k` in all but the last dim, got {tuple(k.shape)} and "
                                   f"{tuple(v.shape)}")


def _check_disjoint(k, v) -> None:
    """`k` and `v` share no memory location (appends write both)."""
    if shares_memory(k, v):
        raise InvalidArgumentError("`v` must not share memory with `k` (the same tensor, or overlapping views "
                                   "of one buffer): appends would write values over keys; pass separate "
                                   "tensors (disjoint views of one buffer, such as kv[:, :, 0] and kv[:, :, 1], "
                                   "are fine)")


def _check_page_table(page_table, num_pages: int, device) -> None:
    if not isinstance(page_table, torch.Tensor):
        raise InvalidTypeError(f"`page_table` must be a torch.Tensor, got {type(page_table).__name__}")
    check_strided("page_table", page_table)
    if page_table.dtype != torch.int32:
        raise InvalidTypeError(f"`page_table` must be int32, got {page_table.dtype}")
    if page_table.dim() != 2:
        raise InvalidArgumentError(f"`page_table` must be 2-D (B, max_pages), got shape {tuple(page_table.shape)}")
    if page_table.device != device:
        raise InvalidArgumentError(f"`page_table` must be on the pools' device {device}, got {page_table.device}")
    if page_table.is_meta:
        raise InvalidArgumentError("`page_table` must hold values (it is read once on the host), got a meta tensor")
    if page_table.numel() and (int(page_table.min()) < 0 or int(page_table.max()) >= num_pages):  # one sync
        raise InvalidArgumentError(f"`page_table` must name pages in [0, {num_pages}), got values in "
                                   f"[{int(page_table.min())}, {int(page_table.max())}]")


def _check_packed_q(q, counts: list[int]) -> None:
    """Packed ``q`` appended with packed ``k``/``v`` holds the rows their ``cu_seqlens`` describes (checked
    before the write: the attention reads the offsets' values only after it)."""
    if isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[0] != sum(counts):
        raise InvalidArgumentError(f"`q` must hold the {sum(counts)} packed rows `cu_seqlens` describes (as "
                                   f"`k`/`v` do), got {q.shape[0]}")


def _check_max_seqlen_q(given, counts: list[int]) -> None:
    """A ``max_seqlen_q`` passed with packed new tokens covers them (the counts are on the host already):
    a smaller one makes kernels that size their grid from it (`triton`) skip queries without an error."""
    try:
        given = None if isinstance(given, bool) else operator.index(given)
    except TypeError:
        given = None  # not an int: `attention`'s own check names it
    if given is not None and 0 <= given < max(counts, default=0):
        b = counts.index(max(counts))
        raise InvalidArgumentError(f"`max_seqlen_q` = {given} is less than the {counts[b]} new tokens `cu_seqlens` "
                                   f"brings to sequence {b}: kernels size their grid from it")


class KVCache:
    """Keys and values of ``B`` sequences, with per-sequence lengths; contiguous or paged.

    Storage (token-major, so appending writes whole rows):
      * contiguous: ``k`` ``(B, capacity, Hkv, D)``, ``v`` ``(B, capacity, Hkv, Dv)`` (wrap a
        ``(B, Hkv, capacity, D)`` cache as its view ``k.transpose(1, 2)``: appends write through it);
      * paged: page pools ``k`` ``(num_pages, page_size, Hkv, D)``, ``v`` ``(num_pages, page_size, Hkv, Dv)``
        and int32 ``page_table`` ``(B, max_pages)``: key ``j`` of sequence ``b`` is row
        ``j % page_size`` of page ``page_table[b, j // page_size]``; capacity ``max_pages * page_size``.

    Build one with `KVCache.allocate`, or wrap tensors you have: ``KVCache(k, v, lengths=...,
    page_table=...)`` (reads tensor ``lengths`` and the page table once: a device sync). The
    cache holds inference state: appends write in place under ``torch.no_grad()``.

    Equivalent PyTorch (contiguous; ``cache.attend(q, k_new, v_new, causal=True)``, ``bhsd``)::

        for b in range(B):
            n = k_new.shape[2]; L = lengths[b]
            K[b, L:L + n] = k_new[b].transpose(0, 1); V[b, L:L + n] = v_new[b].transpose(0, 1)
            lengths[b] += n
            out[b] = attnx.attention(q[b:b+1], K[b:b+1, :L + n].transpose(1, 2),
                                     V[b:b+1, :L + n].transpose(1, 2), causal=True)  # bottom-right
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, *, lengths=None, page_table: Optional[torch.Tensor] = None):
        _check_storage(k, v)
        self.k, self.v = k, v
        self.page_table = page_table
        if page_table is None:
            self.batch, self.capacity = k.shape[0], k.shape[1]
            self.page_size = None
        else:
            _check_page_table(page_table, k.shape[0], k.device)
            self.page_size = k.shape[1]
            if self.page_size < 1:
                raise InvalidArgumentError("`k`/`v` pages must hold at least one token")
            self.batch, self.capacity = page_table.shape[0], page_table.shape[1] * self.page_size
        self._lengths = torch.zeros(self.batch, dtype=torch.int32, device=k.device)
        self._host = [0] * self.batch
        self._pager = None
        if lengths is not None:
            self.set_lengths(lengths)
        _check_disjoint(k, v)  # last (the other checks name their argument first); nothing is written before

    @classmethod
    def allocate(cls, batch: int, capacity: int, heads_kv: int, head_dim: int, *, head_dim_v: Optional[int] = None,
                 dtype: torch.dtype = torch.float32, device=None, page_size: Optional[int] = None,
                 num_pages: Optional[int] = None) -> "KVCache":
        """An empty cache (every length 0) for ``batch`` sequences of up to ``capacity`` tokens.

        ``page_size`` (an int >= 1; 1, 16 and 256 are tested) makes it paged (capacity rounds up to
        whole pages); None makes it contiguous. By default each sequence owns
        ``ceil(capacity / page_size)`` pages from the start. With ``num_pages``, the pool holds that
        many pages, shared: a sequence takes pages as appends need them and gives them back on
        `reset` / shrinking `set_lengths` (a full pool raises `CacheCapacityError` before any write).
        Storage is allocated with ``torch.empty``: positions past a sequence's length hold garbage
        and are never read. No host sync.

        Equivalent PyTorch (contiguous)::

            k = torch.empty(batch, capacity, heads_kv, head_dim, dtype=dtype, device=device)
            v = torch.empty(batch, capacity, heads_kv, head_dim_v, dtype=dtype, device=device)
            lengths = torch.zeros(batch, dtype=torch.int32, device=device)
        """
        batch, capacity = _count("batch", batch, 0), _count("capacity", capacity, 0)
        heads_kv, head_dim = _count("heads_kv", heads_kv, 1), _count("head_dim", head_dim, 1)
        head_dim_v = head_dim if head_dim_v is None else _count("head_dim_v", head_dim_v, 1)
        if dtype not in FLOAT_DTYPES:
            raise InvalidTypeError(f"`dtype` must be float16, bfloat16, float32 or float64, got {dtype!r}")
        try:
            device = torch.device("cpu" if device is None else device)
        except TypeError:
            raise InvalidTypeError(f"`device` must be a torch.device, a str or None, got {device!r}") from None
        except RuntimeError as err:
            raise InvalidArgumentError(f"`device` must name a torch device, got {device!r} ({err})") from None
        if page_size is None:
            if num_pages is not None:
                raise InvalidArgumentError("`num_pages` needs `page_size` (a paged cache)")
            k = torch.empty(batch, capacity, heads_kv, head_dim, dtype=dtype, device=device)
            v = torch.empty(batch, capacity, heads_kv, head_dim_v, dtype=dtype, device=device)
            return cls(k, v)
        page_size = _count("page_size", page_size, 1)
        pages = -(-capacity // page_size)
        shared = num_pages is not None
        pool = _count("num_pages", num_pages, 1) if shared else batch * pages
        k = torch.empty(pool, page_size, heads_kv, head_dim, dtype=dtype, device=device)
        v = torch.empty(pool, page_size, heads_kv, head_dim_v, dtype=dtype, device=device)
        if shared:  # entries written as pages are handed out; unused ones stay 0 (a valid page, never read)
            table = torch.zeros(batch, pages, dtype=torch.int32, device=device)
        else:
            table = torch.arange(batch * pages, dtype=torch.int32, device=device).reshape(batch, pages)
        cache = cls.__new__(cls)  # the table is valid by construction: skip its (syncing) value check
        cache.k, cache.v, cache.page_table, cache.page_size = k, v, table, page_size
        cache.batch, cache.capacity = batch, pages * page_size
        cache._lengths = torch.zeros(batch, dtype=torch.int32, device=device)
        cache._host = [0] * batch
        cache._pager = PageAllocator(pool, batch, page_size) if shared else None
        return cache

    # ---- what it holds -------------------------------------------------------------------
    @property
    def paged(self) -> bool:
        return self.page_table is not None

    @property
    def heads_kv(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    @property
    def head_dim_v(self) -> int:
        return self.v.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def lengths(self) -> torch.Tensor:
        """int32 ``(B,)`` on the cache's device: tokens held per sequence. Change it only through
        the cache's methods (`append`, `attend`, `set_lengths`, `reset`): they keep a host copy."""
        return self._lengths

    @property
    def free_pages(self) -> Optional[int]:
        """Pages left in a shared pool (``allocate(..., num_pages=...)``); None when pages are not shared."""
        return None if self._pager is None else len(self._pager.free)

    @property
    def seqlens(self) -> list[int]:
        """Tokens held per sequence, from the host copy (no device read)."""
        return list(self._host)

    def inputs(self, layout: str = "bhsd") -> dict:
        """Keyword arguments for `attnx.attention` / `attnx.plan`: ``k``, ``v``, ``seqlens_k`` (and ``page_table``).

        ``attnx.attention(q, **cache.inputs(), causal=True)`` attends dense ``bhsd`` queries; pass
        ``layout="bshd"`` here and to `attention` for ``(B, S, H, D)`` queries. Views, never copies.
        """
        check_layout(layout)
        if self.paged:
            return dict(k=self.k, v=self.v, seqlens_k=self._lengths, page_table=self.page_table)
        if layout == "bhsd":
            return dict(k=self.k.transpose(1, 2), v=self.v.transpose(1, 2), seqlens_k=self._lengths)
        return dict(k=self.k, v=self.v, seqlens_k=self._lengths)

    def sequence(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``index``'s keys and values as dense ``(Hkv, length, D)`` tensors (copies if paged)."""
        index = _count("index", index, 0)
        if index >= self.batch:
            raise InvalidArgumentError(f"`index` must be < {self.batch} (the batch), got {index}")
        n = self._host[index]
        if not self.paged:
            return self.k[index, :n].transpose(0, 1), self.v[index, :n].transpose(0, 1)
        pos = torch.arange(n, device=self.device)
        page = self.page_table[index].long()[pos // self.page_size]
        return self.k[page, pos % self.page_size].transpose(0, 1), self.v[page, pos % self.page_size].transpose(0, 1)

    # ---- changing it ---------------------------------------------------------------------
    def _check_writable(self, method: str) -> None:
        """The cache's tensors can be updated in place here (checked before any change, host or device)."""
        if torch.is_inference_mode_enabled():
            return
        tensors = (self.k, self.v, self._lengths) + ((self.page_table,) if self._pager is not None else ())
        if any(t.is_inference() for t in tensors):
            raise InvalidArgumentError(f"`{method}` outside torch.inference_mode() on a cache whose tensors were made "
                                       "inside it: torch refuses in-place updates of inference tensors outside "
                                       "inference mode; call it inside `torch.inference_mode()` (or build the "
                                       "cache outside it)")

    def set_lengths(self, lengths) -> None:
        """Set every sequence's length (e.g. to drop rejected speculative tokens): a list of ints or an
        int32 ``(B,)`` tensor (read once: a device sync on a GPU). Kept keys are not touched."""
        if isinstance(lengths, torch.Tensor):
            if lengths.dtype not in (torch.int32, torch.int64):
                raise InvalidTypeError(f"`lengths` must be an int32 or int64 tensor, got {lengths.dtype}")
            if lengths.is_meta:
                raise InvalidArgumentError("`lengths` must hold values (it is read on the host), got a meta tensor")
            if tuple(lengths.shape) != (self.batch,):
                raise InvalidArgumentError(f"`lengths` must be an integer tensor of shape ({self.batch},), got "
                                           f"{lengths.dtype} {tuple(lengths.shape)}")
            values = lengths.tolist()
        elif isinstance(lengths, (list, tuple)):
            values = [_count("lengths", n, 0) for n in lengths]
        else:
            raise InvalidTypeError(f"`lengths` must be a list of ints or a tensor, got {type(lengths).__name__}")
        if len(values) != self.batch or any(n < 0 or n > self.capacity for n in values):
            raise InvalidArgumentError(f"`lengths` must be {self.batch} values in [0, {self.capacity}] (the "
                                       f"capacity), got {values}")
        self._check_writable("set_lengths")
        if self._pager is not None:
            missing = self._pager.shortfall(values)
            if missing:
                raise CacheCapacityError(f"`lengths` {values} need {missing} more pages than the pool has free")
            for b, n in enumerate(values):
                self._pager.shrink(b, n)
            self._pager.grow(self.page_table, values)
        self._lengths.copy_(torch.tensor(values, dtype=torch.int32))
        self._host = values

    def reset(self, index: Optional[int] = None) -> None:
        """Empty every sequence (``index=None``) or sequence ``index`` (its pages go back to a shared pool).
        No host sync."""
        if index is not None:
            index = _count("index", index, 0)
            if index >= self.batch:
                raise InvalidArgumentError(f"`index` must be < {self.batch} (the batch), got {index}")
        self._check_writable("reset")
        if index is None:
            self._lengths.zero_()
            self._host = [0] * self.batch
        else:
            self._lengths[index] = 0
            self._host[index] = 0
        if self._pager is not None:
            for b in (range(self.batch) if index is None else (index,)):
                self._pager.shrink(b, 0)

    def append(self, k: torch.Tensor, v: torch.Tensor, *, layout: str = "bhsd",
               cu_seqlens: Optional[torch.Tensor] = None) -> None:
        """Write new keys/values after each sequence's last token and grow the lengths, in place.

        ``k``/``v``: ``(B, Hkv, n, D)`` (``layout="bhsd"``) or ``(B, n, Hkv, D)`` (``"bshd"``): ``n`` new
        tokens for every sequence; or packed ``(total_new, Hkv, D)`` with int32 ``cu_seqlens``
        ``(B + 1,)`` (sequence ``b`` gains rows ``cu_seqlens[b]:cu_seqlens[b + 1]``; read once on the
        host). Everything is checked (dtype, device, shapes, room left: `CacheCapacityError`) before
        anything is written. Dense new tokens: no host sync.

        Equivalent PyTorch (contiguous, ``bhsd``)::

            for b in range(B):
                L = lengths[b]; K[b, L:L + n] = k[b].transpose(0, 1); V[b, L:L + n] = v[b].transpose(0, 1)
            lengths += n
        """
        counts = self._new_tokens(k, v, layout, cu_seqlens)
        self._commit(k, v, layout, cu_seqlens, counts)

    def _new_tokens(self, k, v, layout, cu_seqlens, method: Optional[str] = None) -> list[int]:
        """Tokens each sequence gains (every check, a shared pool's free pages included, before any write)."""
        counts = new_tokens(self, k, v, layout, cu_seqlens)
        self._check_writable("append" if method is None else method)
        if self._pager is not None:
            missing = self._pager.shortfall([n + c for n, c in zip(self._host, counts)])
            if missing:
                raise CacheCapacityError(f"`k`/`v` need {missing} more pages than the shared pool has free "
                                         f"({len(self._pager.free)} of {self.k.shape[0]}); `reset` finished sequences")
        return counts

    def _commit(self, k, v, layout, cu_seqlens, counts: list[int]) -> None:
        if self._pager is not None:
            self._pager.grow(self.page_table, [n + c for n, c in zip(self._host, counts)])
        write_tokens(self, k, v, layout, cu_seqlens, counts)
        if cu_seqlens is None:
            self._lengths.add_(counts[0] if counts else 0)
        else:
            self._lengths.add_(torch.tensor(counts, dtype=torch.int32).to(self.device))
        self._host = [n + c for n, c in zip(self._host, counts)]

    # ---- attending -----------------------------------------------------------------------
    def _options(self, layout: str, cu_seqlens, options: dict) -> dict:
        check_layout(layout)
        taken = [name for name in _FROM_CACHE if name in options]
        if taken:
            raise InvalidArgumentError(f"`{taken[0]}` is not an option here: the cache provides its tensors, and "
                                       "`layout`/`cu_seqlens` are arguments of the cache's method")
        call = dict(options, layout=layout)
        if cu_seqlens is not None:
            call["cu_seqlens_q"] = cu_seqlens
        return call

    def attend(self, q: torch.Tensor, k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None, *,
               layout: str = "bhsd", cu_seqlens: Optional[torch.Tensor] = None, backend: Optional[str] = None,
               return_lse: bool = False, **options):
        """Attention of new queries over the cache; with ``k``/``v``, append them first (one call).

        ``q``: ``(B, Hq, Sq, D)`` (``"bhsd"``), ``(B, Sq, Hq, D)`` (``"bshd"``) or packed ``(total_q, Hq, D)``
        with ``cu_seqlens`` (then ``k``/``v`` are packed with the same ``cu_seqlens``). ``options`` are
        `attnx.attention`'s (``causal``, ``window``, ``offset``, ``scale``, ``softcap``, ``alibi_slopes``,
        ``sinks``, ``max_seqlen_q``). The default alignment is bottom-right per sequence: the queries
        are the last tokens of each sequence, after the append. ``q`` and the options are checked
        before anything is written. Returns what `attnx.attention` returns.

        Equivalent PyTorch::

            cache.append(k, v, layout=layout)            # when k/v are given
            out = attnx.attention(q, **cache.inputs(layout), layout=layout, **options)
        """
        call = self._options(layout, cu_seqlens, options)
        if (k is None) != (v is None):
            raise InvalidArgumentError("give both `k` and `v` (new tokens to append), or neither")
        if k is not None:
            counts = self._new_tokens(k, v, layout, cu_seqlens, "attend")
            if cu_seqlens is not None and "max_seqlen_q" not in call:
                call["max_seqlen_q"] = max(counts, default=0)
            if cu_seqlens is not None:
                _check_packed_q(q, counts)
                _check_max_seqlen_q(call["max_seqlen_q"], counts)
            check_return_lse(return_lse)
            check_backend(backend)
            # q, every option and the backend checked before the write: a backend that declines the
            # call raises NoBackendError here, not after the new tokens are in (the decision depends on
            # shapes, never on the lengths, so it is the one `attention` makes below)
            p = make_problem(q, **self.inputs(layout), **call, wants_lse=return_lse)
            if p.is_empty:
                if backend is not None:
                    get_backend(backend)
            else:
                choose(p, backend)
            self._commit(k, v, layout, cu_seqlens, counts)
        return attention(q, **self.inputs(layout), **call, backend=backend, return_lse=return_lse)

    def plan(self, q: torch.Tensor, *, layout: str = "bhsd", cu_seqlens: Optional[torch.Tensor] = None,
             backend: Optional[str] = None, return_lse: bool = False, **options) -> "CachePlan":
        """Decide once for `attend` calls shaped like ``q`` (a decode loop): returns a `CachePlan`.

        The decision depends on shapes, never on the lengths, so one plan serves every step while the
        cache fills. Packed queries: give ``max_seqlen_q`` (the most new tokens a step will bring).

        Equivalent PyTorch::

            step = attnx.plan(q, **cache.inputs(layout), layout=layout, **options)
        """
        call = self._options(layout, cu_seqlens, options)
        if cu_seqlens is not None and "max_seqlen_q" not in call:
            raise InvalidArgumentError("`max_seqlen_q` is needed to plan packed queries (the most new tokens "
                                       "a step will bring): a plan fixes it")
        decided = plan(q, **self.inputs(layout), **call, backend=backend, return_lse=return_lse)
        return CachePlan(self, decided, q, layout, call)

    def __repr__(self) -> str:
        kind = f"paged, page_size={self.page_size}" if self.paged else "contiguous"
        return (f"<attnx.KVCache {kind}: batch={self.batch}, capacity={self.capacity}, heads_kv={self.heads_kv}, "
                f"head_dim={self.head_dim}, dtype={self.dtype}, device={self.device}>")


class CachePlan:
    """`KVCache.attend` with the backend decided once: ``plan.run(q, k_new, v_new)`` per step.

    ``run`` checks ``q`` (shape, dtype, device) and the new tokens before writing, appends, then runs
    the planned backend through `attnx.Plan.run` (which checks the full signature again).
    """

    def __init__(self, cache: KVCache, decided: Plan, q: torch.Tensor, layout: str, call: dict):
        self.cache, self.plan = cache, decided
        self._q = (tuple(q.shape), q.dtype, q.device)
        self._layout = layout
        self._packed = "cu_seqlens_q" in call
        self._max_q = call.get("max_seqlen_q")
        self._tensors = {n: call[n] for n in _TENSOR_OPTIONS if n in call}

    def run(self, q: torch.Tensor, k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None, *,
            cu_seqlens: Optional[torch.Tensor] = None):
        """Append ``k``/``v`` (if given) and attend ``q`` over the cache with the planned backend."""
        if (cu_seqlens is not None) != self._packed:
            raise InvalidArgumentError("`cu_seqlens` must be given exactly when the plan was made with it")
        if not isinstance(q, torch.Tensor):
            raise InvalidTypeError(f"`q` must be a torch.Tensor, got {type(q).__name__}")
        if (tuple(q.shape), q.dtype, q.device) != self._q:
            raise InvalidArgumentError(f"`q` must have the planned shape, dtype and device {self._q}, got "
                                       f"{(tuple(q.shape), q.dtype, q.device)}")
        if (k is None) != (v is None):
            raise InvalidArgumentError("give both `k` and `v` (new tokens to append), or neither")
        tensors = dict(self._tensors)
        if cu_seqlens is not None:
            tensors["cu_seqlens_q"] = cu_seqlens
        if k is None:
            if self._packed and max(packed_counts(cu_seqlens, self.cache.batch, q.shape[0]), default=0) > self._max_q:
                raise InvalidArgumentError(f"`cu_seqlens` holds more queries per sequence than the planned "
                                           f"max_seqlen_q = {self._max_q}")
            return self.plan.run(q, **self.cache.inputs(self._layout), **tensors)
        counts = self.cache._new_tokens(k, v, self._layout, cu_seqlens, "CachePlan.run")
        if self._packed:
            if max(counts, default=0) > self._max_q:
                raise InvalidArgumentError(f"`cu_seqlens` brings {max(counts)} tokens to one sequence, more than "
                                           f"the planned max_seqlen_q = {self._max_q}")
            _check_packed_q(q, counts)
        # the whole signature (q's gradient state included) checked before the write; the cache's tensors
        # are updated in place, so the checked inputs are those the planned backend then reads
        inputs = self.cache.inputs(self._layout)
        p, x = self.plan._check(q, inputs.pop("k"), inputs.pop("v"), {**inputs, **tensors})
        self.cache._commit(k, v, self._layout, cu_seqlens, counts)
        if index_checks.validating() and not p.is_empty:  # debugging mode: the lengths after the append too
            index_checks.read_indices(p, x, check_longest=True)
        return self.plan._execute(p, x)

    __call__ = run

    def __repr__(self) -> str:
        return f"<attnx.CachePlan {self.plan!r} over {self.cache!r}>"
