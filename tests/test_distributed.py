"""attnx.distributed: ring attention over gloo (spawned processes) against single-process attnx.

Each world size (2 and 4) is one spawn of processes that runs every case below and writes what
it found; the tests then read it, one test per (world size, case). Every rank builds the same
full tensors from one seed, computes the single-process result with `attnx.attention`, runs
`ring_attention` on its shard and compares its rows of out, lse, dq, dk and dv (and the dsinks
summed over the ranks) within float32 tolerance. Cases with ``deterministic`` also run the ring
twice more with a backend first in line whose backward adds run-to-run noise: the two
``deterministic=True`` runs must agree bit for bit, the dispatcher's own choice must not.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import attnx
from attnx.distributed import (ALLGATHER_MAX_BYTES, choose_exchange, gather, ring_attention, shard,
                               shard_positions, unshard)

from distributed_harness import assert_every_rank_ok, results_once, run_cases

TOL = dict(atol=2e-5, rtol=2e-5)
SPAWN_TIMEOUT_S = 100

# name -> shapes and options; "S" is the global length (a multiple of 2P for P = 2, 4)
CASES = {
    "causal_zigzag": dict(causal=True),
    "causal_contiguous_gqa_bshd": dict(causal=True, sharding="contiguous", heads_kv=2, layout="bshd"),
    "window_zigzag": dict(window=(5, 3)),
    "causal_window_contiguous_gqa_dv": dict(causal=True, window=(6, None), sharding="contiguous", heads_kv=1,
                                            head_dim_v=12),
    "softcap_alibi_causal_zigzag": dict(causal=True, softcap=2.0, alibi="heads"),
    "alibi_batch_contiguous_bshd_allgather": dict(alibi="batch", sharding="contiguous", layout="bshd",
                                                  exchange="allgather"),
    "sinks_causal_zigzag_gqa": dict(causal=True, sinks=True, heads_kv=2),
    "allgather_causal_zigzag_gqa_bshd": dict(causal=True, heads_kv=2, layout="bshd", exchange="allgather"),
    "allgather_window_offset": dict(window=(4, 2), offset=3, exchange="allgather"),
    "offset_window_zigzag": dict(window=(4, 2), offset=3),
    "full_zigzag_naive": dict(backend="naive"),
    "causal_zigzag_blocked": dict(causal=True, backend="blocked", heads_kv=2, S=64),
    "masked_ranks_ring": dict(causal=True, sharding="contiguous", offset="-half"),
    "masked_ranks_sinks_allgather": dict(causal=True, sharding="contiguous", offset="-half", sinks=True,
                                         exchange="allgather"),
    "forward_only_no_grad": dict(causal=True, grad=False),
    "default_tiles_causal_zigzag_gqa": dict(causal=True, heads_kv=2, tiles=None),
    "bfloat16_causal_zigzag_gqa_bshd": dict(causal=True, heads_kv=2, layout="bshd", dtype=torch.bfloat16),
    "float64_window_sinks_allgather": dict(window=(5, 3), sinks=True, dtype=torch.float64, exchange="allgather"),
    # K/V in pieces: uneven slices of each chunk, more pieces than a chunk has rows (empty pieces at P = 4)
    "pieces_causal_zigzag": dict(causal=True, kv_pieces=3),
    "pieces_window_offset_contiguous_gqa_bshd": dict(window=(4, 2), offset=3, sharding="contiguous", heads_kv=2,
                                                     layout="bshd", kv_pieces=2),
    "pieces_softcap_alibi_sinks_zigzag_dv": dict(causal=True, softcap=2.0, alibi="heads", sinks=True, head_dim_v=12,
                                                 kv_pieces=5),
    "pieces_masked_ranks": dict(causal=True, sharding="contiguous", offset="-half", kv_pieces=2),
    "pieces_float64_window_torch_rule": dict(window=(5, 3), dtype=torch.float64, kv_pieces=4),
    "pieces_default_tiles_auto_bfloat16_gqa": dict(causal=True, heads_kv=2, dtype=torch.bfloat16, tiles=None,
                                                   kv_pieces=3, exchange="auto"),
    # deterministic=True, run twice (and once more without it), a noisy backend first in line (`_noisy_backend`)
    "deterministic_noisy_first_causal_zigzag_gqa": dict(causal=True, heads_kv=2, deterministic=True),
    "deterministic_noisy_first_allgather_window_bshd": dict(window=(5, 3), layout="bshd", exchange="allgather",
                                                            deterministic=True),
    "deterministic_noisy_first_pieces_alibi_sinks": dict(causal=True, alibi="heads", sinks=True, kv_pieces=2,
                                                         deterministic=True),
}
# float32 is the contract; bfloat16 also rounds each block's output before the merge, and
# float64 is limited by the float32 lse the backends return
TOLERANCES = {torch.float32: TOL, torch.bfloat16: dict(atol=3e-2, rtol=3e-2), torch.float64: dict(atol=1e-6, rtol=1e-6)}
# the backward's score tiles, the block backward's pieces and the dK/dV swap's pieces, small and odd
# so every case crosses row and column tile edges, cuts its pairs unevenly and swaps dK/dV in uneven
# pieces: (module under attnx.distributed, name) -> value
TINY_TILES = {("backward", "TILE_ELEMENTS"): 1, ("backward", "MIN_TILE"): 3, ("block_backward", "MIN_PIECE_ROWS"): 3,
              ("exchange", "SWAP_PIECES"): 7, ("exchange", "SWAP_MIN_PIECE_BYTES"): 100}


def _noisy_backend():
    """A copy of `blocked` whose backward adds run-to-run noise to dQ, first in line (tests/test_deterministic.py).

    Register it (`attnx.registered`); ``.calls`` lists its "forward" and "backward" runs.
    """
    from test_deterministic import _Noisy

    backend = type("NoisyBlocked", (_Noisy, type(attnx.get_backend("blocked"))), {"name": "noisy"})()
    backend.calls = []
    return backend


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _inputs(case: dict, world: int):
    g = torch.Generator().manual_seed(1234)
    batch, heads_q, seq, dim = 2, 4, case.get("S", 32), 8
    heads_kv, dim_v = case.get("heads_kv", heads_q), case.get("head_dim_v", dim)
    layout = case.get("layout", "bhsd")

    def rand(heads, width):
        t = torch.randn(batch, heads, seq, width, generator=g)
        return t.transpose(1, 2).contiguous() if layout == "bshd" else t

    dtype = case.get("dtype", torch.float32)
    q, k, v, dout = (t.to(dtype) for t in (rand(heads_q, dim), rand(heads_kv, dim), rand(heads_kv, dim_v),
                                            rand(heads_q, dim_v)))
    options = dict(causal=case.get("causal", False), window=case.get("window"), softcap=case.get("softcap"),
                   layout=layout)
    offset = case.get("offset")
    options["offset"] = -(seq // 2) if offset == "-half" else offset
    if case.get("alibi") == "heads":
        options["alibi_slopes"] = torch.rand(heads_q, generator=g) * 0.5
    elif case.get("alibi") == "batch":
        options["alibi_slopes"] = torch.rand(batch, heads_q, generator=g) * 0.5
    sinks = torch.randn(heads_q, generator=g) if case.get("sinks") else None
    return q, k, v, dout, sinks, options


def _check_case(case: dict, rank: int, world: int) -> None:
    import torch.distributed as dist

    import importlib

    from attnx.distributed import block_backward, exchange

    modules = {name: importlib.import_module(f"attnx.distributed.{name}") for name, _ in TINY_TILES}
    defaults = {key: getattr(modules[key[0]], key[1]) for key in TINY_TILES}
    for (name, attr), value in (case.get("tiles", TINY_TILES) or defaults).items():
        setattr(modules[name], attr, value)
    ran = {"kernel": 0, "torch": 0}  # which rule computed the block backwards (block_backward.py)
    originals = (block_backward.attention_backward, block_backward.backward_block)

    def counted(path, function):
        def call(*args, **kwargs):
            result = function(*args, **kwargs)
            ran[path] += 1
            return result
        return call

    block_backward.attention_backward = counted("kernel", originals[0])
    block_backward.backward_block = counted("torch", originals[1])
    sent_rows = []  # rows of every (B, H, rows, W) tensor sent around the ring
    original_shift = exchange.Ring.shift

    def shift(self, tensors, tag, out=None):
        sent_rows.extend(t.shape[2] for t in tensors if t.dim() == 4)
        return original_shift(self, tensors, tag, out)

    exchange.Ring.shift = shift
    try:
        _compare(case, rank, world, dist)
    finally:
        for (name, attr), value in defaults.items():
            setattr(modules[name], attr, value)
        block_backward.attention_backward, block_backward.backward_block = originals
        exchange.Ring.shift = original_shift
    pieces = case.get("kv_pieces", 1)
    if pieces > 1:  # nothing bigger than a piece travels: one slice of each chunk, rounded up
        chunks = 2 if case.get("sharding", "zigzag") == "zigzag" else 1
        shard_len = case.get("S", 32) // world
        most = chunks * -(-(shard_len // chunks) // pieces)
        assert sent_rows and max(sent_rows) <= most < shard_len, f"sent {sorted(set(sent_rows))}, pieces of {most}"
    if case.get("grad", True) and case.get("offset") != "-half":
        # the backends' own backward kernels with the global lse, unless none takes a given lse:
        # float64 (by default) and naive (it recomputes its normaliser) fall back to the torch-ops rule
        expected = "torch" if case.get("backend") == "naive" or case.get("dtype") == torch.float64 else "kernel"
        other = "kernel" if expected == "torch" else "torch"
        assert ran[expected] > 0 and ran[other] == 0, f"block backwards ran {ran}, expected on {expected}"


def _compare(case: dict, rank: int, world: int, dist) -> None:
    q, k, v, dout, sinks, options = _inputs(case, world)
    sharding, dim = case.get("sharding", "zigzag"), 1 if options["layout"] == "bshd" else 2
    grad = case.get("grad", True)
    backend = case.get("backend")
    full = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    ref_sinks = sinks.clone().requires_grad_(grad) if sinks is not None else None
    ref_options = dict(options, offset=options["offset"] or 0)
    with torch.set_grad_enabled(grad):
        ref_out, ref_lse = attnx.attention(*full, sinks=ref_sinks, return_lse=True, **ref_options)
        if grad:
            ref_out.backward(dout)

    def run(deterministic):
        """This rank's ``(q, k, v leaves, sinks leaf, out, lse)`` of one ring call (and its backward)."""
        part = [shard(t, rank, world, sharding=sharding, dim=dim).clone().requires_grad_(grad) for t in (q, k, v)]
        my_sinks = sinks.clone().requires_grad_(grad) if sinks is not None else None
        with torch.set_grad_enabled(grad):
            out, lse = ring_attention(*part, sharding=sharding, sinks=my_sinks, backend=backend,
                                      exchange=case.get("exchange", "ring"), kv_pieces=case.get("kv_pieces", 1),
                                      deterministic=deterministic, return_lse=True, **options)
            if grad:
                out.backward(shard(dout, rank, world, sharding=sharding, dim=dim))
        return part, my_sinks, out, lse

    (part, my_sinks, out, lse), repeats = _runs(case, run)

    # every collective first, so a failed comparison on one rank leaves no other rank waiting
    total_dsinks = None
    if grad and sinks is not None:
        total_dsinks = my_sinks.grad.clone()
        dist.all_reduce(total_dsinks)
    gathered_q = gather(part[0].detach(), sharding=sharding, dim=dim)

    mine = lambda t, d=dim: shard(t, rank, world, sharding=sharding, dim=d)  # noqa: E731
    tol = TOLERANCES[q.dtype]
    torch.testing.assert_close(out, mine(ref_out), **tol, msg="out")
    lse_tol = TOL if q.dtype != torch.bfloat16 else dict(atol=1e-3, rtol=1e-3)  # docs/semantics.md: accuracy
    torch.testing.assert_close(lse, mine(ref_lse, 2), **lse_tol, msg="lse")
    if options["offset"] is not None and options["offset"] < 0 and rank == 0:  # this rank's queries see nothing
        assert sinks is not None or bool((lse == float("-inf")).all()), "rank 0 should see no key"
    if grad:
        for name, a, b in zip("qkv", part, full):
            torch.testing.assert_close(a.grad, mine(b.grad), **tol, msg=f"d{name}")
        if sinks is not None:
            torch.testing.assert_close(total_dsinks, ref_sinks.grad, **tol, msg="dsinks summed over ranks")
    torch.testing.assert_close(gathered_q, q, msg="gather(shard(q)) == q")
    if repeats is not None:
        _check_repeats(part + [my_sinks], out, *repeats)


