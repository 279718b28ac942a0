"""Every kernel specialisation the CUDA launcher can request, and how it picks one.

A specialisation is one compile of a family's forward or backward source (`families.py`)
with a set of -D defines: dtype, head-dim tile, block sizes, warps and feature flags.
The Ampere family's tiles follow FlashAttention-2's Ampere choices, with a fallback for
GPUs whose shared memory per block is ~99 KB (sm_86, sm_89). The Hopper forward runs
128 query rows per block on three warpgroups (a TMA producer, two wgmma consumers) with
head-dim tiles that are whole 64-column swizzle panels. The Hopper backward (`bwd_wgmma`,
`launch_sm90_bwd`, head dims up to 128) runs 128 keys per block on the same three warpgroup roles.
The deterministic backward (`launch_deterministic`, both families) is the Ampere backward
built without its atomic dQ (`atomic_dq=False`) followed by a dQ pass (`bwd_dq`) that walks the
key blocks of one query block and writes dQ once.
The split-KV decode kernel (`decode`, `decode_combine`; `launch_decode`, both families, not dispatched
yet) runs one 16-row mma tile of a GQA group per block, each warp streaming its own key blocks.
`all_variants()` is what the CI compile test builds; the launcher only ever asks for members of
that set.
"""
from __future__ import annotations

from typing import NamedTuple

from .families import FAMILIES, Family

HEAD_DIM_TILES = (32, 64, 96, 128, 160, 192, 256)
# the Hopper forward's tiles: whole 128-byte panels (TMA zero-fills the columns past the head dim)
PANEL_TILES = (64, 128, 192, 256)
# head dims above this run the backward in two passes (dV, then dK + dQ) so that
# each pass keeps a single accumulator in registers
SINGLE_PASS_BACKWARD_MAX = 128


