"""CPU checks of the cuda backend's packed (varlen) forward: the Ampere kernel built with VARLEN=1
(common/varlen.cuh, launch_varlen.py; checked on the H200 2026-12-02: 49/49, memcheck clean, mostly
0.71-0.86x triton's varlen speed; dispatched below triton).

What runs without a GPU: the check harness with the float32 formula as the kernel (`--self-test`) and
proof that it catches a key read past a sequence and a row written outside every sequence; every case
with the launcher's records and the kernel's index arithmetic emulated (`--emulate`); the launcher's
host side (records, grid, strides, padding); the VarlenParams record against the C struct;
the knob's defines (every table asks VARLEN=0) and a compile of the VARLEN=1 kernel for sm_80 and
sm_90a; the dispatch (declarations, reasons, rank below triton, routing in `CudaBackend.forward`) on
problems that describe a GPU. The kernel itself runs in `python -m benchmarks.cuda_varlen check` on a GPU.
"""
import re
import unittest.mock as mock

import pytest
import torch

import attnx
from attnx import dispatch
from attnx.autograd import backend_view
from attnx.backends.cuda import families, launch, launch_decode, launch_varlen, nvrtc_check, tensor_maps, variants
from attnx.backends.cuda.compile import kernel_source, nvrtc_options
from attnx.conformance.cases import generate_cases
from attnx.problem import Problem, make_call
from benchmarks import cuda_varlen


def _nvrtc() -> str:
    return nvrtc_check.unavailable_reason()


SOME = ("lengths Sq=Sk causal", "empty ends", "no keys at all", "nan tail", "garbage cu_seqlens causal",
        "offset -3 causal", "d40 dv24")


def _some_cases():
    return [c for c in cuda_varlen.cases() if c.name in SOME]


def test_self_test_harness_passes(capsys):
    assert cuda_varlen.check(_some_cases(), cuda_varlen.stand_in_forward, "cpu")
    assert f"{len(SOME)} of {len(SOME)} cases passed" in capsys.readouterr().out


def test_harness_catches_a_key_past_the_sequence():
    """The stand-in reads one key of the next sequence (or of the NaN tail): the check fails."""
    def leaky(p, xv, built):
        total_k = xv.k.shape[0]
        spans = [(qs, (k0, min(k1 + 1, total_k))) for qs, (k0, k1) in built.spans]
        return cuda_varlen.stand_in_forward(p, xv, built._replace(spans=spans))

    cases = [c for c in cuda_varlen.cases() if c.name in ("lengths Sq!=Sk", "nan tail")]
    assert not cuda_varlen.check(cases, leaky, "cpu")


def test_harness_catches_a_row_written_outside_the_sequences():
    def scribbler(p, xv, built):
        out, lse = cuda_varlen.stand_in_forward(p, xv, built)
        out[-1] = 0  # the NaN tail's last row: no sequence covers it
        return out, lse

    assert not cuda_varlen.check([c for c in cuda_varlen.cases() if c.name == "nan tail d64"], scribbler, "cpu")


def test_emulated_kernel_passes_every_case(capsys):
    """Every case of the GPU check with the launcher's records and the kernel's index arithmetic emulated
    (clamped cu_seqlens, early exits, key blocks, masks; a read or write outside a buffer raises)."""
    assert cuda_varlen.main(["check", "--emulate"]) == 0
    n = len(cuda_varlen.cases())
    assert f"{n} of {n} cases passed" in capsys.readouterr().out


def test_emulation_catches_a_wrong_alignment(monkeypatch):
    """The emulation reads the records: a launcher that forgot per-sequence bottom-right alignment fails."""
    real = cuda_varlen.emulate

    def top_left(plan):
        varlen = plan.varlen.copy()
        varlen["align_br"] = 0
        return real(plan._replace(varlen=varlen))

    monkeypatch.setattr(cuda_varlen, "emulate", top_left)
    cases = [c for c in cuda_varlen.cases() if c.name == "causal"]
    assert not cuda_varlen.check(cases, cuda_varlen.emulated_forward, "cpu")


