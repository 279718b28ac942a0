"""A call never seen whose k/v length is all that differs from a validated one (`call_memo.sibling`).

A decode loop's key length grows by one per step, so every step is a new signature. Such a step
reuses the validated `Problem` of its sibling with ``seqlen_k`` replaced instead of validating again;
these tests hold that Problem to the one full validation gives, every bad variant to its typed error,
and the dispatch decision to the one made for the exact problem (never the sibling's).
"""
from __future__ import annotations

import math

import pytest
import torch

import attnx
from attnx import call_memo
from attnx.errors import InvalidArgumentError
from attnx.problem import length_bucket, make_call
from backends.torch import cpu as torch_cpu


@pytest.fixture(autouse=True)
def _fresh_memo():
    call_memo.clear()
    yield
    call_memo.clear()


def _cache(layout="bhsd", heads_q=4, heads_kv=2, length=40, d=8, **kw):
    """q of one token and k/v caches of `length` keys in `layout`; `kv(n)` gives their first n keys."""
    q = torch.randn(2, heads_q, 1, d, **kw)
    k, v = (torch.randn(2, heads_kv, length, d, **kw) for _ in range(2))
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        return q, lambda n: (k[:, :n], v[:, :n])
    return q, lambda n: (k[:, :, :n], v[:, :, :n])


def _key(q, k, v, **options):
    return call_memo.lookup(q, k, v, options.get("layout", "bhsd"), options.get("causal", False),
                            options.get("scale"), options.get("deterministic"), options.get("return_lse", False))[0]


@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(scale=0.25), dict(layout="bshd"),
                                     dict(return_lse=True), dict(deterministic=True), dict(grad=True)])
def test_a_sibling_problem_is_the_validated_one(options):
    options = dict(options)
    grad = options.pop("grad", False)
    q, kv = _cache(layout=options.get("layout", "bhsd"), requires_grad=grad)
    first = attnx.attention(q, *kv(10), **options)  # validated: its siblings are known from now on
    assert first is not None
    for n in (11, 12, 16, 17, 33, 40, 1, 0):
        k, v = kv(n)
        key = _key(q, k, v, **options)
        sibling = call_memo.sibling(key)
        wants_lse = options.get("return_lse", False)
        validated = make_call(q, k, v, memo_key=None, wants_lse=wants_lse,
                              **{name: value for name, value in options.items() if name != "return_lse"})[0]
        assert sibling == validated and sibling.seqlen_k == n, (options, n)


def test_siblings_run_what_the_full_path_runs(monkeypatch):
    from attnx import api

    validated = []
    monkeypatch.setattr(api, "make_call", lambda *a, **kw: validated.append(1) or make_call(*a, **kw))
    q, kv = _cache()
    attnx.attention(q, *kv(8), return_lse=True)
    for n in range(9, 40, 3):
        validated.clear()
        got = attnx.attention(q, *kv(n), return_lse=True)
        assert not validated  # a sibling: not validated again
        call_memo.clear()
        want = attnx.attention(q, *kv(n), return_lse=True)  # validated in full
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    empty = attnx.attention(q, *kv(0), return_lse=True)  # no keys: no backend, out 0, lse -inf
    assert torch.all(empty[0] == 0) and torch.all(empty[1] == float("-inf"))


@pytest.mark.parametrize("bad", [
    lambda k, v: (k, v[:, :, :-1]),             # k and v lengths differ
    lambda k, v: (k[..., :4], v),               # another head dim
    lambda k, v: (k[0], v[0]),                  # 3-D
    lambda k, v: (k, v.double()),               # another dtype
])
def test_a_bad_variant_of_a_sibling_still_raises(bad):
    q, kv = _cache()
    attnx.attention(q, *kv(10))
    k, v = bad(*kv(20))
    with pytest.raises((InvalidArgumentError, attnx.InvalidTypeError)):
        attnx.attention(q, k, v)


