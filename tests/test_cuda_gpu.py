"""The cuda backend against SPEC.md's formula on a GPU (skips without one, or without CuPy).

Each case compares out, lse and the gradients with a float64 evaluation; the
allowed error is twice that of the naive formula computed in the same low dtype,
plus 1e-3 (SPEC.md's accuracy rule). Outputs are poisoned with NaN beforehand.
"""
import importlib
import math

import pytest
import torch

import attnx  # noqa: F401
from attnx.autograd import run
from attnx.problem import make_problem
from attnx.reference import attention_reference, attention_reference_backward
from attnx.registry import _import_builtin_backends

_import_builtin_backends()
cuda_backend = importlib.import_module("attnx.backends.cuda")
BACKEND = cuda_backend.BACKEND

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None
    or torch.cuda.get_device_capability() < (8, 0),
    reason="needs an NVIDIA GPU of compute capability >= 8.0 and CuPy")


def _poison_allocator():
    # freed NaN blocks are handed out again by torch's caching allocator: unwritten outputs show up
    junk = torch.full((64 << 20,), float("nan"), device="cuda", dtype=torch.float32)
    del junk


def check_case(dtype=torch.bfloat16, b=2, hq=4, hkv=4, sq=128, sk=128, d=64, dv=None, causal=False, window=None,
               softcap=None, alibi=False, layout="bhsd", grad=True, scale=None, seed=0):
    dv = d if dv is None else dv
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.float32)

    def mk(h, s, width):
        t = rnd(b, h, s, width)
        t = t.transpose(1, 2).contiguous() if layout == "bshd" else t
        return t.to(dtype).requires_grad_(grad)

    q, k, v = mk(hq, sq, d), mk(hkv, sk, d), mk(hkv, sk, dv)
    slopes = (torch.rand(hq, device="cuda", generator=gen) * 0.5 + 0.01) if alibi else None
    p = make_problem(q, k, v, causal=causal, window=window, softcap=softcap, alibi_slopes=slopes, layout=layout,
                     scale=scale)
    reasons = BACKEND.reasons(p)
    assert not reasons, reasons
    _poison_allocator()
    out, lse = run(p, BACKEND, q, k, v, None, slopes)
    bhsd = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)
    kw = dict(scale=p.scale, softcap=softcap, alibi_slopes=slopes, window_left=p.window_left,
              window_right=p.window_right)
    q64, k64, v64 = (bhsd(t).detach().double() for t in (q, k, v))
    ref, ref_lse = attention_reference(q64, k64, v64, **kw)
    low, _ = attention_reference(bhsd(q).detach(), bhsd(k).detach(), bhsd(v).detach(), compute_dtype=dtype, **kw)
    got = bhsd(out).double()
    assert torch.isfinite(got).all(), "non-finite output"
    err = (got - ref).abs().max().item()
    bound = 2 * (low.double() - ref).abs().max().item() + 1e-3
    assert err <= bound, f"out error {err} > {bound}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)), "lse -inf pattern differs"
    if finite.any():
        lse_err = (lse.double()[finite] - ref_lse[finite]).abs().max().item()
        bound_lse = 1e-3 + 2 ** -20 * ref_lse[finite].abs().max().item()  # float32 cannot resolve 1e-3 past 8192
        assert lse_err <= bound_lse, f"lse error {lse_err}"
    if not grad:
        return
    dout = rnd(*out.shape).to(dtype)
    _poison_allocator()
    dq, dk, dvv = torch.autograd.grad(out, (q, k, v), dout)
    ref_g = attention_reference_backward(q64, k64, v64, ref, bhsd(dout).double(), **kw)[:3]
    low_g = attention_reference_backward(bhsd(q).detach(), bhsd(k).detach(), bhsd(v).detach(), low,
                                         bhsd(dout), compute_dtype=dtype, **kw)[:3]
    for name, g, r, lo in zip(("dq", "dk", "dv"), (dq, dk, dvv), ref_g, low_g):
        g = bhsd(g).double()
        assert torch.isfinite(g).all(), f"non-finite {name}"
        e = (g - r).abs().max().item()
        bnd = 2 * (lo.double() - r).abs().max().item() + 1e-3
        assert e <= bnd, f"{name} error {e} > {bnd}"


DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq,sk", [(128, 128), (1, 1), (77, 200), (200, 77), (300, 300)])
def test_core(dtype, d, sq, sk):
    check_case(dtype=dtype, d=d, sq=sq, sk=sk)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [
    dict(causal=True), dict(causal=True, sq=100, sk=40), dict(causal=True, sq=40, sk=300),
    dict(window=(32, 8)), dict(window=(0, 0), sq=150, sk=150), dict(window=(None, 20), sq=90, sk=260),
    dict(hq=8, hkv=2), dict(hq=6, hkv=1, causal=True), dict(softcap=20.0), dict(softcap=5.0, causal=True),
    dict(alibi=True), dict(alibi=True, causal=True, hq=4, hkv=2), dict(layout="bshd"),
    dict(layout="bshd", hq=4, hkv=2, causal=True), dict(dv=32), dict(scale=0.5), dict(scale=-0.3),
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_features(dtype, case):
    base = dict(dtype=dtype, sq=160, sk=192, d=64)
    base.update(case)
    check_case(**base)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [32, 96, 160, 192, 256, 40, 8, 100, 200])
def test_head_dims(dtype, d):
    check_case(dtype=dtype, d=d, sq=150, sk=170, causal=d % 3 == 0)


def test_large_logits():
    check_case(dtype=torch.float16, d=64, sq=64, sk=64, scale=200.0)
