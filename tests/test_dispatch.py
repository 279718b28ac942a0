"""The dispatcher: explain, use_backend, ATTNX_BACKEND, forced backends, NoBackendError, the decision cache."""
from __future__ import annotations

import pytest
import torch

import attnx
from attnx import dispatch

F64_ONLY = {"dtypes": frozenset({torch.float64})}


def test_explain_reports_chosen_and_every_backend(clean_registry, make_spy, qkv):
    attnx.register_backend(make_spy("declines", **F64_ONLY))
    q, k, v = qkv()
    decision = attnx.explain(q, k, v, causal=True)
    assert decision.chosen in clean_registry
    assert set(decision.reasons) == set(attnx.registered_backends())
    assert decision.reasons[decision.chosen] == []
    assert decision.reasons["naive"] == []  # "would work"
    assert any("float32" in r for r in decision.reasons["declines"])
    text = str(decision)
    assert f"chosen: {decision.chosen}" in text and "declines" in text
    assert decision.problem.causal and decision.problem.window_right == 0


def test_explain_with_forced_backend(clean_registry, make_spy, qkv):
    q, k, v = qkv()
    assert attnx.explain(q, k, v, backend="naive").chosen == "naive"
    attnx.register_backend(make_spy("declines", **F64_ONLY))
    decision = attnx.explain(q, k, v, backend="declines")
    assert decision.chosen is None and decision.considered == ("declines",)
    with pytest.raises(ValueError, match="unknown backend"):
        attnx.explain(q, k, v, backend="no-such-backend")


def test_forcing_a_declining_backend_lists_its_reasons(clean_registry, make_spy, qkv):
    attnx.register_backend(make_spy("declines", **F64_ONLY))
    q, k, v = qkv()
    with pytest.raises(attnx.NoBackendError) as info:
        attnx.attention(q, k, v, backend="declines")
    assert "declines" in str(info.value) and "dtype float32 not supported" in str(info.value)
    assert list(info.value.reasons) == ["declines"]
    with pytest.raises(attnx.NoBackendError, match="dtype float32"), attnx.use_backend("declines"):
        attnx.attention(q, k, v)


def test_no_backend_accepts_lists_every_reason(clean_registry, make_spy, qkv):
    for name in clean_registry:
        attnx.unregister_backend(name)
    attnx.register_backend(make_spy("only64", **F64_ONLY))
    attnx.register_backend(make_spy("nogqa", supports_gqa=False))
    q, k, v = qkv(hq=4, hkv=2)
    with pytest.raises(attnx.NoBackendError) as info:
        attnx.attention(q, k, v)
    message = str(info.value)
    assert "no registered backend accepts" in message
    assert "only64" in message and "dtype float32" in message
    assert "nogqa" in message and "grouped-query" in message
    assert set(info.value.reasons) == {"only64", "nogqa"}


def test_use_backend_restricts_nests_and_restores(ran, qkv):
    q, k, v = qkv()
    attnx.attention(q, k, v)
    default = ran.pop()[0]
    other = "blocked" if default != "blocked" and "blocked" in attnx.registered_backends() else "naive"
    with attnx.use_backend(other):
        attnx.attention(q, k, v)
        assert ran.pop() == (other, "forward")
        with attnx.use_backend(default):
            attnx.attention(q, k, v)
            assert ran.pop() == (default, "forward")
        attnx.attention(q, k, v)
        assert ran.pop() == (other, "forward")
    attnx.attention(q, k, v)
    assert ran.pop() == (default, "forward")


def test_use_backend_restores_after_exception(ran):
    from attnx.selection import allowed_backends

    assert allowed_backends() is None
    with pytest.raises(RuntimeError, match="boom"):
        with attnx.use_backend("naive"):
            assert allowed_backends() == ("naive",)
            raise RuntimeError("boom")
    assert allowed_backends() is None


@pytest.mark.parametrize("names", ["naive,spy", ["naive", "spy"], ("spy", "naive")])
def test_use_backend_accepts_lists(names, clean_registry, make_spy, qkv):
    spy = attnx.register_backend(make_spy())
    q, k, v = qkv()
    with attnx.use_backend(names):
        decision = attnx.explain(q, k, v)
        assert set(decision.considered) == {"naive", "spy"}
        attnx.attention(q, k, v)
    assert decision.chosen == "naive"  # priority decides among the allowed, not the order given
    assert "forward" not in spy.calls


def test_use_backend_restriction_to_a_declining_backend(clean_registry, make_spy, qkv):
    attnx.register_backend(make_spy("declines", **F64_ONLY))
    q, k, v = qkv()
    with attnx.use_backend("declines"):
        with pytest.raises(attnx.NoBackendError, match="allowed backends"):
            attnx.attention(q, k, v)
        attnx.attention(*(t.double() for t in (q, k, v)))  # accepted in float64


