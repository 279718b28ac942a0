"""Launch configurations: tile sizes, warps, stages (and AMD's HIP-only knobs), per vendor and head dim.

Every kernel launch is one *variant*: (kernel, dtype, BLOCK_D, path) plus one config
from `candidates`. The fast ("dense") path is fp16/bf16 with D == Dv == BLOCK_D and no
softcap/alibi/mask; everything else takes the "general" path (masked head dim,
runtime score modifiers). `aot.py` enumerates exactly these, so what is listed here is
what CI compiles for every target.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

# Head dims are padded (inside the kernel, with masks) to one of these.
BLOCK_DS = (64, 128, 256)
KERNELS = ("fwd", "bwd_dkdv", "bwd_dq")          # the matrix kernels (bwd_preprocess has no tiles to tune)
PATHS = ("dense", "general")
DTYPES = ("fp16", "bf16", "fp32")
DENSE_DTYPES = ("fp16", "bf16")
PREPROCESS_BLOCK_M = 64
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


class LaunchConfig(NamedTuple):
    """One candidate: tiles (BLOCK_M = query rows, BLOCK_N = key rows) and compiler options."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    waves_per_eu: int = 0          # AMD only: occupancy hint
    matrix_instr_nonkdim: int = 0  # AMD CDNA only: 16 -> 16x16 MFMA, 32 -> 32x32

    def options(self, family: str) -> dict:
        """Compiler options as triton.compile / a launch take them."""
        opts = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if family in ("cdna", "rdna"):
            if self.waves_per_eu:
                opts["waves_per_eu"] = self.waves_per_eu
            if self.matrix_instr_nonkdim:
                opts["matrix_instr_nonkdim"] = self.matrix_instr_nonkdim
        return opts


# Families that get the dense fast path (tuned, autotuned). The others run everything through the
# general path: half the variants to compile in CI, for parts we cannot time here.
DENSE_FAMILIES = ("hopper", "cdna", "cpu")


def path_of(p) -> str:
    """'dense' (the tuned fast path) or 'general' for a Problem.

    Packed and cache formats keep the dense path (per-sequence starts and lengths are runtime
    arguments); paged keys take the general path, whose key loop reads the page table.
    """
    dense = (p.softcap is None and not p.has_alibi and p.mask_kind is None and p.head_dim == p.head_dim_v
             and p.head_dim in BLOCK_DS and DTYPE_NAMES.get(p.dtype) in DENSE_DTYPES
             and family(p.vendor, p.arch) in DENSE_FAMILIES and p.kv_format != "paged")
    return "dense" if dense else "general"


def block_d(head_dim: int, head_dim_v: int) -> int:
    """The padded head dim the kernels run at."""
    need = max(head_dim, head_dim_v)
    return next(b for b in BLOCK_DS if b >= need)


def family(vendor: str, arch: str) -> str:
    """Config family of a device: 'hopper', 'ampere' (sm80-sm89), 'cdna', 'rdna' or 'cpu' (interpreter)."""
    if vendor == "nvidia":
        return "hopper" if arch.startswith("sm_9") else "ampere"
    if vendor == "amd":
        return "rdna" if arch.startswith("gfx11") else "cdna"
    return "cpu"


C = LaunchConfig


def candidates(fam: str, kernel: str, path: str, bd: int, dtype: str) -> list[LaunchConfig]:
    """Pruned candidates, best guess first. More than one only where autotuning pays (dense path)."""
    wide = dtype == "fp32"  # 4-byte operands: half the tile fits
    if fam == "cpu":
        # the interpreter: small tiles keep numpy fast
        return [C(32, 32, 4, 1)] if kernel != "bwd_dkdv" else [C(16, 32, 4, 1)]
    if fam == "hopper":
        if kernel == "fwd":
            if path == "dense":
                if bd == 64:
                    return [C(128, 128, 4, 3), C(128, 64, 4, 4)]
                if bd == 128:
                    return [C(128, 128, 8, 3), C(128, 64, 8, 3)]
                return [C(64, 64, 4, 2)]
            if wide:
                return [C(64, 32, 4, 2)] if bd < 256 else [C(32, 32, 4, 2)]
            return [C(128, 64, 8, 2)] if bd < 256 else [C(64, 64, 8, 2)]
        if kernel == "bwd_dkdv":
            if path == "dense":
                return [C(64, 128, 8, 3), C(32, 128, 4, 4)] if bd < 256 else [C(32, 64, 8, 2)]
            if wide:
                return [C(32, 64, 4, 2)] if bd < 256 else [C(16, 32, 4, 2)]
            return [C(32, 64, 4, 2)] if bd < 256 else [C(32, 32, 8, 2)]
        if path == "dense":  # bwd_dq
            return [C(128, 64, 8, 3), C(64, 64, 4, 3)] if bd < 256 else [C(64, 32, 4, 2)]
        if wide:
            return [C(64, 32, 4, 2)] if bd < 256 else [C(32, 16, 4, 2)]
        return [C(64, 64, 4, 2)] if bd < 256 else [C(32, 32, 8, 2)]
    if fam == "ampere":
        big = bd == 256 or wide
        if kernel == "fwd":
            return [C(64, 32, 4, 2)] if big else [C(128, 64, 4, 2) if bd == 64 else C(64, 64, 4, 2)]
        if kernel == "bwd_dkdv":
            return [C(16, 32, 4, 2)] if big else [C(32, 64, 4, 2)]
        return [C(32, 16, 4, 2)] if big else [C(64, 32, 4, 2)]
    # AMD: LDS is 64 KB on CDNA2/3 and RDNA3; tiles stay in registers between MFMA/WMMA (num_stages 1)
    nonk = 16 if fam == "cdna" else 0
    big = bd == 256 or wide
    if kernel == "fwd":
        if path == "dense" and fam == "cdna":
            return [C(128, 64, 4, 1, 2, nonk), C(128, 32, 4, 1, 2, nonk)] if bd <= 128 else [C(64, 32, 4, 1, 2, nonk)]
        return [C(32, 32, 4, 1, 0, nonk)] if big else [C(64, 32, 4, 1, 0, nonk)]
    if kernel == "bwd_dkdv":
        return [C(16, 32, 4, 1, 0, nonk)] if big else [C(32, 64, 4, 1, 0, nonk)]
    return [C(32, 16, 4, 1, 0, nonk)] if big else [C(64, 32, 4, 1, 0, nonk)]


