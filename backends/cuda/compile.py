"""Run-time compilation of the CUDA kernels: NVRTC through `cupy.RawModule`.

The `.cu` files under ``kernels/`` include their headers by path from that folder
(``"common/softmax.cuh"``, ``"sm80/ptx.cuh"``); `kernel_source` inlines them so NVRTC
needs no include path and the compiled binary is keyed by the full text. The ``-arch``
value comes from `families.nvrtc_arch` (``sm_90a`` on sm_90). CuPy caches each binary
on disk (``~/.cupy/kernel_cache``, or ``CUPY_CACHE_DIR``) keyed by source, options,
architecture and NVRTC version, and writes cache files atomically, so several processes
may compile at once.
CuPy creates its cache directory when it is imported; where that cannot be done (a read-only
home, an uncreatable ``CUPY_CACHE_DIR``) `import_cupy` imports it on a private temporary
directory, warns, and attnx's kernels then compile in memory (docs/reliability.md, R6).
`compile_time_report()` tells how long each specialisation took to get ready in
this process (a compile, or a disk-cache hit).
"""
from __future__ import annotations

import atexit
import functools
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

from attnx.errors import AttnxError

from .variants import Variant

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.M)
_lock = threading.Lock()
_import_lock = threading.Lock()
_modules: dict = {}
_times: dict = {}
_in_memory = False  # set when CuPy was imported on a private temporary cache directory (R6)


class CupyCacheError(AttnxError, RuntimeError):
    """CuPy cannot be imported because of its kernel cache directory, even on a fresh temporary one."""


@functools.lru_cache(maxsize=None)
def kernel_source(name: str) -> str:
    """The text of kernel file `name` (a path under kernels/) with its headers inlined (each once)."""
    seen: set = set()

    def expand(fname: str) -> str:
        if fname in seen:
            return ""
        seen.add(fname)
        text = (KERNEL_DIR / fname).read_text()
        text = text.replace("#pragma once", "")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(name)


def nvrtc_options(variant: Variant, arch: str) -> tuple[str, ...]:
    """NVRTC options of one specialisation for `arch` (`families.nvrtc_arch`, e.g. "sm_90a")."""
    return (f"-arch={arch}", "-std=c++17", *variant.defines())


def get_kernel(variant: Variant, arch: str, device_index: int):
    """The compiled `cupy.RawKernel` of `variant` on one device (compiled once per process)."""
    key = (variant, arch, device_index)
    kernel = _modules.get(key)
    if kernel is not None:
        return kernel
    cupy = import_cupy()

    with _lock:
        kernel = _modules.get(key)
        if kernel is None:
            start = time.perf_counter()
            with cupy.cuda.Device(device_index):
                kernel = _compile(cupy, variant, arch)
                smem = variant.shared_bytes()
                if smem > 48 * 1024:
                    kernel.max_dynamic_shared_size_bytes = smem
            _times[key] = time.perf_counter() - start
            _modules[key] = kernel
    return kernel


def _cache_dir() -> str:
    return os.environ.get("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache")


def import_cupy():
    """`import cupy`, surviving a kernel cache directory that cannot be created (R6).

    CuPy 14 creates ``CUPY_CACHE_DIR`` (default ``~/.cupy/kernel_cache``) while it is imported
    (``cupy.cuda.compiler`` builds its disk cache then, whatever ``CUPY_CACHE_IN_MEMORY`` says), so
    an uncreatable directory fails the import itself. Before the first import this creates the
    directory as CuPy would; where that fails (or the import still raises ``OSError``), CuPy is
    imported on a fresh private directory instead (`_import_on_private_dir`). If that fails too:
    `CupyCacheError`, before any launch.
    """
    if "cupy" in sys.modules:  # the common case: imported already
        import cupy
        return cupy
    with _import_lock:  # one first import at a time: the fallback sets a process-wide variable
        if "cupy" in sys.modules:
            import cupy
            return cupy
        wanted = _cache_dir()
        try:
            os.makedirs(wanted, exist_ok=True)  # what CuPy's import does first
        except OSError as err:
            return _import_on_private_dir(wanted, err)
        before = set(sys.modules)
        try:
            import cupy
            return cupy
        except OSError as err:
            _forget_cupy_modules(before)
            return _import_on_private_dir(wanted, err)


