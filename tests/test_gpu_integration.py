"""On a GPU: attnx inside torch.compile(fullgraph=True) and CUDA-graph capture, for every GPU backend,
the custom ops under torch.library.opcheck, and the SDPA drop-in routing unmodified model code.

Skips without a CUDA device. Run on the H200 with ``python -m pytest tests/test_gpu_integration.py``.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnx

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU_BACKENDS = [name for name, b in attnx.registered_backends().items()
                if b.available and "cuda" in b.device_types and name not in ("naive",)]


def _qkv(requires_grad=False, b=2, h=4, s=256, d=64, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)
            .requires_grad_(requires_grad) for _ in range(3)]


def _accepts(backend, *args, **kwargs) -> bool:
    return not attnx.explain(*args, backend=backend, **kwargs).reasons[backend]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_compiled_training_step_matches_eager(backend):
    q, k, v = _qkv(requires_grad=True)
    if not _accepts(backend, q, k, v, causal=True):
        pytest.skip(f"{backend} declines this problem")

    def step(q, k, v):
        return attnx.attention(q, k, v, causal=True, backend=backend).float().square().sum()

    step(q, k, v).backward()
    eager = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch._dynamo.reset()
    torch.compile(step, fullgraph=True)(q, k, v).backward()
    for got, want in zip((q.grad, k.grad, v.grad), eager):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_cuda_graph_replay_matches_eager(backend):
    """A captured forward replays with new input values (a decode step's shape)."""
    q, k, v = _qkv(b=4, h=8, s=1, d=128)
    k, v = _qkv(b=4, h=8, s=2048, d=128)[1:]
    if not _accepts(backend, q, k, v):
        pytest.skip(f"{backend} declines this problem")
    step = attnx.plan(q, k, v, backend=backend)
    static_out = step.run(q, k, v)  # warm-up: compiles kernels outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step.run(q, k, v)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step.run(q, k, v)
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(100 + seed)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, device="cuda", dtype=t.dtype, generator=gen))
        graph.replay()
        torch.testing.assert_close(static_out, attnx.attention(q, k, v, backend=backend), atol=0, rtol=0)


def test_custom_ops_pass_opcheck():
    from attnx.compile_ops import SCALARS

    q, k, v = _qkv(requires_grad=True, s=64)
    scalars = dict(causal=True, window_left=None, window_right=0, offset=None, scale=None, softcap=None,
                   layout="bhsd", max_seqlen_q=None, max_seqlen_k=None, deterministic=None, backend="",
                   grads=[n in ("q", "k", "v") for n in attnx.Inputs.field_names() if n in attnx.Inputs.DIFFERENTIABLE])
    tensors = [q, k, v] + [None] * (len(attnx.Inputs.field_names()) - 3)
    torch.library.opcheck(torch.ops.attnx.attention_fwd.default, (*tensors, *(scalars[n] for n, _ in SCALARS)),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_sdpa_drop_in_routes_unmodified_code():
    from attnx.compat import use_attnx_for_sdpa

    q, k, v = _qkv(s=300)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with use_attnx_for_sdpa():
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