def _backends_run(q, kv, lengths, ran, spy, validate_each: bool) -> list:
    """Which backend ran each step of a decode loop over `lengths`, from a fresh dispatch cache;
    `validate_each`: the memo is emptied before every step, so each step validates in full."""
    from attnx import dispatch

    dispatch.clear_cache()
    call_memo.clear()
    names = []
    for n in lengths:
        if validate_each:
            call_memo.clear()
        ran.clear()
        spy.calls.clear()
        attnx.attention(q, *kv(n))
        names.append(spy.name if "forward" in spy.calls else ran[0][0])
    return names


def test_a_decision_that_hangs_on_the_exact_length_is_made_for_each_length(make_spy, ran):
    """A backend ahead of the rest that declines odd key lengths: the steps of a decode loop are siblings,
    and each runs what the fully validated call runs, never the sibling's backend where it declines."""
    spy = make_spy(name="even", priority={"*": 10_000})
    spy.extra_reasons = lambda p: ["odd key length"] if p.seqlen_k % 2 else []
    q, kv = _cache(length=80)
    lengths = [10, 12, 11, 13, 14, 40, 41, 42, 70, 20, 21]
    with attnx.registered(spy):
        got = _backends_run(q, kv, lengths, ran, spy, validate_each=False)
        want = _backends_run(q, kv, lengths, ran, spy, validate_each=True)
    assert got == want
    assert got[:2] == ["even", "even"] and "torch" in got
    assert all(name != "even" for name, n in zip(got, lengths) if n % 2)


def test_a_decision_that_changes_with_the_length_bucket_follows_it(make_spy, ran):
    """Two problems that differ only in the key length, in different length buckets, get the decisions
    their buckets rank: a backend ranked first up to 32 keys and last beyond runs only there."""
    spy = make_spy(name="short")
    spy.rank = lambda p: 10_000 if p.seqlen_k <= 32 else -1
    q, kv = _cache(length=80)
    with attnx.registered(spy):
        for n in list(range(20, 80, 7)) + list(range(79, 20, -9)):
            spy.calls.clear()
            ran.clear()
            attnx.attention(q, *kv(n))
            short = length_bucket(n) <= 32
            assert attnx.explain(q, *kv(n)).chosen == ("short" if short else "torch")
            assert ("forward" in spy.calls) == short and bool(ran) == (not short), n


def test_a_sibling_is_only_a_call_that_differs_in_the_key_length():
    q, kv = _cache()
    attnx.attention(q, *kv(10))
    k, v = kv(12)
    assert call_memo.sibling(_key(q, k, v)) is not None
    for other in (dict(causal=True), dict(scale=0.5), dict(return_lse=True), dict(layout="bshd")):
        assert call_memo.sibling(_key(q, k, v, **other)) is None, other
    assert call_memo.sibling(_key(q[:, :2], k, v)) is None          # another query head count
    assert call_memo.sibling(_key(q, k, v[:, :, :-1])) is None       # lengths differ: the full path raises
    assert call_memo.sibling(_key(q, k.double(), v.double())) is None


@pytest.mark.parametrize("numel", [12, 128, 129, 2048])
def test_the_nonfinite_lse_check_flags_nan_infinities_and_zero_at_any_size(numel):
    """`_suspect` reads small lse back in Python and large lse with two ops: both flag a NaN, either
    infinity or an exact zero anywhere, and pass finite nonzero values (tiny ones included)."""
    lse = torch.randn(2, 2, numel // 4).abs().add_(0.5)
    assert not torch_cpu._suspect(lse)
    tiny = lse.clone()
    tiny[0, 0, 0] = 1e-42  # a float32 denormal: 1 / x overflows, x / x does not
    assert not torch_cpu._suspect(tiny)
    for value in (math.nan, math.inf, -math.inf, 0.0, -0.0):
        for where in ((0, 0, 0), (1, 1, -1)):
            bad = lse.clone()
            bad[where] = value
            assert torch_cpu._suspect(bad), (value, where)
            assert torch_cpu._suspect(bad.transpose(1, 2).contiguous().transpose(1, 2)), (value, where)
