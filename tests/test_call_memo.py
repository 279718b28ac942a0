"""The fast path for repeated plain calls (`attnx.call_memo`, `dispatch._last`) never skips a check.

A plain call validated once is remembered by its signature; every bad variant of it differs in
that signature and still raises its typed error, and everything the `Problem` depends on
(gradient mode, requires_grad, deterministic algorithms) is part of the key.
"""
from __future__ import annotations

import pytest
import torch

import attnx
from attnx import call_memo
from attnx.errors import InvalidArgumentError, InvalidTypeError
from attnx.problem import make_call


def _qkv(**kw):
    return tuple(torch.randn(2, 4, 16, 8, **kw) for _ in range(3))


@pytest.fixture(autouse=True)
def _fresh_memo():
    call_memo.clear()
    yield
    call_memo.clear()


@pytest.mark.parametrize("bad, error", [
    (lambda q, k, v: dict(q=q, k=k.double(), v=v), InvalidTypeError),
    (lambda q, k, v: dict(q=q, k=k[:, :, :, :4], v=v), InvalidArgumentError),
    (lambda q, k, v: dict(q=q, k=k[:1], v=v), InvalidArgumentError),
    (lambda q, k, v: dict(q=q, k=k, v=v[:, :3]), InvalidArgumentError),
    (lambda q, k, v: dict(q=q.int(), k=k, v=v), InvalidTypeError),
    (lambda q, k, v: dict(q=q, k=k, v=v, causal=1), InvalidTypeError),
    (lambda q, k, v: dict(q=q, k=k, v=v, scale=float("inf")), InvalidArgumentError),
    (lambda q, k, v: dict(q=q, k=k, v=v, scale=float("nan")), InvalidArgumentError),
    (lambda q, k, v: dict(q=q, k=k, v=v, layout="bhds"), InvalidArgumentError),
    (lambda q, k, v: dict(q=q, k=k, v=v, window=(-1, 0)), InvalidArgumentError),
])
def test_a_bad_variant_of_a_remembered_call_still_raises(bad, error):
    q, k, v = _qkv()
    for options in (dict(), dict(causal=True), dict(scale=0.5)):
        attnx.attention(q, k, v, **options)  # remembered
        assert make_call(q, k, v, **options)[0] is make_call(q, k, v, **options)[0]
    with pytest.raises(error):
        args = bad(q, k, v)
        attnx.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_the_problem_follows_gradient_mode_and_determinism():
    q, k, v = _qkv()
    assert not make_call(q, k, v)[0].needs_grad
    qg = q.clone().requires_grad_()
    assert make_call(qg, k, v)[0].needs_grad
    with torch.no_grad():
        assert not make_call(qg, k, v)[0].needs_grad
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert make_call(qg, k, v)[0].deterministic
    finally:
        torch.use_deterministic_algorithms(was)
    assert not make_call(qg, k, v)[0].deterministic


def test_remembered_problems_equal_fully_validated_ones():
    q, k, v = _qkv()
    for options in (dict(), dict(causal=True), dict(scale=0.25), dict(layout="bshd")):
        first = make_call(q, k, v, **options)[0]
        call_memo.clear()
        assert make_call(q, k, v, **options)[0] == first


def test_only_plain_calls_are_remembered():
    q, k, v = _qkv()
    make_call(q, k, v, mask=torch.rand(16, 16) > 0.5)
    make_call(q, k, v, window=(3, 0))
    make_call(torch.nn.Parameter(q), k, v)
    make_call(q, k, v, scale=1)  # an int scale takes the full path
    assert not call_memo._memo
    make_call(q, k, v)
    assert len(call_memo._memo) == 1


def test_the_last_decision_follows_restrictions_and_registrations(make_spy):
    q, k, v = _qkv()
    first = attnx.explain(q, k, v).chosen
    out = attnx.attention(q, k, v)
    with attnx.use_backend("naive"):
        torch.testing.assert_close(attnx.attention(q, k, v), out, atol=1e-5, rtol=1e-5)
        assert attnx.dispatch.choose(make_call(q, k, v)[0]).name == "naive"
    assert attnx.dispatch.choose(make_call(q, k, v)[0]).name == first
    spy = make_spy(priority={"*": 10_000})
    with attnx.registered(spy):
        attnx.attention(q, k, v)
        assert "forward" in spy.calls
    assert attnx.dispatch.choose(make_call(q, k, v)[0]).name == first


# -- the remembered run (`call_memo.Run`): `attention` skips make_call and dispatch, never a change --
def test_a_remembered_run_follows_every_dispatch_change(ran, make_spy, monkeypatch):
    q, k, v = _qkv()
    first = attnx.explain(q, k, v).chosen
    for _ in range(2):
        attnx.attention(q, k, v)
    assert ran == [(first, "forward")] * 2 and len(call_memo.runs()) == 1
    ran.clear()
    attnx.attention(q, k, v, backend="naive")           # a forced backend: another run
    with attnx.use_backend("naive"):                    # a restriction
        attnx.attention(q, k, v)
    monkeypatch.setenv("ATTNX_BACKEND", "naive")        # the environment, read on every call
    attnx.attention(q, k, v)
    monkeypatch.delenv("ATTNX_BACKEND")
    attnx.attention(q, k, v)
    assert ran == [("naive", "forward")] * 3 + [(first, "forward")]
    ran.clear()
    spy = make_spy(priority={"*": 10_000})
    with attnx.registered(spy):                         # a registration
        attnx.attention(q, k, v)
        assert "forward" in spy.calls and not ran
    attnx.attention(q, k, v)
    assert ran == [(first, "forward")]


