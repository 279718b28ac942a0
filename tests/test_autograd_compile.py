"""Gradients through the public API vs the float64 reference, and torch.compile(fullgraph=True)."""
from __future__ import annotations

import pytest
import torch

import attnx
from attnx.reference import attention_reference


def _backends_with_backward() -> list[str]:
    return [name for name, b in attnx.registered_backends().items()
            if b.available and "cpu" in b.device_types and b.supports_backward and torch.float64 in b.dtypes]


BACKENDS = _backends_with_backward()
MASK_GRAD_BACKENDS = [n for n in BACKENDS if attnx.get_backend(n).supports_mask_grad]


def _skip_if_declined(backend: str, q, k, v, **kwargs) -> None:
    """Skip a backend that declines the call through its declarations (conformance checks declines)."""
    why = attnx.explain(q, k, v, backend=backend, **kwargs).reasons[backend]
    if why:
        pytest.skip(f"{backend} declines: " + "; ".join(why))

# (id, qkv kwargs, attention kwargs); masks and slopes are made in the test from their tags
CASES = [
    ("plain", dict(), dict()),
    ("causal-gqa", dict(hq=4, hkv=2, sq=9, sk=13), dict(causal=True)),
    ("mqa-window-tall", dict(hq=4, hkv=1, sq=13, sk=9), dict(window=(2, 1))),
    ("bshd", dict(layout="bshd", hq=4, hkv=2, sq=11, sk=7), dict(layout="bshd", causal=True)),
    ("dv-softcap-alibi", dict(dv=24, sq=7, sk=10), dict(softcap=2.0, alibi="bh")),
    ("additive-mask-grad", dict(sq=6, sk=9), dict(mask="additive-full")),
    ("additive-mask-grad-broadcast", dict(hq=4, hkv=2, sq=6, sk=9), dict(mask="additive-2d", causal=True)),
    ("bool-mask-dead-rows", dict(sq=6, sk=9), dict(mask="bool-dead")),
]


def _extras(kwargs: dict, q: torch.Tensor, layout: str) -> dict:
    kwargs = dict(kwargs)
    b, hq, sq = (q.shape[0], q.shape[1], q.shape[2]) if layout == "bhsd" else (q.shape[0], q.shape[2], q.shape[1])
    sk_dim = 2 if layout == "bhsd" else 1
    tag = kwargs.pop("mask", None)
    alibi = kwargs.pop("alibi", None)
    if alibi:
        kwargs["alibi_slopes"] = torch.rand(b, hq) * 0.5
    return kwargs, tag, (b, hq, sq), sk_dim


