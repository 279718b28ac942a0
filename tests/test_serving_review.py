"""Adversarial review of the serving surface on CPU (KVCache, CachePlan, merge, index checks).

Each defect found has a regression test named after it; the rest pin down edge cases that were
probed and found right (so they stay right): packed sequences of length 0, caches at 0 and at
capacity, page tables with repeated or shared pages, page sizes 1 and 256, strided pools, GQA,
and a random sequence of cache operations checked against a plain host model.
"""
from __future__ import annotations

import itertools
import random

import pytest
import torch

import attnx
from attnx import CacheCapacityError, InvalidArgumentError, KVCache

HQ, HKV, D = 4, 2, 8


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def dense_attention(q, k, v, **options):
    """The oracle: `naive` on one dense sequence ``(Hq, Sq, D)`` / ``(Hkv, Sk, D)``."""
    return attnx.attention(q[None], k[None], v[None], backend="naive", **options)[0]


# ---- defect 1: k and v sharing memory -------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda x: (x, x),                                                # the same tensor
    lambda x: (x, x.view(2, 10, 16).view(2, 10, 2, 8)),              # another view of it
    lambda x: (x[:, 1:], x[:, :-1]),                                 # overlapping slices (with gaps)
    lambda x: (x[..., :6], x[..., 2:]),                              # overlapping head-dim slices
], ids=["same", "view", "shifted-slices", "head-dim-slices"])
def test_kvcache_rejects_k_and_v_sharing_memory(make):
    """`KVCache(x, x)` used to be accepted: every append wrote the values over the keys, so attention read
    values as keys (silent corruption; the docs' raw-tensor examples pass one tensor as k and v)."""
    k, v = make(torch.zeros(2, 10, 2, 8))
    with pytest.raises(InvalidArgumentError, match="`v` must not share memory with `k`"):
        KVCache(k, v)


def test_kvcache_rejects_one_pool_for_k_and_v():
    pool = torch.zeros(6, 4, HKV, D)
    with pytest.raises(InvalidArgumentError, match="share memory"):
        KVCache(pool, pool, page_table=i32(0, 1, 2)[None])


def test_kvcache_accepts_disjoint_views_of_one_buffer():
    """Interleaved but disjoint views (flash-attn's packed kv, stacked k/v, a split last dim) stay accepted
    and appends keep keys and values apart."""
    kv = torch.zeros(2, 10, 2, HKV, D)
    stacked = torch.zeros(2, 2, 10, HKV, D)
    split = torch.zeros(2, 10, HKV, 2 * D)
    bhsd = torch.zeros(2, 2, HKV, 10, D)
    for k, v in ((kv[:, :, 0], kv[:, :, 1]), (stacked[0], stacked[1]), (split[..., :D], split[..., D:]),
                 (bhsd[0].transpose(1, 2), bhsd[1].transpose(1, 2))):
        cache = KVCache(k, v)
        k_new, v_new = torch.randn(2, HKV, 3, D), torch.randn(2, HKV, 3, D)
        cache.append(k_new, v_new)
        keys, values = cache.sequence(1)
        assert torch.equal(keys, k_new[1]) and torch.equal(values, v_new[1])


# ---- defect 2: KVCache.attend with a max_seqlen_q below the new tokens -----------------------

def test_attend_rejects_max_seqlen_q_below_the_new_tokens_before_writing():
    """`attend(q, k, v, cu_seqlens=..., max_seqlen_q=m)` with a sequence gaining more than m tokens was
    accepted: `triton` sizes its grid from it and silently skipped the extra query rows (checked with
    TRITON_INTERPRET=1: rows 2-3 of a [1, 3] step differed from `naive` by ~1.3). The counts are on the
    host already, so the check costs nothing; it runs before anything is written."""
    for page_size in (None, 4):
        cache = KVCache.allocate(2, 16, HKV, D, page_size=page_size)
        cache.append(torch.randn(2, HKV, 2, D), torch.randn(2, HKV, 2, D))
        before = cache.k.clone()
        cu = i32(0, 1, 4)
        q, k, v = torch.randn(4, HQ, D), torch.randn(4, HKV, D), torch.randn(4, HKV, D)
        for small in (0, 1, 2):
            with pytest.raises(InvalidArgumentError, match="`max_seqlen_q` = .* less than the 3 new tokens"):
                cache.attend(q, k, v, cu_seqlens=cu, max_seqlen_q=small, causal=True)
            assert cache.seqlens == [2, 2] and torch.equal(cache.k, before)
        out = cache.attend(q, k, v, cu_seqlens=cu, max_seqlen_q=3, causal=True)
        assert cache.seqlens == [3, 5]
        keys, values = cache.sequence(1)
        ref = dense_attention(q[1:].transpose(0, 1), keys, values, causal=True)
        torch.testing.assert_close(out[1:], ref.transpose(0, 1))


