"""The cuda backend's packed (varlen) forward (Ampere kernel, VARLEN=1; not dispatched yet): correctness, speed.

    python -m benchmarks.cuda_varlen check               # every length x feature row vs the float64 formula
    python -m benchmarks.cuda_varlen time                # TFLOP/s beside the dense kernel and triton's varlen
    python -m benchmarks.cuda_varlen check --self-test   # the harness on the CPU (float32 formula as kernel)
    python -m benchmarks.cuda_varlen check --emulate     # the CPU, the launcher's records, the kernel's indexing

`check` prints one numbered line per case (worst error of out and lse beside the bound: twice the error
of the formula computed in the inputs' dtype and in float32, plus 1e-3, as benchmarks/cuda_decode.py),
continues past failures, stops only when the CUDA context is lost, exits 1 on any failure. out and lse
are poisoned with NaN before the launch: every row of a (clamped) sequence must come back as the
formula says (0 / -inf, or the sink, where a sequence has no keys), every row no sequence covers must
stay NaN (the kernel writes nothing outside its sequences). `tail` cases put NaN rows after the last
sequence in q, k and v, so a read past a sequence's end shows up as NaN; `garbage` cases pass
cu_seqlens that fall, start below 0 and run past the end: the kernel clamps them (start and end into
[0, total], the end not below the start) and the formula reads the rows through the same clamps.
Needs CuPy, cuda-bindings and an sm_80..sm_90 GPU (`time` also triton).
"""
from __future__ import annotations

import argparse
import functools
import random
import sys
from typing import NamedTuple

import torch

from attnx.reference import attention_reference

from .backward_check import bench, run_numbered
from .cuda_decode import _compare


class Case(NamedTuple):
    name: str
    lens_q: tuple   # queries of each sequence
    lens_k: tuple   # keys of each sequence
    hq: int
    hkv: int
    d: int
    dv: int
    opts: dict      # attention options; dtype, alibi/sinks (bool or value), tail (NaN rows), cu_q/cu_k (garbage)


LENS = (1, 63, 64, 65, 127, 128, 129, 300, 0)
MIXED_Q = (65, 300, 0, 1, 129, 64)
MIXED_K = (129, 300, 7, 0, 128, 1000)


def cases() -> list:
    found = [
        Case("lengths Sq=Sk", LENS, LENS, 4, 2, 128, 128, {}),
        Case("lengths Sq=Sk causal", LENS, LENS, 4, 2, 128, 128, {"causal": True}),
        Case("lengths Sq!=Sk", MIXED_Q, MIXED_K, 4, 2, 128, 128, {}),
        Case("empty ends", (0, 129, 0, 65, 0), (0, 64, 0, 65, 3), 4, 2, 128, 128, {"causal": True}),
        Case("one sequence", (1000,), (1000,), 4, 2, 128, 128, {"causal": True}),
        Case("single rows", (1, 1, 1, 1), (1, 5, 0, 300), 4, 2, 128, 128, {}),
        Case("no keys at all", (5, 64), (0, 0), 4, 2, 128, 128, {"sinks": True}),
        Case("no rows at all", (0, 0), (0, 0), 4, 2, 128, 128, {}),
        Case("nan tail", MIXED_Q, MIXED_K, 4, 2, 128, 128, {"tail": 9, "causal": True}),
        Case("nan tail d64", LENS, LENS, 4, 2, 64, 64, {"tail": 70}),
        Case("garbage cu_seqlens", (), (), 4, 2, 128, 128,
             {"cu_q": (-9, 40, 10 ** 6, -3), "cu_k": (5, -2, 10 ** 7, 50), "rows": (100, 120)}),
        Case("garbage cu_seqlens causal", (), (), 4, 2, 64, 64,
             {"cu_q": (0, 129, 129, 70, 300), "cu_k": (0, 200, 100, 400, 10 ** 9), "rows": (300, 300),
              "causal": True}),
    ]
    features = [
        ("causal", {"causal": True}),
        ("window", {"window": (32, 16)}),
        ("window causal", {"window": (100, 0)}),
        ("offset 0 causal", {"causal": True, "offset": 0}),
        ("offset -3 causal", {"causal": True, "offset": -3}),
        ("offset 100 window", {"window": (40, 8), "offset": 100}),
        ("softcap", {"softcap": 30.0}),
        ("alibi causal", {"alibi": True, "causal": True}),
        ("softcap+alibi", {"softcap": 20.0, "alibi": True}),
        ("scale<0", {"scale": -0.05}),
        ("sinks causal", {"sinks": True, "causal": True}),
        ("dominant sinks", {"sinks": 20.0}),
        ("fp16 causal", {"dtype": torch.float16, "causal": True}),
        ("fp16 softcap", {"dtype": torch.float16, "softcap": 30.0}),
    ]
    for name, opts in features:
        found.append(Case(name, MIXED_Q, MIXED_K, 4, 2, 128, 128, opts))
    heads = [("gqa1", 4, 4), ("gqa4", 8, 2), ("gqa8", 8, 1)]
    for name, hq, hkv in heads:
        found.append(Case(name + " causal", MIXED_Q, MIXED_K, hq, hkv, 128, 128, {"causal": True}))
    dims = [(64, 64), (40, 40), (32, 32), (96, 96), (160, 160), (192, 192), (256, 256), (128, 64), (40, 24),
            (64, 128)]
    for d, dv in dims:
        found.append(Case(f"d{d} dv{dv}", MIXED_Q, MIXED_K, 4, 2, d, dv, {"causal": True}))
        found.append(Case(f"d{d} dv{dv} fp16 alibi", MIXED_Q, MIXED_K, 4, 2, d, dv,
                          {"dtype": torch.float16, "alibi": True, "window": (64, 64)}))
    return found