def test_env_variable_restricts(monkeypatch, ran, qkv):
    q, k, v = qkv()
    attnx.attention(q, k, v)
    default = ran.pop()[0]
    other = "blocked" if default != "blocked" and "blocked" in attnx.registered_backends() else "naive"
    monkeypatch.setenv("ATTNX_BACKEND", other)
    attnx.attention(q, k, v)
    assert ran.pop() == (other, "forward")
    assert attnx.explain(q, k, v).considered == (other,)
    with attnx.use_backend(default):  # use_backend overrides the environment
        attnx.attention(q, k, v)
        assert ran.pop() == (default, "forward")
    monkeypatch.delenv("ATTNX_BACKEND")
    attnx.attention(q, k, v)
    assert ran.pop() == (default, "forward")


def test_forced_backend_beats_use_backend(ran, qkv):
    q, k, v = qkv()
    with attnx.use_backend("naive"):
        if "blocked" in attnx.registered_backends():
            attnx.attention(q, k, v, backend="blocked")
            assert ran.pop() == ("blocked", "forward")


def test_decision_is_cached_on_the_problem(clean_registry, make_spy, qkv):
    spy = attnx.register_backend(make_spy())
    q, k, v = qkv()
    p = attnx.make_problem(q, k, v)
    first = dispatch.choose(p, "spy")
    assert first is spy and spy.calls == ["reasons"]
    q2, k2, v2 = qkv()  # new tensors, same signature
    assert dispatch.choose(attnx.make_problem(q2, k2, v2), "spy") is first
    attnx.attention(q2, k2, v2, backend="spy", return_lse=True)  # (make_problem's Problem wants lse)
    assert spy.calls == ["reasons", "forward"]  # no second decision
    assert dispatch.choose(p) is dispatch.choose(attnx.make_problem(q2, k2, v2))
    decisions = spy.calls.count("reasons")
    # a different signature is a new decision
    dispatch.choose(attnx.make_problem(q[:, :, :4], k, v), "spy")
    assert spy.calls.count("reasons") == decisions + 1


def test_register_backend_clears_the_cache(clean_registry, make_spy, qkv):
    q, k, v = qkv()
    p = attnx.make_problem(q, k, v)
    before = dispatch.choose(p)
    replacement = attnx.register_backend(make_spy(before.name, priority={"*": 1000}))
    assert dispatch.choose(p) is replacement


def test_priority_prefers_naive_for_small_cpu_problems(qkv):
    q, k, v = qkv()
    small = attnx.make_problem(q, k, v)
    big = small._replace(seqlen_q=4096, seqlen_k=4096)
    order_small, order_big = dispatch.priority(small), dispatch.priority(big)
    if "blocked" in order_small:
        assert order_small.index("naive") < order_small.index("blocked")
        assert order_big.index("blocked") < order_big.index("naive")


def test_list_backends():
    listed = attnx.list_backends()
    names = [b["name"] for b in listed]
    assert "naive" in names and names == list(attnx.registered_backends())
    for entry in listed:
        assert set(entry) >= {"name", "available", "reasons", "description"}
        assert entry["available"] == (entry["reasons"] == [])
    naive = next(b for b in listed if b["name"] == "naive")
    assert naive["available"] and naive["reasons"] == []


def test_unavailable_backend_says_how_to_install(clean_registry, make_spy, qkv):
    missing = attnx.register_backend(make_spy("needs_pkg", required_modules=("attnx_no_such_module",),
                                              install_hint="pip install attnx-no-such-module"))
    assert not missing.available
    q, k, v = qkv()
    why = attnx.explain(q, k, v).reasons["needs_pkg"]
    assert any("attnx_no_such_module" in r and "pip install" in r for r in why)
    with pytest.raises(attnx.NoBackendError, match="not installed"):
        attnx.attention(q, k, v, backend="needs_pkg")


def test_deterministic_algorithms_decline_nondeterministic_backward(clean_registry, make_spy, qkv):
    attnx.register_backend(make_spy("atomics", deterministic=False))
    q, k, v = qkv(requires_grad=True)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(attnx.NoBackendError, match="not deterministic"):
            attnx.attention(q, k, v, backend="atomics")
        with torch.no_grad():  # forward alone has no atomics to worry about
            attnx.attention(q, k, v, backend="atomics")
        assert attnx.explain(q, k, v).chosen != "atomics"
    finally:
        torch.use_deterministic_algorithms(previous)
    assert attnx.explain(q, k, v, backend="atomics").chosen == "atomics"


