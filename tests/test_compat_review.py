"""Regression tests for defects found reviewing attnx.compat against torch's SDPA and flash-attn 2.x."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn.attention.bias
import torch.nn.functional as F

import attnx
import attnx.compat.flash_attn as flash_attn
import attnx.compat.sdpa_override as sdpa_override
from attnx.compat import CompatArgumentError, scaled_dot_product_attention, use_attnx_for_sdpa
from attnx.compat.errors import CompatTypeError

TORCH_SDPA = F.scaled_dot_product_attention
F64 = torch.float64
TOL = dict(atol=1e-10, rtol=1e-10)


def _rand(*shape, requires_grad=False):
    return torch.randn(*shape, dtype=F64, requires_grad=requires_grad)


def _same_as_torch(args, kwargs, want_args=None, backend="naive"):
    """attnx and torch (on ``want_args`` if given) give the same output and gradients in float64."""
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    with use_attnx_for_sdpa(backend=backend):
        got = F.scaled_dot_product_attention(*args, **kwargs)
    want = TORCH_SDPA(*(want_args or args), **kwargs)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL)
    if leaves and want.numel():
        dout = torch.randn_like(want)
        for g, w in zip(torch.autograd.grad(got, leaves, dout), torch.autograd.grad(want, leaves, dout)):
            torch.testing.assert_close(g, w, **TOL)


# -- SDPA: broadcasting torch accepts -----------------------------------------------------------
@pytest.mark.parametrize("mask", [torch.tensor([True, False, True, True, False, True, True]),
                                  torch.randn(7, dtype=F64), torch.tensor(0.5, dtype=F64)])
def test_one_dim_and_scalar_masks_broadcast(mask):
    """A (S,) or 0-D mask broadcasts to the scores (torch's documented rule) instead of being rejected."""
    q, k, v = _rand(3, 5, 8, requires_grad=True), _rand(3, 7, 8, requires_grad=True), _rand(3, 7, 8)
    _same_as_torch((q, k, v, mask), {})  # torch takes these with 3-D inputs
    q4, k4, v4 = _rand(2, 3, 5, 8), _rand(2, 3, 7, 8), _rand(2, 3, 7, 8)
    want = TORCH_SDPA(q4, k4, v4, attn_mask=mask.expand(5, 7))  # torch's 4-D kernel raises IndexError here
    torch.testing.assert_close(scaled_dot_product_attention(q4, k4, v4, attn_mask=mask), want, **TOL)


@pytest.mark.parametrize("shapes", [((3, 5, 8), (1, 3, 1, 7)), ((5, 8), (1, 5, 7)), ((5, 8), (1, 1, 1, 1))])
def test_a_mask_may_not_add_dims_to_the_scores(shapes):
    """torch raises a RuntimeError when the mask has more dims than the scores; attnx used to broadcast it."""
    q_shape, mask_shape = shapes
    q = _rand(*q_shape)
    mask = torch.zeros(mask_shape, dtype=F64)
    with pytest.raises(RuntimeError):
        TORCH_SDPA(q, q, q, attn_mask=mask)
    with pytest.raises(CompatArgumentError, match="attn_mask"):
        scaled_dot_product_attention(q, q, q, attn_mask=mask)


@pytest.mark.parametrize("heads, enable_gqa", [((4, 1, 4), False), ((1, 4, 1), False), ((4, 2, 1), True),
                                               ((4, 2, 4), True), ((6, 3, 2), True)])
def test_key_and_value_head_counts_may_differ(heads, enable_gqa):
    """torch broadcasts (or, with enable_gqa, repeats) key and value heads separately."""
    hq, hk, hv = heads
    q, k, v = _rand(2, hq, 5, 8, requires_grad=True), _rand(2, hk, 7, 8, requires_grad=True), \
        _rand(2, hv, 7, 8, requires_grad=True)
    _same_as_torch((q, k, v), {"enable_gqa": enable_gqa})
    _same_as_torch((q, k, v), {"enable_gqa": enable_gqa, "is_causal": True})


@pytest.mark.parametrize("dims", [(0, 4), (4, 0), (0, 0)])
@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True}, {"attn_mask": "bool"}])
def test_empty_head_dims(dims, kwargs):
    """E = 0 (every score 0) and Ev = 0 (an empty output) are computed as torch does, not rejected."""
    e, ev = dims
    q, k, v = _rand(2, 3, 5, e, requires_grad=True), _rand(2, 3, 7, e, requires_grad=True), \
        _rand(2, 3, 7, ev, requires_grad=True)
    if kwargs.get("attn_mask") == "bool":
        mask = torch.rand(5, 7) > 0.4
        mask[:, 0] = True
        kwargs = {"attn_mask": mask}
    _same_as_torch((q, k, v), kwargs)


