"""The blocked backend against docs/semantics.md's formula (attnx.reference), feature by feature.

Cases come from small tables; each runs forward and backward through `attnx.attention`
with ``backend="blocked"`` and compares out, lse and every gradient (dsinks included)
with the float64 reference, differentiated by torch autograd. Small forced tiles make
every case cross tile boundaries.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field, replace
from typing import Optional

import pytest
import torch

import attnx
from attnx import Inputs
from attnx.reference import attention_reference

BACKEND = attnx.get_backend("blocked")
blocked_pkg = sys.modules[type(BACKEND).__module__.rsplit(".", 1)[0]]
forward_module = sys.modules[f"{blocked_pkg.__name__}.forward"]
backward_module = sys.modules[f"{blocked_pkg.__name__}.backward"]
parallel_module = sys.modules[f"{blocked_pkg.__name__}.parallel"]
scores_module = sys.modules[f"{blocked_pkg.__name__}.scores"]
kv_module = sys.modules[f"{blocked_pkg.__name__}.kv"]
pages_module = sys.modules[f"{blocked_pkg.__name__}.pages"]


@dataclass(frozen=True)
class Case:
    """One attention call: sizes, features, and the tiles forced on the backend."""

    batch: int = 2
    heads_q: int = 4
    heads_kv: int = 4
    seqlen_q: int = 37
    seqlen_k: int = 45
    head_dim: int = 16
    head_dim_v: Optional[int] = None
    causal: bool = False
    window: Optional[tuple] = None
    offset: Optional[int] = None          # aligned position of query 0; None = bottom-right
    mask: Optional[str] = None            # None, "bool", "additive"
    mask_shape: tuple = ()                # () = (B, Hq, Sq, Sk); else the mask's own shape
    mask_grad: bool = False
    alibi: Optional[str] = None           # None, "heads" (Hq,), "batch" (B, Hq)
    sinks: bool = False                   # float32 (Hq,) sink logits, with gradients
    softcap: Optional[float] = None
    scale: Optional[float] = None
    layout: str = "bhsd"
    tiles: Optional[tuple] = (16, 32)     # forced (block_m, block_n); None = the defaults
    extra: dict = field(default_factory=dict)

    def options(self, x: Inputs) -> dict:
        """The keyword arguments of `attnx.attention` / `attnx.make_problem` besides q, k, v."""
        return dict(causal=self.causal, window=self.window, offset=self.offset, mask=x.mask, scale=self.scale,
                    softcap=self.softcap, alibi_slopes=x.alibi_slopes, sinks=x.sinks, layout=self.layout)


FEATURES = {
    "plain": Case(),
    "causal": Case(causal=True),
    "causal_sq_gt_sk": Case(causal=True, seqlen_q=45, seqlen_k=37),
    "window": Case(window=(7, 3)),
    "window_left": Case(window=(5, None)),
    "window_right": Case(window=(None, 4)),
    "window_and_causal": Case(window=(9, 6), causal=True),
    "alibi_heads": Case(alibi="heads"),
    "alibi_batch_causal": Case(alibi="batch", causal=True),
    "softcap": Case(softcap=2.5, scale=0.9),
    "bool_mask": Case(mask="bool"),
    "bool_mask_keys": Case(mask="bool", mask_shape=(2, 1, 1, 45)),
    "additive_mask": Case(mask="additive"),
    "additive_mask_2d": Case(mask="additive", mask_shape=(37, 45)),
    "gqa": Case(heads_q=6, heads_kv=2, causal=True),
    "mqa": Case(heads_q=4, heads_kv=1, window=(6, 6)),
    "dv_differs": Case(head_dim=12, head_dim_v=20),
    "bshd": Case(layout="bshd", heads_q=4, heads_kv=2, causal=True),
    "sinks": Case(sinks=True),
    "sinks_gqa_causal": Case(sinks=True, heads_q=6, heads_kv=2, causal=True, alibi="heads"),
    "everything": Case(heads_q=4, heads_kv=2, causal=True, window=(11, None), alibi="batch", softcap=3.0,
                       mask="additive", mask_shape=(1, 4, 37, 1), mask_grad=True, head_dim_v=8, sinks=True),
    "default_tiles": Case(tiles=None, seqlen_q=300, seqlen_k=700, alibi="heads", causal=True),
}

MASK_GRADS = {
    "full": (2, 4, 37, 45),
    "heads": (1, 4, 37, 45),
    "keys": (2, 1, 1, 45),
    "rows": (1, 4, 37, 1),
    "2d": (37, 45),
    "1d": (45,),
}

# (Sq, Sk) around the forced tiles (16 x 32) and the 128 boundary of the default ones
SIZES = [(1, 1), (1, 17), (17, 1), (17, 127), (127, 128), (128, 128), (1000, 127), (127, 1000), (128, 1)]


def make_inputs(case: Case, dtype=torch.float64, seed=0) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    dv = case.head_dim_v or case.head_dim

    def draw(heads, seqlen, dim):
        t = torch.randn((case.batch, heads, seqlen, dim), generator=gen, dtype=torch.float64).to(dtype)
        return t.transpose(1, 2).contiguous() if case.layout == "bshd" else t

    q = draw(case.heads_q, case.seqlen_q, case.head_dim).requires_grad_()
    k = draw(case.heads_kv, case.seqlen_k, case.head_dim).requires_grad_()
    v = draw(case.heads_kv, case.seqlen_k, dv).requires_grad_()
    mask = None
    if case.mask is not None:
        shape = case.mask_shape or (case.batch, case.heads_q, case.seqlen_q, case.seqlen_k)
        if case.mask == "bool":
            mask = torch.rand(shape, generator=gen) < 0.7
        else:
            mask = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2).to(dtype)
            mask.requires_grad_(case.mask_grad)
    alibi = None
    if case.alibi == "heads":
        alibi = torch.rand((case.heads_q,), generator=gen) * 0.3
    elif case.alibi == "batch":
        alibi = torch.rand((case.batch, case.heads_q), generator=gen) * 0.3
    sinks = None
    if case.sinks:  # around the scores' size, so the sink takes a real share of each row
        sinks = (torch.randn((case.heads_q,), generator=gen) * 1.5 + 1.0).requires_grad_()
    return Inputs(q, k, v, mask, alibi, sinks)


def to_bhsd(case, t):
    return t.transpose(1, 2) if case.layout == "bshd" else t


def grad_leaves(case: Case, x: Inputs) -> list:
    return [x.q, x.k, x.v] + ([x.mask] if case.mask_grad else []) + ([x.sinks] if x.sinks is not None else [])


def run_blocked(case: Case, x: Inputs):
    """out, lse and grads (q, k, v[, mask][, sinks]) from the blocked backend."""
    tiles = BACKEND.force_tile_sizes(*case.tiles) if case.tiles else BACKEND.force_tile_sizes()
    with tiles:
        out, lse = attnx.attention(x.q, x.k, x.v, **case.options(x), backend="blocked", return_lse=True)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        grads = torch.autograd.grad(out, grad_leaves(case, x), dout.to(out.dtype))
    return out, lse, grads, dout


def run_reference(case: Case, x: Inputs, dout, compute_dtype=torch.float64):
    """The same through attnx.reference (bhsd) in `compute_dtype` (float64: the oracle), grads by autograd."""
    p = attnx.make_problem(x.q, x.k, x.v, **case.options(x))
    q, k, v = (to_bhsd(case, t.detach().to(compute_dtype)).requires_grad_() for t in (x.q, x.k, x.v))
    mask = x.mask
    if mask is not None:
        mask = mask.detach() if mask.dtype == torch.bool else mask.detach().to(compute_dtype).requires_grad_()
    sinks = None if x.sinks is None else x.sinks.detach().to(compute_dtype).requires_grad_()
    out, lse = attention_reference(q, k, v, scale=p.scale, softcap=p.softcap, alibi_slopes=x.alibi_slopes,
                                   mask=mask, window_left=p.window_left, window_right=p.window_right,
                                   offset=p.offset, sinks=sinks, compute_dtype=compute_dtype)
    leaves = grad_leaves(case, Inputs(q, k, v, mask, None, sinks))
    grads = torch.autograd.grad(out, leaves, to_bhsd(case, dout).to(compute_dtype))
    grads = [to_bhsd(case, g) for g in grads[:3]] + list(grads[3:])
    return to_bhsd(case, out), lse, grads


def assert_close(name, got, want, atol, nan_ok=False):
    """Max abs error within `atol` where both are finite; infinities at the same places.

    ``nan_ok``: NaN allowed where the reference has NaN: at exactly its places (``True``), or, for
    gradients of NaN inputs (``"grads"``), wherever it reaches (NaN in one iff NaN in the other,
    values compared where neither has NaN). The contract fixes only the rows of the output there;
    the oracle's autograd spreads NaN through ``0 * NaN`` in its full matmuls (keys a row never
    sees), a tiled backward through ``exp(-inf - NaN)`` at the hidden entries of the tiles it visits.
    """
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got, want = got.double(), want.double()
    if nan_ok == "grads":
        assert got.isnan().any() == want.isnan().any(), f"{name}: NaN reaches only one of it and the reference"
        poisoned = got.isnan() | want.isnan()
        got, want = got.masked_fill(poisoned, 0.0), want.masked_fill(poisoned, 0.0)
    elif nan_ok:
        assert torch.equal(got.isnan(), want.isnan()), f"{name}: NaN at other places than the reference's"
    else:
        assert not torch.isnan(got).any(), f"{name}: NaN"
    assert torch.equal(got.isinf(), want.isinf()), f"{name}: infinities at other places than the reference's"
    same = got.isnan() | (got.isinf() & (got == want))
    err = torch.where(same, torch.zeros_like(got), (got - want).abs())
    assert err.max().item() <= atol, f"{name}: max abs error {err.max().item():.3g} > {atol}"


def grad_bound(name: str, want: torch.Tensor, atol: float) -> float:
    """`atol` relative to the gradient's size; dsinks is float32 whatever the inputs (its rounding bounds it)."""
    size = 1 + want.nan_to_num(0.0, 0.0, 0.0).abs().max().item()
    return max(atol, 1e-6) * size if name == "dsinks" else atol * size


