"""cuda: hand-written FlashAttention-2 kernels (mma.sync, ldmatrix, cp.async) compiled by NVRTC through CuPy."""
from __future__ import annotations

import math

import torch

from attnx.backend import Backend
from attnx.limits import length_reasons

from . import tensor_maps
from .families import capability_range
from .variants import HEAD_DIM_TILES

_LOWEST, _HIGHEST = capability_range()


def _hopper_backward(p) -> bool:
    """Whether the Hopper backward (kernels/sm90/fa_bwd.cu) runs `p`'s gradients: sm_90, head dims up to
    128; deterministic problems take its ordered-dQ variant (`backward` below)."""
    if p.capability is None or p.q_format != "dense":
        return False
    from .launch_sm90_bwd import backward_variant_for

    return backward_variant_for(p) is not None


class CudaBackend(Backend):
    name = "cuda"
    description = ("FlashAttention in CUDA C++ compiled at run time by NVRTC through CuPy, NVIDIA sm_80..sm_90, "
                   "fp16/bf16: FlashAttention-2 kernels (mma.sync, ldmatrix, cp.async) for Ampere/Ada; on Hopper "
                   "warp-specialised wgmma + TMA kernels (FlashAttention-3 style): the forward, and the "
                   "backward up to head dim 128 (the Ampere backward above); a split-KV decode kernel for "
                   "cache and paged keys (forward, up to 16 queries per sequence); packed (varlen) q and k/v "
                   "through the Hopper forward on sm_90 with cuda-bindings (ranked above triton), else the "
                   "Ampere forward, and gradients through the Ampere backward (both ranked below triton)")
    device_types = frozenset({"cuda"})
    vendors = frozenset({"nvidia"})
    min_capability = _LOWEST           # the span of the kernel families (families.py)
    max_capability = _HIGHEST
    dtypes = frozenset({torch.float16, torch.bfloat16})
    max_head_dim = HEAD_DIM_TILES[-1]
    mask_kinds = frozenset()          # dense masks are not implemented in the kernels
    # cache and paged keys: the split-KV decode kernel (launch_decode.py), forward only, <= 16 queries;
    # packed q and k/v (launch_varlen.py): the Hopper or Ampere forward built with VARLEN=1, and the Ampere
    # backward built with VARLEN=1 on both families. Packed q against cache or paged keys has no kernel here.
    formats = frozenset({("dense", "dense"), ("dense", "cache"), ("dense", "paged"), ("varlen", "varlen")})
    backward_formats = frozenset({("dense", "dense"), ("varlen", "varlen")})
    supports_mask_grad = False
    # The default backwards add dQ with fp32 atomics. Deterministic problems the Hopper backward covers run
    # its ordered-dQ variant (fixed order of key blocks per query block): 148/148 cases bitwise-identical
    # over reruns on the H200 (2026-12-03 on the DQ_LATE schedule), 1.14-1.30x the atomic Hopper backward's
    # time. The others run launch_deterministic.py (the Ampere backward without atomic dQ, then a dQ pass):
    # bitwise-identical on the H200 2026-12-01 (105 cases), 1.06-1.12x the atomic Ampere backward (NOTES.md).
    deterministic = True
    supports_offset = True
    supports_sinks = True
    # measured on the H200 (2026-12-01, bf16, paper setting, benchmarks/results/h200-2026-12-01-backward/):
    # the Hopper forward beats triton everywhere and the torch backend's cuDNN forward with lse (196-580
    # TFLOP/s against this one's 337-644), so forward-only problems come here first on sm_90 (96);
    # cuDNN without lse was faster at d64 and d128 up to 4k tokens (d64 S=1k: 430 vs 337), where the
    # torch backend ranks 97 for calls that want no lse (`Problem.wants_lse`). Training with the Hopper
    # backward (head dims <= 128; deterministic ones ordered) ranks 92, ahead of triton (90): fwd+bwd d128 16k
    # 442 TFLOP/s against triton's 368; the torch backend (cuDNN, 555) still comes first where it runs.
    # Other training problems keep 60 (the Ampere backward on sm_90: 284 TFLOP/s).
    priority = {"cuda:nvidia": 80, "cuda:sm_90": 60}
    forward_priority = {"cuda:sm_90": 96}
    hopper_training_priority = 92
    # Packed (varlen) forwards (launch_varlen). The Hopper kernel (sm_90 with cuda-bindings) against triton's
    # varlen kernel on the H200 (2026-12-02, bf16, 16k packed tokens, benchmarks/results/h200-2026-12-02-run7/
    # call3/logs/varlen-hopper-time.log): d128 1.14-1.52x in all 6 settings; d64 1.09-1.23x in 3, 0.97-0.99x in
    # 3 (random lengths, and 16 equal sequences without causal). So it ranks 93, above triton
    # (90). The Ampere mma.sync kernel (other GPUs, sm_90 without cuda-bindings) was 0.71-0.86x triton's in 11
    # of 12 settings on the H200 (run2): below triton (85 on sm_90, 65 on other NVIDIA GPUs, where nothing was
    # measured). Still ahead of blocked (20) and naive (10).
    hopper_varlen_priority = 93
    varlen_priority = {"cuda:sm_90": 85, "cuda:nvidia": 65}

    required_modules = ("cupy",)
    install_hint = 'pip install "attnx[cuda13]"  (or [cuda12])'

    def environment_reasons(self) -> list[str]:
        if not torch.cuda.is_available() or torch.version.hip:
            return ["no NVIDIA CUDA device visible to torch"]
        return []

    def extra_reasons(self, p) -> list[str]:
        from .families import family_for
        from .launch import MAX_GRID, score_mod
        from .variants import (backward_variants, deterministic_backward_variants, forward_variant, head_dim_tile,
                               max_shared)

        reasons = length_reasons(p)
        family = family_for(p.capability)
        if family is None:  # the declared capability range has gaps only if the families do
            return reasons + [f"no kernel family for {p.arch}"]
        if "varlen" in (p.q_format, p.kv_format):  # (before the decode branch: that takes every other kv)
            from .launch_varlen import varlen_reasons

            return reasons + varlen_reasons(p)
        if p.kv_format != "dense":
            from .launch_decode import decode_reasons

            return reasons + decode_reasons(p)
        mod = score_mod(p)
        bf16 = p.dtype == torch.bfloat16
        shared = max_shared(p.capability)
        tile = head_dim_tile(p.head_dim, p.head_dim_v, family, "fwd")
        fwd = forward_variant(family, bf16, tile, mod, shared)
        if fwd is None:
            reasons.append(f"no forward tile for head dim {tile} fits {shared} bytes of shared memory")
        elif p.batch * p.heads_q * math.ceil(p.seqlen_q / fwd.block_m) > MAX_GRID:
            reasons.append("too many query blocks for one launch")
        if family.tensor_maps and not tensor_maps.tensor_maps_available():
            reasons.append(f"the {family.name} forward encodes TMA tensor maps through cuda-bindings, "
                           "which is not installed (pip install cuda-bindings)")
        tile = head_dim_tile(p.head_dim, p.head_dim_v, family, "bwd")
        if p.needs_grad and backward_variants(family, bf16, tile, mod, shared) is None:
            reasons.append(f"no backward tile for head dim {tile} fits {shared} bytes of shared memory")
        elif p.deterministic and deterministic_backward_variants(family, bf16, tile, mod, shared) is None:
            reasons.append(f"no deterministic backward tile for head dim {tile} fits {shared} bytes of shared memory")
        return reasons

    def rank(self, p) -> int:
        """Packed q: 93 for forwards the Hopper varlen kernel runs (above triton), else `varlen_priority`
        (below triton; gradients run the Ampere backward). Otherwise on sm_90: 96 without gradients, 92 with gradients the Hopper backward runs; else
        `priority`."""
        if p.q_format == "varlen":
            from .launch_varlen import hopper_runs

            if hopper_runs(p) and not p.needs_grad:  # (gradients: the Ampere backward, below triton)
                return self.hopper_varlen_priority
            for device_class in p.device_classes:
                if device_class in self.varlen_priority:
                    return self.varlen_priority[device_class]
            return super().rank(p)
        if p.needs_grad:
            return self.hopper_training_priority if _hopper_backward(p) else super().rank(p)
        for device_class in p.device_classes:
            if device_class in self.forward_priority:
                return self.forward_priority[device_class]
        return super().rank(p)

    def doctor_details(self) -> dict:
        """First-call cost the doctor reports: one small forward compiles (or loads from disk) its kernel."""
        import time

        import attnx

        from .compile import compile_time_report

        q = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.float16)
        start = time.perf_counter()
        attnx.attention(q, q, q, backend=self.name)
        torch.cuda.synchronize()
        first_call = time.perf_counter() - start
        kernels = ", ".join(f"{r['variant']} {r['seconds']:.2f}s ({r['registers']} regs, {r['local_bytes']} B local)"
                            for r in compile_time_report())
        return {"first call, fp16 d64 (compile or disk-cache load)": f"{first_call:.2f}s",
                "kernels loaded": kernels}

    def forward(self, p, x):
        from .launch_decode import runs_decode

        if p.q_format == "varlen":  # (before runs_decode, which takes every non-dense kv)
            from .launch_varlen import forward as varlen_forward

            return varlen_forward(p, x)
        if runs_decode(p):
            from .launch_decode import forward as decode_forward

            return decode_forward(p, x)
        from .launch import forward

        return forward(p, x)

    def backward(self, p, x, out, lse, dout):
        if p.q_format == "varlen":
            from .launch_varlen import backward as varlen_backward

            return varlen_backward(p, x, out, lse, dout)
        if _hopper_backward(p):
            from .launch_sm90_bwd import backward as hopper_backward
            from .launch_sm90_bwd import backward_variant_for
            from .variants import ordered_twin

            variant = backward_variant_for(p)
            return hopper_backward(p, x, out, lse, dout, ordered_twin(variant) if p.deterministic else variant)
        if p.deterministic:
            from .launch_deterministic import backward as deterministic_backward

            return deterministic_backward(p, x, out, lse, dout)
        from .launch import backward

        return backward(p, x, out, lse, dout)


BACKEND = CudaBackend()
