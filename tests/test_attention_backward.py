"""attnx.attention_backward: a backend's backward from a given (out, lse), against autograd of attnx.attention.

The keys of each problem are cut in two blocks; each block's backward gets the out and lse of
the *whole* softmax (as ring attention gives it), so the blocks' dQ add up to the whole dQ and
each block's dK/dV are its rows of the whole dK/dV only if the backend uses the lse it is given.
Every registered backend that declares it does (`Backend.backward_uses_given_lse`) runs every
case it accepts on the CPU; triton runs through its interpreter in a subprocess.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnx
from attnx.backward_api import choose_backward

ROOT = Path(__file__).resolve().parent.parent
TOL = dict(atol=2e-5, rtol=2e-5)
SQ, SK, SPLIT = 40, 48, 20  # keys [0, SPLIT) and [SPLIT, SK) are the two blocks

# name -> options of the whole problem; "offset" is the aligned position of query 0
CASES = {
    "full_gqa": dict(heads_kv=2),
    "full_bshd": dict(layout="bshd"),
    "causal": dict(causal=True, offset=SK - SQ),
    "window_alibi_softcap_gqa": dict(window=(7, 3), offset=5, alibi=True, softcap=3.0, heads_kv=1),
    "causal_dv_differs": dict(causal=True, offset=0, head_dim_v=12),  # top-left: early rows see few keys
}


def _cpu_backends() -> list[str]:
    """Backends that run on CPU tensors here and say their backward uses a given float32 lse."""
    p = attnx.make_problem(torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8))
    p = p._replace(needs_grad=True)
    return [name for name, b in attnx.registered_backends().items()
            if torch.float32 in b.backward_uses_given_lse and not b.device_reasons(p) and b.available]


def _problem(case: dict, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    heads_q, heads_kv = 4, case.get("heads_kv", 4)
    dim, dim_v = 16, case.get("head_dim_v", 16)
    layout = case.get("layout", "bhsd")

    def rand(heads, length, width):
        t = torch.randn(2, heads, length, width, generator=g)
        return t.transpose(1, 2).contiguous() if layout == "bshd" else t

    q, k, v = rand(heads_q, SQ, dim), rand(heads_kv, SK, dim), rand(heads_kv, SK, dim_v)
    dout = rand(heads_q, SQ, dim_v)
    options = dict(causal=case.get("causal", False), window=case.get("window"), softcap=case.get("softcap"),
                   layout=layout)
    if case.get("alibi"):
        options["alibi_slopes"] = torch.rand(heads_q, generator=g) * 0.3
    return q, k, v, dout, options, case.get("offset")


def _whole(q, k, v, dout, options, offset):
    """out, lse and autograd's gradients of the whole problem (the naive backend: the formula)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attnx.attention(*leaves, offset=offset, backend="naive", return_lse=True, **options)
    grads = torch.autograd.grad(out, leaves, dout)
    return out.detach(), lse, grads


def _blocks(k, v, options, offset):
    """The two key blocks: (k, v, offset of the block) with global positions kept."""
    dim = 1 if options["layout"] == "bshd" else 2
    base = 0 if offset is None else offset
    for start, stop in ((0, SPLIT), (SPLIT, SK)):
        block_offset = None if offset is None else base - start
        yield start, stop, k.narrow(dim, start, stop - start), v.narrow(dim, start, stop - start), block_offset


def _split_backward(q, k, v, out, lse, dout, options, offset, backend):
    dim = 1 if options["layout"] == "bshd" else 2
    dq = torch.zeros_like(q)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    for start, stop, kb, vb, block_offset in _blocks(k, v, options, offset):
        g = attnx.attention_backward(q, kb, vb, out, lse, dout, offset=block_offset, backend=backend, **options)
        dq += g[0]
        dk.narrow(dim, start, stop - start).copy_(g[1])
        dv.narrow(dim, start, stop - start).copy_(g[2])
    return dq, dk, dv


