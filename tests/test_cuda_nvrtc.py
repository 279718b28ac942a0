"""CI (no GPU): every CUDA kernel specialisation the launcher can request compiles with NVRTC.

NVRTC from cuda-bindings is the compiler CuPy uses at run time; it needs
libnvrtc (pip `nvidia-cuda-nvrtc`), not a GPU or a driver. The kernels include no
CUDA headers, so no include path is needed. Also checked here without a GPU: the
kernel families' declarations, the ``-arch`` each GPU gets, and that the launcher's
parameter record matches the kernels' C struct byte for byte.
"""
import os
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

import attnx
from attnx.backends.cuda import compile as cuda_compile
from attnx.backends.cuda import families, nvrtc_check, params, variants
from attnx.problem import Problem

BACKEND = attnx.get_backend("cuda")


def _nvrtc_available() -> str:
    return nvrtc_check.unavailable_reason()


def _compile(args):
    variant, arch = args
    ok, log, size = nvrtc_check.nvrtc_compile(variant, arch)
    return variant.label(), ok, log, size


def _targets():
    """(family, capability, variants) to build: the family's lowest GPU builds every tile it can request
    on any GPU it covers (the small-shared-memory tiles of sm_86/89 included); each arch-specific target
    (sm_90a) builds what that GPU requests."""
    found = []
    for family in families.FAMILIES.values():
        found.append((family, family.min_capability, variants.all_variants(family)))
        for cap in sorted(families.ARCH_SPECIFIC):
            if family.covers(cap):
                found.append((family, cap, variants.requestable(family, cap)))
    return found


TARGETS = {f"{family.name}-{families.nvrtc_arch(cap)}": (family, cap, todo) for family, cap, todo in _targets()}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_specialisation_compiles(target):
    reason = _nvrtc_available()
    if reason:
        pytest.skip(reason)
    _, cap, todo = TARGETS[target]
    arch = families.nvrtc_arch(cap)
    workers = max(1, min(4, os.cpu_count() or 1))
    with ProcessPoolExecutor(workers) as pool:
        results = list(pool.map(_compile, [(v, arch) for v in todo]))
    failed = [f"{label}: {log[:2000]}" for label, ok, log, _ in results if not ok]
    assert not failed, "\n".join(failed)
    assert all(size > 0 for *_, size in results)


def test_hopper_target_is_arch_specific():
    assert f"{families.HOPPER.name}-sm_90a" in TARGETS
    assert families.nvrtc_arch((9, 0)) == "sm_90a"
    assert [families.nvrtc_arch(c) for c in ((8, 0), (8, 6), (8, 9))] == ["sm_80", "sm_86", "sm_89"]


def test_params_record_matches_the_c_struct():
    """offsetof of every AttnParams field and sizeof(AttnParams) equal the numpy record's, checked by NVRTC."""
    reason = _nvrtc_available()
    if reason:
        pytest.skip(reason)
    dtype = params.PARAMS_DTYPE
    checks = [f"static_assert(__builtin_offsetof(AttnParams, {name}) == {dtype.fields[name][1]}, \"{name}\");"
              for name in dtype.names]
    checks.append(f"static_assert(sizeof(AttnParams) == {dtype.itemsize}, \"size\");")
    source = cuda_compile.kernel_source("common/params.cuh") + "\n" + "\n".join(checks) + "\n"
    ok, log, _ = nvrtc_check.compile_source(source, "params_check.cu", ("-arch=sm_80", "-std=c++17"))
    assert ok, log
    assert set(dtype.names) >= {"sinks", "key_offset"}


def test_kernel_sources_inline_every_header():
    for family in families.FAMILIES.values():
        for source in family.sources.values():
            text = cuda_compile.kernel_source(source)
            assert "#include" not in text and "attnx_" in text


def test_launcher_requests_only_listed_variants():
    for family in families.FAMILIES.values():
        listed = set(variants.all_variants(family))
        for cap in variants.covered_capabilities(family):
            assert set(variants.requestable(family, cap)) <= listed
            assert all(v.family == family.name for v in listed)


