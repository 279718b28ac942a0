"""The cuda backend against the formula of docs/semantics.md on a GPU (skips without one, or without CuPy).

Each case compares out, lse and the gradients (dsinks included) with a float64 evaluation
of `attnx.reference.attention_reference`, differentiated by torch autograd. The allowed error
is twice that of the formula computed from the same low-dtype inputs, plus 1e-3 (the accuracy
rule of docs/semantics.md), where the formula's error is the larger of its low-dtype and its
float32 evaluation (as attnx/conformance/bounds.py explains). Outputs are poisoned with NaN
beforehand.
"""
import importlib
import math

import pytest
import torch

import attnx
from attnx.autograd import run
from attnx.problem import make_call
from attnx.reference import attention_reference

BACKEND = attnx.get_backend("cuda")

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None
    or torch.cuda.get_device_capability() < (8, 0),
    reason="needs an NVIDIA GPU of compute capability >= 8.0 and CuPy")


def _poison_allocator():
    # freed NaN blocks are handed out again by torch's caching allocator: unwritten outputs show up
    junk = torch.full((64 << 20,), float("nan"), device="cuda", dtype=torch.float32)
    del junk


def _sinks(kind, hq, gen):
    """float32 (Hq,) sink logits: "normal" draws, "large" above every score, "mixed" with -inf and large."""
    if kind is None:
        return None
    s = torch.randn(hq, device="cuda", generator=gen) * 2
    if kind == "large":
        s = s.abs() + 12.0
    elif kind == "mixed":
        s[0] = float("-inf")
        s[1 % hq] = 15.0
    return s


def _formula(p, q, k, v, slopes, sinks, compute_dtype):
    """(out, lse) of the formula on bhsd `q`, `k`, `v` and `sinks`, computed in `compute_dtype`."""
    return attention_reference(q, k, v, scale=p.scale, softcap=p.softcap, alibi_slopes=slopes,
                               window_left=p.window_left, window_right=p.window_right, offset=p.offset,
                               sinks=sinks, compute_dtype=compute_dtype)


def _formula_grads(p, inputs, slopes, dout, compute_dtype):
    """(out, lse, grads) of the formula; grads by torch autograd, None for an input that is None."""
    leaves = [t.detach().requires_grad_() if t is not None else None for t in inputs]
    out, lse = _formula(p, *leaves[:3], slopes, leaves[3], compute_dtype)
    if dout is None:
        return out.detach(), lse, None
    wanted = [t for t in leaves if t is not None]
    found = iter(torch.autograd.grad(out, wanted, dout.to(out.dtype)))
    return out.detach(), lse.detach(), [next(found) if t is not None else None for t in leaves]


def _max_err(got, ref):
    return (got.double() - ref.double()).abs().max().item()


