"""The torch backend: exactness where torch's kernels differ from the contract, declarations, dispatch rank,
and the CUDA launch code checked on meta tensors (no GPU here; conformance covers the CPU path)."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.version import Version

import attnx
from attnx.inputs import Inputs
from attnx.problem import Problem, make_call
from attnx.reference import attention_reference

from attnx.backends.torch import cuda as torch_cuda

ROOT = Path(__file__).resolve().parent.parent

BACKEND = attnx.get_backend("torch")


def _reference(q, k, v, **options):
    out, lse = attention_reference(q.double(), k.double(), v.double(), scale=1 / math.sqrt(q.shape[-1]), **options)
    return out.to(q.dtype), lse.float()


@pytest.mark.parametrize("rule", ["bool-mask", "window", "bottom-right-causal"])
def test_a_hidden_nan_key_stays_hidden(rule):
    # the kernel adds -inf to a NaN score (NaN): those batch entries are recomputed by the formula
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 6, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    k[0, 0, 7, 0] = float("nan")
    if rule == "bool-mask":
        mask = torch.ones(6, 9, dtype=torch.bool)
        mask[:, 7] = False
        mask[2, 7] = True  # only row 2 sees the NaN key
        options, ref = dict(mask=mask), dict(mask=mask)
    elif rule == "window":
        options, ref = dict(window=(1, 1)), dict(window_left=1, window_right=1)
    else:
        options, ref = dict(causal=True), dict(window_right=0)
    out, lse = attnx.attention(q, k, v, backend="torch", return_lse=True, **options)
    ref_out, ref_lse = _reference(q, k, v, **ref)
    assert torch.equal(torch.isnan(out), torch.isnan(ref_out)) and torch.isnan(out).any()
    torch.testing.assert_close(out.nan_to_num(), ref_out.nan_to_num(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.nan_to_num(), ref_lse.nan_to_num(), atol=1e-5, rtol=1e-5)


def test_rows_that_see_no_key_have_minus_inf_lse_and_zero_gradients():
    q, k, v = (torch.randn(1, 2, 5, 16, requires_grad=True) for _ in range(3))
    mask = torch.zeros(1, 1, 5, 5)
    mask[..., 3, :] = float("-inf")  # additive -inf over a whole row
    out, lse = attnx.attention(q, k, v, mask=mask, causal=True, backend="torch", return_lse=True)
    assert torch.all(out[:, :, 3] == 0) and torch.all(lse[:, :, 3] == float("-inf"))
    out.sum().backward()
    assert torch.all(q.grad[:, :, 3] == 0) and not torch.isnan(k.grad).any()


def test_float64_gradients_use_the_float64_lse():
    q, k, v = (torch.randn(2, 3, 7, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = attnx.attention(q, k, v, causal=True, backend="torch")
    ref, _ = attention_reference(q, k, v, scale=0.25, window_right=0)
    dout = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_declines_what_the_kernels_do_not_compute():
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 8)
    reasons = attnx.explain(q, k, v, softcap=5.0, sinks=torch.zeros(2), backend="torch").reasons["torch"]
    text = "; ".join(reasons)
    assert "softcap" in text and "sinks" in text and "head_dim_v" in text


def test_declines_a_huge_mask_it_would_have_to_build():
    p = Problem.create(dtype=torch.float32, batch=1, heads_q=1, seqlen_q=1 << 15, seqlen_k=1 << 15, head_dim=64,
                       window=(128, 0))
    assert any("additive mask" in r for r in BACKEND.reasons(p))
    assert not BACKEND.reasons(p._replace(window_left=None))  # plain causal needs no mask


@pytest.mark.parametrize("options, rank", [(dict(), 40), (dict(causal=True), 40), (dict(window=(64, 0)), 15),
                                           (dict(causal=True, seqlen_k=512), 15), (dict(mask_kind="bool"), 40)])
def test_cpu_rank(options, rank):
    sizes = dict(seqlen_q=256, seqlen_k=options.pop("seqlen_k", 256))
    if "mask_kind" in options:
        options["mask_shape"] = (1, 1, 256, 256)
    p = Problem.create(dtype=torch.float32, batch=1, heads_q=4, head_dim=64, **sizes, **options)
    assert BACKEND.rank(p.bucketed()) == rank


# -- CUDA: what would run on an H200, checked on meta tensors -----------------------------------
def _cuda_problem(dtype=torch.bfloat16, seqlen=1024, head_dim=128, heads_kv=4, arch="sm_90", **options):
    return Problem.create(device="cuda", vendor="nvidia", arch=arch, dtype=dtype, batch=2, heads_q=4,
                          heads_kv=heads_kv, seqlen_q=seqlen, head_dim=head_dim, **options)


@pytest.mark.parametrize("options, kernel, rank", [
    (dict(needs_grad=True), "cudnn", 95), (dict(causal=True, needs_grad=True), "cudnn", 95),
    (dict(), "cudnn", 50), (dict(seqlen=4096), "cudnn", 95), (dict(seqlen=4096, causal=True), "cudnn", 50),
    (dict(seqlen=4096, head_dim=64), "cudnn", 50), (dict(seqlen=16384, head_dim=64, causal=True), "cudnn", 95),
    (dict(wants_lse=False), "cudnn", 97), (dict(wants_lse=False, seqlen=16384), "cudnn", 95),
    (dict(wants_lse=False, seqlen=16384, head_dim=64), "cudnn", 97),
    (dict(wants_lse=False, needs_grad=True), "cudnn", 95),
    (dict(seqlen=128), "flash", 50),
    (dict(head_dim=96), "flash", 50), (dict(heads_kv=1), "flash", 50), (dict(arch="sm_80"), "flash", 50),
    (dict(dtype=torch.float32), None, None), (dict(window=(16, 0)), None, None),
    (dict(head_dim=100), None, None), (dict(mask_kind="bool", mask_shape=(1, 1, 1, 1024)), None, None),
])
def test_cuda_kernel_choice_and_rank(options, kernel, rank):
    p = _cuda_problem(**options)
    declined = bool(BACKEND.reasons(p))
    assert declined == (kernel is None)
    assert not BACKEND.extra_reasons(p)  # the declarations say every CUDA limit (sizes aside)
    if not declined:
        assert torch_cuda.kernel_name(p) == kernel
    if rank is not None:
        assert BACKEND.rank(p.bucketed()) == rank


@pytest.mark.parametrize("options, kernel, rank", [
    (dict(), "cudnn", 97), (dict(seqlen_k=131072, heads_kv=4), "cudnn", 97),
    (dict(wants_lse=True), "flash", 50), (dict(seqlen_k=1024), "flash", 50), (dict(head_dim=64), "flash", 50),
    (dict(seqlen=2), "flash", 50), (dict(arch="sm_80"), "flash", 50), (dict(causal=True), None, None),
])
def test_cuda_decoding_runs_cudnn_where_measured(options, kernel, rank):
    """One new token against a long cache without lse: cuDNN (GQA included), ahead of the cuda backend's
    decode kernel (96), as measured on the H200 2026-12-02; anything unmeasured keeps flash at 50."""
    options = {"seqlen": 1, "seqlen_k": 32768, "heads_kv": 1, "wants_lse": False, **options}
    p = _cuda_problem(**options)
    assert bool(BACKEND.reasons(p)) == (kernel is None)
    if kernel is not None:
        assert torch_cuda.kernel_name(p) == kernel and BACKEND.rank(p.bucketed()) == rank


def test_cuda_deterministic_backward_is_declined():
    p = _cuda_problem(needs_grad=True, deterministic=True)
    assert any("deterministic" in r for r in BACKEND.declared_reasons(p))


@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(seqlen=128, heads_kv=2)])
def test_cuda_launch_code_on_meta_tensors(options):
    p = _cuda_problem(**options)
    q = torch.empty(2, 4, p.seqlen_q, p.head_dim, dtype=p.dtype, device="meta")
    k = torch.empty(2, p.heads_kv, p.seqlen_k, p.head_dim, dtype=p.dtype, device="meta")
    x = Inputs(q, k, torch.empty_like(k))
    out, lse = torch_cuda.forward(p, x)
    assert out.shape == q.shape and lse.shape == (2, 4, p.seqlen_q) and lse.dtype == torch.float32
    grads = torch_cuda.backward(p, x, out, lse, torch.empty_like(out))
    assert grads.dq.shape == q.shape and grads.dk.shape == k.shape and grads.dv.shape == k.shape


@pytest.mark.parametrize("make, kept", [
    (lambda: torch.randn(2, 4, 16, 64, dtype=torch.float16), True),
    (lambda: torch.randn(2, 16, 4, 64, dtype=torch.float16).transpose(1, 2), True),       # bshd storage
    (lambda: torch.randn(2, 4, 130, 72, dtype=torch.float16)[:, :, 1:17, 3:67], False),  # odd offset, padded rows
    (lambda: torch.randn(1, 4, 16, 64, dtype=torch.float16).expand(2, 4, 16, 64), False),  # broadcast batch
    (lambda: torch.randn(2, 4, 16, 128, dtype=torch.float16)[..., ::2], False),          # last dim strided
    (lambda: torch.randn((), dtype=torch.float16).expand(2, 4, 16, 64), False),          # the dout of a .sum()
])
def test_cuda_operands_are_copied_unless_the_kernels_can_read_them(make, kept):
    t = make()
    ready = torch_cuda._kernel_ready(t)
    assert (ready is t) == kept
    assert torch.equal(ready, t) and ready.stride(-1) == 1 and ready.data_ptr() % 16 == 0


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_kv", [4, 2])
def test_cuda_path_marks_nan_rows_of_lse_as_the_formula_does(causal, heads_kv):
    """The fused CUDA kernels leave lse finite in rows that see a NaN; the launcher marks exactly the formula's."""
    from attnx.backends.torch.cuda import nan_rows_to_lse

    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, heads_kv, 16, 8), torch.randn(2, heads_kv, 16, 8)
    k[1, 0, 5, 3] = float("nan")
    q[0, 2, 7, 1] = float("nan")
    p, _ = make_call(q, k, v, causal=causal)
    _, want = attnx.attention(q.double(), k.double(), v.double(), causal=causal, backend="naive", return_lse=True)
    got = nan_rows_to_lse(p, q, k, torch.randn(2, 4, 16))
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.isnan(got).any() and not torch.isnan(got).all()


