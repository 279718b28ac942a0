"""The public entry points: `attention`, `explain` and `plan`."""
from __future__ import annotations

import functools
from typing import Optional

import torch

from . import call_memo, index_checks
from .autograd import run
from .dispatch import Decision, choose, decide
from .empty import empty_attention
from .errors import InvalidArgumentError, InvalidTypeError
from .inputs import Inputs
from .problem import Problem, make_call
from .registry import generation, get_backend
from .selection import allowed_backends

_is_compiling = torch.compiler.is_compiling
_Run = call_memo.Run


def _check_return_lse(return_lse) -> None:
    if not isinstance(return_lse, bool):
        raise InvalidTypeError(f"`return_lse` must be a bool, got {return_lse!r}")


def _check_backend(backend) -> None:
    if backend is not None and not isinstance(backend, str):
        raise InvalidTypeError(f"`backend` must be a backend name (a str) or None, got {type(backend).__name__}")


def empty_result(p: Problem, x):
    """`empty_attention`, after the checks of the index values a CPU call always gets.

    An empty problem asks no backend, so `naive`/`blocked` do not read its index tensors; on a CPU
    reading them costs nothing, and docs/errors.md promises every CPU call that check (a batch of
    0 sequences whose `cu_seqlens_q` does not end at q's rows, a bad cache length with 0 heads).
    """
    if not p.is_dense and not index_checks.validating() and all(
            t is None or t.device.type == "cpu" for t in (x.cu_seqlens_q, x.cu_seqlens_k, x.seqlens_k, x.page_table)):
        index_checks.read_indices(p, x)
    return empty_attention(p, x)


def _execute(p: Problem, x, backend: Optional[str]):
    """Run `p` (a call validated just now)."""
    if p.is_empty:
        if backend is not None:
            get_backend(backend)  # an unknown name is still an error
        return empty_result(p, x)
    return run(p, choose(p, backend), x)


def _forward(backend, p: Problem, q, k, v):
    return backend.forward(p, Inputs(q, k, v))


def _execute_remembered(p: Problem, q, k, v, backend: Optional[str], memo_key: tuple):
    """Run the `Problem` of a plain call validated before, and remember which backend ran it (`call_memo.Run`)."""
    if p.is_empty:
        return _execute(p, Inputs(q, k, v), backend)
    allowed, stamp = allowed_backends(), generation()  # read before choosing: a later change misses
    chosen = choose(p, backend)
    direct = None
    if p.layout == "bhsd" and not p.needs_grad:  # `autograd.run` would call `forward` on q, k, v as given
        direct = chosen.dense_forward(p) or functools.partial(_forward, chosen, p)
    call_memo.remember(memo_key, _Run(p, backend, allowed, stamp, chosen, direct))
    return direct(q, k, v) if direct is not None else run(p, chosen, Inputs(q, k, v))


