"""CPU checks of the cuda backend's split-KV decode kernel (no GPU here; checked on the H200 2026-12-02).

What runs without a GPU: the check harness with the float32 formula as the kernel (`--self-test`),
the launcher's host side with the kernels' index arithmetic emulated in torch on the record it packs
(`--emulate`: splits, warp key blocks, clamped lengths and page entries, the warp merge and the
combine; an out-of-bounds read raises there), the record's layout against the C struct, the split
heuristic, the variants and a no-spill compile. The kernels themselves run in
`python -m benchmarks.cuda_decode check` on a GPU.
"""
import unittest.mock as mock

import pytest
import torch

import attnx
from attnx.inputs import Inputs
from attnx.backends.cuda import families, launch_decode, nvrtc_check, variants
from attnx.backends.cuda.compile import kernel_source, nvrtc_options
from attnx.problem import Problem
from benchmarks import cuda_decode, decode_emulate


def _nvrtc() -> str:
    return nvrtc_check.unavailable_reason()


def test_self_test_harness_passes(capsys):
    assert cuda_decode.main(["check", "--self-test", "--only", "len"]) == 0
    assert "cases passed" in capsys.readouterr().out


def test_emulated_kernels_pass_every_case(capsys):
    """Every case of the GPU check, with the launcher's record and the kernels' arithmetic emulated."""
    assert cuda_decode.main(["check", "--emulate"]) == 0
    out = capsys.readouterr().out
    assert "BAD" not in out and f"{len(cuda_decode.cases())} of {len(cuda_decode.cases())} cases passed" in out