def _make_mask(tag, bhs, sk, dtype):
    b, hq, sq = bhs
    if tag == "additive-full":
        return torch.randn(b, hq, sq, sk, dtype=dtype).requires_grad_()
    if tag == "additive-2d":
        return torch.randn(sq, sk, dtype=dtype).requires_grad_()
    mask = torch.rand(b, hq, sq, sk) < 0.7
    mask[:, :, 0] = False  # row 0 sees no key
    return mask


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)], ids=["f64", "f32"])
@pytest.mark.parametrize("shape_kw, call_kw", [pytest.param(s, c, id=i) for i, s, c in CASES])
def test_gradients_match_float64_reference(backend, dtype, tol, shape_kw, call_kw, qkv):
    torch.manual_seed(0)
    layout = shape_kw.get("layout", "bhsd")
    q, k, v = qkv(dtype=dtype, requires_grad=True, **shape_kw)
    kwargs, tag, bhs, sk_dim = _extras(call_kw, q, layout)
    mask = None if tag is None else _make_mask(tag, bhs, k.shape[sk_dim], dtype)
    _skip_if_declined(backend, q, k, v, mask=mask, **kwargs)
    out, lse = attnx.attention(q, k, v, mask=mask, backend=backend, return_lse=True, **kwargs)
    dout = torch.randn_like(out)
    out.backward(dout)

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    mask64 = None if mask is None else (mask if mask.dtype == torch.bool else mask.detach().double().requires_grad_())
    to_bhsd = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)
    p = attnx.make_problem(q, k, v, causal=kwargs.get("causal", False), window=kwargs.get("window"),
                           scale=None, layout=layout)
    ref_out, ref_lse = attention_reference(
        *(to_bhsd(t) for t in leaves), scale=p.scale, softcap=kwargs.get("softcap"),
        alibi_slopes=kwargs.get("alibi_slopes"), mask=mask64, window_left=p.window_left,
        window_right=p.window_right, compute_dtype=torch.float64)
    to_bhsd(ref_out).backward(dout.double())

    torch.testing.assert_close(out.double(), to_bhsd(ref_out).detach(), atol=tol, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), atol=1e-5, rtol=0)  # lse is float32
    for got, ref, name in zip((q.grad, k.grad, v.grad), leaves, "qkv"):
        assert got is not None and got.dtype == dtype, name
        torch.testing.assert_close(got.double(), ref.grad, atol=tol * max(1.0, float(ref.grad.abs().max())), rtol=0,
                                   msg=lambda m: f"d{name}: {m}")
    if mask64 is not None and mask64.requires_grad:
        assert mask.grad is not None and mask.grad.shape == mask.shape
        torch.testing.assert_close(mask.grad.double(), mask64.grad, atol=tol * max(1.0, float(mask64.grad.abs().max())), rtol=0)
    if tag == "bool-dead":
        assert torch.isneginf(lse[:, :, 0]).all() and (out[:, :, 0] == 0).all() and (q.grad[:, :, 0] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck(backend, qkv):
    torch.manual_seed(1)
    q, k, v = qkv(hq=2, hkv=1, sq=3, sk=5, d=4, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(1, 1, 3, 5, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, mask):
        return attnx.attention(q, k, v, mask=mask, causal=True, softcap=3.0, backend=backend)

    _skip_if_declined(backend, q, k, v, mask=mask, causal=True, softcap=3.0)
    assert torch.autograd.gradcheck(f, (q, k, v, mask))


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_mask_requires_grad(backend, qkv):
    q, k, v = qkv(dtype=torch.float64)
    mask = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    _skip_if_declined(backend, q, k, v, mask=mask)
    attnx.attention(q, k, v, mask=mask, backend=backend).sum().backward()
    assert mask.grad is not None and mask.grad.shape == (8, 8) and torch.isfinite(mask.grad).all()


def test_no_grad_mode_skips_autograd(qkv):
    q, k, v = qkv(requires_grad=True)
    with torch.no_grad():
        out = attnx.attention(q, k, v)
    assert not out.requires_grad
    assert not attnx.make_problem(q.detach(), k.detach(), v.detach()).needs_grad


class _TinyAttention(torch.nn.Module):
    def __init__(self, dim=16, heads=2, seqlen=10, bias=False, backend=None):
        super().__init__()
        self.heads, self.backend = heads, backend
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.bias = torch.nn.Parameter(torch.randn(seqlen, seqlen) * 0.1) if bias else None

    def forward(self, x):
        b, s, dim = x.shape
        q, k, v = self.qkv(x).reshape(b, s, 3, self.heads, dim // self.heads).unbind(2)
        out = attnx.attention(q, k, v, causal=True, layout="bshd", mask=self.bias, backend=self.backend)
        return self.proj(out.reshape(b, s, dim))


@pytest.mark.parametrize("bias, backend", [(False, None), (True, MASK_GRAD_BACKENDS[-1])],
                         ids=["dispatch", "mask-grad-forced"])
def test_torch_compile_fullgraph_forward_backward(bias, backend):
    torch.manual_seed(0)
    _assert_compiled_training_matches_eager(_TinyAttention(bias=bias, backend=backend), torch.randn(2, 10, 16),
                                            grad_tol=1e-5)


def _assert_compiled_training_matches_eager(model: torch.nn.Module, x: torch.Tensor, grad_tol: float) -> None:
    """torch.compile(fullgraph=True) forward and backward give eager's output and parameter gradients."""
    model(x).square().sum().backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, eager[name], atol=grad_tol, rtol=grad_tol,
                                   msg=lambda m: f"{name}: {m}")


def _projected(x: torch.Tensor, heads: int, kind: str):
    """q, k, v made from one projection the way model code makes them, in several stride kinds."""
    b, s, width = x.shape
    d = width // (3 * heads)
    if kind == "view-transpose":   # x.view(B, T, H, D).transpose(1, 2): the most common pattern
        return [t.view(b, s, heads, d).transpose(1, 2) for t in x.split(heads * d, dim=-1)], "bhsd"
    if kind == "bshd-views":       # flash-attn layout, sliced out of one packed tensor
        return list(x.view(b, s, 3, heads, d).unbind(2)), "bshd"
    if kind == "contiguous":
        return [t.reshape(b, s, heads, d).transpose(1, 2).contiguous() for t in x.split(heads * d, dim=-1)], "bhsd"
    raise ValueError(kind)


class _ViewAttention(torch.nn.Module):
    def __init__(self, kind: str, heads=2, dim=24, extras=None):
        super().__init__()
        self.kind, self.heads, self.extras = kind, heads, extras or {}
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.sinks = torch.nn.Parameter(torch.randn(heads)) if self.extras.pop("sinks", False) else None

    def forward(self, x):
        (q, k, v), layout = _projected(self.qkv(x), self.heads, self.kind)
        out = attnx.attention(q, k, v, layout=layout, sinks=self.sinks, **self.extras)
        return out.float().sum(dim=1 if layout == "bhsd" else 2)


@pytest.mark.parametrize("kind", ["view-transpose", "bshd-views", "contiguous"])
@pytest.mark.parametrize("extras", [dict(causal=True), dict(sinks=True, causal=True), dict(offset=0, causal=True,
                                                                                                    window=(3, 0))],
                         ids=["causal", "sinks", "offset-window"])
def test_torch_compile_training_over_stride_kinds(kind, extras):
    """Compiled forward+backward matches eager for every way model code lays out q, k, v (the fake
    gradients must have the real op's strides, or the compiled backward fails)."""
    torch.manual_seed(0)
    _assert_compiled_training_matches_eager(_ViewAttention(kind, extras=dict(extras)), torch.randn(2, 9, 24),
                                            grad_tol=1e-4)