def _declines(backend: str, q, k, v, options, offset) -> list[str]:
    """The backend's reasons to decline either block (empty: it runs both)."""
    reasons = []
    for _, _, kb, vb, block_offset in _blocks(k, v, options, offset):
        p = attnx.make_problem(q, kb, vb, offset=block_offset, **options)._replace(needs_grad=True)
        reasons += attnx.get_backend(backend).reasons(p)
    return reasons


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", _cpu_backends())
def test_blocks_with_the_global_lse_add_up_to_the_whole_gradient(backend, case):
    q, k, v, dout, options, offset = _problem(CASES[case])
    declined = _declines(backend, q, k, v, options, offset)
    if declined:
        pytest.skip(f"{backend} declines: " + "; ".join(sorted(set(declined))))
    out, lse, expected = _whole(q, k, v, dout, options, offset)
    got = _split_backward(q, k, v, out, lse, dout, options, offset, backend)
    for name, a, b in zip(("dq", "dk", "dv"), got, expected):
        torch.testing.assert_close(a, b, **TOL, msg=name)
    # the lse matters: each block's own (local) lse gives other gradients, so the test above can fail
    _, _, kb, vb, block_offset = next(_blocks(k, v, options, offset))
    local_lse = attnx.attention(q, kb, vb, offset=block_offset, backend="naive", return_lse=True, **options)[1]
    wrong = attnx.attention_backward(q, kb, vb, out, local_lse, dout, offset=block_offset, backend=backend,
                                     **options)
    assert not torch.allclose(wrong[2], expected[2].narrow(1 if options["layout"] == "bshd" else 2, 0, SPLIT),
                              **TOL)


@pytest.mark.parametrize("backend", _cpu_backends())
def test_blocks_in_bfloat16(backend):
    q, k, v, dout, options, offset = _problem(CASES["causal"], seed=5)
    q, k, v, dout = (t.to(torch.bfloat16) for t in (q, k, v, dout))
    declined = _declines(backend, q, k, v, options, offset)
    if declined:
        pytest.skip(f"{backend} declines: " + "; ".join(sorted(set(declined))))
    out, lse, expected = _whole(q, k, v, dout, options, offset)
    got = _split_backward(q, k, v, out, lse, dout, options, offset, backend)
    for name, a, b in zip(("dq", "dk", "dv"), got, expected):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2, msg=name)


@pytest.mark.parametrize("backend", _cpu_backends())
def test_whole_problem_with_sinks_equals_autograd(backend):
    q, k, v, dout, options, _ = _problem(dict(heads_kv=2, causal=True), seed=3)
    sinks = torch.randn(4)
    p = attnx.make_problem(q, k, v, sinks=sinks, **options)._replace(needs_grad=True)
    if attnx.get_backend(backend).reasons(p):
        pytest.skip(f"{backend} declines: " + "; ".join(attnx.get_backend(backend).reasons(p)))
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out, lse = attnx.attention(*leaves[:3], sinks=leaves[3], backend="naive", return_lse=True, **options)
    expected = torch.autograd.grad(out, leaves, dout)
    got = attnx.attention_backward(q, k, v, out.detach(), lse, dout, sinks=sinks, backend=backend, **options)
    assert len(got) == 4
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, expected):
        torch.testing.assert_close(a, b, **TOL, msg=name)


