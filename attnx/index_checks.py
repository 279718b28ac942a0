"""The values of the index tensors (`cu_seqlens_*`, `seqlens_k`, `page_table`), checked on the host.

Shapes and dtypes of these tensors are checked for every call (`attnx.problem`); their *values*
need the tensor's contents, which on a GPU costs a host sync. Two places read them:

* `read_indices`: the `naive` and `blocked` backends (`attnx.formats`) need the values anyway;
  they call it before any row is read.
* `validate_indices()`: a debugging mode, per thread. While it is on, every call that has index
  tensors reads them once (one device->host copy) before a backend is chosen, and the first bad
  entry raises `InvalidArgumentError` naming the argument and the entry. `check_indices` runs the
  same checks once, on request.

Kernels that read the values on the device (`triton`) clamp every index instead, so a bad value
gives wrong numbers, never a read or write outside a buffer.
"""
from __future__ import annotations

import contextlib
import threading
from typing import NamedTuple, Optional, Sequence

import torch

from .errors import InvalidArgumentError, InvalidTypeError

INDEX_NAMES = ("cu_seqlens_q", "cu_seqlens_k", "seqlens_k", "page_table")


class _Mode(threading.local):
    on = False  # per thread: one thread debugging its calls leaves the others' untouched


_MODE = _Mode()


def validating() -> bool:
    """True inside `validate_indices()` on this thread."""
    return _MODE.on


@contextlib.contextmanager
def validate_indices(enabled: bool = True):
    """Check the values of index tensors on every call in this block (on this thread), for debugging.

    Inside the block, each `attnx.attention` / `attnx.plan` / `Plan.run` / `attnx.explain` call
    with ``cu_seqlens_q``, ``cu_seqlens_k``, ``seqlens_k`` or ``page_table`` copies them to the
    host once and raises `attnx.InvalidArgumentError` naming the first bad entry (for instance
    ``page_table[3, 17] = 9001 is outside the pool of 512 pages``) before any kernel runs.
    Off by default: on a GPU the copy is a host sync per call (and breaks CUDA-graph capture).
    Nests; the previous state comes back on exit. ``enabled=False`` turns checking off inside.

    Equivalent PyTorch (what is checked, for packed keys)::

        cu = cu_seqlens_k.tolist()
        assert cu[0] == 0 and cu[-1] == k.shape[0]
        assert all(a <= b for a, b in zip(cu, cu[1:]))
    """
    if not isinstance(enabled, bool):
        raise InvalidTypeError(f"`enabled` must be a bool, got {enabled!r}")
    previous = _MODE.on
    _MODE.on = enabled
    try:
        yield
    finally:
        _MODE.on = previous


def check_indices(q, k, v, **options) -> None:
    """Check ``attnx.attention(q, k, v, **options)``'s arguments, index values included; run nothing.

    Raises what `attnx.attention` would for a bad shape or option, and `InvalidArgumentError`
    naming the first bad entry of ``cu_seqlens_*``, ``seqlens_k`` or ``page_table`` (one
    device->host copy of them). Returns None when everything is in range. ``backend`` and
    ``return_lse`` are accepted (so a call's keyword arguments can be passed as they are) and
    play no part.

    Equivalent PyTorch: ``with attnx.validate_indices(): attnx.explain(q, k, v, **options)``.
    """
    from .problem import make_call  # (attnx.problem imports this module)

    options.pop("backend", None)
    options.pop("return_lse", None)
    p, x = make_call(q, k, v, **options)
    if not p.is_dense:
        read_indices(p, x, check_longest=True)


class HostIndices(NamedTuple):
    """The index values of one call, checked, as host lists."""

    q_starts: Optional[list]   # cu_seqlens_q (packed q), else None
    k_starts: Optional[list]   # cu_seqlens_k (packed k/v), else None
    lengths: list              # keys of each sequence


def _on_host(x) -> dict:
    """The call's index tensors on the host: one copy for all of them (they share a device)."""
    present = {name: getattr(x, name) for name in INDEX_NAMES if getattr(x, name) is not None}
    tensors = list(present.values())
    if not tensors or tensors[0].device.type == "cpu":
        return present
    flat = torch.cat([t.reshape(-1) for t in tensors]).cpu()
    parts = flat.split([t.numel() for t in tensors])
    return {name: part.view(t.shape) for (name, t), part in zip(present.items(), parts)}