def _runs(case: dict, run):
    """``(run(...)'s result, repeats)``: one run; with "deterministic" in the case, that run and a
    second one on the noisy backend first in line, then one without deterministic (the control).
    `repeats` is None, or ``(again, control, avoided, noisy_ran)`` for `_check_repeats`."""
    if "deterministic" not in case:
        return run(None), None
    noisy = _noisy_backend()
    with attnx.registered(noisy):
        first = run(case["deterministic"])
        again = run(case["deterministic"])
        avoided = "backward" not in noisy.calls
        control = run(None)  # the dispatcher's first choice again: the noisy backward
    return first, (again, control, avoided, "backward" in noisy.calls)


def _check_repeats(leaves, out, again, control, avoided: bool, noisy_ran: bool) -> None:
    """Two deterministic runs agree bit for bit (out, dq, dk, dv, dsinks); a run on the noisy backward does not."""
    assert avoided, "deterministic=True ran the noisy backward"
    assert noisy_ran, "without deterministic the noisy backend was not chosen: the comparison proves nothing"
    assert _bits(again[2]) == _bits(out), "out differs between two runs"
    for name, first, second in zip(("q", "k", "v", "sinks"), leaves, again[0] + [again[1]]):
        if first is not None:
            assert _bits(first.grad) == _bits(second.grad), f"d{name} differs between two deterministic runs"
    assert _bits(control[0][0].grad) != _bits(leaves[0].grad), "the noisy backward left dq unchanged"


