"""What the backward benchmarks' `check` and `time` share (benchmarks/hopper_backward.py,
benchmarks/cuda_deterministic.py): the case grid, the inputs, the formula's gradients, the bound
and the comparison against it, the numbered case lines with their summary, the CPU stand-in for
`--self-test` and the timer.

A case passes when each gradient is finite, within the bound of tests/test_cuda_gpu.py (twice the
error of the formula computed from the same low-dtype inputs in that dtype and in float32, plus
1e-3) and within `MAX_REL_ERR` of the float64 one in relative norm (and when the script's own
`extra` check passes).
"""
from __future__ import annotations

import itertools
import traceback

import torch

from attnx.reference import attention_reference

# a guard beside the max-error bound, which the formula's own bf16 error makes loose where scores
# are large (softcap + ALiBi): a wrong kernel misses the float64 gradients by far more than 3 %
MAX_REL_ERR = 3e-2
GRAD_NAMES = ("dq", "dk", "dv", "dsinks")


def case_grid(head_dims, lengths, features, length_cases):
    """(name, b, hq, hkv, sq, sk, d, dv, opts): the simplest first, then the length pairs (each pair
    gives the cases ``length_cases(sq, sk)`` -> [(name, opts)]), then `features` ((name, b, hq, hkv,
    sq, sk, D, Dv, opts); D/Dv None: the head dim of the sweep)."""
    found = []
    for d in head_dims:
        found.append(("plain", 1, 2, 2, 128, 128, d, d, {}))
        for sq, sk in itertools.product(lengths, lengths):
            for name, opts in length_cases(sq, sk):
                found.append((name, 1, 2, 2, sq, sk, d, d, opts))
    for d in head_dims:
        for name, b, hq, hkv, sq, sk, fd, fdv, opts in features:
            found.append((name, b, hq, hkv, sq, sk, fd or d, fdv or fd or d, opts))
    return found


def inputs(case, device, gen):
    """q, k, v, dout in the case's layout (dout as the forward's out view), and attention kwargs:
    fresh random draws for every case."""
    _, b, hq, hkv, sq, sk, d, dv, opts = case
    opts = dict(opts)
    dtype = opts.pop("dtype", torch.bfloat16)
    layout = opts.get("layout", "bhsd")

    def make(h, s, width):
        shape = (b, s, h, width) if layout == "bshd" else (b, h, s, width)
        return torch.randn(shape, device=device, generator=gen).to(dtype)

    q, k, v, dout = make(hq, sq, d), make(hkv, sk, d), make(hkv, sk, dv), make(hq, sq, dv)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = torch.rand(hq, device=device, generator=gen) * 0.5 + 0.01
    if opts.pop("sinks", False):
        opts["sinks"] = torch.randn(hq, device=device, generator=gen) * 2
    return q, k, v, dout, opts


def formula_grads(p, q, k, v, sinks, slopes, dout, compute_dtype):
    """dq, dk, dv, dsinks (None without sinks) of the formula on bhsd inputs, by torch autograd.

    float64: every input converted first; otherwise the low-dtype inputs as given, computed in
    `compute_dtype` (the formula's own rounding, which sets the bound).
    """
    high = compute_dtype == torch.float64
    leaves = [None if t is None else (t.double() if high else t).detach().requires_grad_() for t in (q, k, v, sinks)]
    if slopes is not None:
        slopes = slopes.double() if high else slopes.float()
    out, _ = attention_reference(*leaves[:3], scale=p.scale, softcap=p.softcap, alibi_slopes=slopes,
                                 window_left=p.window_left, window_right=p.window_right, offset=p.offset,
                                 sinks=leaves[3], compute_dtype=compute_dtype)
    wanted = [t for t in leaves if t is not None]
    found = iter(torch.autograd.grad(out, wanted, dout.to(out.dtype), allow_unused=True))
    grads = [next(found) if t is not None else None for t in leaves]
    return [torch.zeros_like(t) if g is None and t is not None else g for g, t in zip(grads, leaves)]


def max_err(got, ref) -> float:
    return (got.double() - ref.double()).abs().max().item() if got.numel() else 0.0


def rel_err(got, ref) -> float:
    """||got - ref|| / max(||ref||, 1e-3 * sqrt(n)): relative where the gradient is not ~0; where it
    vanishes (one key: dq = dk = 0 exactly) relative to the bound's absolute slack of 1e-3 per entry,
    so rounding residue of 1e-7 is not a 1e23 relative error."""
    diff = (got.double() - ref.double()).norm().item()
    floor = 1e-3 * max(ref.numel(), 1) ** 0.5
    return diff / max(ref.double().norm().item(), floor) if diff else 0.0


def stand_in_grads(p, xv, dout_v):
    """--self-test: the float32 formula in place of the kernel (bhsd views in, grads out)."""
    slopes = xv.alibi_slopes[0] if xv.alibi_slopes is not None else None
    grads = formula_grads(p, xv.q, xv.k, xv.v, xv.sinks, slopes, dout_v, torch.float32)
    return [g.to(xv.q.dtype) if i < 3 else g for i, g in enumerate(grads)]


