"""attnx.compat.flash_attn: flash-attn 2.x's functions, checked through their own signatures against the oracle."""
from __future__ import annotations

import inspect

import pytest
import torch

import attnx
import attnx.compat.flash_attn as flash_attn
from attnx.compat import CompatArgumentError
from attnx.reference import attention_reference

F64 = torch.float64
TOL = dict(atol=1e-10, rtol=1e-10)


def oracle(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, alibi=None, scale=None):
    """flash-attn's documented function for one dense ``bshd`` batch, by the float64 formula: (out, lse)."""
    left, right = (None if w < 0 else w for w in window)
    if causal:
        right = 0 if right is None else min(right, 0)
    q, k, v = (t.transpose(1, 2).to(F64) for t in (q, k, v))
    out, lse = attention_reference(q, k, v, scale=scale or q.shape[-1] ** -0.5, softcap=softcap or None,
                                   alibi_slopes=alibi, window_left=left, window_right=right)
    return out.transpose(1, 2), lse


def _bshd(b, s, h, d=16, grad=False):
    return torch.randn(b, s, h, d, dtype=F64, requires_grad=grad)


# -- the signatures are flash-attn 2.x's ----------------------------------------------------
COMMON = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
          ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
SIGNATURES = {
    "flash_attn_func": ["q", "k", "v"] + COMMON,
    "flash_attn_kvpacked_func": ["q", "kv"] + COMMON,
    "flash_attn_qkvpacked_func": ["qkv"] + COMMON,
    "flash_attn_varlen_func": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]
    + COMMON + [("block_table", None)],
    "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]
    + COMMON,
    "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen"] + COMMON,
    "flash_attn_with_kvcache": ["q", "k_cache", "v_cache", ("k", None), ("v", None), ("rotary_cos", None),
                                ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None),
                                ("cache_leftpad", None), ("block_table", None), ("softmax_scale", None),
                                ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0),
                                ("rotary_interleaved", True), ("alibi_slopes", None), ("num_splits", 0),
                                ("return_softmax_lse", False)],
}


@pytest.mark.parametrize("name", SIGNATURES)
def test_signature_matches_flash_attn(name):
    params = list(inspect.signature(getattr(flash_attn, name)).parameters.values())
    want = [(p, inspect.Parameter.empty) if isinstance(p, str) else p for p in SIGNATURES[name]]
    assert [(p.name, p.default) for p in params] == want


# -- dense functions ---------------------------------------------------------------------------
FEATURES = {
    "plain": {},
    "causal-sq<sk": {"causal": True},
    "causal-sq>sk": {"causal": True, "swap": True},
    "window": {"window_size": (3, 2)},
    "window-causal": {"window_size": (4, -1), "causal": True},
    "window-left-only": {"window_size": (2, -1)},
    "softcap": {"softcap": 3.0},
    "alibi": {"alibi": True},
    "scale": {"softmax_scale": 0.7},
}


@pytest.mark.parametrize("feature", FEATURES)
def test_flash_attn_func_matches_the_documented_function(feature):
    opts = dict(FEATURES[feature])
    sq, sk = (9, 6) if opts.pop("swap", False) else (6, 9)
    q, k, v = _bshd(2, sq, 4, grad=True), _bshd(2, sk, 2, grad=True), _bshd(2, sk, 2, grad=True)
    alibi = torch.rand(2, 4) if opts.pop("alibi", False) else None
    out, lse, probs = flash_attn.flash_attn_func(q, k, v, alibi_slopes=alibi, return_attn_probs=True, **opts)
    ref_out, ref_lse = oracle(q, k, v, causal=opts.get("causal", False), window=opts.get("window_size", (-1, -1)),
                              softcap=opts.get("softcap", 0.0), alibi=alibi, scale=opts.get("softmax_scale"))
    assert probs is None and out.shape == q.shape and lse.shape == (2, 4, sq) and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, **TOL)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite].float())
    assert torch.all(lse[~finite] == float("-inf"))  # rows that see no key (flash-attn: +inf)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref_out, (q, k, v), dout)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


