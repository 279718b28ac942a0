"""The Hopper (sm_90a) backward of the cuda backend (not dispatched yet): correctness, then speed.

    python -m benchmarks.hopper_backward check   # dq/dk/dv/dsinks against the float64 formula
    python -m benchmarks.hopper_backward time    # paper setting (bf16, 16k tokens) beside the Ampere
                                                 # backward on sm_90, SDPA cuDNN and SDPA flash

One device call runs both: ``check && time``; ``--configs table,dqbulk`` adds the variant whose dQ
goes through shared memory and a writer warp's bulk reductions (check it before timing it).
`check` prints one numbered line per case (the worst error of each gradient beside its bound),
continues past failures, stops only when the CUDA context is lost, ends with a summary of the
failures and exits 1 on any. The bound is the one of tests/test_cuda_gpu.py: twice the error
of the formula computed from the same low-dtype inputs in that dtype and in float32, plus 1e-3.
dk and dv are poisoned with NaN before the launch. `--self-test` runs the harness on the CPU with
the float32 formula standing in for the kernel (it checks the harness, not the kernel). Each
gradient must also be within 3 % of the float64 one in relative norm (`MAX_REL_ERR`). Needs an
sm_90 GPU, CuPy and cuda-bindings otherwise.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import traceback

import torch

from attnx.reference import attention_reference

LENGTHS = (1, 77, 128, 1000, 4096)
# a guard beside the max-error bound, which the formula's own bf16 error makes loose where scores
# are large (softcap + ALiBi): a wrong kernel misses the float64 gradients by far more than 3 %
MAX_REL_ERR = 3e-2
# (name, batch, Hq, Hkv, Sq, Sk, D, Dv, options); D/Dv None: the head dim of the sweep
FEATURES = [
    ("window", 1, 4, 4, 1000, 1000, None, None, {"window": (100, 20)}),
    ("window+offset", 1, 4, 4, 300, 1000, None, None, {"window": (64, 64), "offset": 400}),
    ("causal+offset<0", 1, 4, 4, 1000, 300, None, None, {"causal": True, "offset": -3}),
    ("causal+offset0", 1, 4, 4, 100, 400, None, None, {"causal": True, "offset": 0}),
    ("gqa4:1 causal", 2, 8, 2, 1000, 1000, None, None, {"causal": True}),
    ("gqa4:1 Sq!=Sk", 1, 8, 2, 77, 1000, None, None, {}),
    ("mqa", 1, 4, 1, 1000, 4096, None, None, {}),
    ("mqa causal", 2, 4, 1, 128, 1000, None, None, {"causal": True}),
    ("softcap", 1, 4, 4, 1000, 1000, None, None, {"softcap": 30.0}),
    ("alibi", 1, 4, 4, 1000, 1000, None, None, {"alibi": True, "causal": True}),
    ("softcap+alibi+gqa", 1, 8, 2, 300, 1000, None, None, {"softcap": 20.0, "alibi": True, "causal": True}),
    ("scale<0", 1, 2, 2, 190, 190, None, None, {"scale": -0.05}),
    ("dv!=d", 1, 4, 4, 1000, 1000, None, 40, {"causal": True}),
    ("d40 dv24 (padded)", 1, 4, 4, 300, 300, 40, 24, {"causal": True}),
    ("d96 (tile 128)", 1, 4, 4, 300, 1000, 96, 96, {}),
    ("d128 dv64", 1, 4, 4, 300, 300, 128, 64, {}),
    ("bshd", 2, 4, 4, 1000, 1000, None, None, {"layout": "bshd"}),
    ("bshd gqa causal", 2, 8, 2, 77, 300, None, None, {"layout": "bshd", "causal": True}),
    ("sinks", 1, 4, 4, 300, 1000, None, None, {"sinks": True, "causal": True}),
    ("fp16", 1, 4, 4, 1000, 1000, None, None, {"dtype": torch.float16, "causal": True}),
    ("fp16 softcap bshd", 1, 4, 2, 300, 300, None, None, {"dtype": torch.float16, "softcap": 30.0,
                                                          "layout": "bshd"}),
    ("Sq=1 causal", 1, 4, 4, 1, 4096, None, None, {"causal": True}),
    ("long causal", 1, 2, 2, 4096, 4096, None, None, {"causal": True}),
]


def cases(head_dims=(128, 64)):
    """(name, b, hq, hkv, sq, sk, d, dv, opts): the simplest first, then every length pair, then features."""
    found = []
    for d in head_dims:
        found.append(("plain", 1, 2, 2, 128, 128, d, d, {}))
        for sq, sk in itertools.product(LENGTHS, LENGTHS):
            found.append(("lengths", 1, 2, 2, sq, sk, d, d, {}))
            found.append(("lengths causal", 1, 2, 2, sq, sk, d, d, {"causal": True}))
    for d in head_dims:
        for name, b, hq, hkv, sq, sk, fd, fdv, opts in FEATURES:
            found.append((name, b, hq, hkv, sq, sk, fd or d, fdv or fd or d, opts))
    return found


def _inputs(case, device, gen):
    """q, k, v, dout in the case's layout (dout as the forward's out view), and attention kwargs."""
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


def _formula_grads(p, q, k, v, sinks, slopes, dout, compute_dtype):
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


def _max_err(got, ref) -> float:
    return (got.double() - ref.double()).abs().max().item() if got.numel() else 0.0


def _rel_err(got, ref) -> float:
    """||got - ref|| / ||ref|| (0 where both vanish)."""
    diff = (got.double() - ref.double()).norm().item()
    return diff / max(ref.double().norm().item(), 1e-30) if diff else 0.0


# configurations: the shipped tile table, or it with dQ added by the writer warp's bulk reductions
CONFIGS = ("table", "dqbulk")


def _variant(p, config):
    from attnx.backends.cuda.launch_sm90_bwd import backward_variant_for

    v = backward_variant_for(p)
    return v._replace(dq_bulk=True) if config == "dqbulk" and v is not None else v


def _kernel_grads(config):
    """The Hopper forward, then the Hopper backward in `config` (dk/dv poisoned with NaN first)."""
    def grads(p, xv, dout_v):
        from attnx.backends.cuda import launch_sm90, launch_sm90_bwd

        out, lse = launch_sm90.forward(p, xv)
        g = launch_sm90_bwd.backward(p, xv, out, lse, dout_v, _variant(p, config), poison=True)
        return [g.dq, g.dk, g.dv, g.dsinks]
    return grads


def _stand_in_grads(p, xv, dout_v):
    """--self-test: the float32 formula in place of the kernel (bhsd views in, grads out)."""
    slopes = xv.alibi_slopes[0] if xv.alibi_slopes is not None else None
    grads = _formula_grads(p, xv.q, xv.k, xv.v, xv.sinks, slopes, dout_v, torch.float32)
    return [g.to(xv.q.dtype) if i < 3 else g for i, g in enumerate(grads)]


def check_one(case, device, gen, grads_of) -> tuple[bool, str]:
    from attnx.autograd import backend_view
    from attnx.problem import make_call

    q, k, v, dout, opts = _inputs(case, device, gen)
    layout = opts.get("layout", "bhsd")
    p, x = make_call(q, k, v, grad_inputs=(), **opts)
    xv = backend_view(p, x)
    dout_v = dout.transpose(1, 2) if layout == "bshd" else dout
    got = grads_of(p, xv, dout_v)
    slopes = opts.get("alibi_slopes")
    sinks = opts.get("sinks")
    ref = _formula_grads(p, xv.q, xv.k, xv.v, sinks, slopes, dout_v, torch.float64)
    lows = [_formula_grads(p, xv.q, xv.k, xv.v, sinks, slopes, dout_v, cd) for cd in (xv.q.dtype, torch.float32)]
    good, parts = True, []
    for i, name in enumerate(("dq", "dk", "dv", "dsinks")):
        if ref[i] is None:
            continue
        if got[i] is None or tuple(got[i].shape) != tuple(ref[i].shape):
            good = False
            parts.append(f"{name} shape {None if got[i] is None else tuple(got[i].shape)} != {tuple(ref[i].shape)}")
            continue
        finite = bool(torch.isfinite(got[i]).all())
        bound = 2 * max(_max_err(lo[i], ref[i]) for lo in lows) + 1e-3
        err = _max_err(got[i], ref[i]) if finite else float("nan")
        rel = _rel_err(got[i], ref[i]) if finite else float("nan")
        ok = finite and err <= bound and rel <= MAX_REL_ERR
        good &= ok
        parts.append(f"{name} {err:.1e}/{bound:.1e} rel {rel:.0e}{'' if ok else ' !'}")
    return good, "  ".join(parts)


def check(head_dims, grads_of, device, max_scores=None, only=None) -> bool:
    """Every case of `cases` (those of at most `max_scores` Sq x Sk, whose name contains `only`, where
    given); False on any failure."""
    gen = torch.Generator(device=device).manual_seed(0)
    all_good, failed = True, []
    todo = [c for c in cases(head_dims) if (max_scores is None or c[4] * c[5] <= max_scores)
            and (only is None or only in c[0])]
    print(f"{'':4} {'#':>3} {'case':<20} {'B':>2} {'Hq':>3} {'Hkv':>3} {'Sq':>5} {'Sk':>5} {'D':>4} {'Dv':>4} "
          f"{'options':<44} max err / bound")
    for n, case in enumerate(todo):
        name, b, hq, hkv, sq, sk, d, dv, opts = case
        shown = {k: (v if not isinstance(v, torch.dtype) else str(v).replace("torch.", "")) for k, v in opts.items()}
        head = f"{n:>3} {name:<20} {b:>2} {hq:>3} {hkv:>3} {sq:>5} {sk:>5} {d:>4} {dv:>4} {str(shown):<44}"
        try:
            good, text = check_one(case, device, gen, grads_of)
        except Exception as err:  # a launch that fails: report it; a lost context ends the run
            good, text = False, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            traceback.print_exc()
            if device == "cuda" and not _context_alive():
                print(f"BAD  {head} {text}\nCUDA context lost in case {n}: the remaining "
                      f"{len(todo) - n - 1} cases are not run", flush=True)
                for line in failed:
                    print(line)
                return False
        all_good &= good
        line = f"{'ok ' if good else 'BAD'}  {head} {text}"
        print(line, flush=True)  # a hang leaves case n + 1 of `cases()` as the culprit
        if not good:
            failed.append(line)
    # the summary last: a device call returns only the tail of the output
    print(f"{len(todo) - len(failed)} of {len(todo)} cases passed" + ("" if all_good else ", failures:"))
    for line in failed:
        print(line)
    return all_good


def _context_alive() -> bool:
    try:
        torch.ones(1, device="cuda").add_(1).item()
        torch.cuda.synchronize()
        return True
    except Exception:
        return False


# ---- time -------------------------------------------------------------------------------------
def _flops_fwd(b, h, s, d, causal):
    return 4 * b * h * s * s * d / (2 if causal else 1)


def time_all(seqlens, head_dims, configs=("table",)) -> None:
    """bwd-only and fwd+bwd per kernel, one row printed as soon as it is measured. attnx rows: the Hopper
    forward and the backward timed apart (fwd+bwd = their sum); SDPA rows: its own forward + backward."""
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attnx.autograd import backend_view
    from attnx.backends.cuda import launch, launch_sm90, launch_sm90_bwd
    from attnx.problem import make_call

    def bench(fn):
        try:
            return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
        except Exception as err:  # one kernel that cannot run this shape must not end the table
            print(f"  ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})", flush=True)
            return float("nan")

    print(f"{'d':>4} {'S':>6} {'causal':>6} {'kernel':<26} {'bwd ms':>8} {'TFLOP/s':>8} {'x cuDNN':>8} "
          f"{'f+b ms':>8} {'TFLOP/s':>8} {'x cuDNN':>8}", flush=True)
    for d in head_dims:
        for s in seqlens:
            b, h = max(1, 16384 // s), 2048 // d
            q, k, v, dout = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            for causal in (False, True):
                p, x = make_call(q, k, v, causal=causal, grad_inputs=())
                xv = backend_view(p, x)
                out, lse = launch_sm90.forward(p, xv)
                fwd_ms = bench(lambda: launch_sm90.forward(p, xv))
                found = {}  # name -> (bwd ms, fwd+bwd ms)
                for name, kind in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                                   ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
                    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

                    def both(kind=kind, leaves=leaves):
                        with sdpa_kernel(kind):
                            o = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
                        return torch.autograd.grad(o, leaves, dout)
                    try:
                        with sdpa_kernel(kind):
                            o = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
                        bwd = bench(lambda o=o, leaves=leaves: torch.autograd.grad(o, leaves, dout, retain_graph=True))
                        del o
                    except Exception as err:
                        print(f"  ({name}: {type(err).__name__})", flush=True)
                        bwd = float("nan")
                    found[name] = (bwd, bench(both))
                for config in configs:
                    variant = _variant(p, config)
                    hopper = bench(lambda: launch_sm90_bwd.backward(p, xv, out, lse, dout, variant))
                    found[f"sm90 bwd {config}"] = (hopper, fwd_ms + hopper)
                ampere = bench(lambda: launch.backward(p, xv, out, lse, dout))
                found["sm80 bwd on sm90 (today)"] = (ampere, fwd_ms + ampere)
                flops = _flops_fwd(b, h, s, d, causal)
                base_bwd, base_both = found["sdpa-cudnn"]
                for name, (bwd, both) in found.items():
                    print(f"{d:>4} {s:>6} {causal!s:>6} {name:<26} {bwd:8.3f} {2.5 * flops / bwd / 1e9:8.1f} "
                          f"{base_bwd / bwd:8.2f} {both:8.3f} {3.5 * flops / both / 1e9:8.1f} {base_both / both:8.2f}",
                          flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("check", "time"))
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--seqlens", default="1024,4096,16384", help="time: sequence lengths")
    parser.add_argument("--configs", default="table", help=f"comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--max-scores", type=int, default=None,
                        help="check: only cases of at most this many Sq x Sk (e.g. under compute-sanitizer)")
    parser.add_argument("--only", default=None, help="check: only cases whose name contains this")
    parser.add_argument("--self-test", action="store_true",
                        help="check on the CPU with the float32 formula standing in for the kernel (small cases)")
    args = parser.parse_args(argv)
    head_dims = tuple(int(d) for d in args.head_dims.split(","))
    configs = tuple(args.configs.split(","))
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    if args.what == "check":
        if args.self_test:
            return 0 if check(head_dims, _stand_in_grads, "cpu", args.max_scores or 300 * 1000, args.only) else 1
        good = True
        for config in configs:
            print(f"== config {config}")
            good &= check(head_dims, _kernel_grads(config), "cuda", args.max_scores, args.only)
        return 0 if good else 1
    time_all(tuple(int(s) for s in args.seqlens.split(",")), head_dims, configs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
