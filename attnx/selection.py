"""Restricting which backends the dispatcher may use: `use_backend` and ATTNX_BACKEND."""
from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterable, Optional, Union

from .errors import InvalidArgumentError, InvalidTypeError
from .registry import get_backend

ENV_VAR = "ATTNX_BACKEND"
_allowed: contextvars.ContextVar[Optional[tuple]] = contextvars.ContextVar("attnx_allowed_backends", default=None)
_env_cache: dict[str, tuple] = {}
# os.environ's own store and ATTNX_BACKEND's key in it: one dict lookup per call instead of
# os.environ.get's encode and KeyError round trip (every attention call asks)
_ENVIRON = os.environ
_ENV_STORE = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey(ENV_VAR) if _ENV_STORE is not None and hasattr(os.environ, "encodekey") else None


def _environment_value() -> Optional[str]:
    """ATTNX_BACKEND as the environment holds it now (None when unset)."""
    if _ENV_KEY is None or os.environ is not _ENVIRON:
        return os.environ.get(ENV_VAR)
    raw = _ENV_STORE.get(_ENV_KEY)
    return None if raw is None else _ENVIRON.decodevalue(raw)


def normalize_names(names: Union[str, Iterable[str]], what: str) -> tuple[str, ...]:
    """Turn "a", "a,b" or ["a", "b"] into a tuple of registered names."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    elif isinstance(names, Iterable):
        names = list(names)
    else:
        raise InvalidTypeError(f"{what} must be a backend name or a list of names, got {type(names).__name__}")
    if not names:
        raise InvalidArgumentError(f"{what} names no backend")
    for name in names:
        try:
            get_backend(name)
        except InvalidTypeError as err:  # name what was wrong: use_backend or ATTNX_BACKEND
            raise InvalidTypeError(f"{what}: {err}") from None
        except InvalidArgumentError as err:
            raise InvalidArgumentError(f"{what}: {err}") from None
    return tuple(names)


def allowed_backends() -> Optional[tuple[str, ...]]:
    """Names the current context allows (innermost `use_backend`, else ATTNX_BACKEND), or None for all."""
    allowed = _allowed.get()
    if allowed is not None:
        return allowed
    if _ENV_KEY is not None and _ENV_KEY not in _ENV_STORE and os.environ is _ENVIRON:
        return None  # ATTNX_BACKEND unset, the common case: one lookup, no call
    env = _environment_value()
    if not env:
        return None
    cached = _env_cache.get(env)
    if cached is None:
        cached = _env_cache[env] = normalize_names(env, f"the environment variable {ENV_VAR}")
    return cached


@contextlib.contextmanager
def use_backend(names: Union[str, Iterable[str]]):
    """Restrict dispatch to the named backend(s) inside a ``with`` block.

    The innermost block wins; the previous restriction is restored on exit, also
    when the block raises. A problem none of the named backends accepts raises
    `attnx.NoBackendError` with their reasons.

    Example::

        with attnx.use_backend("blocked"):
            out = attnx.attention(q, k, v, causal=True)
    """
    token = _allowed.set(normalize_names(names, "use_backend"))
    try:
        yield
    finally:
        _allowed.reset(token)