@pytest.mark.parametrize("kwargs", [{"scale": np.float32(0.25)}, {"scale": torch.tensor(0.25)},
                                    {"scale": np.int64(1)}, {"dropout_p": np.float32(0.0)},
                                    {"dropout_p": torch.tensor(0.0)}, {"dropout_p": False}])
def test_numbers_torch_accepts(kwargs):
    """NumPy numbers, 0-dim tensors and bools are floats to torch's argument parser."""
    _same_as_torch((_rand(2, 3, 5, 8), _rand(2, 3, 7, 8), _rand(2, 3, 7, 8)), kwargs)


def test_a_non_zero_dropout_given_as_a_tensor_is_still_refused():
    q = _rand(1, 1, 2, 8)
    with pytest.raises(CompatArgumentError, match="dropout_p"):
        scaled_dot_product_attention(q, q, q, dropout_p=torch.tensor(0.1))


@pytest.mark.parametrize("case", ["mixed", "integer"])
def test_dtype_errors_are_runtime_errors_as_in_torch(case):
    """torch raises RuntimeError for these; attnx's InvalidTypeError alone escaped `except RuntimeError`."""
    q = _rand(1, 2, 4, 8)
    k = q.float() if case == "mixed" else torch.ones(1, 2, 4, 8, dtype=torch.int64)
    if case == "integer":
        q = k
    with pytest.raises(RuntimeError):
        TORCH_SDPA(q, k, k)
    with pytest.raises(CompatTypeError) as info:
        scaled_dot_product_attention(q, k, k)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, attnx.InvalidTypeError)


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")  # torch's, for sq > sk
@pytest.mark.parametrize("variant", ["causal_lower_right", "causal_upper_left"])
@pytest.mark.parametrize("sq, sk", [(3, 5), (4, 4), (6, 3)])
def test_torch_causal_bias_masks(variant, sq, sk):
    """torch.nn.attention.bias masks were read as plain float masks: their data is not the mask (wrong output)."""
    bias = getattr(torch.nn.attention.bias, variant)(sq, sk)
    q, k, v = _rand(2, 4, sq, 8, requires_grad=True), _rand(2, 2, sk, 8, requires_grad=True), _rand(2, 2, sk, 8)
    _same_as_torch((q, k, v, bias), {"enable_gqa": True})
    _same_as_torch((q, k, v, bias), {"enable_gqa": True}, backend="blocked")


def test_torch_causal_bias_errors():
    q = _rand(1, 2, 3, 8)
    with pytest.raises(CompatArgumentError, match="causal=True"):
        scaled_dot_product_attention(q, q, q, attn_mask=torch.nn.attention.bias.causal_upper_left(3, 3), is_causal=True)
    with pytest.raises(CompatArgumentError, match="CausalBias"):
        scaled_dot_product_attention(q, q, q, attn_mask=torch.nn.attention.bias.causal_lower_right(3, 4))