def test_variants_cover_every_head_dim_tile():
    for family in families.FAMILIES.values():
        kinds = {(v.kernel, v.head_dim) for v in variants.all_variants(family)}
        for kernel in ("fwd", "bwd"):
            for tile in variants.TILE_SETS[(family.name, kernel)]:
                assert (kernel, tile) in kinds


@pytest.mark.parametrize("head_dim,tile", [(8, 64), (40, 64), (64, 64), (72, 128), (96, 128), (128, 128),
                                           (136, 192), (192, 192), (200, 256), (256, 256)])
def test_hopper_forward_pads_to_whole_panels(head_dim, tile):
    assert variants.head_dim_tile(head_dim, head_dim, families.HOPPER, "fwd") == tile
    assert variants.head_dim_tile(head_dim, 8, families.HOPPER, "fwd") == tile  # Dv below D: D decides
    assert variants.head_dim_tile(300, 8, families.HOPPER, "fwd") is None


def test_hopper_forward_tiles_fit_and_use_three_warpgroups():
    shared = variants.max_shared((9, 0))
    for v in variants.requestable(families.HOPPER, (9, 0)):
        assert v.shared_bytes() <= shared
        if v.kernel == "fwd":
            assert v.hopper_forward and v.threads == 384 and v.block_m == 128
            assert v.block_n % 16 == 0 and v.head_dim % 64 == 0
            assert "-DOVERLAP=1" in v.defines()  # every shipped tile pipelines S with P V


def test_hopper_backward_tiles_fit_and_are_compiled():
    """The Hopper backward's specialisations (CI builds them for sm_90a) fit; 128 keys on three warpgroups."""
    shared = variants.max_shared((9, 0))
    found = [v for v in variants.requestable(families.HOPPER, (9, 0)) if v.hopper_backward]
    assert {(v.head_dim, v.score_mod) for v in found} == {(t, m) for t in variants.HOPPER_BACKWARD_TILES
                                                          for m in (False, True)}
    for v in found:
        assert v.shared_bytes() <= shared and v.threads == 384 and v.block_n == 128
        assert v.block_m in (64, 128) and v.head_dim % 64 == 0
        assert v.source == "sm90/fa_bwd.cu" and v.function == "attnx_bwd_wgmma"
    assert not any(v.hopper_backward for v in variants.all_variants(families.AMPERE))


# The Hopper backward's knobs on the plain schedule (the table's DQ_LATE off) that benchmarks/hopper_backward.py
# checks and times beside the table (NOTES.md has each one's H200 result): (Variant field, define, label flag).
# SPLIT_WAIT, DQ_KEYS (and, over DQ_LATE, DQ_POINTERS; DQ_BULK; TURN_EARLY) were measured and removed on
# 2026-12-03 (NOTES.md, "Removed knobs").
HOPPER_BACKWARD_OPT_INS = [
    ("dq_late", "DQ_LATE", "+dqlate"),  # (the table's own) a step's dQ added in the next step
]
# ptxas's wgmma serialisation notes: C7510/C7519/C7520 (why it serialised), C7512 (accumulators spread over
# too many registers), C7514 (accumulators read inside a pipeline stage: DQ_LATE's first try), C7517 (a wait
# ptxas injected)
WGMMA_SERIALISED = ("C7510", "C7512", "C7514", "C7517", "C7519", "C7520")


