"""Triton's on-disk kernel cache, when it fails a compile (docs/reliability.md T2, T3).

Triton raises instead of compiling when its cache directory cannot be written and holds no entry for
the kernel (`PermissionError`, `NotADirectoryError`), and on some damaged entries (`JSONDecodeError`
or `UnicodeDecodeError` from unreadable metadata; before Triton 3.9 also from a damaged group index,
and `KeyError` from an index naming a deleted binary). attnx does not own that cache, so it neither
repairs nor deletes anything in it: a launch or compile that fails that way runs again with Triton
pointed at a private temporary directory (one per broken directory, removed at exit, a warning says
which), and every later call while the same directory is configured goes there directly. This is what
the cuda backend does with CuPy's cache (R5, R6). A binary that Triton loads without complaint (T1: no
checksum) is not detected.
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile
import threading
import warnings
from pathlib import Path

ENV = "TRITON_CACHE_DIR"
# errors Triton raises reading its own cache entries (metadata, group indexes, IR files); only counted
# when raised inside Triton's compiler or cache modules
_READ_ERRORS = (json.JSONDecodeError, UnicodeDecodeError, KeyError)
_TRITON_CACHE_CODE = (os.path.join("triton", "runtime", "cache.py"), os.path.join("triton", "compiler", "compiler.py"))

_redirects: dict = {}   # configured directory -> private directory
_lock = threading.RLock()  # held while a call runs redirected (the variable is process-wide)


def configured_dir() -> str:
    """The directory Triton's next compile would use (what TRITON_CACHE_DIR or Triton's default says)."""
    try:
        from triton import knobs
        return str(knobs.cache.dir)
    except ImportError:  # Triton before the knobs module
        from triton.runtime.cache import default_cache_dir
        return str(default_cache_dir())


def _within(path, directory: str) -> bool:
    try:
        return Path(os.path.abspath(path)).is_relative_to(os.path.abspath(directory))
    except (TypeError, ValueError):
        return False


def is_cache_error(err: BaseException, directory: str) -> bool:
    """Whether `err` comes from Triton's cache in `directory` (not from the kernel or its inputs)."""
    if isinstance(err, OSError):
        return any(_within(name, directory) for name in (err.filename, err.filename2) if name)
    if isinstance(err, _READ_ERRORS):
        tb, inside = err.__traceback__, False
        while tb is not None:
            inside = inside or tb.tb_frame.f_code.co_filename.endswith(_TRITON_CACHE_CODE)
            tb = tb.tb_next
        return inside
    return False


def _private_for(directory: str, err: BaseException) -> str:
    with _lock:
        private = _redirects.get(directory)
        if private is None:
            private = tempfile.mkdtemp(prefix="attnx-triton-cache-")
            atexit.register(shutil.rmtree, private, True)
            _redirects[directory] = private
            warnings.warn(f"Triton's kernel cache {directory!r} failed a compile ({type(err).__name__}: "
                          f"{str(err)[:200]}); attnx compiles Triton kernels in {private!r} for the rest of this "
                          f"process while {ENV} points there (docs/reliability.md T2, T3)", RuntimeWarning,
                          stacklevel=4)
    return private


def _run_in(private: str, fn, args, kwargs):
    with _lock:
        before = os.environ.get(ENV)
        os.environ[ENV] = private
        try:
            return fn(*args, **kwargs)
        finally:
            if before is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = before


def survives_cache_errors(fn):
    """`fn` (a launch or compile of Triton kernels) run again in a private cache directory when Triton's
    configured cache fails it; calls made while a broken directory is configured go there directly."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if _redirects:  # (the common case, no broken cache seen, costs nothing here)
            private = _redirects.get(configured_dir())
            if private is not None:
                return _run_in(private, fn, args, kwargs)
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            directory = configured_dir()
            if not is_cache_error(err, directory):
                raise
            private = _private_for(directory, err)
        return _run_in(private, fn, args, kwargs)
    return run