@pytest.mark.parametrize("causal", [False, True])
def test_lse_kept_only_for_the_backward_marks_rows_that_see_a_nan_key(causal):
    """Without return_lse (a training call) only rows that see a NaN key are marked: a NaN q row's scores
    are NaN in the backward whatever its lse, so q is not read (`Problem.returns_lse`)."""
    from attnx.backends.torch.cuda import nan_rows_to_lse

    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    p = attnx.explain(q, k, v, causal=causal).problem
    assert p.wants_lse and not p.returns_lse
    assert attnx.explain(q, k, v, causal=causal, return_lse=True).problem.returns_lse
    q, k = q.detach().clone(), k.detach().clone()
    k[1, 0, 5, 3] = float("nan")
    q[0, 2, 7, 1] = float("nan")
    got = torch.isnan(nan_rows_to_lse(p, q, k, torch.randn(2, 4, 16)))
    want = torch.zeros(2, 4, 16, dtype=torch.bool)
    want[1, 0, 5 if causal else 0:] = True  # the rows of (1, 0) that see key 5; (0, 2, 7) is left finite
    assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's fused CUDA kernels")
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_training_keeps_nan_rows_as_the_formula_does(causal):
    """A training call without return_lse still needs `nan_rows_to_lse`: a row that sees a NaN key must
    have a NaN lse for the backward too, or P stays finite off that key and dv misses the NaN (H200,
    2026-12-02, with the fix-up skipped: dv wrong without causal, dk with it). Its NaN q row is left to
    the scores (keys-only marking since 2026-12-03): the gradients must still be the formula's. out and dq must be NaN
    exactly where the float64 formula's are; dk and dv at least at every key a NaN row can see, and
    nowhere the formula is finite (keys such a row cannot see are not defined: docs/semantics.md)."""
    torch.manual_seed(0)
    shape = (2, 4, 256, 64)
    q, k, v = (torch.randn(shape, dtype=torch.bfloat16) for _ in range(3))
    k[1, 0, 5, 3] = float("nan")
    q[0, 2, 7, 1] = float("nan")
    dout = torch.randn(shape, dtype=torch.bfloat16)
    results = []
    for device, dtype, backend in (("cuda", torch.bfloat16, "torch"), ("cpu", torch.float64, "naive")):
        leaves = [t.to(device, dtype, copy=True).requires_grad_() for t in (q, k, v)]
        out = attnx.attention(*leaves, causal=causal, backend=backend)
        out.backward(dout.to(device, dtype))
        results.append([torch.isnan(t).cpu() for t in (out, *(leaf.grad for leaf in leaves))])
    (out, dq, dk, dv), (want_out, want_dq, want_dk, want_dv) = results
    assert torch.equal(out, want_out) and torch.equal(dq, want_dq)
    assert want_out.any() and not want_out.all()
    nan_rows = want_out.any(-1)                                           # (B, H, Sq)
    last_row = torch.where(nan_rows, torch.arange(shape[2]), -1).amax(-1)  # the last NaN row per (b, h)
    keys = torch.arange(shape[2])
    seen = keys <= last_row[..., None] if causal else (last_row[..., None] >= 0).expand(-1, -1, shape[2])
    for got, want, name in ((dk, want_dk, "dk"), (dv, want_dv, "dv")):
        required = want & seen[..., None]
        assert (got | ~required).all(), f"{name}: finite at a key a NaN row sees"
        assert (want | ~got).all(), f"{name}: NaN where the formula is finite"