def test_record_matches_the_c_struct():
    reason = _nvrtc()
    if reason:
        pytest.skip(reason)
    dtype = launch_varlen.VARLEN_PARAMS_DTYPE
    checks = [f"static_assert(__builtin_offsetof(VarlenParams, {n}) == {dtype.fields[n][1]}, \"{n}\");"
              for n in dtype.names]
    checks.append(f"static_assert(sizeof(VarlenParams) == {dtype.itemsize}, \"size\");")
    v = variants.varlen_forward_variant(True, 64, False, variants.max_shared((8, 0)))
    source = kernel_source(v.source) + "\n" + "\n".join(checks) + "\n"
    ok, log, _ = nvrtc_check.compile_source(source, "varlen_params.cu", nvrtc_options(v, "sm_80"))
    assert ok, log


def test_dense_tables_ask_varlen_0_and_the_varlen_variants_are_listed_for_ci():
    for family in families.FAMILIES.values():
        fwd = [v for v in variants.all_variants(family) if v.kernel == "fwd"]
        dense = [v for v in fwd if not v.varlen]
        assert dense
        for v in fwd:  # the Ampere forward always has the knob; the Hopper one only in its packed builds
            want = (f"-DVARLEN={int(v.varlen)}",) if not v.hopper_forward or v.varlen else ()
            assert tuple(d for d in v.defines() if d.startswith("-DVARLEN")) == want
        # every packed variant launch_varlen can ask for, both EXACT_ALPHA twins
        assert {v for v in fwd if v.varlen} == {w._replace(varlen=True) for w in dense}
    for cap in ((8, 0), (8, 6), (9, 0)):
        v = variants.varlen_forward_variant(True, 128, False, variants.max_shared(cap))
        assert v.family == "sm80" and v.source == "sm80/fa_fwd.cu" and v.function == "attnx_fwd"
        assert "-DVARLEN=1" in v.defines() and "+varlen" in v.label()
        assert v.shared_bytes() <= variants.max_shared(cap)


def _packed_call(d=128, dv=None, hq=8, hkv=2, lens=(5, 0, 300, 129), offset=None, **opts):
    dv = dv or d
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    q = torch.randn(total, hq, d).to(torch.bfloat16)
    k = torch.randn(total + 3, hkv, d).to(torch.bfloat16)
    v = torch.randn(total + 3, hkv, dv).to(torch.bfloat16)
    cu_k = cu.clone()
    cu_k[-1] += 3
    p, x = make_call(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu_k, offset=offset, grad_inputs=(), **opts)
    p = p._replace(device_type="cuda", vendor="nvidia", arch="sm_90")
    return p, backend_view(p, x)


def test_prepare_packs_a_call_on_the_host():
    p, x = _packed_call(causal=True)
    assert launch_varlen.runs_varlen(p) and not launch_varlen.varlen_reasons(p)
    plan = launch_varlen.prepare(p, x)
    r, vr = plan.args, plan.varlen
    family = "sm90" if launch_varlen.hopper_runs(p) else "sm80"  # (with cuda-bindings: the Hopper kernel)
    assert plan.variant.varlen and plan.variant.family == family and plan.variant.head_dim == 128
    assert plan.variant.block_m == 128 and r["num_blocks"] == 3 and plan.grid == 4 * 8 * 3  # B x Hq x ceil(300 / 128)
    assert (r["q_bs"], r["q_hs"], r["q_rs"]) == (0, 128, 8 * 128)
    assert (r["k_bs"], r["k_hs"], r["k_rs"]) == (0, 128, 2 * 128) and r["v_rs"] == 2 * 128
    assert (r["o_bs"], r["o_hs"], r["o_rs"]) == (0, 128, 8 * 128) and r["group"] == 4
    assert r["key_offset"] == 0 and vr["align_br"] == 1 and r["window_right"] == 0
    assert (vr["total_q"], vr["total_k"]) == (434, 437)
    assert vr["cu_seqlens_q"] == x.cu_seqlens_q.data_ptr() and vr["cu_seqlens_k"] == x.cu_seqlens_k.data_ptr()
    assert r["q"] == x.q.data_ptr() and r["o"] == plan.out.data_ptr() and plan.out_k is plan.out
    assert tuple(plan.out.shape) == (434, 8, 128) and tuple(plan.lse.shape) == (8, 434)
    assert r["lse"] == plan.lse.data_ptr()