@pytest.mark.parametrize("field,define,flag", HOPPER_BACKWARD_OPT_INS, ids=[o[0] for o in HOPPER_BACKWARD_OPT_INS])
def test_hopper_backward_opt_in_knob_compiles_without_spills(field, define, flag):
    """Every table tile, with and without score mod, with the knob on builds for sm_90a with no local memory
    and no wgmma serialisation; of the table's own builds (its deterministic twins included) only the
    dispatched schedule's (DQ_LATE) turn one on, and they are held to the same."""
    reason = _nvrtc_available()
    if reason:
        pytest.skip(reason)
    found = [v for v in variants.requestable(families.HOPPER, (9, 0)) if v.hopper_backward and v.bf16]
    table = [v for v in found if not v.dq_ordered]
    assert table and all((f"-D{define}=1" in v.defines()) == (field == "dq_late") for v in found)
    from attnx.backends.cuda.compile import kernel_source

    todo = [t._replace(**{"dq_late": False, "dq_tma": False, field: True}) for t in table]
    for v in todo + (found if field == "dq_late" else []):
        assert f"-D{define}=1" in v.defines() and flag in v.label()
        ok, log, size = nvrtc_check.compile_source(kernel_source(v.source), v.source,
                                                   (*cuda_compile.nvrtc_options(v, "sm_90a"), "-Xptxas=-v"))
        assert ok and size > 0, log[:2000]
        assert " 0 bytes spill stores" in log and not any(c in log for c in WGMMA_SERIALISED), log


@pytest.mark.parametrize("define,flag,changes", [("DQ_TMA", "+dqtma", {}), ("DQ_WRITER", "+writer", {"dq_writer": True})],
                         ids=["table", "dq_writer"])
def test_hopper_backward_opt_ins_over_the_table_compile_without_spills(define, flag, changes):
    """The table (DQ_LATE + DQ_TMA) and the opt-in DQ_WRITER over it: every table tile with and without score
    mod builds for sm_90a with no local memory and no wgmma serialisation (the kernel's static_assert holds its
    shared-memory layout to variants.py's count)."""
    reason = _nvrtc_available()
    if reason:
        pytest.skip(reason)
    table = [v for v in variants.requestable(families.HOPPER, (9, 0)) if v.hopper_backward and v.bf16
             and not v.dq_ordered]
    assert table and all(v.dq_late and v.dq_tma for v in table)  # DQ_TMA: the table's since 2026-12-03
    from attnx.backends.cuda.compile import kernel_source

    for v in (t._replace(**changes) for t in table):
        assert f"-D{define}=1" in v.defines() and flag in v.label()
        assert v.shared_bytes() <= variants.max_shared((9, 0))
        ok, log, size = nvrtc_check.compile_source(kernel_source(v.source), v.source,
                                                   (*cuda_compile.nvrtc_options(v, "sm_90a"), "-Xptxas=-v"))
        assert ok and size > 0, log[:2000]
        assert " 0 bytes spill stores" in log and not any(c in log for c in WGMMA_SERIALISED), log


def test_hopper_backward_dq_ordered_variants_compile():
    """The ordered dQ (turn counters per query block: bitwise-deterministic dq) that deterministic problems
    run: every table tile has its ordered twin among the requestable variants (so CI builds both), on the
    table's schedule with its additions made by TMA reduce-adds in turn (DQ_TMA) by a writer thread of the
    producer warpgroup (DQ_WRITER); it builds for sm_90a with no local memory and no wgmma serialisation (the
    split by keys, whose two consumers' parts go to the same dQ elements, only in the score-mod tile); so do
    the opt-in twins: thread 128 taking the turns, the red path in turn (DQ_TMA off), DQ_ROTATE; DQ_ROTATE
    without the ordered dQ is refused, and so is DQ_WRITER without DQ_TMA."""
    reason = _nvrtc_available()
    if reason:
        pytest.skip(reason)
    from attnx.backends.cuda.compile import kernel_source

    found = [v for v in variants.requestable(families.HOPPER, (9, 0)) if v.hopper_backward]
    table = [v for v in found if not v.dq_ordered]
    assert table and all("-DDQ_ORDERED=0" in v.defines() for v in table)
    assert {v for v in found if v.dq_ordered} == {variants.ordered_twin(v) for v in table}
    twins = [variants.ordered_twin(v) for v in table if v.bf16]
    assert {v.block_m for v in twins if v.score_mod and v.head_dim == 64} == {64}  # the split by keys
    assert all(v.dq_late and v.dq_tma and v.dq_writer for v in twins)
    assert all("-DDQ_WRITER=1" in v.defines() and "+writer" in v.label() for v in twins)
    fenced = [v._replace(dq_writer=False) for v in twins]
    rotated = [v._replace(dq_rotate=True) for v in twins if v.head_dim == 128]  # (d64 BM 128: 8 bytes spilled)
    assert all("-DDQ_ROTATE=1" in v.defines() and "+rotate" in v.label() for v in rotated)
    assert not any("DQ_ROTATE" in d for v in found for d in v.defines())  # opt-in
    assert not any(v.dq_writer for v in table)  # (opt-in over the table)
    for v in twins + [fenced[0]._replace(dq_tma=False)] + fenced + rotated:
        assert "-DDQ_ORDERED=1" in v.defines() and "+ordered" in v.label()
        assert v.shared_bytes() <= variants.max_shared((9, 0))
        ok, log, size = nvrtc_check.compile_source(kernel_source(v.source), v.source,
                                                   (*cuda_compile.nvrtc_options(v, "sm_90a"), "-Xptxas=-v"))
        assert ok and size > 0, log[:2000]
        assert " 0 bytes spill stores" in log and not any(c in log for c in WGMMA_SERIALISED), log
    ok, log, _ = nvrtc_check.nvrtc_compile(twins[0]._replace(dq_ordered=False, dq_rotate=True), "sm_90a")
    assert not ok and "DQ_ROTATE" in log
    ok, log, _ = nvrtc_check.nvrtc_compile(twins[0]._replace(dq_tma=False), "sm_90a")  # (DQ_WRITER on)
    assert not ok and "DQ_WRITER" in log


