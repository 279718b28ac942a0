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
from benchmarks import cuda_decode


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


def test_emulation_catches_lost_keys(monkeypatch):
    """The harness is not blind: splits that cover half their keys fail."""
    real = cuda_decode.emulate

    def lossy(plan):
        args = plan.args.copy()
        args["split_keys"] = max(16, int(args["split_keys"]) // 2)
        return real(plan._replace(args=args))

    monkeypatch.setattr(cuda_decode, "emulate", lossy)
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
    """Checked on the H200 (2026-12-02: 118/118): forward-only cache/paged calls of up to 16 queries are
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


def test_decode_compiles_without_spills_for_sm_90a():
    reason = _nvrtc()
    if reason:
        pytest.skip(reason)
    shared = variants.max_shared((9, 0))
    for tile in (128, 256):
        v = variants.decode_variant(families.HOPPER, True, tile, tile == 256, shared)
        ok, log, size = nvrtc_check.compile_source(kernel_source(v.source), v.source,
                                                   (*nvrtc_options(v, "sm_90a"), "-Xptxas=-v"))
        assert ok and size > 0, log[:2000]
        assert " 0 bytes spill stores" in log and "bytes stack frame" in log, log