def attention(q, k, v, *, causal=False, window=None, offset=None, mask=None, scale=None, softcap=None,
              alibi_slopes=None, sinks=None, layout="bhsd", cu_seqlens_q=None, cu_seqlens_k=None,
              max_seqlen_q=None, max_seqlen_k=None, seqlens_k=None, page_table=None, deterministic=None,
              backend=None, return_lse=False):
    """Exact scaled dot-product attention, computed by the best backend for the problem.

    Args:
        q: ``(B, Hq, Sq, D)`` (``layout="bhsd"``) or ``(B, Sq, Hq, D)`` (``layout="bshd"``).
        k, v: ``(B, Hkv, Sk, D)`` and ``(B, Hkv, Sk, Dv)`` in the same layout; ``Hq % Hkv == 0``
            (query head ``h`` reads kv head ``h // (Hq // Hkv)``).
        causal: query ``i`` sees key ``j`` iff ``j <= p_i`` (``p_i``: the aligned position, below).
        window: ``(left, right)``, ints >= 0 or None: query ``i`` sees ``j`` iff
            ``p_i - left <= j <= p_i + right``.
        offset: aligned position of query 0, ``p_i = i + offset``. None (default) is bottom-right,
            ``Sk - Sq`` (per sequence for varlen and caches), as in flash-attn and KV-cache decoding;
            ``0`` is top-left, what ``F.scaled_dot_product_attention(is_causal=True)`` means.
        mask: bool (True = may attend) or floating additive bias, broadcastable to ``(B, Hq, Sq, Sk)``.
        scale: score scale, default ``1 / sqrt(D)``.
        softcap: ``s = softcap * tanh(s / softcap)`` on the scaled score, before masks and bias.
        alibi_slopes: float32 ``(Hq,)`` or ``(B, Hq)``; adds ``-slope * |p_i - j|``.
        sinks: float32 ``(Hq,)`` attention-sink logits: each row's softmax denominator gains
            ``exp(sinks[h])`` (a key with that score and a zero value); gradients flow to it.
        layout: ``"bhsd"`` (torch SDPA) or ``"bshd"`` (flash-attn) for dense q, k, v.
        cu_seqlens_q, cu_seqlens_k: int32 ``(B + 1,)``: packed variable-length sequences, q as
            ``(total_q, Hq, D)`` and k/v as ``(total_k, Hkv, D)``; sequence ``b`` is rows
            ``cu[b]:cu[b + 1]``. ``max_seqlen_q``/``max_seqlen_k`` give the longest (computed,
            with one device sync, when None).
        seqlens_k: int32 ``(B,)``: a KV cache, sequence ``b`` uses its first ``seqlens_k[b]`` keys.
        page_table: int32 ``(B, max_pages)``: a paged cache; k/v are page pools
            ``(num_pages, page_size, Hkv, D)`` and key ``j`` of sequence ``b`` is row
            ``j % page_size`` of page ``page_table[b, j // page_size]`` (needs ``seqlens_k``).
        deterministic: whether the backward must give bitwise-identical gradients run to run.
            None (default) follows ``torch.use_deterministic_algorithms``; True requires it (a
            backend whose backward is not deterministic declines, saying so); False requires
            nothing of its own and never overrides torch's switch when that is on. Calls
            without gradients are unaffected.
        backend: name of a registered backend to force, or None to let the dispatcher choose.
        return_lse: also return ``lse``, float32 ``(B, Hq, Sq)`` (``(Hq, total_q)`` for packed q):
            log of the softmax denominator (``-inf`` for a row that sees no key). Not differentiable.

    Returns:
        ``out`` with ``q``'s dtype, shape ``(B, Hq, Sq, Dv)`` in ``layout`` (``(total_q, Hq, Dv)`` for
        packed q); or ``(out, lse)``.

    A query row that sees no key gets ``out = 0``, ``lse = -inf`` and zero gradients.

    Equivalent PyTorch (``bhsd``, no GQA, window, alibi, softcap or sinks)::

        s = (q @ k.transpose(-2, -1)) * scale
        if causal:
            s = s.masked_fill(~torch.ones(Sq, Sk, dtype=torch.bool).tril(offset), float("-inf"))
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
        out = torch.softmax(s, dim=-1) @ v
    """
    if return_lse is not False and return_lse is not True:
        _check_return_lse(return_lse)
    memo_key = known = None
    # A plain call (q, k, v and at most layout, causal, a float scale, deterministic and a backend
    # name) seen before runs the backend that ran it, if the dispatch state is unchanged (call_memo.py).
    if (window is None and offset is None and mask is None and softcap is None and alibi_slopes is None
            and sinks is None and cu_seqlens_q is None and cu_seqlens_k is None and max_seqlen_q is None
            and max_seqlen_k is None and seqlens_k is None and page_table is None
            and (backend is None or type(backend) is str) and not _is_compiling()):
        try:
            memo_key, known = call_memo.lookup(q, k, v, layout, causal, scale, deterministic, return_lse, backend)
        except RuntimeError:  # a tensor without sizes (nested): `make_call` raises the typed error
            memo_key = known = None
        if (type(known) is _Run and known.forced == backend and known.generation == generation()
                and known.allowed == allowed_backends()):
            direct = known.direct
            out, lse = direct(q, k, v) if direct is not None else run(known.problem, known.backend, Inputs(q, k, v))
            return (out, lse) if return_lse else out
    if known is None and memo_key is not None:
        p = call_memo.sibling(memo_key)
        if p is not None:  # a new k/v length of a call validated before (a decode step): no validation again
            call_memo.remember(memo_key, p)
            out, lse = _execute(p, Inputs(q, k, v), backend)
            return (out, lse) if return_lse else out
    if known is not None:  # validated before: choose, run, and remember the Run from now on
        out, lse = _execute_remembered(call_memo.problem_of(known), q, k, v, backend, memo_key)
        return (out, lse) if return_lse else out
    _check_backend(backend)
    options = dict(causal=causal, window=window, offset=offset, mask=mask, scale=scale, softcap=softcap,
                   alibi_slopes=alibi_slopes, sinks=sinks, layout=layout, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                   seqlens_k=seqlens_k, page_table=page_table, deterministic=deterministic)
    if torch.compiler.is_compiling():
        from .compile_ops import traced_attention

        out, lse = traced_attention(q, k, v, options, backend)
    else:
        # first time (or not plain): validate; the Problem is remembered under a plain call's key
        p, x = make_call(q, k, v, **options, memo_key=memo_key, wants_lse=return_lse)
        out, lse = _execute(p, x, backend)
    return (out, lse) if return_lse else out