@pytest.mark.parametrize("head_dim,head_dim_v,deterministic,hopper", [
    (128, 128, False, True), (64, 64, False, True), (40, 24, False, True), (128, 64, False, True),
    (192, 192, False, False), (256, 256, False, False), (128, 128, True, True), (256, 256, True, False)])
def test_training_on_hopper_runs_the_hopper_backward_where_it_has_a_tile(head_dim, head_dim_v, deterministic,
                                                                         hopper):
    """sm_90 gradients: the wgmma/TMA backward for head dims up to 128 (checked on the H200 2026-12-01,
    1.5x the Ampere kernel there), deterministic problems included (its ordered dQ); larger head dims keep
    the Ampere kernel."""
    from attnx.backends.cuda.backend import _hopper_backward

    p = _problem("sm_90", head_dim=head_dim, head_dim_v=head_dim_v, needs_grad=True, deterministic=deterministic)
    assert _hopper_backward(p) is hopper
    assert BACKEND.rank(p) == (92 if hopper else 60)
    assert (BACKEND.rank(p) > attnx.get_backend("triton").rank(p)) is hopper
    assert not _hopper_backward(_problem("sm_80", head_dim=head_dim, head_dim_v=head_dim_v, needs_grad=True))


@pytest.mark.parametrize("deterministic", [False, True])
def test_hopper_backward_takes_the_ordered_variant_when_deterministic(monkeypatch, deterministic):
    """`CudaBackend.backward` on sm_90: the ordered-dQ twin of the table's tile for deterministic problems
    (same bits on every run), the table's own (atomic dQ) otherwise; the launch itself is replaced here."""
    from attnx.backends.cuda import launch_sm90_bwd

    launched = []
    monkeypatch.setattr(launch_sm90_bwd, "backward", lambda p, x, out, lse, dout, variant: launched.append(variant))
    p = _problem("sm_90", head_dim=128, needs_grad=True, deterministic=deterministic)
    BACKEND.backward(p, None, None, None, None)
    table = launch_sm90_bwd.backward_variant_for(p)
    assert launched == [variants.ordered_twin(table) if deterministic else table]
    assert not table.dq_ordered and table.dq_late and variants.ordered_twin(table).dq_late


