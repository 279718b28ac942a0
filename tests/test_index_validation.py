"""`attnx.validate_indices()` and `attnx.check_indices`: index values read on request, the bad entry named.

Each bad value below is checked three ways: inside the mode it raises before any backend runs
(`ran` records none), `check_indices` raises the same message, and `naive` (which reads the values
itself) raises it too. Outside the mode a backend that reads values on the device is handed them
unread: the normal path never reads index values on the host for it.
"""
from __future__ import annotations

import threading
from typing import Callable, NamedTuple

import pytest
import torch

import attnx
from attnx import index_checks
from attnx.problem import FORMAT_PAIRS

HQ, HKV, D = 4, 2, 8


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def packed(cu_q=(0, 3, 7), cu_k=(0, 4, 9), **options):
    """Packed q (7 rows) and k/v (9 rows), 2 sequences."""
    q, k, v = torch.randn(7, HQ, D), torch.randn(9, HKV, D), torch.randn(9, HKV, D)
    return (q, k, v), dict(cu_seqlens_q=i32(*cu_q), cu_seqlens_k=i32(*cu_k), **options)


def cache(lengths=(3, 5), sq=1):
    """A cache of capacity 6 for 2 sequences, `sq` new queries each."""
    return (torch.randn(2, HQ, sq, D), torch.randn(2, HKV, 6, D), torch.randn(2, HKV, 6, D)), \
        dict(seqlens_k=i32(*lengths))


def paged(lengths=(3, 5), rows=((0, 1), (2, 0))):
    """A pool of 3 pages of 4 tokens; a page table of 2 pages a sequence (capacity 8)."""
    return (torch.randn(2, HQ, 1, D), torch.randn(3, 4, HKV, D), torch.randn(3, 4, HKV, D)), \
        dict(seqlens_k=i32(*lengths), page_table=torch.tensor(rows, dtype=torch.int32))


class Bad(NamedTuple):
    name: str
    make: Callable           # -> (tensors, options)
    message: str             # the start of the error's message
    naive_checks: bool = True  # naive/blocked raise it too (max_seqlen_* they do not need)


BAD = [
    Bad("cu-q-start", lambda: packed(cu_q=(1, 3, 7)), "`cu_seqlens_q`[0] = 1, must be 0"),
    Bad("cu-q-falls", lambda: packed(cu_q=(0, 5, 3, 7), cu_k=(0, 4, 4, 9)), "`cu_seqlens_q`[2] = 3 < `cu_seqlens_q`[1] = 5"),
    Bad("cu-q-end-short", lambda: packed(cu_q=(0, 3, 6)), "`cu_seqlens_q`[2] = 6, must equal the packed length 7"),
    Bad("cu-k-end-past", lambda: packed(cu_k=(0, 4, 11)), "`cu_seqlens_k`[2] = 11, must equal the packed length 9"),
    Bad("cu-k-negative", lambda: packed(cu_k=(0, -4, 9)), "`cu_seqlens_k`[1] = -4 < `cu_seqlens_k`[0] = 0"),
    Bad("max-seqlen-q-short", lambda: packed(max_seqlen_q=3), "sequence 1 has 4 rows (`cu_seqlens_q`[2] - "
        "`cu_seqlens_q`[1]) but `max_seqlen_q` = 3", naive_checks=False),
    Bad("max-seqlen-k-short", lambda: packed(max_seqlen_k=4), "sequence 1 has 5 rows (`cu_seqlens_k`[2] - "
        "`cu_seqlens_k`[1]) but `max_seqlen_k` = 4", naive_checks=False),
    Bad("cache-length-past", lambda: cache(lengths=(3, 7)), "`seqlens_k`[1] = 7 exceeds the cache capacity 6"),
    Bad("cache-length-negative", lambda: cache(lengths=(-2, 5)), "`seqlens_k`[0] = -2 is negative"),
    Bad("paged-length-past-table", lambda: paged(lengths=(3, 9)), "`seqlens_k`[1] = 9 exceeds the cache capacity 8"),
    Bad("page-past-pool", lambda: paged(rows=((0, 1), (2, 3))), "`page_table`[1, 1] = 3 is outside the pool of 3 pages"),
    Bad("page-negative", lambda: paged(lengths=(1, 5), rows=((-1, 1), (2, 0))), "`page_table`[0, 0] = -1 is outside"),
    Bad("page-huge", lambda: paged(rows=((2**31 - 1, 1), (2, 0))), "`page_table`[0, 0] = 2147483647 is outside"),
]


@pytest.mark.parametrize("bad", BAD, ids=lambda b: b.name)
def test_the_mode_names_the_entry_before_any_backend_runs(bad, ran):
    tensors, options = bad.make()
    with attnx.validate_indices():
        with pytest.raises(attnx.InvalidArgumentError) as err:
            attnx.attention(*tensors, **options)
    assert str(err.value).startswith(bad.message), str(err.value)
    assert ran == []


