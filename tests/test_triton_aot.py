"""CI check 2 for the triton backend: every kernel variant it can launch compiles ahead of time.

`triton.compile` with a `GPUTarget` needs no GPU: cubins for NVIDIA sm_80/sm_90 and hsaco
for AMD gfx90a/gfx942/gfx1100, the split-KV decode kernels included (tensor formats are runtime
arguments, so they add no variants). A variant must also fit the target's shared memory (Triton
only checks that at load time). Variants that cannot work on a target must be declared
in `configs.UNSUPPORTED` (then the backend declines them there, with the reason) instead.
"""
from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor

import pytest

pytest.importorskip("triton")
from attnx.backends.triton import aot, configs  # noqa: E402

WORKERS = max(1, min(4, os.cpu_count() or 1))


def _compile(job):
    variant, target = job
    try:
        return variant.id, aot.compile_variant(variant, target), None
    except Exception as err:  # noqa: BLE001 - collected and reported below
        return variant.id, None, f"{type(err).__name__}: {str(err)[:400]}"


def test_variant_list_matches_launcher():
    """The AOT list covers every (kernel, dtype, BLOCK_D, path) the launcher can pick, and nothing twice."""
    for target in aot.TARGETS:
        ids = [v.id for v in aot.variants(target)]
        assert len(ids) == len(set(ids))
        fam = aot.TARGETS[target][3]
        for dtype in configs.DTYPES:
            for bd in configs.BLOCK_DS:
                for kernel in configs.KERNELS:
                    if configs.unsupported_reason(fam, kernel, "general", bd, dtype):
                        continue
                    assert any(v.kernel == kernel and v.dtype == dtype and v.block_d == bd and v.path == "general"
                               for v in aot.variants(target)), (target, kernel, dtype, bd)


def test_decode_variants_listed():
    """The split-KV decode kernel for every dtype and BLOCK_D, its combine kernel for every output dtype."""
    for target in aot.TARGETS:
        found = aot.variants(target)
        for dtype in configs.DTYPES:
            assert sum(v.kernel == "decode_combine" and v.dtype == dtype for v in found) == 1, (target, dtype)
            for bd in configs.BLOCK_DS:
                assert sum(v.kernel == "decode" and v.dtype == dtype and v.block_d == bd for v in found) == 1


@pytest.mark.parametrize("programs,seqlen_k,want", [
    (8, 32768, 29),      # B=1, 8 kv heads: split until 132 SMs x 2 are ~full
    (64, 8192, 4),       # B=8: 4 splits fill 256 of 264 slots
    (512, 32768, 1),     # B=64: a wave already
    (8, 300, 1),         # too few keys to split (256 per split at least)
    (8, 1024, 4),        # capped by the keys
])
def test_decode_split_rule(programs, seqlen_k, want):
    """configs.decode_splits on an H200 (132 SMs): FlashAttention-2's wave-efficiency rule."""
    assert configs.decode_splits("hopper", 132, programs, seqlen_k) == want


@pytest.mark.parametrize("q_format,kv_format", [("varlen", "varlen"), ("dense", "cache"), ("dense", "paged"),
                                                ("varlen", "cache"), ("varlen", "paged")])
def test_formats_accepted_on_every_target(q_format, kv_format):
    """Tensor formats are runtime arguments: every target that takes dense problems takes them, with grads."""
    import torch

    from attnx.backends.triton import BACKEND
    from attnx.problem import Problem

    for vendor, arch in (("nvidia", "sm_90"), ("nvidia", "sm_80"), ("amd", "gfx942"), ("amd", "gfx1100")):
        p = Problem.create(device="cuda", vendor=vendor, arch=arch, dtype=torch.bfloat16, batch=4, heads_q=32,
                           heads_kv=8, seqlen_q=1 if kv_format != "varlen" else 500, seqlen_k=4096, head_dim=128,
                           causal=True, needs_grad=True, q_format=q_format, kv_format=kv_format,
                           page_size=16 if kv_format == "paged" else None)
        own = [r for r in BACKEND.reasons(p) if r not in BACKEND.unavailable_reasons]
        assert not own, (vendor, arch, own)


@pytest.mark.parametrize("target", list(aot.TARGETS))
def test_every_variant_compiles(target, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", os.environ.get("ATTNX_AOT_CACHE", str(tmp_path / "cache")))
    jobs = [(v, target) for v in aot.variants(target)]
    with ProcessPoolExecutor(WORKERS) as pool:
        results = list(pool.map(_compile, jobs))
    limit = aot.TARGETS[target][4]
    problems = [f"{vid}: {err}" for vid, _, err in results if err]
    problems += [f"{vid}: shared memory {r['shared']} > {limit}" for vid, r, _ in results if r and r["shared"] > limit]
    assert not problems, f"{len(problems)} of {len(jobs)} variants fail on {target}:\n" + "\n".join(problems)
    if target == "sm_90":
        # Hopper: the fast path's matrix kernels must use wgmma, not the Ampere mma.sync path
        dense = {vid: r["wgmma"] for vid, r, _ in results if r and "-dense-" in vid}
        assert dense and all(dense.values()), [vid for vid, w in dense.items() if not w]


@pytest.mark.parametrize("vendor,arch,accepted", [
    ("nvidia", "sm_90", True), ("nvidia", "sm_80", True), ("nvidia", "sm_86", True), ("nvidia", "sm_75", False),
    ("amd", "gfx942", True), ("amd", "gfx90a", True), ("amd", "gfx1100", True), ("amd", "gfx1030", False)])
def test_declared_targets_match_aot_targets(vendor, arch, accepted):
    """The backend accepts exactly the architectures CI compiles for (plus sm_8x/sm_9x siblings)."""
    import torch

    from attnx.backends.triton import BACKEND
    from attnx.problem import Problem

    # vendor and arch both given: no device is probed
    p = Problem.create(device="cuda", vendor=vendor, arch=arch, dtype=torch.bfloat16, batch=2, heads_q=8,
                       heads_kv=2, seqlen_q=300, head_dim=128, causal=True, offset=-7, sinks=True, needs_grad=True)
    own = [r for r in BACKEND.reasons(p) if r not in BACKEND.unavailable_reasons]
    assert (not own) == accepted, own


@pytest.mark.parametrize("vendor,arch,rank", [("nvidia", "sm_90", 90), ("nvidia", "sm_80", 70),
                                              ("nvidia", "sm_89", 70), ("amd", "gfx942", 70)])
def test_priority_by_device_class(vendor, arch, rank):
    """Ahead of the cuda backend's Ampere family (60 there) on Hopper, behind it (80) elsewhere on NVIDIA."""
    import torch

    from attnx.backends.triton import BACKEND
    from attnx.problem import Problem

    p = Problem.create(device="cuda", vendor=vendor, arch=arch, dtype=torch.float16, batch=1, heads_q=8,
                       seqlen_q=1024, head_dim=64)
    assert BACKEND.rank(p.bucketed()) == rank