def test_prepare_explicit_offset_padding_and_features():
    slopes = torch.rand(4, 8)
    p, x = _packed_call(d=36, dv=20, offset=-3, softcap=30.0, alibi_slopes=slopes, sinks=torch.randn(8))
    plan = launch_varlen.prepare(p, x)
    r, vr = plan.args, plan.varlen
    assert r["key_offset"] == -3 and vr["align_br"] == 0
    assert plan.variant.score_mod and plan.variant.head_dim == 64
    assert r["head_dim"] == 40 and r["head_dim_v"] == 24 and r["q_rs"] == 8 * 40 and r["v_rs"] == 2 * 24
    assert plan.out_k is not plan.out and tuple(plan.out_k.shape) == (434, 8, 24)
    assert tuple(plan.out.shape) == (434, 8, 20)
    assert r["alibi"] != 0 and r["alibi_bs"] == 8 and r["alibi_hs"] == 1 and r["sinks"] != 0


def test_launcher_reasons():
    p, _ = _packed_call()
    assert not launch_varlen.varlen_reasons(p._replace(needs_grad=True))  # the VARLEN=1 Ampere backward
    assert any("no deterministic varlen backward" in r
               for r in launch_varlen.varlen_reasons(p._replace(needs_grad=True, deterministic=True)))
    assert not launch_varlen.varlen_reasons(p._replace(needs_grad=True, has_alibi=True))  # checked 2026-12-03
    assert any("packed q and k/v" in r for r in launch_varlen.varlen_reasons(p._replace(kv_format="cache")))
    assert any("float16/bfloat16" in r for r in launch_varlen.varlen_reasons(p._replace(dtype=torch.float32)))
    assert any("tile" in r for r in launch_varlen.varlen_reasons(p._replace(head_dim=512, head_dim_v=512)))
    assert launch_varlen.runs_varlen(p._replace(arch="sm_80"))
    assert any("too many query blocks" in r for r in launch_varlen.varlen_reasons(p._replace(seqlen_q=1 << 27,
                                                                                            heads_q=1024)))


def test_long_key_sequences_take_exact_alpha():
    """As the dense launchers: the rescale factor from the rounded shifts from 64k keys in a sequence."""
    short = launch_varlen.varlen_variant_for(_varlen_problem(seqlen_k=variants.EXACT_ALPHA_MIN_KEYS - 1))
    long = launch_varlen.varlen_variant_for(_varlen_problem(seqlen_k=variants.EXACT_ALPHA_MIN_KEYS))
    assert long == short._replace(exact_alpha=True) and not short.exact_alpha and long.varlen
    assert "-DEXACT_ALPHA=1" in long.defines() and "-DVARLEN=1" in long.defines()


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_varlen_kernel_compiles(arch):
    """VARLEN=1 compiles for both targets; d64 without spills. (d128 sits at 255 registers: the dense
    build spills a few bytes there too; the figures are in NOTES.md and are checked for speed on a GPU.)"""
    reason = _nvrtc()
    if reason:
        pytest.skip(reason)
    cap = (9, 0) if arch == "sm_90a" else (8, 0)
    for tile, mod, ea in ((64, False, False), (64, True, False), (128, False, False), (64, False, True)):
        v = variants.varlen_forward_variant(True, tile, mod, variants.max_shared(cap))._replace(exact_alpha=ea)
        ok, log, size = nvrtc_check.compile_source(kernel_source(v.source), v.source,
                                                   (*nvrtc_options(v, arch), "-Xptxas=-v"))
        assert ok and size > 0, log[:2000]
        spills = int(re.search(r"(\d+) bytes spill stores", log).group(1))
        assert spills == 0 or tile == 128, (v.label(), log)


