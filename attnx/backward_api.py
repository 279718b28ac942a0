"""`attention_backward`: the gradients of attention from a given ``(out, lse)``, on a backend's own backward.

The dispatcher's rules for a problem that needs gradients decide which backend runs it, plus
one more: the backend's backward must compute the probabilities from the lse it is given
(`Backend.backward_uses_given_lse`), because the lse may come from a wider softmax than the
keys passed here (ring attention merges blocks held by other ranks). Backends that recompute
their own normaliser decline with that reason.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import registry
from .autograd import lse_shape, run_backward
from .api import empty_result
from .dispatch import no_backend, priority
from .errors import InvalidArgumentError, InvalidTypeError
from .problem import Problem, check_strided, make_call
from .selection import allowed_backends

_CACHE_LIMIT = 4096
_chosen: dict = {}  # (problem, allowed, registry generation) -> backend


def lse_reasons(backend, p: Problem) -> list[str]:
    """Why `backend` cannot run `attention_backward` for `p` beyond its usual reasons (empty: it can)."""
    # the declarations in force on p's device (`Backend.device_declarations` may change it there)
    declared = backend.declarations(p.device_classes) if hasattr(backend, "declarations") else backend
    if p.dtype in declared.backward_uses_given_lse:
        return []
    dtype = str(p.dtype).replace("torch.", "")
    return [f"its {dtype} backward recomputes the softmax normaliser over its own keys instead of using the "
            "given lse (Backend.backward_uses_given_lse)"]


def choose_backward(p: Problem, forced: Optional[str] = None):
    """The backend that runs `attention_backward` for `p` (which needs gradients); NoBackendError otherwise."""
    allowed = (forced,) if forced is not None else allowed_backends()
    key = (p, allowed, registry.generation())
    backend = _chosen.get(key)
    if backend is not None:
        return backend
    if forced is not None:
        registry.get_backend(forced)  # unknown names raise
    declined = {}
    for name in priority(p):
        if allowed is not None and name not in allowed:
            continue
        candidate = registry.get_backend(name)
        why = candidate.reasons(p) + lse_reasons(candidate, p)
        if not why:
            if len(_chosen) >= _CACHE_LIMIT:
                _chosen.clear()
            _chosen[key] = candidate
            return candidate
        declined[name] = why
    raise no_backend(forced, allowed, "this backward", declined)


def _out_shape(p: Problem, q: torch.Tensor) -> tuple:
    if p.q_format == "varlen":
        return (q.shape[0], p.heads_q, p.head_dim_v)
    if p.layout == "bshd":
        return (p.batch, p.seqlen_q, p.heads_q, p.head_dim_v)
    return (p.batch, p.heads_q, p.seqlen_q, p.head_dim_v)


def _check_tensor(name: str, t, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    check_strided(name, t)
    if t.dtype != dtype:
        raise InvalidTypeError(f"`{name}` must be {str(dtype).replace('torch.', '')}, got "
                               f"{str(t.dtype).replace('torch.', '')}")
    if tuple(t.shape) != tuple(shape):
        raise InvalidArgumentError(f"`{name}` must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise InvalidArgumentError(f"`{name}` must be on {device}, got {t.device}")


def attention_backward(q, k, v, out, lse, dout, *, causal=False, window=None, offset=None, mask=None, scale=None,
                       softcap=None, alibi_slopes=None, sinks=None, layout="bhsd", cu_seqlens_q=None,
                       cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqlens_k=None, page_table=None,
                       deterministic=None, backend=None):
    """Gradients of `attnx.attention` for the output gradient `dout`, from a given ``out`` and ``lse``.

    Runs the chosen backend's own backward kernel (the dispatcher decides as for a call that
    needs gradients, or runs `backend`). The probabilities are ``P = exp(s - lse)`` with the
    ``lse`` given here, so it may come from a softmax over more keys than `k` holds: with the
    ``out`` and ``lse`` of the whole row (merged over blocks, as ring attention does), the result
    is this block's share of the row's gradients, and the shares of the blocks add up to the
    gradients of the whole row. Backends whose backward recomputes its own normaliser decline
    (`Backend.backward_uses_given_lse`: every built-in backend but ``naive``, float64 excepted).

    Args:
        q, k, v: as in `attnx.attention` (any format and layout); need not require grad.
        out: the forward's output, q's dtype, the shape `attention` returns.
        lse: float32, the shape `attention(..., return_lse=True)` returns; rows that see no key
            (over the whole softmax) hold ``-inf``, and the sinks are counted in it.
        dout: the gradient of ``out``, same shape and dtype.
        causal, window, offset, mask, scale, softcap, alibi_slopes, sinks, layout, cu_seqlens_q,
        cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqlens_k, page_table, backend: as in
        `attnx.attention`. No gradient of `mask` is computed.
        deterministic: as in `attnx.attention`: True (or ``torch.use_deterministic_algorithms(True)``)
            runs only a backward that gives bitwise-identical gradients run to run.

    Returns:
        ``(dq, dk, dv)`` in the shapes, dtype and layout of q, k, v; ``(dq, dk, dv, dsinks)``
        (``dsinks`` float32 ``(Hq,)``) when `sinks` is given.

    Equivalent PyTorch (``lse`` and ``out`` from the same call's forward)::

        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = attnx.attention(q, k, v, causal=causal, ...)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)

    and for a given ``lse`` (``bhsd``, no GQA; ``s`` the final scores, -inf where hidden)::

        p = torch.exp(s - lse[..., None])
        dv = p.transpose(-2, -1) @ dout
        ds = p * (dout @ v.transpose(-2, -1) - (dout * out).sum(-1, keepdim=True))
        dq, dk = ds @ k * scale, ds.transpose(-2, -1) @ q * scale   # softcap: ds * (1 - tanh^2)
    """
    options = dict(causal=causal, window=window, offset=offset, mask=mask, scale=scale, softcap=softcap,
                   alibi_slopes=alibi_slopes, sinks=sinks, layout=layout, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                   seqlens_k=seqlens_k, page_table=page_table, deterministic=deterministic)
    wanted = ("q", "k", "v") + (("sinks",) if sinks is not None else ())
    p, x = make_call(q, k, v, grad_inputs=wanted, **options)
    shape = _out_shape(p, q)
    _check_tensor("out", out, shape, q.dtype, q.device)
    _check_tensor("dout", dout, shape, q.dtype, q.device)
    _check_tensor("lse", lse, lse_shape(p, q), torch.float32, q.device)
    if p.is_empty:
        if backend is not None:
            registry.get_backend(backend)  # an unknown name is still an error
        empty_result(p, x)  # the index values a CPU call always has checked
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        return tuple(grads) + ((torch.zeros_like(sinks, dtype=torch.float32),) if sinks is not None else ())
    chosen = choose_backward(p, backend)
    with torch.no_grad():
        x = x.replace(**{name: getattr(x, name).detach() for name in wanted + ("mask", "alibi_slopes")
                         if getattr(x, name) is not None})
        grads = run_backward(p, chosen, x, out.detach(), lse.detach(), dout.detach())
    result = (grads.dq, grads.dk, grads.dv)
    return result + (grads.dsinks,) if sinks is not None else result