@pytest.mark.parametrize("family", list(families.FAMILIES.values()), ids=lambda f: f.name)
def test_deterministic_backward_has_launches_for_every_tile(family):
    """Every backward tile on every GPU a family covers has a deterministic backward: the dK/dV pass(es)
    without atomic dQ, then the dQ pass; all of them are in the set CI compiles."""
    listed = set(variants.all_variants(family))
    for cap in variants.covered_capabilities(family):
        shared = variants.max_shared(cap)
        for tile in variants.TILE_SETS[(family.name, "bwd")]:
            for bf16, mod in ((False, False), (True, True)):
                launches = variants.deterministic_backward_variants(family, bf16, tile, mod, shared)
                assert launches, (cap, tile)
                *dkdv, dq = launches
                assert [v.kernel for v in dkdv] == ["bwd"] * len(dkdv) and dkdv[-1].do_dk
                assert all("-DDQ_ATOMIC=0" in v.defines() for v in dkdv if v.do_dk)
                assert dq.kernel == "bwd_dq" and dq.source == "sm80/fa_bwd_dq.cu" and dq.function == "attnx_bwd_dq"
                assert dq.block_m == 16 * dq.warps and dq.head_dim == tile
                assert all(v.shared_bytes() <= shared for v in launches) and set(launches) <= listed


def test_atomic_backward_keeps_its_dq():
    """The dispatched (non-deterministic) backward still adds dQ in its dK pass: DQ_ATOMIC=1."""
    for family in families.FAMILIES.values():
        for v in variants.all_variants(family):
            if v.kernel == "bwd" and v.atomic_dq:
                assert "-DDQ_ATOMIC=1" in v.defines()
    v = variants.backward_variants(families.HOPPER, True, 128, False, variants.max_shared((9, 0)))[0]
    assert v.atomic_dq and v.shared_bytes() > v._replace(atomic_dq=False).shared_bytes()  # dS^T staging


def test_deterministic_dq_pass_compiles_without_spills():
    """The dQ pass of the d64/d128 tiles (the ones timed) builds for sm_90a with no local memory."""
    reason = _nvrtc_available()
    if reason:
        pytest.skip(reason)
    from attnx.backends.cuda.compile import kernel_source

    for tile in (64, 128):
        v = variants.dq_variant(families.HOPPER, True, tile, False, variants.max_shared((9, 0)))
        ok, log, size = nvrtc_check.compile_source(kernel_source(v.source), v.source,
                                                   (*cuda_compile.nvrtc_options(v, "sm_90a"), "-Xptxas=-v"))
        assert ok and size > 0, log[:2000]
        assert " 0 bytes spill stores" in log and "bytes stack frame" in log, log


def test_wgmma_header_is_generated_from_the_widths():
    import importlib.util

    script = cuda_compile.KERNEL_DIR / "sm90" / "gen_wgmma.py"
    if not script.exists():
        pytest.skip("an installed copy without the generator script")
    spec = importlib.util.spec_from_file_location("gen_wgmma", script)
    gen_wgmma = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_wgmma)
    assert gen_wgmma.HEADER.read_text() == gen_wgmma.render(), "run gen_wgmma.py after changing WIDTHS"
    hopper = variants.requestable(families.HOPPER, (9, 0))
    used = {v.block_n for v in hopper if v.kernel == "fwd"}
    used |= set(variants.PANEL_TILES)
    used |= {v.block_m for v in hopper if v.hopper_backward}  # S^T and dP^T are 64 keys x block_m queries
    assert used <= set(gen_wgmma.WIDTHS)
    assert set(variants.PANEL_TILES) <= set(gen_wgmma.MN_WIDTHS)  # the backward's dQ = dS K


def test_family_for_each_gpu():
    assert families.family_for((8, 0)) is families.AMPERE
    assert families.family_for((8, 9)) is families.AMPERE
    assert families.family_for((9, 0)) is families.HOPPER
    assert families.family_for((7, 5)) is None and families.family_for((10, 0)) is None