class Built(NamedTuple):
    args: tuple     # q, k, v packed
    kwargs: dict    # attention options (cu_seqlens_q/k, ...)
    spans: list     # per sequence: ((q0, q1), (k0, k1)) as the kernel clamps cu_seqlens


def _spans(cu: list, total: int) -> list:
    out = []
    for a, b in zip(cu, cu[1:]):
        start = min(max(a, 0), total)
        out.append((start, min(max(b, start), total)))
    return out


def build(case: Case, device, gen) -> Built:
    opts = dict(case.opts)
    dtype = opts.pop("dtype", torch.bfloat16)
    tail = opts.pop("tail", 0)
    cu_q, cu_k = opts.pop("cu_q", None), opts.pop("cu_k", None)
    rows = opts.pop("rows", None)
    if cu_q is None:
        cu_q = [0] + torch.tensor(case.lens_q).cumsum(0).tolist()
        cu_k = [0] + torch.tensor(case.lens_k).cumsum(0).tolist()
        rows = (cu_q[-1] + tail, cu_k[-1] + tail)
    b = len(cu_q) - 1

    def randn(*shape):
        return torch.randn(shape, device=device, generator=gen).to(dtype)

    q, k, v = randn(rows[0], case.hq, case.d), randn(rows[1], case.hkv, case.d), randn(rows[1], case.hkv, case.dv)
    if tail:  # rows past the last sequence: a read of them shows up as NaN
        for t in (q, k, v):
            t[t.shape[0] - tail:] = float("nan")
    kwargs = dict(opts, cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
                  cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=device))
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(b, case.hq, device=device, generator=gen) * 0.5 + 0.01
    sinks = kwargs.pop("sinks", None)
    if sinks is True:
        kwargs["sinks"] = torch.randn(case.hq, device=device, generator=gen) * 2
    elif sinks is not None:
        kwargs["sinks"] = torch.full((case.hq,), float(sinks), device=device)
    return Built((q, k, v), kwargs, list(zip(_spans(cu_q, rows[0]), _spans(cu_k, rows[1]))))


def covered(built: Built, total_q: int) -> torch.Tensor:
    """How many (clamped) sequences cover each packed query row: garbage cu_seqlens can overlap, and then
    which sequence's blocks write a row last is not defined."""
    rows = torch.zeros(total_q, dtype=torch.int32)
    for (q0, q1), _ in built.spans:
        rows[q0:q1] += 1
    return rows


