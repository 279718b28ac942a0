"""attnx.distributed under review: regressions for defects found on the CPU with gloo, and P = 3.

The multi-process cases run in spawned processes (tests/distributed_harness.py), one spawn per
world size, every case bounded by the harness's timeout, so a hang fails instead of waiting:

* bad input that only some ranks see, or that differs between ranks, raises a typed error on
  every rank (never a hang, never a crashed process) and leaves the group usable: a dense
  ``max_seqlen_q`` or a non-bool ``return_lse`` on one rank, packed shards on one rank and dense
  ones on the others, tensors on another device type, other ``sinks`` values, and the same for
  `gather` / `gather_varlen` (shapes, dtypes, a rank's own bad arguments);
* a huge ``kv_pieces`` (more pieces than rows) runs at once and matches whole blocks;
* results and gradients at P = 3 (the other files test P = 2 and 4) against the whole problem
  in one process (``backend="naive"``, float64), dense and packed, and on a subgroup.
"""
from __future__ import annotations

import pytest
import torch

import attnx
from attnx.distributed import gather, gather_varlen, ring_attention, shard, shard_varlen

from distributed_harness import assert_every_rank_ok, results_once, run_cases

SPAWN_TIMEOUT_S = 150
F64 = dict(atol=1e-6, rtol=1e-6)
F32 = dict(atol=2e-5, rtol=2e-5)


def _raises_everywhere(rank: int, bad_rank: int, own_error, match_own: str, call, others_match: str = r"rank\(s\)"):
    """`call()` raises `own_error` on `bad_rank` and InvalidArgumentError (matching `others_match`) elsewhere."""
    error = own_error if rank == bad_rank else attnx.InvalidArgumentError
    with pytest.raises(error, match=match_own if rank == bad_rank else others_match):
        call()


def _still_usable(rank: int, world: int) -> None:
    q = torch.randn(1, 2, 2 * world, 4, generator=torch.Generator().manual_seed(0))
    assert ring_attention(q, q, q, causal=True).shape == q.shape


# -- bad input seen by some ranks only: typed errors everywhere -------------------------------------
def check_dense_max_seqlen_on_one_rank(rank, world):
    """Was a hang: the dense path raised before the ranks' signature all-gather, the others waited in it."""
    q = torch.randn(1, 2, 8, 4)
    _raises_everywhere(rank, 0, attnx.InvalidArgumentError, "max_seqlen_q",
                       lambda: ring_attention(q, q, q, max_seqlen_q=8 if rank == 0 else None))
    _still_usable(rank, world)


def check_return_lse_not_bool_on_one_rank(rank, world):
    """Was a hang (dense and packed): `return_lse` was checked before the all-gather."""
    q = torch.randn(1, 2, 8, 4)
    bad = world - 1
    _raises_everywhere(rank, bad, attnx.InvalidTypeError, "return_lse",
                       lambda: ring_attention(q, q, q, return_lse=1 if rank == bad else True))
    packed, cu = torch.randn(8, 2, 4), torch.tensor([0, 3, 8], dtype=torch.int32)
    _raises_everywhere(rank, bad, attnx.InvalidTypeError, "return_lse",
                       lambda: ring_attention(packed, packed, packed, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                              return_lse=None if rank == bad else False))
    _still_usable(rank, world)


def check_packed_on_one_rank_dense_on_others(rank, world):
    """Was a crashed process (SIGABRT in gloo): dense and packed signatures had other lengths."""
    if rank == 0:
        q, cu = torch.randn(8, 2, 4), torch.tensor([0, 8], dtype=torch.int32)
        call = lambda: ring_attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu)  # noqa: E731
    else:
        q = torch.randn(1, 2, 8, 4)
        call = lambda: ring_attention(q, q, q)  # noqa: E731
    with pytest.raises(attnx.InvalidArgumentError, match=r"rank\(s\) \[0\] passed packed shards"):
        call()
    _still_usable(rank, world)


def check_device_type_differs(rank, world):
    """Was a hang: tensors on another device type (meta here, CPU vs CUDA in practice) were not compared."""
    q = torch.randn(1, 2, 8, 4, device="meta" if rank == 0 else "cpu")
    with pytest.raises(attnx.InvalidArgumentError, match="different device"):
        ring_attention(q, q, q)
    _still_usable(rank, world)