# ---- defect 3: a cache made under torch.inference_mode, changed outside it ------------------

def test_inference_mode_cache_changed_outside_raises_typed_error_before_any_change():
    """A cache allocated inside `torch.inference_mode()` (as serving code often is) and appended to outside
    it raised torch's untyped RuntimeError, and a shared pool had already handed out the pages by then
    (its bookkeeping then disagreed with the lengths). Now a typed error, before any change."""
    with torch.inference_mode():
        cache = KVCache.allocate(2, 16, HKV, D, page_size=4, num_pages=6)
        cache.append(torch.randn(2, HKV, 3, D), torch.randn(2, HKV, 3, D))
    free, owned = cache.free_pages, [list(o) for o in cache._pager.owned]
    k_new, v_new = torch.randn(2, HKV, 2, D), torch.randn(2, HKV, 2, D)
    calls = [lambda: cache.append(k_new, v_new), lambda: cache.attend(torch.randn(2, HQ, 1, D), k_new, v_new),
             lambda: cache.plan(torch.randn(2, HQ, 1, D)).run(torch.randn(2, HQ, 1, D), k_new, v_new),
             lambda: cache.set_lengths([1, 8]), lambda: cache.reset(), lambda: cache.reset(1)]
    for call in calls:
        with pytest.raises(InvalidArgumentError, match="inference_mode"):
            call()
        assert cache.seqlens == [3, 3] and cache.lengths.tolist() == [3, 3]
        assert cache.free_pages == free and cache._pager.owned == owned
    cache.attend(torch.randn(2, HQ, 1, D))  # reading is fine outside inference mode
    with torch.inference_mode():
        cache.append(k_new, v_new)
        cache.set_lengths([1, 8])
    assert cache.seqlens == [1, 8]


def test_wrapping_a_meta_page_table_is_a_typed_error():
    pool = torch.zeros(4, 2, HKV, D, device="meta")
    with pytest.raises(InvalidArgumentError, match="`page_table` must hold values"):
        KVCache(pool, torch.zeros(4, 2, HKV, D, device="meta"),
                page_table=torch.zeros(1, 2, dtype=torch.int32, device="meta"))


# ---- defect 5: new tokens sliced from the cache's own storage --------------------------------

@pytest.mark.parametrize("page_size", [None, 4])
@pytest.mark.parametrize("lengths", [[4, 4], [4, 2], [2, 2]])
def test_append_of_tokens_that_alias_the_cache_copies_them_first(page_size, lengths):
    """`cache.append(cache.k[:, 0:3].transpose(1, 2), ...)` (repeating cached tokens, e.g. forking a
    sequence) wrote positions the same write was still reading: 5 of the 6 dense cases stored wrong keys
    without an error, and every packed one raised torch's untyped RuntimeError from index_put_. New
    tokens that lie in the cache's storage are now copied before the write."""
    torch.manual_seed(0)
    cache = KVCache.allocate(2, 16, HKV, D, page_size=page_size)
    cache.append(torch.randn(2, HKV, 4, D), torch.randn(2, HKV, 4, D))
    cache.set_lengths(lengths)
    rows = slice(None) if page_size is None else slice(0, 2)  # paged: pages 0 and 1 (sequence 0's pages)
    k_new, v_new = cache.k[rows, 0:3].transpose(1, 2), cache.v[rows, 0:3].transpose(1, 2)
    want_k, want_v = k_new.clone(), v_new.clone()
    cache.append(k_new, v_new)
    for b in range(2):
        keys, values = cache.sequence(b)
        assert torch.equal(keys[:, -3:], want_k[b]) and torch.equal(values[:, -3:], want_v[b])
    # packed new tokens sliced from the cache too
    cache.set_lengths(lengths)
    flat_k = cache.k.flatten(0, 1)[1:6]
    flat_v = cache.v.flatten(0, 1)[1:6]
    want_k, want_v = flat_k.clone(), flat_v.clone()
    cache.append(flat_k, flat_v, cu_seqlens=i32(0, 2, 5))
    for b, (a, e) in enumerate(((0, 2), (2, 5))):
        keys, values = cache.sequence(b)
        n = e - a
        assert torch.equal(keys[:, -n:], want_k[a:e].transpose(0, 1))
        assert torch.equal(values[:, -n:], want_v[a:e].transpose(0, 1))


