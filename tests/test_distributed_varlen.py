"""attnx.distributed with packed (varlen) batches: ring attention over gloo against single-process attnx.

Each world size (2 and 4) is one spawn of processes running every case below. Every rank builds
the same packed batch (sequences of unequal lengths, including 0 and fewer tokens than ranks)
from one seed, computes `attnx.attention` on the whole batch, runs `ring_attention` on its
`shard_varlen` shard and compares its rows of out, lse, dq, dk and dv (and dsinks summed over
the ranks) within float32 tolerance. Cases with ``deterministic`` also run the ring twice more
with a backend first in line whose backward adds run-to-run noise (as tests/test_distributed.py).
"""
from __future__ import annotations

import pytest
import torch

import attnx
from attnx.distributed import (gather_varlen, ring_attention, shard_positions_varlen, shard_varlen,
                               unshard_varlen)
from attnx.distributed.varlen_calls import VarlenSpec, plan_block
from attnx.distributed.varlen_sharding import VarlenLayout

from distributed_harness import assert_every_rank_ok, results_once, run_cases
from test_distributed import _check_repeats, _runs

TOL = dict(atol=2e-5, rtol=2e-5)
SPAWN_TIMEOUT_S = 100
# 0 tokens, fewer tokens than ranks (and than the 2P zigzag pieces), and longer ones
LENGTHS = [5, 0, 1, 12, 3, 9, 7]

CASES = {
    "causal_zigzag": dict(causal=True),
    "causal_contiguous_gqa": dict(causal=True, sharding="contiguous", heads_kv=2),
    "window_softcap_alibi_sinks_zigzag_gqa": dict(window=(4, 2), softcap=3.0, alibi="batch", sinks=True, heads_kv=1),
    "allgather_causal_zigzag_gqa": dict(causal=True, heads_kv=2, exchange="allgather"),
    "allgather_offset_window_contiguous": dict(window=(3, 1), offset=2, sharding="contiguous", exchange="allgather",
                                               alibi="heads"),
    "naive_causal_contiguous_torch_rule": dict(causal=True, sharding="contiguous", backend="naive", heads_kv=2),
    "forward_only_causal_zigzag": dict(causal=True, grad=False),
    # P = 4: ranks 1 and 2 hold no token at all (P = 2: rank 1 holds one)
    "tiny_batch_empty_ranks_zigzag_gqa": dict(causal=True, heads_kv=2, lengths=[1, 0, 2]),
    "tiny_batch_empty_ranks_allgather_window": dict(window=(1, 0), lengths=[2, 1], exchange="allgather"),
    "no_tokens_at_all": dict(causal=True, lengths=[0, 0]),
    "float64_window_sinks_torch_rule": dict(window=(2, 3), sinks=True, dtype=torch.float64),
    "bfloat16_causal_zigzag_gqa": dict(causal=True, heads_kv=2, dtype=torch.bfloat16),
    # K/V in pieces: uneven slices of every sequence piece, sequences shorter than the pieces
    "pieces_causal_zigzag_gqa": dict(causal=True, heads_kv=2, kv_pieces=3),
    "pieces_window_softcap_alibi_sinks_contiguous": dict(window=(4, 2), softcap=3.0, alibi="batch", sinks=True,
                                                         sharding="contiguous", kv_pieces=2),
    "pieces_offset_window_alibi_float64_torch_rule": dict(window=(3, 1), offset=2, alibi="heads", dtype=torch.float64,
                                                          kv_pieces=4),
    "pieces_tiny_batch_empty_ranks_auto": dict(causal=True, lengths=[1, 0, 2], kv_pieces=2, exchange="auto"),
    # queries that continue a longer key sequence (chunked prefill against a prefix): bottom-right per sequence;
    # a sequence with keys and no queries, one with more queries than keys (its first rows see no key)
    "prefix_causal_zigzag_gqa": dict(causal=True, heads_kv=2, lengths_k=[9, 4, 1, 20, 3, 15, 2]),
    "prefix_window_alibi_sinks_contiguous_pieces": dict(window=(4, 2), alibi="batch", sinks=True, sharding="contiguous",
                                                        lengths_k=[9, 4, 1, 20, 3, 15, 2], kv_pieces=2),
    "prefix_offset_window_allgather": dict(window=(3, 1), offset=2, exchange="allgather",
                                           lengths_k=[9, 4, 1, 20, 3, 15, 2]),
    "prefix_float64_causal_softcap_torch_rule": dict(causal=True, softcap=2.0, dtype=torch.float64,
                                                     lengths_k=[9, 4, 1, 20, 3, 15, 2]),
    # deterministic=True, run twice (and once more without it), a noisy backend first in line
    "deterministic_noisy_first_causal_zigzag_gqa": dict(causal=True, heads_kv=2, deterministic=True),
    "deterministic_noisy_first_allgather_window_alibi_sinks": dict(window=(4, 2), alibi="batch", sinks=True,
                                                                   exchange="allgather", deterministic=True),
    "deterministic_noisy_first_prefix_pieces": dict(causal=True, lengths_k=[9, 4, 1, 20, 3, 15, 2], kv_pieces=2,
                                                    deterministic=True),
}
# float32 is the contract; bfloat16 also rounds each local call's output before the merge, and
# float64 is limited by the float32 lse the backends return
TOLERANCES = {torch.float32: TOL, torch.bfloat16: dict(atol=3e-2, rtol=3e-2), torch.float64: dict(atol=1e-6, rtol=1e-6)}