def _check_errors(rank: int, world: int) -> None:
    """Rejected arguments raise typed errors on every rank, and the group stays usable."""
    q = torch.randn(1, 2, 8, 4)
    # shapes differ between ranks: every rank raises
    mine = q if rank == 0 else torch.randn(1, 2, 16, 4)
    with pytest.raises(attnx.InvalidArgumentError, match="different shard length"):
        ring_attention(mine, mine, mine)
    # one rank's own arguments are wrong: it raises its error, the others say which rank
    v = q.double() if rank == 1 else q
    error = attnx.InvalidTypeError if rank == 1 else attnx.InvalidArgumentError
    with pytest.raises(error):
        ring_attention(q, q, v)
    # gradients needed on one rank only would leave the others out of the backward
    with pytest.raises(attnx.InvalidArgumentError, match="needs_grad"):
        ring_attention(q.clone().requires_grad_(rank == 0), q, q)
    # kv_pieces: a rank's own bad value raises there (the others name the rank); ranks that disagree all raise
    error = attnx.InvalidTypeError if rank == 1 else attnx.InvalidArgumentError
    with pytest.raises(error, match="kv_pieces|rank"):
        ring_attention(q, q, q, kv_pieces=2.0 if rank == 1 else 2)
    with pytest.raises(attnx.InvalidArgumentError, match="kv_pieces|rank"):
        ring_attention(q, q, q, kv_pieces=0 if rank == 0 else 2)
    with pytest.raises(attnx.InvalidArgumentError, match="different .*kv_pieces"):
        ring_attention(q, q, q, kv_pieces=2 if rank == 0 else 1)
    with pytest.raises(attnx.InvalidArgumentError, match="allgather"):  # no ring to cut into pieces
        ring_attention(q, q, q, kv_pieces=2, exchange="allgather")
    # deterministic: a rank's own bad value; ranks that require it differently (with gradients) all raise
    error = attnx.InvalidTypeError if rank == 1 else attnx.InvalidArgumentError
    with pytest.raises(error, match="`deterministic`|rank"):
        ring_attention(q, q, q, deterministic="yes" if rank == 1 else True)
    leaf = q.clone().requires_grad_()
    with pytest.raises(attnx.InvalidArgumentError, match="different deterministic"):
        ring_attention(leaf, q, q, deterministic=True if rank == 0 else None)
    ring_attention(q, q, q, deterministic=True if rank == 0 else None)  # without gradients it requires nothing
    # a named backend whose backward is not deterministic: every rank declines
    with attnx.registered(_noisy_backend()):
        with pytest.raises(attnx.NoBackendError, match="backward is not deterministic"):
            ring_attention(leaf, q, q, backend="noisy", deterministic=True)
    # ALiBi slopes whose values differ on one rank (or whose heads are swapped): every rank raises
    slopes = torch.tensor([0.5, 0.25])
    for mine in (slopes * 2, slopes.flip(0)):
        with pytest.raises(attnx.InvalidArgumentError, match="different alibi_slopes values"):
            ring_attention(q, q, q, causal=True, alibi_slopes=mine if rank == world - 1 else slopes)
    ring_attention(q, q, q, causal=True, alibi_slopes=slopes.clone())  # equal values, other tensors: agreed
    out = ring_attention(q, q, q, causal=True)  # still works
    assert out.shape == q.shape


