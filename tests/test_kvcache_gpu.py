"""KVCache on a GPU (skipped elsewhere): the dispatched backend in a CachePlan decode loop, no host syncs,
CUDA-graph replay; the loop itself also runs on CPU so its code is known to work."""
from __future__ import annotations

import pytest
import torch

import attnx
from attnx import KVCache

KINDS = [None, 1, 16, 256]  # contiguous, then page sizes (as test_kvcache_object.py)
KIND_IDS = ["contiguous", "page1", "page16", "page256"]

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _decode_loop(kind, device, dtype, check_syncs):
    """A CachePlan decode loop at unequal lengths vs the naive backend on each full sequence; returns the plan."""
    torch.manual_seed(19)
    B, Hq, Hkv, D = 4, 8, 2, 128
    rand = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)  # noqa: E731
    cache = KVCache.allocate(B, 512, Hkv, D, dtype=dtype, device=device, page_size=kind)
    cache.append(rand(B, Hkv, 300, D), rand(B, Hkv, 300, D))
    cache.reset(2)   # unequal lengths: the indexed write path
    step = cache.plan(rand(B, Hq, 1, D), causal=True)
    keys = [[t.clone() for t in cache.sequence(b)] for b in range(B)]   # (Hkv, L, D) per sequence
    for _ in range(4):
        q, k, v = rand(B, Hq, 1, D), rand(B, Hkv, 1, D), rand(B, Hkv, 1, D)
        if check_syncs:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")   # any host sync inside raises
        try:
            out = step.run(q, k, v)
        finally:
            if check_syncs:
                torch.cuda.set_sync_debug_mode("default")
        assert torch.isfinite(out).all()
        for b in range(B):
            keys[b] = [torch.cat([keys[b][0], k[b]], 1), torch.cat([keys[b][1], v[b]], 1)]
            want = attnx.attention(q[b:b + 1], keys[b][0][None], keys[b][1][None], causal=True, backend="naive")
            torch.testing.assert_close(out[b:b + 1].float(), want.float(), rtol=2e-2, atol=2e-2)
    assert cache.lengths.tolist() == cache.seqlens == [304, 304, 4, 304]
    return step


def test_decode_loop_helper_on_cpu():
    """The GPU loop below, run here on CPU (no sync check) so its code is known to work."""
    _decode_loop(16, "cpu", torch.float32, check_syncs=False)


@GPU
@pytest.mark.parametrize("kind", KINDS[:3], ids=KIND_IDS[:3])
def test_gpu_decode_loop_makes_no_host_sync(kind):
    """Whichever backend the plan chose (cuda's decode kernel on sm_90, else triton): lengths and page
    tables stay on the device."""
    _decode_loop(kind, "cuda", torch.bfloat16, check_syncs=False)   # compiles kernels, checks numbers
    _decode_loop(kind, "cuda", torch.bfloat16, check_syncs=True)


@GPU
def test_gpu_graph_replays_attention_over_a_growing_cache():
    """The attention of a decode step captured once; appends run outside the graph (they keep host bookkeeping)."""
    torch.manual_seed(20)
    dev, dt, B, Hq, Hkv, D = "cuda", torch.bfloat16, 2, 8, 2, 128
    cache = KVCache.allocate(B, 256, Hkv, D, dtype=dt, device=dev, page_size=16)
    cache.append(torch.randn(B, Hkv, 50, D, device=dev, dtype=dt), torch.randn(B, Hkv, 50, D, device=dev, dtype=dt))
    q = torch.randn(B, Hq, 1, D, device=dev, dtype=dt)
    step = attnx.plan(q, **cache.inputs(), causal=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step.run(q, **cache.inputs())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step.run(q, **cache.inputs())
    for _ in range(3):
        cache.append(torch.randn(B, Hkv, 1, D, device=dev, dtype=dt), torch.randn(B, Hkv, 1, D, device=dev, dtype=dt))
        q.copy_(torch.randn_like(q))
        graph.replay()
        want = attnx.attention(q, **cache.inputs(), causal=True, backend="naive")
        torch.testing.assert_close(static_out.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert cache.seqlens == [53, 53]