def check_case(dtype=torch.bfloat16, b=2, hq=4, hkv=4, sq=128, sk=128, d=64, dv=None, causal=False, window=None,
               offset=None, softcap=None, alibi=False, sinks=None, layout="bhsd", grad=True, scale=None, seed=0,
               broadcast_dout=False):
    """`broadcast_dout`: the output gradient is one row expanded over batch, heads and rows (strides 0),
    as autograd hands it to a backward after ``(out * w).sum()`` with a per-column weight."""
    dv = d if dv is None else dv
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def mk(h, s, width):
        t = torch.randn(b, h, s, width, device="cuda", generator=gen, dtype=torch.float32)
        t = t.transpose(1, 2).contiguous() if layout == "bshd" else t
        return t.to(dtype).requires_grad_(grad)

    q, k, v = mk(hq, sq, d), mk(hkv, sk, d), mk(hkv, sk, dv)
    slopes = (torch.rand(hq, device="cuda", generator=gen) * 0.5 + 0.01) if alibi else None
    sink = _sinks(sinks, hq, gen)
    if sink is not None:
        sink.requires_grad_(grad)
    p, x = make_call(q, k, v, causal=causal, window=window, offset=offset, softcap=softcap, alibi_slopes=slopes,
                     sinks=sink, layout=layout, scale=scale)
    reasons = BACKEND.reasons(p)
    assert not reasons, reasons
    _poison_allocator()
    out, lse = run(p, BACKEND, x)
    bhsd = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)
    low_inputs = [bhsd(t).detach() for t in (q, k, v)] + [sink.detach() if sink is not None else None]
    high_inputs = [t.double() if t is not None else None for t in low_inputs]
    slopes64 = slopes.double() if slopes is not None else None
    dout = torch.randn(*out.shape, device="cuda", generator=gen).to(dtype) if grad else None
    if grad and broadcast_dout:
        dout = torch.randn(out.shape[-1], device="cuda", generator=gen).to(dtype).expand(out.shape)
    dout_bhsd = bhsd(dout) if grad else None
    ref, ref_lse, ref_g = _formula_grads(p, high_inputs, slopes64, dout_bhsd, torch.float64)
    # the formula from the low-dtype inputs, computed in that dtype and in float32
    lows = [_formula_grads(p, low_inputs, slopes, dout_bhsd, cd) for cd in (dtype, torch.float32)]

    got = bhsd(out)
    assert torch.isfinite(got).all(), "non-finite output"
    bound = 2 * max(_max_err(lo[0], ref) for lo in lows) + 1e-3
    err = _max_err(got, ref)
    assert err <= bound, f"out error {err} > {bound}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)), "lse -inf pattern differs"
    assert torch.equal(ref_lse[~finite], lse.double()[~finite]), "lse infinities differ"
    if finite.any():
        lse_err = (lse.double()[finite] - ref_lse[finite]).abs().max().item()
        bound_lse = 1e-3 + 2 ** -20 * ref_lse[finite].abs().max().item()  # float32 cannot resolve 1e-3 past 8192
        assert lse_err <= bound_lse, f"lse error {lse_err}"
    if not grad:
        return
    _poison_allocator()
    wanted = [q, k, v] + ([sink] if sink is not None else [])
    grads = list(torch.autograd.grad(out, wanted, dout))
    names = ("dq", "dk", "dv", "dsinks")
    for i, (name, g) in enumerate(zip(names, grads)):
        g = bhsd(g) if i < 3 else g
        assert torch.isfinite(g).all(), f"non-finite {name}"
        r = ref_g[i]
        bnd = 2 * max(_max_err(lo[2][i], r) for lo in lows) + 1e-3
        e = _max_err(g, r)
        assert e <= bnd, f"{name} error {e} > {bnd}"


DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq,sk", [(128, 128), (1, 1), (77, 200), (200, 77), (300, 300)])
def test_core(dtype, d, sq, sk):
    check_case(dtype=dtype, d=d, sq=sq, sk=sk)