def check_one(case, device, gen, grads_of, extra=None) -> tuple[bool, str]:
    """One case: ``grads_of(p, xv, dout_v)`` against the float64 formula; then, where given,
    ``extra(p, xv, dout_v, got)`` -> (good, text), the script's own check."""
    from attnx.autograd import backend_view
    from attnx.problem import make_call

    q, k, v, dout, opts = inputs(case, device, gen)
    layout = opts.get("layout", "bhsd")
    p, x = make_call(q, k, v, grad_inputs=(), **opts)
    xv = backend_view(p, x)
    dout_v = dout.transpose(1, 2) if layout == "bshd" else dout
    got = grads_of(p, xv, dout_v)
    slopes, sinks = opts.get("alibi_slopes"), opts.get("sinks")
    ref = formula_grads(p, xv.q, xv.k, xv.v, sinks, slopes, dout_v, torch.float64)
    lows = [formula_grads(p, xv.q, xv.k, xv.v, sinks, slopes, dout_v, cd) for cd in (xv.q.dtype, torch.float32)]
    good, text = compare_grads(got, ref, lows)
    parts = [text]
    if extra is not None:
        ok, text = extra(p, xv, dout_v, got)
        good &= ok
        parts.append(text)
    return good, "  ".join(parts)


def compare_grads(got, ref, lows, inside=None) -> tuple[bool, str]:
    """Each of GRAD_NAMES that `ref` has: `got` finite, within the bound (twice the worst error of `lows`, the
    formula in low dtypes, plus 1e-3) and within MAX_REL_ERR in relative norm; (all good, one text). `inside`:
    per gradient, a row mask where that rule applies; every row outside it must be exactly 0."""
    good, parts = True, []
    for i, name in enumerate(GRAD_NAMES):
        if ref[i] is None:
            continue
        if got[i] is None or tuple(got[i].shape) != tuple(ref[i].shape):
            good = False
            parts.append(f"{name} shape {None if got[i] is None else tuple(got[i].shape)} != {tuple(ref[i].shape)}")
            continue
        rows = inside[i] if inside is not None else None
        g, r = (got[i], ref[i]) if rows is None else (got[i][rows], ref[i][rows])
        finite = bool(torch.isfinite(g).all())
        bound = 2 * max(max_err(lo[i] if rows is None else lo[i][rows], r) for lo in lows) + 1e-3
        err = max_err(g, r) if finite else float("nan")
        rel = rel_err(g, r) if finite else float("nan")
        zero_outside = rows is None or bool((got[i][~rows] == 0).all())
        ok = finite and err <= bound and rel <= MAX_REL_ERR and zero_outside
        good &= ok
        parts.append(f"{name} {err:.1e}/{bound:.1e} rel {rel:.0e}{'' if zero_outside else ' (rows outside not 0)'}"
                     f"{'' if ok else ' !'}")
    return good, "  ".join(parts)


def check(all_cases, grads_of, device, max_scores=None, only=None, quiet=False, extra=None) -> bool:
    """Every case of `all_cases` (of at most `max_scores` Sq x Sk, whose name contains `only`, where
    given), one numbered line each; False on any failure. Continues past failures, stops only when
    the CUDA context is lost; `quiet`: no case lines and no summary."""
    gen = torch.Generator(device=device).manual_seed(0)
    todo = [c for c in all_cases if (max_scores is None or c[4] * c[5] <= max_scores)
            and (only is None or only in c[0])]
    say = (lambda *a, **k: None) if quiet else print
    say(f"{'':4} {'#':>3} {'case':<20} {'B':>2} {'Hq':>3} {'Hkv':>3} {'Sq':>5} {'Sk':>5} {'D':>4} {'Dv':>4} "
        f"{'options':<44} max err / bound")

    def head_of(n, case):
        name, b, hq, hkv, sq, sk, d, dv, opts = case
        shown = {k: (v if not isinstance(v, torch.dtype) else str(v).replace("torch.", "")) for k, v in opts.items()}
        return f"{n:>3} {name:<20} {b:>2} {hq:>3} {hkv:>3} {sq:>5} {sk:>5} {d:>4} {dv:>4} {str(shown):<44}"

    return run_numbered(todo, head_of, lambda case: check_one(case, device, gen, grads_of, extra), device, say)


def run_numbered(todo, head_of, check_case, device, say=print) -> bool:
    """Run ``check_case(case) -> (good, text)`` on each case, one numbered line each (``head_of(n, case)``
    then the text), the failures again at the end; False on any. An exception fails its case; a lost
    CUDA context ends the run (the cases after it cannot run)."""
    failed = []
    for n, case in enumerate(todo):
        head = head_of(n, case)
        try:
            good, text = check_case(case)
        except Exception as err:  # a launch that fails: report it; a lost context ends the run
            good, text = False, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            traceback.print_exc()
            if device == "cuda" and not context_alive():
                print(f"BAD  {head} {text}\nCUDA context lost in case {n}: the remaining "
                      f"{len(todo) - n - 1} cases are not run", flush=True)
                for line in failed:
                    print(line)
                return False
        line = f"{'ok ' if good else 'BAD'}  {head} {text}"
        say(line, flush=True)  # a hang leaves case n + 1 as the culprit
        if not good:
            failed.append(line)
    # the summary last: a device call returns only the tail of the output
    say(f"{len(todo) - len(failed)} of {len(todo)} cases passed" + (", failures:" if failed else ""))
    for line in failed:
        say(line)
    return not failed


def context_alive() -> bool:
    try:
        torch.ones(1, device="cuda").add_(1).item()
        torch.cuda.synchronize()
        return True
    except Exception:
        return False


def bench_rounds(fns: dict, rounds: int) -> dict:
    """{name: median over `rounds` of `bench(fn)`}, the names timed in turn within each round, so that a drift of
    the clocks or of the host over the run falls on every name alike (on the H200 one kernel timed twice in one
    process, one after the other, differed by up to 3 %)."""
    import statistics

    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(bench(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def bench(fn) -> float:
    """Median ms of `fn` by triton's do_bench; NaN (and a line) where it cannot run, so that one
    kernel that cannot run a shape does not end the table."""
    import triton.testing

    try:
        return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
    except Exception as err:
        print(f"  ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})", flush=True)
        return float("nan")
