"""The torch backend declares, per device, exactly what that device's path computes.

Two checks, both walking the conformance grid of the backend that declares everything (naive),
so every feature appears:

* on each real device here (the CPU; CUDA when a GPU is present): every problem the torch backend
  accepts runs and matches the float64 oracle, and every one it declines is declined by its
  declarations with a reason (never by `extra_reasons` alone);
* on CUDA problems described without a GPU (sm_80, sm_90): the declarations accept exactly the
  problems torch's fused kernels compute, stated here independently, and an accepted problem
  never needs a mask tensor (the CUDA launch code passes none).
"""
from __future__ import annotations

import pytest
import torch

import attnx
from attnx.backend import Backend, Declarations
from attnx.conformance import generate_cases, run_case
from attnx.conformance.check import declined_reasons_kind
from attnx.conformance.runner import declarations_on
from attnx.problem import Problem

from attnx.backends.torch import cuda as torch_cuda
from attnx.backends.torch.masks import needs_mask_tensor, positional_sides

BACKEND = attnx.get_backend("torch")
GRID = generate_cases(attnx.get_backend("naive"), "quick")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


def _grid_on(device: str) -> list:
    """The naive grid, with fp16 twins on CUDA (where the torch backend declares fp16/bf16 only)."""
    if device == "cpu":
        return GRID
    from dataclasses import replace
    return GRID + [replace(c, group=c.group + "-fp16", dtype="float16") for c in GRID if c.dtype == "float32"]


@pytest.mark.parametrize("device", DEVICES)
def test_accepted_problems_match_the_oracle_and_declined_ones_have_declared_reasons(device):
    failures, accepted, declined = [], 0, 0
    for case in _grid_on(device):
        result = run_case("torch", case, device)  # an extra-only decline is a failure here
        if result.status == "declined":
            declined += 1
            if not result.reasons or not all(isinstance(r, str) and r for r in result.reasons):
                failures.append(f"{case.id}: declined without a reason")
        elif result.status == "pass":
            accepted += 1
        else:
            failures.append(f"{case.id}: {result.summary()}")
    assert not failures, "\n".join(failures[:20])
    assert accepted > 20 and declined > 20  # the grid reaches both sides


@pytest.mark.parametrize("device", DEVICES)
def test_every_decline_on_the_grid_comes_from_the_declarations(device):
    for case in _grid_on(device):
        p = case.problem()
        if device == "cuda":
            vendor, arch = attnx.capability.device_arch(torch.device("cuda"))
            p = p._replace(device_type="cuda", vendor=vendor, arch=arch)
        if not p.is_empty and BACKEND.reasons(p):
            assert declined_reasons_kind(BACKEND, p) == "declarations", (case.id, BACKEND.reasons(p))


# -- CUDA, described without a GPU ---------------------------------------------------------------
def fused_cuda_computes(p: Problem) -> bool:
    """What torch's fused NVIDIA kernels (cuDNN, flash) compute exactly as the contract says."""
    plain_rule = not p.has_window or (p.is_causal_only and p.seqlen_q == p.seqlen_k and p.offset is None)
    return (p.vendor == "nvidia" and p.capability >= (8, 0) and p.dtype in (torch.float16, torch.bfloat16)
            and p.head_dim == p.head_dim_v and p.head_dim % 8 == 0 and p.head_dim <= 256
            and p.mask_kind is None and not p.has_alibi and p.softcap is None and not p.has_sinks
            and p.is_dense and plain_rule and not (p.needs_grad and p.deterministic))


def _cuda_problems():
    for case in generate_cases(attnx.get_backend("naive"), "full"):
        base = case.problem()
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for arch in ("sm_90", "sm_80", "sm_75"):
                for deterministic in (False, True):
                    yield case.id, base._replace(device_type="cuda", vendor="nvidia", arch=arch, dtype=dtype,
                                                 deterministic=deterministic and base.needs_grad)
        yield case.id, base._replace(device_type="cuda", vendor="amd", arch="gfx942", dtype=torch.float16)


