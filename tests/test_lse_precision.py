"""The forward's lse over many key blocks (benchmarks/lse_precision.py) and the EXACT_ALPHA knob.

The CPU model reproduces the H200's lse error of the Hopper forward at S = 2**20 (2.7e-3): the
rescale factor alpha = exp2(old_max * unit - shift) is fused into an FFMA whose product is not rounded,
so while the row max stays alpha is 2^(rounding error of the shift) instead of 1, compounding over the
key blocks. A compensated sum does not help; rounding the product (EXACT_ALPHA=1: the forward from
`EXACT_ALPHA_MIN_KEYS` keys, the decode kernel always, since 2026-12-02) does.
"""
import numpy as np
import pytest
import torch

from attnx.backends.cuda import families, nvrtc_check, variants
from attnx.backends.cuda.compile import kernel_source, nvrtc_options
from benchmarks import lse_precision


def test_model_reproduces_the_fused_alpha_drift_and_the_fix_removes_it():
    # 512 key blocks: the kernel's order drifts ~1e-4 (it grows with the number of blocks: 2.8e-3 at
    # 8192 blocks, as on the H200); triton's order and the fix stay at float32 rounding
    pos, ref, err, predicted = lse_precision.model(seqlen=1 << 16, rows=6, seed=0)
    worst = {c: float(np.abs(e).max()) for c, e in err.items()}
    assert worst["kernel"] > 5e-5, worst
    assert worst["alpha-fix"] < 1e-5 and worst["triton"] < 1e-5, worst
    assert worst["alpha-fix"] * 10 < worst["kernel"], worst
    # compensation is no cure: the drift is a multiplicative bias of the sum, not lost additions
    assert worst["kahan"] > 0.5 * worst["kernel"], worst
    # the first-order prediction (-ln2 x the shift's rounding error x blocks) explains the kernel's error
    assert float(np.abs(err["kernel"] - predicted).max()) < 0.3 * worst["kernel"], (err["kernel"], predicted)
    # per row: the peaked row with the largest drift is fixed
    i = int(np.argmax(np.abs(err["kernel"])))
    assert abs(err["alpha-fix"][i]) < abs(err["kernel"][i]) / 10


def test_model_causal_rows_see_fewer_blocks():
    pos, ref, err, _ = lse_precision.model(seqlen=1 << 14, rows=3, seed=1, causal=True)
    assert abs(err["kernel"][0]) < 1e-6  # row 0 sees one key: no rescale at all
    assert float(np.abs(err["alpha-fix"]).max()) < 1e-5


def _nvrtc() -> str:
    return nvrtc_check.unavailable_reason()


def test_exact_alpha_from_long_key_sequences_and_in_decode():
    """The forward rounds the rescale product from `EXACT_ALPHA_MIN_KEYS` keys (its drift grows with the key
    blocks; it costs up to 8 % of non-causal speed below, H200 2026-12-02), the decode kernel always; both
    forward twins are requestable."""
    for fam in (families.HOPPER, families.AMPERE):
        fwd = [v for v in variants.all_variants(fam) if v.kernel == "fwd"]
        with_it = {v._replace(exact_alpha=False) for v in fwd if v.exact_alpha}
        assert with_it and with_it == {v for v in fwd if not v.exact_alpha}
        assert all(("-DEXACT_ALPHA=1" in v.defines()) == v.exact_alpha for v in fwd)
        assert "+exactalpha" in fwd[0]._replace(exact_alpha=True).label()
    decode = [v for v in variants.all_variants(families.HOPPER) if v.kernel == "decode"]
    assert decode and all("-DEXACT_ALPHA=1" in v.defines() for v in decode)
    others = [v for v in variants.all_variants(families.HOPPER) if v.kernel not in ("fwd", "decode")]
    assert not any("EXACT_ALPHA" in d for v in others for d in v.defines())


@pytest.mark.parametrize("seqlen_k,want", [(4096, False), (variants.EXACT_ALPHA_MIN_KEYS - 1, False),
                                           (variants.EXACT_ALPHA_MIN_KEYS, True), (1 << 20, True)])
def test_the_forward_picks_exact_alpha_by_key_count(seqlen_k, want):
    from attnx.backends.cuda import launch_sm90
    from attnx.problem import Problem

    p = Problem.create(dtype=torch.bfloat16, batch=1, heads_q=1, heads_kv=1, seqlen_q=128, seqlen_k=seqlen_k,
                       head_dim=128, device="cuda", vendor="nvidia", arch="sm_90")
    assert launch_sm90.forward_variant_for(p).exact_alpha is want


@pytest.mark.parametrize("family,arch,tile", [(families.HOPPER, "sm_90a", 128), (families.HOPPER, "sm_90a", 64),
                                              (families.AMPERE, "sm_80", 64)])
def test_exact_alpha_compiles_without_spills(family, arch, tile):
    reason = _nvrtc()
    if reason:
        pytest.skip(reason)
    cap = (9, 0) if arch == "sm_90a" else (8, 0)
    v = variants.forward_variant(family, True, tile, False, variants.max_shared(cap))
    for knob in (False, True):
        w = v._replace(exact_alpha=knob)
        ok, log, size = nvrtc_check.compile_source(kernel_source(w.source), w.source,
                                                   (*nvrtc_options(w, arch), "-Xptxas=-v"))
        assert ok and size > 0, log[:2000]
        assert " 0 bytes spill stores" in log, log