def test_growing_decode_length_does_not_re_ask(clean_registry, make_spy):
    """Each new length asks the bucket's order from the top: the top backend accepts, the others are never
    asked."""
    chosen = attnx.register_backend(make_spy("chosen", priority={"*": 1000}))
    other = attnx.register_backend(make_spy("other", priority={"*": 999}))
    q = torch.randn(1, 2, 1, 16)
    for sk in range(1000, 1030):
        k = torch.randn(1, 2, sk, 16)
        attnx.attention(q, k, k)
    assert other.calls.count("reasons") == 0  # never asked: the chosen one accepted first
    assert chosen.calls.count("reasons") == 30 and chosen.calls.count("forward") == 30


def test_a_bucket_hit_the_chosen_backend_declines_is_decided_again(clean_registry, make_spy):
    """A backend whose limit hangs on an exact size (Sq == Sk) is never reused past it within a bucket."""
    def square_only(self, p):
        """Only Sq == Sk."""
        return [] if p.seqlen_q == p.seqlen_k else ["Sq != Sk"]

    square = attnx.register_backend(make_spy("square", priority={"*": 1000}, extra_reasons=square_only))
    q, k = torch.randn(1, 2, 500, 16), torch.randn(1, 2, 500, 16)
    attnx.attention(q, k, k, causal=True)
    assert square.calls.count("forward") == 1
    k2 = torch.randn(1, 2, 510, 16)  # same length bucket (512), Sq != Sk
    out = attnx.attention(q, k2, k2, causal=True)
    assert square.calls.count("forward") == 1  # another backend ran it
    torch.testing.assert_close(out, attnx.attention(q, k2, k2, causal=True, backend="naive"))


def test_the_backend_that_runs_does_not_depend_on_earlier_calls(clean_registry, make_spy):
    """Dispatch is a function of the signature (docs/semantics.md): within one length bucket, a length the
    top backend declines (Sq != Sk) must not change which backend runs a later length it accepts."""
    def square_only(self, p):
        """Only Sq == Sk."""
        return [] if p.seqlen_q == p.seqlen_k else ["Sq != Sk"]

    square = attnx.register_backend(make_spy("square", priority={"*": 1000}, extra_reasons=square_only))
    attnx.register_backend(make_spy("other", priority={"*": 999}))
    for sq, sk in ((500, 500), (500, 510), (505, 505)):  # one bucket (512 x 512)
        q, k = torch.randn(1, 2, sq, 16), torch.randn(1, 2, sk, 16)
        attnx.attention(q, k, k, causal=True)
    assert attnx.explain(q, k, k, causal=True).chosen == "square"
    assert square.calls.count("forward") == 2  # (500, 500) and (505, 505)


def test_priority_tables_order_backends(clean_registry, make_spy, qkv):
    q, k, v = qkv(sq=512, sk=512)  # large enough that naive's small-problem rule is off
    default = attnx.explain(q, k, v).chosen
    assert default in ("torch", "blocked")
    with attnx.registered(make_spy("third_party", priority={"cpu": 100, "*": 0})):
        assert attnx.explain(q, k, v).chosen == "third_party"
        p = attnx.make_problem(q, k, v)
        assert dispatch.priority(p)[0] == "third_party"
        # the most specific device class wins: "cpu:cpu" (arch) over "cpu" (device type)
        with attnx.registered(make_spy("by_arch", priority={"cpu:cpu": 200, "cpu": -1})):
            assert attnx.explain(q, k, v).chosen == "by_arch"
    assert "third_party" not in attnx.registered_backends()
    assert attnx.explain(q, k, v).chosen == default


def test_registered_restores_a_replaced_backend(clean_registry, make_spy, qkv):
    original = attnx.get_backend("naive")
    with attnx.registered(make_spy("naive")) as spy:
        assert attnx.get_backend("naive") is spy
    assert attnx.get_backend("naive") is original


def test_backends_decline_contract_features_they_do_not_declare(clean_registry, make_spy, qkv):
    """Offsets, sinks and new formats default to unsupported, so an older backend declines them."""
    spy = attnx.register_backend(make_spy())
    q, k, v = qkv()
    why = attnx.explain(q[:, :, :4], k, v, offset=0, sinks=torch.zeros(2)).reasons["spy"]
    assert any("offset" in r for r in why) and any("sinks" in r for r in why)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    packed = attnx.explain(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu_seqlens_q=cu,
                           cu_seqlens_k=cu).reasons["spy"]
    assert any("format q=varlen" in r for r in packed)
    assert "forward" not in spy.calls
