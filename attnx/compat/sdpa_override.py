"""`use_attnx_for_sdpa`: route ``torch.nn.functional.scaled_dot_product_attention`` through attnx in a block.

While at least one block is open anywhere in the process, the module attribute
``torch.nn.functional.scaled_dot_product_attention`` is a small router; calls made
inside a block (in the thread, or asyncio task, that entered it: the state is a
``contextvars.ContextVar``) go to attnx, every other call to torch's own function.
The last block to close puts torch's function back.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from typing import Optional

import torch
import torch.nn.functional as F

from ..errors import InvalidTypeError
from ..registry import get_backend
from .sdpa import sdpa_call

# the options of the innermost open block in this context, or None (torch's function runs)
_route: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("attnx_sdpa_route", default=None)
_lock = threading.Lock()
# the options of every open block in the process (all threads), in the order they were opened
_open_routes: list[dict] = []
_torch_sdpa = F.scaled_dot_product_attention
# what torch.compile sees while it traces inside a block (it cannot read the ContextVar): the
# options of the most recently opened block still open, or None
_traced_route: Optional[dict] = None


@functools.wraps(_torch_sdpa)
def _router(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    route = _traced_route if torch.compiler.is_compiling() else _route.get()
    if route is None:
        return _torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    return sdpa_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend=route["backend"])


def _install(options: dict) -> None:
    """Open a block: the router is in place while any block is open."""
    global _traced_route
    with _lock:
        if not _open_routes:
            F.scaled_dot_product_attention = _router
        _open_routes.append(options)
        _traced_route = options


def _uninstall(options: dict) -> None:
    """Close the block of ``options`` (blocks of several threads may close in any order)."""
    global _traced_route
    with _lock:
        index = next(i for i, route in enumerate(_open_routes) if route is options)
        del _open_routes[index]
        _traced_route = _open_routes[-1] if _open_routes else None
        if not _open_routes and F.scaled_dot_product_attention is _router:
            F.scaled_dot_product_attention = _torch_sdpa


@contextlib.contextmanager
def use_attnx_for_sdpa(backend: Optional[str] = None):
    """Inside the block, ``torch.nn.functional.scaled_dot_product_attention`` calls run on attnx.

    Unmodified model code (transformers' ``sdpa``, timm, diffusers, ``nn.MultiheadAttention``)
    then computes its attention with attnx; `scaled_dot_product_attention` says how the
    arguments map. ``backend`` forces one attnx backend (default: the dispatcher chooses).

    * Restores torch's function on exit, also when the block raises.
    * Nests: the innermost block's ``backend`` applies; torch's function is back once the
      outermost block in the process has closed.
    * Thread-safe: only calls made in the thread (or asyncio task) that entered the block are
      routed; other threads keep calling torch's function meanwhile.
    * Code that bound the function before the block (``from torch.nn.functional import
      scaled_dot_product_attention``) keeps torch's; code that looks it up on the module
      (``F.scaled_dot_product_attention(...)``) is routed.
    * torch.compile: graphs traced inside a block call attnx (the routing is decided when
      the graph is traced, not per call).
    * ``dropout_p > 0`` raises `CompatArgumentError` (attnx has no dropout): call ``model.eval()``.

    Example::

        with attnx.compat.use_attnx_for_sdpa():
            logits = model(input_ids)       # every F.scaled_dot_product_attention call runs on attnx

    Equivalent PyTorch (what the block replaces)::

        logits = model(input_ids)           # F.scaled_dot_product_attention runs torch's kernels
    """
    if backend is not None:
        if not isinstance(backend, str):
            raise InvalidTypeError(f"`backend` must be a backend name or None, got {backend!r}")
        get_backend(backend)
    options = {"backend": backend}
    token = _route.set(options)
    _install(options)
    try:
        yield
    finally:
        _uninstall(options)
        _route.reset(token)