def test_cuda_declarations_accept_exactly_what_the_fused_kernels_compute():
    wrong = []
    for case_id, p in _cuda_problems():
        accepted = not BACKEND.reasons(p)
        if accepted != fused_cuda_computes(p):
            wrong.append(f"{case_id} {p.dtype} {p.arch}: accepted={accepted} reasons={BACKEND.reasons(p)}")
        if accepted:
            assert not needs_mask_tensor(p), case_id  # the launch code passes no mask
            assert torch_cuda.kernel_name(p) in ("cudnn", "flash")
    assert not wrong, "\n".join(wrong[:20])


def test_cuda_declines_no_more_than_rules_that_hide_no_key():
    # Conservative only where a causal/window rule or offset hides no key at all (decoding with
    # causal=True, a window wider than the sequence): the kernel would compute those too.
    for case_id, p in _cuda_problems():
        if fused_cuda_computes(p._replace(causal=False, window_left=None, window_right=None, offset=None)):
            if BACKEND.reasons(p) and p.has_window:
                binding = positional_sides(p)
                assert binding == (None, None) or not (binding[0] is None and p.seqlen_q == p.seqlen_k), case_id


def test_the_cuda_grid_holds_only_what_cuda_declares():
    cuda = BACKEND.declarations(("cuda:sm_90", "cuda:nvidia", "cuda", "*"))
    assert isinstance(cuda, Declarations) and cuda.dtypes == {torch.float16, torch.bfloat16}
    cases = generate_cases(cuda, "full")
    assert cases and {c.dtype for c in cases} <= {"float16", "bfloat16"}
    assert all(c.mask is None and c.head_dim % 8 == 0 for c in cases)
    assert declarations_on(BACKEND, "cpu") is BACKEND  # nothing differs on the CPU


# -- the base class's per-device declarations -----------------------------------------------------
class _TwoDevices(Backend):
    name = "two_devices"
    device_types = frozenset({"cpu", "cuda"})
    device_declarations = {"cuda": {"dtypes": frozenset({torch.float16}), "supports_window": False},
                           "cuda:sm_90": {"dtypes": frozenset({torch.bfloat16})}}


def _problem(device="cpu", arch=None, **options):
    vendor = "nvidia" if device == "cuda" else None
    return Problem.create(device=device, vendor=vendor, arch=arch, dtype=options.pop("dtype", torch.float16),
                          batch=1, heads_q=2, seqlen_q=8, head_dim=16, **options)


def test_device_declarations_override_by_the_most_specific_device_class():
    b = _TwoDevices()
    assert b.reasons(_problem(dtype=torch.float32)) == []                       # CPU: the class attributes
    assert b.reasons(_problem("cuda", "sm_80")) == []
    assert any("dtype float32" in r for r in b.reasons(_problem("cuda", "sm_80", dtype=torch.float32)))
    assert any("sliding window" in r for r in b.reasons(_problem("cuda", "sm_80", window=(2, 2))))
    assert any("dtype float16" in r for r in b.reasons(_problem("cuda", "sm_90")))  # sm_90 wins over cuda
    assert b.reasons(_problem("cuda", "sm_90", dtype=torch.bfloat16)) == []
    assert any("sliding window" in r for r in b.reasons(_problem("cuda", "sm_90", dtype=torch.bfloat16,
                                                                   window=(2, 2))))  # cuda's entry still applies


def test_device_declarations_name_only_declarations():
    with pytest.raises(TypeError, match="not declarations"):
        type("Typo", (Backend,), {"device_declarations": {"cuda": {"dtype": frozenset()}}})


def test_head_dim_multiple_and_equal_lengths_are_declarations():
    b = type("Narrow", (Backend,), {"head_dim_multiple": 8, "causal_needs_equal_lengths": True})()
    p = Problem.create(dtype=torch.float32, batch=1, heads_q=1, seqlen_q=4, seqlen_k=6, head_dim=12, causal=True)
    text = "; ".join(b.declared_reasons(p))
    assert "not a multiple of 8" in text and "Sq == Sk" in text
    assert b.declared_reasons(p._replace(head_dim=16, head_dim_v=16, seqlen_k=4)) == []
