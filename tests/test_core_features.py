"""The contract's 2026-12 additions through the public API, on every CPU backend that declares them:
alignment offsets, sinks, NaN propagation, zero-size problems, `merge` and `plan`."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnx
from attnx.reference import attention_reference


def _cpu_backends(feature: str) -> list[str]:
    return [n for n, b in attnx.registered_backends().items()
            if b.available and "cpu" in b.device_types and getattr(b, feature) and torch.float64 in b.dtypes]


@pytest.mark.parametrize("backend", _cpu_backends("supports_offset"))
@pytest.mark.parametrize("sq, sk", [(5, 9), (9, 5), (6, 6)])
def test_offset_zero_is_sdpa_top_left_causal(backend, sq, sk):
    q, k, v = torch.randn(2, 3, sq, 16), torch.randn(2, 3, sk, 16), torch.randn(2, 3, sk, 16)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = attnx.attention(q, k, v, causal=True, offset=0, backend=backend)
    if sq > sk:  # SDPA's top-left triangle leaves no row empty here, so both are defined everywhere
        assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", _cpu_backends("supports_sinks"))
def test_sinks_equal_an_extra_key_with_zero_value(backend):
    """A sink is a key of score sink_h (not scaled) and value 0: append one and compare."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, dtype=torch.float64) for _ in range(3))
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float32)
    out, lse = attnx.attention(q, k, v, sinks=sinks, return_lse=True, backend=backend)
    scale = 8 ** -0.5
    # a key whose score q.k * scale equals the sink for every query: k_sink = q-independent is impossible,
    # so extend the scores directly
    s = torch.cat([q @ k.transpose(-1, -2) * scale, sinks.double()[None, :, None, None].expand(1, 2, 6, 1)], -1)
    want = torch.softmax(s, -1)[..., :-1] @ v
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", _cpu_backends("supports_backward"))
def test_nan_in_one_key_makes_exactly_the_rows_that_see_it_nan(backend):
    q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    k[0, 0, 3, 0] = float("nan")
    out, lse = attnx.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    rows_seeing_key3 = torch.arange(6) >= 3
    assert torch.isnan(out[0, 0, rows_seeing_key3]).all() and torch.isnan(lse[0, 0, rows_seeing_key3]).all()
    assert torch.isfinite(out[0, 0, ~rows_seeing_key3]).all() and torch.isfinite(out[0, 1]).all()