def formula(p, xv, built: Built, compute_dtype):
    """(out (total_q, Hq, Dv), lse (Hq, total_q)) of the formula one sequence at a time; NaN in rows no
    sequence covers."""
    high = compute_dtype == torch.float64
    slopes, sinks = built.kwargs.get("alibi_slopes"), built.kwargs.get("sinks")
    total_q = xv.q.shape[0]
    out = torch.full((total_q, p.heads_q, p.head_dim_v), float("nan"), dtype=compute_dtype, device=xv.q.device)
    lse = torch.full((p.heads_q, total_q), float("nan"), dtype=torch.float64 if high else torch.float32,
                     device=xv.q.device)
    for b, ((q0, q1), (k0, k1)) in enumerate(built.spans):
        if q1 == q0:
            continue
        q, k, v = (t[r0:r1].transpose(0, 1)[None] for t, (r0, r1) in ((xv.q, (q0, q1)), (xv.k, (k0, k1)),
                                                                        (xv.v, (k0, k1))))
        if high:
            q, k, v = q.double(), k.double(), v.double()
        cast = (lambda t: t.double()) if high else (lambda t: t.float())
        o, l = attention_reference(
            q, k, v, scale=p.scale, softcap=p.softcap,
            alibi_slopes=None if slopes is None else cast(slopes[b:b + 1]),
            window_left=p.window_left, window_right=p.window_right, offset=p.offset,
            sinks=None if sinks is None else cast(sinks), compute_dtype=compute_dtype)
        out[q0:q1] = o[0].transpose(0, 1)
        lse[:, q0:q1] = l[0]
    return out, lse


def kernel_forward(p, xv, built: Built):
    from attnx.backends.cuda import launch_varlen

    return launch_varlen.forward(p, xv, poison=True)


def hopper_variant(p):
    """The opt-in Hopper varlen forward (`variants.hopper_varlen_variant`) for `p`, EXACT_ALPHA as the launcher's."""
    from attnx.backends.cuda import launch, variants

    tile = variants.head_dim_tile(launch.round8(p.head_dim), launch.round8(p.head_dim_v), variants.FAMILIES["sm90"],
                                  "fwd")
    v = variants.hopper_varlen_variant(p.dtype == torch.bfloat16, tile, launch.score_mod(p),
                                       variants.max_shared(p.capability))
    return v._replace(exact_alpha=True) if variants.forward_rounds_rescale(p.seqlen_k) else v


def hopper_kernel_forward(p, xv, built: Built):
    from attnx.backends.cuda import launch_varlen

    return launch_varlen.forward(p, xv, variant=hopper_variant(p), poison=True)


def stand_in_forward(p, xv, built: Built):
    """--self-test: the float32 formula in place of the kernel (out in the inputs' dtype; NaN rows unwritten)."""
    out, lse = formula(p, xv, built, torch.float32)
    return out.to(xv.q.dtype), lse


def check_one(case: Case, device, gen, forward) -> tuple[bool, str]:
    from attnx.autograd import backend_view
    from attnx.problem import make_call

    built = build(case, device, gen)
    p, x = make_call(*built.args, grad_inputs=(), **built.kwargs)
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        p = p._replace(arch=f"sm_{major}{minor}")
    xv = backend_view(p, x)
    out, lse = forward(p, xv, built)
    cover = covered(built, xv.q.shape[0]).to(xv.q.device)
    rows, shared = cover == 1, cover > 1  # rows two sequences write: any finite result, not compared
    ref = formula(p, xv, built, torch.float64)
    lows = [formula(p, xv, built, cd) for cd in (xv.q.dtype, torch.float32)]
    if "alibi_slopes" in built.kwargs:
        # ALiBi biases of hundreds of positions computed in bf16/fp16 are off by whole units, which would
        # make the bound meaningless: the float32 formula with out rounded to the dtype instead, its error
        # doubled once more (the kernel also rounds P to the dtype before P V)
        o32, l32 = lows[1]
        lows[0] = (ref[0] + 2 * (o32.to(xv.q.dtype).double() - ref[0]), l32)
    good_o, text_o = _compare(out[rows], ref[0][rows], [lo[0][rows] for lo in lows], "out")
    good_l, text_l = _compare(lse[:, rows], ref[1][:, rows], [lo[1][:, rows] for lo in lows], "lse")
    untouched = bool(torch.isnan(out[cover == 0].float()).all()) and bool(torch.isnan(lse[:, cover == 0]).all())
    written = bool(torch.isfinite(out[shared].float()).all())
    extra = ("" if untouched else "  wrote rows outside every sequence !") + \
        ("" if written else "  left a row two sequences cover unwritten !")
    overlap = f" ({int(shared.sum())} overlapping)" if bool(shared.any()) else ""
    return good_o and good_l and untouched and written, \
        f"{text_o}  {text_l}  rows {int(rows.sum())}/{rows.numel()}{overlap}{extra}"


