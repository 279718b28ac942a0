"""Bad input raises ValueError/TypeError naming the argument, before any backend runs (docs/semantics.md)."""
from __future__ import annotations

import math

import pytest
import torch

import attnx

B, HQ, HKV, SQ, SK, D = 2, 4, 2, 5, 7, 8


def _good():
    q = torch.randn(B, HQ, SQ, D)
    k = torch.randn(B, HKV, SK, D)
    v = torch.randn(B, HKV, SK, D)
    return q, k, v


def _with(**changes):
    """A call (args, kwargs) equal to a valid one except for `changes` (q/k/v or keyword arguments)."""
    q, k, v = _good()
    tensors = {"q": q, "k": k, "v": v}
    for name in ("q", "k", "v"):
        if name in changes:
            tensors[name] = changes.pop(name)
    return (tensors["q"], tensors["k"], tensors["v"]), changes


def _meta(shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


# (id, call, expected error type, words the message must contain)
BAD = [
    ("q-rank3", _with(q=torch.randn(B, HQ, SQ)), ValueError, "`q`"),
    ("k-rank5", _with(k=torch.randn(B, HKV, SK, D, 1)), ValueError, "`k`"),
    ("v-rank2", _with(v=torch.randn(SK, D)), ValueError, "`v`"),
    ("q-not-tensor", _with(q=[[1.0]]), TypeError, "`q`"),
    ("v-numpy", _with(v=torch.randn(B, HKV, SK, D).numpy()), TypeError, "`v`"),
    ("q-int-dtype", _with(q=torch.ones(B, HQ, SQ, D, dtype=torch.int32)), TypeError, "`q`"),
    ("k-complex-dtype", _with(k=torch.ones(B, HKV, SK, D, dtype=torch.complex64)), TypeError, "`k`"),
    ("k-dtype-differs", _with(k=torch.randn(B, HKV, SK, D, dtype=torch.float64)), TypeError, "`k`"),
    ("v-dtype-differs", _with(v=torch.randn(B, HKV, SK, D, dtype=torch.float16)), TypeError, "`v`"),
    ("batch-differs", _with(k=torch.randn(B + 1, HKV, SK, D), v=torch.randn(B + 1, HKV, SK, D)), ValueError, "batch"),
    ("k-head-dim", _with(k=torch.randn(B, HKV, SK, D + 1)), ValueError, "`k` head dim"),
    ("v-seqlen", _with(v=torch.randn(B, HKV, SK + 1, D)), ValueError, "`v`"),
    ("v-heads", _with(v=torch.randn(B, HKV + 1, SK, D)), ValueError, "`v`"),
    ("heads-not-multiple", _with(k=torch.randn(B, 3, SK, D), v=torch.randn(B, 3, SK, D)), ValueError, "heads"),
    ("d-zero", _with(q=torch.randn(B, HQ, SQ, 0), k=torch.randn(B, HKV, SK, 0)), ValueError, "head dim"),
    ("k-other-device", _with(k=_meta((B, HKV, SK, D))), ValueError, "device"),
    ("q-other-device", _with(q=_meta((B, HQ, SQ, D))), ValueError, "device"),
    ("layout-unknown", _with(layout="bsdh"), ValueError, "`layout`"),
    ("layout-not-str", _with(layout=1), ValueError, "`layout`"),
    ("layout-bshd-mismatch", _with(layout="bshd"), ValueError, "heads"),
    ("mask-wrong-shape", _with(mask=torch.ones(SQ, SK + 1, dtype=torch.bool)), ValueError, "`mask`"),
    ("mask-rank5", _with(mask=torch.ones(1, B, HQ, SQ, SK, dtype=torch.bool)), ValueError, "`mask`"),
    ("mask-batch-mismatch", _with(mask=torch.zeros(B + 1, 1, SQ, SK)), ValueError, "`mask`"),
    ("mask-int-dtype", _with(mask=torch.ones(SQ, SK, dtype=torch.int64)), TypeError, "`mask`"),
    ("mask-not-tensor", _with(mask=[[True] * SK] * SQ), TypeError, "`mask`"),
    ("mask-other-device", _with(mask=_meta((SQ, SK))), ValueError, "`mask`"),
    ("alibi-float16", _with(alibi_slopes=torch.ones(HQ, dtype=torch.float16)), TypeError, "`alibi_slopes`"),
    ("alibi-float64", _with(alibi_slopes=torch.ones(HQ, dtype=torch.float64)), TypeError, "`alibi_slopes`"),
    ("alibi-wrong-heads", _with(alibi_slopes=torch.ones(HKV)), ValueError, "`alibi_slopes`"),
    ("alibi-rank3", _with(alibi_slopes=torch.ones(1, B, HQ)), ValueError, "`alibi_slopes`"),
    ("alibi-not-tensor", _with(alibi_slopes=[0.5] * HQ), TypeError, "`alibi_slopes`"),
    ("alibi-other-device", _with(alibi_slopes=_meta((HQ,))), ValueError, "`alibi_slopes`"),
    ("window-negative-left", _with(window=(-1, 0)), ValueError, "`window`"),
    ("window-negative-right", _with(window=(None, -3)), ValueError, "`window`"),
    ("window-int", _with(window=4), TypeError, "`window`"),
    ("window-triple", _with(window=(1, 2, 3)), TypeError, "`window`"),
    ("window-float-side", _with(window=(2.0, 0)), TypeError, "`window`"),
    ("window-bool-side", _with(window=(True, 0)), TypeError, "`window`"),
    ("window-str", _with(window="left"), TypeError, "`window`"),
    ("softcap-zero", _with(softcap=0.0), ValueError, "`softcap`"),
    ("softcap-negative", _with(softcap=-5.0), ValueError, "`softcap`"),
    ("softcap-inf", _with(softcap=math.inf), ValueError, "`softcap`"),
    ("softcap-nan", _with(softcap=math.nan), ValueError, "`softcap`"),
    ("softcap-str", _with(softcap="30"), TypeError, "`softcap`"),
    ("scale-str", _with(scale="0.1"), TypeError, "`scale`"),
    ("scale-nan", _with(scale=math.nan), ValueError, "`scale`"),
    ("scale-inf", _with(scale=-math.inf), ValueError, "`scale`"),
    ("scale-bool", _with(scale=True), TypeError, "`scale`"),
    ("scale-tensor", _with(scale=torch.tensor(0.5)), TypeError, "`scale`"),
    ("causal-str", _with(causal="yes"), TypeError, "`causal`"),
    ("causal-int", _with(causal=1), TypeError, "`causal`"),
    ("return-lse-str", _with(return_lse="yes"), TypeError, "`return_lse`"),
    ("return-lse-none", _with(return_lse=None), TypeError, "`return_lse`"),
    ("deterministic-str", _with(deterministic="yes"), TypeError, "`deterministic`"),
    ("deterministic-int", _with(deterministic=1), TypeError, "`deterministic`"),
    ("sinks-float16", _with(sinks=torch.zeros(HQ, dtype=torch.float16)), TypeError, "`sinks`"),
    ("sinks-kv-heads", _with(sinks=torch.zeros(HKV)), ValueError, "`sinks`"),
    ("sinks-list", _with(sinks=[0.0] * HQ), TypeError, "`sinks`"),
    ("sinks-other-device", _with(sinks=_meta((HQ,))), ValueError, "`sinks`"),
    ("offset-float", _with(offset=1.5), TypeError, "`offset`"),
    ("offset-bool", _with(offset=True), TypeError, "`offset`"),
    ("offset-huge", _with(offset=1 << 40), ValueError, "`offset`"),
    ("cu-seqlens-int64", _with(q=torch.randn(7, HQ, D), k=torch.randn(7, HKV, D), v=torch.randn(7, HKV, D),
                               cu_seqlens_q=torch.tensor([0, 7]), cu_seqlens_k=torch.tensor([0, 7])),
     TypeError, "`cu_seqlens_q`"),
    ("cu-seqlens-q-alone", _with(q=torch.randn(7, HQ, D), cu_seqlens_q=torch.tensor([0, 7], dtype=torch.int32)),
     ValueError, "`cu_seqlens_q`"),
    ("cu-seqlens-k-length", _with(q=torch.randn(7, HQ, D), k=torch.randn(7, HKV, D), v=torch.randn(7, HKV, D),
                                  cu_seqlens_q=torch.tensor([0, 7], dtype=torch.int32),
                                  cu_seqlens_k=torch.tensor([0, 3, 7], dtype=torch.int32)), ValueError, "`cu_seqlens_k`"),
    ("varlen-q-rank4", _with(cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32),
                             cu_seqlens_k=torch.tensor([0, 2, 5], dtype=torch.int32)), ValueError, "`q`"),
    ("page-table-without-lengths", _with(k=torch.randn(3, 4, HKV, D), v=torch.randn(3, 4, HKV, D),
                                         page_table=torch.zeros(B, 2, dtype=torch.int32)), ValueError, "seqlens_k"),
    ("page-table-int64", _with(k=torch.randn(3, 4, HKV, D), v=torch.randn(3, 4, HKV, D),
                               page_table=torch.zeros(B, 2, dtype=torch.int64),
                               seqlens_k=torch.zeros(B, dtype=torch.int32)), TypeError, "`page_table`"),
    ("page-table-rows", _with(k=torch.randn(3, 4, HKV, D), v=torch.randn(3, 4, HKV, D),
                              page_table=torch.zeros(B + 1, 2, dtype=torch.int32),
                              seqlens_k=torch.zeros(B, dtype=torch.int32)), ValueError, "`page_table`"),
    ("seqlens-k-length", _with(seqlens_k=torch.zeros(B + 1, dtype=torch.int32)), ValueError, "`seqlens_k`"),
    ("mask-with-cache", _with(seqlens_k=torch.zeros(B, dtype=torch.int32), mask=torch.ones(SQ, SK, dtype=torch.bool)),
     ValueError, "`mask`"),
    ("backend-unknown", _with(backend="no-such-backend"), ValueError, "backend"),
    ("backend-not-str", _with(backend=3), TypeError, "backend"),
]