# ---- defect 4: merge of parts whose rows saw nothing -----------------------------------------

def test_merge_ignores_out_of_rows_with_minus_inf_lse():
    """A part's row with lse = -inf (no key) has weight 0, but merge computed 0 * out: NaN or inf in an
    unwritten split-KV workspace made the merged row NaN, and parts that all saw nothing gave NaN instead
    of the documented out = 0, lse = -inf."""
    torch.manual_seed(0)
    o1, l1 = torch.randn(2, HQ, 3, D), torch.randn(2, HQ, 3)
    empty = torch.full((2, HQ, 3), float("-inf"))
    for garbage in (float("nan"), float("inf"), float("-inf")):
        junk = torch.full_like(o1, garbage)
        out, lse = attnx.merge([o1, junk], [l1, empty])
        assert torch.equal(out, o1) and torch.equal(lse, l1)
        out, lse = attnx.merge([junk, junk], [empty, empty])
        assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, empty)
        out, lse = attnx.merge([junk[0].transpose(0, 1)], [empty[0]], layout="varlen")
        assert torch.equal(out, torch.zeros_like(out))
    # a NaN lse still propagates, and so does a NaN out whose row saw keys
    bad = l1.clone()
    bad[0, 0, 0] = float("nan")
    out, lse = attnx.merge([o1, o1], [bad, l1])
    assert out[0, 0, 0].isnan().all() and lse[0, 0, 0].isnan() and not out[1].isnan().any()
    nan_out = o1.clone()
    nan_out[1, 2, 1, 0] = float("nan")
    out, _ = attnx.merge([nan_out, o1], [l1, l1])
    assert out[1, 2, 1, 0].isnan() and out.isnan().sum() == 1
    # +inf (flash-attn 2's lse of an empty row) is not taken for empty: NaN, as documented
    out, lse = attnx.merge([o1, o1], [torch.full_like(l1, float("inf")), l1])
    assert out.isnan().all() and lse.isnan().all()
    # gradients of a masked part are zero, never NaN
    o = torch.full_like(o1, float("nan")).requires_grad_()
    l_empty = empty.clone().requires_grad_()
    o_seen = o1.clone().requires_grad_()
    out, lse = attnx.merge([o_seen, o], [l1, l_empty])
    out.sum().backward()
    assert torch.equal(o.grad, torch.zeros_like(o)) and torch.equal(l_empty.grad, torch.zeros_like(empty))
    assert not o_seen.grad.isnan().any()


def test_merge_weights_do_not_round_through_lse():
    """Weights were exp(lse_i - lse) with lse = top + log(total) rounded to float32: at lse ~ 1e4 two equal
    parts got weights off by ~4e-4. Now exp(lse_i - top) / total: exact for equal parts, float64-close
    otherwise."""
    torch.manual_seed(0)
    o1, o2 = torch.randn(1, 2, 3, D), torch.randn(1, 2, 3, D)
    for base in (0.0, 100.0, 1e4, -1e4):
        l1 = torch.full((1, 2, 3), base)
        out, lse = attnx.merge([o1, o2], [l1, l1])
        torch.testing.assert_close(out, (o1 + o2) / 2, rtol=0, atol=1e-6)
        l2 = l1 + torch.randn(1, 2, 3)
        out, _ = attnx.merge([o1, o2], [l1, l2])
        w = torch.softmax(torch.stack([l1, l2]).double(), dim=0)
        want = w[0, ..., None] * o1.double() + w[1, ..., None] * o2.double()
        torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-6)