def check_case(case: Case, dtype=torch.float64, atol=1e-10, seed=0, x: Optional[Inputs] = None, nan_ok=False):
    """Blocked against the float64 oracle; ``nan_ok``: NaN inputs (out and lse NaN exactly where the
    oracle's are; gradients, see `assert_close`)."""
    x = make_inputs(case, dtype, seed) if x is None else x
    out, lse, grads, dout = run_blocked(case, x)
    ref_out, ref_lse, ref_grads = run_reference(case, x, dout)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close("out", out, ref_out, atol, nan_ok)
    # lse is float32 whatever the input: compare it at float32 precision
    lse_scale = 1 + ref_lse.nan_to_num(0, 0, 0).abs().max().item()
    assert_close("lse", lse, ref_lse, max(atol, 1e-5 * lse_scale), nan_ok)
    names = ["dq", "dk", "dv"] + ["dmask"] * case.mask_grad + ["dsinks"] * (x.sinks is not None)
    if x.sinks is not None:
        assert grads[-1].dtype == torch.float32
    for name, got, want in zip(names, grads, ref_grads):
        assert_close(name, got, want, grad_bound(name, want, atol), nan_ok and "grads")
    return out, lse, grads


@pytest.mark.parametrize("name", list(FEATURES))
def test_feature_float64(name):
    check_case(FEATURES[name])