@pytest.mark.parametrize("bad", BAD, ids=lambda b: b.name)
def test_check_indices_and_naive_raise_the_same(bad):
    tensors, options = bad.make()
    with pytest.raises(attnx.InvalidArgumentError) as err:
        attnx.check_indices(*tensors, **options)
    assert str(err.value).startswith(bad.message)
    for backend in ("naive", "blocked"):
        if bad.naive_checks:
            with pytest.raises(attnx.InvalidArgumentError) as from_backend:
                attnx.attention(*tensors, **options, backend=backend)
            assert str(from_backend.value) == str(err.value)
        else:  # naive/blocked compute every row whatever max_seqlen_* says: a right answer, no error
            attnx.attention(*tensors, **options, backend=backend)


@pytest.mark.parametrize("entry", ["plan", "Plan.run", "explain", "flash_attn_varlen_func"])
def test_every_entry_point_checks_inside_the_mode(entry, ran):
    (q, k, v), options = paged(rows=((0, 1), (2, 7)))
    with attnx.validate_indices():
        with pytest.raises(attnx.InvalidArgumentError, match=r"`page_table`\[1, 1\] = 7"):
            if entry == "plan":
                attnx.plan(q, k, v, **options)
            elif entry == "Plan.run":
                good = dict(options, page_table=i32(0, 1, 2, 0).view(2, 2))
                attnx.plan(q, k, v, **good).run(q, k, v, **options)
            elif entry == "explain":
                attnx.explain(q, k, v, **options)
            else:
                from attnx.compat.flash_attn import flash_attn_varlen_func
                flash_attn_varlen_func(torch.randn(2, HQ, D), k, v, i32(0, 1, 2), i32(0, 3, 8), 1, 5,
                                       block_table=options["page_table"])
    assert ran == []


def test_kvcache_attend_inside_the_mode_reads_its_lengths():
    cache = attnx.KVCache.allocate(batch=2, capacity=8, heads_kv=HKV, head_dim=D, page_size=4)
    q = torch.randn(2, HQ, 1, D)
    with attnx.validate_indices():
        out = cache.attend(q, torch.randn(2, HKV, 1, D), torch.randn(2, HKV, 1, D), causal=True)
        assert out.shape == (2, HQ, 1, D)
        cache.page_table[1, 0] = 99     # edited behind the object's back
        with pytest.raises(attnx.InvalidArgumentError, match=r"`page_table`\[1, 0\] = 99 is outside the pool"):
            cache.attend(q, causal=True)


def test_kvcache_append_inside_the_mode_checks_the_pages_it_writes():
    cache = attnx.KVCache.allocate(batch=2, capacity=8, heads_kv=HKV, head_dim=D, page_size=4)
    cache.append(torch.randn(2, HKV, 3, D), torch.randn(2, HKV, 3, D))
    cache.page_table[1, 0] = -1     # edited behind the object's back: page 0 of sequence 1
    pool = cache.k.clone()
    with attnx.validate_indices():
        with pytest.raises(attnx.InvalidArgumentError, match=r"`page_table`\[1, 0\] = -1 is outside the pool"):
            cache.append(torch.randn(2, HKV, 1, D), torch.randn(2, HKV, 1, D))
    # bitwise (the pool's unused rows hold torch.empty garbage, NaN included)
    assert torch.equal(cache.k.view(torch.int32), pool.view(torch.int32)), "nothing is written before the error"
    assert cache.seqlens == [3, 3]


def test_kvcache_append_with_edited_lengths_stays_inside_the_cache():
    """An in-place edit of `cache.lengths` (outside the contract) cannot make an append write outside
    the cache: positions are clamped to its capacity (the write lands in the last slot)."""
    cache = attnx.KVCache.allocate(batch=2, capacity=8, heads_kv=HKV, head_dim=D)
    first = torch.randn(2, HKV, 2, D)
    cache.append(first, first)
    cache.lengths.fill_(1000)       # past the capacity: unclamped indexing would fail
    new = torch.randn(2, 3, HKV, D)  # one sequence each, packed: the path that builds index tensors
    cache.append(new.flatten(0, 1)[:4], new.flatten(0, 1)[:4], layout="bshd",
                 cu_seqlens=torch.tensor([0, 1, 4], dtype=torch.int32))
    assert cache.seqlens == [3, 5]
    assert torch.equal(cache.k[0, 7], new.flatten(0, 1)[0])
    assert torch.equal(cache.k[1, 7], new.flatten(0, 1)[3])
    assert torch.equal(cache.k[:, :2], first.transpose(1, 2)), "the tokens before are untouched"


def test_kvcache_append_with_an_edited_page_table_stays_inside_the_pool():
    cache = attnx.KVCache.allocate(batch=2, capacity=8, heads_kv=HKV, head_dim=D, page_size=4)
    cache.append(torch.randn(2, HKV, 3, D), torch.randn(2, HKV, 3, D))
    cache.page_table[1, 0] = 9001   # outside the pool of 4 pages: clamped to the last page
    new = torch.randn(2, HKV, 1, D)
    cache.append(new, new)
    assert cache.seqlens == [4, 4]
    assert torch.equal(cache.k[cache.k.shape[0] - 1, 3], new[1, :, 0])