def test_packed_functions_equal_flash_attn_func_and_fill_packed_gradients():
    qkv = torch.randn(2, 7, 3, 4, 16, dtype=F64, requires_grad=True)
    out = flash_attn.flash_attn_qkvpacked_func(qkv, causal=True)
    ref = flash_attn.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    torch.testing.assert_close(out, ref, **TOL)
    out.sum().backward()
    assert qkv.grad.shape == qkv.shape and bool(qkv.grad[:, :, 2].abs().sum() > 0)

    q, kv = _bshd(2, 5, 4), torch.randn(2, 8, 2, 2, 16, dtype=F64, requires_grad=True)
    out = flash_attn.flash_attn_kvpacked_func(q, kv, window_size=(2, 1))
    torch.testing.assert_close(out, flash_attn.flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], window_size=(2, 1)),
                               **TOL)
    out.sum().backward()
    assert kv.grad.shape == kv.shape


# -- varlen -----------------------------------------------------------------------------------
def _packed(lengths, h, d=16):
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return torch.randn(int(cu[-1]), h, d, dtype=F64), cu


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (2, 1))])
def test_varlen_is_flash_attn_func_per_sequence(causal, window):
    q, cu_q = _packed([3, 0, 5], 4)
    k, cu_k = _packed([6, 2, 5], 2)
    v = torch.randn_like(k)
    out, lse, probs = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, causal=causal, window_size=window,
                                                        return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0]) and probs is None
    for b in range(3):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ref = flash_attn.flash_attn_func(q[qs][None], k[ks][None], v[ks][None], causal=causal, window_size=window)
        torch.testing.assert_close(out[qs], ref[0], **TOL)


def test_varlen_packed_variants():
    qkv = torch.randn(9, 3, 2, 16, dtype=F64)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    out = flash_attn.flash_attn_varlen_qkvpacked_func(qkv, cu, 5, causal=True)
    ref = flash_attn.flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, 5, 5, causal=True)
    torch.testing.assert_close(out, ref, **TOL)
    q, kv = torch.randn(9, 4, 16, dtype=F64), torch.randn(9, 2, 2, 16, dtype=F64)
    out = flash_attn.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 5, 5, softcap=2.0)
    torch.testing.assert_close(out, flash_attn.flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu, cu, 5, 5, softcap=2.0),
                               **TOL)