# -- dispatch (checked on the H200 2026-12-02; backends/cuda/NOTES.md "Varlen forward") ----------------------
CUDA = attnx.get_backend("cuda")
ARCHS = ("sm_90", "sm_80", "sm_86", "sm_89")  # the Hopper family, and the Ampere family's GPUs
# packed forwards the kernel runs (the H200 check's features): options for `_varlen_problem`
ACCEPTED = {
    "plain": {},
    "causal": dict(causal=True),
    "window alibi": dict(window=(7, 0), alibi=True),
    "gqa sinks": dict(heads_q=16, heads_kv=4, causal=True, sinks=True),
    "offset": dict(causal=True, offset=-3),
    "softcap Sq>Sk": dict(seqlen_q=300, seqlen_k=100, causal=True, softcap=30.0),
    "fp16 d32": dict(dtype=torch.float16, head_dim=32),
    "d256": dict(head_dim=256),
    "d40 dv24": dict(head_dim=40, head_dim_v=24),
}
# what it declines, and the words of its reason: (options, words, where the reason comes from)
DECLINED = {
    "deterministic gradients": (dict(needs_grad=True, deterministic=True), "no deterministic varlen backward",
                                "extra"),
    "packed q, cache keys": (dict(kv_format="cache"), "format q=varlen, k/v=cache", "declared"),
    "packed q, paged keys": (dict(kv_format="paged", page_size=16), "format q=varlen, k/v=paged", "declared"),
    "float32": (dict(dtype=torch.float32), "dtype float32", "declared"),
    "mask tensor": (dict(mask_kind="bool", mask_shape=(4, 8, 300, 300)), "mask tensor", "declared"),
    "too many query blocks": (dict(seqlen_q=1 << 27, seqlen_k=1 << 27, heads_q=1024, heads_kv=1024),
                              "too many query blocks", "extra"),
}


def _varlen_problem(arch="sm_90", **kw):
    base = dict(dtype=torch.bfloat16, batch=4, heads_q=8, heads_kv=2, seqlen_q=300, seqlen_k=300, head_dim=128,
                device="cuda", vendor="nvidia", arch=arch, q_format="varlen", kv_format="varlen")
    return Problem.create(**{**base, **kw})


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", list(ACCEPTED))
def test_packed_forwards_are_accepted(arch, name):
    p = _varlen_problem(arch, **ACCEPTED[name])
    assert not CUDA.device_reasons(p) and not CUDA.declared_reasons(p) and not CUDA.extra_reasons(p)
    assert launch_varlen.runs_varlen(p)


@pytest.fixture
def bindings(monkeypatch):
    """Set whether cuda-bindings (TMA tensor maps) is importable, for the launcher's picks."""
    def set_available(available: bool):
        monkeypatch.setattr(tensor_maps, "tensor_maps_available", lambda: available)
        launch_varlen.varlen_variant_for.cache_clear()
    yield set_available
    launch_varlen.varlen_variant_for.cache_clear()


def test_hopper_needs_no_cuda_bindings_for_packed_calls(bindings):
    """Without cuda-bindings sm_90 runs packed calls on the Ampere kernel (no TMA maps): no reason, and the
    dense forward names the missing bindings."""
    bindings(False)
    p = _varlen_problem("sm_90")
    assert not CUDA.extra_reasons(p)
    assert launch_varlen.varlen_variant_for(p).family == "sm80" and not launch_varlen.hopper_runs(p)
    dense = _varlen_problem("sm_90", q_format="dense", kv_format="dense")
    assert any("cuda-bindings" in r for r in CUDA.extra_reasons(dense))