def _worker(rank: int, world: int, outdir: str) -> None:
    def check(name: str) -> None:
        if name == "errors":
            _check_errors(rank, world)
        else:
            _check_case(CASES[name], rank, world)

    run_cases(rank, world, outdir, list(CASES) + ["errors"], check)



_RESULTS: dict = {}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", list(CASES) + ["errors"])
def test_ring_matches_single_process(world, case, tmp_path_factory):
    per_rank = results_once(_RESULTS, _worker, world, tmp_path_factory, SPAWN_TIMEOUT_S, "ring", "ring")
    assert_every_rank_ok(per_rank[case])


# -- in one process: helpers, the size rule, errors raised before any communication ----------------
@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_unshard_round_trip(sharding, world):
    x = torch.arange(2 * 3 * 24 * 2).reshape(2, 3, 24, 2)
    shards = [shard(x, r, world, sharding=sharding) for r in range(world)]
    assert torch.equal(unshard(shards, sharding=sharding), x)
    positions = torch.cat([shard_positions(r, world, 24, sharding=sharding) for r in range(world)])
    assert sorted(positions.tolist()) == list(range(24))
    for r in range(world):
        assert torch.equal(shards[r][0, 0, :, 0] // 2, shard_positions(r, world, 24, sharding=sharding))


def test_zigzag_holds_chunks_r_and_2p_minus_1_minus_r():
    assert shard_positions(1, 4, 16).tolist() == [2, 3, 12, 13]
    assert shard(torch.arange(16), 1, 4, dim=0).tolist() == [2, 3, 12, 13]
    assert shard(torch.arange(16), 1, 4, sharding="contiguous", dim=0).tolist() == [4, 5, 6, 7]


def test_shard_errors():
    with pytest.raises(attnx.InvalidArgumentError, match="multiple of 8"):
        shard(torch.zeros(1, 1, 12, 1), 0, 4)
    with pytest.raises(attnx.InvalidArgumentError, match="sharding"):
        shard(torch.zeros(1, 1, 8, 1), 0, 2, sharding="striped")
    with pytest.raises(attnx.InvalidArgumentError, match="rank"):
        shard(torch.zeros(1, 1, 8, 1), 2, 2)
    with pytest.raises(attnx.InvalidTypeError):
        shard([1, 2], 0, 1)


def test_size_rule():
    assert choose_exchange(1, 1, 1) == "ring"
    assert choose_exchange(4, 1 << 20, 1 << 20) == "allgather"                  # small K/V
    assert choose_exchange(4, 1 << 20, ALLGATHER_MAX_BYTES) == "ring"          # large K/V
    assert choose_exchange(4, 1 << 30, 1 << 27) == "allgather"                  # GQA-heavy: K/V << q


def _spec(world, rank, sharding, shard_len, causal=True, window=(None, None), offset=0):
    from attnx.distributed.spec import RingSpec

    left, right = window
    if causal:
        right = 0 if right is None else min(right, 0)
    return RingSpec(group=None, rank=rank, world_size=world, sharding=sharding, layout="bhsd", shard_len=shard_len,
                    scale=1.0, softcap=None, window_left=left, window_right=right, offset=offset, alibi_slopes=None,
                    backend=None, exchange="ring")


def _scheduled_area(spec) -> tuple[int, int]:
    """(pairs computed, query x key cells they cover) by one rank over the whole ring."""
    from attnx.distributed.schedule import pairs

    count = area = 0
    for src in range(spec.world_size):
        for _, qc, kc, _seen in pairs(spec, spec.chunks(spec.rank), spec.chunks(src)):
            count += 1
            area += qc.length * kc.length
    return count, area


def test_zigzag_balances_causal_work_and_skips_hidden_blocks():
    world, shard_len = 4, 8
    zigzag = [_scheduled_area(_spec(world, r, "zigzag", shard_len)) for r in range(world)]
    contiguous = [_scheduled_area(_spec(world, r, "contiguous", shard_len)) for r in range(world)]
    assert len({area for _, area in zigzag}) == 1          # every rank the same work
    assert [count for count, _ in contiguous] == [1, 2, 3, 4]  # rank r skips the blocks after it
    # nothing at all for a rank whose queries come before every key
    assert _scheduled_area(_spec(world, 0, "contiguous", shard_len, offset=-shard_len)) == (0, 0)
    # a window reaches one block back
    assert _scheduled_area(_spec(world, 3, "contiguous", shard_len, window=(2, 0))) == (2, 2 * shard_len ** 2)


@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world, shard_len, count", [(2, 16, 3), (4, 8, 5), (3, 12, 1), (2, 4, 8)])
def test_kv_pieces_cover_the_block_once(sharding, world, shard_len, count):
    """The pieces' rows are every row of the block once, at the global positions of the source rank's rows."""
    from dataclasses import replace

    from attnx.distributed.kv_pieces import kv_pieces

    if sharding == "zigzag" and shard_len % 2:
        pytest.skip("zigzag shards are even")
    block = torch.arange(shard_len).view(1, 1, shard_len, 1).float()
    for rank in range(world):
        spec = replace(_spec(world, rank, sharding, shard_len), kv_pieces=count)
        pieces = kv_pieces(spec)
        assert 1 <= len(pieces) <= count and all(p.rows for p in pieces)
        rows = torch.cat([p.take(block).flatten() for p in pieces]).long()
        assert sorted(rows.tolist()) == list(range(shard_len))
        for src in range(world):
            positions = shard_positions(src, world, shard_len * world, sharding=sharding)
            for p in pieces:
                taken = p.take(block).flatten().long()
                from_chunks = torch.cat([torch.arange(c.position, c.position + c.length) for c in p.chunks(spec, src)])
                assert torch.equal(from_chunks, positions[taken])
        back = torch.zeros_like(block)
        for p in pieces:
            p.put(back, p.take(block))
        assert torch.equal(back, block)


def test_kv_pieces_check():
    from attnx.distributed.rule import check_kv_pieces

    assert check_kv_pieces(4, "auto") == 4 and check_kv_pieces(1, "allgather") == 1
    for bad, error in ((True, attnx.InvalidTypeError), ("2", attnx.InvalidTypeError), (0, attnx.InvalidArgumentError)):
        with pytest.raises(error, match="kv_pieces"):
            check_kv_pieces(bad, "ring")
    with pytest.raises(attnx.InvalidArgumentError, match="allgather"):
        check_kv_pieces(2, "allgather")


def test_visibility():
    from attnx.distributed.schedule import ALL, NONE, SOME, visibility

    assert visibility(8, 4, 0, 4, None, 0) == ALL      # keys wholly before the queries
    assert visibility(0, 4, 0, 4, None, 0) == SOME     # the diagonal
    assert visibility(0, 4, 4, 4, None, 0) == NONE     # keys wholly after
    assert visibility(8, 4, 0, 4, 2, 0) == NONE        # out of the window's reach
    assert visibility(8, 4, 4, 4, 8, None) == ALL
    assert visibility(0, 0, 0, 4, None, None) == NONE  # an empty chunk


def test_errors_before_any_communication():
    """Without a process group: argument errors first, then the missing group, never a hang."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(attnx.InvalidArgumentError, match="not initialized"):
        ring_attention(q, q, q)
    with pytest.raises(attnx.InvalidTypeError, match="return_lse"):
        ring_attention(q, q, q, return_lse=1)
    with pytest.raises(attnx.InvalidTypeError, match="group"):
        ring_attention(q, q, q, group="world")


@pytest.fixture
def one_rank(monkeypatch):
    """`ring_attention` in this process as a group of one: no process group, nothing exchanged."""
    from attnx.distributed import validate, varlen_validate

    for module in (validate, varlen_validate):
        monkeypatch.setattr(module, "resolve_group", lambda group: (None, 0, 1))


@pytest.fixture
def noisy(clean_registry):
    from attnx import call_memo

    backend = _noisy_backend()
    call_memo.clear()
    with attnx.registered(backend):
        yield backend
    call_memo.clear()


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_deterministic_reaches_every_block_call(one_rank, noisy, monkeypatch, packed):
    """The ring's forward and backward block calls get ``deterministic``: the dispatcher skips the noisy backward."""
    from attnx.distributed import forward, varlen_block

    gen = torch.Generator().manual_seed(3)
    shape = (13, 2, 8) if packed else (1, 2, 12, 8)
    packing = dict(cu_seqlens_q=torch.tensor([0, 5, 13], dtype=torch.int32)) if packed else {}
    packing["cu_seqlens_k"] = packing.get("cu_seqlens_q")
    tensors = [torch.randn(shape, generator=gen) for _ in range(3)]
    given = []  # `deterministic` as each forward block call got it
    module = varlen_block if packed else forward
    attention = module.attention

    def recorded(*args, **kwargs):
        given.append(kwargs.get("deterministic", "missing"))
        return attention(*args, **kwargs)

    monkeypatch.setattr(module, "attention", recorded)

    def dq(**options):
        leaves = [t.clone().requires_grad_() for t in tensors]
        ring_attention(*leaves, causal=True, **packing, **options).sum().backward()
        return leaves[0].grad

    dq()
    assert noisy.calls.count("backward") > 0 and set(given) == {False}  # the dispatcher's first choice
    noisy.calls.clear()
    first, second = dq(deterministic=True), dq(deterministic=True)
    assert "backward" not in noisy.calls and "forward" in noisy.calls and set(given) == {False, True}
    assert _bits(first) == _bits(second)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        dq(deterministic=False)  # False never overrides torch's switch
    finally:
        torch.use_deterministic_algorithms(was)
    assert "backward" not in noisy.calls
    with pytest.raises(attnx.NoBackendError, match="backward is not deterministic") as declined:
        dq(backend="noisy", deterministic=True)
    assert "deterministic=True" in declined.value.reasons["noisy"][0]
    ring_attention(*tensors, causal=True, backend="noisy", deterministic=True, **packing)  # no gradients: fine
    with pytest.raises(attnx.InvalidTypeError, match="`deterministic`"):
        ring_attention(*tensors, deterministic=1, **packing)


def test_slopes_checksum():
    """Equal values agree whatever the tensor; another value or swapped heads differ; computed on the device."""
    from attnx.distributed.agreement import slopes_checksum

    cpu = torch.device("cpu")
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    same = slopes_checksum(slopes, cpu)
    assert torch.equal(same, slopes_checksum(slopes.clone(), cpu)) and same.dtype == torch.int64
    for other in (slopes.flip(0), slopes + torch.tensor([0, 0, 0, 1e-7]), slopes.view(2, 2)[:, :1].flatten()):
        assert not torch.equal(same, slopes_checksum(other, cpu))
    assert torch.equal(slopes_checksum(None, cpu), torch.zeros(1, dtype=torch.int64))
    # no values are read on the host: it runs on tensors that have none
    meta = torch.device("meta")
    assert slopes_checksum(torch.empty(4, device=meta), meta).device == meta


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="measures through Linux's /proc")
def test_memory_benchmark_runs(tmp_path):
    """benchmarks/ring_memory.py end to end at a toy size (its numbers are committed, not asserted)."""
    from benchmarks import ring_memory

    ring_memory.main(["--seqlen", "256", "--worlds", "1", "2", "--problems", "2x1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "ring_memory.json").read_text())
    assert {(r["world"], r["rank"]) for r in result["ranks"]} == {(1, 0), (2, 0), (2, 1)}
    assert all(r["ring"]["peak_bytes"] >= 0 for r in result["ranks"])
    assert "| 2 | allgather |" in (tmp_path / "ring_memory.md").read_text()
