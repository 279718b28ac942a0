"""Regression tests from an adversarial review of the core API (attnx/api.py, problem.py, kvcache*.py,
merge.py, ...): each test names the defect it pins down. CPU, small shapes."""
import math

import numpy as np
import pytest
import torch

import attnx
from attnx import CacheCapacityError, InvalidArgumentError, InvalidTypeError, KVCache, NoBackendError


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def _state(cache):
    """Everything an append may change: the host and device lengths, the storage, the page table, free pages."""
    table = None if cache.page_table is None else cache.page_table.clone()
    return (cache.seqlens, cache.lengths.clone(), cache.k.clone(), cache.v.clone(), table, cache.free_pages)


def _assert_untouched(cache, before):
    after = _state(cache)
    assert after[0] == before[0]
    assert torch.equal(after[1], before[1])
    assert torch.equal(after[2].nan_to_num(), before[2].nan_to_num())  # storage is torch.empty: NaN may be there
    assert torch.equal(after[3].nan_to_num(), before[3].nan_to_num())
    assert (after[4] is None) == (before[4] is None) and (after[4] is None or torch.equal(after[4], before[4]))
    assert after[5] == before[5]


def _cache(page_size, num_pages=None):
    torch.manual_seed(0)
    cache = KVCache.allocate(2, 16, 2, 8, page_size=page_size, num_pages=num_pages)
    cache.append(torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8))
    return cache


KINDS = [(None, None), (1, None), (4, None), (4, 10)]
KIND_IDS = ["contiguous", "page1", "page4", "page4-shared"]


# -- KVCache.attend: every failure before the write ------------------------------------------------
@pytest.mark.parametrize("page_size,num_pages", KINDS, ids=KIND_IDS)
def test_attend_with_a_declining_backend_leaves_the_cache_untouched(page_size, num_pages):
    """Was: the new tokens were appended, then `attention` raised NoBackendError (torch declines caches)."""
    cache = _cache(page_size, num_pages)
    before = _state(cache)
    with pytest.raises(NoBackendError):
        cache.attend(torch.randn(2, 4, 1, 8), torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8), backend="torch")
    _assert_untouched(cache, before)


@pytest.mark.parametrize("page_size,num_pages", KINDS, ids=KIND_IDS)
def test_attend_with_a_bad_return_lse_leaves_the_cache_untouched(page_size, num_pages):
    """Was: appended, then InvalidTypeError for `return_lse`."""
    cache = _cache(page_size, num_pages)
    before = _state(cache)
    with pytest.raises(InvalidTypeError, match="`return_lse`"):
        cache.attend(torch.randn(2, 4, 1, 8), torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8), return_lse=1)
    _assert_untouched(cache, before)


@pytest.mark.parametrize("page_size,num_pages", KINDS, ids=KIND_IDS)
def test_attend_packed_q_of_another_length_leaves_the_cache_untouched(page_size, num_pages):
    """Was: appended, then the backend's host check of `cu_seqlens_q` raised (q has 4 rows, cu_seqlens 3)."""
    cache = _cache(page_size, num_pages)
    before = _state(cache)
    with pytest.raises(InvalidArgumentError, match="`q`"):
        cache.attend(torch.randn(4, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8), cu_seqlens=_i32(0, 1, 3))
    _assert_untouched(cache, before)


def test_attend_backend_not_a_str_names_backend_and_leaves_the_cache_untouched():
    cache = _cache(None)
    before = _state(cache)
    with pytest.raises(InvalidTypeError, match="`backend`"):
        cache.attend(torch.randn(2, 4, 1, 8), torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8), backend=3)
    _assert_untouched(cache, before)


