"""`attnx.KVCache`: append + attend over contiguous and paged caches against the naive oracle on the
full sequences computed densely; typed errors before any write; no host reads on the dense append path;
the serving page's examples run."""
import importlib.util
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

import attnx
from attnx import CacheCapacityError, InvalidArgumentError, InvalidTypeError, KVCache

PAGE = Path(__file__).resolve().parent.parent / "docs" / "serving.md"
KINDS = [None, 1, 16, 256]  # contiguous, then page sizes
KIND_IDS = ["contiguous", "page1", "page16", "page256"]


def _randn(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=torch.float64).to(dtype)


class Shadow:
    """The cache's contents kept densely per sequence: (Hkv, L, D) tensors, the oracle's input."""

    def __init__(self, batch, heads_kv, dim, dim_v, dtype):
        self.k = [torch.empty(heads_kv, 0, dim, dtype=dtype) for _ in range(batch)]
        self.v = [torch.empty(heads_kv, 0, dim_v, dtype=dtype) for _ in range(batch)]

    def add(self, b, k_bhsd, v_bhsd):  # (Hkv, n, D)
        self.k[b] = torch.cat([self.k[b], k_bhsd], dim=1)
        self.v[b] = torch.cat([self.v[b], v_bhsd], dim=1)

    def oracle(self, b, q_b, **options):  # q_b (Hq, n, D) -> (Hq, n, Dv), lse (Hq, n)
        out, lse = attnx.attention(q_b[None], self.k[b][None], self.v[b][None], backend="naive", return_lse=True,
                                   **options)
        return out[0], lse[0]


def _make(kind, batch=3, capacity=40, heads_kv=2, dim=16, dim_v=16, dtype=torch.float64):
    return KVCache.allocate(batch, capacity, heads_kv, dim, head_dim_v=dim_v, dtype=dtype, page_size=kind)