@pytest.mark.parametrize("available", (True, False))
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_forwards_rank_by_kernel(arch, available, bindings):
    """The Hopper varlen kernel (sm_90 with cuda-bindings) was 1.14-1.52x triton's varlen kernel at d128 on the
    H200 and ranks above it; the Ampere one was 0.71-0.86x and ranks below (nothing measured on sm_80..89)."""
    bindings(available)
    triton = attnx.get_backend("triton")
    hopper = available and arch == "sm_90"
    for p in (_varlen_problem(arch), _varlen_problem(arch, causal=True, seqlen_q=16384, seqlen_k=16384)):
        key = p.bucketed()
        variant = launch_varlen.varlen_variant_for(p)
        assert variant.varlen and (variant.family == "sm90") == hopper and variant.hopper_forward == hopper
        assert attnx.get_backend("blocked").rank(key) < CUDA.rank(key)
        if hopper:
            assert CUDA.rank(key) == CUDA.hopper_varlen_priority > triton.rank(key)
        else:
            assert CUDA.rank(key) == CUDA.varlen_priority["cuda:sm_90" if arch == "sm_90" else "cuda:nvidia"]
            assert CUDA.rank(key) < triton.rank(key)
        order = dispatch.priority(p)
        assert (order.index("cuda") < order.index("triton")) == hopper
    # dense forwards keep their place (ahead of triton)
    dense = _varlen_problem(arch, q_format="dense", kv_format="dense").bucketed()
    assert CUDA.rank(dense) > triton.rank(dense)


