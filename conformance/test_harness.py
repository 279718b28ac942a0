"""The conformance suite checks itself: the grid follows declarations, and broken backends fail.

Cheap: a few cases per broken backend, so the default CI run keeps the suite honest.
"""
from __future__ import annotations

import json

import pytest
import torch

import attnx
from attnx.conformance import Case, declared_reasons, generate_cases, run_case
from attnx.conformance.cases import HEAD_DIMS
from attnx.conformance.report import write_reports

NaiveBackend = type(attnx.get_backend("naive"))


@pytest.fixture
def register():
    """Register backend instances for one test; the registry is restored afterwards."""
    added = []

    def register(backend):
        added.append(backend.name)
        return attnx.register_backend(backend)

    yield register
    for name in added:
        attnx.unregister_backend(name)


def _variant(name, **attributes):
    return type(f"Variant_{name}", (NaiveBackend,), {"name": name, **attributes})()


def _make_problem_of(case: Case):
    from attnx.conformance.inputs import make_inputs

    inputs, _ = make_inputs(case, "cpu")
    views = inputs.views
    return attnx.make_problem(views["q"], views["k"], views["v"], causal=case.causal, window=case.window,
                              offset=case.offset, mask=views.get("mask"), scale=inputs.scale, softcap=case.softcap,
                              alibi_slopes=inputs.alibi_slopes, sinks=views.get("sinks"), layout=case.layout,
                              **inputs.index)


def test_grid_follows_declarations():
    narrow = _variant("narrow", dtypes=frozenset({torch.float16, torch.float64}), head_dims=frozenset({64, 128}),
                      supports_gqa=False, supports_window=False, mask_kinds=frozenset({"bool"}),
                      supports_alibi=False, supports_softcap=False, supports_dv_differs=False)
    cases = generate_cases(narrow, "quick")
    assert cases
    for case in cases:
        assert declared_reasons(narrow, case) == [], case.id
        assert narrow.reasons(_make_problem_of(case)) == [], case.id
    assert {c.dtype for c in cases} == {"float16", "float64"}
    assert {c.head_dim for c in cases} == {64, 128}
    assert any(c.causal for c in cases) and any(c.mask == "bool" for c in cases)
    no_backward = _variant("fwd_only", supports_backward=False)
    assert generate_cases(no_backward, "quick") and not any(c.grad for c in generate_cases(no_backward, "quick"))