def _check_dense_step(cache, shadow, n, heads_q, layout, options, dtype=torch.float64):
    B, Hkv, D, Dv = cache.batch, cache.heads_kv, cache.head_dim, cache.head_dim_v
    q, k, v = (_randn(B, heads_q, n, D, dtype=dtype), _randn(B, Hkv, n, D, dtype=dtype),
               _randn(B, Hkv, n, Dv, dtype=dtype))
    for b in range(B):
        shadow.add(b, k[b], v[b])
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    out, lse = cache.attend(q, k, v, layout=layout, return_lse=True, **options)
    if layout == "bshd":
        out = out.transpose(1, 2)
        q = q.transpose(1, 2)
    assert torch.isfinite(out).all()
    for b in range(B):
        want, want_lse = shadow.oracle(b, q[b], **options)
        torch.testing.assert_close(out[b], want, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(lse[b], want_lse, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("heads", [(4, 2), (2, 2), (3, 1)], ids=["gqa", "mha", "mqa"])
def test_steps_of_append_and_attend_match_the_dense_oracle(kind, heads, layout):
    heads_q, heads_kv = heads
    torch.manual_seed(zlib.crc32(repr((kind, heads, layout)).encode()))
    cache = _make(kind, heads_kv=heads_kv, capacity=300 if kind == 256 else 40)
    shadow = Shadow(cache.batch, heads_kv, 16, 16, torch.float64)
    # a prefill chunk, then decode steps, then a short verify chunk (speculative decoding)
    for n in (5, 1, 1, 3, 1):
        _check_dense_step(cache, shadow, n, heads_q, layout, dict(causal=True))
    assert cache.seqlens == [11] * cache.batch
    assert cache.lengths.tolist() == [11] * cache.batch


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_packed_prefill_with_a_zero_length_sequence_then_decode(kind):
    """Different lengths per sequence (one empty) through packed new tokens; decode steps after."""
    torch.manual_seed(11)
    B, Hq, Hkv, D, Dv = 4, 4, 2, 16, 8
    cache = KVCache.allocate(B, 300 if kind == 256 else 24, Hkv, D, head_dim_v=Dv, dtype=torch.float64,
                             page_size=kind)
    shadow = Shadow(B, Hkv, D, Dv, torch.float64)
    counts = [3, 0, 7, 1]
    cu = torch.tensor([0, 3, 3, 10, 11], dtype=torch.int32)
    q, k, v = _randn(11, Hq, D), _randn(11, Hkv, D), _randn(11, Hkv, Dv)
    out, lse = cache.attend(q, k, v, cu_seqlens=cu, causal=True, return_lse=True)
    assert cache.seqlens == counts and cache.lengths.tolist() == counts
    assert torch.isfinite(out).all()
    for b in range(B):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        shadow.add(b, k[rows].transpose(0, 1), v[rows].transpose(0, 1))
        if counts[b]:
            want, want_lse = shadow.oracle(b, q[rows].transpose(0, 1), causal=True)
            torch.testing.assert_close(out[rows].transpose(0, 1), want, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(lse[:, rows], want_lse, rtol=1e-9, atol=1e-9)
    for n in (1, 1, 2):
        _check_dense_step(cache, shadow, n, Hq, "bhsd", dict(causal=True, window=(4, 0)))
    assert cache.seqlens == [c + 4 for c in counts]


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_attend_without_new_tokens_and_empty_sequences(kind):
    torch.manual_seed(3)
    cache = _make(kind, batch=3)
    k, v = _randn(2, 2, 5, 16), _randn(2, 2, 5, 16)
    # only sequences 0 and 2 get tokens: packed with an empty middle sequence
    cu = torch.tensor([0, 5, 5, 10], dtype=torch.int32)
    pk = torch.cat([k[0].transpose(0, 1), k[1].transpose(0, 1)])
    pv = torch.cat([v[0].transpose(0, 1), v[1].transpose(0, 1)])
    cache.append(pk, pv, cu_seqlens=cu)
    q = _randn(3, 4, 1, 16)
    out, lse = cache.attend(q, return_lse=True)
    assert torch.all(out[1] == 0) and torch.all(lse[1] == float("-inf"))
    for b, src in ((0, 0), (2, 1)):
        want = attnx.attention(q[b:b + 1], k[src:src + 1], v[src:src + 1], backend="naive")
        torch.testing.assert_close(out[b:b + 1], want, rtol=1e-9, atol=1e-9)
    # the whole cache empty: Sk = 0 for every sequence
    cache.reset()
    out, lse = cache.attend(q, return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


def test_permuted_page_table_wrapped_from_tensors():
    """A pool shared in a shuffled order (as a serving engine hands pages out), wrapped as a KVCache."""
    torch.manual_seed(5)
    B, Hkv, D, ps, pages_per = 3, 2, 8, 4, 3
    perm = torch.randperm(B * pages_per + 2)[:B * pages_per].to(torch.int32).reshape(B, pages_per)
    pool_k, pool_v = _randn(B * pages_per + 2, ps, Hkv, D), _randn(B * pages_per + 2, ps, Hkv, D)
    cache = KVCache(pool_k, pool_v, page_table=perm, lengths=[0, 0, 0])
    assert cache.capacity == pages_per * ps and cache.paged
    shadow = Shadow(B, Hkv, D, D, torch.float64)
    for n in (6, 1, 4, 1):
        _check_dense_step(cache, shadow, n, 4, "bhsd", dict(causal=True))
    for b in range(B):
        k_b, v_b = cache.sequence(b)
        torch.testing.assert_close(k_b, shadow.k[b], rtol=0, atol=0)
        torch.testing.assert_close(v_b, shadow.v[b], rtol=0, atol=0)


def test_wrapping_a_bhsd_cache_writes_through_the_view():
    torch.manual_seed(16)
    k_cache, v_cache = _randn(2, 2, 12, 16), _randn(2, 2, 12, 16)      # (B, Hkv, capacity, D)
    cache = KVCache(k_cache.transpose(1, 2), v_cache.transpose(1, 2), lengths=torch.tensor([4, 7], dtype=torch.int32))
    q, k, v = _randn(2, 4, 2, 16), _randn(2, 2, 2, 16), _randn(2, 2, 2, 16)
    out = cache.attend(q, k, v, causal=True)
    assert torch.equal(k_cache[0, :, 4:6], k[0]) and torch.equal(v_cache[1, :, 7:9], v[1])
    want = attnx.attention(q, k_cache, v_cache, seqlens_k=torch.tensor([6, 9], dtype=torch.int32), causal=True,
                           backend="naive")
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9)
    cache.set_lengths([9, 9])                                           # one length: the slice-copy path
    k1, v1 = _randn(2, 2, 1, 16), _randn(2, 2, 1, 16)
    cache.append(k1, v1)
    assert torch.equal(k_cache[:, :, 9], k1[:, :, 0]) and torch.equal(v_cache[:, :, 9], v1[:, :, 0])


def test_unequal_lengths_write_at_each_sequences_own_end():
    torch.manual_seed(6)
    for kind in (None, 16):
        cache = _make(kind, batch=3)
        prefix_k, prefix_v = _randn(3, 2, 9, 16), _randn(3, 2, 9, 16)
        cache.append(prefix_k, prefix_v)
        cache.set_lengths([2, 9, 0])
        shadow = Shadow(3, 2, 16, 16, torch.float64)
        for b, n in enumerate([2, 9, 0]):
            shadow.add(b, prefix_k[b, :, :n], prefix_v[b, :, :n])
        for n in (1, 2, 1):
            _check_dense_step(cache, shadow, n, 4, "bhsd", dict(causal=True))
        assert cache.seqlens == [6, 13, 4] and cache.lengths.tolist() == [6, 13, 4]


def test_inputs_work_with_attention_and_plan():
    torch.manual_seed(7)
    for kind in (None, 16):
        cache = _make(kind)
        cache.append(_randn(3, 2, 6, 16), _randn(3, 2, 6, 16))
        q = _randn(3, 4, 2, 16)
        direct = attnx.attention(q, **cache.inputs(), causal=True)
        torch.testing.assert_close(cache.attend(q, causal=True), direct, rtol=0, atol=0)
        step = attnx.plan(q, **cache.inputs(), causal=True)
        torch.testing.assert_close(step.run(q, **cache.inputs()), direct, rtol=0, atol=0)
        qs = q.transpose(1, 2).contiguous()
        bshd = attnx.attention(qs, **cache.inputs("bshd"), layout="bshd", causal=True)
        torch.testing.assert_close(bshd.transpose(1, 2), direct, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_cache_plan_decode_loop_matches_attend(kind):
    torch.manual_seed(8)
    a, b = _make(kind, dtype=torch.float32), _make(kind, dtype=torch.float32)
    q0 = torch.randn(3, 4, 1, 16)
    step = a.plan(q0, causal=True, return_lse=True)
    for _ in range(6):
        q, k, v = torch.randn(3, 4, 1, 16), torch.randn(3, 2, 1, 16), torch.randn(3, 2, 1, 16)
        out, lse = step.run(q, k, v)
        want, want_lse = b.attend(q, k, v, causal=True, return_lse=True)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    assert a.seqlens == [6] * 3
    with pytest.raises(InvalidArgumentError, match="`q`"):
        step.run(torch.randn(3, 4, 2, 16), torch.randn(3, 2, 2, 16), torch.randn(3, 2, 2, 16))
    assert a.seqlens == [6] * 3  # nothing appended by the refused call


def _fill(cache):
    """Random values in all of the storage (torch.empty may hold NaN, which no snapshot equals)."""
    cache.k.copy_(torch.randn_like(cache.k))
    cache.v.copy_(torch.randn_like(cache.v))
    return cache


def _snapshot(cache):
    return cache.k.clone(), cache.v.clone(), cache.lengths.clone(), cache.seqlens


def _unchanged(cache, snap):
    k, v, lengths, host = snap
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v)
    assert torch.equal(cache.lengths, lengths) and cache.seqlens == host


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_capacity_overflow_is_refused_before_any_write(kind):
    torch.manual_seed(9)
    cache = _fill(_make(kind, batch=2, capacity=8, dtype=torch.float32))
    cache.append(torch.randn(2, 2, cache.capacity - 1, 16), torch.randn(2, 2, cache.capacity - 1, 16))
    snap = _snapshot(cache)
    with pytest.raises(CacheCapacityError, match="capacity") as err:
        cache.append(torch.randn(2, 2, 2, 16), torch.randn(2, 2, 2, 16))
    assert isinstance(err.value, InvalidArgumentError) and "`k`" in str(err.value)
    _unchanged(cache, snap)
    with pytest.raises(CacheCapacityError):
        cache.attend(torch.randn(2, 4, 2, 16), torch.randn(2, 2, 2, 16), torch.randn(2, 2, 2, 16))
    _unchanged(cache, snap)
    cu = torch.tensor([0, 0, 2], dtype=torch.int32)   # only sequence 1 overflows
    with pytest.raises(CacheCapacityError, match="sequence 1"):
        cache.append(torch.randn(2, 2, 16), torch.randn(2, 2, 16), cu_seqlens=cu)
    _unchanged(cache, snap)
    cache.append(torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16))   # exactly full is fine
    assert cache.seqlens == [cache.capacity] * 2


def test_bad_new_tokens_name_the_argument_before_any_write():
    torch.manual_seed(10)
    cache = _fill(_make(16, batch=2, dtype=torch.float32))
    cache.append(torch.randn(2, 2, 3, 16), torch.randn(2, 2, 3, 16))
    snap = _snapshot(cache)
    good = torch.randn(2, 2, 1, 16)
    cases = [
        ((good.double(), good), InvalidTypeError, "`k`"),
        ((good, good.half()), InvalidTypeError, "`v`"),
        ((torch.randn(2, 3, 1, 16), good), InvalidArgumentError, "`k`"),
        ((good, torch.randn(2, 2, 1, 8)), InvalidArgumentError, "`v`"),
        ((good, torch.randn(2, 2, 2, 16)), InvalidArgumentError, "`v`"),
        ((torch.randn(3, 2, 1, 16), good), InvalidArgumentError, "`k`"),
        ((good[0], good), InvalidArgumentError, "`k`"),
        (([1.0], good), InvalidTypeError, "`k`"),
    ]
    for (k, v), error, name in cases:
        with pytest.raises(error, match=name):
            cache.append(k, v)
        _unchanged(cache, snap)
    with pytest.raises(InvalidArgumentError, match="`layout`"):
        cache.append(good, good, layout="sbhd")
    with pytest.raises(InvalidTypeError, match="`cu_seqlens`"):
        cache.append(good[0].transpose(0, 1), good[0].transpose(0, 1), cu_seqlens=torch.tensor([0, 1, 1]))
    with pytest.raises(InvalidArgumentError, match=r"`cu_seqlens`\[2\] = 0 < `cu_seqlens`\[1\] = 1"):
        cache.append(good[0].transpose(0, 1), good[0].transpose(0, 1),
                     cu_seqlens=torch.tensor([0, 1, 0], dtype=torch.int32))
    with pytest.raises(InvalidArgumentError, match=r"`cu_seqlens`\[2\] = 2, must equal .* \(`k` has 1 rows\)"):
        cache.append(good[0].transpose(0, 1), good[0].transpose(0, 1),
                     cu_seqlens=torch.tensor([0, 1, 2], dtype=torch.int32))
    # attend: a bad q, option or backend is refused before the new tokens are written
    for q, options, error, name in [
        (torch.randn(2, 4, 1, 16, dtype=torch.float64), {}, InvalidTypeError, "dtype"),
        (torch.randn(2, 3, 1, 16), {}, InvalidArgumentError, "heads"),
        (torch.randn(2, 4, 1, 16), {"softcap": -1.0}, InvalidArgumentError, "`softcap`"),
        (torch.randn(2, 4, 1, 16), {"seqlens_k": cache.lengths}, InvalidArgumentError, "`seqlens_k`"),
        (torch.randn(2, 4, 1, 16), {"backend": "no-such-backend"}, InvalidArgumentError, "no-such-backend"),
    ]:
        with pytest.raises(error, match=name):
            cache.attend(q, good, good, **options)
        _unchanged(cache, snap)
    with pytest.raises(InvalidArgumentError, match="`v`"):
        cache.attend(torch.randn(2, 4, 1, 16), good)


def test_allocate_and_wrap_errors():
    with pytest.raises(InvalidTypeError, match="`dtype`"):
        KVCache.allocate(2, 8, 2, 16, dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match="`page_size`"):
        KVCache.allocate(2, 8, 2, 16, page_size=0)
    with pytest.raises(InvalidTypeError, match="`capacity`"):
        KVCache.allocate(2, 8.0, 2, 16)
    with pytest.raises(InvalidArgumentError, match="`heads_kv`"):
        KVCache.allocate(2, 8, 0, 16)
    pool = torch.randn(4, 2, 2, 8)
    with pytest.raises(InvalidTypeError, match="`page_table`"):
        KVCache(pool, pool, page_table=torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(InvalidArgumentError, match="`page_table`"):
        KVCache(pool, pool, page_table=torch.tensor([[0, 1], [2, 4]], dtype=torch.int32))
    with pytest.raises(InvalidArgumentError, match="`lengths`"):
        KVCache(pool, pool, page_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), lengths=[1, 5])
    with pytest.raises(InvalidTypeError, match="`v`"):
        KVCache(pool, pool.double())
    cache = KVCache.allocate(2, 10, 2, 8, page_size=4)
    assert cache.capacity == 12 and cache.page_table.dtype == torch.int32 and cache.lengths.dtype == torch.int32


def test_nan_in_new_keys_reaches_only_the_rows_that_see_it():
    torch.manual_seed(12)
    cache = _make(16, batch=2, dtype=torch.float32)
    k, v = torch.randn(2, 2, 4, 16), torch.randn(2, 2, 4, 16)
    k[1, 0, 2, 3] = float("nan")   # sequence 1, kv head 0, position 2
    out = cache.attend(torch.randn(2, 4, 4, 16), k, v, causal=True)
    assert torch.isfinite(out[0]).all()
    assert torch.isnan(out[1, :2, 2:]).all()            # heads 0-1 read kv head 0; rows 2-3 see key 2
    assert torch.isfinite(out[1, :2, :2]).all() and torch.isfinite(out[1, 2:]).all()


def test_dense_append_reads_nothing_back_from_the_device(monkeypatch):
    """The decode append path never reads a tensor's values on the host (a sync on a GPU)."""
    torch.manual_seed(13)
    for kind in (None, 16):
        cache = _make(kind, batch=3, dtype=torch.float32)
        cache.append(torch.randn(3, 2, 2, 16), torch.randn(3, 2, 2, 16))
        cache.reset(1)
        k, v = torch.randn(3, 2, 1, 16), torch.randn(3, 2, 1, 16)

        def refuse(*args, **kwargs):
            raise AssertionError("the append path read a tensor on the host")

        with monkeypatch.context() as m:
            for name in ("tolist", "item", "__bool__", "__int__", "__index__", "numpy"):
                m.setattr(torch.Tensor, name, refuse)
            cache.append(k, v)   # unequal lengths: the indexed path
            cache.append(k, v)
        assert cache.seqlens == [4, 2, 4] and cache.lengths.tolist() == [4, 2, 4]
        got_k, _ = cache.sequence(1)
        torch.testing.assert_close(got_k, torch.cat([k[1], k[1]], dim=1), rtol=0, atol=0)


def test_compat_kvcache_shim_agrees_with_the_object():
    from attnx.compat.kvcache import flash_attn_with_kvcache

    torch.manual_seed(14)
    cache = _make(None, batch=2, dtype=torch.float32)
    k_cache, v_cache = torch.randn(2, 40, 2, 16), torch.randn(2, 40, 2, 16)
    cache.k.copy_(k_cache)
    cache.v.copy_(v_cache)
    cache.set_lengths([5, 9])
    q, k, v = torch.randn(2, 2, 4, 16), torch.randn(2, 2, 2, 16), torch.randn(2, 2, 2, 16)
    got = cache.attend(q, k, v, layout="bshd", causal=True)
    want = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([5, 9], dtype=torch.int32),
                                   causal=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_serving_page_examples_run():
    """The python blocks of docs/serving.md, in order, in one namespace (tests/test_docs.py runs them too)."""
    text = PAGE.read_text()
    blocks = [m.group(2) for m in re.finditer(r"(^|\n)```python\n(.*?)\n```", text, re.S)]
    assert len(blocks) >= 3
    namespace = {"__name__": "__serving__"}
    for index, code in enumerate(blocks):
        exec(compile(code, f"serving.md python block {index + 1}", "exec"), namespace)


_TRITON_SCRIPT = """
import torch, attnx
torch.manual_seed(0)
for kind in (None, 1, 16):
    for layout in ("bhsd", "bshd"):
        cache = attnx.KVCache.allocate(2, 48, 2, 24, page_size=kind)
        cu = torch.tensor([0, 0, 7], dtype=torch.int32)
        cache.append(torch.randn(7, 2, 24), torch.randn(7, 2, 24), cu_seqlens=cu)
        keys = [cache.sequence(b)[0].clone() for b in range(2)]        # (Hkv, L, D) per sequence; 0 empty
        vals = [cache.sequence(b)[1].clone() for b in range(2)]
        q = torch.randn(2, 4, 1, 24)                                   # no new tokens: sequence 0 sees nothing
        out, lse = cache.attend(q, backend="triton", return_lse=True)
        assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf")), (kind, layout)
        want = attnx.attention(q[1:], keys[1][None], vals[1][None], backend="naive")
        torch.testing.assert_close(out[1:], want, rtol=1e-5, atol=1e-5)
        for n in (5, 1, 2, 20):   # decode kernel (n <= 16) and the main kernel
            q, k, v = torch.randn(2, 4, n, 24), torch.randn(2, 2, n, 24), torch.randn(2, 2, n, 24)
            keys = [torch.cat([keys[b], k[b]], 1) for b in range(2)]
            vals = [torch.cat([vals[b], v[b]], 1) for b in range(2)]
            args = [t.transpose(1, 2).contiguous() for t in (q, k, v)] if layout == "bshd" else (q, k, v)
            out = cache.attend(*args, layout=layout, causal=True, backend="triton")
            out = out.transpose(1, 2) if layout == "bshd" else out
            assert torch.isfinite(out).all(), (kind, layout, n)
            for b in range(2):
                want = attnx.attention(q[b:b + 1], keys[b][None], vals[b][None], causal=True, backend="naive")
                torch.testing.assert_close(out[b:b + 1], want, rtol=1e-5, atol=1e-5)
print("ok")
"""


def _old_triton() -> bool:
    from importlib.metadata import version

    from packaging.version import Version

    return Version(version("triton")) < Version("3.7")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.skipif(importlib.util.find_spec("triton") is not None and _old_triton(),
                    reason="Triton 3.6's interpreter fails in the decode kernel (TypeError: only 0-dimensional "
                           "arrays can be converted to Python scalars; seen on the H200 image, 2026-12-01); the "
                           "compiled kernels are checked by this file's GPU tests")
def test_cache_object_on_triton_kernels_through_the_interpreter():
    """The cache's views (bshd storage seen as bhsd, page pools) in triton's kernels (TRITON_INTERPRET=1)."""
    root = str(PAGE.parent.parent)
    env = {k: v for k, v in os.environ.items() if k != "ATTNX_BACKEND"}
    env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""))
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-4000:]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_shared_pool_hands_pages_out_as_sequences_grow(page_size):
    """``allocate(num_pages=...)``: fewer pages than batch x capacity; pages taken on append, returned on reset."""
    torch.manual_seed(15)
    B, Hkv, D, capacity = 3, 2, 16, 32
    num_pages = max(-(-40 // page_size), 4)   # room for about 40 tokens, against 3 x 32 = 96 of capacity
    cache = KVCache.allocate(B, capacity, Hkv, D, dtype=torch.float64, page_size=page_size, num_pages=num_pages)
    _fill(cache)
    assert cache.free_pages == num_pages
    shadow = Shadow(B, Hkv, D, D, torch.float64)
    cu = torch.tensor([0, 7, 7, 12], dtype=torch.int32)       # packed prefill: 7, 0 and 5 tokens
    k, v = _randn(12, Hkv, D), _randn(12, Hkv, D)
    cache.append(k, v, cu_seqlens=cu)
    for b in range(B):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        shadow.add(b, k[rows].transpose(0, 1), v[rows].transpose(0, 1))
    for n in (1, 3, 1):
        _check_dense_step(cache, shadow, n, 4, "bhsd", dict(causal=True))
    assert cache.seqlens == [12, 5, 10]
    used = sum(-(-n // page_size) for n in cache.seqlens)
    assert cache.free_pages == num_pages - used
    # the pool runs dry before any sequence reaches its capacity: refused before any write
    snap = _snapshot(cache)
    table = cache.page_table.clone()
    with pytest.raises(CacheCapacityError, match="pages"):   # 10 more each: within capacity, not in the pool
        cache.append(_randn(B, Hkv, 10, D), _randn(B, Hkv, 10, D))
    _unchanged(cache, snap)
    assert torch.equal(cache.page_table, table) and cache.free_pages == num_pages - used
    # a finished sequence gives its pages back; the others keep their keys, the freed pages are reused
    cache.reset(0)
    shadow.k[0], shadow.v[0] = shadow.k[0][:, :0], shadow.v[0][:, :0]
    assert cache.free_pages == num_pages - used + -(-12 // page_size)
    for n in (6, 1):
        _check_dense_step(cache, shadow, n, 4, "bhsd", dict(causal=True))
    for b in range(B):
        got_k, got_v = cache.sequence(b)
        assert torch.equal(got_k, shadow.k[b]) and torch.equal(got_v, shadow.v[b])
    # speculative rollback: shrinking frees whole pages past the new length
    cache.set_lengths([3, 2, 9])
    assert cache.free_pages == num_pages - sum(-(-n // page_size) for n in (3, 2, 9))
    with pytest.raises(InvalidArgumentError, match="`num_pages`"):
        KVCache.allocate(B, capacity, Hkv, D, num_pages=4)


def test_serving_page_format_table_matches_the_backends_declarations():
    """docs/serving.md's 'Which backend computes what' table says what each backend's `formats` (and
    `backward_formats`: "forward" cells) declares."""
    lines = [line for line in PAGE.read_text().splitlines() if line.startswith("| ")]
    header = [cell.strip(" `") for cell in lines[0].strip("|").split("|")]
    assert header[0].startswith("format")
    rows = {"dense / dense": [("dense", "dense")],
            "packed / packed (`cu_seqlens_q`, `cu_seqlens_k`)": [("varlen", "varlen")],
            "dense / cache (`seqlens_k`)": [("dense", "cache")],
            "dense / paged (`page_table`, any page size >= 1)": [("dense", "paged")],
            "packed / cache or paged": [("varlen", "cache"), ("varlen", "paged")]}
    backends = attnx.registered_backends()
    seen = set()
    for line in lines[2:2 + len(rows)]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        pairs = rows[cells[0]]
        seen.add(cells[0])
        for name, cell in zip(header[1:], cells[1:]):
            backend = backends[name]
            declared = all(pair in backend.formats for pair in pairs)
            forward_only = declared and backend.backward_formats is not None and not all(
                pair in backend.backward_formats for pair in pairs)
            assert cell.startswith(("yes", "forward")) == declared, f"{cells[0]} / {name}: page says {cell!r}"
            assert cell.startswith("forward") == forward_only, f"{cells[0]} / {name}: page says {cell!r}"
            assert cell.startswith(("yes", "forward")) or cell == "declines", cell
    assert seen == set(rows) and set(header[1:]) == set(backends)


@pytest.mark.parametrize("kind", [None, 16], ids=["contiguous", "page16"])
def test_cache_plan_with_packed_queries_and_bshd(kind):
    """Packed new tokens (different counts per step) through a plan fixed at max_seqlen_q; bshd dense steps."""
    torch.manual_seed(17)
    a, b = _make(kind, dtype=torch.float32), _make(kind, dtype=torch.float32)
    cu0 = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    step = a.plan(torch.randn(5, 4, 16), cu_seqlens=cu0, max_seqlen_q=4, causal=True)
    for counts in ([2, 0, 3], [1, 4, 0], [3, 1, 1]):
        cu = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32)
        q, k, v = torch.randn(5, 4, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 16)
        got = step.run(q, k, v, cu_seqlens=cu)
        want = b.attend(q, k, v, cu_seqlens=cu, causal=True)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert a.seqlens == b.seqlens == [6, 5, 4]
    cu = torch.tensor([0, 5, 5, 5], dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match="max_seqlen_q"):
        step.run(torch.randn(5, 4, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 16), cu_seqlens=cu)
    assert a.seqlens == [6, 5, 4]
    with pytest.raises(InvalidArgumentError, match="max_seqlen_q"):
        a.plan(torch.randn(5, 4, 16), cu_seqlens=cu0, causal=True)
    with pytest.raises(InvalidArgumentError, match=r"`cu_seqlens`\[3\] = 4, must equal .* \(`q` has 5 rows\)"):
        step.run(torch.randn(5, 4, 16), cu_seqlens=torch.tensor([0, 2, 2, 4], dtype=torch.int32))
    step = a.plan(torch.randn(3, 1, 4, 16), layout="bshd", causal=True)
    q, k, v = torch.randn(3, 1, 4, 16), torch.randn(3, 1, 2, 16), torch.randn(3, 1, 2, 16)
    torch.testing.assert_close(step.run(q, k, v), b.attend(q, k, v, layout="bshd", causal=True), rtol=0, atol=0)


def test_inference_mode_and_query_gradients():
    """Appends work under torch.inference_mode; gradients reach q (the cache itself holds no graph), and an
    append after the forward makes that backward fail loudly instead of using overwritten keys."""
    torch.manual_seed(18)
    cache = _make(16, batch=2)
    with torch.inference_mode():
        out = cache.attend(_randn(2, 4, 3, 16), _randn(2, 2, 3, 16), _randn(2, 2, 3, 16), causal=True)
        assert torch.isfinite(out).all() and cache.seqlens == [3, 3]
    k_new, v_new = _randn(2, 2, 2, 16), _randn(2, 2, 2, 16)
    cache.append(k_new, v_new)
    q = _randn(2, 4, 2, 16).requires_grad_()
    out = cache.attend(q, causal=True)
    out.backward(torch.ones_like(out))
    keys = [cache.sequence(b) for b in range(2)]
    q_ref = q.detach().clone().requires_grad_()
    for b in range(2):
        ref = attnx.attention(q_ref[b:b + 1], keys[b][0][None], keys[b][1][None], causal=True, backend="naive")
        ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(q.grad, q_ref.grad, rtol=1e-9, atol=1e-9)
    out = cache.attend(q, causal=True)
    cache.append(_randn(2, 2, 1, 16), _randn(2, 2, 1, 16))
    with pytest.raises(RuntimeError, match="inplace"):
        out.sum().backward()