def test_dispatcher_skips_backends_that_recompute_the_lse(make_spy, clean_registry):
    q, k, v, dout, options, _ = _problem(CASES["full_gqa"])
    out, lse, expected = _whole(q, k, v, dout, options, None)
    spy = make_spy("lse_spy", backward_uses_given_lse=frozenset(), priority={"*": 1000})
    attnx.register_backend(spy)
    p = attnx.make_problem(q, k, v, **options)._replace(needs_grad=True)
    assert attnx.explain(q, k, v, **options).chosen == "lse_spy"  # the forward would run it ...
    assert choose_backward(p).name != "lse_spy"                    # ... the given-lse backward not
    with pytest.raises(attnx.NoBackendError, match="backward_uses_given_lse"):
        attnx.attention_backward(q, k, v, out, lse, dout, backend="lse_spy", **options)
    with pytest.raises(attnx.NoBackendError, match="recomputes the softmax normaliser"):
        attnx.attention_backward(q, k, v, out, lse, dout, backend="naive", **options)
    got = attnx.attention_backward(q, k, v, out, lse, dout, **options)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **TOL)


def test_float64_declines_by_default():
    q, k, v, dout, options, _ = _problem(CASES["full_gqa"])
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    out, lse = attnx.attention(q, k, v, return_lse=True, **options)
    with pytest.raises(attnx.NoBackendError, match="float64 backward recomputes"):
        attnx.attention_backward(q, k, v, out, lse, dout, **options)


def test_typed_errors_name_the_argument():
    q, k, v, dout, options, _ = _problem(CASES["full_gqa"])
    out, lse = attnx.attention(q, k, v, return_lse=True, **options)
    with pytest.raises(attnx.InvalidTypeError, match="`lse`"):
        attnx.attention_backward(q, k, v, out, lse.double(), dout, **options)
    with pytest.raises(attnx.InvalidArgumentError, match="`out`"):
        attnx.attention_backward(q, k, v, out[:, :, 1:], lse, dout, **options)
    with pytest.raises(attnx.InvalidArgumentError, match="`dout`"):
        attnx.attention_backward(q, k, v, out, lse, dout.transpose(1, 2), **options)
    with pytest.raises(attnx.InvalidTypeError, match="`out`"):
        attnx.attention_backward(q, k, v, out.tolist(), lse, dout, **options)
    with pytest.raises(attnx.InvalidArgumentError, match="backend"):
        attnx.attention_backward(q, k, v, out, lse, dout, backend="no-such-backend", **options)


def test_inputs_that_require_grad_are_left_alone():
    q, k, v, dout, options, _ = _problem(CASES["causal"])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attnx.attention(*leaves, return_lse=True, **options)
    grads = attnx.attention_backward(*leaves, out, lse, dout, **options)
    assert all(not g.requires_grad for g in grads) and all(t.grad is None for t in leaves)


def test_empty_problem_gives_zero_gradients():
    q, k, v = torch.randn(1, 2, 0, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    out, lse = attnx.attention(q, k, v, return_lse=True)
    dq, dk, dv = attnx.attention_backward(q, k, v, out, lse, torch.randn_like(out))
    assert dq.shape == q.shape and not dk.any() and not dv.any()


# -- triton, through its CPU interpreter (a fresh process: TRITON_INTERPRET is read at import) ------------
_TRITON_SCRIPT = """
import json, sys
import torch
sys.path.insert(0, {tests!r})
import test_attention_backward as t
errors = {{}}
for name, case in t.CASES.items():
    q, k, v, dout, options, offset = t._problem(case)
    declined = t._declines("triton", q, k, v, options, offset)
    if declined:
        errors[name] = "declined: " + "; ".join(declined)
        continue
    out, lse, expected = t._whole(q, k, v, dout, options, offset)
    got = t._split_backward(q, k, v, out, lse, dout, options, offset, "triton")
    errors[name] = max((a - b).abs().max().item() for a, b in zip(got, expected))
print("RESULT " + json.dumps(errors))
"""


@pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"), reason="triton not installed")
def test_triton_interpreter_blocks_add_up():
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = _TRITON_SCRIPT.format(tests=str(ROOT / "tests"))
    run = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-4000:]
    errors = json.loads(lines[-1][len("RESULT "):])
    computed = {name: err for name, err in errors.items() if not isinstance(err, str)}
    assert computed, errors
    assert all(err < 5e-5 for err in computed.values()), errors