def test_varlen_with_block_table_reads_pages():
    page, lengths = 4, [5, 3]
    k_seqs = [torch.randn(n, 2, 16, dtype=F64) for n in lengths]
    v_seqs = [torch.randn(n, 2, 16, dtype=F64) for n in lengths]
    table = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32)
    k_pool, v_pool = torch.zeros(4, page, 2, 16, dtype=F64), torch.zeros(4, page, 2, 16, dtype=F64)
    for b, n in enumerate(lengths):
        for t in range(n):
            k_pool[table[b, t // page], t % page] = k_seqs[b][t]
            v_pool[table[b, t // page], t % page] = v_seqs[b][t]
    q, cu_q = _packed([2, 3], 4)
    cu_k = torch.tensor([0, 5, 8], dtype=torch.int32)
    out = flash_attn.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, 3, 5, causal=True, block_table=table)
    ref = flash_attn.flash_attn_varlen_func(q, torch.cat(k_seqs), torch.cat(v_seqs), cu_q, cu_k, 3, 5, causal=True)
    torch.testing.assert_close(out, ref, **TOL)


# -- kv cache ---------------------------------------------------------------------------------
def test_kvcache_dense_appends_in_place_then_attends():
    b, cap, hkv, h = 2, 10, 2, 4
    k_cache, v_cache = torch.zeros(b, cap, hkv, 16, dtype=F64), torch.zeros(b, cap, hkv, 16, dtype=F64)
    lengths = torch.tensor([3, 6], dtype=torch.int32)
    for i, n in enumerate(lengths.tolist()):
        k_cache[i, :n], v_cache[i, :n] = torch.randn(n, hkv, 16, dtype=F64), torch.randn(n, hkv, 16, dtype=F64)
    k_new, v_new, q = _bshd(b, 2, hkv), _bshd(b, 2, hkv), _bshd(b, 2, h)
    out, lse = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths,
                                                  causal=True, return_softmax_lse=True)
    assert lse.shape == (b, h, 2)
    for i, n in enumerate(lengths.tolist()):
        assert torch.equal(k_cache[i, n:n + 2], k_new[i]) and torch.equal(v_cache[i, n:n + 2], v_new[i])
        ref = flash_attn.flash_attn_func(q[i:i + 1], k_cache[i:i + 1, :n + 2], v_cache[i:i + 1, :n + 2], causal=True)
        torch.testing.assert_close(out[i:i + 1], ref, **TOL)


def test_kvcache_int_lengths_batch_index_and_no_new_keys():
    k_cache, v_cache = torch.randn(3, 8, 1, 16, dtype=F64), torch.randn(3, 8, 1, 16, dtype=F64)
    q = _bshd(2, 1, 2)
    index = torch.tensor([2, 0], dtype=torch.int32)
    out = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5, cache_batch_idx=index)
    for i, row in enumerate(index.tolist()):
        ref = flash_attn.flash_attn_func(q[i:i + 1], k_cache[row:row + 1, :5], v_cache[row:row + 1, :5])
        torch.testing.assert_close(out[i:i + 1], ref, **TOL)
    whole = flash_attn.flash_attn_with_kvcache(q, k_cache[:2], v_cache[:2])  # no lengths: the whole cache
    torch.testing.assert_close(whole, flash_attn.flash_attn_func(q, k_cache[:2], v_cache[:2]), **TOL)


def test_kvcache_paged():
    page, hkv = 4, 2
    table = torch.tensor([[3, 1, 4], [0, 2, 5]], dtype=torch.int32)
    k_pool, v_pool = torch.randn(6, page, hkv, 16, dtype=F64), torch.randn(6, page, hkv, 16, dtype=F64)
    lengths = torch.tensor([5, 2], dtype=torch.int32)
    k_new, v_new, q = _bshd(2, 3, hkv), _bshd(2, 3, hkv), _bshd(2, 3, 4)
    out = flash_attn.flash_attn_with_kvcache(q, k_pool, v_pool, k_new, v_new, cache_seqlens=lengths,
                                             block_table=table, causal=True, window_size=(3, -1))
    for b, n in enumerate(lengths.tolist()):
        rows = [(int(table[b, t // page]), t % page) for t in range(n + 3)]
        keys = torch.stack([k_pool[p, r] for p, r in rows])[None]
        values = torch.stack([v_pool[p, r] for p, r in rows])[None]
        torch.testing.assert_close(keys[0, n:], k_new[b])
        ref = flash_attn.flash_attn_func(q[b:b + 1], keys, values, causal=True, window_size=(3, -1))
        torch.testing.assert_close(out[b:b + 1], ref, **TOL)


@pytest.mark.parametrize("case", ["rotary", "leftpad", "overflow", "k-without-lengths"])
def test_kvcache_errors(case):
    k_cache, v_cache, q = torch.zeros(1, 4, 1, 16), torch.zeros(1, 4, 1, 16), torch.randn(1, 1, 1, 16)
    kwargs = {}
    if case == "rotary":
        kwargs = dict(rotary_cos=torch.ones(4, 8), rotary_sin=torch.zeros(4, 8))
    elif case == "leftpad":
        kwargs = dict(cache_leftpad=torch.zeros(1, dtype=torch.int32))
    elif case == "overflow":
        kwargs = dict(k=torch.randn(1, 2, 1, 16), v=torch.randn(1, 2, 1, 16), cache_seqlens=3)
    else:
        kwargs = dict(k=torch.randn(1, 1, 1, 16), v=torch.randn(1, 1, 1, 16))
    with pytest.raises(attnx.InvalidArgumentError):
        flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
    assert torch.all(k_cache == 0)  # nothing written before the error


# -- arguments attnx does not take -------------------------------------------------------------
def test_dropout_is_a_clear_error():
    q = _bshd(1, 4, 2)
    with pytest.raises(CompatArgumentError, match="dropout_p=0.1 is not supported"):
        flash_attn.flash_attn_func(q, q, q, dropout_p=0.1)


def test_deterministic_true_avoids_nondeterministic_backends(make_spy):
    loose = make_spy("loose", deterministic=False, priority={"*": 1000})
    q, k, v = _bshd(1, 4, 2, grad=True), _bshd(1, 4, 2, grad=True), _bshd(1, 4, 2, grad=True)
    with attnx.registered(loose):
        assert attnx.explain(q, k, v, layout="bshd").chosen == "loose"
        out = flash_attn.flash_attn_func(q, k, v, deterministic=True)
        out.sum().backward()
        flash_attn.flash_attn_func(q.detach(), k.detach(), v.detach(), deterministic=True)  # no grads: any backend
    assert loose.calls.count("forward") == 1
