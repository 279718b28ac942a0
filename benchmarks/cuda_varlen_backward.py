"""The cuda backend's packed (varlen) backward (the Ampere backward built with VARLEN=1): gradients, speed.

    python -m benchmarks.cuda_varlen_backward check              # the forward check's cases, with gradients
    python -m benchmarks.cuda_varlen_backward check --self-test  # the harness on the CPU (float32 formula)
    python -m benchmarks.cuda_varlen_backward time               # fwd+bwd TFLOP/s beside triton's varlen

`check` runs `benchmarks.cuda_varlen`'s cases (inputs, NaN tails, per-sequence formula) except those
with garbage cu_seqlens (overlapping sequences have no single gradient): the kernel's forward, then
`launch_varlen.backward` with a fresh random dout, against the float64 formula's gradients one
sequence at a time, with the bound of benchmarks/backward_check.py (twice the formula's own error in
the inputs' dtype and in float32, plus 1e-3, and 3 % in relative norm). Rows no sequence covers must
get exactly zero gradients (the NaN `tail` rows included: a read of them would show up as NaN).
Needs CuPy and an sm_80..sm_90 GPU (`time` also triton).
"""
from __future__ import annotations

import random
import sys

import torch

from .backward_check import bench, compare_grads, formula_grads, run_numbered
from .cuda_varlen import Built, Case, build, cases, covered, parser_for


def formula(p, xv, built: Built, dout, compute_dtype) -> list:
    """dq, dk, dv (packed, zero in rows no sequence covers) and dsinks of the formula, one sequence at a time."""
    slopes, sinks = built.kwargs.get("alibi_slopes"), built.kwargs.get("sinks")
    wide = torch.float64 if compute_dtype == torch.float64 else xv.q.dtype
    grads = [torch.zeros(t.shape, dtype=wide, device=t.device) for t in (xv.q, xv.k, xv.v)]
    dsinks = None if sinks is None else torch.zeros(sinks.shape, dtype=torch.float64, device=sinks.device)
    for b, ((q0, q1), (k0, k1)) in enumerate(built.spans):
        if q1 == q0:
            continue
        q, k, v, do = (t[r0:r1].transpose(0, 1)[None] for t, (r0, r1) in
                       ((xv.q, (q0, q1)), (xv.k, (k0, k1)), (xv.v, (k0, k1)), (dout, (q0, q1))))
        dq, dk, dv, ds = formula_grads(p, q, k, v, sinks, None if slopes is None else slopes[b:b + 1], do,
                                       compute_dtype)
        for full, part, (r0, r1) in ((grads[0], dq, (q0, q1)), (grads[1], dk, (k0, k1)), (grads[2], dv, (k0, k1))):
            full[r0:r1] += part[0].transpose(0, 1).to(wide)
        if dsinks is not None:
            dsinks += ds.double()
    return grads + [dsinks]


def kernel_grads(p, xv, built: Built, dout) -> list:
    from attnx.backends.cuda import launch_varlen

    out, lse = launch_varlen.forward(p, xv)
    g = launch_varlen.backward(p, xv, out, lse, dout)
    return [g.dq, g.dk, g.dv, g.dsinks]


def stand_in_grads(p, xv, built: Built, dout) -> list:
    """--self-test: the float32 formula in place of the kernel."""
    found = formula(p, xv, built, dout, torch.float32)
    return [g.to(xv.q.dtype) if i < 3 else g for i, g in enumerate(found)]


def check_one(case: Case, device, gen, grads_of) -> tuple[bool, str]:
    from attnx.autograd import backend_view
    from attnx.problem import make_call

    built = build(case, device, gen)
    p, x = make_call(*built.args, grad_inputs=(), **built.kwargs)
    p = p._replace(needs_grad=True)
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        p = p._replace(arch=f"sm_{major}{minor}")
    xv = backend_view(p, x)
    dout = torch.randn(xv.q.shape[0], p.heads_q, p.head_dim_v, device=device, generator=gen).to(xv.q.dtype)
    got = grads_of(p, xv, built, dout)
    ref = formula(p, xv, built, dout, torch.float64)
    lows = [formula(p, xv, built, dout, cd) for cd in (xv.q.dtype, torch.float32)]
    q_rows = covered(built, xv.q.shape[0]).to(device) > 0
    k_rows = torch.zeros(xv.k.shape[0], dtype=torch.bool, device=device)
    for _, (k0, k1) in built.spans:
        k_rows[k0:k1] = True
    return compare_grads(got, ref, lows, inside=(q_rows, k_rows, k_rows, None))