@pytest.mark.parametrize("sizes", SIZES, ids=[f"{sq}x{sk}" for sq, sk in SIZES])
@pytest.mark.parametrize("variant", ["plain", "causal", "everything"])
def test_tile_boundaries(variant, sizes):
    sq, sk = sizes
    base = FEATURES[variant]
    mask_shape = base.mask_shape and (1, base.heads_q, sq, 1)
    check_case(replace(base, batch=1, seqlen_q=sq, seqlen_k=sk, mask_shape=mask_shape))


@pytest.mark.parametrize("shape_name", list(MASK_GRADS))
def test_mask_gradient_shapes(shape_name):
    case = Case(mask="additive", mask_shape=MASK_GRADS[shape_name], mask_grad=True, heads_q=4, heads_kv=2,
                window=(20, 9))
    check_case(case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["plain", "everything", "gqa"])
def test_low_precision(name, dtype):
    """float32 within 1e-4 of float64; fp16/bf16 within 2x the naive formula's own error + 1e-3."""
    case = FEATURES[name]
    x = make_inputs(case, dtype)
    out, lse, grads, dout = run_blocked(case, x)
    ref_out, ref_lse, ref_grads = run_reference(case, x, dout)
    if dtype == torch.float32:
        bounds = [1e-4] + [1e-4 * (1 + r.abs().max().item()) for r in ref_grads]
    else:
        low, _, low_grads = run_reference(case, x, dout, compute_dtype=dtype)
        bounds = [2 * (n.double() - r).abs().max().item() + 1e-3
                  for n, r in zip([low] + low_grads, [ref_out] + ref_grads)]
    assert_close("out", out, ref_out, bounds[0])
    assert_close("lse", lse, ref_lse, 1e-3)
    for index, (got, want, bound) in enumerate(zip(grads, ref_grads, bounds[1:])):
        assert_close(f"grad {index}", got, want, bound)


