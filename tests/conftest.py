"""Shared fixtures: a registry restored after each test, spy backends that record what ran.

Helpers are handed out as fixtures (`make_spy`, `qkv`), not imported: tests/ and conformance/
both have a conftest.py, so `from conftest import ...` would depend on collection order.
"""
from __future__ import annotations

import pytest
import torch

import attnx
from attnx.reference import attention_reference


class SpyBackend(attnx.Backend):
    """The formula in torch ops, recording every reasons/forward/backward call."""

    name = "spy"
    device_types = frozenset({"cpu", "meta"})

    def __init__(self):
        self.calls = []

    def reasons(self, p):
        self.calls.append("reasons")
        return super().reasons(p)

    def forward(self, p, x):
        self.calls.append("forward")
        with torch.no_grad():
            out, lse = attention_reference(x.q, x.k, x.v, scale=p.scale, softcap=p.softcap,
                                           alibi_slopes=x.alibi_slopes, mask=x.mask, window_left=p.window_left,
                                           window_right=p.window_right)
        result = attnx.alloc_out(p, x.q)
        result.copy_(out)
        return result, lse.float()


def _make_spy(name="spy", **declarations):
    """A SpyBackend subclass instance named `name` with class attributes overridden."""
    cls = type(f"Spy_{name}", (SpyBackend,), {"name": name, **declarations})
    return cls()


@pytest.fixture
def make_spy():
    """Factory: ``make_spy(name="spy", **class_attributes)`` -> an unregistered SpyBackend instance."""
    return _make_spy


@pytest.fixture
def clean_registry(monkeypatch):
    """The registered backends (a dict) before the test; restored after it, with ATTNX_BACKEND."""
    monkeypatch.delenv("ATTNX_BACKEND", raising=False)
    saved = attnx.registered_backends()
    yield saved
    for name in attnx.registered_backends():
        if name not in saved:
            attnx.unregister_backend(name)
    for backend in saved.values():
        attnx.register_backend(backend)


@pytest.fixture
def ran(clean_registry, monkeypatch):
    """List of (backend name, "forward"/"backward") for every backend compute call made in the test."""
    calls = []
    for name, backend in clean_registry.items():
        for method in ("forward", "backward"):
            original = getattr(backend, method)

            def record(*args, _name=name, _method=method, _original=original, **kwargs):
                calls.append((_name, _method))
                return _original(*args, **kwargs)

            monkeypatch.setattr(backend, method, record)

        # a remembered plain call runs the function `dense_forward` gives instead of `forward`
        def dense_forward(p, _name=name, _original=backend.dense_forward):
            direct = _original(p)
            if direct is None:
                return None

            def record(*args):
                calls.append((_name, "forward"))
                return direct(*args)
            return record

        monkeypatch.setattr(backend, "dense_forward", dense_forward)
    return calls


def _qkv(b=1, hq=2, hkv=2, sq=8, sk=8, d=16, dv=None, dtype=torch.float32, layout="bhsd", requires_grad=False,
        device="cpu"):
    """Small random q, k, v in `layout`."""
    def shape(h, s, dim):
        return (b, h, s, dim) if layout == "bhsd" else (b, s, h, dim)

    tensors = [torch.randn(shape(hq, sq, d), dtype=dtype, device=device),
               torch.randn(shape(hkv, sk, d), dtype=dtype, device=device),
               torch.randn(shape(hkv, sk, dv or d), dtype=dtype, device=device)]
    return [t.requires_grad_(requires_grad) for t in tensors]


@pytest.fixture
def qkv():
    """Factory: ``qkv(b, hq, hkv, sq, sk, d, dv, dtype, layout, requires_grad)`` -> small random q, k, v."""
    return _qkv