def test_merge_single_part_float64_and_split_attention():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, HQ, 5, D), torch.randn(2, HKV, 11, D), torch.randn(2, HKV, 11, D)
    full, full_lse = attnx.attention(q, k, v, return_lse=True, backend="naive")
    parts = [attnx.attention(q, k[:, :, a:b], v[:, :, a:b], return_lse=True, backend="naive")
             for a, b in ((0, 4), (4, 4), (4, 11))]                                  # one part is empty
    out, lse = attnx.merge([o for o, _ in parts], [l for _, l in parts])
    torch.testing.assert_close(out, full)
    torch.testing.assert_close(lse, full_lse)
    one, one_lse = attnx.merge([full], [full_lse])
    assert torch.equal(one, full) and torch.equal(one_lse, full_lse)
    out64, lse64 = attnx.merge([o.double() for o, _ in parts], [l for _, l in parts])
    assert out64.dtype == torch.float64 and lse64.dtype == torch.float64
    torch.testing.assert_close(out64, full.double(), rtol=1e-5, atol=1e-6)


# ---- probed and right: packed sequences ------------------------------------------------------

@pytest.mark.parametrize("backend", ["naive", "blocked"])
def test_packed_edge_cases_match_the_dense_oracle(backend):
    torch.manual_seed(0)
    cu = i32(0, 5, 5, 8)                                               # one empty sequence
    q, k, v = torch.randn(8, HQ, D), torch.randn(8, HKV, D), torch.randn(8, HKV, D)
    want = torch.cat([dense_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                      causal=True).transpose(0, 1) for a, b in ((0, 5), (5, 8))])
    # max_seqlen below the real maximum: naive/blocked compute every row whatever it says
    for extra in ({}, dict(max_seqlen_q=5, max_seqlen_k=5), dict(max_seqlen_q=1, max_seqlen_k=0)):
        out = attnx.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, backend=backend, **extra)
        torch.testing.assert_close(out, want)
    strided = i32(0, 9, 5, 9, 5, 9, 8, 9)[::2]                          # non-contiguous offsets
    out = attnx.attention(q, k, v, cu_seqlens_q=strided, cu_seqlens_k=strided, causal=True, backend=backend)
    torch.testing.assert_close(out, want)
    with attnx.validate_indices(), pytest.raises(InvalidArgumentError, match="`max_seqlen_q` = 1"):
        attnx.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1, max_seqlen_k=5, backend=backend)
    with pytest.raises(attnx.InvalidTypeError, match="int32"):
        attnx.attention(q, k, v, cu_seqlens_q=cu.long(), cu_seqlens_k=cu.long(), backend=backend)
    # all sequences empty
    none = i32(0, 0, 0)
    out, lse = attnx.attention(q[:0], k[:0], v[:0], cu_seqlens_q=none, cu_seqlens_k=none, return_lse=True,
                               backend=backend)
    assert out.shape == (0, HQ, D) and lse.shape == (HQ, 0)
    # queries without keys: out 0, lse -inf
    out, lse = attnx.attention(q[:3], k[:4], v[:4], cu_seqlens_q=i32(0, 0, 3), cu_seqlens_k=i32(0, 4, 4),
                               return_lse=True, backend=backend)
    assert torch.equal(out, torch.zeros_like(out)) and (lse == float("-inf")).all()


# ---- probed and right: caches and pages ------------------------------------------------------

