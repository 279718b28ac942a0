"""The set of registered backends, by name.

The built-in backends live in ``attnx.backends`` (the top-level ``backends/`` folder,
installed under that name by pyproject.toml). Other packages register theirs with
`register_backend`, or for a test with the `registered` context manager.
"""
from __future__ import annotations

import contextlib
import importlib
import threading

from .backend import Backend
from .errors import InvalidArgumentError, InvalidTypeError

_backends: dict[str, Backend] = {}
_loaded = False
_load_lock = threading.Lock()  # threads making their first call at once must all see the built-ins
# bumped on every change, so cached dispatch decisions made under another registry are never reused
_generation = 0


def _ensure_builtins() -> None:
    global _loaded
    if _loaded:
        return
    with _load_lock:
        if not _loaded:
            for backend in importlib.import_module("attnx.backends").builtin_backends():
                _backends.setdefault(backend.name, backend)
            _loaded = True


def generation() -> int:
    """A number that changes whenever the set of registered backends does."""
    return _generation


def _set(name: str, backend) -> None:
    global _generation
    _ensure_builtins()
    if backend is None:
        _backends.pop(name, None)
    else:
        _backends[name] = backend
    _generation += 1


def _checked(backend) -> Backend:
    if not isinstance(backend, Backend):
        raise InvalidTypeError(f"`backend` must be an attnx.Backend instance, got {type(backend).__name__}")
    if not backend.name:
        raise InvalidArgumentError("a backend needs a non-empty `name`")
    return backend


def register_backend(backend: Backend) -> Backend:
    """Register a backend instance under its ``name`` (replacing one of that name).

    Its place in the dispatcher's order comes from its `Backend.priority` table.
    """
    _set(_checked(backend).name, backend)
    return backend


def unregister_backend(name: str) -> None:
    """Remove the backend registered as `name` (unknown names raise)."""
    get_backend(name)
    _set(name, None)


@contextlib.contextmanager
def registered(backend: Backend):
    """Register `backend` inside a ``with`` block; on exit restore what had its name before.

    Example (a test's spy backend)::

        with attnx.registered(MyBackend()):
            attnx.attention(q, k, v, backend="mine")
    """
    name = _checked(backend).name
    previous = registered_backends().get(name)
    _set(name, backend)
    try:
        yield backend
    finally:
        _set(name, previous)


def registered_backends() -> dict[str, Backend]:
    """Registered backends by name, in registration order (a copy)."""
    _ensure_builtins()
    return dict(_backends)


def get_backend(name: str) -> Backend:
    if not isinstance(name, str):
        raise InvalidTypeError(f"a backend name must be a str, got {type(name).__name__}")
    _ensure_builtins()
    backend = _backends.get(name)
    if backend is None:
        raise InvalidArgumentError(f"unknown backend {name!r}; registered: {', '.join(_backends)}")
    return backend


def list_backends() -> list[dict]:
    """Each registered backend with its availability on this machine."""
    return [{"name": b.name, "available": b.available, "reasons": list(b.unavailable_reasons),
             "description": b.description} for b in registered_backends().values()]