@pytest.mark.parametrize("call, error, words", [pytest.param(c, e, w, id=i) for i, c, e, w in BAD])
def test_bad_input_raises_before_any_backend(call, error, words, ran):
    args, kwargs = call
    with pytest.raises(error) as info:
        attnx.attention(*args, **kwargs)
    assert words in str(info.value), str(info.value)
    assert isinstance(info.value, attnx.AttnxError)
    assert ran == []


@pytest.mark.parametrize("call, error, words",
                         [pytest.param(c, e, w, id=i) for i, c, e, w in BAD if "return_lse" not in c[1]])
def test_explain_validates_the_same(call, error, words, ran):
    args, kwargs = call
    with pytest.raises(error) as info:
        attnx.explain(*args, **kwargs)
    assert words in str(info.value), str(info.value)
    assert ran == []


def test_forced_spy_backend_never_runs_on_bad_input(clean_registry, make_spy):
    spy = attnx.register_backend(make_spy())
    q, k, v = _good()
    with pytest.raises(ValueError, match="`window`"):
        attnx.attention(q, k, v, window=(-1, 0), backend="spy")
    with pytest.raises(ValueError, match="`mask`"):
        attnx.attention(q, k, v, mask=torch.ones(3, 3, dtype=torch.bool), backend="spy")
    assert "forward" not in spy.calls
    attnx.attention(q, k, v, backend="spy")  # the spy itself works
    assert spy.calls.count("forward") == 1