def _inputs(case: dict):
    g = torch.Generator().manual_seed(4321)
    heads_q, dim = 4, 8
    heads_kv = case.get("heads_kv", heads_q)
    lengths = case.get("lengths", LENGTHS)
    cu, cu_k = (torch.tensor([0] + torch.tensor(n, dtype=torch.long).cumsum(0).tolist(), dtype=torch.int32)
                for n in (lengths, case.get("lengths_k", lengths)))
    total, total_k = int(cu[-1]), int(cu_k[-1])
    q, k, v, dout = (torch.randn(n, h, dim, generator=g).to(case.get("dtype", torch.float32))
                     for n, h in ((total, heads_q), (total_k, heads_kv), (total_k, heads_kv), (total, heads_q)))
    options = dict(causal=case.get("causal", False), window=case.get("window"), softcap=case.get("softcap"),
                   offset=case.get("offset"))
    if case.get("alibi") == "heads":
        options["alibi_slopes"] = torch.rand(heads_q, generator=g) * 0.5
    elif case.get("alibi") == "batch":
        options["alibi_slopes"] = torch.rand(len(lengths), heads_q, generator=g) * 0.5
    sinks = torch.randn(heads_q, generator=g) if case.get("sinks") else None
    return q, k, v, dout, cu, cu_k, sinks, options


