"""Every kernel variant the triton backend can launch, and ahead-of-time compilation of one for a target.

A variant is (kernel, dtype, BLOCK_D, path, config); `variants(target)` lists them from
`configs.candidates` (and `configs.decode_config`/`combine_config` for the split-KV decode
kernels), exactly as the launcher picks them. Tensor formats are runtime arguments: no variants. `compile_variant` runs
`triton.compile` for a `GPUTarget` without a GPU and reports registers/shared memory
where the target's binary says them. Used by tests/test_triton_aot.py:

    python -m attnx.backends.triton.aot gfx942        # compile every variant for MI300
"""
from __future__ import annotations

import sys
import time
from typing import NamedTuple

from . import cache_fallback, configs

# name -> (backend, arch, warp size, config family, shared memory per block in bytes)
TARGETS = {
    "sm_80": ("cuda", 80, 32, "ampere", 166912),
    "sm_90": ("cuda", 90, 32, "hopper", 232448),
    "gfx90a": ("hip", "gfx90a", 64, "cdna", 65536),
    "gfx942": ("hip", "gfx942", 64, "cdna", 65536),
    "gfx1100": ("hip", "gfx1100", 32, "rdna", 65536),
}
_FLOAT_ARGS = {"scale", "softcap"}
_FP32_POINTERS = {"Lse", "Delta", "Mask", "Slopes", "Sinks", "dMask", "PartOut", "PartLse"}
_I32_POINTERS = {"CuQ", "CuK", "SeqlensK", "PageTable"}


class Variant(NamedTuple):
    kernel: str        # "fwd", "bwd_dkdv", "bwd_dq", "bwd_preprocess", "decode", "decode_combine"
    dtype: str         # "fp16", "bf16", "fp32"
    block_d: int
    path: str          # "dense" or "general"
    config: configs.LaunchConfig

    @property
    def id(self) -> str:
        c = self.config
        return (f"{self.kernel}-{self.dtype}-d{self.block_d}-{self.path}-m{c.block_m}n{c.block_n}"
                f"w{c.num_warps}s{c.num_stages}")


def variants(target: str) -> list[Variant]:
    """What the launcher can launch on `target`, minus variants declared unsupported there."""
    fam = TARGETS[target][3]
    found = []
    for dtype in configs.DTYPES:
        for bd in configs.BLOCK_DS:
            found.append(Variant("bwd_preprocess", dtype, bd, "general",
                                 configs.LaunchConfig(configs.PREPROCESS_BLOCK_M, 0, 4, 1)))
            for path in configs.PATHS:
                if path == "dense" and (dtype not in configs.DENSE_DTYPES or fam not in configs.DENSE_FAMILIES):
                    continue
                for kernel in configs.KERNELS:
                    if configs.unsupported_reason(fam, kernel, path, bd, dtype):
                        continue
                    for cfg in configs.candidates(fam, kernel, path, bd, dtype):
                        found.append(Variant(kernel, dtype, bd, path, cfg))
            # split-KV decode: every feature and format at runtime, one variant per dtype and BLOCK_D
            found.append(Variant("decode", dtype, bd, "general", configs.decode_config(fam, bd, dtype)))
        found.append(Variant("decode_combine", dtype, configs.COMBINE_BLOCK_D, "general", configs.combine_config(fam)))
    return found


def _kernel_fn(kernel: str):
    from . import kernels_bwd, kernels_decode, kernels_fwd

    return {"fwd": kernels_fwd.attn_fwd, "bwd_dkdv": kernels_bwd.bwd_dkdv, "bwd_dq": kernels_bwd.bwd_dq,
            "bwd_preprocess": kernels_bwd.bwd_preprocess, "decode": kernels_decode.attn_decode,
            "decode_combine": kernels_decode.decode_combine}[kernel]


def _signature(fn, variant: Variant, constexprs: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name[0].isupper() or name.startswith("d") and name[1:2].isupper():
            sig[name] = ("*fp32" if name in _FP32_POINTERS else "*i32" if name in _I32_POINTERS
                         else f"*{variant.dtype}")
        elif name in _FLOAT_ARGS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


@cache_fallback.survives_cache_errors
def compile_variant(variant: Variant, target: str) -> dict:
    """Compile one variant for `target` (no GPU needed); returns its resource use."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    backend, arch, warp, fam, _ = TARGETS[target]
    fn = _kernel_fn(variant.kernel)
    c = variant.config
    if variant.kernel == "bwd_preprocess":
        constexprs = {"BLOCK_M": c.block_m, "BLOCK_D": variant.block_d}
    elif variant.kernel == "decode":
        constexprs = {"BLOCK_R": c.block_m, "BLOCK_N": c.block_n, "BLOCK_D": variant.block_d}
    elif variant.kernel == "decode_combine":
        constexprs = {"BLOCK_R": c.block_m, "BLOCK_D": c.block_n}
    else:
        constexprs = {"BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "BLOCK_D": variant.block_d,
                      "DENSE": variant.path == "dense"}
    # a launch sees the head dim contiguous (stride 1), which Triton folds in as a constant
    constexprs.update({name: 1 for name in fn.arg_names if name.startswith("stride") and name.endswith("d")})
    sig = _signature(fn, variant, constexprs)
    # the launch specialises pointers and the ints not in do_not_specialize (strides; the decode
    # kernel's head dims) on 16-divisibility; assume the aligned case
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
               if sig[name].startswith("*") or sig[name] == "i32" and name not in fn.do_not_specialize}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=aligned)
    start = time.perf_counter()
    compiled = triton.compile(src, target=GPUTarget(backend, arch, warp), options=c.options(fam))
    meta = compiled.metadata
    binary = "cubin" if backend == "cuda" else "hsaco"
    return {"id": variant.id, "target": target, "seconds": round(time.perf_counter() - start, 2),
            "shared": meta.shared, "binary_bytes": len(compiled.asm.get(binary, b"")),
            "wgmma": "wgmma" in compiled.asm.get("ptx", "")}


def main(argv=None) -> int:
    targets = (argv if argv is not None else sys.argv[1:]) or list(TARGETS)
    failed = 0
    for target in targets:
        for v in variants(target):
            try:
                r = compile_variant(v, target)
                over = r["shared"] > TARGETS[target][4]
                failed += over
                print(f"{target} {v.id}: {r['seconds']}s shared {r['shared']}{' OVER' if over else ''}", flush=True)
            except Exception as err:  # noqa: BLE001 - report every failure, then fail
                failed += 1
                print(f"{target} {v.id}: FAILED {type(err).__name__}: {str(err)[:300]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