@pytest.mark.parametrize("names, error", [("no-such-backend", ValueError), (3, TypeError), ([], ValueError),
                                          ("naive,no-such-backend", ValueError), ([None], TypeError)])
def test_use_backend_unknown_names(names, error, ran):
    with pytest.raises(error, match="use_backend"):
        with attnx.use_backend(names):
            pass
    assert ran == []


def test_env_unknown_backend(monkeypatch, ran, qkv):
    monkeypatch.setenv("ATTNX_BACKEND", "no-such-backend")
    q, k, v = qkv()
    with pytest.raises(ValueError, match="ATTNX_BACKEND"):
        attnx.attention(q, k, v)
    assert ran == []


def test_register_backend_type_checked(clean_registry, make_spy):
    with pytest.raises(TypeError, match="`backend`"):
        attnx.register_backend("naive")
    with pytest.raises(ValueError, match="name"):
        attnx.register_backend(make_spy(name=""))


def test_errors_are_typed_attnx_errors():
    assert issubclass(attnx.InvalidArgumentError, ValueError)
    assert issubclass(attnx.InvalidTypeError, TypeError)
    assert issubclass(attnx.NoBackendError, ValueError) and issubclass(attnx.NoBackendError, RuntimeError)


@pytest.mark.parametrize("index, words", [
    (dict(cu_seqlens_q=[0, 5, 3], cu_seqlens_k=[0, 4, 7]), "cu_seqlens_q"),   # falls
    (dict(cu_seqlens_q=[0, 3, 7], cu_seqlens_k=[0, 4, 9]), "cu_seqlens_k"),   # past the packed keys
    (dict(cu_seqlens_q=[1, 3, 7], cu_seqlens_k=[0, 4, 7]), "cu_seqlens_q"),   # does not start at 0
])
def test_bad_index_values_raise_before_anything_is_read(index, words):
    """Index tensors' values are checked on the host before any row they name is read."""
    q, k = torch.randn(7, HQ, D), torch.randn(7, HKV, D)
    tensors = {n: torch.tensor(v, dtype=torch.int32) for n, v in index.items()}
    with pytest.raises(ValueError, match=words):
        attnx.attention(q, k, k, backend="naive", **tensors)


def test_bad_page_table_values_raise():
    q = torch.randn(1, HQ, 1, D)
    pool = torch.randn(3, 4, HKV, D)
    lengths = torch.tensor([6], dtype=torch.int32)
    with pytest.raises(ValueError, match="page_table"):
        attnx.attention(q, pool, pool, seqlens_k=lengths, page_table=torch.tensor([[0, 3]], dtype=torch.int32),
                        backend="naive")
    with pytest.raises(ValueError, match="seqlens_k"):
        attnx.attention(q, pool, pool, seqlens_k=torch.tensor([9], dtype=torch.int32),
                        page_table=torch.tensor([[0, 1]], dtype=torch.int32), backend="naive")