def _forget_cupy_modules(before: set) -> None:
    """Drop the CuPy submodules a failed import left behind: a second import must run them afresh
    (CuPy 14.2 fails with "partially initialized module" otherwise; checked without a GPU)."""
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("cupy", "cupyx", "cupy_backends"):
            del sys.modules[name]


def _import_on_private_dir(wanted: str, first: OSError):
    """Import CuPy with CUPY_CACHE_DIR on a fresh private directory (mode 0700, removed at exit).

    The caller's ``CUPY_CACHE_DIR`` is restored right after the import (CuPy read it then), and
    attnx's kernels compile in memory from then on, so the private directory stays empty.
    """
    global _in_memory
    private = tempfile.mkdtemp(prefix="attnx-cupy-cache-")
    previous = os.environ.get("CUPY_CACHE_DIR")
    os.environ["CUPY_CACHE_DIR"] = private
    before = set(sys.modules)
    try:
        import cupy
    except OSError as err:
        _forget_cupy_modules(before)
        shutil.rmtree(private, ignore_errors=True)
        raise CupyCacheError(
            f"`import cupy` failed ({type(first).__name__}: {first}); CuPy creates its kernel cache directory "
            f"(CUPY_CACHE_DIR, here {wanted!r}) when imported, and an import on a fresh temporary directory failed "
            f"too ({type(err).__name__}: {err}). Set CUPY_CACHE_DIR to a folder you can write.") from err
    finally:
        if previous is None:
            os.environ.pop("CUPY_CACHE_DIR", None)
        else:
            os.environ["CUPY_CACHE_DIR"] = previous
    atexit.register(shutil.rmtree, private, ignore_errors=True)
    _in_memory = True
    warnings.warn(f"CuPy's kernel cache directory cannot be created (CUPY_CACHE_DIR, here {wanted!r}: {first}); "
                  f"attnx imported CuPy on a private temporary directory and compiles its kernels in memory, so "
                  f"they are not kept across processes (set CUPY_CACHE_DIR to a folder you can write)",
                  RuntimeWarning, stacklevel=4)
    return cupy


def _compile(cupy, variant: Variant, arch: str):
    """Compile (or load from CuPy's disk cache); an unwritable cache compiles in memory, with a warning."""
    def build():
        module = cupy.RawModule(code=kernel_source(variant.source), options=nvrtc_options(variant, arch))
        return module.get_function(variant.function)  # CuPy compiles here, lazily

    if not _in_memory:  # (in memory: CuPy runs on a private temporary cache, warned at import)
        try:
            return build()
        except OSError as err:  # PermissionError, read-only file system, disk full: the cache, not the kernel
            warnings.warn(f"CuPy's kernel cache cannot be written ({err}); compiling {variant.label()} in memory "
                          f"(set CUPY_CACHE_DIR to a writable folder to keep compiled kernels)", RuntimeWarning,
                          stacklevel=3)
    previous = os.environ.get("CUPY_CACHE_IN_MEMORY")
    os.environ["CUPY_CACHE_IN_MEMORY"] = "1"
    try:
        return build()
    finally:
        if previous is None:
            del os.environ["CUPY_CACHE_IN_MEMORY"]
        else:
            os.environ["CUPY_CACHE_IN_MEMORY"] = previous


def compile_time_report() -> list[dict]:
    """Per specialisation loaded in this process: label, arch, seconds to get ready, registers, spills.

    The first call of a specialisation compiles it (or loads it from CuPy's disk
    cache); the doctor shows these figures.
    """
    rows = []
    for (variant, arch, device), seconds in sorted(_times.items(), key=lambda kv: kv[0][0].label()):
        kernel = _modules[(variant, arch, device)]
        try:
            attrs = kernel.attributes
            regs, local = attrs.get("num_regs"), attrs.get("local_size_bytes")
        except Exception:  # attributes need a live context; the figures are optional
            regs = local = None
        rows.append({"variant": variant.label(), "arch": arch, "device": device, "seconds": round(seconds, 3),
                     "registers": regs, "local_bytes": local})
    return rows