def check(all_cases, forward, device, only=None) -> bool:
    """Every case (whose name contains `only`), one numbered line each; False on any failure."""
    gen = torch.Generator(device=device).manual_seed(0)
    todo = [c for c in all_cases if only is None or only in c.name]
    print(f"{'':4} {'#':>3} {'case':<28} {'Hq':>3} {'Hkv':>3} {'D':>4} {'Dv':>4} {'Sq per sequence':<34} "
          f"max err / bound")

    def head_of(n, case):
        lens = str(case.lens_q if case.lens_q else case.opts.get("cu_q"))
        return f"{n:>3} {case.name:<28} {case.hq:>3} {case.hkv:>3} {case.d:>4} {case.dv:>4} {lens:<34}"

    def check_case(case):
        good, text = check_one(case, device, gen, forward)
        shown = {k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v) for k, v in case.opts.items()
                 if k not in ("cu_q", "cu_k", "rows")}
        return good, text + (f"  {shown}" if shown else "")

    return run_numbered(todo, head_of, check_case, device)


# -- emulation: the kernel's index arithmetic in torch, on the records the launcher packs ---------------
def emulate(plan) -> None:
    """Write plan.out_k and plan.lse as fa_fwd.cu (VARLEN=1) does from `plan` (launch_varlen.prepare): the
    same blocks, clamped cu_seqlens, early exits, key blocks and masks, in float32. Reads and writes memory
    only through the records' pointers, strides and sizes (an offset outside a buffer raises)."""
    from .decode_emulate import _at, _storage

    r = {name: plan.args[name].item() for name in plan.args.dtype.names}
    vr = {name: plan.varlen[name].item() for name in plan.varlen.dtype.names}
    by_ptr = {t.data_ptr(): t for t in plan.keep}
    mem = {name: _storage(by_ptr[r[name]]) for name in ("q", "k", "v", "o", "lse", "alibi", "sinks") if r[name]}
    cu_q, cu_k = (_storage(by_ptr[vr[n]]) for n in ("cu_seqlens_q", "cu_seqlens_k"))
    bm, bn = plan.variant.block_m, plan.variant.block_n
    d, dv, log2e, ar = r["head_dim"], r["head_dim_v"], 1.4426950408889634, torch.arange

    def span(cu, b, total):
        start = min(max(int(_at(cu, torch.tensor(b))), 0), total)
        return start, min(max(int(_at(cu, torch.tensor(b + 1))), start), total)

    for blk in range(plan.grid):
        bh, rest = divmod(blk, r["num_blocks"])
        b, h = divmod(bh, r["heads_q"])
        hk, m0 = h // r["group"], (r["num_blocks"] - 1 - rest) * bm
        (q0, q1), (k0, k1) = span(cu_q, b, vr["total_q"]), span(cu_k, b, vr["total_k"])
        sq, sk = q1 - q0, k1 - k0
        if m0 >= sq:
            continue
        offset = r["key_offset"] + (sk - sq if vr["align_br"] else 0)
        rows = ar(m0, min(m0 + bm, sq))
        lo = max(0, m0 + offset - r["window_left"])
        hi = min(sk - 1, rows[-1].item() + offset + r["window_right"])
        keys = ar(lo // bn * bn, (hi // bn + 1) * bn) if hi >= lo else ar(0)
        live = keys < sk
        q = _at(mem["q"], (q0 * r["q_rs"] + h * r["q_hs"] + rows * r["q_rs"])[:, None] + ar(d))
        kt, vt = torch.zeros(len(keys), d), torch.zeros(len(keys), dv)
        if live.any():  # (an empty k has no storage to read)
            kt[live] = _at(mem["k"], (k0 * r["k_rs"] + hk * r["k_hs"] + keys[live] * r["k_rs"])[:, None] + ar(d))
            vt[live] = _at(mem["v"], (k0 * r["v_rs"] + hk * r["v_hs"] + keys[live] * r["v_rs"])[:, None] + ar(dv))
        s = q @ kt.T * r["scale"]
        if r["softcap"] > 0:
            s = r["softcap"] * torch.tanh(s * r["softcap_inv"])
        if "alibi" in mem:
            slope = _at(mem["alibi"], torch.tensor(b * r["alibi_bs"] + h * r["alibi_hs"]))
            s = s - slope * (rows[:, None] + offset - keys[None, :]).abs().float()
        pos = rows[:, None] + offset
        seen = live[None, :] & (keys[None, :] >= pos - r["window_left"]) & (keys[None, :] <= pos + r["window_right"])
        s = torch.where(seen, s * log2e, torch.tensor(float("-inf")))
        sink = _at(mem["sinks"], torch.tensor(h)) * log2e if "sinks" in mem else torch.tensor(float("-inf"))
        top = torch.maximum(torch.where(s.isnan(), float("-inf"), s).amax(1) if len(keys) else
                            torch.full((len(rows),), float("-inf")), sink)
        shift = torch.where(top == float("-inf"), torch.zeros_like(top), top)
        pr = torch.exp2(s - shift[:, None])
        total = pr.sum(1) + torch.exp2(sink - shift)
        empty = total == 0
        out = torch.where(empty[:, None], 0.0, (pr @ vt) / total[:, None])
        lse = torch.where(empty, sink / log2e, (shift + torch.log2(total)) / log2e)
        o_off = (q0 * r["o_rs"] + h * r["o_hs"] + rows * r["o_rs"])[:, None] + ar(dv)
        _at(mem["o"], o_off)  # (bounds)
        mem["o"][o_off] = out.to(mem["o"].dtype)
        l_off = h * vr["total_q"] + q0 + rows
        _at(mem["lse"], l_off)
        mem["lse"][l_off] = lse


def emulated_forward(p, xv, built: Built, hopper: bool = False):
    """--emulate: the launcher's host side (`prepare`, as for an H200) and the kernel's arithmetic emulated;
    `hopper`: with the Hopper varlen forward's tile (its blocks, rows and key blocks; both kernels share the
    grid, the clamped cu_seqlens and the masks; the Hopper one's zeroed V rows are the emulation's `live`)."""
    from attnx.backends.cuda import launch_varlen

    p = p._replace(device_type="cuda", vendor="nvidia", arch="sm_90")
    plan = launch_varlen.prepare(p, xv, variant=hopper_variant(p) if hopper else None)
    plan.out_k.fill_(float("nan"))
    plan.lse.fill_(float("nan"))
    emulate(plan)
    if plan.out_k is not plan.out:
        plan.out.copy_(plan.out_k[..., : p.head_dim_v])
    return plan.out, plan.lse


# -- time ---------------------------------------------------------------------------------------------
def _pairs(lens: list, causal: bool) -> int:
    """Query-key pairs the formula evaluates (bottom-right causal with Sq = Sk: the lower triangle)."""
    return sum(n * (n + 1) // 2 if causal else n * n for n in lens)


def sdpa_padded(q, k, v, lens, causal: bool):
    """What a model without varlen support runs: the sequences padded to the longest into one batch, and
    torch's SDPA with a boolean mask (padding keys off; causal per sequence), K/V heads repeated for GQA
    outside the timing. A callable timing one call."""
    import torch.nn.functional as F

    b, s, hq, hkv = len(lens), max(lens), q.shape[1], k.shape[1]
    starts = [0] + torch.tensor(lens).cumsum(0).tolist()[:-1]

    def pad(t, heads):
        out = t.new_zeros(b, heads, s, t.shape[-1])
        for i, (a, n) in enumerate(zip(starts, lens)):
            out[i, :, :n] = t[a:a + n].transpose(0, 1)
        return out

    qp, kp, vp = pad(q, hq), pad(k, hkv).repeat_interleave(hq // hkv, 1), pad(v, hkv).repeat_interleave(hq // hkv, 1)
    pos = torch.arange(s, device=q.device)
    keep = pos[None, None, :] < torch.tensor(lens, device=q.device)[:, None, None]  # (B, 1, S) keys of each sequence
    mask = keep & (pos[None, None, :] <= pos[None, :, None]) if causal else keep.expand(b, s, s)
    mask = mask[:, None]  # (B, 1, S, S); padded query rows see the sequence's keys: no empty rows
    return lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask)


def time_all(total: int, hq: int, hkv: int, dims, seqs: int, hopper: bool = False) -> None:
    """bf16, `seqs` sequences of random lengths summing to `total`, beside equal lengths and one sequence
    of `total` tokens: TFLOP/s (4 * pairs * D * Hq, the pairs of the sequences only) of the varlen kernel,
    triton's varlen, SDPA on the padded batch (`sdpa_padded`), FlexAttention on the packed tokens with a
    document mask (its row's name carries its max error against triton's varlen), and the cuda backend's
    dense kernel on the dense equivalent (B x S when lengths are equal)."""
    import attnx
    from attnx.autograd import backend_view
    from attnx.backends.cuda import launch_varlen
    from attnx.problem import make_call

    from .flex_rows import flex_document, packed_out

    major, minor = torch.cuda.get_device_capability()
    rng = random.Random(0)
    cuts = sorted(rng.sample(range(1, total), seqs - 1))
    shapes = {"random": [b - a for a, b in zip([0] + cuts, cuts + [total])],
              "equal": [total // seqs] * seqs, "one": [total]}
    print(f"{'lengths':<8} {'D':>4} {'causal':<6} {'kernel':<22} {'ms':>8} {'TFLOP/s':>8}")
    for d in dims:
        for causal in (False, True):
            for shape, lens in shapes.items():
                cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
                q = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(total, hkv, d, device="cuda", dtype=torch.bfloat16)
                v = torch.randn_like(k)
                kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens),
                          causal=causal)
                p, x = make_call(q, k, v, grad_inputs=(), **kw)
                p = p._replace(arch=f"sm_{major}{minor}")
                xv = backend_view(p, x)
                flops = 4 * _pairs(lens, causal) * d * hq

                def row(name, fn):
                    ms = bench(fn)
                    print(f"{shape:<8} {d:>4} {str(causal):<6} {name:<22} {ms:8.3f} {flops / ms / 1e9:8.1f}",
                          flush=True)

                row("cuda varlen", lambda: launch_varlen.forward(p, xv))
                if hopper:
                    row("cuda hopper varlen", lambda: launch_varlen.forward(p, xv, variant=hopper_variant(p)))
                row("triton varlen", lambda: attnx.attention(q, k, v, backend="triton", **kw))
                row("sdpa padded batch", sdpa_padded(q, k, v, lens, causal))
                flex = flex_document(q, k, v, lens, causal)
                if flex is not None:
                    ref = attnx.attention(q, k, v, backend="triton", **kw).float()
                    err = float((packed_out(flex()).float() - ref).abs().max())
                    row(f"flex doc mask {err:.0e}", flex)
                if shape != "random":  # the dense equivalent: B sequences of one length
                    b, s = len(lens), lens[0]
                    qd, kd, vd = (t.view(b, s, t.shape[1], d) for t in (q, k, v))
                    row("cuda dense (B x S)", lambda: attnx.attention(qd, kd, vd, layout="bshd", causal=causal,
                                                                      backend="cuda"))
                q = k = v = None
            torch.cuda.empty_cache()


def parser_for(description: str, dims: str) -> argparse.ArgumentParser:
    """The options this script and cuda_varlen_backward share: what, the case filter, the CPU self-test, the
    packed batch that `time` runs."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("what", choices=("check", "time"))
    parser.add_argument("--only", default=None, help="check: only cases whose name contains this")
    parser.add_argument("--self-test", action="store_true",
                        help="check on the CPU with the float32 formula standing in for the kernel")
    parser.add_argument("--total", type=int, default=16384, help="time: tokens of the packed batch")
    parser.add_argument("--seqs", type=int, default=16, help="time: sequences of the packed batch")
    parser.add_argument("--heads", default="16,16", help="time: Hq,Hkv")
    parser.add_argument("--dims", default=dims, help="time: head dims")
    return parser


def main(argv=None) -> int:
    parser = parser_for(__doc__.splitlines()[0], "64,128")
    parser.add_argument("--hopper", action="store_true",
                        help="check/time the opt-in Hopper varlen forward (sm90 fa_fwd.cu VARLEN=1) instead of / beside "
                             "the Ampere one")
    parser.add_argument("--emulate", action="store_true",
                        help="check on the CPU: the launcher's host side and the kernel's index arithmetic emulated")
    args = parser.parse_args(argv)
    if args.what == "check":
        if args.self_test or args.emulate:
            forward = functools.partial(emulated_forward, hopper=args.hopper) if args.emulate else stand_in_forward
            return 0 if check(cases(), forward, "cpu", args.only) else 1
        forward = hopper_kernel_forward if args.hopper else kernel_forward
        return 0 if check(cases(), forward, "cuda", args.only) else 1
    hq, hkv = (int(h) for h in args.heads.split(","))
    time_all(args.total, hq, hkv, tuple(int(d) for d in args.dims.split(",")), args.seqs, args.hopper)
    return 0


if __name__ == "__main__":
    sys.exit(main())