# -- use_attnx_for_sdpa: blocks of two threads closing out of order -------------------------------
def _interleaved_blocks(check_inside_b):
    """Thread A opens a block, then thread B; A closes first; ``check_inside_b()`` runs in B afterwards."""
    a_open, b_open, a_closed = threading.Event(), threading.Event(), threading.Event()
    errors = []

    def thread_a():
        with use_attnx_for_sdpa(backend="naive"):
            a_open.set()
            b_open.wait(10)
        a_closed.set()

    def thread_b():
        a_open.wait(10)
        try:
            with use_attnx_for_sdpa(backend="naive"):
                b_open.set()
                a_closed.wait(10)
                check_inside_b()
        except Exception as err:  # noqa: BLE001 - reported in the main thread
            errors.append(err)

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]


def test_blocks_closing_out_of_order_keep_the_compile_route():
    """A's close used to put back the route seen before A (None) while B was still open, and B's close
    then left A's closed route behind: graphs traced in B after A closed called torch's function."""
    seen = []
    _interleaved_blocks(lambda: seen.append(sdpa_override._traced_route))
    assert seen == [{"backend": "naive"}]
    assert sdpa_override._traced_route is None and sdpa_override._open_routes == []
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_graph_traced_in_a_block_open_after_another_thread_closed_its_block_calls_attnx(ran):
    q = _rand(1, 2, 4, 8)

    def attend(x):
        return F.scaled_dot_product_attention(x, x, x, is_causal=True)

    outputs = []
    _interleaved_blocks(lambda: outputs.append(torch.compile(attend, backend="eager", fullgraph=True)(q)))
    torch.testing.assert_close(outputs[0], TORCH_SDPA(q, q, q, is_causal=True), **TOL)
    assert ("naive", "forward") in ran


# -- flash-attn -----------------------------------------------------------------------------------
def _bshd(b, s, h, d=8):
    return torch.randn(b, s, h, d, dtype=F64)


def test_flash_attn_takes_numpy_numbers():
    """flash-attn's float and int arguments take NumPy scalars (pybind converts them)."""
    q, k, v = _bshd(2, 5, 4), _bshd(2, 7, 2), _bshd(2, 7, 2)
    want = flash_attn.flash_attn_func(q, k, v, softmax_scale=0.25, softcap=3.0)
    got = flash_attn.flash_attn_func(q, k, v, dropout_p=np.float32(0), softmax_scale=np.float32(0.25),
                                     softcap=np.float32(3))
    torch.testing.assert_close(got, want, **TOL)
    k_cache, v_cache = k.clone(), v.clone()
    out = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.int32(7), num_splits=np.int64(2),
                                             softmax_scale=np.float64(0.25), softcap=3.0)
    torch.testing.assert_close(out, want, **TOL)


KVCACHE_ERRORS = {  # name: (keyword overrides, the typed error); every one is raised before the caches are written
    "q dtype": ({"q": torch.randn(2, 1, 4, 8)}, attnx.InvalidTypeError),
    "q head dim": ({"q": _bshd(2, 1, 4, 6)}, attnx.InvalidArgumentError),
    "q heads": ({"q": _bshd(2, 1, 3)}, attnx.InvalidArgumentError),
    "alibi shape": ({"alibi_slopes": torch.rand(3)}, attnx.InvalidArgumentError),
    "new v head dim": ({"v": _bshd(2, 1, 2, 4)}, attnx.InvalidArgumentError),
    "v_cache length": ({"v_cache": torch.zeros(3, 5, 2, 8, dtype=F64)}, attnx.InvalidArgumentError),
    "k_cache rank": ({"k_cache": torch.zeros(6, 2, 8, dtype=F64)}, attnx.InvalidArgumentError),
    "v_cache rank": ({"v_cache": torch.zeros(3, 6, 16, dtype=F64)}, attnx.InvalidArgumentError),
    "k_cache not a tensor": ({"k_cache": [[0.0]]}, attnx.InvalidTypeError),  # was AttributeError
}


