"""CI (no GPU): every CUDA kernel specialisation the launcher can request compiles with NVRTC.

NVRTC from cuda-bindings is the compiler CuPy uses at run time; it needs
libnvrtc (pip `nvidia-cuda-nvrtc`), not a GPU or a driver. The kernels include no
CUDA headers, so no include path is needed.
"""
import importlib
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

import attnx  # noqa: F401  (maps attnx.backends in a source checkout)
from attnx.registry import _import_builtin_backends

_import_builtin_backends()
variants = importlib.import_module("attnx.backends.cuda.variants")
nvrtc_check = importlib.import_module("attnx.backends.cuda.nvrtc_check")


def _nvrtc_available() -> str:
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        return "cuda-bindings is not installed (pip install cuda-bindings)"
    try:
        nvrtc.nvrtcVersion()
    except Exception as err:  # the bindings load libnvrtc lazily
        return f"libnvrtc not found (pip install nvidia-cuda-nvrtc): {str(err).splitlines()[0]}"
    return ""


def _compile(args):
    variant, arch = args
    ok, log, size = nvrtc_check.nvrtc_compile(variant, arch)
    return variant.label(), ok, log, size


# sm_80 builds everything the launcher can request on any GPU (the small-shared-memory tiles of
# sm_86/89 included); sm_90 builds what it can request on sm_90.
ARCH_VARIANTS = {"sm_80": variants.all_variants,
                 "sm_90": lambda: variants.requestable(variants.SHARED_MEMORY_CLASSES["sm_90"])}


@pytest.mark.parametrize("arch", sorted(ARCH_VARIANTS))
def test_every_specialisation_compiles(arch):
    reason = _nvrtc_available()
    if reason:
        pytest.skip(reason)
    todo = [(v, arch) for v in ARCH_VARIANTS[arch]()]
    workers = max(1, min(4, os.cpu_count() or 1))
    with ProcessPoolExecutor(workers) as pool:
        results = list(pool.map(_compile, todo))
    failed = [f"{label}: {log[:2000]}" for label, ok, log, _ in results if not ok]
    assert not failed, "\n".join(failed)
    assert all(size > 0 for *_, size in results)


def test_launcher_requests_only_listed_variants():
    listed = set(variants.all_variants())
    for shared in variants.SHARED_MEMORY_CLASSES.values():
        assert set(variants.requestable(shared)) <= listed


def test_variants_cover_every_head_dim_tile():
    kinds = {(v.kernel, v.head_dim) for v in variants.all_variants()}
    for tile in variants.HEAD_DIM_TILES:
        assert ("fwd", tile) in kinds and ("bwd", tile) in kinds
