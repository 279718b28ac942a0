"""The blocked backend's CPU execution paths against the float64 formula: the thread pool, key pieces
merged flash-decoding style, work items, bf16/fp16 keys converted a chunk at a time, paged caches
read page by page, forced tile sizes. (The feature-by-feature checks are in test_blocked.py.)
"""
from __future__ import annotations

import pytest
import torch

import attnx
from attnx import Inputs
from test_blocked import (BACKEND, Case, assert_close, blocked_pkg, check_case, forward_module, kv_module,
                          make_inputs, pages_module, parallel_module, run_blocked, run_reference, scores_module)


def test_threaded_path_matches(monkeypatch):
    """The CPU thread pool (query tiles split among workers) gives the reference's answer."""
    monkeypatch.setattr(parallel_module, "MIN_PARALLEL_SCORES", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = make_inputs(Case())
        p = attnx.make_problem(x.q, x.k, x.v)
        assert parallel_module.worker_count(p, 4) == 2
        for mask_shape in ((1, 2, 1, 45), (1, 1, 37, 45)):  # per-worker and shared dmask
            check_case(Case(heads_q=4, heads_kv=2, mask="additive", mask_shape=(1, 4) + mask_shape[2:],
                            mask_grad=True, causal=True, tiles=(8, 16), sinks=True, offset=-3))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


# few query rows against many keys (decode, short chunks, speculative verification)
FEW_ROWS = {
    "decode_gqa": Case(seqlen_q=1, seqlen_k=300, heads_q=6, heads_kv=2),
    "chunk_causal_sinks_alibi": Case(seqlen_q=5, seqlen_k=300, heads_q=4, heads_kv=2, causal=True, sinks=True,
                                     alibi="batch"),
    "window_softcap_mask": Case(seqlen_q=3, seqlen_k=300, window=(70, 0), softcap=2.0, mask="additive",
                                mask_shape=(1, 1, 3, 300), mask_grad=True),
    "bshd": Case(seqlen_q=2, seqlen_k=300, layout="bshd", heads_q=4, heads_kv=2),
    # the first pieces see no key at all: their partial state is empty (max -inf, sum 0)
    "mask_hides_pieces": Case(seqlen_q=2, seqlen_k=300, mask="bool", mask_shape=(1, 1, 1, 300), sinks=True),
}


@pytest.mark.parametrize("name", list(FEW_ROWS))
def test_key_pieces_merge(monkeypatch, name):
    """Fewer query tiles than workers: each tile's keys are split into pieces, run apart and merged."""
    monkeypatch.setattr(parallel_module, "MIN_PARALLEL_SCORES", 0)
    monkeypatch.setattr(forward_module, "MIN_KEYS_PER_PIECE", 16)
    merged = []
    original = forward_module.merge
    monkeypatch.setattr(forward_module, "merge", lambda parts: merged.append(len(parts)) or original(parts))
    case = FEW_ROWS[name]
    x = make_inputs(case)
    if name == "mask_hides_pieces":
        x = x.replace(mask=torch.arange(300) >= 200)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check_case(case, x=x)
    finally:
        torch.set_num_threads(threads)
    assert merged and min(merged) >= 2, merged


def test_work_items_split_large_shares_of_keys():
    """A query tile holding a large share of all the keys is split into pieces that tile its key span;
    prefill tiles and a batch of equal decodes stay whole; one worker never splits."""
    def jobs(seqlen_q, seqlens_k, window=None, block_m=1):
        made = []
        for seqlen_k in seqlens_k:
            q, k, v = torch.zeros(1, 8, seqlen_q, 64), torch.zeros(1, 2, seqlen_k, 64), torch.zeros(1, 2, seqlen_k, 64)
            p = attnx.make_problem(q, k, v, window=window)
            made.append(forward_module.Job(p, Inputs(q, k, v), blocked_pkg.TileSizes(block_m, 512)))
        return made

    pieces = forward_module.PIECES_PER_WORKER
    windowed = jobs(1, [10000], window=(6000, 0))
    items = forward_module.work_items(windowed, workers=2)
    assert len(items) == 2 * pieces and not any(i.whole for i in items)
    assert (items[0].lo, items[-1].hi) == forward_module.key_span(windowed[0].p, 0, 1) == (3999, 10000)
    assert all(a.hi == b.lo for a, b in zip(items, items[1:]))
    assert len(forward_module.work_items(windowed, workers=1)) == 1
    skewed = forward_module.work_items(jobs(1, [32768] + [100] * 7), workers=2)
    assert [i.job for i in skewed if not i.whole] == [0] * (2 * pieces)
    assert all(i.whole for i in forward_module.work_items(jobs(1, [4096] * 8), workers=2))
    prefill = forward_module.work_items(jobs(4096, [4096], block_m=256), workers=2)
    assert len(prefill) == 16 and all(i.whole for i in prefill)


def test_converted_chunks(monkeypatch):
    """bf16 K/V reach the GEMMs a few keys at a time in float32; no buffer holds more than one tile."""
    monkeypatch.setattr(kv_module, "CONVERT_ELEMENTS", 1)  # MIN_CHUNK_KEYS keys per chunk
    sizes = []
    original = kv_module.buffer_for
    monkeypatch.setattr(kv_module, "buffer_for", lambda t, acc, keys: sizes.append(keys) or original(t, acc, keys))
    for layout in ("bshd", "bhsd"):
        case = Case(seqlen_q=3, seqlen_k=300, heads_q=4, heads_kv=2, layout=layout, causal=True, tiles=(16, 64))
        x = make_inputs(case, torch.bfloat16)
        out, lse, grads, dout = run_blocked(case, x)
        ref_out, ref_lse, ref_grads = run_reference(case, x, dout)
        # bf16 inputs are exact in float32: only float32 rounding and the output's bf16 rounding remain
        assert_close("lse", lse, ref_lse, 1e-5)
        assert_close("out", out, ref_out, 2 ** -8 * ref_out.abs().max().item())
        _, _, low_grads = run_reference(case, x, dout, compute_dtype=torch.bfloat16)
        for got, want, low in zip(grads, ref_grads, low_grads):
            assert_close("grad", got, want, 2 * (low.double() - want).abs().max().item() + 1e-3)
    assert max(sizes) == 64 and kv_module.MIN_CHUNK_KEYS in sizes  # backward: whole tiles; forward: chunks


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_paged_forward_reads_pages_per_tile(monkeypatch, page_size, dtype):
    """Paged keys are gathered a chunk of pages at a time (pieces starting mid-page, empty sequences,
    packed queries), and give what the naive backend gives on the same pool."""
    monkeypatch.setattr(parallel_module, "MIN_PARALLEL_SCORES", 0)
    monkeypatch.setattr(forward_module, "MIN_KEYS_PER_PIECE", 16)
    monkeypatch.setattr(kv_module, "CONVERT_ELEMENTS", 1)  # MIN_CHUNK_KEYS keys per chunk
    gathered = []
    original = pages_module.PagedKV.buffer
    monkeypatch.setattr(pages_module.PagedKV, "buffer",
                        lambda self, acc, keys: gathered.append(keys) or original(self, acc, keys))
    gen = torch.Generator().manual_seed(5)
    lengths = torch.tensor([130, 0, 301], dtype=torch.int32)
    pages = -(-301 // page_size)
    pool_k, pool_v = (torch.randn(3 * pages + 2, page_size, 2, 16, generator=gen, dtype=torch.float64).to(dtype)
                      for _ in range(2))
    table = torch.randperm(3 * pages + 2, generator=gen)[:3 * pages].view(3, pages).int()
    q = torch.randn(3, 4, 3, 16, generator=gen, dtype=torch.float64).to(dtype)
    cu_q = torch.tensor([0, 1, 1, 4], dtype=torch.int32)
    calls = {"causal_softcap": dict(causal=True, softcap=2.0),
             "window_sinks": dict(window=(50, 0), sinks=torch.ones(4)),
             "packed_q": dict(q=q.transpose(1, 2).reshape(-1, 4, 16)[:4], cu_seqlens_q=cu_q, max_seqlen_q=3,
                              causal=True)}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for options in calls.values():
            call = dict(dict(q=q), **options)
            got, got_lse = attnx.attention(k=pool_k, v=pool_v, seqlens_k=lengths, page_table=table, return_lse=True,
                                           backend="blocked", **call)
            want, want_lse = attnx.attention(k=pool_k, v=pool_v, seqlens_k=lengths, page_table=table,
                                             return_lse=True, backend="naive", **call)
            assert_close("lse", got_lse, want_lse, 1e-5)
            assert_close("out", got, want, 1e-10 if dtype == torch.float64 else 2 ** -8 * want.abs().max().item())
    finally:
        torch.set_num_threads(threads)
    assert gathered and max(gathered) == kv_module.MIN_CHUNK_KEYS


def test_tile_override(monkeypatch):
    """force_tile_sizes sets the tiles inside the block only; causal skips tiles above the diagonal."""
    x = make_inputs(Case(batch=1, heads_q=1, heads_kv=1, seqlen_q=64, seqlen_k=64))
    q, k, v = x.q, x.k, x.v
    p = attnx.make_problem(q, k, v, causal=True)
    default = BACKEND.tile_sizes(p)
    assert default == blocked_pkg.default_tile_sizes(p)
    calls = []
    original = scores_module.score_tile

    def counting(ops, q_tile, i0, i1, j0, j1, *args, **kwargs):
        calls.append((i0, i1, j0, j1))
        return original(ops, q_tile, i0, i1, j0, j1, *args, **kwargs)

    monkeypatch.setattr(forward_module, "score_tile", counting)
    with blocked_pkg.force_tile_sizes(block_m=16, block_n=16):
        assert BACKEND.tile_sizes(p) == (16, 16)
        with torch.no_grad():
            attnx.attention(q, k, v, causal=True, backend="blocked")
    assert BACKEND.tile_sizes(p) == default
    # query tile t sees keys [0, 16 t + 16): t + 1 key tiles, 10 of the 16 pairs
    assert len(calls) == 10
    assert all(j1 <= i1 for _, i1, _, j1 in calls)
    with pytest.raises(ValueError):
        with BACKEND.force_tile_sizes(block_m=0):
            pass
    with pytest.raises(TypeError):
        with BACKEND.force_tile_sizes(block_n=2.5):
            pass
