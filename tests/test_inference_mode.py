"""Every CPU backend works under torch.inference_mode and no_grad (thread-local modes must reach
any worker threads a backend uses)."""
from __future__ import annotations

import pytest
import torch

import attnx
from attnx.reference import attention_reference

CPU_BACKENDS = [name for name, b in attnx.registered_backends().items() if b.available and "cpu" in b.device_types]


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_modes_without_autograd(backend, mode):
    torch.manual_seed(0)
    # large enough for blocked's CPU thread pool (>= 64k scores, several query tiles)
    q = torch.randn(1, 512, 4, 32)
    k, v = torch.randn(1, 640, 2, 32), torch.randn(1, 640, 2, 32)
    context = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    with context:
        out, lse = attnx.attention(q, k, v, causal=True, layout="bshd", backend=backend, return_lse=True)
    ref, ref_lse = attention_reference(q.transpose(1, 2).double(), k.transpose(1, 2).double(),
                                       v.transpose(1, 2).double(), scale=32 ** -0.5, window_right=0)
    assert torch.allclose(out.transpose(1, 2).double(), ref, atol=1e-4)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-4)