# explicit alignment offsets (docs/semantics.md): 0 is top-left; Sq = 37, Sk = 45 (bottom-right is 8)
OFFSETS = {"top_left": 0, "positive": 20, "negative": -10, "past_the_keys": 50, "before_the_keys": -40}
OFFSET_FEATURES = {
    "causal": Case(causal=True),
    "window": Case(window=(6, 3)),
    "causal_window_alibi": Case(causal=True, window=(9, None), alibi="batch", heads_q=4, heads_kv=2),
    "alibi_only": Case(alibi="heads"),
    "causal_sinks_sq_gt_sk": Case(causal=True, sinks=True, seqlen_q=45, seqlen_k=37),
}


@pytest.mark.parametrize("offset", list(OFFSETS))
@pytest.mark.parametrize("feature", list(OFFSET_FEATURES))
def test_explicit_offset(feature, offset):
    """Query i at aligned position i + offset: causal, window and alibi against the oracle (keyless rows too)."""
    check_case(replace(OFFSET_FEATURES[feature], offset=OFFSETS[offset]))


def test_offset_top_left_is_sdpa_causal():
    """offset=0 with causal is what F.scaled_dot_product_attention(is_causal=True) computes for Sq != Sk."""
    case = Case(causal=True, offset=0, seqlen_q=45, seqlen_k=37)
    x = make_inputs(case)
    with torch.no_grad():
        out = attnx.attention(x.q, x.k, x.v, causal=True, offset=0, backend="blocked")
        want = torch.nn.functional.scaled_dot_product_attention(x.q, x.k, x.v, is_causal=True)
    assert_close("out", out, want, 1e-10)
    assert BACKEND.reasons(attnx.make_problem(x.q, x.k, x.v, causal=True, offset=0)) == []


# sinks: per-head logits from far below the scores (no effect) to far above (they take the whole row)
SINK_LEVELS = {"small": -30.0, "comparable": 0.5, "dominant": 12.0, "minus_inf": float("-inf")}
SINK_FEATURES = {
    "plain": Case(sinks=True),
    "gqa_causal": Case(sinks=True, heads_q=6, heads_kv=2, causal=True),
    "window_softcap_mask": Case(sinks=True, window=(5, 2), softcap=2.0, mask="additive", mask_grad=True,
                                mask_shape=(1, 4, 37, 45)),
    "bshd_alibi": Case(sinks=True, layout="bshd", alibi="heads", heads_q=4, heads_kv=1),
}


