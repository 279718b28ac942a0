"""The cuda backend's split-KV decode kernel: correctness, then speed (the tile sweep: decode_sweep.py).

    python -m benchmarks.cuda_decode check               # every format x feature row vs the float64 formula
    python -m benchmarks.cuda_decode time                # Llama-3-8B decode: GB/s of K+V beside SDPA, triton
    python -m benchmarks.cuda_decode check --self-test   # the harness on the CPU (float32 formula as kernel)
    python -m benchmarks.cuda_decode time --tiles        # the decode tile sweep (each candidate checked first)
    python -m benchmarks.cuda_decode check --tiles       # every sweep candidate on the tile cases
    python -m benchmarks.cuda_decode check --tile n32w4s2 --emulate --all-cases   # one candidate, on the CPU

One device call runs both: ``check && time``. `check` prints one numbered line per case (worst error
of out and lse beside the bound), continues past failures, stops only when the CUDA context is lost,
ends with a summary and exits 1 on any failure. The bound is benchmarks/backward_check.py's: twice
the error of the formula computed from the same low-dtype inputs in that dtype and in float32, plus
1e-3; NaN rows must be exactly the formula's, rows that see nothing exactly -inf (or the sink).
out and lse are poisoned with NaN before each launch. Caches hold NaN past every sequence's length,
paged pools NaN in every page no sequence uses and page tables garbage (negative, past the pool)
past the used pages, so a read the kernel should not make shows up as NaN. Needs CuPy,
cuda-bindings and an sm_80..sm_90 GPU (the `time` rows also triton).
"""
from __future__ import annotations

import argparse
import sys
from typing import NamedTuple

import torch

from attnx.reference import attention_reference

from .backward_check import max_err, run_numbered
from .decode_emulate import emulate  # a module global here: tests patch `cuda_decode.emulate`
from .decode_timing import TIME_FORMATS

SWEEP_LENGTHS = "32768,131072"  # the tile sweep's defaults (benchmarks/decode_sweep.py)
SWEEP_FORMATS = "cache,paged16"


class Case(NamedTuple):
    name: str
    fmt: str        # "dense", "cache" or "paged"
    lengths: tuple  # keys of each sequence (dense: every sequence has lengths[0])
    hq: int
    hkv: int
    sq: int
    d: int
    dv: int
    page_size: int
    opts: dict      # attention options, and dtype, layout, alibi/sinks (bool or value), splits, nan_key


LENGTHS = (1, 15, 16, 17, 1000, 4097)