def test_forced_family_runs_the_ampere_kernels_on_hopper_and_restores(monkeypatch):
    """`forced_family("sm80")` (how the H200 checks the Ampere family): sm_90 problems get the Ampere family
    (forward variant, no Hopper backward), older GPUs keep theirs; on exit, and on an error inside, the Hopper
    family is back; cached per-problem choices are forgotten both ways; an unknown name is a ValueError."""
    from attnx.backends.cuda import launch_decode
    from attnx.backends.cuda.backend import _hopper_backward
    from attnx.backends.cuda.forced_family import forced_family

    p = _problem("sm_90", head_dim=128, needs_grad=True)
    assert _hopper_backward(p)
    launch_decode.decode_candidates_for(p)
    with forced_family("sm80") as family:
        assert family is families.AMPERE and families.family_for((9, 0)) is families.AMPERE
        assert families.family_for((7, 5)) is None
        assert not _hopper_backward(p)
        assert launch_decode.decode_candidates_for.cache_info().currsize == 0
        launch_decode.decode_candidates_for(p)
    assert families.family_for((9, 0)) is families.HOPPER and _hopper_backward(p)
    assert launch_decode.decode_candidates_for.cache_info().currsize == 0
    with pytest.raises(RuntimeError), forced_family("sm80"):
        raise RuntimeError("inside")
    assert families.family_for((9, 0)) is families.HOPPER
    with forced_family("sm90"):  # newer than the GPU: ignored
        assert families.family_for((8, 0)) is families.AMPERE
    with pytest.raises(ValueError, match="unknown cuda kernel family 'sm70'"), forced_family("sm70"):
        pass


def _problem(arch, **kw):
    base = dict(dtype=torch.bfloat16, batch=2, heads_q=8, seqlen_q=512, head_dim=128, device="cuda",
                vendor="nvidia", arch=arch)
    base.update(kw)
    return Problem.create(**base)


@pytest.mark.parametrize("arch,head_dim,rank", [("sm_80", 128, 80), ("sm_86", 128, 80), ("sm_90", 128, 92),
                                                ("sm_90", 256, 60)])
def test_priority(arch, head_dim, rank):
    assert BACKEND.rank(_problem(arch, head_dim=head_dim, needs_grad=True)) == rank


@pytest.mark.parametrize("arch,head_dim,seqlen,rank", [("sm_80", 128, 512, 80), ("sm_90", 128, 512, 96),
                                                       ("sm_90", 64, 4096, 96), ("sm_90", 64, 16384, 96),
                                                       ("sm_90", 256, 512, 96)])
def test_forward_priority_on_hopper(arch, head_dim, seqlen, rank):
    """Forward-only problems on sm_90 run the wgmma/TMA family first, measured faster than triton and than
    the torch backend (cuDNN returning lse) at every length and head dim (H200, 2026-12-01)."""
    p = _problem(arch, head_dim=head_dim, seqlen_q=seqlen).bucketed()
    assert BACKEND.rank(p) == rank
    if arch == "sm_90":
        assert rank > attnx.get_backend("triton").rank(p)
        assert rank > attnx.get_backend("torch").rank(p)


@pytest.mark.parametrize("arch", ["sm_75", "sm_100", "sm_120"])
def test_declines_gpus_no_family_covers(arch):
    reasons = BACKEND.device_reasons(_problem(arch))
    assert reasons and "compute capability" in reasons[0]


@pytest.mark.parametrize("kw", [dict(offset=5), dict(offset=-3, causal=True), dict(sinks=True),
                                dict(sinks=True, offset=0, window=(16, 0), needs_grad=True)])
def test_declares_offset_and_sinks(kw):
    assert BACKEND.declared_reasons(_problem("sm_90", seqlen_k=700, **kw)) == []
    assert BACKEND.extra_reasons(_problem("sm_90", seqlen_k=700, **kw)) == []


def test_declines_lengths_past_the_position_limit():
    from attnx.limits import MAX_SEQLEN

    reasons = BACKEND.extra_reasons(_problem("sm_90", batch=1, heads_q=1, seqlen_q=1, seqlen_k=MAX_SEQLEN))
    assert any("sequence length" in r for r in reasons)


def test_declines_other_formats():
    """Packed q against cache or paged keys has no kernel here (packed/packed and dense q against caches do)."""
    for kv_format in ("cache", "paged"):
        reasons = BACKEND.declared_reasons(_problem("sm_90", q_format="varlen", kv_format=kv_format,
                                                    page_size=16 if kv_format == "paged" else None))
        assert any("tensor format" in r for r in reasons), reasons