def check_offsets(name: str, values: Sequence[int], total: int, tensor: str,
                  longest: Optional[int] = None, longest_name: str = "") -> None:
    """``values`` (cu_seqlens) start at 0, never fall, end at ``total`` (the rows of ``tensor``).

    With ``longest``, no sequence is longer than it (``longest_name``: the argument it came from).
    """
    if values[0] != 0:
        raise InvalidArgumentError(f"`{name}`[0] = {values[0]}, must be 0 (the first sequence starts at row 0)")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise InvalidArgumentError(f"`{name}`[{i}] = {values[i]} < `{name}`[{i - 1}] = {values[i - 1]}: "
                                       "offsets must not fall")
    last = len(values) - 1
    if values[last] != total:
        raise InvalidArgumentError(f"`{name}`[{last}] = {values[last]}, must equal the packed length {total} "
                                   f"(`{tensor}` has {total} rows)")
    if longest is not None:
        for b in range(last):
            if values[b + 1] - values[b] > longest:
                raise InvalidArgumentError(
                    f"sequence {b} has {values[b + 1] - values[b]} rows (`{name}`[{b + 1}] - `{name}`[{b}]) but "
                    f"`{longest_name}` = {longest}: kernels size their grid from it")


def check_lengths(name: str, values: Sequence[int], capacity: int, what: str) -> None:
    """Each cache length lies in ``[0, capacity]`` (``what`` says where the capacity comes from)."""
    for b, n in enumerate(values):
        if n < 0:
            raise InvalidArgumentError(f"`{name}`[{b}] = {n} is negative")
        if n > capacity:
            raise InvalidArgumentError(f"`{name}`[{b}] = {n} exceeds the cache capacity {capacity} ({what})")


def check_append(name: str, values: Sequence[int], new: Sequence[int], capacity: int) -> None:
    """Sequence b's ``values[b]`` cached tokens plus ``new[b]`` new ones fit in ``capacity``."""
    for b, (n, add) in enumerate(zip(values, new)):
        if n < 0:
            raise InvalidArgumentError(f"`{name}`[{b}] = {n} is negative")
        if n + add > capacity:
            raise InvalidArgumentError(f"`{name}`[{b}] + new tokens {add} = {n + add} exceeds the cache "
                                       f"capacity {capacity}")


def check_pages(name: str, table: torch.Tensor, used: torch.Tensor, num_pages: int) -> None:
    """Entries ``table[b, :used[b]]`` (the pages sequence b reads) name pages in ``[0, num_pages)``.

    ``table`` (B, max_pages) and ``used`` (B,) integer tensors; entries past ``used[b]`` may hold
    anything (a sequence never reads them). On a GPU, one read of the smallest and largest entry.
    """
    used = used.to(table.device)
    if table.device.type == "cpu" and table.numel():  # only the columns some sequence reads
        table = table[:, :max(int(used.max()), 0)]
    in_use = torch.arange(table.shape[1], device=table.device)[None, :] < used[:, None]
    if not table.numel():
        return
    low, high = torch.stack(torch.aminmax(torch.where(in_use, table, 0))).tolist()
    if low >= 0 and high < num_pages:
        return
    bad = in_use & ((table < 0) | (table >= num_pages))
    b, j = (int(i) for i in bad.nonzero()[0])
    raise InvalidArgumentError(f"`{name}`[{b}, {j}] = {int(table[b, j])} is outside the pool of {num_pages} "
                               f"pages (sequence {b} reads its first {int(used[b])} entries)")


def read_indices(p, x, *, check_longest: bool = False) -> HostIndices:
    """Copy the index tensors of a non-dense call to the host, check every value a kernel would trust.

    ``p`` the call's `Problem`, ``x`` its `Inputs` (shapes already checked by `make_call`).
    ``check_longest`` also checks ``max_seqlen_q``/``max_seqlen_k`` against the packed lengths
    (the `naive`/`blocked` backends do not need it: they compute every row whatever it says).
    """
    host = _on_host(x)
    q_starts = k_starts = None
    if p.q_format == "varlen":
        q_starts = host["cu_seqlens_q"].tolist()
        check_offsets("cu_seqlens_q", q_starts, x.q.shape[0], "q", p.seqlen_q if check_longest else None,
                      "max_seqlen_q")
    if p.kv_format == "varlen":
        k_starts = host["cu_seqlens_k"].tolist()
        check_offsets("cu_seqlens_k", k_starts, x.k.shape[0], "k", p.seqlen_k if check_longest else None,
                      "max_seqlen_k")
        return HostIndices(q_starts, k_starts, [b - a for a, b in zip(k_starts, k_starts[1:])])
    lengths = host["seqlens_k"].tolist()
    if p.kv_format == "paged":
        pages = host["page_table"].shape[1]
        check_lengths("seqlens_k", lengths, p.seqlen_k, f"`page_table` has {pages} pages of {p.page_size} tokens "
                                                         "a sequence")
        used = (host["seqlens_k"].long() + p.page_size - 1) // p.page_size
        check_pages("page_table", host["page_table"], used, x.k.shape[0])
    else:
        check_lengths("seqlens_k", lengths, p.seqlen_k, "the length of `k`")
    return HostIndices(q_starts, None, lengths)