@pytest.mark.parametrize("by_rows", [False, True])
@pytest.mark.parametrize("name", KVCACHE_ERRORS)
def test_kvcache_error_leaves_the_caches_unchanged(name, by_rows):
    """New keys used to be written before attention checked the call: an error left them in the cache."""
    overrides, error = KVCACHE_ERRORS[name]
    call = dict(q=_bshd(2, 1, 4), k_cache=torch.zeros(3, 6, 2, 8, dtype=F64),
                v_cache=torch.zeros(3, 6, 2, 8, dtype=F64),
                k=_bshd(2, 1, 2), v=_bshd(2, 1, 2), cache_seqlens=2,
                cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32) if by_rows else None)
    call.update(overrides)
    if not by_rows and isinstance(call["k_cache"], torch.Tensor) and call["k_cache"].dim() == 4:
        call["k_cache"], call["v_cache"] = call["k_cache"][:2], call["v_cache"][:2]
    before = [torch.as_tensor(call[name]).clone() for name in ("k_cache", "v_cache")]
    with pytest.raises(error, match="k_cache|v_cache" if "rank" in name or "tensor" in name else None):
        flash_attn.flash_attn_with_kvcache(**call)
    assert torch.equal(torch.as_tensor(call["k_cache"]), before[0])
    assert torch.equal(torch.as_tensor(call["v_cache"]), before[1])


def test_kvcache_paged_error_leaves_the_pool_unchanged():
    pool_k, pool_v = torch.zeros(4, 2, 2, 8, dtype=F64), torch.zeros(4, 2, 2, 8, dtype=F64)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(attnx.InvalidTypeError):
        flash_attn.flash_attn_with_kvcache(torch.randn(2, 1, 4, 8), pool_k, pool_v, _bshd(2, 1, 2), _bshd(2, 1, 2),
                                           cache_seqlens=1, block_table=table)
    assert not pool_k.any() and not pool_v.any()


def test_kvcache_block_table_not_a_tensor_is_a_typed_error():
    """Without new keys a list block_table used to raise AttributeError (block_table.shape)."""
    pool = torch.zeros(4, 2, 2, 8, dtype=F64)
    with pytest.raises(attnx.InvalidTypeError, match="block_table"):
        flash_attn.flash_attn_with_kvcache(_bshd(2, 1, 4), pool, pool, block_table=[[0, 1], [2, 3]])


@pytest.mark.parametrize("layout", ["dense", "rows", "paged"])
def test_kvcache_gradients_reach_the_new_keys(layout):
    """New k/v are written in place under no_grad; their gradients used to be silently None."""
    q = _bshd(2, 3, 4).requires_grad_()
    old_k, old_v = _bshd(2, 10, 2), _bshd(2, 10, 2)
    new_k, new_v = _bshd(2, 2, 2).requires_grad_(), _bshd(2, 2, 2).requires_grad_()
    extra = {}
    if layout == "paged":
        k_cache, v_cache = old_k.reshape(10, 2, 2, 8).clone(), old_v.reshape(10, 2, 2, 8).clone()
        extra["block_table"] = torch.arange(10, dtype=torch.int32).reshape(2, 5)
    elif layout == "rows":  # sequence b lives in cache row 1 - b
        k_cache, v_cache = old_k.flip(0).clone(), old_v.flip(0).clone()
        extra["cache_batch_idx"] = torch.tensor([1, 0], dtype=torch.int32)
    else:
        k_cache, v_cache = old_k.clone(), old_v.clone()
    got = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, new_k, new_v, cache_seqlens=5, causal=True, **extra)
    want = flash_attn.flash_attn_func(q, torch.cat([old_k[:, :5], new_k], 1), torch.cat([old_v[:, :5], new_v], 1),
                                      causal=True)
    torch.testing.assert_close(got, want, **TOL)
    dout = torch.randn_like(want)
    leaves = (q, new_k, new_v)
    for g, w in zip(torch.autograd.grad(got, leaves, dout), torch.autograd.grad(want, leaves, dout)):
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.parametrize("cu_seqlens_k, error", [
    (torch.tensor(3, dtype=torch.int32), attnx.InvalidArgumentError),   # was a raw IndexError
    (torch.tensor([[0, 3, 4]], dtype=torch.int32), attnx.InvalidArgumentError),
    (torch.tensor([0.0, 3.0, 4.0]), attnx.InvalidTypeError),             # was silently truncated to int32
    (torch.tensor([0, 3, 4]), attnx.InvalidTypeError),                   # int64: refused as without block_table
])
def test_varlen_block_table_checks_cu_seqlens_k(cu_seqlens_k, error):
    q, pool = torch.randn(5, 4, 8), torch.randn(4, 2, 2, 8)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(error, match="cu_seqlens_k"):
        flash_attn.flash_attn_varlen_func(q, pool, pool, torch.tensor([0, 2, 5], dtype=torch.int32), cu_seqlens_k,
                                          3, 4, block_table=table)