# -- split-KV decode (kernels_decode.py) ------------------------------------------------------
# Few query rows (decode: 1 token; speculative verification or short chunks: a few) take the decode
# kernel: the rows of one GQA group together, BLOCK_R at a time, keys split across programs.
DECODE_MAX_SEQLEN_Q = 16
DECODE_BLOCK_R = 16           # rows (query heads of a group x queries) per program; the MMA minimum
COMBINE_BLOCK_R = 32          # rows per program of the combine kernel
COMBINE_BLOCK_D = 64          # head-dim slice per program of the combine kernel (any Dv, one variant)
DECODE_PROGRAMS_PER_SM = 2    # decode programs resident per SM/CU (the tiles below fit twice)
DECODE_MIN_SPLIT_KEYS = 256   # a split reads at least this many keys (fewer: the combine costs more)
DECODE_MAX_SPLITS = 128
# the interpreter has no SMs; an imaginary 4-SM device with short splits exercises the split path
INTERPRETER_SMS = 4
INTERPRETER_MIN_SPLIT_KEYS = 16


def use_decode(p) -> bool:
    """Whether the forward of `p` runs the split-KV decode kernel (few query rows, no mask tensor)."""
    return 1 <= p.seqlen_q <= DECODE_MAX_SEQLEN_Q and p.mask_kind is None


def decode_splits(fam: str, sm_count: int, programs: int, seqlen_k: int) -> int:
    """Number of key splits for `programs` (batch x kv heads x row chunks) programs over up to `seqlen_k` keys.

    FlashAttention-2's rule (`num_splits_heuristic`): no split once the programs fill 80 % of one
    wave (``DECODE_PROGRAMS_PER_SM`` per SM); otherwise, among 1..max splits (max: 128, and at
    least ``DECODE_MIN_SPLIT_KEYS`` keys per split), the fewest whose last wave is at least 85 % as
    full as the best choice's (wave efficiency = waves / ceil(waves)). Decided from the longest
    sequence (the capacity for caches), so a decode loop keeps one decision per cache.
    """
    slots = max(1, sm_count) * DECODE_PROGRAMS_PER_SM
    min_keys = INTERPRETER_MIN_SPLIT_KEYS if fam == "cpu" else DECODE_MIN_SPLIT_KEYS
    if programs <= 0 or programs >= 0.8 * slots:
        return 1
    most = max(1, min(DECODE_MAX_SPLITS, seqlen_k // min_keys))
    eff = []
    for s in range(1, most + 1):
        waves = programs * s / slots
        eff.append(waves / -(-waves // 1))
    best = max(eff)
    return next(s for s, e in enumerate(eff, start=1) if e >= 0.85 * best)


def decode_config(fam: str, bd: int, dtype: str) -> LaunchConfig:
    """Tiles of the decode kernel: BLOCK_R query rows, BLOCK_N keys, K and V tiles pipelined."""
    row_bytes = bd * (4 if dtype == "fp32" else 2)
    if fam == "cpu":
        return C(DECODE_BLOCK_R, 16, 4, 1)
    if fam in ("cdna", "rdna"):  # 64 KB LDS, no multi-stage pipelining
        nonk = 16 if fam == "cdna" else 0
        return C(DECODE_BLOCK_R, 64 if row_bytes <= 256 else 32 if row_bytes <= 512 else 16, 4, 1, 0, nonk)
    # NVIDIA: measured on the H200 (B=8, Hkv=8, Sk=8k, d128 bf16, CUDA graph): 32 keys x 4 stages 1146 GB/s,
    # 64 x 3 924, 64 x 4 911, 64 x 3 with 8 warps 907, 128 x 3 (8 warps) 757, 128 x 2 93 (spills).
    # K+V tiles x stages stay within sm_80's 163 KB.
    return C(DECODE_BLOCK_R, 32, 4, 4 if row_bytes <= 256 else 3 if row_bytes <= 512 else 2)


def combine_config(fam: str) -> LaunchConfig:
    return C(COMBINE_BLOCK_R, COMBINE_BLOCK_D, 4, 1)


# Variants that do not compile or fit on a family, with the reason (kept in step with tests/test_triton_aot.py).
UNSUPPORTED: dict = {}


def unsupported_reason(fam: str, kernel: str, path: str, bd: int, dtype: str) -> Optional[str]:
    return UNSUPPORTED.get((fam, kernel, path, bd, dtype))
