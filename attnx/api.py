"""The public entry points: `attention` and `explain`."""
from __future__ import annotations

import torch

from .autograd import run
from .dispatch import Decision, choose, decide
from .errors import InvalidTypeError
from .problem import make_problem


def attention(q, k, v, *, causal=False, window=None, mask=None, scale=None, softcap=None,
              alibi_slopes=None, layout="bhsd", backend=None, return_lse=False):
    """Exact scaled dot-product attention, computed by the best backend for the problem.

    Args:
        q: ``(B, Hq, Sq, D)`` (``layout="bhsd"``) or ``(B, Sq, Hq, D)`` (``layout="bshd"``).
        k, v: ``(B, Hkv, Sk, D)`` and ``(B, Hkv, Sk, Dv)`` in the same layout; ``Hq % Hkv == 0``
            (query head ``h`` reads kv head ``h // (Hq // Hkv)``).
        causal: bottom-right aligned: query ``i`` sees key ``j`` iff ``j <= i + Sk - Sq``.
        window: ``(left, right)``, ints >= 0 or None: query ``i`` sees ``j`` iff
            ``p_i - left <= j <= p_i + right`` with ``p_i = i + Sk - Sq``.
        mask: bool (True = may attend) or floating additive bias, broadcastable to ``(B, Hq, Sq, Sk)``.
        scale: score scale, default ``1 / sqrt(D)``.
        softcap: ``s = softcap * tanh(s / softcap)`` on the scaled score, before masks and bias.
        alibi_slopes: float32 ``(Hq,)`` or ``(B, Hq)``; adds ``-slope * |p_i - j|``.
        layout: ``"bhsd"`` (torch SDPA) or ``"bshd"`` (flash-attn).
        backend: name of a registered backend to force, or None to let the dispatcher choose.
        return_lse: also return ``lse``, float32 ``(B, Hq, Sq)``: log of the softmax denominator
            (``-inf`` for a row that sees no key). ``lse`` is not differentiable.

    Returns:
        ``out`` with ``q``'s dtype, shape ``(B, Hq, Sq, Dv)`` in ``layout``; or ``(out, lse)``.

    A query row that sees no key gets ``out = 0``, ``lse = -inf`` and zero gradients.

    Equivalent PyTorch (``bhsd``, no GQA, no window/alibi/softcap)::

        s = (q @ k.transpose(-2, -1)) * scale
        if causal:
            s = s.masked_fill(~torch.ones(Sq, Sk, dtype=torch.bool).tril(Sk - Sq), float("-inf"))
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
        out = torch.softmax(s, dim=-1) @ v
    """
    if not isinstance(return_lse, bool):
        raise InvalidTypeError(f"`return_lse` must be a bool, got {return_lse!r}")
    if torch.compiler.is_compiling():
        from .compile_ops import traced_attention

        out, lse = traced_attention(q, k, v, mask, alibi_slopes, causal, window, scale, softcap, layout, backend)
    else:
        p = make_problem(q, k, v, causal, window, mask, scale, softcap, alibi_slopes, layout)
        out, lse = run(p, choose(p, backend), q, k, v, mask, alibi_slopes)
    return (out, lse) if return_lse else out


def explain(q, k, v, *, causal=False, window=None, mask=None, scale=None, softcap=None,
            alibi_slopes=None, layout="bhsd", backend=None, return_lse=False) -> Decision:
    """The dispatcher's decision for these arguments, without running anything.

    Returns a `Decision`: ``chosen`` (a backend name, or None) and ``reasons``
    mapping every registered backend to ``[]`` ("would work") or the reasons it
    declines. ``print(attnx.explain(q, k, v, causal=True))`` shows it as a table.
    """
    p = make_problem(q, k, v, causal, window, mask, scale, softcap, alibi_slopes, layout)
    if backend is not None:
        from .registry import get_backend

        get_backend(backend)
    return decide(p, backend)