def check_untyped_error_on_one_rank(rank, world):
    """Was a hang: only typed errors of a rank's own checks reached the others; any other error left them waiting
    (here: packed tensors and cu_seqlens on the meta device, whose values cannot be read)."""
    device = "meta" if rank == 0 else "cpu"
    packed, cu = torch.randn(8, 2, 4, device=device), torch.tensor([0, 8], dtype=torch.int32, device=device)
    with pytest.raises(Exception) as raised:
        ring_attention(packed, packed, packed, cu_seqlens_q=cu, cu_seqlens_k=cu)
    if rank != 0:
        assert raised.type is attnx.InvalidArgumentError and "rank(s) [0] rejected" in str(raised.value)
    # ALiBi slopes on the meta device (with meta shards): their checksum cannot reach the signature's device
    q = torch.randn(1, 2, 8, 4, device=device)
    with pytest.raises(Exception) as raised:
        ring_attention(q, q, q, alibi_slopes=torch.full((2,), 0.5, device=device))
    if rank != 0:
        assert raised.type is attnx.InvalidArgumentError and "rank(s) [0] rejected" in str(raised.value)
    _still_usable(rank, world)


def check_sinks_values_differ(rank, world):
    """Were accepted silently: each rank merged its own sinks into its rows (no single-process equivalent)."""
    q = torch.randn(1, 2, 4 * world, 4)
    sinks = torch.tensor([0.5, -1.0])
    with pytest.raises(attnx.InvalidArgumentError, match="different sinks values"):
        ring_attention(q, q, q, causal=True, sinks=sinks * 2 if rank == world - 1 else sinks)
    with pytest.raises(attnx.InvalidArgumentError, match="different sinks values"):
        ring_attention(q, q, q, sinks=sinks.flip(0) if rank == 0 else sinks)
    packed, cu = torch.randn(8, 2, 4), torch.tensor([0, 5, 8], dtype=torch.int32)
    with pytest.raises(attnx.InvalidArgumentError, match="different sinks values"):
        ring_attention(packed, packed, packed, cu_seqlens_q=cu, cu_seqlens_k=cu,
                       sinks=sinks + 1 if rank == 0 else sinks)
    ring_attention(q, q, q, causal=True, sinks=sinks.clone().requires_grad_())  # equal values: agreed


def check_gather_disagreements(rank, world):
    """Were crashed processes (shape or dtype differing) or hangs (one rank's bad `dim`)."""
    x = torch.randn(1, 2, 4, 4)
    with pytest.raises(attnx.InvalidArgumentError, match="different shape"):
        gather(x if rank else torch.randn(1, 2, 8, 4))
    with pytest.raises(attnx.InvalidArgumentError, match="different dtype"):
        gather(x.double() if rank == world - 1 else x)
    with pytest.raises(attnx.InvalidArgumentError, match="different sharding"):
        gather(x, sharding="contiguous" if rank == 0 else "zigzag")
    _raises_everywhere(rank, 0, attnx.InvalidArgumentError, "out of range",
                       lambda: gather(x, dim=7 if rank == 0 else 2))
    full = torch.arange(4.0 * world).view(1, 1, -1, 1)
    assert torch.equal(gather(shard(full, rank, world)), full)  # still works


def check_gather_varlen_disagreements(rank, world):
    """Were crashed processes (trailing shape or dtype differing) or hangs (one rank's bad cu_seqlens)."""
    x, cu = torch.randn(4, 2, 4), torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(attnx.InvalidArgumentError, match="different shape after dim 0"):
        gather_varlen(x if rank else torch.randn(4, 3, 4), cu)
    with pytest.raises(attnx.InvalidArgumentError, match="different dtype"):
        gather_varlen(x.double() if rank == world - 1 else x, cu)
    with pytest.raises(attnx.InvalidArgumentError, match="different number of sequences"):
        gather_varlen(x, cu if rank else torch.tensor([0, 2, 4], dtype=torch.int32))
    _raises_everywhere(rank, 0, attnx.InvalidArgumentError, "must equal the packed length",
                       lambda: gather_varlen(x, torch.tensor([0, 3 if rank == 0 else 4], dtype=torch.int32)))
    full_cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    full = torch.arange(12.0).view(12, 1)
    mine, mine_cu = shard_varlen(full, full_cu, rank, world)
    back, back_cu = gather_varlen(mine, mine_cu)  # still works
    assert torch.equal(back, full) and torch.equal(back_cu, full_cu)