def test_nan_fixup_ways_give_the_same_lse():
    """benchmarks/nan_fixup.py: every fix-up way (the backend's two Triton kernels among them) must mark
    exactly the rows `nan_rows_by_ops` marks: GQA, causal, NaN in q and in keys at any position,
    infinities; bf16 and float32. Compiled kernels on a GPU; Triton's interpreter (3.9 or later: 3.6's
    fails in these kernels, H200 image 2026-12-02) on a CPU."""
    triton = pytest.importorskip("triton")
    env = dict(os.environ)
    if not torch.cuda.is_available():
        if Version(triton.__version__).release < (3, 9):
            pytest.skip(f"Triton {triton.__version__}'s interpreter fails in these kernels")
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.nan_fixup", "check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "every way gives the ops' lse" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_nan_row_candidates_agree_on_nan_and_infinities(capsys):
    """benchmarks/nan_rows.py: cheaper ways to find NaN rows for `nan_rows_to_lse` (its amax costs 0.34 ms of a
    1.80 ms training step on the H200) must give the same rows, infinities and huge values included."""
    from benchmarks import nan_rows

    assert nan_rows.check("cpu"), capsys.readouterr().out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("transposed", [False, True])
def test_cuda_path_nan_row_finder_agrees_with_isnan_any(dtype, transposed):
    """`_rows_with_nan` (the H200's fastest way, benchmarks/nan_rows.py) on NaN, +-inf, both infinities in
    one row and rows of the dtype's largest value; also on a (B, S, H, D) tensor viewed as (B, H, S, D)."""
    from attnx.backends.torch.cuda import _rows_with_nan
    from benchmarks import nan_rows

    t = nan_rows._inputs("cpu", dtype=dtype, shape=(2, 8, 64, 16))
    if transposed:
        t = t.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(_rows_with_nan(t), torch.isnan(t).any(-1))
    assert torch.equal(_rows_with_nan(t[..., :0]), torch.zeros(t.shape[:-1], dtype=torch.bool))