@pytest.fixture
def lossy_emulation(monkeypatch):
    """The emulated kernels with splits that cover half their keys (what a blind harness would pass)."""
    real = cuda_decode.emulate

    def lossy(plan):
        args = plan.args.copy()
        args["split_keys"] = max(16, int(args["split_keys"]) // 2)
        return real(plan._replace(args=args))

    monkeypatch.setattr(cuda_decode, "emulate", lossy)


def test_emulation_catches_lost_keys(lossy_emulation):
    """The harness is not blind: splits that cover half their keys fail."""
    assert not cuda_decode.check(cuda_decode.cases()[:12], cuda_decode.emulated_forward, "cpu", only="len")


def test_record_matches_the_c_struct():
    reason = _nvrtc()
    if reason:
        pytest.skip(reason)
    dtype = launch_decode.DECODE_PARAMS_DTYPE
    checks = [f"static_assert(__builtin_offsetof(DecodeParams, {n}) == {dtype.fields[n][1]}, \"{n}\");"
              for n in dtype.names]
    checks.append(f"static_assert(sizeof(DecodeParams) == {dtype.itemsize}, \"size\");")
    source = kernel_source("sm80/fa_decode.cu") + "\n" + "\n".join(checks) + "\n"
    ok, log, _ = nvrtc_check.compile_source(source, "decode_params.cu",
                                            ("-arch=sm_80", "-std=c++17", "-DIS_BF16=1", "-DDECODE_COMBINE=1"))
    assert ok, log


@pytest.mark.parametrize("programs,slots,capacity,want", [(512, 264, 131072, 1), (300, 264, 131072, 1),
                                                          (8, 264, 0, 1), (8, 264, 100, 1)])
def test_splits_heuristic_edges(programs, slots, capacity, want):
    assert launch_decode.num_splits(programs, slots, capacity, 64) == want


@pytest.mark.parametrize("programs,want", [(8, 33), (64, 4), (16, 16), (100, 5)])
def test_splits_fill_one_wave_when_they_can(programs, want):
    """B = 1 (8 programs, 264 slots): 33 splits, one full wave (1-4 % faster than 29 on the H200); B = 8:
    4 (256 of 264); 100 programs cannot fill one wave to 95 %: the 85 % rule's 5."""
    assert launch_decode.num_splits(programs, 264, 131072, 64) == want


@pytest.mark.parametrize("programs,slots,capacity,want", [(8, 264, 4096, 16), (8, 396, 4096, 16), (8, 396, 8192, 32),
                                                          (8, 264, 2048, 8), (16, 264, 4096, 16), (40, 264, 4096, 6)])
def test_short_keys_take_every_split_that_fits_one_wave(programs, slots, capacity, want):
    """Where even the most splits (>= MIN_SPLIT_KEYS keys each) stay inside one wave, all of them: B = 1, 4k on
    the H200 ran 1.04-1.10x faster with 16 splits than the 85 % rule's 13 (run 14); past one wave the rules
    before it hold (40 programs x 16 splits > 264 slots: 6 fill one wave)."""
    assert launch_decode.num_splits(programs, slots, capacity, 64) == want


def test_splits_cover_the_capacity():
    for programs in (1, 4, 16, 64, 200):
        for capacity in (1, 255, 256, 4097, 131072):
            s = launch_decode.num_splits(programs, 264, capacity, 64)
            assert 1 <= s <= launch_decode.MAX_SPLITS
            assert s == 1 or capacity // s >= launch_decode.MIN_SPLIT_KEYS


def test_prepare_packs_a_paged_call_on_the_host():
    q = torch.randn(2, 32, 1, 128).to(torch.bfloat16)
    k = torch.randn(40, 16, 8, 128).to(torch.bfloat16)
    table = torch.arange(40, dtype=torch.int32).reshape(2, 20)
    lens = torch.tensor([300, 17], dtype=torch.int32)
    from attnx.autograd import backend_view
    from attnx.problem import make_call

    p, x = make_call(q, k, k, seqlens_k=lens, page_table=table, grad_inputs=())
    p = p._replace(device_type="cuda", vendor="nvidia", arch="sm_90")
    plan = launch_decode.prepare(p, backend_view(p, x), 132)
    r = plan.args
    assert plan.variant.kernel == "decode" and plan.variant.head_dim == 128 and plan.variant.family == "sm90"
    assert r["capacity"] == 320 and r["num_pages"] == 40 and r["page_size"] == 16 and r["align_br"] == 1
    assert r["k_bs"] == 16 * 8 * 128 and r["k_rs"] == 8 * 128 and r["k_hs"] == 128 and r["pt_bs"] == 20
    assert r["group"] == 4 and r["row_chunks"] == 1 and r["rows"] == 64
    assert r["split_keys"] % (plan.variant.warps * plan.variant.block_n) == 0
    assert r["splits"] * r["split_keys"] >= r["capacity"] and plan.grid == r["splits"] * 2 * 8
    assert (plan.combine is not None) == (plan.splits > 1)


def test_zero_queries_against_a_cache_launch_nothing():
    """Found by the cuda fuzzer on the H200 (2026-12-02, shrunk to B1 H1 Sq=0 Sk=1 d16): a cache call with no
    new queries raised instead of returning empty outputs."""
    from attnx.autograd import backend_view
    from attnx.problem import make_call

    q, k = torch.randn(1, 1, 0, 16).to(torch.float16), torch.randn(1, 1, 5, 16).to(torch.float16)
    p, x = make_call(q, k, k, seqlens_k=torch.tensor([1], dtype=torch.int32), grad_inputs=())
    p = p._replace(device_type="cuda", vendor="nvidia", arch="sm_90")
    assert p.kv_format == "cache" and not p.is_empty
    plan = launch_decode.prepare(p, backend_view(p, x), 132)
    assert plan.grid == 0 and plan.out.shape == (1, 1, 0, 16) and plan.lse.shape == (1, 1, 0)


def test_decode_variants_are_listed_and_fit():
    for family in families.FAMILIES.values():
        listed = set(variants.all_variants(family))
        for cap in variants.covered_capabilities(family):
            shared = variants.max_shared(cap)
            found = [v for v in variants.requestable(family, cap) if v.kernel == "decode"]
            assert {(v.head_dim, v.bf16, v.score_mod) for v in found} == {
                (t, b, m) for t in variants.DECODE_HEAD_DIM_TILES for b in (False, True) for m in (False, True)}
            assert all(v.shared_bytes() <= shared and v.source == "sm80/fa_decode.cu" for v in found)
            assert set(found) <= listed
        combine = [v for v in listed if v.kernel == "decode_combine"]
        assert len(combine) == 2 and all(v.function == "attnx_decode_combine" for v in combine)


def _decode_problem(kv_format="cache", **kw):
    base = dict(dtype=torch.bfloat16, batch=2, heads_q=32, heads_kv=8, seqlen_q=1, seqlen_k=4096, head_dim=128,
                device="cuda", vendor="nvidia", arch="sm_90", kv_format=kv_format,
                page_size=16 if kv_format == "paged" else None)
    return Problem.create(**{**base, **kw})


@pytest.mark.parametrize("kv_format", ["cache", "paged"])
def test_cache_and_paged_keys_run_the_decode_kernel(kv_format):
    """Checked on the H200 (2026-12-02: 118/118 cases; later runs in docs/testing.md): forward-only cache/paged calls of up to 16 queries are
    accepted and run here, ahead of triton on sm_90; gradients, longer query blocks and head dims without
    a tile are declined with their reason."""
    backend = attnx.get_backend("cuda")
    p = _decode_problem(kv_format)
    assert not backend.declared_reasons(p) and not backend.extra_reasons(p)
    assert launch_decode.runs_decode(p) and backend.rank(p) > attnx.get_backend("triton").rank(p)
    assert any("forward only" in r for r in backend.declared_reasons(_decode_problem(kv_format, needs_grad=True)))
    declined = {"at most 16 queries": _decode_problem(kv_format, seqlen_q=17),
                "no decode tile": _decode_problem(kv_format, head_dim=512, head_dim_v=512)}
    for words, q in declined.items():
        assert any(words in r for r in backend.extra_reasons(q)), (words, backend.extra_reasons(q))


def test_dense_keys_decode_only_short_forward_calls():
    """Dense keys take the decode kernel for forward-only calls of <= 16 queries; the forward kernels
    (one 128-query tile per head) run everything else."""
    assert launch_decode.runs_decode(_decode_problem("dense", seqlen_q=16))
    assert not launch_decode.runs_decode(_decode_problem("dense", seqlen_q=17))
    assert not launch_decode.runs_decode(_decode_problem("dense", needs_grad=True))


def test_splits_keep_the_grid_in_one_launch():
    """Many sequences and kv heads: the split count shrinks before the grid passes CUDA's limit."""
    p = _decode_problem("dense", batch=1)  # 8 blocks per split (8 kv heads, 4 query heads each)
    k = torch.randn(1, 8, 4096, 128, dtype=torch.bfloat16)
    x = Inputs(q=torch.randn(1, 32, 1, 128, dtype=torch.bfloat16), k=k, v=k)
    launch_decode._split_plan.cache_clear()  # (the split decision is cached per problem)
    with mock.patch.object(launch_decode, "MAX_GRID", 20):
        plan = launch_decode.prepare(p, x, 132, splits=64)
    launch_decode._split_plan.cache_clear()
    assert plan.grid == 16 and plan.splits == 2


def test_pools_of_pages_smaller_than_a_key_block_take_bulk_rings_with_three_stages():
    """`ring_format`: pages that do not hold whole 16-key blocks (a table entry per key) are "paged-rows", whose
    3-stage d128 ring copies a row per bulk copy on Hopper (`DECODE_KV_BULK`, run 14: 1.05-1.07x at B = 64, page 1);
    their 2-stage ring and every other format's stay swizzled, and Ampere-class GPUs have no bulk copies."""
    assert all(t.block_n == variants.DECODE_BLOCK_KEYS for tiles in variants.DECODE_TILES.values() for t in tiles)
    shared = variants.max_shared((9, 0))
    for page_size, ring in ((1, "paged-rows"), (5, "paged-rows"), (8, "paged-rows"), (16, "paged"), (48, "paged"),
                            (256, "paged")):
        p = _decode_problem("paged", batch=64, page_size=page_size)
        assert launch_decode.ring_format(p) == ring
        found = launch_decode.decode_candidates_for(p)
        assert [(v.stages, v.kv_bulk, v.kv_swizzle) for v in found] == (
            [(2, False, True), (3, True, False)] if ring == "paged-rows" else [(2, False, True), (3, False, True)])
        assert launch_decode.pick_decode_variant(p, 32768, 132, None).kv_bulk is (ring == "paged-rows")
    assert launch_decode.ring_format(_decode_problem("cache", batch=64)) == "cache"
    ampere = variants.decode_variants(families.AMPERE, True, 128, False, variants.max_shared((8, 0)), "paged-rows")
    assert ampere and not any(v.kv_bulk for v in ampere)
    for tile in (64, 256):  # no 3-stage tile: swizzled
        assert not any(v.kv_bulk for v in variants.decode_variants(families.HOPPER, True, tile, False, shared,
                                                                   "paged-rows"))
    requested = variants.requestable(families.HOPPER, (9, 0))
    assert sum(v.kv_bulk for v in requested) == 4  # d128 s3: fp16/bf16 x with/without score mod


def test_page_batch_is_for_paged_pools_only(monkeypatch):
    monkeypatch.setattr(variants, "DECODE_PAGE_BATCH", True)
    shared = variants.max_shared((9, 0))
    for kv_format, want in (("paged", True), ("cache", False), ("dense", False)):
        found = variants.decode_variants(families.HOPPER, True, 128, False, shared, kv_format)
        assert found and all(v.page_batch is want for v in found)
        assert all(("-DPAGE_BATCH=1" in v.defines()) is want for v in found)


def test_fused_combine_launches_one_kernel_and_zeroes_its_arrival_counters():
    """FUSED_COMBINE: no combine launch; part_lse carries one zeroed int32 counter per program after the
    splits' rows (the kernel's `split_arrivals`); without splits nothing changes."""
    from attnx.autograd import backend_view
    from attnx.problem import make_call

    q = torch.randn(2, 8, 1, 128).to(torch.bfloat16)
    k = torch.randn(2, 2, 4096, 128).to(torch.bfloat16)
    p, x = make_call(q, k, k, seqlens_k=torch.tensor([4000, 17], dtype=torch.int32), grad_inputs=())
    p = p._replace(device_type="cuda", vendor="nvidia", arch="sm_90")
    xv = backend_view(p, x)
    base = launch_decode.prepare(p, xv, 132).variant
    fused = base._replace(fused_combine=True)
    assert "-DFUSED_COMBINE=1" in fused.defines() and "FUSED_COMBINE" not in " ".join(base.defines())
    plan = launch_decode.prepare(p, xv, 132, variant=fused)
    programs = plan.grid // plan.splits
    assert plan.splits > 1 and programs == 2 * 2 and plan.combine is None and plan.combine_grid == 0
    part_lse = next(t for t in plan.keep if t.data_ptr() == int(plan.args["part_lse"]))
    assert part_lse.numel() == plan.splits * int(plan.args["rows"]) + programs
    assert torch.equal(part_lse[-programs:].view(torch.int32), torch.zeros(programs, dtype=torch.int32))
    one = launch_decode.prepare(p, xv, 132, variant=fused, splits=1)
    assert one.splits == 1 and one.combine is None and int(one.args["part_lse"]) == 0


def test_decode_compiles_without_spills_for_sm_90a():
    reason = _nvrtc()
    if reason:
        pytest.skip(reason)
    shared = variants.max_shared((9, 0))
    found = [v for tile, kv_format in ((128, "cache"), (128, "paged"), (256, "cache"), (256, "paged"))
             for v in variants.decode_variants(families.HOPPER, True, tile, tile == 256, shared, kv_format)]
    # d128: 2 and 3 stages per format, every ring swizzled (DECODE_KV_SWIZZLE); pages smaller than a key block:
    # the 3-stage ring bulk-copied (DECODE_KV_BULK), compiled at the end
    assert [(v.head_dim, v.stages, v.kv_swizzle) for v in found] == [
        (128, 2, True), (128, 3, True), (128, 2, True), (128, 3, True), (256, 2, True), (256, 2, True)]
    rows = variants.decode_variants(families.HOPPER, True, 128, False, shared, "paged-rows")
    assert [(v.stages, v.kv_swizzle, v.kv_bulk) for v in rows] == [(2, True, False), (3, False, True)]
    # PAGE_BATCH (page entries 32 blocks ahead) is opt-in: compiled here beside the table's paged variants
    assert not any(v.page_batch for v in found)
    found += [v._replace(page_batch=True) for v in found[2:4] + found[5:]]
    # FUSED_COMBINE (the last split merges) is opt-in too: every table variant's twin
    assert not any(v.fused_combine for v in found)
    found += [v._replace(fused_combine=True) for v in found[:6]]
    # KV_BULK (a K/V row per bulk copy, padded rings) is opt-in: the table's twins (the kernel's static_assert
    # holds its barriers' place to Variant.shared_bytes), one with the fused merge's weights overlaid too
    assert not any(v.kv_bulk for v in found)
    found += [v._replace(kv_swizzle=False, kv_bulk=True) for v in found[:6]] + [found[6]._replace(kv_swizzle=False,
                                                                                                  kv_bulk=True)]
    found += rows[1:]
    for v in found:
        ok, log, size = nvrtc_check.compile_source(kernel_source(v.source), v.source,
                                                   (*nvrtc_options(v, "sm_90a"), "-Xptxas=-v"))
        assert ok and size > 0, log[:2000]
        assert " 0 bytes spill stores" in log and "bytes stack frame" in log, log


# -- the tile sweep (variants.decode_sweep_variants; benchmarks.cuda_decode sweep / check --tiles) -------------
D128_CANDIDATES = ["n16w4s2", "n16w4s3", "n16w4s4", "n16w8s2", "n16w8s3", "n32w4s2", "n32w4s3"]


def test_decode_table_and_its_wave_choice():
    """d128 offers 2 and 3 stages (H200 sweep, 2026-12-03): 2 where key splits fill the block slots (B = 1, 8),
    3 where a large batch would leave a tail (B = 64: 512 blocks on 396 slots with 2 stages, 264 with 3)."""
    A = variants.ForwardTile
    assert variants.DECODE_TILES == {64: (A(16, 16, 4, 4),), 128: (A(16, 16, 4, 2), A(16, 16, 4, 3)),
                                     256: (A(16, 16, 4, 2), A(16, 16, 2, 2))}
    assert variants.DECODE_TILES_BY_WAVE == {128}
    shared = variants.max_shared((9, 0))
    v = variants.decode_variant(families.HOPPER, True, 128, False, shared)
    assert (v.block_n, v.warps, v.stages, v.exact_alpha, v.kv_swizzle) == (16, 4, 2, True, True)
    assert "-DEXACT_ALPHA=1" in v.defines() and "-DEXACT_ALPHA=0" in v._replace(exact_alpha=False).defines()
    assert [w.stages for w in variants.decode_variants(families.HOPPER, True, 128, False, shared)] == [2, 3]
    assert [w.stages for w in variants.decode_variants(families.AMPERE, True, 128, False, 101376)] == [2]
    assert [w.warps for w in variants.decode_variants(families.HOPPER, True, 256, True, shared)] == [4]
    for kv_format in ("cache", "paged"):
        picks = {}
        for batch, capacity in ((1, 32768), (8, 32768), (8, 131072), (64, 32768), (1, 4096)):
            p = _decode_problem(kv_format, batch=batch)
            picks[batch, capacity] = launch_decode.pick_decode_variant(p, capacity, 132, None).stages
        assert picks == {(1, 32768): 2, (8, 32768): 2, (8, 131072): 2, (64, 32768): 3, (1, 4096): 3}, kv_format
    p = _decode_problem("cache", batch=64)
    assert launch_decode.pick_decode_variant(p, 32768, 132, 3).stages == 2  # 1536 blocks fill both alike
    assert launch_decode.pick_decode_variant(p._replace(head_dim=64, head_dim_v=64), 32768, 132, None).stages == 4


def test_sweep_candidates_fit_and_start_with_the_default():
    found = cuda_decode.tile_candidates(128)
    assert [cuda_decode.tile_label(v) for v in found] == D128_CANDIDATES
    default = variants.decode_variant(families.HOPPER, True, 128, False, variants.max_shared((9, 0)))
    # (+swz twins: --tile all+swz; the page batch follows the launcher's variant for the call: `tile_variant`)
    assert found[0] == default._replace(exact_alpha=False, kv_swizzle=False, page_batch=False)
    assert cuda_decode.tile_candidates(128, exact_alpha=True)[1] == default._replace(kv_swizzle=False,
                                                                                      page_batch=False)
    assert all(v.kernel == "decode" and v.shared_bytes() <= 232448 and v.block_m == 16 for v in found)
    assert [cuda_decode.tile_label(v) for v in cuda_decode.tile_candidates(128, exact_alpha=True)][:2] == \
        ["n16w4s2", "n16w4s2+ea"]
    d64 = {cuda_decode.tile_label(v) for v in cuda_decode.tile_candidates(64)}
    assert {"n64w4s2", "n64w4s3"} <= d64  # 64-key blocks fit only at d64
    with pytest.raises(SystemExit):
        cuda_decode.pick_tiles("n64w4s2")  # not a d128 candidate


def test_sweep_dry_run_lists_every_candidate(capsys):
    assert cuda_decode.main(["sweep", "--dry-run", "--exact-alpha"]) == 0
    out = capsys.readouterr().out
    assert all(f"{label} " in out for label in D128_CANDIDATES + ["n16w4s2+ea"])


def test_sweep_labels_name_forced_split_counts():
    """`--splits 0,48`: each candidate timed at the heuristic's count and at 48, under distinct labels."""
    from benchmarks.decode_sweep import _label

    tile = variants.decode_sweep_variants(128)[0]
    assert _label(tile, 0, (0,)) == cuda_decode.tile_label(tile)
    labels = {_label(tile, n, (0, 48)) for n in (0, 48)}
    assert labels == {cuda_decode.tile_label(tile) + "/auto", cuda_decode.tile_label(tile) + "/s48"}


def test_copy_map_of_every_candidate():
    """load_kv's lane -> (row, column chunk, page register) map covers each block once (64-key blocks: two
    page registers per lane), and the static_asserts' limits are the emulation's."""
    for hd in (64, 128, 256):
        for v in cuda_decode.tile_candidates(hd):
            decode_emulate.check_copy_map(v)
    v = cuda_decode.tile_candidates(64)[0]
    with pytest.raises(ValueError):
        decode_emulate.check_copy_map(v._replace(block_n=128))


SOME_TILE_CASES = ("paged1 causal sq4", "paged bad index values", "cache splits=13 forced")


@pytest.mark.parametrize("label", D128_CANDIDATES[1:] + ["n16w4s3+ea", "d64 n64w4s2", "d64 n64w4s3"])
def test_sweep_candidates_pass_the_emulation(label):
    """A few of the tile cases per candidate, with the launcher's record for that tile (split unit warps x
    keys per block) and the kernels' arithmetic emulated (`check --tiles --emulate` runs all of them)."""
    hd, label = (64, label.split()[1]) if label.startswith("d64") else (128, label)
    tile, = cuda_decode.pick_tiles(label, hd)
    todo = [c for c in cuda_decode.tile_cases(hd) if c.name.startswith(SOME_TILE_CASES)]
    assert len(todo) == 4
    assert cuda_decode.check(todo, cuda_decode.emulated_forward, "cpu", tile=tile)


def test_tile_check_is_not_blind(lossy_emulation):
    """A candidate whose splits drop keys fails its check (the sweep would refuse to time it)."""
    tile, = cuda_decode.pick_tiles("n32w4s2")
    todo = [c for c in cuda_decode.tile_cases(128) if c.name.startswith("cache splits=13")]
    assert not cuda_decode.check(todo, cuda_decode.emulated_forward, "cpu", tile=tile)


def _compile_verbose(args):
    v, arch = args
    ok, log, _ = nvrtc_check.compile_source(kernel_source(v.source), v.source,
                                            (*nvrtc_options(v, arch), "-Xptxas=-v"))
    return cuda_decode.tile_label(v), arch, ok, log


def test_sweep_candidates_compile_without_spills():
    """Every d128 candidate (and the default's EXACT_ALPHA twin, and d64's 64-key blocks) for sm_90a and sm_80."""
    reason = _nvrtc()
    if reason:
        pytest.skip(reason)
    from concurrent.futures import ProcessPoolExecutor

    todo = cuda_decode.tile_candidates(128, exact_alpha=True) + cuda_decode.pick_tiles("n64w4s2,n64w4s3", 64)
    with ProcessPoolExecutor(2) as pool:
        results = list(pool.map(_compile_verbose, [(v, arch) for v in todo for arch in ("sm_90a", "sm_80")]))
    for label, arch, ok, log in results:
        assert ok, f"{label} {arch}: {log[:2000]}"
        assert " 0 bytes spill stores" in log and " 0 bytes stack frame" in log, f"{label} {arch}: {log}"


def test_sweep_swizzled_twins():
    """`--tile all+swz`: every candidate followed by its twin with the swizzled ring (labelled +swz, less shared memory)."""
    found = cuda_decode.pick_tiles("all+swz")
    labels = [cuda_decode.tile_label(v) for v in found]
    assert labels[::2] == D128_CANDIDATES and labels[1::2] == [f"{x}+swz" for x in D128_CANDIDATES]
    assert all(s.kv_swizzle and not p.kv_swizzle and s.shared_bytes() < p.shared_bytes()
               for p, s in zip(found[::2], found[1::2]))


def test_sweep_bulk_twins():
    """`+bulk` names a candidate's KV_BULK twin: padded rows, an mbarrier per warp stage after the overlaid ring,
    merge buffer and fused weights (8-byte aligned), the kernel told the total (SHARED_BYTES) to place them."""
    (bulk,) = cuda_decode.pick_tiles("n16w4s2+ea+bulk")
    (padded,) = cuda_decode.pick_tiles("n16w4s2+ea")
    assert bulk == padded._replace(kv_bulk=True) and cuda_decode.tile_label(bulk) == "n16w4s2+ea+bulk"
    assert bulk.shared_bytes() == -(-padded.shared_bytes() // 8) * 8 + 8 * 4 * 2
    assert "-DKV_BULK=1" in bulk.defines() and f"-DSHARED_BYTES={bulk.shared_bytes()}" in bulk.defines()
    assert "KV_BULK" not in " ".join(padded.defines()) and "+bulk" in bulk.label()
    with pytest.raises(SystemExit):  # no swizzled bulk twin: a copy writes a whole row in place
        cuda_decode.pick_tiles("n16w4s2+ea+swz+bulk")


@pytest.mark.parametrize("page_size,shift", [(1, 0), (5, -1), (8, 3), (16, 4), (48, -1), (256, 8)])
def test_paged_calls_pass_the_page_shift(page_size, shift):
    """The kernel shifts by `page_shift` where the page size is a power of two and divides otherwise."""
    assert launch_decode.page_shift(page_size) == shift
    p = _decode_problem("paged", batch=1, page_size=page_size)
    pages = -(-4096 // page_size)
    pool = torch.randn(pages, page_size, 8, 128, dtype=torch.bfloat16)
    x = Inputs(q=torch.randn(1, 32, 1, 128, dtype=torch.bfloat16), k=pool, v=pool,
               page_table=torch.arange(pages, dtype=torch.int32)[None], seqlens_k=torch.tensor([4000]))
    plan = launch_decode.prepare(p, x, 132)
    assert plan.args["page_shift"] == shift and plan.args["page_size"] == page_size