def test_valid_values_give_the_same_results_inside_and_outside():
    for make in (packed, cache, paged):
        tensors, options = make()
        want = attnx.attention(*tensors, **options)
        with attnx.validate_indices():
            got = attnx.attention(*tensors, **options)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert attnx.check_indices(*tensors, **options) is None


def test_entries_a_sequence_does_not_read_may_hold_anything():
    """Page-table entries past a sequence's pages are never read: not an error."""
    tensors, options = paged(lengths=(3, 0), rows=((0, -5), (12345, 7)))
    with attnx.validate_indices():
        attnx.attention(*tensors, **options)


def test_check_indices_raises_attentions_shape_errors():
    (q, k, v), options = packed()
    with pytest.raises(attnx.InvalidTypeError, match="`cu_seqlens_q` must be int32"):
        attnx.check_indices(q, k, v, **dict(options, cu_seqlens_q=options["cu_seqlens_q"].long()))
    with pytest.raises(attnx.InvalidArgumentError, match="`cu_seqlens_k` must have 3 entries"):
        attnx.check_indices(q, k, v, **dict(options, cu_seqlens_k=i32(0, 9)))
    assert attnx.check_indices(*torch.randn(3, 1, 2, 4, 8)) is None   # dense: nothing to read
    assert attnx.check_indices(q, k, v, **options, backend="naive", return_lse=True) is None


class _DeviceSideBackend(attnx.Backend):
    """Takes every format and reads no index value (as a GPU kernel that clamps would); records calls."""

    name = "device-side-example"
    device_types = frozenset({"cpu"})
    formats = FORMAT_PAIRS
    priority = {"cpu": 1}

    def __init__(self):
        self.calls = 0

    def forward(self, p, x):
        self.calls += 1
        return attnx.alloc_out(p, x.q).zero_(), x.q.new_zeros(attnx.lse_shape(p, x.q), dtype=torch.float32)


@pytest.mark.parametrize("bad", BAD, ids=lambda b: b.name)
def test_outside_the_mode_values_are_not_read_for_a_device_side_backend(bad, clean_registry):
    backend = _DeviceSideBackend()
    tensors, options = bad.make()
    with attnx.registered(backend):
        attnx.attention(*tensors, **options, backend=backend.name)      # not read: no error
        assert backend.calls == 1
        with attnx.validate_indices(), pytest.raises(attnx.InvalidArgumentError):
            attnx.attention(*tensors, **options, backend=backend.name)
        assert backend.calls == 1


def test_the_mode_nests_restores_and_is_per_thread():
    assert not index_checks.validating()
    with attnx.validate_indices():
        assert index_checks.validating()
        with attnx.validate_indices(False):
            assert not index_checks.validating()
        assert index_checks.validating()
        seen = []
        worker = threading.Thread(target=lambda: seen.append(index_checks.validating()))
        worker.start()
        worker.join()
        assert seen == [False]            # another thread's calls are not checked
    assert not index_checks.validating()
    with pytest.raises(ZeroDivisionError):
        with attnx.validate_indices():
            1 / 0
    assert not index_checks.validating()  # restored after an exception too
    with pytest.raises(attnx.InvalidTypeError, match="`enabled`"):
        with attnx.validate_indices("yes"):
            pass


def test_works_as_a_decorator():
    @attnx.validate_indices()
    def step():
        return index_checks.validating()

    assert step() and not index_checks.validating()


def test_one_copy_for_every_index_tensor(monkeypatch):
    """Off the CPU the index tensors go to the host in one copy (faked here: `meta` cannot be read)."""
    (q, k, v), options = paged()
    x = attnx.Inputs(q, k, v, **options)
    copies = []
    real_cat = torch.cat

    class Flat:  # what torch.cat returns on a device: `.cpu()` is the one copy
        def __init__(self, t):
            self.t = t

        def cpu(self):
            copies.append(self.t.numel())
            return self.t

    monkeypatch.setattr(index_checks.torch, "cat", lambda ts: Flat(real_cat(ts)))
    fake = {name: _OnDevice(t) for name, t in (("seqlens_k", x.seqlens_k), ("page_table", x.page_table))}
    host = index_checks._on_host(x.replace(**fake))
    assert copies == [2 + 4]
    assert torch.equal(host["page_table"], x.page_table) and torch.equal(host["seqlens_k"], x.seqlens_k)


class _OnDevice:
    """A CPU tensor that says it lives on a GPU (for `_on_host`'s copy count)."""

    def __init__(self, t):
        self.t = t
        self.shape = t.shape
        self.device = torch.device("cuda", 0)

    def reshape(self, *shape):
        return self.t.reshape(*shape)

    def numel(self):
        return self.t.numel()