@pytest.mark.parametrize("page_size,num_pages", KINDS, ids=KIND_IDS)
def test_attend_still_appends_and_attends(page_size, num_pages):
    """The checks moved before the write change nothing for a good call (against the naive oracle)."""
    cache = _cache(page_size, num_pages)
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    out, lse = cache.attend(q, k, v, cu_seqlens=_i32(0, 1, 3), causal=True, return_lse=True, backend="blocked")
    assert cache.seqlens == [4, 5]
    for b, (start, stop) in enumerate(((0, 1), (1, 3))):
        keys, values = cache.sequence(b)
        want, want_lse = attnx.attention(q[start:stop].transpose(0, 1)[None], keys[None], values[None], causal=True,
                                         backend="naive", return_lse=True)
        torch.testing.assert_close(out[start:stop], want[0].transpose(0, 1))
        torch.testing.assert_close(lse[:, start:stop], want_lse[0])


# -- CachePlan.run: the whole signature checked before the write --------------------------------------
@pytest.mark.parametrize("page_size,num_pages", KINDS, ids=KIND_IDS)
def test_cache_plan_run_with_q_needing_grad_leaves_the_cache_untouched(page_size, num_pages):
    """Was: `run` checked q's shape, dtype and device, appended, then `Plan.run` refused q's gradients."""
    cache = _cache(page_size, num_pages)
    step = cache.plan(torch.randn(2, 4, 1, 8), causal=True)
    before = _state(cache)
    with pytest.raises(InvalidArgumentError, match="needs_grad"):
        step.run(torch.randn(2, 4, 1, 8, requires_grad=True), torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
    _assert_untouched(cache, before)
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)
    out = step.run(q, k, v)                                 # and a good step still runs, over the new tokens
    assert cache.seqlens == [4, 4]
    keys, values = cache.sequence(1)
    torch.testing.assert_close(out[1:], attnx.attention(q[1:], keys[None], values[None], causal=True, backend="naive"))


def test_cache_plan_run_packed_q_of_another_length_leaves_the_cache_untouched():
    cache = _cache(4)
    step = cache.plan(torch.randn(3, 4, 8), cu_seqlens=_i32(0, 1, 3), max_seqlen_q=2, causal=True)
    before = _state(cache)
    with pytest.raises(InvalidArgumentError, match="`q`"):
        step.run(torch.randn(3, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8), cu_seqlens=_i32(0, 1, 2))
    _assert_untouched(cache, before)


