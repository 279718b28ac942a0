"""The set of registered backends, by name."""
from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys

from .backend import Backend
from .errors import InvalidArgumentError, InvalidTypeError

_BACKENDS: dict[str, Backend] = {}
_builtins_loaded = False


def _import_builtin_backends():
    """Import ``attnx.backends`` (installed from the top-level ``backends/`` folder)."""
    try:
        return importlib.import_module("attnx.backends")
    except ModuleNotFoundError as err:
        if err.name != "attnx.backends":
            raise
    # Running from a source checkout that was never installed: map the folder by hand.
    folder = pathlib.Path(__file__).resolve().parent.parent / "backends"
    spec = importlib.util.spec_from_file_location(
        "attnx.backends", folder / "__init__.py", submodule_search_locations=[str(folder)])
    if spec is None:
        raise ModuleNotFoundError("attnx.backends is not installed; run `pip install -e .`")
    module = importlib.util.module_from_spec(spec)
    sys.modules["attnx.backends"] = module
    spec.loader.exec_module(module)
    return module


def _ensure_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for backend in _import_builtin_backends().builtin_backends():
            _BACKENDS.setdefault(backend.name, backend)


def register_backend(backend: Backend) -> Backend:
    """Register a backend instance under its ``name`` (replacing one of that name)."""
    if not isinstance(backend, Backend):
        raise InvalidTypeError(f"`backend` must be an attnx.Backend instance, got {type(backend).__name__}")
    if not backend.name:
        raise InvalidArgumentError("a backend needs a non-empty `name`")
    _ensure_builtins()
    _BACKENDS[backend.name] = backend
    from .dispatch import clear_cache
    clear_cache()
    return backend


def registered_backends() -> dict[str, Backend]:
    """Registered backends by name, in registration order."""
    _ensure_builtins()
    return _BACKENDS


def get_backend(name: str) -> Backend:
    if not isinstance(name, str):
        raise InvalidTypeError(f"a backend name must be a str, got {type(name).__name__}")
    table = registered_backends()
    if name not in table:
        raise InvalidArgumentError(f"unknown backend {name!r}; registered: {', '.join(table)}")
    return table[name]


def list_backends() -> list[dict]:
    """Each registered backend with its availability on this machine."""
    return [{"name": b.name, "available": b.available, "reasons": list(b.unavailable_reasons),
             "description": b.description} for b in registered_backends().values()]