@pytest.mark.parametrize("seqlen_k", [1, 4, 15, 16, 40])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_kernel_nan_rows_are_nan_rows(seqlen_k, causal, where, dtype):
    """torch's CPU flash kernel (torch 2.13) turns a row whose scores are all NaN into a row that saw nothing
    (out 0, lse 0) below 16 keys; the torch backend gives the formula's NaN rows (out, lse, and which
    rows of each gradient hold a NaN), as `naive` does."""
    gen = torch.Generator().manual_seed(seqlen_k)
    q, k, v = (torch.randn(2, 2, n, 8, generator=gen, dtype=dtype) for n in (3, seqlen_k, seqlen_k))
    if where == "q":
        q[0, 1, -1, 4] = float("nan")  # the last row sees keys under either alignment
    else:
        k[1, 0, seqlen_k // 2, 4] = float("nan")
    results = {}
    for backend in ("torch", "naive"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = attnx.attention(*leaves, causal=causal, backend=backend, return_lse=True)
        out.sum().backward()
        results[backend] = (out.detach(), lse, *(t.grad for t in leaves))
    got, want = results["torch"], results["naive"]
    assert torch.isnan(want[0]).any()
    for a, b in zip(got, want):
        assert torch.equal(torch.isnan(a).any(-1) if a.dim() == 4 else torch.isnan(a),
                           torch.isnan(b).any(-1) if b.dim() == 4 else torch.isnan(b))
    finite = torch.isfinite(want[0])
    assert torch.allclose(got[0][finite], want[0][finite], atol=1e-5)


@pytest.mark.parametrize("seqlen", [1, 5, 40])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("nan", [None, "q", "k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_plain_path_backward_matches_the_formula(seqlen, causal, scale, nan, dtype):
    """The CPU kernel's short path (full attention, or causal with Sq == Sk; `cpu._plain`), forward and
    backward, against `naive`: values where finite, NaN exactly where the formula's rows are NaN (a NaN
    in q or in a key; lse read with one sum), GQA included, default and explicit scale."""
    gen = torch.Generator().manual_seed(seqlen)
    q = torch.randn(2, 4, seqlen, 8, generator=gen, dtype=dtype)
    k, v = (torch.randn(2, 2, seqlen, 8, generator=gen, dtype=dtype) for _ in range(2))
    if nan == "q":
        q[0, 1, seqlen - 1, 4] = float("nan")
    elif nan == "k":
        k[1, 0, 0, 4] = float("nan")
    p = attnx.explain(q, k, v, causal=causal, scale=scale).problem
    assert p.window_left is None and attnx.backends.torch.cpu._plain(p, Inputs(q, k, v))
    results = {}
    for backend in ("torch", "naive"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = attnx.attention(*leaves, causal=causal, scale=scale, backend=backend, return_lse=True)
        out.backward(torch.ones_like(out))
        results[backend] = (out.detach(), lse, *(t.grad for t in leaves))
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for got, want, name in zip(results["torch"], results["naive"], ("out", "lse", "dq", "dk", "dv")):
        assert torch.equal(torch.isnan(got), torch.isnan(want)), name
        finite = ~torch.isnan(want)
        assert torch.allclose(got[finite], want[finite], atol=tol, rtol=tol), name


@pytest.mark.parametrize("arch", [80, 90])
def test_nan_row_kernels_compile_for_nvidia_targets(arch):
    """The torch backend's two NaN-row kernels (backends/torch/nan_rows_triton.py) compile ahead of time
    for sm_80 and sm_90 (no GPU needed) at every head-dim tile, both dtypes, causal or not."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from attnx.backends.torch import nan_rows_triton as kernels

    strides = {"stride_b": "i64", "stride_h": "i64", "stride_s": "i64", "stride_d": "i32"}
    target = GPUTarget("cuda", arch, 32)
    for dtype in ("bf16", "fp16"):
        for block_d in (16, 64, 128, 256):
            first = {"k_ptr": f"*{dtype}", "first_ptr": "*i32", "heads_kv": "i32", "seqlen_k": "i32",
                     "head_dim": "i32", "chunk": "i32", "chunks": "i32", **strides,
                     "BLOCK_N": "constexpr", "BLOCK_D": "constexpr"}
            compiled = triton.compile(ASTSource(kernels._first_nan_key, first,
                                                {"BLOCK_N": kernels.BLOCK_N, "BLOCK_D": block_d}), target=target)
            assert compiled.asm.get("cubin")
            for causal, q_rows in ((False, True), (True, True), (False, False), (True, False)):
                mark = {"q_ptr": f"*{dtype}", "first_ptr": "*i32", "lse_ptr": "*fp32", "heads_q": "i32",
                        "heads_kv": "i32", "seqlen_q": "i32", "seqlen_k": "i32", "head_dim": "i32", "chunks": "i32",
                        **strides, "CAUSAL": "constexpr", "BLOCK_M": "constexpr", "BLOCK_D": "constexpr",
                        "CHUNKS": "constexpr", "Q_ROWS": "constexpr"}
                constants = {"CAUSAL": causal, "BLOCK_M": kernels.BLOCK_M, "BLOCK_D": block_d,
                             "CHUNKS": kernels.MAX_CHUNKS, "Q_ROWS": q_rows}
                compiled = triton.compile(ASTSource(kernels._mark_lse, mark, constants), target=target)
                assert compiled.asm.get("cubin")