# -- kv_pieces beyond the rows of a block ------------------------------------------------------------
def check_huge_kv_pieces(rank, world):
    """Was a hang on every rank: the pieces were found by looking at every one of `kv_pieces` slices."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 4 * world, 4, generator=g) for _ in range(3))
    results = []
    for pieces in (1, 10 ** 12):
        leaves = [shard(t, rank, world).clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*leaves, causal=True, exchange="ring", kv_pieces=pieces)
        out.sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **F32)
    cu = torch.tensor([0, 5, 0 + 5, 12], dtype=torch.int32)
    packed = [torch.randn(12, 2, 4, generator=g) for _ in range(3)]
    results = []
    for pieces in (1, 10 ** 12):
        shards = [shard_varlen(t, cu, rank, world) for t in packed]
        leaves = [s.clone().requires_grad_() for s, _ in shards]
        my_cu = shards[0][1]
        out = ring_attention(*leaves, cu_seqlens_q=my_cu, cu_seqlens_k=my_cu, causal=True, exchange="ring",
                             kv_pieces=pieces)
        out.sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **F32)


# -- P = 3 (and a subgroup) against one process -------------------------------------------------------
DENSE = {
    "dense_causal_zigzag_gqa": dict(causal=True),
    "dense_window_offset_contiguous_bshd": dict(window=(3, 1), offset=-2, sharding="contiguous", layout="bshd"),
    "dense_softcap_alibi_sinks_pieces": dict(causal=True, softcap=1.5, alibi=True, sinks=True, kv_pieces=3),
    "dense_allgather_window_sinks": dict(window=(2, 2), sinks=True, exchange="allgather"),
    "dense_float32_causal_pieces_contiguous": dict(causal=True, kv_pieces=2, sharding="contiguous",
                                                   dtype=torch.float32),
}
PACKED = {
    "packed_causal_zigzag_gqa": dict(causal=True),
    "packed_prefix_window_alibi_sinks_pieces": dict(window=(4, 1), alibi=True, sinks=True, kv_pieces=2,
                                                     lengths_k=[9, 4, 1, 20, 3, 0, 2]),
    "packed_offset_allgather_contiguous": dict(window=(3, 1), offset=2, exchange="allgather", sharding="contiguous"),
    "packed_float32_causal_prefix": dict(causal=True, lengths_k=[9, 4, 1, 20, 3, 0, 2], dtype=torch.float32),
}


def _close(name, got, want, tol):
    torch.testing.assert_close(got.double(), want.double(), **tol, msg=name)


def check_dense(rank, world, Hq=4, Hkv=2, D=8, sharding="zigzag", layout="bhsd", dtype=torch.float64, sinks=False,
                alibi=False, kv_pieces=1, exchange="ring", group=None, **options):
    import torch.distributed as dist

    g = torch.Generator().manual_seed(7)
    S = 4 * world
    shape = (lambda h: (1, h, S, D)) if layout == "bhsd" else (lambda h: (1, S, h, D))
    q, k, v, dout = (torch.randn(shape(h), generator=g, dtype=torch.float64) for h in (Hq, Hkv, Hkv, Hq))
    sink = torch.randn(Hq, generator=g) if sinks else None
    slopes = torch.rand(Hq, generator=g) * 0.5 if alibi else None
    dim = 2 if layout == "bhsd" else 1
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_sinks = sink.clone().requires_grad_() if sinks else None
    ref, ref_lse = attnx.attention(*leaves, sinks=ref_sinks, alibi_slopes=slopes, layout=layout, backend="naive",
                                   return_lse=True, **dict(options, offset=options.get("offset") or 0))
    ref.backward(dout)
    part = [shard(t, rank, world, sharding=sharding, dim=dim).to(dtype).requires_grad_() for t in (q, k, v)]
    my_sinks = sink.clone().requires_grad_() if sinks else None
    out, lse = ring_attention(*part, group=group, sharding=sharding, layout=layout, sinks=my_sinks,
                              alibi_slopes=slopes, kv_pieces=kv_pieces, exchange=exchange, return_lse=True, **options)
    out.backward(shard(dout, rank, world, sharding=sharding, dim=dim).to(dtype))
    total = None
    if sinks:
        total = my_sinks.grad.clone()
        dist.all_reduce(total, group=group)  # every collective before any comparison
    tol = F64 if dtype == torch.float64 else F32
    mine = lambda t, d=dim: shard(t, rank, world, sharding=sharding, dim=d)  # noqa: E731
    _close("out", out, mine(ref.detach()), tol)
    _close("lse", lse, mine(ref_lse, 2), tol)
    for name, a, b in zip("qkv", part, leaves):
        _close("d" + name, a.grad, mine(b.grad), tol)
    if sinks:
        _close("dsinks summed over ranks", total, ref_sinks.grad, tol)


def check_packed(rank, world, lengths=(5, 0, 1, 12, 3, 9, 7), lengths_k=None, Hq=4, Hkv=2, D=8, sharding="zigzag",
                 dtype=torch.float64, sinks=False, alibi=False, kv_pieces=1, exchange="ring", **options):
    import torch.distributed as dist

    g = torch.Generator().manual_seed(11)
    lengths_k = lengths_k or lengths
    offsets = lambda ls: torch.tensor([0] + torch.tensor(ls).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    cu_q, cu_k = offsets(lengths), offsets(lengths_k)
    q, dout = (torch.randn(int(cu_q[-1]), Hq, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(int(cu_k[-1]), Hkv, D, generator=g, dtype=torch.float64) for _ in range(2))
    sink = torch.randn(Hq, generator=g) if sinks else None
    slopes = torch.rand(len(lengths), Hq, generator=g) * 0.5 if alibi else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_sinks = sink.clone().requires_grad_() if sinks else None
    ref, ref_lse = attnx.attention(*leaves, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, sinks=ref_sinks,
                                   alibi_slopes=slopes, backend="naive", return_lse=True, **options)
    ref.backward(dout)
    cut = lambda t, cu: shard_varlen(t, cu, rank, world, sharding=sharding)  # noqa: E731
    (q_r, cu_q_r), (k_r, cu_k_r), (v_r, _) = cut(q, cu_q), cut(k, cu_k), cut(v, cu_k)
    part = [t.to(dtype).requires_grad_() for t in (q_r, k_r, v_r)]
    my_sinks = sink.clone().requires_grad_() if sinks else None
    out, lse = ring_attention(*part, cu_seqlens_q=cu_q_r, cu_seqlens_k=cu_k_r, sharding=sharding, sinks=my_sinks,
                              alibi_slopes=slopes, kv_pieces=kv_pieces, exchange=exchange, return_lse=True, **options)
    out.backward(cut(dout, cu_q)[0].to(dtype))
    total = None
    if sinks:
        total = my_sinks.grad.clone()
        dist.all_reduce(total)
    tol = F64 if dtype == torch.float64 else F32
    _close("out", out, cut(ref.detach(), cu_q)[0], tol)
    _close("lse", lse.t(), cut(ref_lse.t(), cu_q)[0], tol)
    _close("dq", part[0].grad, cut(leaves[0].grad, cu_q)[0], tol)
    _close("dk", part[1].grad, cut(leaves[1].grad, cu_k)[0], tol)
    _close("dv", part[2].grad, cut(leaves[2].grad, cu_k)[0], tol)
    if sinks:
        _close("dsinks summed over ranks", total, ref_sinks.grad, tol)


def check_subgroup(rank, world):
    """Ranks 0 and the last run the ring over a group of their own (peers named by global rank)."""
    import torch.distributed as dist

    members = [0, world - 1]
    group = dist.new_group(members)  # every rank takes part in creating it
    if rank in members:
        check_dense(dist.get_rank(group), 2, group=group, causal=True, kv_pieces=2)


ERRORS = {
    "dense_max_seqlen_on_one_rank": check_dense_max_seqlen_on_one_rank,
    "return_lse_not_bool_on_one_rank": check_return_lse_not_bool_on_one_rank,
    "packed_on_one_rank_dense_on_others": check_packed_on_one_rank_dense_on_others,
    "device_type_differs": check_device_type_differs,
    "untyped_error_on_one_rank": check_untyped_error_on_one_rank,
    "sinks_values_differ": check_sinks_values_differ,
    "gather_disagreements": check_gather_disagreements,
    "gather_varlen_disagreements": check_gather_varlen_disagreements,
    "huge_kv_pieces": check_huge_kv_pieces,
    "subgroup_of_two": check_subgroup,
}
NAMES = list(ERRORS) + list(DENSE) + list(PACKED)


def _worker(rank: int, world: int, outdir: str) -> None:
    def check(name: str) -> None:
        if name in ERRORS:
            ERRORS[name](rank, world)
        elif name in DENSE:
            check_dense(rank, world, **DENSE[name])
        else:
            check_packed(rank, world, **PACKED[name])

    run_cases(rank, world, outdir, NAMES, check)


_RESULTS: dict = {}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", NAMES)
def test_review_case(world, case, tmp_path_factory):
    per_rank = results_once(_RESULTS, _worker, world, tmp_path_factory, SPAWN_TIMEOUT_S, "review", "review")
    assert_every_rank_ok(per_rank[case])


# -- in one process ------------------------------------------------------------------------------------
def test_slices_with_rows_is_every_nonempty_slice():
    from attnx.distributed.kv_pieces import slices_with_rows

    for m in range(1, 14):
        for lengths in ([], [0], [3], [5, 2], [0, 7, 1], [13, 13], [4, 9, 2]):
            brute = [j for j in range(m) if any((j + 1) * n // m > j * n // m for n in lengths)]
            assert slices_with_rows(m, lengths) == brute, (m, lengths)
    m = 10 ** 15  # row i of a run of 3 lies in slice ceil((i + 1) * m / 3) - 1
    assert slices_with_rows(m, [3, 1]) == [-(-m // 3) - 1, -(-2 * m // 3) - 1, m - 1]


def test_huge_kv_pieces_cut_as_one_row_pieces():
    """Pieces beyond a chunk's rows: the same runs as one piece per row, found without a loop over `kv_pieces`."""
    from dataclasses import replace

    from attnx.distributed.kv_pieces import kv_pieces
    from attnx.distributed.spec import RingSpec
    from attnx.distributed.varlen_pieces import VarlenPieces
    from attnx.distributed.varlen_sharding import VarlenLayout

    spec = RingSpec(group=None, rank=1, world_size=3, sharding="zigzag", layout="bhsd", shard_len=8, scale=1.0,
                    softcap=None, window_left=None, window_right=0, offset=0, alibi_slopes=None, backend=None,
                    exchange="ring")
    huge, rows = (kv_pieces(replace(spec, kv_pieces=m)) for m in (10 ** 12, 4))
    assert [p.runs for p in huge] == [p.runs for p in rows] and len(huge) == 4
    layout = VarlenLayout([5, 0, 1, 12], 3, "zigzag")
    cut = VarlenPieces(layout, 10 ** 12)
    for rank in range(3):
        taken = sorted(int(i) for j in cut.pieces() for i in cut._index(j, rank, "cpu"))
        assert taken == list(range(layout.tokens(rank)))


def test_packed_helpers_raise_typed_errors_for_unreadable_offsets():
    """Were ValueError / IndexError / RuntimeError: `shard_positions_varlen` read ``cu_seqlens[-1]`` before
    checking its shape, and meta offsets reached ``tolist()``."""
    from attnx.distributed import shard_positions_varlen

    for bad in (torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor(5, dtype=torch.int32),
                torch.tensor([0, 5], dtype=torch.int32, device="meta")):
        with pytest.raises(attnx.InvalidArgumentError, match="cu_seqlens"):
            shard_positions_varlen(bad, 0, 2)
    with pytest.raises(attnx.InvalidArgumentError, match="meta"):
        shard_varlen(torch.randn(5, 2), torch.tensor([0, 5], dtype=torch.int32, device="meta"), 0, 2)
    assert shard_positions_varlen(torch.tensor([0, 8, 8, 11], dtype=torch.int32), 1, 2).tolist() == [2, 3, 4, 5, 0, 1]