def test_cache_plan_run_q_not_a_tensor_is_a_type_error():
    cache = _cache(None)
    step = cache.plan(torch.randn(2, 4, 1, 8))
    with pytest.raises(InvalidTypeError, match="`q`"):
        step.run([1.0], torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
    assert cache.seqlens == [3, 3]


def test_cache_plan_run_under_validate_indices():
    cache = _cache(4)
    step = cache.plan(torch.randn(2, 4, 1, 8), causal=True)
    with attnx.validate_indices():
        step.run(torch.randn(2, 4, 1, 8), torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
    assert cache.seqlens == [4, 4]


# -- KVCache arguments ---------------------------------------------------------------------------
def test_set_lengths_float_tensor_is_a_type_error():
    """Was InvalidArgumentError; docs/errors.md: a wrong dtype is an InvalidTypeError."""
    cache = _cache(None)
    with pytest.raises(InvalidTypeError, match="`lengths`"):
        cache.set_lengths(torch.tensor([1.0, 2.0]))
    with pytest.raises(InvalidArgumentError, match="`lengths`"):
        cache.set_lengths(_i32(1, 2, 3))
    assert cache.seqlens == [3, 3]


@pytest.mark.parametrize("device,error", [("no-such-device", InvalidArgumentError), (3.5, InvalidTypeError)])
def test_allocate_bad_device_is_typed(device, error):
    """Was a bare RuntimeError/TypeError from torch.device."""
    with pytest.raises(error, match="`device`"):
        KVCache.allocate(1, 4, 2, 8, device=device)


# -- plan / explain / attention --------------------------------------------------------------------
def test_plan_of_an_empty_problem_checks_the_backend_name():
    """Was: accepted (`attention` and `explain` raise for the same call)."""
    q = torch.randn(0, 2, 4, 8)
    with pytest.raises(InvalidArgumentError, match="no-such"):
        attnx.plan(q, q, q, backend="no-such")
    with pytest.raises(InvalidArgumentError, match="no-such"):
        attnx.attention(q, q, q, backend="no-such")


@pytest.mark.parametrize("entry", ["attention", "plan", "explain"])
@pytest.mark.parametrize("backend", [3, ["naive"], ("naive",)])
def test_backend_not_a_str_names_the_argument(entry, backend):
    """Was "a backend name must be a str" (from the registry), without the argument's name."""
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(InvalidTypeError, match="`backend`"):
        getattr(attnx, entry)(q, q, q, backend=backend)


def test_scale_beyond_float_range_is_typed():
    """Was a bare OverflowError from float(10**400)."""
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(InvalidArgumentError, match="`scale`"):
        attnx.attention(q, q, q, scale=10 ** 400)
    with pytest.raises(InvalidArgumentError, match="`softcap`"):
        attnx.attention(q, q, q, softcap=-10 ** 400)


@pytest.mark.parametrize("value", [np.float32(0.25), np.float64(0.25), np.int64(2)])
def test_numpy_scalars_are_numbers(value):
    """Was InvalidTypeError: docs/errors.md rejects a scale that is "not a number"; torch's SDPA takes these."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    want = attnx.attention(q, k, v, scale=float(value), softcap=float(value), backend="naive")
    torch.testing.assert_close(attnx.attention(q, k, v, scale=value, softcap=value, backend="naive"), want)


@pytest.mark.parametrize("value", [True, torch.tensor(1.0), "1", 1j, np.bool_(True)])
def test_scale_not_a_number_is_still_a_type_error(value):
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(InvalidTypeError, match="`scale`"):
        attnx.attention(q, q, q, scale=value)


def test_set_lengths_counts_pages_a_shrinking_sequence_gives_back():
    """Was CacheCapacityError: the shortfall ignored the pages another sequence frees in the same call."""
    cache = KVCache.allocate(2, 8, 1, 2, page_size=2, num_pages=5)
    cache.append(torch.randn(2, 1, 3, 2), torch.randn(2, 1, 3, 2))   # 2 pages each, 1 free
    cache.set_lengths([3, 6])                                         # sequence 1: 3 pages, none free
    assert cache.free_pages == 0
    cache.set_lengths([8, 0])                                         # 0 gains 2 pages, 1 gives back 3
    assert cache.seqlens == [8, 0] and cache.free_pages == 1
    pages = cache.page_table[0].tolist()
    assert len(set(pages)) == 4 and all(0 <= p < 5 for p in pages)
    with pytest.raises(CacheCapacityError):                           # 0 needs nothing, 1 needs 3: 1 free
        cache.set_lengths([8, 6])
    assert cache.seqlens == [8, 0] and cache.free_pages == 1


# -- empty problems with index tensors: their values are still checked on a CPU ------------------
_EMPTY_BAD_INDICES = {
    "no sequences, q has rows": (lambda: ((torch.randn(5, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)),
                                          dict(cu_seqlens_q=_i32(0), cu_seqlens_k=_i32(0))), "`cu_seqlens_q`"),
    "no heads, offsets past q": (lambda: ((torch.randn(5, 0, 8), torch.randn(3, 0, 8), torch.randn(3, 0, 8)),
                                          dict(cu_seqlens_q=_i32(0, 7), cu_seqlens_k=_i32(0, 3))), "`cu_seqlens_q`"),
    "no heads, cache length past capacity": (
        lambda: ((torch.randn(1, 0, 1, 8), torch.randn(1, 0, 4, 8), torch.randn(1, 0, 4, 8)),
                 dict(seqlens_k=_i32(9))), "`seqlens_k`"),
    "no heads, page outside the pool": (
        lambda: ((torch.randn(1, 0, 1, 8), torch.randn(2, 4, 0, 8), torch.randn(2, 4, 0, 8)),
                 dict(seqlens_k=_i32(8), page_table=_i32(0, 5).reshape(1, 2))), "`page_table`"),
}


@pytest.mark.parametrize("case", list(_EMPTY_BAD_INDICES))
def test_empty_problem_with_bad_index_values_raises_on_cpu(case):
    """Was: accepted (an empty problem asks no backend, so nothing read the index values); docs/errors.md:
    on a CPU every call has them checked."""
    make, name = _EMPTY_BAD_INDICES[case]
    (q, k, v), index = make()
    with pytest.raises(InvalidArgumentError, match=name):
        attnx.attention(q, k, v, **index)
    step = attnx.plan(q, k, v, **index, **({"max_seqlen_q": 0, "max_seqlen_k": 0} if "cu_seqlens_k" in index else {}))
    with pytest.raises(InvalidArgumentError, match=name):
        step.run(q, k, v, **index)


def test_empty_problems_with_good_index_values_still_run():
    out, lse = attnx.attention(torch.randn(0, 2, 8), torch.randn(0, 2, 8), torch.randn(0, 2, 8), cu_seqlens_q=_i32(0),
                               cu_seqlens_k=_i32(0), return_lse=True)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)
    out = attnx.attention(torch.randn(5, 0, 8), torch.randn(3, 0, 8), torch.randn(3, 0, 6), cu_seqlens_q=_i32(0, 5),
                          cu_seqlens_k=_i32(0, 3))
    assert out.shape == (5, 0, 6)
    out = attnx.attention(torch.randn(0, 2, 1, 8), torch.randn(2, 4, 2, 8), torch.randn(2, 4, 2, 8), seqlens_k=_i32(),
                          page_table=torch.zeros(0, 3, dtype=torch.int32))
    assert out.shape == (0, 2, 1, 8)


def test_no_backend_error_survives_pickling():
    """Was TypeError on unpickling (``__init__`` needs ``reasons``): an error raised in a worker process
    (multiprocessing, a DataLoader, a distributed helper) could not be sent back."""
    import pickle

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NoBackendError) as info:
        attnx.attention(q, q, q, sinks=torch.zeros(2), backend="torch")
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is NoBackendError and str(again) == str(info.value)
    assert again.reasons == info.value.reasons and isinstance(again, (ValueError, RuntimeError))
    for error in (InvalidArgumentError("`q` bad"), InvalidTypeError("`q` bad"), CacheCapacityError("full")):
        assert str(pickle.loads(pickle.dumps(error))) == str(error)


# -- sparse and nested tensors: a typed error, not a kernel's RuntimeError ----------------------------
def _sparse(t):
    return t.to_sparse()


_NOT_STRIDED = {
    "q sparse": (lambda q: dict(q=_sparse(q)), "`q`"),
    "k sparse": (lambda q: dict(k=_sparse(q)), "`k`"),
    "v sparse": (lambda q: dict(v=_sparse(q)), "`v`"),
    "mask sparse": (lambda q: dict(mask=_sparse(torch.ones(5, 5))), "`mask`"),
    "mask csr": (lambda q: dict(mask=torch.ones(5, 5).to_sparse_csr()), "`mask`"),
    "sinks sparse": (lambda q: dict(sinks=_sparse(torch.zeros(2))), "`sinks`"),
    "alibi sparse": (lambda q: dict(alibi_slopes=_sparse(torch.zeros(2))), "`alibi_slopes`"),
    "seqlens_k sparse": (lambda q: dict(seqlens_k=_sparse(_i32(5))), "`seqlens_k`"),
    "q nested": (lambda q: dict(q=torch.nested.nested_tensor([torch.randn(2, 5, 7)])), "`q`"),
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", list(_NOT_STRIDED))
def test_sparse_or_nested_tensors_are_type_errors(case):
    """Was a bare RuntimeError from deep inside a backend (or from the plain-call memo's ``q.shape``)."""
    from attnx import call_memo

    call_memo.clear()  # (also without it since the memo key holds the layouts: tests/test_call_memo.py)
    make, name = _NOT_STRIDED[case]
    q = torch.randn(1, 2, 5, 7)
    args = dict(q=q, k=torch.randn(1, 2, 5, 7), v=torch.randn(1, 2, 5, 7))
    args.update(make(q))
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    for entry in (attnx.attention, attnx.explain, attnx.plan):
        with pytest.raises(InvalidTypeError, match=name):
            entry(q, k, v, **args)


def test_sparse_tensors_elsewhere_are_type_errors():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(InvalidTypeError, match="`outs`"):
        attnx.merge([q.to_sparse()], [torch.zeros(1, 2, 4)])
    cache = KVCache.allocate(1, 4, 2, 8)
    with pytest.raises(InvalidTypeError, match="`k`"):
        cache.append(q.to_sparse(), q)
    with pytest.raises(InvalidTypeError, match="`cu_seqlens`"):
        cache.append(q[0].transpose(0, 1), q[0].transpose(0, 1), cu_seqlens=_i32(0, 4).to_sparse())
    with pytest.raises(InvalidTypeError, match="`k`"):
        KVCache(q.to_sparse(), q)
    assert cache.seqlens == [0]
    out, lse = attnx.attention(q, q, q, return_lse=True)
    with pytest.raises(InvalidTypeError, match="`out`"):
        attnx.attention_backward(q, q, q, out.to_sparse(), lse, out)


@pytest.mark.parametrize("window", [(2 ** 70, 0), (0, 2 ** 70), (3, 2 ** 64)])
@pytest.mark.parametrize("backend", ["naive", "blocked", "torch"])
def test_window_sides_beyond_int64_are_unbounded(window, backend):
    """Was a bare OverflowError in naive/blocked (torch clamped): a side past every position is unbounded."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    finite = tuple(min(side, 100) for side in window)
    torch.testing.assert_close(attnx.attention(q, k, v, window=window, backend=backend),
                               attnx.attention(q, k, v, window=finite, backend="naive"))


def test_q_on_another_device_is_named_before_the_index_tensors():
    """Was "`seqlens_k` must be on meta, got cpu" for a q on another device than the cache (the index
    tensors were held to q's device before q, k and v were compared). "meta" stands in for a second device."""
    q, k, v = torch.randn(2, 4, 1, 8, device="meta"), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    with pytest.raises(InvalidArgumentError, match="`q`, `k` and `v` must be on one device"):
        attnx.attention(q, k, v, seqlens_k=_i32(3, 4))
    cache = _cache(None)
    with pytest.raises(InvalidArgumentError, match="`q`, `k` and `v` must be on one device"):
        cache.attend(q, torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
    assert cache.seqlens == [3, 3]


def test_meta_index_values_for_the_cache_are_typed_errors():
    """Was NotImplementedError ("Cannot copy out of meta tensor") from the host read."""
    cache = _cache(None)
    with pytest.raises(InvalidArgumentError, match="`cu_seqlens`"):
        cache.append(torch.randn(2, 2, 8), torch.randn(2, 2, 8), cu_seqlens=_i32(0, 1, 2).to("meta"))
    with pytest.raises(InvalidArgumentError, match="`lengths`"):
        cache.set_lengths(_i32(1, 1).to("meta"))
    with pytest.raises(InvalidArgumentError, match="`lengths`"):
        KVCache(torch.randn(2, 8, 2, 8), torch.randn(2, 8, 2, 8), lengths=_i32(1, 1).to("meta"))
    assert cache.seqlens == [3, 3]


@pytest.mark.parametrize("shape", [(1, 8, 2, 4), (2, 1, 2, 4), (2, 8, 1, 4)])
def test_kvcache_refuses_storage_that_overlaps_itself(shape):
    """Was: accepted; the first append raised torch's bare RuntimeError, or (lengths differing) every sequence
    silently wrote into the same memory."""
    k = torch.zeros(shape).expand(2, 8, 2, 4)
    with pytest.raises(InvalidArgumentError, match="`k` must not overlap"):
        KVCache(k, torch.zeros(2, 8, 2, 4), lengths=[0, 1])
    with pytest.raises(InvalidArgumentError, match="`v` must not overlap"):
        KVCache(torch.zeros(2, 8, 2, 4), k)
    KVCache(torch.zeros(2, 2, 8, 4).transpose(1, 2), torch.zeros(2, 2, 8, 4).transpose(1, 2))  # views are fine