def test_quick_profile_touches_every_axis_value():
    cases = generate_cases(attnx.get_backend("naive"), "quick")
    seen = lambda attr: {getattr(c, attr) for c in cases}  # noqa: E731
    assert seen("dtype") == {"float16", "bfloat16", "float32", "float64"}
    assert seen("head_dim") >= set(HEAD_DIMS)
    sizes = seen("seqlen_q") | seen("seqlen_k")
    assert sizes >= {1, 17, 127, 128, 1000}
    assert any(c.seqlen_q < c.seqlen_k for c in cases) and any(c.seqlen_q > c.seqlen_k for c in cases)
    assert {c.heads_q // c.heads_kv for c in cases if c.heads_kv} >= {1, 2, 4} and any(c.heads_kv == 1 < c.heads_q for c in cases)
    windows = seen("window")
    for side in (0, 1):
        assert {w[side] if w else None for w in windows} >= {None, 0, 7}
    assert any(c.causal for c in cases)
    assert {(c.mask, c.mask_shape) for c in cases if c.mask} >= {(k, s) for k in ("bool", "additive")
                                                                  for s in ("full", "heads", "keys", "2d")}
    assert seen("alibi") >= {"h", "bh"} and any(c.softcap for c in cases)
    assert seen("layout") == {"bhsd", "bshd"}
    assert seen("memory") == {"contiguous", "sliced", "transposed", "strided", "expanded"}
    assert any(c.masked_rows for c in cases) and any(c.large_logits for c in cases)
    assert any(c.head_dim != c.head_dim_v for c in cases)
    assert seen("grad") == {True, False} and any(c.mask_grad for c in cases)
    assert len({c.key for c in cases}) == len(cases)
    assert {c.offset for c in cases} >= {None, 0, 5, -3} and any(c.sinks and c.grad for c in cases)
    assert any(c.nan for c in cases) and any(0 in (c.batch, c.heads_q, c.seqlen_q, c.seqlen_k) for c in cases)
    assert {(c.q_format, c.kv_format) for c in cases} == {("dense", "dense"), ("varlen", "varlen"),
                                                          ("dense", "cache"), ("dense", "paged"), ("varlen", "paged"),
                                                          ("varlen", "cache")}
    assert {c.page_size for c in cases} >= {1, 7, 16}


def test_grid_leaves_out_formats_and_features_a_backend_does_not_declare():
    dense_only = _variant("dense_only", supports_sinks=False, supports_offset=False,
                          formats=frozenset({("dense", "dense")}))
    cases = generate_cases(dense_only, "quick")
    assert cases and all(c.is_dense and not c.sinks and c.offset is None for c in cases)


def _broken_lse(self, p, x):
    out, lse = NaiveBackend.forward(self, p, x)
    return out, lse + 1e-2


def _nan_rows(self, p, x):
    out, lse = NaiveBackend.forward(self, p, x)
    out[torch.isneginf(lse)] = float("nan")
    return out, lse


def _bad_gqa_dk(self, p, *args):
    grads = NaiveBackend.backward(self, p, *args)
    grads.dk = grads.dk * (0.9 if p.heads_q != p.heads_kv else 1.0)
    return grads


def _half_unwritten(self, p, x):
    out, lse = NaiveBackend.forward(self, p, x)
    result = attnx.alloc_out(p, x.q)
    result[:, :, : p.seqlen_q // 2] = out[:, :, : p.seqlen_q // 2]
    result[:, :, p.seqlen_q // 2:] = 0
    return result, lse


BASE = Case("t", "float32", 1, 2, 2, 9, 13, 16, 16)
BROKEN = [
    ("lse", {"forward": _broken_lse}, BASE, "lse error"),
    ("nan-rows", {"forward": _nan_rows}, Case("t", "float16", 1, 2, 2, 13, 9, 16, 16, causal=True, masked_rows=True),
     "out error inf"),
    ("gqa-dk", {"backward": _bad_gqa_dk}, Case("t", "bfloat16", 1, 4, 1, 9, 13, 16, 16), "dk error"),
    ("unwritten", {"forward": _half_unwritten}, Case("t", "float64", 1, 2, 2, 8, 8, 16, 16, layout="bshd"), "out error"),
]


@pytest.mark.parametrize("methods, case, message", [pytest.param(m, c, w, id=i) for i, m, c, w in BROKEN])
def test_broken_backends_fail(methods, case, message, register):
    name = "broken"
    register(type("Broken", (NaiveBackend,), {"name": name, **methods})())
    result = run_case(name, case, "cpu")
    assert result.status == "fail" and any(message in f for f in result.failures), result.summary()
    assert run_case("naive", case, "cpu").status == "pass"


def test_extra_reasons_decline_is_a_failure_unless_allowed(register):
    register(_variant("picky", extra_reasons=lambda self, p: ["odd Sq"] if p.seqlen_q % 2 else []))
    result = run_case("picky", BASE, "cpu")
    assert result.status == "fail" and "declined a case its declarations support" in result.failures[0]
    result = run_case("picky", BASE, "cpu", allow_extra_declines=True)
    assert result.status == "declined" and result.reasons == ["odd Sq"]


def test_crash_is_a_failure_and_reports_are_written(register, tmp_path):
    def crash(self, p, *args):
        raise RuntimeError("kernel exploded")

    register(_variant("crashes", forward=crash))
    results = [run_case("crashes", BASE, "cpu"), run_case("naive", BASE, "cpu")]
    assert results[0].status == "fail" and "kernel exploded" in results[0].failures[0]
    md, js = write_reports(results, tmp_path / "rep", {"backend": "x", "profile": "quick", "device": "cpu",
                                                      "seconds": 1.0, "torch": torch.__version__})
    payload = json.loads(js.read_text())
    assert payload["summary"] == {"cases": 2, "pass": 1, "fail": 1, "declined": 0}
    assert payload["results"][1]["errors"]["out"] <= payload["results"][1]["bounds"]["out"]
    assert "kernel exploded" in md.read_text()


def test_nondeterminism_is_caught_when_declared_deterministic(register):
    def noisy(self, p, x):
        out, lse = NaiveBackend.forward(self, p, x)
        return out + torch.rand(()).item() * 1e-12, lse

    register(_variant("noisy", forward=noisy))
    case = Case("base", "float64", 1, 2, 2, 9, 13, 16, 16)
    result = run_case("noisy", case, "cpu")
    assert result.status == "fail" and any("differs between two runs" in f for f in result.failures)


def _ignores_sinks(self, p, x):
    return NaiveBackend.forward(self, p, x.replace(sinks=None))


def _ignores_offset(self, p, x):
    return NaiveBackend.forward(self, p._replace(offset=None), x)


def _first_page_only(self, p, x):
    if x.page_table is not None:
        x = x.replace(page_table=x.page_table[:, :1].expand_as(x.page_table).contiguous())
    return NaiveBackend.forward(self, p, x)


def _zeros_for_nan(self, p, x):
    out, lse = NaiveBackend.forward(self, p, x)
    return torch.nan_to_num(out), torch.nan_to_num(lse)


@pytest.mark.parametrize("forward, group", [(_ignores_sinks, "sinks"), (_ignores_offset, "offset"),
                                            (_first_page_only, "format"), (_zeros_for_nan, "nan")],
                         ids=["sinks", "offset", "pages", "nan"])
def test_broken_contract_features_fail(forward, group, register):
    register(type("Broken", (NaiveBackend,), {"name": "broken", "forward": forward})())
    cases = [c for c in generate_cases(attnx.get_backend("broken"), "quick") if c.group == group]
    statuses = [run_case("broken", c, "cpu").status for c in cases]
    assert "fail" in statuses, statuses