def cases() -> list:
    found = []
    # every format at every length (two sequences: caches hold different lengths), default splits
    for fmt, ps in (("dense", 0), ("cache", 0), ("paged", 16)):
        for n in LENGTHS:
            lens = (n, n) if fmt == "dense" else (n, max(n // 2, 0) if fmt == "cache" else max(n - 3, 0))
            found.append(Case(f"{fmt} len", fmt, lens, 8, 2, 1, 128, 128, ps, {}))
    # page sizes: one key (per-key entries), 5 (a division), 8 (two pages per 16-key block), 16 and 48 (a
    # block inside one page: one entry per block; 48 by a division), 256
    for ps in (1, 5, 8, 16, 48, 256):
        found.append(Case(f"paged{ps} mixed", "paged", (1000, 17, 0, 4097), 8, 2, 1, 128, 128, ps, {}))
        found.append(Case(f"paged{ps} causal sq4", "paged", (3, 300, 1000), 8, 2, 4, 128, 128, ps, {"causal": True}))
    found.append(Case("cache empty", "cache", (0, 17, 0), 8, 2, 1, 128, 128, 0, {}))
    found.append(Case("cache all empty", "cache", (0, 0), 8, 2, 1, 128, 128, 0, {"sinks": True}))
    found.append(Case("paged all empty", "paged", (0, 0), 8, 2, 1, 128, 128, 16, {}))
    # features, each on the three formats
    features = [
        ("gqa1", (1000, 77), 8, 8, 1, 128, 128, {}),
        ("gqa8", (1000, 77), 8, 1, 1, 128, 128, {}),
        ("gqa8 sq16", (1000, 77), 8, 1, 16, 128, 128, {"causal": True}),
        ("gqa8 sq3 (chunks span heads)", (500, 40), 8, 1, 3, 128, 128, {"causal": True}),
        ("llama gqa4 sq4", (4097, 1000), 32, 8, 4, 128, 128, {"causal": True}),
        ("causal sq16 short", (5, 300), 8, 2, 16, 128, 128, {"causal": True}),
        ("window", (1000, 300), 8, 2, 4, 128, 128, {"window": (64, 0)}),
        ("window+offset", (1000, 300), 8, 2, 4, 128, 128, {"window": (32, 8), "offset": 250}),
        ("causal offset0", (1000, 300), 8, 2, 4, 128, 128, {"causal": True, "offset": 0}),
        ("offset<0", (1000, 300), 8, 2, 2, 128, 128, {"causal": True, "offset": -3}),
        ("softcap", (1000, 300), 8, 2, 1, 128, 128, {"softcap": 30.0}),
        ("alibi causal", (1000, 300), 8, 2, 4, 128, 128, {"alibi": True, "causal": True}),
        ("softcap+alibi", (1000, 300), 8, 2, 2, 128, 128, {"softcap": 20.0, "alibi": True}),
        ("scale<0", (300, 190), 8, 2, 1, 128, 128, {"scale": -0.05}),
        ("sinks", (1000, 0), 8, 2, 2, 128, 128, {"sinks": True, "causal": True}),
        ("dominant sinks", (1000, 17), 8, 2, 1, 128, 128, {"sinks": 20.0}),
        ("-inf sinks", (1000, 17), 8, 2, 1, 128, 128, {"sinks": float("-inf")}),
        ("fp16", (1000, 300), 8, 2, 4, 128, 128, {"dtype": torch.float16, "causal": True}),
        ("fp16 softcap bshd", (1000, 300), 8, 2, 1, 128, 128, {"dtype": torch.float16, "softcap": 30.0,
                                                               "layout": "bshd"}),
        ("bshd", (1000, 300), 8, 2, 4, 128, 128, {"layout": "bshd", "causal": True}),
        ("d64", (1000, 300), 8, 2, 1, 64, 64, {}),
        ("d256", (1000, 300), 8, 2, 2, 256, 256, {"causal": True}),
        ("d40 dv24 (copies)", (1000, 300), 8, 2, 1, 40, 24, {}),
        ("d128 dv64", (1000, 300), 8, 2, 1, 128, 64, {}),
        ("d192 (tile 256)", (1000, 300), 8, 2, 1, 192, 192, {"sinks": True}),
        ("splits=1 forced", (4097, 1000), 8, 2, 1, 128, 128, {"splits": 1}),
        ("splits=13 forced", (4097, 1000), 8, 2, 1, 128, 128, {"splits": 13, "sinks": True}),
        ("splits=1 sinks alibi sq4", (1000, 300), 8, 2, 4, 128, 128, {"splits": 1, "sinks": True, "alibi": True,
                                                                      "causal": True}),
        ("nan key", (1000, 300), 8, 2, 4, 128, 128, {"nan_key": 37, "causal": True}),
    ]
    for fmt, ps in (("cache", 0), ("paged", 1), ("paged", 5), ("paged", 16), ("paged", 48), ("paged", 256)):
        found.append(Case(f"{fmt} bad index values", fmt, (1000, 300, 40), 8, 2, 1, 128, 128, ps,
                          {"bad_index": True}))
    for fmt, ps in (("dense", 0), ("cache", 0), ("paged", 16)):
        for name, lens, hq, hkv, sq, d, dv, opts in features:
            lens = (lens[0], lens[0]) if fmt == "dense" else lens
            found.append(Case(f"{fmt} {name}", fmt, lens, hq, hkv, sq, d, dv, ps, opts))
    return found


class Built(NamedTuple):
    args: tuple         # q, k, v (caller layout)
    kwargs: dict        # attention options (seqlens_k, page_table, ...)
    seqs: list          # per sequence: (k, v) bhsd (1, Hkv, L, D) of the keys it holds
    splits: object
    tile: object = None  # a sweep candidate (variants.decode_sweep_variants) in place of the tile table


# -- the tile sweep's candidates ------------------------------------------------------------------------
# cases every candidate tile is checked on before it is timed (bf16 without score mods: a tile changes the
# key-block, page-lookup, split and warp arithmetic, which these cover; one compile per candidate), run at
# the candidate's head dim
TILE_CASES = (  # (name, page size, first length) of cases()
    ("dense len", 0, 4097), ("cache len", 0, 17), ("paged len", 16, 4097), ("paged1 mixed", 1, 1000), ("paged16 mixed", 16, 1000), ("paged256 mixed", 256, 1000),
    ("paged1 causal sq4", 1, 3), ("cache all empty", 0, 0),
    ("cache llama gqa4 sq4", 0, 4097), ("paged gqa8 sq3 (chunks span heads)", 16, 500),
    ("cache window+offset", 0, 1000), ("paged sinks", 16, 1000), ("paged bad index values", 1, 1000),
    ("paged bad index values", 16, 1000), ("cache splits=13 forced", 0, 4097), ("paged splits=1 forced", 16, 4097),
    ("dense nan key", 0, 1000))


def tile_label(v) -> str:
    """A candidate's short name: keys per warp block, warps, stages (+ea: EXACT_ALPHA; +l2_N: cp.async's
    L2 prefetch hint of N bytes where it is not the launcher's, `variants.DECODE_L2_PREFETCH`; +swz: K/V rows
    swizzled, as the launcher's rings are by key format and stages, `variants.DECODE_KV_SWIZZLE`; else padded;
    +bulk: padded rows copied a row per bulk copy, KV_BULK, sm_90)."""
    from attnx.backends.cuda import variants

    return (f"n{v.block_n}w{v.warps}s{v.stages}" + ("+ea" if v.exact_alpha else "")
            + (f"+l2_{v.l2_prefetch}" if v.l2_prefetch != variants.DECODE_L2_PREFETCH else "")
            + ("+swz" if v.kv_swizzle else "") + ("+bulk" if v.kv_bulk else ""))


def tile_candidates(head_dim: int = 128, exact_alpha: bool = False, family: str = "sm90") -> list:
    """The sweep's candidates (variants.decode_sweep_variants, bf16; the launcher's pick first); with
    `exact_alpha` the launcher's pick is followed by its EXACT_ALPHA=1 twin (its cost and lse, one more
    compile and check)."""
    from attnx.backends.cuda import variants

    found = variants.decode_sweep_variants(head_dim, family=family)
    return found[:1] + [found[0]._replace(exact_alpha=True)] + found[1:] if exact_alpha and found else found


def pick_tiles(labels: str, head_dim: int = 128, exact_alpha: bool = False) -> list:
    """Candidates by label ("n32w4s2,n16w8s2+ea"; `exact_alpha`: each one's +ea twin too), "all" of them
    (`tile_candidates`), or "all+swz": each of them followed by its twin with the swizzled K/V ring."""
    if labels == "all":
        return tile_candidates(head_dim, exact_alpha)
    if labels == "all+swz":
        return [w for v in tile_candidates(head_dim, exact_alpha) for w in (v, v._replace(kv_swizzle=True))]
    every = tile_candidates(head_dim)
    twins = [v._replace(exact_alpha=ea, l2_prefetch=l2, kv_swizzle=swz, kv_bulk=bulk) for v in every
             for ea in (False, True) for l2 in (0, 128, 256) for swz, bulk in ((False, False), (True, False),
                                                                             (False, True))
             if not bulk or v.block_n <= 32]
    by_label = {tile_label(v): v for v in twins}
    found = []
    for label in labels.split(","):
        if label not in by_label:
            raise SystemExit(f"no candidate {label!r} at d{head_dim}: {', '.join(by_label)}")
        found.append(by_label[label])
        if exact_alpha and not by_label[label].exact_alpha:
            found.append(by_label[tile_label(by_label[label]._replace(exact_alpha=True))])
    return found


def tile_cases(head_dim: int = 128, all_cases: bool = False) -> list:
    """The cases a candidate is checked on: `TILE_CASES` at `head_dim`; `all_cases`: every case whose
    head-dim tile is `head_dim`'s, then those."""
    from attnx.backends.cuda import families, variants

    def tile_of(c):
        return variants.head_dim_tile(-(-c.d // 8) * 8, -(-c.dv // 8) * 8, families.HOPPER, "decode")

    by_key = {(c.name, c.page_size, c.lengths[0]): c for c in cases()}
    found = [by_key[key]._replace(name=f"{key[0]} d{head_dim}", d=head_dim, dv=head_dim) for key in TILE_CASES]
    if all_cases:
        found = [c for c in cases() if tile_of(c) == tile_of(found[0])] + found
    return found


def tile_variant(p, tile):
    """The candidate `tile`'s block shape on the variant the launcher would pick for `p` (its dtype, score
    mod and head-dim tile); None without a candidate; an error where it does not fit p's GPU."""
    from attnx.backends.cuda import launch_decode, variants

    if tile is None:
        return None
    base = launch_decode.decode_variant_for(p)
    if base is None or base.head_dim != tile.head_dim:
        raise ValueError(f"candidate {tile_label(tile)} is a d{tile.head_dim} tile; the call's is "
                         f"{base and base.head_dim}")
    v = base._replace(block_m=16, block_n=tile.block_n, warps=tile.warps, stages=tile.stages,
                      exact_alpha=tile.exact_alpha, l2_prefetch=tile.l2_prefetch, kv_swizzle=tile.kv_swizzle,
                      kv_bulk=tile.kv_bulk)
    if v.shared_bytes() > variants.max_shared(p.capability):
        raise ValueError(f"candidate {tile_label(tile)} needs {v.shared_bytes()} bytes of shared memory; "
                         f"{p.arch} has {variants.max_shared(p.capability)}")
    return v


def build(case: Case, device, gen) -> Built:
    """The case's tensors: caches NaN past each length, pools NaN in unused pages, tables garbage past use.
    `bad_index`: one used page entry negative and one past the pool, and lengths -3 and 10**6 (caches are
    then filled with numbers, not NaN): the kernels clamp them (docs/semantics.md: wrong numbers, never
    a read outside the buffers) and the formula reads the keys through the same clamps."""
    opts = dict(case.opts)
    dtype = opts.pop("dtype", torch.bfloat16)
    layout = opts.get("layout", "bhsd")
    splits = opts.pop("splits", None)
    nan_key = opts.pop("nan_key", None)
    bad = opts.pop("bad_index", False)
    b = len(case.lengths)
    lengths = torch.tensor(case.lengths, dtype=torch.int32)

    def randn(*shape):
        return torch.randn(shape, device=device, generator=gen).to(dtype)

    def caller(t):  # bhsd -> the caller's tensor in the case's layout
        return t.transpose(1, 2).contiguous() if layout == "bshd" else t

    q = caller(randn(b, case.hq, case.sq, case.d))
    kwargs = dict(opts)
    if case.fmt in ("dense", "cache"):
        cap = case.lengths[0] if case.fmt == "dense" else max(case.lengths) + 5
        k, v = randn(b, case.hkv, cap, case.d), randn(b, case.hkv, cap, case.dv)
        if nan_key is not None:
            k[0, 0, nan_key, 3] = float("nan")
        if case.fmt == "cache" and not bad:
            for i, n in enumerate(case.lengths):
                k[i, :, n:], v[i, :, n:] = float("nan"), float("nan")
        if bad:
            lengths[0], lengths[-1] = -3, 10 ** 6
        used = lengths.clamp(0, cap)
        seqs = [(k[i:i + 1, :, :n], v[i:i + 1, :, :n]) for i, n in enumerate(used.tolist())]
        if case.fmt == "cache":
            kwargs["seqlens_k"] = lengths.to(device)
        k, v = caller(k), caller(v)
    else:
        ps = case.page_size
        used = [-(-n // ps) for n in case.lengths]
        num_pages = sum(used) + 3
        perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(sum(case.lengths)))
        k = torch.full((num_pages, ps, case.hkv, case.d), float("nan"), device=device, dtype=dtype)
        v = torch.full((num_pages, ps, case.hkv, case.dv), float("nan"), device=device, dtype=dtype)
        max_pages = max(used) + 2
        table = torch.randint(-1000, 4 * num_pages + 1000, (b, max_pages),
                              generator=torch.Generator().manual_seed(7)).to(torch.int32)
        start = 0
        for i, n in enumerate(case.lengths):
            pages = perm[start:start + used[i]]
            start += used[i]
            table[i, : used[i]] = pages.to(torch.int32)
            kr, vr = randn(1, case.hkv, n, case.d), randn(1, case.hkv, n, case.dv)
            if nan_key is not None and i == 0:
                kr[0, 0, nan_key, 3] = float("nan")
            for j, page in enumerate(pages.tolist()):
                rows = slice(j * ps, min((j + 1) * ps, n))
                k[page, : rows.stop - rows.start] = kr[0, :, rows].transpose(0, 1)
                v[page, : rows.stop - rows.start] = vr[0, :, rows].transpose(0, 1)
        if bad:
            table[0, 0], table[-1, min(1, max_pages - 1)] = -7, num_pages + 100
            lengths[0], lengths[-1] = -3, 10 ** 6
        # the keys as the kernels read them: lengths and page entries clamped
        seqs = []
        for i, n in enumerate(lengths.clamp(0, max_pages * ps).tolist()):
            j = torch.arange(n)
            pages = table[i].long()[j // ps].clamp(0, num_pages - 1).to(device)
            rows = (j % ps).to(device)
            seqs.append((k[pages, rows].permute(1, 0, 2)[None], v[pages, rows].permute(1, 0, 2)[None]))
        kwargs["page_table"] = table.to(device)
        kwargs["seqlens_k"] = lengths.to(device)
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(case.hq, device=device, generator=gen) * 0.5 + 0.01
    sinks = kwargs.pop("sinks", None)
    if sinks is True:
        kwargs["sinks"] = torch.randn(case.hq, device=device, generator=gen) * 2
    elif sinks is not None:
        kwargs["sinks"] = torch.full((case.hq,), float(sinks), device=device)
    return Built((q, k, v), kwargs, seqs, splits)


def formula(p, xv, built: Built, compute_dtype):
    """(out (B, Hq, Sq, Dv), lse (B, Hq, Sq)) of the formula, one sequence at a time."""
    outs, lses = [], []
    slopes = built.kwargs.get("alibi_slopes")
    sinks = built.kwargs.get("sinks")
    high = compute_dtype == torch.float64
    for i, (k, v) in enumerate(built.seqs):
        q = xv.q[i:i + 1]
        if high:
            q, k, v = q.double(), k.double(), v.double()
        o, lse = attention_reference(
            q, k, v, scale=p.scale, softcap=p.softcap,
            alibi_slopes=None if slopes is None else (slopes.double() if high else slopes.float()),
            window_left=p.window_left, window_right=p.window_right, offset=p.offset,
            sinks=None if sinks is None else (sinks.double() if high else sinks.float()),
            compute_dtype=compute_dtype)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def kernel_forward(p, xv, built: Built):
    from attnx.backends.cuda import launch_decode

    return launch_decode.forward(p, xv, splits=built.splits, variant=tile_variant(p, built.tile), poison=True)


def fused_forward(p, xv, built: Built):
    """--fused: the launcher's kernel (or the case's tile) with its splits merged by their last block
    (`Variant.fused_combine`), beside the same kernel with the separate combine launch, whose bits it must
    match (same arithmetic, same order); with splits, also replayed twice from a CUDA graph with its
    outputs poisoned before each replay (the arrival counters must start at zero every time). The notes
    land in `fused_forward.note`, which `check_one` prints."""
    from attnx.backends.cuda import launch_decode

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    base = tile_variant(p, built.tile) or launch_decode.prepare(p, xv, sms, splits=built.splits).variant
    fused = base._replace(fused_combine=True)
    out, lse = launch_decode.forward(p, xv, splits=built.splits, variant=fused, poison=True)
    ref_out, ref_lse = launch_decode.forward(p, xv, splits=built.splits, variant=base, poison=True)
    def same_bits(a, b):  # NaN where the other has NaN, equal elsewhere (torch.equal fails on any NaN)
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())

    same = same_bits(out, ref_out) and same_bits(lse, ref_lse)
    notes = ["bits same" if same else "bits DIFFER from the separate combine"]
    if launch_decode.prepare(p, xv, sms, splits=built.splits, variant=fused).splits > 1:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_out, g_lse = launch_decode.forward(p, xv, splits=built.splits, variant=fused)
        replays_ok = True
        for _ in range(2):
            g_out.fill_(float("nan"))
            g_lse.fill_(float("nan"))
            graph.replay()
            replays_ok &= same_bits(g_out, out) and same_bits(g_lse, lse)
        notes.append("replays same" if replays_ok else "REPLAYS DIFFER")
        same &= replays_ok
    fused_forward.note = "  " + ", ".join(notes)
    if not same:  # a failure of the case (run_numbered prints it)
        raise AssertionError(fused_forward.note.strip())
    return out, lse


def stand_in_forward(p, xv, built: Built):
    """--self-test: the float32 formula in place of the kernel (out in the inputs' dtype)."""
    out, lse = formula(p, xv, built, torch.float32)
    return out.to(xv.q.dtype), lse.float()


def _compare(got, ref, lows, name) -> tuple[bool, str]:
    """NaN exactly where the formula has NaN, -inf exactly where it has -inf, elsewhere within the bound."""
    if got is None or tuple(got.shape) != tuple(ref.shape):
        return False, f"{name} shape {None if got is None else tuple(got.shape)} != {tuple(ref.shape)} !"
    got, ref = got.double(), ref.double()
    nan_ok = bool(torch.equal(torch.isnan(got), torch.isnan(ref)))
    inf_ok = bool(torch.equal(torch.isinf(got) & (got < 0), torch.isinf(ref) & (ref < 0)))
    fin = torch.isfinite(ref)
    fin_ok = bool(torch.isfinite(got[fin]).all())
    err = max_err(got[fin], ref[fin]) if fin_ok else float("nan")
    bound = 2 * max(max_err(lo.double()[fin], ref[fin]) for lo in lows) + 1e-3
    ok = nan_ok and inf_ok and fin_ok and err <= bound
    flags = ("" if nan_ok else " nan-mismatch") + ("" if inf_ok else " -inf-mismatch") + ("" if fin_ok else " non-finite")
    return ok, f"{name} {err:.1e}/{bound:.1e}{flags}{'' if ok else ' !'}"


def check_one(case: Case, device, gen, forward, tile=None) -> tuple[bool, str]:
    from attnx.autograd import backend_view
    from attnx.problem import make_call

    built = build(case, device, gen)._replace(tile=tile)
    p, x = make_call(*built.args, grad_inputs=(), **built.kwargs)
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        p = p._replace(arch=f"sm_{major}{minor}")
    xv = backend_view(p, x)
    out, lse = forward(p, xv, built)
    ref = formula(p, xv, built, torch.float64)
    lows = [formula(p, xv, built, cd) for cd in (xv.q.dtype, torch.float32)]
    good_o, text_o = _compare(out, ref[0], [lo[0] for lo in lows], "out")
    good_l, text_l = _compare(lse, ref[1], [lo[1] for lo in lows], "lse")
    note = getattr(forward, "note", "")
    return good_o and good_l, f"{text_o}  {text_l}  splits {_splits(p, xv, built, device)}{note}"


def _splits(p, xv, built: Built, device) -> int:
    """The split count the launcher picks for the case (on this GPU, or as for an H200 on the CPU)."""
    from attnx.backends.cuda import launch_decode

    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 132
    if device != "cuda":
        p = p._replace(device_type="cuda", vendor="nvidia", arch="sm_90")
    return launch_decode.prepare(p, xv, sms, splits=built.splits, variant=tile_variant(p, built.tile)).splits


def check(all_cases, forward, device, only=None, tile=None) -> bool:
    """Every case (whose name contains `only`), one numbered line each; False on any failure. `tile`: a
    sweep candidate (variants.decode_sweep_variants) runs every case in place of the tile table's pick."""
    gen = torch.Generator(device=device).manual_seed(0)
    todo = [c for c in all_cases if only is None or only in c.name]
    print(f"{'':4} {'#':>3} {'case':<38} {'fmt':<5} {'ps':>3} {'Hq':>3} {'Hkv':>3} {'Sq':>3} {'D':>4} {'Dv':>4} "
          f"{'lengths':<22} max err / bound")

    def head_of(n, case):
        return (f"{n:>3} {case.name:<38} {case.fmt:<5} {case.page_size:>3} {case.hq:>3} {case.hkv:>3} {case.sq:>3} "
                f"{case.d:>4} {case.dv:>4} {str(case.lengths):<22}")

    def check_case(case):
        good, text = check_one(case, device, gen, forward, tile)
        shown = {k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v) for k, v in case.opts.items()}
        return good, text + (f"  {shown}" if shown else "")

    return run_numbered(todo, head_of, check_case, device)


def emulated_forward(p, xv, built: Built, sm_count: int = 132):
    """--emulate: the launcher's host side (`prepare`, as for an H200) and the kernels' arithmetic emulated."""
    from attnx.backends.cuda import launch_decode

    p = p._replace(device_type="cuda", vendor="nvidia", arch="sm_90")
    plan = launch_decode.prepare(p, xv, sm_count, splits=built.splits, variant=tile_variant(p, built.tile))
    out, lse = emulate(plan)
    return out[..., : p.head_dim_v].to(xv.q.dtype), lse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("check", "time", "sweep"))
    parser.add_argument("--only", default=None, help="check: only cases whose name contains this")
    parser.add_argument("--self-test", action="store_true",
                        help="check on the CPU with the float32 formula standing in for the kernel")
    parser.add_argument("--emulate", action="store_true",
                        help="check on the CPU: the launcher's host side and the kernels' index arithmetic emulated")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--lengths", default=None, help="time: 4096,32768,131072; the sweep: " + SWEEP_LENGTHS)
    parser.add_argument("--max-gb", type=float, default=40.0, help="time: skip shapes with more K+V than this")
    parser.add_argument("--tiles", action="store_true",
                        help="time: the tile sweep (= sweep); check: every sweep candidate on the tile cases")
    parser.add_argument("--tile", default=None, help="check/sweep: only these candidates (n16w4s3,n32w4s2,...)")
    parser.add_argument("--exact-alpha", action="store_true",
                        help="check/sweep: each candidate's EXACT_ALPHA=1 twin too (label +ea)")
    parser.add_argument("--head-dim", type=int, default=128, help="check/sweep: the candidates' head-dim tile")
    parser.add_argument("--all-cases", action="store_true",
                        help="check --tile(s): every case of the candidate's head-dim tile, then the tile cases")
    parser.add_argument("--formats", default=None,
                        help=f"time ({','.join(TIME_FORMATS)}) and sweep ({SWEEP_FORMATS}): key formats (dense, cache, "
                             "cache-tok, pagedN, pagedN-hnd: benchmarks/decode_timing.py)")
    parser.add_argument("--rep", type=int, default=50, help="sweep: ms of replays per timing (triton do_bench)")
    parser.add_argument("--splits", default="0",
                        help="sweep: key-split counts to time each candidate at (0 = the launcher's heuristic)")
    parser.add_argument("--fused", action="store_true",
                        help="check: every case on the launcher's kernel with FUSED_COMBINE (bits against the separate "
                             "combine, graph replays); time: its rows beside the launcher's where keys are split")
    parser.add_argument("--dry-run", action="store_true",
                        help="sweep: list the candidates and the launcher's splits per row, on the CPU")
    args = parser.parse_args(argv)
    from .decode_sweep import sweep, sweep_plan

    sweeping = args.what == "sweep" or (args.what == "time" and args.tiles)
    tiles = None
    if args.tiles or args.tile or args.exact_alpha or sweeping:
        tiles = pick_tiles(args.tile or "all", args.head_dim, args.exact_alpha)
    if args.what == "check":
        if args.self_test or args.emulate:
            forward, device = (emulated_forward if args.emulate else stand_in_forward), "cpu"
        else:
            forward, device = (fused_forward if args.fused else kernel_forward), "cuda"
        if tiles is None:
            return 0 if check(cases(), forward, device, args.only) else 1
        todo = tile_cases(args.head_dim, args.all_cases)
        failed = []
        for tile in tiles:
            print(f"== {tile_label(tile)} (d{args.head_dim}): {len(todo)} cases", flush=True)
            if not check(todo, forward, device, args.only, tile=tile):
                failed.append(tile_label(tile))
        print(f"tiles: {len(tiles) - len(failed)} of {len(tiles)} passed" + (f"; FAILED {failed}" if failed else ""))
        return 1 if failed else 0
    batches = tuple(int(b) for b in args.batches.split(","))
    if sweeping:
        lengths = tuple(int(s) for s in (args.lengths or SWEEP_LENGTHS).split(","))
        formats = tuple((args.formats or SWEEP_FORMATS).split(","))
        if args.dry_run:
            sweep_plan(tiles, batches, lengths, formats, args.head_dim)
            return 0
        split_counts = tuple(int(n) for n in args.splits.split(","))
        return 0 if sweep(tiles, batches, lengths, formats, args.max_gb, args.head_dim, args.rep, split_counts) else 1
    args.lengths = args.lengths or "4096,32768,131072"
    from .decode_timing import time_all

    time_all(tuple(int(b) for b in args.batches.split(",")), tuple(int(s) for s in args.lengths.split(",")),
             args.max_gb, fused=args.fused, formats=tuple((args.formats or ",".join(TIME_FORMATS)).split(",")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