def check(all_cases, grads_of, device, only=None) -> bool:
    """Every case with valid cu_seqlens (whose name contains `only`), one numbered line each; False on any failure."""
    gen = torch.Generator(device=device).manual_seed(0)
    todo = [c for c in all_cases if "cu_q" not in c.opts and (only is None or only in c.name)]
    print(f"{'':4} {'#':>3} {'case':<28} {'Hq':>3} {'Hkv':>3} {'D':>4} {'Dv':>4} {'Sq per sequence':<34} "
          f"max err / bound")

    def head_of(n, case):
        return f"{n:>3} {case.name:<28} {case.hq:>3} {case.hkv:>3} {case.d:>4} {case.dv:>4} {str(case.lens_q):<34}"

    def check_case(case):
        good, text = check_one(case, device, gen, grads_of)
        shown = {k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v) for k, v in case.opts.items()}
        return good, text + (f"  {shown}" if shown else "")

    return run_numbered(todo, head_of, check_case, device)


def time_all(total: int, hq: int, hkv: int, dims, seqs: int) -> None:
    """bf16 forward + backward of `seqs` random lengths, equal lengths and one sequence summing to `total`
    tokens: TFLOP/s (2.5 x the forward's 4 * pairs * D * Hq) of the cuda backend's varlen path, triton's,
    and the cuda backend's dense path on the dense equivalent (equal lengths)."""
    import attnx

    rng = random.Random(0)
    cuts = sorted(rng.sample(range(1, total), seqs - 1))
    shapes = {"random": [b - a for a, b in zip([0] + cuts, cuts + [total])],
              "equal": [total // seqs] * seqs, "one": [total]}
    print(f"{'lengths':<8} {'D':>4} {'causal':<6} {'fwd+bwd':<22} {'ms':>8} {'TFLOP/s':>8}")
    for d in dims:
        for causal in (False, True):
            for shape, lens in shapes.items():
                cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
                q = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                k = torch.randn(total, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                v = torch.randn(total, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                dout = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16)
                kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens),
                          causal=causal)
                pairs = sum(n * (n + 1) // 2 if causal else n * n for n in lens)
                flops = 2.5 * 4 * pairs * d * hq

                def row(name, fn):
                    ms = bench(fn)
                    print(f"{shape:<8} {d:>4} {str(causal):<6} {name:<22} {ms:8.3f} {flops / ms / 1e9:8.1f}", flush=True)

                for backend in ("cuda", "triton"):
                    row(f"{backend} varlen", lambda: attnx.attention(q, k, v, backend=backend, **kw).backward(dout))
                if shape == "equal":
                    b, s = len(lens), lens[0]
                    qd, kd, vd = (t.detach().view(b, s, t.shape[1], d).requires_grad_() for t in (q, k, v))
                    dd = dout.view(b, s, hq, d)
                    row("cuda dense (B x S)", lambda: attnx.attention(qd, kd, vd, layout="bshd", causal=causal,
                                                                      backend="cuda").backward(dd))
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    args = parser_for(__doc__.splitlines()[0], "128,64").parse_args(argv)
    if args.what == "check":
        grads_of, device = (stand_in_grads, "cpu") if args.self_test else (kernel_grads, "cuda")
        return 0 if check(cases(), grads_of, device, args.only) else 1
    hq, hkv = (int(h) for h in args.heads.split(","))
    time_all(args.total, hq, hkv, tuple(int(d) for d in args.dims.split(",")), args.seqs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
