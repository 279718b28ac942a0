"""Run-time compilation of the CUDA kernels: NVRTC through `cupy.RawModule`.

The `.cu` files under ``kernels/`` include their headers by path from that folder
(``"common/softmax.cuh"``, ``"sm80/ptx.cuh"``); `kernel_source` inlines them so NVRTC
needs no include path and the compiled binary is keyed by the full text. The ``-arch``
value comes from `families.nvrtc_arch` (``sm_90a`` on sm_90). CuPy caches each binary
on disk (``~/.cupy/kernel_cache``, or ``CUPY_CACHE_DIR``) keyed by source, options,
architecture and NVRTC version, and writes cache files atomically, so several processes
may compile at once.
`compile_time_report()` tells how long each specialisation took to get ready in
this process (a compile, or a disk-cache hit).
"""
from __future__ import annotations

import functools
import os
import re
import threading
import time
import warnings
from pathlib import Path

from .variants import Variant

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.M)
_lock = threading.Lock()
_modules: dict = {}
_times: dict = {}


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
    import cupy

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


def _compile(cupy, variant: Variant, arch: str):
    """Compile (or load from CuPy's disk cache); an unwritable cache compiles in memory, with a warning."""
    def build():
        module = cupy.RawModule(code=kernel_source(variant.source), options=nvrtc_options(variant, arch))
        return module.get_function(variant.function)  # CuPy compiles here, lazily

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