@pytest.mark.parametrize("backend", ["naive", "blocked"])
def test_page_tables_with_repeated_and_shared_pages(backend):
    torch.manual_seed(0)
    pool_k, pool_v = torch.randn(5, 4, HKV, D), torch.randn(5, 4, HKV, D)
    q = torch.randn(2, HQ, 2, D)
    lengths = i32(10, 6)
    for table in (i32(0, 1, 2, 0, 3, 4).view(2, 3), i32(0, 0, 0, 1, 1, 2).view(2, 3)):  # shared prefix; repeats
        out = attnx.attention(q, pool_k, pool_v, seqlens_k=lengths, page_table=table, causal=True, backend=backend)
        for b in range(2):
            rows = table[b].long()
            keys = pool_k[rows].flatten(0, 1)[:lengths[b]].transpose(0, 1)
            values = pool_v[rows].flatten(0, 1)[:lengths[b]].transpose(0, 1)
            torch.testing.assert_close(out[b], dense_attention(q[b], keys, values, causal=True))
    # entries a sequence does not read may hold anything
    table = i32(0, 99, -5, 1, 2, -1).view(2, 3)
    attnx.attention(q, pool_k, pool_v, seqlens_k=i32(4, 5), page_table=table, backend=backend)
    with pytest.raises(InvalidArgumentError, match=r"`page_table`\[0, 1\] = 99"):
        attnx.attention(q, pool_k, pool_v, seqlens_k=i32(5, 5), page_table=table, backend=backend)


@pytest.mark.parametrize("page_size", [None, 1, 16, 256])
@pytest.mark.parametrize("backend", ["naive", "blocked"])
def test_cache_garbage_past_the_lengths_is_never_read(page_size, backend):
    """Storage is torch.empty: NaN past each length must not reach the output (GQA, several queries)."""
    torch.manual_seed(0)
    cache = KVCache.allocate(2, 300, HKV, D, page_size=page_size, dtype=torch.bfloat16)
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    cache.append(torch.randn(2, HKV, 37, D, dtype=torch.bfloat16), torch.randn(2, HKV, 37, D, dtype=torch.bfloat16))
    cache.set_lengths([37, 5])
    q = torch.randn(2, HQ, 3, D, dtype=torch.bfloat16)
    out, lse = cache.attend(q, causal=True, backend=backend, return_lse=True)
    assert not out.isnan().any() and not lse.isnan().any()
    for b in range(2):
        keys, values = cache.sequence(b)
        torch.testing.assert_close(out[b], dense_attention(q[b], keys, values, causal=True))