def test_packed_backward_packs_its_launch_on_the_host(monkeypatch):
    """launch_varlen.backward without a GPU (the launch captured): the VARLEN=1 Ampere backward's passes,
    packed strides, (Hq, total_q) delta and lse, the grid over the longest sequence's key blocks; dq back
    as (total_q, Hq, D); zero gradients where nothing was launched."""
    from attnx.backends.cuda import compile as cuda_compile

    launched = []
    monkeypatch.setattr(launch, "_device_index", lambda t: 0)
    monkeypatch.setattr(cuda_compile, "get_kernel", lambda variant, arch, index: variant)
    monkeypatch.setattr(launch, "_launch", lambda kernel, grid, threads, smem, args, index:
                        launched.append((kernel, grid, args)))
    p, x = _packed_call(causal=True, sinks=torch.randn(8))
    p = p._replace(needs_grad=True)
    out = torch.randn(x.q.shape[0], 8, 128).to(torch.bfloat16)
    lse = torch.randn(8, x.q.shape[0])
    g = launch_varlen.backward(p, x, out, lse, torch.randn_like(out))
    (kernel, grid, (args, vp)), = launched
    assert kernel.kernel == "bwd" and kernel.varlen and "-DVARLEN=1" in kernel.defines()
    assert grid == 4 * 2 * -(-300 // kernel.block_n)  # B x Hkv x key blocks of the longest sequence
    assert (args["q_bs"], args["q_rs"], args["k_rs"], args["o_rs"], args["dk_rs"]) == (0, 8 * 128, 2 * 128, 8 * 128,
                                                                                      2 * 128)
    assert args["dq_row"] == 128 and (vp["total_q"], vp["total_k"], vp["align_br"]) == (434, 437, 1)
    assert tuple(g.dq.shape) == (434, 8, 128) and tuple(g.dk.shape) == (437, 2, 128) and g.dsinks.shape == (8,)
    assert not g.dq.any() and not g.dk.any()  # (nothing ran)


def test_backward_routes_packed_calls_to_the_varlen_launcher():
    p, x = _packed_call(causal=True)
    p = p._replace(needs_grad=True)
    with mock.patch.object(launch_varlen, "backward", return_value="varlen") as varlen:
        assert CUDA.backward(p, x, None, None, None) == "varlen"
        varlen.assert_called_once_with(p, x, None, None, None)


@pytest.mark.parametrize("arch", ("sm_90", "sm_80"))
@pytest.mark.parametrize("name", list(DECLINED))
def test_packed_problems_it_declines(arch, name):
    options, words, where = DECLINED[name]
    p = _varlen_problem(arch, **options)
    reasons = CUDA.declared_reasons(p) if where == "declared" else CUDA.extra_reasons(p)
    assert any(words in r for r in reasons), reasons
    if where == "extra":
        assert not CUDA.declared_reasons(p)


@pytest.mark.parametrize("arch", ("sm_90", "sm_80"))
def test_head_dim_without_a_tile_is_declined(arch):
    """Every tile up to 256 fits on every covered GPU; a wider head has none (and is above max_head_dim)."""
    p = _varlen_problem(arch, head_dim=512, head_dim_v=512)
    assert any("above the maximum 256" in r for r in CUDA.declared_reasons(p))
    assert any("no varlen forward tile for head dims 512/512" in r for r in CUDA.extra_reasons(p))


@pytest.mark.parametrize("arch", ("sm_90", "sm_80"))
def test_conformance_grid_has_packed_forwards_it_runs(arch):
    """The grid generated from the declarations holds packed cases, with gradients, every one accepted (no
    extra declines), none with packed q against cache or paged keys."""
    found = [c for c in generate_cases(CUDA, "full") if c.q_format == "varlen"]
    assert len(found) >= 6 and sum(c.grad for c in found) >= 6
    for case in found:
        p = case.problem()._replace(device_type="cuda", vendor="nvidia", arch=arch)
        assert case.kv_format == "varlen", case.id
        assert not CUDA.declared_reasons(p), case.id
        assert not CUDA.extra_reasons(p), case.id


def test_forward_routes_packed_calls_to_the_varlen_launcher():
    """Packed q goes to launch_varlen (before runs_decode, which takes every non-dense kv); dense and cache
    calls keep their kernels. The launchers are mocked: no GPU here."""
    p, x = _packed_call(causal=True)
    dense = _varlen_problem(q_format="dense", kv_format="dense", seqlen_q=1024, seqlen_k=1024)
    cache = _varlen_problem(q_format="dense", kv_format="cache", seqlen_q=1, seqlen_k=4096)
    with mock.patch.object(launch_varlen, "forward", return_value="varlen") as varlen, \
            mock.patch.object(launch_decode, "forward", return_value="decode") as decode, \
            mock.patch.object(launch, "forward", return_value="dense") as dense_forward:
        assert CUDA.forward(p, x) == "varlen"
        varlen.assert_called_once_with(p, x)
        assert CUDA.forward(dense, None) == "dense" and CUDA.forward(cache, None) == "decode"
        assert varlen.call_count == 1 and decode.call_count == 1 and dense_forward.call_count == 1


# -- the opt-in Hopper varlen forward (sm90/fa_fwd.cu VARLEN=1; written offline, not yet run on a GPU) ---------
def test_hopper_varlen_variant_is_the_hopper_tile_with_the_knob():
    for tile in (64, 128, 192, 256):
        dense = variants.forward_variant(families.HOPPER, True, tile, False, variants.max_shared((9, 0)))
        v = variants.hopper_varlen_variant(True, tile, False, variants.max_shared((9, 0)))
        assert v == dense._replace(varlen=True) and v.hopper_forward and v.source == "sm90/fa_fwd.cu"
        assert "-DVARLEN=1" in v.defines() and not any(d.startswith("-DVARLEN") for d in dense.defines())
        assert v.shared_bytes() == dense.shared_bytes()


def test_hopper_varlen_kernel_compiles_without_spills_up_to_d128():
    """sm_90a, every head-dim tile with and without a score mod: compiles; d64 and d128 (the paper's and the
    serving shapes) without spills (d192+mod and d256 spill a few bytes; NOTES.md)."""
    reason = _nvrtc()
    if reason:
        pytest.skip(reason)
    for tile in (64, 128, 192, 256):
        for mod in (False, True):
            v = variants.hopper_varlen_variant(True, tile, mod, variants.max_shared((9, 0)))
            ok, log, size = nvrtc_check.compile_source(kernel_source(v.source), v.source,
                                                       (*nvrtc_options(v, "sm_90a"), "-Xptxas=-v"))
            assert ok and size > 0, log[:2000]
            if tile <= 128:
                assert int(re.search(r"(\d+) bytes spill stores", log).group(1)) == 0, log


def test_hopper_varlen_tiles_pass_the_emulated_cases(capsys):
    """The launcher's records with the Hopper tile (128 query rows, its key blocks) through the emulated
    kernel arithmetic: grid, clamped cu_seqlens, early exits, masks, rows written only inside sequences."""
    assert cuda_varlen.main(["check", "--emulate", "--hopper"]) == 0
    assert "cases passed" in capsys.readouterr().out
