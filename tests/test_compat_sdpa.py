"""attnx.compat.scaled_dot_product_attention against torch's own function, and use_attnx_for_sdpa."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import attnx
from attnx.compat import CompatArgumentError, scaled_dot_product_attention, use_attnx_for_sdpa

TORCH_SDPA = F.scaled_dot_product_attention
F64 = dict(dtype=torch.float64)


def _rand(*shape, requires_grad=False):
    return torch.randn(*shape, **F64, requires_grad=requires_grad)


def _same(args, kwargs, backend="naive", grads=True):
    """attnx (forced onto `backend`) and torch give the same output and gradients in float64."""
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    with use_attnx_for_sdpa(backend=backend):
        got = F.scaled_dot_product_attention(*args, **kwargs)
    want = TORCH_SDPA(*args, **kwargs)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    if grads and leaves:
        dout = torch.randn_like(want)
        got_grads = torch.autograd.grad(got, leaves, dout)
        want_grads = torch.autograd.grad(want, leaves, dout)
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-10)


SHAPES = {  # name: (q shape, k shape, v shape, kwargs)
    "4d": ((2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 8), {}),
    "gqa": ((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), {"enable_gqa": True}),
    "mqa-broadcast": ((2, 4, 5, 8), (2, 1, 7, 8), (2, 1, 7, 8), {}),
    "one-query-head": ((2, 1, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8), {}),
    "batch-broadcast": ((1, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 8), {}),
    "3d": ((3, 5, 8), (3, 7, 8), (3, 7, 8), {}),
    "2d": ((5, 8), (7, 8), (7, 8), {}),
    "2d-query-3d-keys": ((5, 8), (3, 7, 8), (3, 7, 8), {}),
    "5d": ((2, 3, 4, 5, 8), (2, 3, 4, 7, 8), (2, 3, 4, 7, 8), {}),
    "dv-differs": ((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 3), {"enable_gqa": True}),
    "scale": ((2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 8), {"scale": 0.3}),
}


@pytest.mark.parametrize("name", SHAPES)
def test_shapes_and_broadcasting_match_torch(name):
    qs, ks, vs, kwargs = SHAPES[name]
    _same((_rand(*qs, requires_grad=True), _rand(*ks, requires_grad=True), _rand(*vs, requires_grad=True)), kwargs)


@pytest.mark.parametrize("sq, sk", [(5, 5), (3, 9), (9, 4)])
def test_is_causal_is_top_left(sq, sk):
    q, k, v = _rand(2, 3, sq, 8, requires_grad=True), _rand(2, 3, sk, 8), _rand(2, 3, sk, 8)
    _same((q, k, v), {"is_causal": True})


@pytest.mark.parametrize("mask_shape", [(5, 7), (4, 5, 7), (2, 1, 5, 7), (2, 4, 5, 7), (1, 1, 1, 7)])
@pytest.mark.parametrize("kind", ["bool", "float32", "query-dtype"])
def test_masks_broadcast_as_in_torch(mask_shape, kind):
    q, k, v = _rand(2, 4, 5, 8, requires_grad=True), _rand(2, 4, 7, 8, requires_grad=True), _rand(2, 4, 7, 8)
    if kind == "bool":
        mask = torch.rand(mask_shape) > 0.3
        mask[..., 0] = True  # no fully masked rows here (see test_fully_masked_rows)
    else:
        mask = torch.randn(mask_shape, dtype=torch.float32 if kind == "float32" else torch.float64)
    _same((q, k, v), {"attn_mask": mask})


def test_five_dim_inputs_with_a_mask():
    q, k, v = _rand(2, 3, 4, 5, 8), _rand(2, 3, 4, 7, 8), _rand(2, 3, 4, 7, 8)
    mask = torch.rand(3, 1, 5, 7) > 0.3
    mask[..., 0] = True
    _same((q, k, v), {"attn_mask": mask})


def test_positional_mask_and_dropout_zero_positional_arguments():
    q, k, v = _rand(1, 2, 4, 8), _rand(1, 2, 6, 8), _rand(1, 2, 6, 8)
    mask = torch.ones(4, 6, dtype=torch.bool).tril(2)
    _same((q, k, v, mask, 0.0, False), {})


def test_fully_masked_rows_are_zero():
    q, k, v = _rand(1, 2, 4, 8), _rand(1, 2, 6, 8), _rand(1, 2, 6, 8)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1] = False
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.all(out[:, :, 1] == 0)
    assert not torch.isnan(out).any()


def test_the_signature_is_torchs():
    q, k, v = _rand(1, 2, 4, 8), _rand(1, 2, 6, 8), _rand(1, 2, 6, 8)
    with pytest.raises(TypeError):
        scaled_dot_product_attention(q, k, v, None, 0.0, False, 0.5)  # scale is keyword-only, as in torch


@pytest.mark.parametrize("case", ["dropout", "causal-and-mask", "mask-dtype", "mask-extra-dims", "mask-shape",
                                  "gqa-heads", "heads", "head-dims", "value-length"])
def test_errors_are_runtime_errors_as_in_torch(case):
    q, k, v = _rand(2, 4, 5, 8), _rand(2, 2, 7, 8), _rand(2, 2, 7, 8)
    kwargs = {"enable_gqa": True}
    if case == "dropout":
        kwargs["dropout_p"] = 0.1
    elif case == "causal-and-mask":
        kwargs.update(is_causal=True, attn_mask=torch.ones(5, 7, dtype=torch.bool))
    elif case == "mask-dtype":
        kwargs["attn_mask"] = torch.zeros(5, 7, dtype=torch.float16)
    elif case == "mask-extra-dims":  # a mask may not add dims to the scores (torch: RuntimeError)
        kwargs["attn_mask"] = torch.zeros(1, 1, 1, 5, 7, dtype=torch.float64)
    elif case == "mask-shape":  # raised by attnx.attention, turned into the compat error
        kwargs["attn_mask"] = torch.zeros(5, 6, dtype=torch.float64)
    elif case == "gqa-heads":
        k, v = _rand(2, 3, 7, 8), _rand(2, 3, 7, 8)
    elif case == "head-dims":
        k = _rand(2, 2, 7, 9)
    elif case == "value-length":
        v = _rand(2, 2, 6, 8)
    else:
        kwargs = {}  # 4 query heads, 2 kv heads and no enable_gqa
    with pytest.raises(CompatArgumentError) as info:
        scaled_dot_product_attention(q, k, v, **kwargs)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, attnx.InvalidArgumentError)


def test_dropout_error_says_what_to_do():
    q = _rand(1, 1, 2, 8)
    with pytest.raises(CompatArgumentError, match="dropout_p=0.5 is not supported"):
        scaled_dot_product_attention(q, q, q, dropout_p=0.5)


# -- use_attnx_for_sdpa -----------------------------------------------------------------------
def test_override_routes_calls_and_restores(ran):
    q = _rand(1, 2, 4, 8)
    with use_attnx_for_sdpa(backend="naive"):
        assert F.scaled_dot_product_attention is not TORCH_SDPA
        F.scaled_dot_product_attention(q, q, q)
    assert F.scaled_dot_product_attention is TORCH_SDPA
    assert ran == [("naive", "forward")]
    F.scaled_dot_product_attention(q, q, q)
    assert ran == [("naive", "forward")]


def test_override_restores_on_exception():
    with pytest.raises(ZeroDivisionError):
        with use_attnx_for_sdpa():
            1 / 0
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_override_nests_innermost_backend_wins(ran):
    q = _rand(1, 2, 4, 8)
    with use_attnx_for_sdpa(backend="naive"):
        with use_attnx_for_sdpa(backend="blocked"):
            F.scaled_dot_product_attention(q, q, q)
        assert F.scaled_dot_product_attention is not TORCH_SDPA
        F.scaled_dot_product_attention(q, q, q)
    assert F.scaled_dot_product_attention is TORCH_SDPA
    assert ran == [("blocked", "forward"), ("naive", "forward")]


def test_override_is_per_thread(ran):
    q = _rand(1, 2, 4, 8)
    inside, outside_done = threading.Event(), threading.Event()

    def other_thread():
        inside.wait()
        F.scaled_dot_product_attention(q, q, q)  # the block is open in the main thread only
        outside_done.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with use_attnx_for_sdpa(backend="naive"):
        inside.set()
        assert outside_done.wait(10)
        F.scaled_dot_product_attention(q, q, q)
    worker.join()
    assert ran == [("naive", "forward")]


def test_override_reaches_module_code(ran):
    class Attention(torch.nn.Module):  # the common pattern: looks the function up on F at call time
        def forward(self, x):
            b, t, _ = x.shape
            q = x.view(b, t, 2, 4).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(b, t, 8)

    x = _rand(2, 6, 8, requires_grad=True)
    want = Attention()(x)
    with use_attnx_for_sdpa(backend="naive"):
        got = Attention()(x)
        got.sum().backward()
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    assert ("naive", "forward") in ran and ("naive", "backward") in ran


def test_override_rejects_unknown_backend():
    with pytest.raises(attnx.InvalidArgumentError):
        with use_attnx_for_sdpa(backend="no-such-backend"):
            pass
    assert F.scaled_dot_product_attention is TORCH_SDPA