def test_strided_pools_and_capacity_edges():
    torch.manual_seed(0)
    pool_k = torch.zeros(HKV, 6, 4, D).permute(1, 2, 0, 3)            # (pages, page, Hkv, D), not contiguous
    pool_v = torch.zeros(D, 6, 4, HKV).permute(1, 2, 3, 0)
    cache = KVCache(pool_k, pool_v, page_table=i32(5, 0, 2, 1, 4, 3).view(2, 3))
    k_new, v_new = torch.randn(2, HKV, 12, D), torch.randn(2, HKV, 12, D)
    cache.append(k_new[:, :, :7], v_new[:, :, :7])
    cache.append(k_new[:, :, 7:], v_new[:, :, 7:])                    # exactly to the capacity
    assert cache.seqlens == [12, 12]
    with pytest.raises(CacheCapacityError):
        cache.append(k_new[:, :, :1], v_new[:, :, :1])
    q = torch.randn(2, HQ, 1, D)
    for backend in ("naive", "blocked"):
        out = cache.attend(q, causal=True, backend=backend)
        for b in range(2):
            torch.testing.assert_close(out[b], dense_attention(q[b], k_new[b], v_new[b], causal=True))
    # length 0 everywhere, capacity 0, batch 0
    cache.reset()
    out, lse = cache.attend(q, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and (lse == float("-inf")).all()
    empty = KVCache.allocate(2, 0, HKV, D, page_size=4)
    empty.append(torch.randn(2, HKV, 0, D), torch.randn(2, HKV, 0, D))
    with pytest.raises(CacheCapacityError):
        empty.append(torch.randn(2, HKV, 1, D), torch.randn(2, HKV, 1, D))
    none = KVCache.allocate(0, 8, HKV, D)
    assert none.attend(torch.randn(0, HQ, 1, D), torch.randn(0, HKV, 1, D), torch.randn(0, HKV, 1, D)).shape == \
        (0, HQ, 1, D)


# ---- probed and right: random operation sequences against a host model ---------------------

def _fuzz(seed: int, page_size, shared: bool, backend: str) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    batch, capacity = 3, 24
    num_pages = None
    if shared:
        per_sequence = -(-capacity // page_size)
        num_pages = rng.randint(per_sequence, batch * per_sequence)
    cache = KVCache.allocate(batch, capacity, HKV, D, page_size=page_size, num_pages=num_pages)
    model = [(torch.empty(HKV, 0, D), torch.empty(HKV, 0, D)) for _ in range(batch)]

    def grow(b, k, v):
        model[b] = (torch.cat([model[b][0], k], 1), torch.cat([model[b][1], v], 1))

    for _ in range(20):
        op = rng.choice(["dense", "packed", "attend", "attend_packed", "plan", "set", "reset"])
        try:
            if op in ("dense", "attend", "plan"):
                n = rng.randint(0 if op != "plan" else 1, 4) if op != "plan" else 1
                k, v = torch.randn(batch, HKV, n, D), torch.randn(batch, HKV, n, D)
                q = torch.randn(batch, HQ, rng.randint(1, 3) if op == "attend" else 1, D)
                if op == "dense":
                    cache.append(k, v)
                elif op == "attend":
                    out = cache.attend(q, k, v, causal=True, backend=backend)
                else:
                    out = cache.plan(q, causal=True, backend=backend).run(q, k, v)
                for b in range(batch):
                    grow(b, k[b], v[b])
                if op != "dense":
                    for b in range(batch):
                        torch.testing.assert_close(out[b], dense_attention(q[b], *model[b], causal=True))
            elif op in ("packed", "attend_packed"):
                counts = [rng.randint(0, 4) for _ in range(batch)]
                cu = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32)
                k, v = torch.randn(sum(counts), HKV, D), torch.randn(sum(counts), HKV, D)
                q = torch.randn(sum(counts), HQ, D)
                if op == "packed":
                    cache.append(k, v, cu_seqlens=cu)
                else:
                    out = cache.attend(q, k, v, cu_seqlens=cu, causal=True, backend=backend)
                starts = cu.tolist()
                for b in range(batch):
                    grow(b, k[starts[b]:starts[b + 1]].transpose(0, 1), v[starts[b]:starts[b + 1]].transpose(0, 1))
                if op == "attend_packed":
                    for b in range(batch):
                        a, e = starts[b], starts[b + 1]
                        if e > a:
                            want = dense_attention(q[a:e].transpose(0, 1), *model[b], causal=True)
                            torch.testing.assert_close(out[a:e], want.transpose(0, 1))
            elif op == "set":  # shrink only: growing exposes storage nobody wrote
                lengths = [rng.randint(0, m[0].shape[1]) for m in model]
                cache.set_lengths(lengths)
                model = [(m[0][:, :n], m[1][:, :n]) for m, n in zip(model, lengths)]
            else:
                b = rng.randrange(batch)
                cache.reset(b)
                model[b] = (torch.empty(HKV, 0, D), torch.empty(HKV, 0, D))
        except CacheCapacityError:
            pass
        assert cache.seqlens == [m[0].shape[1] for m in model] == cache.lengths.tolist()
        for b in range(batch):
            keys, values = cache.sequence(b)
            assert torch.equal(keys, model[b][0]) and torch.equal(values, model[b][1])
        if shared:
            pages = sorted([p for own in cache._pager.owned for p in own] + cache._pager.free)
            assert pages == list(range(cache.k.shape[0]))


@pytest.mark.parametrize("page_size,shared", [(None, False), (1, False), (4, False), (1, True), (4, True),
                                              (5, True)])
@pytest.mark.parametrize("backend", ["naive", "blocked"])
def test_cache_operations_match_a_host_model(page_size, shared, backend):
    for seed in range(2):
        _fuzz(seed, page_size, shared, backend)