def _compare(case: dict, rank: int, world: int, dist) -> None:
    from attnx.distributed import exchange, varlen_block

    q, k, v, dout, cu, cu_k, sinks, options = _inputs(case)
    sharding, grad, backend = case.get("sharding", "zigzag"), case.get("grad", True), case.get("backend")
    full = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    ref_sinks = sinks.clone().requires_grad_(grad) if sinks is not None else None
    with torch.set_grad_enabled(grad):
        ref_out, ref_lse = attnx.attention(*full, cu_seqlens_q=cu, cu_seqlens_k=cu_k, sinks=ref_sinks,
                                           return_lse=True, **options)
        if grad:
            ref_out.backward(dout)

    mine = lambda t: shard_varlen(t, cu, rank, world, sharding=sharding)[0]  # noqa: E731
    mine_k = lambda t: shard_varlen(t, cu_k, rank, world, sharding=sharding)[0]  # noqa: E731
    cu_mine = shard_varlen(q, cu, rank, world, sharding=sharding)[1]
    cu_k_mine = shard_varlen(k, cu_k, rank, world, sharding=sharding)[1]
    ran = {"kernel": 0, "torch": 0}
    original = varlen_block.BlockBackward.add

    def counted(self, *args):
        original(self, *args)
        ran["kernel"], ran["torch"] = ran["kernel"] + self.kernel_calls, ran["torch"] + self.torch_pairs
        self.kernel_calls = self.torch_pairs = 0

    varlen_block.BlockBackward.add = counted
    sent_rows = []  # rows of every (T, H, W) tensor sent around the ring
    original_shift = exchange.Ring.shift

    def shift(self, tensors, tag, out=None):
        sent_rows.extend(t.shape[0] for t in tensors if t.dim() == 3)
        return original_shift(self, tensors, tag, out)

    exchange.Ring.shift = shift

    def run(deterministic):
        """This rank's ``(q, k, v leaves, sinks leaf, out, lse)`` of one ring call (and its backward)."""
        part = [mine(q).clone().requires_grad_(grad)] + [mine_k(t).clone().requires_grad_(grad) for t in (k, v)]
        my_sinks = sinks.clone().requires_grad_(grad) if sinks is not None else None
        with torch.set_grad_enabled(grad):
            out, lse = ring_attention(*part, cu_seqlens_q=cu_mine, cu_seqlens_k=cu_k_mine, sharding=sharding,
                                      sinks=my_sinks, backend=backend, exchange=case.get("exchange", "ring"),
                                      kv_pieces=case.get("kv_pieces", 1), deterministic=deterministic,
                                      return_lse=True, **options)
            if grad:
                out.backward(mine(dout))
        return part, my_sinks, out, lse

    try:
        (part, my_sinks, out, lse), repeats = _runs(case, run)
    finally:
        varlen_block.BlockBackward.add = original
        exchange.Ring.shift = original_shift
    longest = max(shard_varlen(k, cu_k, r, world, sharding=sharding)[0].shape[0] for r in range(world))
    if case.get("kv_pieces", 1) > 1 and longest:  # pieces travel, never a (padded) block
        assert sent_rows, "nothing travelled around the ring"
        assert max(sent_rows) < longest or "lengths" in case, f"sent {sorted(set(sent_rows))} of {longest} rows"

    # every collective first, so a failed comparison on one rank leaves no other rank waiting
    total_dsinks = None
    if grad and sinks is not None:
        total_dsinks = my_sinks.grad.clone()
        dist.all_reduce(total_dsinks)
    gathered_q, gathered_cu = gather_varlen(part[0].detach(), cu_mine, sharding=sharding)

    tol = TOLERANCES[q.dtype]
    assert lse.shape == (q.shape[1], part[0].shape[0]), f"varlen lse is (Hq, T_rank), got {tuple(lse.shape)}"
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out, mine(ref_out), **tol, msg="out")
    lse_tol = TOL if q.dtype != torch.bfloat16 else dict(atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(lse, mine(ref_lse.t()).t(), **lse_tol, msg="lse")
    if grad:
        for name, a, b, cut in zip("qkv", part, full, (mine, mine_k, mine_k)):
            torch.testing.assert_close(a.grad, cut(b.grad), **tol, msg=f"d{name}")
        if sinks is not None:
            torch.testing.assert_close(total_dsinks, ref_sinks.grad, **tol, msg="dsinks summed over ranks")
        # the backends' own backward with the given lse; naive recomputes its normaliser and float64
        # backwards may refine the lse: the torch-ops rule (neither on a rank that holds no token)
        expected = "torch" if backend == "naive" or q.dtype == torch.float64 else "kernel"
        if part[0].shape[0]:
            assert ran[expected] > 0 and ran["kernel" if expected == "torch" else "torch"] == 0, f"ran {ran}"
    torch.testing.assert_close(gathered_q, q, msg="gather_varlen(shard_varlen(q)) == q")
    assert torch.equal(gathered_cu, cu)
    if repeats is not None:
        _check_repeats(part + [my_sinks], out, *repeats)


def _check_errors(rank: int, world: int) -> None:
    """Bad packed shards raise typed errors on every rank, and the group stays usable."""
    cu = torch.tensor([0, 6, 9], dtype=torch.int32)
    q = torch.randn(9, 2, 4)
    mine, cu_mine = shard_varlen(q, cu, rank, world)
    # cut otherwise than shard_varlen: rank 0 holds one token more of sequence 0, the last rank one less
    wrong = cu_mine.clone()
    if rank == 0:
        wrong[1:] += 1
    elif rank == world - 1:
        wrong[1:] -= 1
    shard = torch.randn(int(wrong[-1]), 2, 4)
    with pytest.raises(attnx.InvalidArgumentError, match="shard_varlen"):
        ring_attention(shard, shard, shard, cu_seqlens_q=wrong, cu_seqlens_k=wrong, causal=True)
    # k cut otherwise than shard_varlen (rank 0 holds none of sequence 0's keys)
    other = cu_mine.clone()
    other[1] = 0
    with pytest.raises(attnx.InvalidArgumentError, match="shard_varlen"):
        ring_attention(mine, mine, mine, cu_seqlens_q=cu_mine, cu_seqlens_k=other if rank == 0 else cu_mine)
    # ranks with different numbers of sequences
    one = torch.tensor([0, mine.shape[0]], dtype=torch.int32)
    with pytest.raises(attnx.InvalidArgumentError, match="batch"):
        ring_attention(mine, mine, mine, cu_seqlens_q=one if rank == 1 else cu_mine,
                       cu_seqlens_k=one if rank == 1 else cu_mine)
    # a backend that declines packed calls: raised on every rank before any K/V moves
    with pytest.raises(attnx.NoBackendError):
        ring_attention(mine, mine, mine, cu_seqlens_q=cu_mine, cu_seqlens_k=cu_mine, backend="torch")
    # kv_pieces: differ between ranks; a rank's own bad value
    with pytest.raises(attnx.InvalidArgumentError, match="kv_pieces"):
        ring_attention(mine, mine, mine, cu_seqlens_q=cu_mine, cu_seqlens_k=cu_mine, kv_pieces=3 if rank else 2)
    error = attnx.InvalidTypeError if rank == 0 else attnx.InvalidArgumentError
    with pytest.raises(error, match="kv_pieces|rank"):
        ring_attention(mine, mine, mine, cu_seqlens_q=cu_mine, cu_seqlens_k=cu_mine, kv_pieces=None if rank == 0 else 2)
    # options differ between ranks
    with pytest.raises(attnx.InvalidArgumentError, match="options"):
        ring_attention(mine, mine, mine, cu_seqlens_q=cu_mine, cu_seqlens_k=cu_mine, causal=rank == 0)
    # deterministic: a rank's own bad value; ranks that require it differently (with gradients)
    packed = dict(cu_seqlens_q=cu_mine, cu_seqlens_k=cu_mine)
    error = attnx.InvalidTypeError if rank == 0 else attnx.InvalidArgumentError
    with pytest.raises(error, match="`deterministic`|rank"):
        ring_attention(mine, mine, mine, deterministic=None if rank else 0, **packed)
    leaf = mine.clone().requires_grad_()
    with pytest.raises(attnx.InvalidArgumentError, match="different deterministic"):
        ring_attention(leaf, mine, mine, deterministic=rank == world - 1, **packed)
    # per-sequence ALiBi slopes that differ on one rank: every rank raises
    slopes = torch.tensor([[0.5, 0.25], [0.125, 0.0625]])
    with pytest.raises(attnx.InvalidArgumentError, match="different alibi_slopes values"):
        ring_attention(mine, mine, mine, alibi_slopes=slopes.flip(0) if rank == 0 else slopes, **packed)
    out = ring_attention(mine, mine, mine, cu_seqlens_q=cu_mine, cu_seqlens_k=cu_mine, causal=True)  # still works
    assert out.shape == mine.shape


def _worker(rank: int, world: int, outdir: str) -> None:
    import torch.distributed as dist

    def check(name: str) -> None:
        if name == "errors":
            _check_errors(rank, world)
        else:
            _compare(CASES[name], rank, world, dist)

    run_cases(rank, world, outdir, list(CASES) + ["errors"], check)



_RESULTS: dict = {}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", list(CASES) + ["errors"])
def test_varlen_ring_matches_single_process(world, case, tmp_path_factory):
    per_rank = results_once(_RESULTS, _worker, world, tmp_path_factory, SPAWN_TIMEOUT_S, "varlen ring", "ringv")
    assert_every_rank_ok(per_rank[case])


# -- in one process: the helpers and the grouping of local calls -----------------------------------
@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_varlen_round_trip(sharding, world):
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(int(cu[-1]), 3, 2)
    parts = [shard_varlen(x, cu, r, world, sharding=sharding) for r in range(world)]
    assert sum(p[0].shape[0] for p in parts) == x.shape[0]
    back, back_cu = unshard_varlen([p[0] for p in parts], [p[1] for p in parts], sharding=sharding)
    assert torch.equal(back, x) and torch.equal(back_cu, cu)
    within = torch.cat([torch.arange(n) for n in LENGTHS])
    for r in range(world):
        assert torch.equal(shard_positions_varlen(cu, r, world, sharding=sharding),
                           shard_varlen(within, cu, r, world, sharding=sharding)[0])


def test_shard_varlen_pieces():
    cu = torch.tensor([0, 8, 8, 11], dtype=torch.int32)  # lengths 8, 0, 3; zigzag over 2 ranks: 4 pieces each
    x = torch.arange(11)
    assert shard_varlen(x, cu, 0, 2)[0].tolist() == [0, 1, 6, 7, 10]    # pieces 0 and 3 of each sequence
    assert shard_varlen(x, cu, 1, 2)[0].tolist() == [2, 3, 4, 5, 8, 9]
    assert shard_varlen(x, cu, 1, 2)[1].tolist() == [0, 4, 4, 6]
    assert shard_varlen(x, cu, 1, 2, sharding="contiguous")[0].tolist() == [4, 5, 6, 7, 9, 10]


def test_shard_varlen_errors():
    x = torch.randn(5, 2)
    # a bad entry is named (attnx.index_checks.check_offsets)
    with pytest.raises(attnx.InvalidArgumentError, match=r"`cu_seqlens`\[2\] = 4, must equal .* \(`x` has 5 rows\)"):
        shard_varlen(x, torch.tensor([0, 2, 4], dtype=torch.int32), 0, 2)
    with pytest.raises(attnx.InvalidArgumentError, match=r"`cu_seqlens`\[0\] = 1, must be 0"):
        shard_positions_varlen(torch.tensor([1, 2, 5], dtype=torch.int32), 0, 2)
    with pytest.raises(attnx.InvalidArgumentError, match=r"`cu_seqlens\[1\]`\[2\] = 1 < `cu_seqlens\[1\]`\[1\] = 3"):
        unshard_varlen([x[:2], x[:3]], [torch.tensor(cu, dtype=torch.int32) for cu in ([0, 1, 2], [0, 3, 1])])
    with pytest.raises(attnx.InvalidTypeError, match="cu_seqlens"):
        shard_varlen(x, [0, 5], 0, 2)
    with pytest.raises(attnx.InvalidArgumentError, match="rank"):
        shard_varlen(x, torch.tensor([0, 5], dtype=torch.int32), 2, 2)
    a, b = (shard_varlen(x, torch.tensor([0, 5], dtype=torch.int32), r, 2) for r in range(2))
    with pytest.raises(attnx.InvalidArgumentError, match="shard_varlen"):  # shards swapped: not the zigzag cut
        unshard_varlen([b[0], a[0]], [b[1], a[1]])


def _spec(world, rank, sharding, lengths, window=(None, 0), offset=0):
    from attnx.distributed.spec import RingSpec

    ring = RingSpec(group=None, rank=rank, world_size=world, sharding=sharding, layout="varlen", shard_len=0,
                    scale=1.0, softcap=None, window_left=window[0], window_right=window[1], offset=offset,
                    alibi_slopes=None, backend=None, exchange="ring")
    return VarlenSpec(ring=ring, layout=VarlenLayout(lengths, world, sharding), per_sequence_slopes=False)


@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
def test_causal_blocks_need_no_explicit_offset(sharding):
    """Causal self-attention: one call per (query slot, key slot), bottom-right or unmasked, never an offset."""
    world = 4
    for rank in range(world):
        for src in range(world):
            calls = plan_block(_spec(world, rank, sharding, LENGTHS), rank, src, "cpu")
            assert len(calls) <= (4 if sharding == "zigzag" else 1)
            assert all(c.offset is None for c in calls)
            if sharding == "contiguous":  # a later rank's keys are hidden from an earlier rank's queries
                assert bool(calls) == (src <= rank)


def test_window_blocks_group_by_offset():
    """A window cuts pieces at per-sequence offsets: the calls cover exactly the pairs in the band."""
    from attnx.distributed.schedule import NONE, visibility

    lengths, world = [10, 17, 4], 2
    spec = _spec(world, 0, "contiguous", lengths, window=(3, 1))
    calls = plan_block(spec, 0, 1, "cpu")
    covered = sorted(qc.seq for c in calls for qc, _, _ in c.pairs)
    q_slot, k_slot = spec.layout.slots(0)[0], spec.layout.slots(1)[0]
    expected = [qc.seq for qc, kc in zip(q_slot, k_slot)
                if visibility(qc.position, qc.length, kc.position, kc.length, 3, 1) != NONE]
    assert covered == expected and len(expected) == 3
    assert {c.offset for c in calls} == {-5, -8, -2}  # one per distinct offset: 0 - 5, 0 - 8, 0 - 2


@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world, count", [(2, 3), (4, 2), (3, 20)])
def test_varlen_kv_pieces_cover_each_block_once(sharding, world, count):
    """Every rank's pieces take each row of its block once, and their slots say each row's position in its sequence."""
    from attnx.distributed.varlen_pieces import VarlenPieces

    layout = VarlenLayout(LENGTHS, world, sharding)
    cut = VarlenPieces(layout, count)
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32)
    within = torch.cat([torch.arange(n) for n in LENGTHS])
    seq = torch.cat([torch.full((n,), b) for b, n in enumerate(LENGTHS)])
    for rank in range(world):
        block = torch.arange(layout.tokens(rank)).view(-1, 1, 1).float()
        taken = []
        for j in cut.pieces():
            piece = cut.take(j, rank, block)
            assert piece.shape[0] == cut.rows[j]
            chunks = [c for slot in cut.slots(j, rank) for c in slot if c.length]
            rows = torch.cat([piece.flatten()[c.start:c.start + c.length] for c in chunks]).long()
            expected = torch.cat([torch.arange(c.position, c.position + c.length) for c in chunks])
            assert torch.equal(shard_varlen(within, cu, rank, world, sharding=sharding)[0][rows], expected)
            assert torch.equal(shard_varlen(seq, cu, rank, world, sharding=sharding)[0][rows],
                               torch.cat([torch.full((c.length,), c.seq) for c in chunks]))
            taken += rows.tolist()
            back = torch.zeros_like(block)
            cut.put(j, rank, back, piece)
            assert torch.equal(back.flatten()[rows], rows.float())
        assert sorted(taken) == list(range(layout.tokens(rank)))


def test_varlen_errors_before_any_communication():
    """Without a process group: argument errors first, then the missing group, never a hang."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    q, cu = torch.randn(6, 2, 4), torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(attnx.InvalidArgumentError, match="not initialized"):
        ring_attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu)
    with pytest.raises(attnx.InvalidArgumentError, match="max_seqlen_q"):  # dense shards have no packed lengths
        ring_attention(q[None], q[None], q[None], max_seqlen_q=4)