def explain(q, k, v, *, backend=None, return_lse=False, **options) -> Decision:
    """The dispatcher's decision for `attention`'s arguments, without running anything.

    Returns a `Decision`: ``chosen`` (a backend name, or None) and ``reasons``
    mapping every registered backend to ``[]`` ("would work") or the reasons it
    declines. ``print(attnx.explain(q, k, v, causal=True))`` shows it as a table.
    """
    _check_return_lse(return_lse)
    _check_backend(backend)
    p = make_call(q, k, v, **options, wants_lse=return_lse)[0]
    if backend is not None:
        get_backend(backend)
    return decide(p, backend)


class Plan:
    """A decision made once for calls of one signature: `attnx.plan(...)` returns it.

    ``plan.run(q, k, v, **tensors)`` validates the new tensors, checks they have the
    planned signature (shapes, dtypes, device, formats) and runs the planned backend
    without asking the dispatcher again: what a decode loop or a CUDA-graph capture wants.
    Keyword arguments that are not tensors (``causal``, ``window``, ...) are fixed at plan time.
    """

    _TENSOR_OPTIONS = ("mask", "alibi_slopes", "sinks", "cu_seqlens_q", "cu_seqlens_k", "seqlens_k", "page_table")

    def __init__(self, problem: Problem, backend, options: dict, return_lse: bool):
        self.problem = problem
        self.backend = backend
        self._options = {n: v for n, v in options.items() if n not in self._TENSOR_OPTIONS}
        self._return_lse = return_lse

    def run(self, q, k, v, **tensors):
        """``attention(q, k, v, ...)`` with the planned options and backend."""
        return self._execute(*self._check(q, k, v, tensors))

    def _check(self, q, k, v, tensors: dict):
        """Validate a call's tensors against the plan (raising before anything runs): its ``(Problem, Inputs)``."""
        unknown = set(tensors) - set(self._TENSOR_OPTIONS)
        if unknown:
            raise InvalidArgumentError(f"Plan.run takes tensors only; fixed at plan time: {', '.join(sorted(unknown))}")
        p, x = make_call(q, k, v, **self._options, **tensors, wants_lse=self._return_lse)
        if p is not self.problem and p != self.problem:  # (a remembered plain call: the same object)
            changed = [f"{name} {getattr(self.problem, name)!r} -> {getattr(p, name)!r}"
                       for name in Problem._fields if getattr(p, name) != getattr(self.problem, name)]
            raise InvalidArgumentError("these tensors do not have the planned signature: " + "; ".join(changed))
        return p, x

    def _execute(self, p: Problem, x: Inputs):
        out, lse = empty_result(p, x) if p.is_empty else run(p, self.backend, x)
        return (out, lse) if self._return_lse else out

    __call__ = run

    def __repr__(self) -> str:
        return f"<attnx.Plan backend={getattr(self.backend, 'name', None)!r}>"


def plan(q, k, v, *, backend=None, return_lse=False, **options) -> Plan:
    """Decide once for `attention(q, k, v, **options)`; call the returned `Plan` with new tensors.

    Example (a decode loop over a paged cache; shapes stay fixed, values change)::

        step = attnx.plan(q, k_pages, v_pages, seqlens_k=lengths, page_table=table)
        for _ in range(steps):
            out = step.run(q, k_pages, v_pages, seqlens_k=lengths, page_table=table)
    """
    _check_return_lse(return_lse)
    _check_backend(backend)
    p = make_call(q, k, v, **options, wants_lse=return_lse)[0]
    chosen = None if p.is_empty else choose(p, backend)
    if chosen is not None:
        chosen.prepare(p)
    elif backend is not None:
        get_backend(backend)  # an empty problem runs no backend, but an unknown name is still an error
    return Plan(p, chosen, options, return_lse)