class Variant(NamedTuple):
    """One compile of one kernel file."""

    family: str        # a key of families.FAMILIES
    kernel: str        # "fwd", "bwd", "bwd_dq" (the deterministic dQ pass), "bwd_wgmma" (the Hopper backward),
                       # "decode" (split-KV decode) or "decode_combine" (its merge of the splits)
    bf16: bool
    head_dim: int      # padded tile
    block_m: int       # fwd, bwd_dq: queries per block; bwd: queries per step
    block_n: int       # fwd, bwd_dq: keys per step;     bwd: keys per block
    warps: int
    score_mod: bool    # softcap and/or ALiBi
    do_dv: bool = True
    do_dk: bool = True
    stages: int = 1    # fwd, bwd_dq: K/V buffers in shared memory
    overlap: bool = False   # Hopper fwd: Q K^T of block j issued before P V of block j-1 completes
    pingpong: bool = False  # Hopper fwd: the two consumer warpgroups take turns at the tensor cores
    dq_ordered: bool = False  # Hopper bwd: dQ added per query block in a fixed order of key blocks (turn
                              # counters): bitwise-deterministic dq (dispatched for deterministic problems)
    dq_late: bool = False  # Hopper bwd: a step's dQ GEMM waited for and added in the next step, under its
                           # S^T GEMM (DQ_LATE; the table's schedule since 2026-12-03, its ordered twins' too)
    dq_tma: bool = False  # Hopper bwd, DQ_LATE: the late dQ part staged in shared memory and added with TMA
                          # reduce-adds by one thread (DQ_TMA; the table's since 2026-12-03; with dq_ordered
                          # in the query block's turn)
    dq_rotate: bool = False  # Hopper bwd, dq_ordered: each key block's walk over the query blocks rotated so a
                             # query block's turns come one after another in time (DQ_ROTATE; opt-in: correct,
                             # slower than unrotated on 5 of 8 rows with the writer, run 13;
                             # launch_sm90_bwd.rotation_applies)
    dq_writer: bool = False  # Hopper bwd, dq_tma: the staged parts added (dq_ordered: in turn) by a writer warp of
                             # the producer warpgroup, not by a consumer thread (DQ_WRITER; the ordered twin's
                             # since 2026-12-03 run 13; over the table 0.97-1.01x its time: opt-in there)
    atomic_dq: bool = True  # bwd: the dK pass adds dQ with fp32 atomics (False: the deterministic backward's
                            # dK/dV kernel, whose dQ is the bwd_dq pass)
    exact_alpha: bool = False  # fwd (both families) and decode: the online softmax's rescale factor from the rounded
                               # shifts (EXACT_ALPHA, common/softmax.cuh): lse exact over many key blocks (decode
                               # always, fwd from EXACT_ALPHA_MIN_KEYS keys; benchmarks/exact_alpha.py)
    l2_prefetch: int = 0  # decode: cp.async's L2 prefetch hint in bytes (0, 128, 256; L2_PREFETCH, sm80/ptx.cuh)
    kv_swizzle: bool = False  # decode: K/V ring rows unpadded and XOR-swizzled (KV_SWIZZLE, sm80/fa_decode.cu)
    varlen: bool = False  # fwd, bwd: packed q and k/v through cu_seqlens (VARLEN, common/varlen.cuh; a VarlenParams
                          # kernel argument): the Ampere forward (`varlen_forward_variant`), the Hopper one
                          # (`hopper_varlen_variant`, sm_90 with cuda-bindings) and the Ampere backward
                          # (`varlen_backward_variants`, both families); launch_varlen picks
    page_batch: bool = False  # decode, paged pools: a warp's page entries loaded 32 blocks ahead into lanes
                              # where a block lies inside one page (PAGE_BATCH, sm80/fa_decode.cu)
    fused_combine: bool = False  # decode: with key splits, the last block of each (batch, kv head, rows) to
                                 # finish merges the splits (FUSED_COMBINE, sm80/fa_decode.cu): no combine launch
    kv_bulk: bool = False  # decode, sm_90, padded rings of 16/32-key blocks: each K/V row one bulk copy by the TMA
                           # engine on a per-stage mbarrier, not HEAD_DIM / 8 cp.async (KV_BULK, sm80/fa_decode.cu)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def hopper_forward(self) -> bool:
        return FAMILIES[self.family].tensor_maps and self.kernel == "fwd"

    @property
    def hopper_backward(self) -> bool:
        return self.kernel == "bwd_wgmma"

    @property
    def source(self) -> str:
        """The file under kernels/ this specialisation compiles."""
        return FAMILIES[self.family].source(self.kernel)

    @property
    def function(self) -> str:
        return f"attnx_{self.kernel}"

    def defines(self) -> tuple[str, ...]:
        if self.kernel == "decode_combine":  # the combine alone: only the output dtype matters
            return (f"-DIS_BF16={int(self.bf16)}", "-DDECODE_COMBINE=1")
        d = {"IS_BF16": int(self.bf16), "HEAD_DIM": self.head_dim, "BLOCK_M": self.block_m,
             "BLOCK_N": self.block_n, "NUM_WARPS": self.warps, "SCORE_MOD": int(self.score_mod)}
        if self.hopper_backward:
            del d["NUM_WARPS"]  # fixed by the kernel's warpgroup roles
            d["DQ_ORDERED"] = int(self.dq_ordered)
            if self.dq_late:  # (only the builds with a knob on define it)
                d["DQ_LATE"] = 1
            if self.dq_tma:  # (likewise)
                d["DQ_TMA"] = 1
            if self.dq_rotate:  # (likewise)
                d["DQ_ROTATE"] = 1
            if self.dq_writer:  # (likewise)
                d["DQ_WRITER"] = 1
            d["SHARED_BYTES"] = self.shared_bytes()  # the kernel asserts its layout needs exactly this
        elif self.kernel == "bwd":
            d.update(DO_DV=int(self.do_dv), DO_DK=int(self.do_dk), DQ_ATOMIC=int(self.atomic_dq))
            if self.varlen:  # (only packed builds define it: the dense builds' defines stay as they were)
                d["VARLEN"] = 1
        else:
            d.update(KV_STAGES=self.stages)
        if self.kernel == "fwd":
            d["EXACT_ALPHA"] = int(self.exact_alpha)
            if not self.hopper_forward:  # only the Ampere forward has the knob
                d["VARLEN"] = int(self.varlen)
        if self.kernel == "decode":
            d["EXACT_ALPHA"] = int(self.exact_alpha)
            if self.l2_prefetch:
                d["L2_PREFETCH"] = self.l2_prefetch
            if self.kv_swizzle:
                d["KV_SWIZZLE"] = 1
            if self.page_batch:
                d["PAGE_BATCH"] = 1
            if self.fused_combine:
                d["FUSED_COMBINE"] = 1
            if self.kv_bulk:  # (likewise: only the bulk builds define it)
                d["KV_BULK"] = 1
                d["SHARED_BYTES"] = self.shared_bytes()  # the kernel places its barriers at the end
        if self.hopper_forward:
            d.update(OVERLAP=int(self.overlap), PINGPONG=int(self.pingpong))
            del d["BLOCK_M"], d["NUM_WARPS"]  # fixed by the kernel's warpgroup roles
            if self.varlen:  # (only packed builds define it: the dense builds' defines stay as they were)
                d["VARLEN"] = 1
        return tuple(f"-D{k}={v}" for k, v in d.items())

    def shared_bytes(self) -> int:
        if self.hopper_backward:
            # K, V; 2 stages of Q, dO; 2 dS^T buffers; (DQ_TMA: 2 dQ parts); 2 stages of lse, delta;
            # 7 mbarriers; 1 KB to align
            panels, bm, bn = self.head_dim // 64, self.block_m, self.block_n
            dq_parts = 2 * 64 * 64 * 4 if self.dq_tma else 0  # two 64 x 64 fp32 parts, swizzled, for TMA
            return (2 * panels * bn * 128 + 4 * panels * bm * 128 + 2 * (bm // 64) * bn * 128 + dq_parts + 16 * bm
                    + 8 * 7 + 1024)
        if self.hopper_forward:
            # Q panels, STAGES x (K, V) panels, mbarriers, and 1 KB to align the swizzle atoms
            panels = self.head_dim // 64
            return (panels * 128 * (self.block_m + 2 * self.stages * self.block_n) + 8 * (1 + 4 * self.stages)
                    + 1024)
        if self.kernel == "decode_combine":
            return 0
        ld = self.head_dim + 8
        if self.kernel == "decode":
            # Q tile + each warp's ring of STAGES x (K, V) blocks; the end-of-loop merge buffer (fp32 out,
            # max and sum of every warp's 16 rows) overlays them
            kv_ld = self.head_dim if self.kv_swizzle else ld
            ring = 16 * ld * 2 + 2 * self.warps * self.stages * self.block_n * kv_ld * 2
            merge = self.warps * 16 * ((self.head_dim + 4) * 4 + 8)
            split_weights = 16 * 128 * 4 if self.fused_combine else 0  # FUSED_COMBINE: 16 rows x MAX_SPLITS
            overlaid = max(ring, merge, split_weights)
            if not self.kv_bulk:
                return overlaid
            return -(-overlaid // 8) * 8 + 8 * self.warps * self.stages  # KV_BULK: an mbarrier per warp stage
        if self.kernel == "fwd":
            return (self.block_m + 2 * self.stages * self.block_n) * ld * 2
        if self.kernel == "bwd_dq":  # Q, dO; STAGES x (K, V)
            return (2 * self.block_m + 2 * self.stages * self.block_n) * ld * 2
        ds_staging = self.block_n * (self.block_m + 8) * 2 if self.atomic_dq else 0
        return (2 * self.block_n + 4 * self.block_m) * ld * 2 + ds_staging + 4 * 4 * self.block_m

    def label(self) -> str:
        flags = ("bf16" if self.bf16 else "fp16") + ("+mod" if self.score_mod else "")
        if self.kernel == "decode_combine":
            return f"{self.family} decode_combine {flags}"
        if self.kernel == "bwd" and not (self.do_dv and self.do_dk):
            flags += "+dv" if self.do_dv else "+dk"
        flags += "" if self.atomic_dq else " no-dq"
        flags += (" wgmma" + ("+ordered" if self.dq_ordered else "") + ("+dqlate" if self.dq_late else "")
                  + ("+dqtma" if self.dq_tma else "") + ("+rotate" if self.dq_rotate else "")
                  + ("+writer" if self.dq_writer else "")
                  if self.hopper_backward else "")
        stages = f" s{self.stages}" if self.kernel in ("fwd", "bwd_dq", "decode") else ""
        stages += ("+overlap" if self.overlap else "") + ("+pingpong" if self.pingpong else "")
        stages += "+exactalpha" if self.exact_alpha else ""
        stages += "+swizzle" if self.kv_swizzle else ""
        stages += "+pagebatch" if self.page_batch else ""
        stages += "+fused" if self.fused_combine else ""
        stages += "+bulk" if self.kv_bulk else ""
        stages += "+varlen" if self.varlen else ""
        tile = f"d{self.head_dim} {self.block_m}x{self.block_n} w{self.warps}{stages}"
        return f"{self.family} {self.kernel} {tile} {flags}"


class ForwardTile(NamedTuple):
    block_m: int
    block_n: int
    warps: int
    stages: int
    overlap: bool = False
    pingpong: bool = False


# Forward tiles per family and head-dim tile, best first; the first that fits the device's shared
# memory is used.
_A = ForwardTile
FORWARD_TILES = {
    "sm80": {
        # measured on the H200 (2026-11-29): double-buffered K/V +2% at d128, -5% at d64
        32: (_A(128, 64, 4, 1),),
        64: (_A(128, 64, 4, 1),),
        96: (_A(128, 64, 4, 1),),
        128: (_A(128, 64, 4, 2), _A(128, 64, 4, 1)),
        160: (_A(128, 64, 8, 1),),
        192: (_A(128, 64, 8, 1), _A(64, 64, 4, 1)),
        256: (_A(128, 64, 8, 1), _A(64, 32, 4, 1)),
    },
    # 128 rows, 12 warps (producer + 2 consumers), K/V double-buffered. Measured on the H200
    # (2026-12-01, bf16, 16k tokens, x cuDNN non-causal / causal; benchmarks/results/h200-2026-12-01/
    # hopper_forward_configs.log): the pipelined loop (overlap) needs two P register sets, so at most
    # 128 keys per block fit 240 registers at d64/d128; pingpong pays at d128/d192 only.
    "sm90": {
        64: (_A(128, 128, 12, 2, overlap=True),),                  # 0.96 / 0.96
        128: (_A(128, 128, 12, 2, overlap=True, pingpong=True),),  # 1.02 / 1.08
        192: (_A(128, 96, 12, 2, overlap=True, pingpong=True),),   # 1.08 / 1.12
        256: (_A(128, 64, 12, 2, overlap=True),),                  # 1.03 / 1.07
    },
}
# Hopper backward: head-dim tile -> (queries per step without, with a score mod); 128 keys per block.
# d64 steps over 128 queries (each consumer then adds 64 rows of dQ); its score-mod path keeps the
# softcap derivative beside S^T and dP^T and only fits 240 registers with 64 (dQ then split by keys).
HOPPER_BACKWARD_TILES = {64: (128, 64), 128: (64, 64)}
HOPPER_BACKWARD_KEYS = 128
# Split-KV decode: head-dim tile -> (block_m = 16 rows, block_n = keys per warp block, warps, K/V stages per
# warp), best first; the first that fits the device's shared memory is used, except for the tiles of
# `DECODE_TILES_BY_WAVE`. 16-key blocks keep a warp's ring small enough for 3-4 stages; d256's second
# tile is for ~99 KB GPUs (sm_86, sm_89), unmeasured.
DECODE_TILES = {
    64: (_A(16, 16, 4, 4),),                      # 76 KB
    128: (_A(16, 16, 4, 2), _A(16, 16, 4, 3)),    # 74 KB (3 blocks per SM on sm_90) / 109 KB (2)
    256: (_A(16, 16, 4, 2), _A(16, 16, 2, 2)),    # 144 KB / 76 KB
}
# Head-dim tiles whose fitting DECODE_TILES the launcher picks among by how fully each one's grid fills
# the GPU's block slots (`launch_decode.pick_decode_variant`). The H200 sweep of 2026-12-03 (run 8): d128
# with 2 stages is best wherever the batch takes key splits (B = 1, 8: 0.92-0.99x cuDNN) and leaves a
# 1.3-wave tail at B = 64 (512 blocks on 396 slots, 0.75-0.83x), where 3 stages fill 1.94 waves (0.86-0.98x).
DECODE_TILES_BY_WAVE = frozenset({128})
DECODE_HEAD_DIM_TILES = tuple(DECODE_TILES)
DECODE_L2_PREFETCH = 128  # the decode kernel's cp.async L2 prefetch hint (bytes; sm80/ptx.cuh L2_PREFETCH): the
# H200 sweep of 2026-12-02 (run 6): +1-3 % over none on a cache, 256 slower on paged caches
# The decode kernel's K/V ring rows, per key format: the stage counts whose ring is swizzled (KV_SWIZZLE,
# sm80/fa_decode.cu); other rings are padded. ncu on the H200 showed the padded rows' copies reading 1.5x the
# ideal L2 sectors; swizzled, a contiguous cache read 1.01-1.05x faster (0.94-0.98x cuDNN), sweep of 2026-12-02
# (h200-2026-12-02-run7/call4). Paged pools: swizzled 3-5 % faster with 2 stages (B = 1, 8) but 3-12 % slower
# with 3 (B = 64) while the kernel clamped each page entry right after its load (run8/call4); with the lookup
# of 2026-12-03 (entries clamped a block later, one per block inside a page) swizzled is 0-5 % faster at
# B = 64 with 3 stages too and never more than 1 % slower (run9/call1). Ampere-class GPUs unmeasured.
# "paged-rows": pools whose pages do not hold whole key blocks (`launch_decode.ring_format`; page 1: a table entry
# per key, shuffled to the lanes copying its row's chunks).
DECODE_KV_SWIZZLE = {"dense": (2, 3, 4), "cache": (2, 3, 4), "paged": (2, 3, 4), "paged-rows": (2, 3, 4)}
# Rings copied a whole K/V row per bulk copy (KV_BULK) on families with bulk copies, per key format: the stage
# counts, before DECODE_KV_SWIZZLE. The H200 sweep of 2026-12-03 (run 14 call 1): bulk rings 3-7 % slower than
# swizzled ones wherever a block lies inside one page (and on caches), but on "paged-rows" with 3 stages (B = 64,
# no splits) 1.05-1.07x faster (page 1: 0.84-0.86x cuDNN's dense rate -> 0.90), with 2 stages 1-6 % slower.
DECODE_KV_BULK = {"paged-rows": (3,)}
DECODE_BLOCK_KEYS = 16  # every DECODE_TILES entry's key block (a page of a multiple of it holds whole blocks)
# Paged pools: page entries loaded 32 blocks ahead (PAGE_BATCH) where a page holds whole key blocks. Written
# 2026-12-03 for B = 1, where a block's lookup a block ahead looked exposed (paged 16 at 0.90x the cache at
# 4k). Correct on the H200 (126/126, memcheck and synccheck clean, conformance 190/190) but not measurably
# faster (paged 16 / cache 0.90 -> 0.91 at B = 1, 4k; every other row within 1 %: run9/call4), so opt-in.
DECODE_PAGE_BATCH = False
# With key splits, the splits merged by the last block of each program to finish (FUSED_COMBINE) instead of a
# second kernel (attnx_decode_combine, 3-5 us of a 17-270 us decode step on the H200). Written 2026-12-03.
DECODE_FUSED_COMBINE = False
COMBINE_WARPS = 4  # decode_combine: one block of 4 warps per row (fa_decode.cu COMBINE_WARPS)
# head-dim tiles of each family's kernels ("bwd", the Ampere backward, runs on sm_90 for head dims
# above 128 and in the deterministic mode, which uses its tiles for dK/dV and for the dQ pass)
TILE_SETS = {("sm80", "fwd"): HEAD_DIM_TILES, ("sm80", "bwd"): HEAD_DIM_TILES,
             ("sm90", "fwd"): PANEL_TILES, ("sm90", "bwd"): HEAD_DIM_TILES,
             ("sm90", "bwd_wgmma"): tuple(HOPPER_BACKWARD_TILES),
             ("sm80", "decode"): DECODE_HEAD_DIM_TILES, ("sm90", "decode"): DECODE_HEAD_DIM_TILES}
# (block_m = queries per step, block_n = keys per block = 16 * warps, warps)
BACKWARD_TILES = {
    32: ((64, 128, 8), (64, 64, 4)),
    64: ((64, 128, 8), (64, 64, 4)),
    96: ((64, 128, 8), (64, 64, 4)),
    128: ((64, 128, 8), (32, 64, 4)),
    160: ((32, 64, 4),),
    192: ((32, 64, 4), (16, 32, 2)),
    256: ((32, 64, 4), (16, 32, 2)),
}


# The deterministic dQ pass: (block_m = queries per block = 16 * warps, block_n = keys per step, warps,
# K/V stages), best first; the first that fits the device's shared memory is used. 64 queries per block
# with 4 warps and two K/V stages: on the H200 (2026-12-01, bf16, 1k-16k tokens) the whole deterministic
# backward ran 1.06-1.12x the atomic one with it, 1.11-1.16x with 128 queries / 8 warps (more blocks in
# flight hide the K/V loads better than 8 warps sharing one load); d32 and d96 follow d64/d128 unmeasured.
# Head dims above 128 step over 32 keys so S, dP and a 16 x 256 dQ accumulator fit the registers of one
# thread. The single-stage fallbacks are for ~99 KB GPUs (sm_86, sm_89).
_D = ForwardTile
DQ_TILES = {
    32: (_D(64, 64, 4, 2),),
    64: (_D(64, 64, 4, 2),),
    96: (_D(64, 64, 4, 2), _D(64, 64, 4, 1)),
    128: (_D(64, 64, 4, 2), _D(64, 64, 4, 1)),
    160: (_D(128, 32, 8, 2), _D(64, 32, 4, 1)),
    192: (_D(128, 32, 8, 2), _D(64, 32, 4, 1)),
    256: (_D(128, 32, 8, 2), _D(64, 32, 4, 2), _D(64, 32, 4, 1)),
}


def head_dim_tile(head_dim: int, head_dim_v: int, family: Family | None = None, kernel: str = "fwd") -> int | None:
    """The smallest tile of `family`'s `kernel` holding both head dims (rounded up to 8), or None above 256."""
    need = max(head_dim, head_dim_v)
    tiles = TILE_SETS[(family.name, kernel)] if family is not None else HEAD_DIM_TILES
    return next((t for t in tiles if t >= need), None)


# Keys from which the forward rounds its rescale product (EXACT_ALPHA). The fused product's drift grows
# about quadratically with the key blocks (H200, 2026-12-02, lse vs float64: 1.1e-4 at 256k keys, 2.7e-3 at
# 1M, above the 1e-3 bound; ~1e-5 expected at 64k); rounding it cost up to 8 % of non-causal forward speed
# at 4k-16k (d128 16k 574 vs 624 TFLOP/s; causal and decode within noise): benchmarks/exact_alpha.py.
EXACT_ALPHA_MIN_KEYS = 65536


def forward_rounds_rescale(seqlen_k: int) -> bool:
    """Whether a forward over `seqlen_k` keys (the longest sequence's, packed) is built with EXACT_ALPHA."""
    return seqlen_k >= EXACT_ALPHA_MIN_KEYS


def forward_variant(family: Family, bf16: bool, tile: int, score_mod: bool, max_shared: int,
                    exact_alpha: bool = False) -> Variant | None:
    """The forward's specialisation for a head-dim tile (the first of `FORWARD_TILES` that fits), or None;
    `exact_alpha` for long key sequences (`EXACT_ALPHA_MIN_KEYS`)."""
    for t in FORWARD_TILES[family.name].get(tile, ()):
        v = Variant(family.name, "fwd", bf16, tile, t.block_m, t.block_n, t.warps, score_mod, stages=t.stages,
                    overlap=t.overlap, pingpong=t.pingpong, exact_alpha=exact_alpha)
        if v.shared_bytes() > max_shared:
            continue
        # Ampere: double buffering only where two blocks still fit on a multiprocessor
        if v.hopper_forward or t.stages == 1 or 2 * v.shared_bytes() <= max_shared:
            return v
    return None


def varlen_forward_variant(bf16: bool, tile: int, score_mod: bool, max_shared: int) -> Variant | None:
    """The Ampere forward built for packed q and k/v (VARLEN=1): the tile `forward_variant` picks for the
    Ampere family on a GPU of `max_shared`. Both families can run it: launch_varlen requests it (with
    EXACT_ALPHA from 64k keys) on Ampere-class GPUs and on sm_90 without cuda-bindings (no TMA maps);
    `requestable` lists it under the Ampere family, so CI builds it for sm_80."""
    v = forward_variant(FAMILIES["sm80"], bf16, tile, score_mod, max_shared)
    return v._replace(varlen=True) if v is not None else None


def hopper_varlen_variant(bf16: bool, tile: int, score_mod: bool, max_shared: int) -> Variant | None:
    """The Hopper forward built for packed q and k/v (VARLEN=1, sm90/fa_fwd.cu): the tile `forward_variant`
    picks for the Hopper family. `launch_varlen.varlen_variant_for` runs it on sm_90 (checked and timed on
    the H200 2026-12-02: `benchmarks.cuda_varlen check/time`)."""
    v = forward_variant(FAMILIES["sm90"], bf16, tile, score_mod, max_shared)
    return v._replace(varlen=True) if v is not None else None


def backward_variants(family: Family, bf16: bool, tile: int, score_mod: bool,
                      max_shared: int) -> tuple[Variant, ...] | None:
    """The launches of one backward: one pass, or a dV pass then a dK + dQ pass."""
    for bm, bn, w in BACKWARD_TILES.get(tile, ()):
        if tile <= SINGLE_PASS_BACKWARD_MAX:
            passes = (Variant(family.name, "bwd", bf16, tile, bm, bn, w, score_mod, True, True),)
        else:
            passes = (Variant(family.name, "bwd", bf16, tile, bm, bn, w, score_mod, True, False),
                      Variant(family.name, "bwd", bf16, tile, bm, bn, w, score_mod, False, True))
        if passes[0].shared_bytes() <= max_shared:
            return passes
    return None


def varlen_backward_variants(family: Family, bf16: bool, tile: int, score_mod: bool,
                             max_shared: int) -> tuple[Variant, ...] | None:
    """The Ampere backward's passes built for packed q and k/v (VARLEN=1, sm80/fa_bwd.cu; launch_varlen.backward),
    on both families (sm_90 runs the Ampere backward too), or None."""
    passes = backward_variants(family, bf16, tile, score_mod, max_shared)
    return tuple(v._replace(varlen=True) for v in passes) if passes else None


def dq_variant(family: Family, bf16: bool, tile: int, score_mod: bool, max_shared: int) -> Variant | None:
    """The deterministic dQ pass for a head-dim tile: the first of `DQ_TILES` that fits, or None."""
    if "bwd_dq" not in family.sources:
        return None
    for t in DQ_TILES.get(tile, ()):
        v = Variant(family.name, "bwd_dq", bf16, tile, t.block_m, t.block_n, t.warps, score_mod, stages=t.stages)
        if v.shared_bytes() <= max_shared:
            return v
    return None


def deterministic_backward_variants(family: Family, bf16: bool, tile: int, score_mod: bool,
                                    max_shared: int) -> tuple[Variant, ...] | None:
    """The launches of the deterministic backward: the Ampere backward's passes with the dK pass built
    without its atomic dQ (the dV-only pass of large head dims has none to drop), then the dQ pass."""
    passes = backward_variants(family, bf16, tile, score_mod, max_shared)
    dq = dq_variant(family, bf16, tile, score_mod, max_shared)
    if passes is None or dq is None:
        return None
    return tuple(v._replace(atomic_dq=False) if v.do_dk else v for v in passes) + (dq,)


def hopper_backward_variant(family: Family, bf16: bool, tile: int, score_mod: bool,
                            max_shared: int) -> Variant | None:
    """The Hopper backward's specialisation for a head-dim tile, or None (no such tile, or it does not fit)."""
    if "bwd_wgmma" not in family.sources or tile not in HOPPER_BACKWARD_TILES:
        return None
    block_m = HOPPER_BACKWARD_TILES[tile][int(score_mod)]
    # dq_late: 0.99-1.08x the plain schedule's speed; dq_tma (its late dQ through TMA reduce-adds) 1.07-1.20x
    # dq_late's (H200, 2026-12-03 runs 10 and 11, NOTES.md "DQ_LATE", "DQ_TMA"); the ordered twins too (run 12)
    v = Variant(family.name, "bwd_wgmma", bf16, tile, block_m, HOPPER_BACKWARD_KEYS, 12, score_mod, dq_late=True,
                dq_tma=True)
    return v if v.shared_bytes() <= max_shared else None


def ordered_twin(v: Variant) -> Variant:
    """The deterministic twin of a Hopper backward variant: dQ added in a fixed order of key blocks (on the
    same schedule: with DQ_LATE a step's dQ takes its turn during the next step)."""
    # (with the table's DQ_TMA, the parts added in turn by a writer thread of the producer warpgroup: DQ_WRITER,
    # 0.98-1.11x the table's time on the H200, 2026-12-03 run 13, where thread 128 adding them in the turn took
    # 1.12-1.25x; NOTES.md "Ordered dQ through TMA")
    return v._replace(dq_ordered=True, dq_writer=v.dq_tma)


def decode_variants(family: Family, bf16: bool, tile: int, score_mod: bool, max_shared: int,
                    kv_format: str = "paged") -> list[Variant]:
    """The split-KV decode kernels the launcher picks among for a head-dim tile and key format (its ring
    layout: `DECODE_KV_BULK`, then `DECODE_KV_SWIZZLE`; formats as `launch_decode.ring_format` names them),
    best first: every `DECODE_TILES` entry that fits for the tiles of `DECODE_TILES_BY_WAVE`, else the first
    that fits; empty where none does."""
    if "decode" not in family.sources:
        return []
    found = []
    for t in DECODE_TILES.get(tile, ()):
        bulk = family.bulk_copies and t.stages in DECODE_KV_BULK.get(kv_format, ())
        v = Variant(family.name, "decode", bf16, tile, t.block_m, t.block_n, t.warps, score_mod, stages=t.stages,
                    exact_alpha=True, l2_prefetch=DECODE_L2_PREFETCH,
                    kv_swizzle=t.stages in DECODE_KV_SWIZZLE[kv_format] and not bulk,
                    kv_bulk=bulk,
                    page_batch=DECODE_PAGE_BATCH and kv_format == "paged", fused_combine=DECODE_FUSED_COMBINE)
        if v.shared_bytes() <= max_shared:
            found.append(v)
            if tile not in DECODE_TILES_BY_WAVE:
                break
    return found


def decode_variant(family: Family, bf16: bool, tile: int, score_mod: bool, max_shared: int,
                   kv_format: str = "paged") -> Variant | None:
    """The first of `decode_variants` (the launcher's pick when the grid fills every candidate's block
    slots alike), or None."""
    found = decode_variants(family, bf16, tile, score_mod, max_shared, kv_format)
    return found[0] if found else None


# The decode tile sweep's axes (`decode_sweep_variants`; benchmarks/cuda_decode.py `time --tiles`).
DECODE_SWEEP_BLOCK_N = (16, 32, 64)
DECODE_SWEEP_WARPS = (4, 8)
DECODE_SWEEP_STAGES = (2, 3, 4)


def decode_sweep_variants(tile: int, *, family: str = "sm90", bf16: bool = True, score_mod: bool = False,
                          max_shared: int | None = None, exact_alpha: bool = False) -> list[Variant]:
    """The decode tile sweep's candidates for head-dim tile `tile`: every BLOCK_N x warps x KV stages of the
    sweep's axes whose shared memory fits `max_shared` (default: the family's first GPU with the most,
    sm_90's 232,448 bytes), the launcher's candidates (`decode_variants`) first. Not a launcher table: the
    sweep's winner goes into `DECODE_TILES`. d128 on sm_90: 16-key blocks w4 s2-s4, w8 s2-s3; 32-key
    blocks w4 s2-s3; 64-key blocks fit no ring of 4 warps (each warp's ring is STAGES x 64 x 272 x 2 bytes)."""
    fam = FAMILIES[family]
    if "decode" not in fam.sources:
        return []
    shared = max_shared if max_shared is not None else max(SHARED_PER_BLOCK[c] for c in covered_capabilities(fam))
    # compared without EXACT_ALPHA and padded, then all given `exact_alpha` (the sweep times each one's +ea and
    # +swz twins itself)
    found = [v._replace(exact_alpha=False, kv_swizzle=False, page_batch=False, fused_combine=False)
             for v in decode_variants(fam, bf16, tile, score_mod, shared)]
    for bn in DECODE_SWEEP_BLOCK_N:
        for w in DECODE_SWEEP_WARPS:
            for st in DECODE_SWEEP_STAGES:
                v = Variant(fam.name, "decode", bf16, tile, 16, bn, w, score_mod, stages=st,
                            l2_prefetch=DECODE_L2_PREFETCH)
                if v.shared_bytes() <= shared and v not in found:
                    found.append(v)
    return [v._replace(exact_alpha=exact_alpha) for v in found]


def decode_combine_variant(family: Family, bf16: bool) -> Variant | None:
    """The merge of the decode kernel's splits (one per output dtype), or None."""
    if "decode_combine" not in family.sources:
        return None
    return Variant(family.name, "decode_combine", bf16, 0, 0, 0, COMBINE_WARPS, False)


# opt-in shared memory per block (bytes) by compute capability; others get the small figure
SHARED_PER_BLOCK = {(8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376, (9, 0): 232448,
                    (10, 0): 232448, (10, 3): 232448, (12, 0): 101376}
SMALL_SHARED = 101376


def max_shared(capability) -> int:
    return SHARED_PER_BLOCK.get(tuple(capability), SMALL_SHARED)


def requestable(family: Family, capability) -> list[Variant]:
    """Exactly the specialisations the launcher can request from `family` on a GPU of `capability`."""
    shared = max_shared(capability)
    found = []
    for bf16 in (False, True):
        for mod in (False, True):
            for tile in TILE_SETS[(family.name, "fwd")]:
                fwd = forward_variant(family, bf16, tile, mod, shared)
                found += [fwd, fwd._replace(exact_alpha=True)] if fwd else []  # the second: long key sequences
                if family.name == "sm80":  # packed sequences (launch_varlen): the Ampere kernel, on both families
                    packed = varlen_forward_variant(bf16, tile, mod, shared)
                    found += [packed, packed._replace(exact_alpha=True)] if packed else []
                if family.tensor_maps:  # and the Hopper one where cuda-bindings encodes its TMA maps
                    packed = hopper_varlen_variant(bf16, tile, mod, shared)
                    found += [packed, packed._replace(exact_alpha=True)] if packed else []
            for tile in TILE_SETS[(family.name, "bwd")]:
                found += list(backward_variants(family, bf16, tile, mod, shared) or ())
                found += list(varlen_backward_variants(family, bf16, tile, mod, shared) or ())
                found += list(deterministic_backward_variants(family, bf16, tile, mod, shared) or ())
            for tile in TILE_SETS.get((family.name, "bwd_wgmma"), ()):
                bwd = hopper_backward_variant(family, bf16, tile, mod, shared)
                found += [bwd, ordered_twin(bwd)] if bwd else []  # the second: deterministic
            for tile in TILE_SETS.get((family.name, "decode"), ()):
                for kv_format in ("cache", "paged", "paged-rows"):  # (dense keys share the cache's ring layout)
                    found += [v for v in decode_variants(family, bf16, tile, mod, shared, kv_format) if v not in found]
        combine = decode_combine_variant(family, bf16)
        found += [combine] if combine else []
    return found


def covered_capabilities(family: Family) -> list[tuple[int, int]]:
    """The GPUs of the shared-memory table that `family` covers."""
    return [cap for cap in SHARED_PER_BLOCK if family.covers(cap)]


def all_variants(family: Family) -> list[Variant]:
    """Every specialisation the launcher can request from `family`, on any GPU it covers."""
    seen = {}
    for cap in covered_capabilities(family):
        for variant in requestable(family, cap):
            seen.setdefault(variant, None)
    return list(seen)
