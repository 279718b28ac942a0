"""The error bounds of the conformance checker (attnx/conformance/bounds.py, docs/semantics.md#accuracy).

A float32 quantity passes within the fixed tolerance (1e-4, gradients times max(1, max |reference|))
OR within 2 x the error of the naive backend (float32 accumulation) on the same inputs. The naive
error is computed only for a quantity over its fixed bound, and the naive backend itself keeps the
fixed bound (it would otherwise be compared with itself).

dq, dk, dmask and dsinks of float16 and bfloat16 inputs also get the rounding allowance of ``dP - delta``
(`rounding_terms`): the float32 rounding of the two dot products the backward subtracts.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import attnx
from attnx.backends.naive.backend import NaiveBackend
from attnx.conformance import check, run_case
from attnx.conformance.bounds import (FLOAT32_ROUNDING_RULE, MASK_DTYPE_RULE, NAIVE_RULE, ROUNDING_C,
                                      ROUNDING_QUANTITIES, ROUNDING_U, bound, float32_naive_bound,
                                      mask_dtype_rounding, rounding_terms, ulp, uses_naive_float32)
from attnx.conformance.cases import Case
from attnx.conformance.fuzz import case_from_dict
from attnx.conformance.inputs import make_inputs
from attnx.inputs import Grads, sinks_grad
from attnx.reference import scores

CASE = Case("bounds", "float32", 1, 2, 2, 8, 8, 16, 16, grad=False)


class _Shifted(attnx.Backend):
    """The formula (evaluated in float64) plus `shift` on every element of out: an out error of `shift`."""

    device_types = frozenset({"cpu"})
    supports_backward = False
    mask_kinds = frozenset()

    shift = 0.0

    def forward(self, p, x):
        from attnx.reference import attention_reference

        out, lse = attention_reference(x.q.double(), x.k.double(), x.v.double(), scale=p.scale, softcap=p.softcap,
                                       window_left=p.window_left, window_right=p.window_right, offset=p.offset)
        result = attnx.alloc_out(p, x.q)
        result.copy_(out + self.shift)
        return result, lse.float()


def _shifted(name: str, shift: float) -> attnx.Backend:
    return type(f"_Shifted_{name}", (_Shifted,), {"name": name, "shift": shift})()


def _run(backend: str, shift: float, naive_shift: float):
    """`backend` off by `shift`, checked while "naive" is off by `naive_shift`."""
    with attnx.registered(_shifted("naive", naive_shift)):
        if backend == "naive":
            return run_case("naive", CASE, "cpu")
        with attnx.registered(_shifted(backend, shift)):
            return run_case(backend, CASE, "cpu")


def test_float32_passes_within_twice_the_naive_error():
    result = _run("shifted", 1.5e-4, 1e-4)
    assert result.status == "pass", result.summary()
    assert result.bound_rules == {"out": NAIVE_RULE} and "(2x naive)" in result.summary()
    assert result.naive_acc32["out"] == pytest.approx(1e-4, rel=1e-2)
    assert result.bounds["out"] == pytest.approx(2e-4, rel=1e-2)
    assert result.as_dict()["bound_rules"] == {"out": NAIVE_RULE}


def test_float32_fails_beyond_twice_the_naive_error():
    result = _run("shifted", 1.5e-4, 0.5e-4)
    assert result.status == "fail" and result.failures == [f"out error {result.errors['out']:.3g} > bound 0.0001"]
    assert result.errors["out"] == pytest.approx(1.5e-4, rel=1e-2)
    assert result.naive_acc32["out"] == pytest.approx(0.5e-4, rel=1e-2)
    assert result.bounds["out"] == pytest.approx(1e-4, rel=1e-2)  # max(1e-4, 2 x ~0.5e-4)


def test_naive_keeps_the_fixed_bound():
    result = _run("naive", None, 1.5e-4)
    assert result.status == "fail" and result.bounds["out"] == 1e-4, result.summary()
    assert result.naive_acc32 == {} and result.bound_rules == {}


def test_naive_error_is_computed_only_over_the_fixed_bound():
    result = _run("shifted", 0.5e-4, 1e-4)  # within 1e-4: naive is never run
    assert result.status == "pass" and result.bounds["out"] == 1e-4
    assert result.naive_acc32 == {} and result.bound_rules == {}


def test_the_rule_in_bounds():
    blocked, naive = attnx.get_backend("blocked"), attnx.get_backend("naive")
    assert uses_naive_float32("out", torch.float32, "blocked") and uses_naive_float32("dk", torch.float32, "triton")
    assert not uses_naive_float32("out", torch.float32, "naive")
    assert not uses_naive_float32("lse", torch.float32, "blocked")  # lse keeps its own rule
    assert not any(uses_naive_float32("out", dt, "blocked") for dt in (torch.float64, torch.float16, torch.bfloat16))
    fixed = bound("dk", torch.float32, blocked, torch.zeros(3), None)
    assert fixed == bound("dk", torch.float32, naive, torch.zeros(3), None) == 1e-4
    assert float32_naive_bound(fixed, 1e-4) == 2e-4 and float32_naive_bound(fixed, 0.5e-4) == fixed
    assert float32_naive_bound(fixed, None) == fixed and float32_naive_bound(fixed, float("inf")) == fixed
    assert float32_naive_bound(fixed, float("nan")) == fixed


def _record(case_id: str) -> Case:
    records = json.loads((Path(__file__).parent / "fuzz_regressions.json").read_text())["cases"]
    return next(case_from_dict(r["case"]) for r in records if r["case"]["id"] == case_id)


def test_real_cancellation_case():
    """The H200 triton finding (one key: dk's dP - delta cancels to exactly 0) on CPU: blocked and naive
    both get dk ~2.6e-4 > 1e-4; blocked passes within 2 x naive's error (the allowance is not computed),
    naive itself, held to 1e-4 by that rule, within the float32 rounding allowance of dP - delta."""
    case = _record("fuzz:float32-B2H2-S171x1-D1v240-scale1.88216-denseq-cachekv-grad")
    blocked = run_case("blocked", case, "cpu")
    naive = run_case("naive", case, "cpu")
    assert blocked.status == "pass" and naive.status == "pass", (blocked.summary(), naive.summary())
    if naive.errors["dk"] <= 1e-4:
        # whether dP - delta cancels depends on the CPU's float32 matmul (its summation order): on an AMD EPYC
        # host (2026-12-03) naive's dk came to 1.5e-5, within the fixed bound, and no rule was needed; the
        # rules themselves are tested on synthetic errors above
        assert blocked.bound_rules == {} and naive.bound_rules == {}, (blocked.summary(), naive.summary())
        return
    assert blocked.bound_rules == {"dk": NAIVE_RULE}, blocked.summary()
    assert blocked.errors["dk"] > 1e-4 and blocked.rounding == {}
    assert naive.bound_rules == {"dk": FLOAT32_ROUNDING_RULE}, naive.summary()
    assert naive.errors["dk"] > 1e-4 and naive.bounds["dk"] == naive.rounding["dk"] > 1e-4


def test_float32_out_rounding_allowance_is_small_on_ordinary_inputs_and_large_at_large_logits():
    """The logits' float32 rounding through the softmax (bounds.py): ~1e-5 on unit-normal inputs at D = 64,
    below the fixed 1e-4 that it must not loosen; past it at D = 256, scale 2.9 (the H200's triton record)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 128, 64), torch.randn(1, 2, 128, 64), torch.randn(1, 2, 128, 64)
    ordinary = rounding_terms(q, k, v, None, scale=64 ** -0.5)
    assert set(ordinary) == {"out", "lse"} and 1e-6 < ordinary["out"] < 3e-5
    assert ordinary["lse"] < 1e-5  # far below lse's fixed 1e-4 (float32 inputs)
    q, k, v = torch.randn(1, 2, 9, 256), torch.randn(1, 2, 255, 256), torch.randn(1, 2, 255, 256)
    large = rounding_terms(q, k, v, None, scale=2.875)["out"]
    assert 1e-4 < large < 1e-2


def test_float32_out_passes_within_its_rounding_at_large_logits():
    """A backend off by 1.5e-4 everywhere fails an ordinary float32 case (above) but passes the H200's large-
    logit triton record (D = 256, scale 2.875; naive exact here), whose allowance is ~1e-3."""
    case = replace(_record("fuzz:float32-B2H4-S9x255-D256-winN_N-additivemask-full-float16-scale2.875-fwd"),
                   mask=None, window=None)
    with attnx.registered(_shifted("naive", 0.0)), attnx.registered(_shifted("shifted", 1.5e-4)):
        result = run_case("shifted", case, "cpu")
    assert result.status == "pass" and result.bound_rules == {"out": FLOAT32_ROUNDING_RULE}, result.summary()
    assert result.bounds["out"] == result.rounding["out"] > 1.5e-4


# -- the rounding allowance of dP - delta ---------------------------------------------------------
class _StandIn(NaiveBackend):
    """A float32 FlashAttention-style backward (dense, no mask) standing in for a GPU kernel: ``delta =
    rowsum(dout * out)`` by torch's sum; ``dP = dout . v`` by `dp_order`: "sequential" (one float32
    accumulator over d, as an MMA's k-loop) or "sum" (torch's sum, the order of delta: on one key, where
    out == v, the two cancel exactly, as the naive backend's did on the H200). `bug` breaks dk."""

    name = "standin"
    mask_kinds = frozenset()
    dp_order = "sequential"
    bug = None

    def backward(self, p, x, out, lse, dout):
        s = scores(x.q, x.k, scale=p.scale, softcap=p.softcap, alibi_slopes=x.alibi_slopes,
                   window_left=p.window_left, window_right=p.window_right, offset=p.offset,
                   compute_dtype=torch.float32)
        lse = lse.float()[..., None]
        prob = torch.where(lse == float("-inf"), 0.0, torch.exp(s - lse))
        group = x.q.shape[1] // x.k.shape[1]
        k, v = (t.float().repeat_interleave(group, dim=1) for t in (x.k, x.v))
        q, do = x.q.float(), dout.float()
        delta = (do * out.float()).sum(-1, keepdim=True)
        products = do[..., :, None, :] * v[..., None, :, :]
        if self.dp_order == "sequential":
            dp = torch.zeros(products.shape[:-1])
            for d in range(products.shape[-1]):
                dp = dp + products[..., d]
        else:
            dp = products.sum(-1)
        ds = prob * (dp - delta)
        dq = ds @ k * p.scale
        dk = ds.transpose(-2, -1) @ q * (p.scale * (1.05 if self.bug == "dk_scale" else 1.0))
        if self.bug == "drop_key":  # the last query's contribution to every dk is lost
            dk = dk - ds[..., -1:, :].transpose(-2, -1) @ q[..., -1:, :] * p.scale
        dv = prob.transpose(-2, -1) @ do
        b, h = dk.shape[:2]
        dk, dv = (t.reshape(b, h // group, group, *t.shape[2:]).sum(2) for t in (dk, dv))
        dsinks = None if x.sinks is None else sinks_grad(x.sinks, lse[..., 0], delta[..., 0])
        return Grads(dq.to(x.q.dtype), dk.to(x.k.dtype), dv.to(x.v.dtype), None, dsinks)


def _standin(name="standin", **attrs) -> attnx.Backend:
    return type(f"_StandIn_{name}", (_StandIn,), {"name": name, **attrs})()


def _run_standin(case: Case, **attrs):
    """The stand-in kernel on `case`, with "naive" replaced by the stand-in in delta's order."""
    with attnx.registered(_standin("naive", dp_order="sum")), attnx.registered(_standin(**attrs)):
        return run_case("standin", case, "cpu")


ONE_KEY = [  # (case, the stand-in's dq and dk errors): the H200 cuda fuzz finding of 2026-12-02, shrunk and as found
    (Case("fuzz", "float16", 1, 1, 1, 1, 1, 40, 40, window=(None, None), large_logits=True, offset=0), 0.0137, 0.0165),
    (Case("fuzz", "float16", 1, 3, 3, 1, 65, 192, 192, window=(None, None), alibi="bh", large_logits=True, offset=0,
          sinks=True), 0.00422, 0.00505),
]


@pytest.mark.parametrize("case,dq,dk", ONE_KEY, ids=[c.id for c, _, _ in ONE_KEY])
def test_one_key_cancellation_passes_within_the_rounding_allowance(case, dq, dk, monkeypatch):
    """dP and delta summed in different float32 orders: the stand-in's dq, dk errors are those the H200
    reported (the exact dS is 0; scale ~1e4 amplifies a few float32 ulps). Naive's error is 0, so
    the old bound was the 1e-3 slack, and the case failed; the allowance (~1e2 x the error) passes it."""
    result = _run_standin(case)
    assert result.status == "pass", result.summary()
    assert result.errors["dq"] == pytest.approx(dq, rel=0.01) and result.errors["dk"] == pytest.approx(dk, rel=0.01)
    assert result.naive_acc32["dq"] < 1e-20 and result.naive_acc32["dk"] < 1e-20  # P is one-hot: out == v
    for name in ("dq", "dk"):
        old = result.bounds[name] - result.rounding[name]
        assert old == pytest.approx(1e-3, rel=1e-3) and result.errors[name] > old  # the slack (+ 2 ulps of ~0)
        assert 20 * result.errors[name] < result.rounding[name] < 500 * result.errors[name]
    monkeypatch.setattr(check, "_rounding_allowances", lambda *args: {})  # the bound before the allowance
    old = _run_standin(case)
    assert old.status == "fail" and [f.split(" ")[0] for f in old.failures] == ["dq", "dk"], old.summary()


ORDINARY = [Case("bounds", dt, 1, 2, 2, 16, 16, 32, 32) for dt in ("float32", "float16", "bfloat16")] + \
           [Case("bounds", "float32", 2, 4, 2, 33, 40, 64, 64, causal=True, sinks=True)]


@pytest.mark.parametrize("bug", ["dk_scale", "drop_key"])
@pytest.mark.parametrize("case", ORDINARY, ids=[c.id for c in ORDINARY])
def test_a_real_bug_still_fails(case, bug):
    """dk 5% off, or one query's contribution to dk lost: over the bound, allowance included, by far."""
    assert _run_standin(case, dp_order="sum").status == "pass"
    result = _run_standin(case, bug=bug)
    assert result.status == "fail" and [f.split(" ")[0] for f in result.failures] == ["dk"], result.summary()
    assert result.errors["dk"] > 2.5 * result.bounds["dk"] and result.rounding.get("dk", 0.0) < 0.5 * result.bounds["dk"]
    assert result.rounding != {}  # computed (dk is over its bound), and no excuse


def test_allowance_is_small_on_ordinary_inputs():
    """Unit-normal inputs, B2 H4 S128 D64: the allowance is ~1e-5, far below the 1e-3 slack of the
    low-precision bound: the model is not loosened where it need not be."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 4, 128, 64, generator=gen, dtype=torch.float64) for _ in range(4))
    terms = rounding_terms(q, k, v, dout, scale=64 ** -0.5)
    assert 2e-6 < terms["dq"] < 2e-5 and 2e-6 < terms["dk"] < 2e-5, terms
    assert float(terms["dS"].max()) < 3e-5 and terms["dsinks"] is None


def test_allowance_formula():
    """`rounding_terms` against the formula written out by loops: GQA (dk sums its group), causal, sinks."""
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 2, 3, 4, generator=gen, dtype=torch.float64), torch.randn(1, 1, 5, 4, generator=gen)
    v, dout = torch.randn(1, 1, 5, 3, generator=gen), torch.randn(1, 2, 3, 3, generator=gen, dtype=torch.float64)
    sinks, scale, n = torch.tensor([0.5, -1.0]), 0.7, math.sqrt(3) * ROUNDING_C
    terms = rounding_terms(q, k, v, dout, scale=scale, window_right=0, offset=1, sinks=sinks)
    dq, dk, dsinks = torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(2)
    for h in range(2):
        for i in range(3):
            seen = range(i + 2)  # causal, query i at position i + 1
            logits = [scale * float(q[0, h, i] @ k[0, 0, j].double()) for j in seen] + [float(sinks[h])]
            total = sum(math.exp(x) for x in logits)
            out = sum(math.exp(logits[j]) / total * v[0, 0, j].double() for j in seen)
            b = float(dout[0, h, i].abs() @ out.abs())
            for j in seen:
                a = float(dout[0, h, i].abs() @ v[0, 0, j].double().abs())
                err = n * ROUNDING_U * math.exp(logits[j]) / total * (a + b)
                dq[h, i] += scale * err * k[0, 0, j].abs().float()
                dk[j] += scale * err * q[0, h, i].abs().float()
                assert float(terms["dS"][0, h, i, j]) == pytest.approx(err, rel=1e-9)
            dsinks[h] += n * ROUNDING_U * math.exp(logits[-1]) / total * b
    assert terms["dq"] == pytest.approx(float(dq.max()), rel=1e-6)
    assert terms["dk"] == pytest.approx(float(dk.max()), rel=1e-6)
    assert torch.allclose(terms["dsinks"].float(), dsinks, rtol=1e-6)


def test_allowance_only_for_the_gradients_through_ds():
    blocked = attnx.get_backend("blocked")
    ref = torch.tensor([0.5, -2.0])
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        half = dtype in (torch.float16, torch.bfloat16)
        for name in ("out", "lse", "dv", "dq", "dk", "dmask", "dsinks"):
            plain, loose = bound(name, dtype, blocked, ref, 1e-3), bound(name, dtype, blocked, ref, 1e-3, 0.25)
            assert loose == pytest.approx(plain + 0.25 if half and name in ROUNDING_QUANTITIES else plain), (dtype, name)
    nan = bound("dq", torch.float16, blocked, ref, 1e-3, float("nan"))
    assert nan == bound("dq", torch.float16, blocked, ref, 1e-3)


FORMATS = [Case("bounds", "float16", 3, 4, 2, 9, 12, 16, 16, sinks=True, q_format="varlen", kv_format="paged",
                page_size=4),
           Case("bounds", "bfloat16", 3, 2, 2, 9, 12, 16, 8, causal=True, kv_format="cache", layout="bshd"),
           Case("bounds", "float32", 2, 2, 2, 9, 12, 16, 16, mask="additive", mask_shape="keys", mask_grad=True),
           Case("bounds", "float32", 2, 2, 2, 9, 12, 16, 16, grad=False),
           Case("bounds", "float32", 2, 2, 2, 9, 12, 16, 16, grad=False, layout="bshd"),
           Case("bounds", "float64", 2, 2, 2, 9, 12, 16, 16)]


@pytest.mark.parametrize("case", FORMATS, ids=[c.id for c in FORMATS])
def test_allowance_in_every_format(case):
    """The checker computes the allowance per sequence for packed formats, out's and lse's for every case, dmask's
    and dsinks' when the case has them, none for float64; only once a quantity is over its bound
    without it (these cases pass without: none is computed)."""
    result = run_case("naive", case, "cpu")
    assert result.status == "pass" and result.rounding == {}, result.summary()
    inputs, twin = make_inputs(case, "cpu")
    _, views64 = twin(torch.float64, False)
    terms = check._rounding_allowances(case, inputs, views64, inputs.scale or case.head_dim ** -0.5)
    want = set() if case.torch_dtype == torch.float64 else {"out", "lse"} if not case.grad else \
        {"out", "lse", "dq", "dk"} | ({"dmask"} if case.mask_grad else set()) | ({"dsinks"} if case.sinks else set())
    assert set(terms) == want
    assert all(0 < t < 2e-4 for t in terms.values()), terms  # dmask: summed over Hq x Sq


def test_half_precision_bound_floors_the_formula_error_at_one_ulp():
    """The H200's E1 finding (fp16 out, one-hot softmax): the fp16 formula is exact, the kernel one ulp
    of |out| = 3.64 off (0.00195). The bound is 2 ulps + 1e-3, not the bare 1e-3 slack; a formula error
    above an ulp is used as it is."""
    ref = torch.tensor([3.642578125, -1.0], dtype=torch.float64)
    naive = NaiveBackend()
    assert ulp(torch.float16, 3.64) == 2.0 ** -9 and ulp(torch.bfloat16, 1.0) == 2.0 ** -7
    assert bound("out", torch.float16, naive, ref, 0.0) == pytest.approx(2 * 2.0 ** -9 + 1e-3)
    assert bound("out", torch.float16, naive, ref, 0.01) == pytest.approx(0.02 + 1e-3)
    assert bound("out", torch.float16, naive, ref, 0.0) > 0.001953125
    assert bound("out", torch.float32, naive, ref, 0.0) == 1e-4  # float32 keeps its fixed bound


MASK_DTYPE_CASES = [Case("bounds", "float32", 1, 2, 2, s, s + 3, 16, 16, mask="additive", mask_grad=True,
                         mask_dtype=mask_dtype) for s in (2, 17) for mask_dtype in ("bfloat16", "float16")]


@pytest.mark.parametrize("case", MASK_DTYPE_CASES, ids=[c.id for c in MASK_DTYPE_CASES])
def test_dmask_in_a_coarser_mask_dtype_is_bounded_with_its_rounding(case):
    """A bf16 or fp16 mask on float32 inputs: dmask comes back in the mask's dtype, so its rounding to
    that dtype (bf16: ~6e-3 here) is part of the naive backend's result too (once E3): one ulp of the
    mask's dtype at the largest |dmask| is added, and only to dmask."""
    result = run_case("naive", case, "cpu")
    assert result.status == "pass", result.summary()
    if result.errors["dmask"] > 1e-4 * max(1.0, result.magnitudes["dmask"]):
        assert result.bound_rules.get("dmask") == MASK_DTYPE_RULE
    assert all(result.bound_rules.get(n) != MASK_DTYPE_RULE for n in result.bounds if n != "dmask")


def test_mask_dtype_rounding_only_for_a_coarser_mask():
    assert mask_dtype_rounding(torch.float32, torch.bfloat16, 3.0) == ulp(torch.bfloat16, 3.0) == 2.0 ** -6
    assert mask_dtype_rounding(torch.float32, None, 3.0) == 0.0
    assert mask_dtype_rounding(torch.float32, torch.float32, 3.0) == 0.0
    assert mask_dtype_rounding(torch.float16, torch.float32, 3.0) == 0.0      # a finer mask: q's bound rules
    assert mask_dtype_rounding(torch.float16, torch.bfloat16, 3.0) == ulp(torch.bfloat16, 3.0)