def _ids(case):
    return "-".join(f"{k}={v}" for k, v in case.items())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [
    dict(causal=True), dict(causal=True, sq=100, sk=40), dict(causal=True, sq=40, sk=300),
    dict(window=(32, 8)), dict(window=(0, 0), sq=150, sk=150), dict(window=(None, 20), sq=90, sk=260),
    dict(hq=8, hkv=2), dict(hq=6, hkv=1, causal=True), dict(softcap=20.0), dict(softcap=5.0, causal=True),
    dict(alibi=True), dict(alibi=True, causal=True, hq=4, hkv=2), dict(layout="bshd"),
    dict(layout="bshd", hq=4, hkv=2, causal=True), dict(dv=32), dict(scale=0.5), dict(scale=-0.3),
], ids=_ids)
def test_features(dtype, case):
    base = dict(dtype=dtype, sq=160, sk=192, d=64)
    base.update(case)
    check_case(**base)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [
    dict(offset=0, causal=True, sq=100, sk=300),                 # top-left causal (SDPA's is_causal)
    dict(offset=-40, causal=True),                               # the first 40 rows see no key
    dict(offset=150, window=(100, 10), sq=160, sk=192),          # the last rows see past every key
    dict(offset=37, alibi=True, softcap=10.0, window=(50, 50)),  # the score mod reads the offset
    dict(offset=-20, window=(None, 30), hq=8, hkv=2, layout="bshd"),
    dict(offset=500, causal=True, sq=64, sk=96),                 # every key visible to every row
    dict(offset=-300, causal=True, sq=64, sk=96),                # no row sees a key
], ids=_ids)
def test_offset(dtype, case):
    base = dict(dtype=dtype, sq=160, sk=192, d=64)
    base.update(case)
    check_case(**base)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [
    dict(sinks="normal"), dict(sinks="large"), dict(sinks="mixed"),
    dict(sinks="normal", causal=True, offset=-30),               # rows that see no key: out 0, lse = sink
    dict(sinks="mixed", offset=-300, causal=True, sq=64, sk=96),  # no row sees a key
    dict(sinks="normal", softcap=8.0, alibi=True, hq=8, hkv=2),
    dict(sinks="large", window=(16, 16), layout="bshd", d=128),
    dict(sinks="normal", d=256, sq=70, sk=90, causal=True),      # two-pass backward
], ids=_ids)
def test_sinks(dtype, case):
    base = dict(dtype=dtype, sq=160, sk=192, d=64)
    base.update(case)
    check_case(**base)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [32, 96, 160, 192, 256, 40, 8, 100, 200])
def test_head_dims(dtype, d):
    check_case(dtype=dtype, d=d, sq=150, sk=170, causal=d % 3 == 0)


def test_large_logits():
    check_case(dtype=torch.float16, d=64, sq=64, sk=64, scale=200.0)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_nan_rows(softcap, sinks):
    """A NaN in q or k makes exactly the rows that read it NaN (out and lse); the others stay exact."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    b, h, sq, sk, d = 2, 2, 96, 96, 64
    q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=gen).half() for s in (sq, sk, sk))
    q[0, 1, 5, 3] = float("nan")    # one query row
    k[1, 0, 40, 7] = float("nan")   # one key: the causal rows from 40 on read it
    sink = torch.randn(h, device="cuda", generator=gen) if sinks else None
    q.requires_grad_()
    p, x = make_call(q, k, v, causal=True, softcap=softcap, sinks=sink)
    assert not BACKEND.reasons(p), BACKEND.reasons(p)
    _poison_allocator()
    out, lse = run(p, BACKEND, x)
    ref, ref_lse = _formula(p, q.detach().double(), k.double(), v.double(), None,
                            sink.double() if sinks else None, torch.float64)
    nan_rows = torch.isnan(ref).any(-1)
    assert nan_rows[0, 1, 5] and nan_rows[1, 0, 40:].all() and not nan_rows[1, 0, :40].any()
    assert torch.equal(torch.isnan(out).all(-1), nan_rows), "NaN rows differ from the formula's"
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse)), "NaN lse differ from the formula's"
    assert not torch.isnan(out[~nan_rows]).any(), "NaN leaked into other rows"
    assert _max_err(out[~nan_rows], ref[~nan_rows]) <= 1e-2
    dq, = torch.autograd.grad(out, (q,), torch.ones_like(out))
    assert torch.isnan(dq[0, 1, 5]).all(), "the NaN row's dq is not NaN"
    assert not math.isnan(dq[0, 0].float().sum().item()), "NaN reached a head that never read one"


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_broadcast_output_gradient(d, layout):
    """An output gradient with zero strides (a weighted sum of the output) reaches the backward in place:
    the Hopper backward's TMA tensor maps and the Ampere kernel read it as they read any other."""
    check_case(torch.bfloat16, b=2, hq=4, hkv=2, sq=200, sk=300, d=d, causal=True, layout=layout,
               broadcast_dout=True)