@pytest.mark.parametrize("level", list(SINK_LEVELS))
@pytest.mark.parametrize("feature", list(SINK_FEATURES))
def test_sinks(feature, level):
    """out, lse (which includes the sink) and every gradient, dsinks included, against the oracle."""
    case = SINK_FEATURES[feature]
    x = make_inputs(case)
    sinks = torch.full((case.heads_q,), SINK_LEVELS[level])
    sinks[0] = 1.0  # one head with a sink of the scores' size, whatever the level
    out, lse, grads = check_case(case, x=x.replace(sinks=sinks.requires_grad_()))
    if level == "minus_inf":  # no sink: heads 1.. are plain attention, and get a zero gradient
        assert (grads[-1][1:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sinks_keyless_rows(dtype):
    """A row that sees no key gets out 0 and lse = sink, with zero dq; tiles without keys too."""
    case = Case(causal=True, sinks=True, seqlen_q=50, seqlen_k=30, mask="bool", tiles=(16, 16))
    x = make_inputs(case, dtype)
    mask = torch.rand(case.batch, case.heads_q, 50, 30, generator=torch.Generator().manual_seed(5)) < 0.8
    mask[:, :, 40:45] = False
    atol = 1e-10 if dtype == torch.float64 else 1e-4
    out, lse, grads = check_case(case, dtype, atol=atol, x=x.replace(mask=mask))
    keyless = torch.zeros(50, dtype=torch.bool)
    keyless[:20] = keyless[40:45] = True   # p_i = i - 20 < 0, and the masked rows
    sinks = x.sinks.detach()[None, :, None].expand(case.batch, -1, int(keyless.sum()))
    torch.testing.assert_close(lse[:, :, keyless], sinks, rtol=4e-7, atol=4e-7)  # base-2 round trip
    assert (out[:, :, keyless] == 0).all() and (grads[0][:, :, keyless] == 0).all()


def test_fully_masked_rows():
    """Rows that see no key (bool mask rows, causal rows before the first key): out 0, lse -inf, grads 0."""
    case = Case(causal=True, seqlen_q=50, seqlen_k=30, mask="bool", tiles=(16, 16))
    x = make_inputs(case)
    mask = torch.rand(case.batch, case.heads_q, 50, 30) < 0.8
    mask[:, :, 40:45] = False
    out, lse, grads = check_case(case, x=x.replace(mask=mask))
    dead = torch.isinf(lse)
    assert dead[:, :, :20].all() and dead[:, :, 40:45].all()  # p_i = i - 20 < 0, and the masked rows
    assert (lse[dead] < 0).all() and (out[dead] == 0).all() and (grads[0][dead] == 0).all()
    assert all(torch.isfinite(t).all() for t in (out, *grads))


def test_window_sees_nothing():
    """A window to the right of every key leaves whole query tiles without keys."""
    check_case(Case(window=(None, 0), seqlen_q=80, seqlen_k=20, mask="additive", mask_grad=True,
                    mask_shape=(1, 1, 80, 20)))


# one NaN input element: (tensor, index; bhsd cases); every row that reads it turns NaN
NAN_PLACES = {
    "q_row": ("q", (0, 1, 5, 3)),
    "k_key": ("k", (1, 0, 0, 2)),       # key 0: every row sees it, causal or not
    "k_last_key": ("k", (0, 1, 44, 0)),  # causal: only the last query sees key 44, the others stay finite
    "v_key": ("v", (0, 1, 0, 0)),       # one element of key 0's value: that output column
    "mask_score": ("mask", (1, 2, 3, 0)),
    "sink": ("sinks", (2,)),
}
NAN_FEATURES = {
    "plain": Case(sinks=True, mask="additive", mask_grad=True),
    "gqa_causal": Case(sinks=True, mask="additive", heads_q=4, heads_kv=2, causal=True),
}


@pytest.mark.parametrize("place", list(NAN_PLACES))
@pytest.mark.parametrize("feature", list(NAN_FEATURES))
def test_nan_inputs_give_nan_rows(feature, place):
    """NaN in an input makes NaN the rows that read it (out and lse), never a masked row; other rows exact."""
    case = NAN_FEATURES[feature]
    name, index = NAN_PLACES[place]
    x = make_inputs(case)
    poisoned = getattr(x, name).detach().clone()
    poisoned[index] = float("nan")
    x = x.replace(**{name: poisoned.requires_grad_(getattr(x, name).requires_grad)})
    out, lse, _ = check_case(case, x=x, nan_ok=True)
    nan_rows = out.isnan().any(dim=-1)
    assert nan_rows.any() and not nan_rows.all()
    if name == "v":  # one V element: that output column only; lse reads no V
        assert not lse.isnan().any()
    else:  # a NaN score: the whole row, out and lse
        assert torch.equal(out.isnan().all(dim=-1), nan_rows) and torch.equal(lse.isnan(), nan_rows)


def test_nan_in_rows_nobody_reads():
    """A NaN score that the causal rule hides (masked, not read) leaves every row finite, as in the oracle."""
    case = Case(causal=True, mask="additive")
    x = make_inputs(case)
    mask = x.mask.detach().clone()
    mask[:, :, 0, 20] = float("nan")   # query 0 sits at p = 8: key 20 is in its future
    check_case(case, x=x.replace(mask=mask))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_large_logits_stay_finite(dtype):
    """|s| up to 1e4 after scaling: finite, and rows dominated by their largest score."""
    case = Case(causal=True)
    x = make_inputs(case, dtype)
    with torch.no_grad():
        x.q.mul_(50)
        x.k.mul_(50)
    out, lse, grads, dout = run_blocked(case, x)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert all(torch.isfinite(g).all() for g in grads)
    ref_out, ref_lse, _ = run_reference(case, x, dout)
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-3 * ref_lse.abs().max().item()


def test_poisoned_outputs(monkeypatch):
    """Every element of out, dq, dk, dv is written: allocations come back NaN-filled."""
    def poisoned_out(p, q):
        return attnx.alloc_out(p, q).fill_(float("nan"))

    monkeypatch.setattr(forward_module, "alloc_out", poisoned_out)
    monkeypatch.setattr(backward_module, "empty_like", lambda t: torch.empty_like(t).fill_(float("nan")))
    for case in (FEATURES["everything"], replace(FEATURES["causal_sq_gt_sk"], seqlen_q=70),
                 Case(window=(None, 0), seqlen_q=80, seqlen_k=20), Case(window=(None, 0), seqlen_q=80,
                                                                        seqlen_k=20, sinks=True),
                 FEATURES["bshd"]):
        check_case(case)


def test_non_contiguous_inputs():
    """Strided views (a sliced last dim, a stride-0 batch) are read through their strides."""
    case = Case(heads_q=4, heads_kv=2, causal=True, alibi="heads")
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 37, 32, generator=gen, dtype=torch.float64)[..., ::2].requires_grad_()
    base_k = torch.randn(1, 2, 45, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k = base_k.expand(2, 2, 45, 16)
    v = torch.randn(2, 45, 2, 16, generator=gen, dtype=torch.float64).transpose(1, 2).requires_grad_()
    alibi = torch.rand(4, generator=gen)
    check_case(case, x=Inputs(q, k, v, alibi_slopes=alibi), atol=1e-10)


def test_declarations():
    """Accepts every feature (offsets, sinks and every tensor format) on the CPU; declines float64 on mps
    with a reason; ranks behind naive only where naive ranks itself first."""
    case = replace(FEATURES["everything"], offset=3)
    x = make_inputs(case)
    p = attnx.make_problem(x.q, x.k, x.v, **case.options(x))
    assert p.offset == 3 and p.has_sinks
    assert BACKEND.reasons(p) == []
    assert {"cpu", "cuda", "mps", "xpu"} <= BACKEND.device_types
    assert any("float64" in r for r in BACKEND.reasons(p._replace(device_type="mps", vendor="apple", arch="mps")))
    for kv_format in ("cache", "paged"):
        assert BACKEND.reasons(p._replace(kv_format=kv_format, mask_kind=None, mask_shape=None,
                                          mask_requires_grad=False)) == []
    assert BACKEND.rank(p) == 20
    naive = attnx.get_backend("naive")
    assert naive.rank(p.bucketed()) < BACKEND.rank(p.bucketed())  # 2*4*37*45 scores: small, but GQA


MEMORY_SCRIPT = textwrap.dedent("""
    import json, resource, sys, torch
    import attnx
    torch.manual_seed(0)
    S, D = 32768, 64
    q, k, v = (torch.randn(1, 1, S, D) for _ in range(3))
    with torch.no_grad():
        out = attnx.attention(q, k, v, backend="blocked")
    forward_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    finite = bool(torch.isfinite(out).all())
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attnx.attention(q, k, v, causal=True, backend="blocked")
    out.sum().backward()
    total_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    finite = finite and all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))
    print(json.dumps({"forward_mb": forward_mb, "total_mb": total_mb, "finite": finite}))
""")


def test_memory_stays_far_below_one_score_matrix():
    """S = 32768, one head: the score matrix alone would be 4 GiB; peak RSS stays under 1 GiB."""
    repo_root = pathlib.Path(attnx.__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT], capture_output=True, text=True, timeout=600,
                            cwd=str(repo_root))
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["finite"]
    assert report["forward_mb"] < 1024, report
    assert report["total_mb"] < 1024, report