@pytest.mark.parametrize("backend", _cpu_backends("supports_backward"))
@pytest.mark.parametrize("causal", [False, True])
def test_an_infinite_score_makes_its_row_nan_and_its_lse_not_finite(backend, causal):
    """docs/semantics.md: a +inf score (an infinity in q or k, no NaN) makes the row's out NaN as the
    formula does; lse is +inf or NaN, never finite; a -inf score is a key the row does not see."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    q[0, 0, 4, 0], k[0, 0, :, 0] = float("inf"), torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
    out, lse = attnx.attention(q, k, v, causal=causal, return_lse=True, backend=backend)
    want = attnx.attention(q.double(), k.double(), v.double(), causal=causal, backend="naive")
    assert torch.isnan(out[0, 0, 4]).all() and not torch.isfinite(lse[0, 0, 4])
    assert torch.equal(torch.isnan(out), torch.isnan(want))
    assert torch.isfinite(lse[0, 0, :4]).all() and torch.isfinite(lse[0, 0, 5]).all()
    torch.testing.assert_close(out[0, 0, :4], want[0, 0, :4].float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape_q, shape_k", [((0, 2, 5, 8), (0, 2, 7, 8)), ((1, 0, 5, 8), (1, 0, 7, 8)),
                                              ((1, 2, 0, 8), (1, 2, 7, 8)), ((1, 2, 5, 8), (1, 2, 0, 8))],
                         ids=["batch0", "heads0", "sq0", "sk0"])
def test_zero_size_problems_match_sdpa(shape_q, shape_k):
    q = torch.randn(shape_q, requires_grad=True)
    k = torch.randn(shape_k, requires_grad=True)
    v = torch.randn(shape_k, requires_grad=True)
    out, lse = attnx.attention(q, k, v, return_lse=True)
    assert out.shape == F.scaled_dot_product_attention(q, k, v).shape == shape_q
    assert lse.shape == shape_q[:3] and (lse == float("-inf")).all()
    assert (out == 0).all()
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape and (t.grad == 0).all()
    sinks = torch.tensor([0.25, -2.0])
    if shape_q[1] == 2:
        _, lse = attnx.attention(q, k, v, sinks=sinks, return_lse=True)
        assert torch.equal(lse, sinks[None, :, None].expand_as(lse))


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_merge_of_key_splits_is_one_shot_attention(layout):
    torch.manual_seed(0)
    q = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    k, v = torch.randn(2, 3, 11, 8, dtype=torch.float64), torch.randn(2, 3, 11, 8, dtype=torch.float64)
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    dim = 1 if layout == "bshd" else 2
    bounds = [(0, 4), (4, 9), (9, 11)]
    parts = [attnx.attention(q, k.narrow(dim, a, b - a), v.narrow(dim, a, b - a), layout=layout, return_lse=True)
             for a, b in bounds]
    out, lse = attnx.merge([o for o, _ in parts], [l for _, l in parts], layout=layout)
    want, want_lse = attnx.attention(q, k, v, layout=layout, return_lse=True)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse.double())


def test_merge_rows_no_part_saw_and_gradients():
    q = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    k, v = torch.randn(1, 1, 6, 8, dtype=torch.float64), torch.randn(1, 1, 6, 8, dtype=torch.float64)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[0] = False  # row 0 sees nothing in either part
    a = attnx.attention(q, k[:, :, :3], v[:, :, :3], mask=mask[:, :3], return_lse=True)
    b = attnx.attention(q, k[:, :, 3:], v[:, :, 3:], mask=mask[:, 3:], return_lse=True)
    outs = [a[0].requires_grad_(), b[0].requires_grad_()]
    lses = [a[1].double().requires_grad_(), b[1].double().requires_grad_()]
    out, lse = attnx.merge(outs, lses)
    assert (out[0, 0, 0] == 0).all() and lse[0, 0, 0] == float("-inf")
    (out.sum() + lse[torch.isfinite(lse)].sum()).backward()
    for t in outs + lses:
        assert torch.isfinite(t.grad).all()
    assert torch.autograd.gradcheck(lambda *t: attnx.merge(t[:2], t[2:])[0],
                                    (torch.randn(1, 1, 3, 4, dtype=torch.float64, requires_grad=True),
                                     torch.randn(1, 1, 3, 4, dtype=torch.float64, requires_grad=True),
                                     torch.randn(1, 1, 3, dtype=torch.float64, requires_grad=True),
                                     torch.randn(1, 1, 3, dtype=torch.float64, requires_grad=True)))


def test_merge_propagates_nan_and_checks_shapes():
    o = torch.zeros(1, 1, 2, 4)
    l1, l2 = torch.tensor([[[0.0, float("nan")]]]), torch.zeros(1, 1, 2)
    out, lse = attnx.merge([o, o], [l1, l2])
    assert torch.isnan(lse[0, 0, 1]) and not torch.isnan(lse[0, 0, 0])
    with pytest.raises(ValueError, match="lse"):
        attnx.merge([o], [torch.zeros(1, 2, 1)])
    with pytest.raises(ValueError, match="layout"):
        attnx.merge([o], [l2], layout="sbhd")


def test_plan_runs_new_tensors_without_re_deciding(clean_registry, make_spy):
    spy = attnx.register_backend(make_spy(priority={"*": 1000}))
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    step = attnx.plan(q, k, v, causal=True)
    assert step.backend is spy
    decisions = spy.calls.count("reasons")
    for _ in range(3):
        q2, k2, v2 = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)
        torch.testing.assert_close(step.run(q2, k2, v2), attnx.attention(q2, k2, v2, causal=True, backend="naive"))
    assert spy.calls.count("reasons") == decisions and spy.calls.count("forward") == 3
    with pytest.raises(ValueError, match="planned signature"):
        step.run(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match="plan time"):
        step.run(q, k, v, causal=False)


def test_plan_over_a_paged_cache_follows_new_lengths():
    q = torch.randn(2, 2, 1, 8)
    pool = torch.randn(6, 4, 2, 8)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    step = attnx.plan(q, pool, pool, causal=True, seqlens_k=torch.tensor([5, 9], dtype=torch.int32),
                      page_table=table)
    for lengths in ([5, 9], [6, 10], [12, 1]):
        lens = torch.tensor(lengths, dtype=torch.int32)
        got = step.run(q, pool, pool, seqlens_k=lens, page_table=table)
        for b, n in enumerate(lengths):
            keys = pool[table[b].long()].flatten(0, 1)[:n].transpose(0, 1)[None]
            want = attention_reference(q[b:b + 1], keys, keys, scale=8 ** -0.5)[0]
            torch.testing.assert_close(got[b:b + 1], want.to(got.dtype))