def test_flash_attn_with_kvcache_refuses_caches_that_share_memory_before_writing():
    """One tensor as both caches (or overlapping views): the new values would overwrite the new keys."""
    cache = torch.randn(2, 8, 2, 8, dtype=F64)
    before = cache.clone()
    with pytest.raises(attnx.InvalidArgumentError, match="share memory"):
        flash_attn.flash_attn_with_kvcache(_bshd(2, 1, 2), cache, cache, _bshd(2, 1, 2), _bshd(2, 1, 2),
                                           cache_seqlens=1)
    assert torch.equal(cache, before)
    kv = torch.randn(2, 8, 2, 2, 8, dtype=F64)  # a packed kv buffer: disjoint views, as flash-attn's kvpacked callers hold
    out = flash_attn.flash_attn_with_kvcache(_bshd(2, 1, 2), kv[:, :, 0], kv[:, :, 1], _bshd(2, 1, 2),
                                             _bshd(2, 1, 2), cache_seqlens=1)
    assert out.shape == (2, 1, 2, 8)
    # read-only calls may pass one tensor for both (nothing is written)
    flash_attn.flash_attn_with_kvcache(_bshd(2, 1, 2), cache, cache, cache_seqlens=3)


def test_flash_attn_with_kvcache_new_keys_must_have_the_cache_dtype():
    k_cache, v_cache = torch.randn(2, 8, 2, 8), torch.randn(2, 8, 2, 8)
    before = k_cache.clone()
    with pytest.raises(attnx.InvalidArgumentError, match="cache's dtype"):
        flash_attn.flash_attn_with_kvcache(_bshd(2, 1, 2).float(), k_cache, v_cache, _bshd(2, 1, 2),
                                           _bshd(2, 1, 2), cache_seqlens=1)
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize("name", ["cache_seqlens", "cache_batch_idx"])
def test_flash_attn_with_kvcache_meta_index_tensors_are_typed_errors(name):
    k_cache, v_cache = torch.randn(3, 8, 2, 8, dtype=F64), torch.randn(3, 8, 2, 8, dtype=F64)
    call = dict(cache_seqlens=torch.tensor([1, 0, 2], dtype=torch.int32),
                cache_batch_idx=torch.tensor([2, 0, 1], dtype=torch.int32))
    call[name] = torch.empty(3, dtype=torch.int32, device="meta")
    with pytest.raises(attnx.InvalidArgumentError, match=f"`{name}` is a meta tensor"):
        flash_attn.flash_attn_with_kvcache(_bshd(3, 1, 2), k_cache, v_cache, _bshd(3, 1, 2), _bshd(3, 1, 2), **call)


def test_flash_attn_with_kvcache_cache_seqlens_true_is_not_a_length():
    with pytest.raises(attnx.InvalidTypeError, match="cache_seqlens"):
        flash_attn.flash_attn_with_kvcache(_bshd(2, 1, 2), torch.randn(2, 8, 2, 8, dtype=F64), torch.randn(2, 8, 2, 8, dtype=F64),
                                           cache_seqlens=True)