def test_a_remembered_run_gives_what_the_full_path_gives():
    q, k, v = _qkv()
    qg = q.clone().requires_grad_()
    cases = [dict(), dict(causal=True), dict(scale=0.3), dict(layout="bshd"), dict(return_lse=True),
             dict(backend="naive", return_lse=True)]
    for options in cases:
        call_memo.clear()
        full = attnx.attention(q, k, v, **options)
        attnx.attention(q, k, v, **options)             # the second time remembers the run
        assert len(call_memo.runs()) == 1, options
        again = attnx.attention(q, k, v, **options)     # and the third uses it
        for a, b in zip(*(r if isinstance(r, tuple) else (r,) for r in (full, again))):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    out = attnx.attention(qg, k, v)                     # needs gradients: another key, through autograd
    assert out.grad_fn is not None
    out.sum().backward()
    ref_q = q.clone().requires_grad_()
    attnx.attention(ref_q, k, v, backend="naive").sum().backward()
    torch.testing.assert_close(qg.grad, ref_q.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad, error", [
    (dict(backend=3), InvalidTypeError),
    (dict(backend="no-such-backend"), InvalidArgumentError),
    (dict(return_lse="yes"), InvalidTypeError),
    (dict(return_lse=1), InvalidTypeError),
])
def test_a_remembered_run_still_checks_backend_and_return_lse(bad, error):
    q, k, v = _qkv()
    attnx.attention(q, k, v)
    attnx.attention(q, k, v)
    with pytest.raises(error):
        attnx.attention(q, k, v, **bad)


def test_a_run_is_remembered_from_the_second_call_on():
    """A decode loop whose Sk grows never repeats a signature: it pays for no Run."""
    q = torch.randn(1, 2, 1, 8)
    cache = torch.randn(1, 2, 40, 8)
    for sk in range(20, 40):
        attnx.attention(q, cache[:, :, :sk], cache[:, :, :sk])
    assert not call_memo.runs() and len(call_memo._memo) == 20
    attnx.attention(q, cache[:, :, :20], cache[:, :, :20])
    assert len(call_memo.runs()) == 1


def test_empty_calls_are_not_remembered_as_runs():
    q, k, v = (torch.randn(2, 4, 0, 8) for _ in range(3))
    for _ in range(3):
        assert attnx.attention(q, k, v).shape == (2, 4, 0, 8)
    assert not call_memo.runs()


class _LseOnDemand:
    """Stands in for a backend that skips lse when the caller does not use it (the torch backend's cuDNN)."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def dense_forward(self, p):
        return None  # not the inner backend's: every call runs `forward` below

    def forward(self, p, x):
        self.seen.append(p.wants_lse)
        out, lse = self.inner.forward(p, x)
        return out, (lse if p.wants_lse else None)


def test_wants_lse_follows_return_lse_and_is_part_of_the_key(monkeypatch):
    """`Problem.wants_lse` is False only for a call that neither returns lse nor needs gradients; a
    remembered call without lse never answers a call that asks for it (nor the other way round)."""
    from attnx import api, dispatch

    q, k, v = _qkv()
    assert attnx.explain(q, k, v).problem.wants_lse is False
    assert attnx.explain(q, k, v, return_lse=True).problem.wants_lse is True
    qg, kg, vg = _qkv(requires_grad=True)
    assert attnx.explain(qg, kg, vg).problem.wants_lse is True  # a backward needs it
    assert attnx.plan(q, k, v).problem.wants_lse is False
    chosen = dispatch.choose(attnx.explain(q, k, v).problem)
    stand_in = _LseOnDemand(chosen)
    monkeypatch.setattr(api, "choose", lambda p, backend=None: stand_in)
    for _ in range(3):  # first call, remembered Problem, remembered run
        for return_lse in (False, True):
            got = attnx.attention(q, k, v, return_lse=return_lse)
            if return_lse:
                out, lse = got
                assert lse is not None and lse.shape == (2, 4, 16)
            else:
                out = got
            assert torch.allclose(out, attnx.attention(q, k, v, backend="naive"), atol=1e-5)
    assert stand_in.seen and set(stand_in.seen) == {False, True}


def test_make_problem_wants_lse_must_be_a_bool():
    q, k, v = _qkv()
    assert attnx.make_problem(q, k, v).wants_lse is True
    assert attnx.make_problem(q, k, v, wants_lse=False).wants_lse is False
    with pytest.raises(InvalidTypeError, match="`wants_lse`"):
        attnx.make_problem(q, k, v, wants_lse="no")


def test_a_sparse_call_of_a_remembered_shape_is_validated():
    """The memo key holds the tensors' layouts: a sparse q, k, v of a shape whose plain call is remembered
    gets the full path's typed error naming `q`, not a kernel's RuntimeError."""
    q = torch.randn(1, 2, 3, 4)
    attnx.attention(q, q, q)
    attnx.attention(q, q, q)  # remembered, and from now on a Run
    sparse = q.to_sparse()
    with pytest.raises(attnx.InvalidTypeError, match="`q`"):
        attnx.attention(sparse, sparse, sparse)
