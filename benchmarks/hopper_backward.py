"""The Hopper (sm_90a) backward of the cuda backend: correctness, then speed, of its table and opt-in schedules.

    python -m benchmarks.hopper_backward check   # dq/dk/dv/dsinks against the float64 formula
    python -m benchmarks.hopper_backward time    # paper setting (bf16, 16k tokens) beside the Ampere
                                                 # backward on sm_90, SDPA cuDNN and SDPA flash

One device call runs both: ``check && time``; ``--configs table,CONFIG,...`` adds other configurations
(check each before timing it; `CONFIGS` below lists them): ``ordered`` is the variant whose dQ additions into
each query block follow a fixed order of key blocks (`dq_ordered`, turn counters: bitwise-deterministic dq,
what deterministic problems run): its `check`, and that of every `ORDERED` configuration, also runs every case
`RERUNS` more times on the same inputs and asserts the same bits of dq, dk, dv (and dsinks) each time.
`check` prints one numbered line per case (the worst error of each gradient beside its bound),
continues past failures, stops only when the CUDA context is lost, ends with a summary of the
failures and exits 1 on any. The bound is the one of tests/test_cuda_gpu.py: twice the error
of the formula computed from the same low-dtype inputs in that dtype and in float32, plus 1e-3.
dk and dv are poisoned with NaN before the launch. `--self-test` runs the harness on the CPU with
the float32 formula standing in for the kernel (it checks the harness, not the kernel). Each
gradient must also be within 3 % of the float64 one in relative norm (`MAX_REL_ERR`; the
harness is benchmarks/backward_check.py, shared with benchmarks/cuda_deterministic.py). Needs an
sm_90 GPU, CuPy and cuda-bindings otherwise.
"""
from __future__ import annotations

import argparse
import sys

import torch

from .backward_check import bench, bench_rounds, case_grid, check, stand_in_grads
from .cuda_deterministic import same_bits

LENGTHS = (1, 77, 128, 1000, 4096)
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
    return case_grid(head_dims, LENGTHS, FEATURES,
                     lambda sq, sk: [("lengths", {}), ("lengths causal", {"causal": True})])


# The table's tile with these fields changed: (`plain`) the schedule before DQ_LATE (each step's dQ added at its
# end), (`dqlate`) DQ_LATE without DQ_TMA (the late dQ by `red` from every thread), (`dqwriter`) DQ_TMA's adds
# made by a writer thread of the producer warpgroup (opt-in over the table: 0.97-1.01x its time, run 13)
TABLE_CHANGES = {"table": {}, "plain": {"dq_late": False, "dq_tma": False}, "dqlate": {"dq_tma": False},
                 "dqwriter": {"dq_writer": True}}
# Bitwise-deterministic configurations (their checks rerun each case): the ordered twin (DQ_WRITER since
# 2026-12-03 run 13) with these fields changed: (`orderedfence`) its turns taken by consumer thread 128 (run 12's
# twin), (`orderedred`) with `red` additions in turn (before run 12), (`orderedrot`) with DQ_ROTATE (where
# launch_sm90_bwd.rotation_applies; elsewhere the launcher runs it unrotated)
ORDERED = {"ordered": {}, "orderedfence": {"dq_writer": False}, "orderedred": {"dq_writer": False, "dq_tma": False},
           "orderedrot": {"dq_rotate": True}}
CONFIGS = (*TABLE_CHANGES, *ORDERED)
RERUNS = 2  # ORDERED: runs after the first, each compared bit for bit with it


def _variant(p, config):
    """The table's variant for `p` changed by `TABLE_CHANGES[config]`, or its deterministic twin ("ordered",
    what deterministic problems run) changed by `ORDERED[config]`; None where the table has no tile."""
    from attnx.backends.cuda.launch_sm90_bwd import backward_variant_for
    from attnx.backends.cuda.variants import ordered_twin

    v = backward_variant_for(p)
    if v is None:
        return None
    if config in ORDERED:
        return ordered_twin(v)._replace(**ORDERED[config])
    return v._replace(**TABLE_CHANGES[config])


def _same_bits_over_reruns(grads_of, reruns=RERUNS):
    """`check`'s extra check for `ordered`: `reruns` more runs on the same inputs give the first run's bits."""
    def extra(p, xv, dout_v, got):
        differ = sorted({name for _ in range(reruns) for name in same_bits(got, grads_of(p, xv, dout_v))})
        return not differ, "bits " + ("same" if not differ else "DIFFER: " + ",".join(differ))
    return extra


def _kernel_grads(config):
    """The Hopper forward, then the Hopper backward in `config` (dk/dv poisoned with NaN first)."""
    def grads(p, xv, dout_v):
        from attnx.backends.cuda import launch_sm90, launch_sm90_bwd

        out, lse = launch_sm90.forward(p, xv)
        g = launch_sm90_bwd.backward(p, xv, out, lse, dout_v, _variant(p, config), poison=True)
        return [g.dq, g.dk, g.dv, g.dsinks]
    return grads


def self_test(head_dims, max_scores, only) -> bool:
    """The harness on the CPU: the formula passes (with the `ordered` reruns' bit comparison too); a stand-in
    whose dq changes its bits from run to run fails that comparison ("plain" cases)."""
    passes = check(cases(head_dims), stand_in_grads, "cpu", max_scores, only)
    ordered = check(cases(head_dims), stand_in_grads, "cpu", max_scores, only or "plain", quiet=True,
                    extra=_same_bits_over_reruns(stand_in_grads))
    calls = [0]

    def noisy(p, xv, dout_v):  # what unordered atomics do: another last bit now and then (accuracy intact)
        found = stand_in_grads(p, xv, dout_v)
        calls[0] += 1
        if calls[0] % 2:
            dq = found[0].contiguous().clone()
            dq.view({2: torch.int16, 4: torch.int32}[dq.element_size()]).view(-1)[0] ^= 1
            found[0] = dq
        return found
    jitter = check(cases(head_dims), noisy, "cpu", max_scores, only or "plain", quiet=True,
                   extra=_same_bits_over_reruns(noisy))
    print(f"self-test: formula {'passes' if passes else 'FAILS'}; with reruns {'passes' if ordered else 'FAILS'}; "
          f"run-to-run bits {'FAIL (good)' if not jitter else 'pass (bad)'}")
    return passes and ordered and not jitter


# ---- time -------------------------------------------------------------------------------------
def _flops_fwd(b, h, s, d, causal):
    return 4 * b * h * s * s * d / (2 if causal else 1)


def time_all(seqlens, head_dims, configs=("table",), rounds=3) -> None:
    """bwd-only and fwd+bwd per kernel, one row printed as soon as it is measured. attnx rows: the Hopper
    forward and the backward timed apart (fwd+bwd = their sum; the backward configurations in `rounds` rounds
    of one each, the median kept: `bench_rounds`); SDPA rows: its own forward + backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attnx.autograd import backend_view
    from attnx.backends.cuda import launch, launch_sm90, launch_sm90_bwd
    from attnx.problem import make_call

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
                timed = bench_rounds({config: (lambda v=_variant(p, config): launch_sm90_bwd.backward(
                    p, xv, out, lse, dout, v)) for config in configs}, rounds)
                for config, hopper in timed.items():
                    found[f"sm90 bwd {config}"] = (hopper, fwd_ms + hopper)
                ampere = bench(lambda: launch.backward(p, xv, out, lse, dout))
                found["sm80 bwd on sm90 (today)"] = (ampere, fwd_ms + ampere)
                for config in sorted(ORDERED.keys() & set(configs)):  # issue 11: deterministic within 15 % of the default
                    base = launch_sm90_bwd.backward_variant_for(p)
                    table = found.get("sm90 bwd table") or (
                        bench(lambda: launch_sm90_bwd.backward(p, xv, out, lse, dout, base)),)
                    ratio = found[f"sm90 bwd {config}"][0] / table[0]
                    print(f"{d:>4} {s:>6} {causal!s:>6} {config} / table backward {ratio:.3f} (target <= 1.15)",
                          flush=True)
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
    parser.add_argument("--rounds", type=int, default=3, help="time: rounds over the configurations (median kept)")
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
            return 0 if self_test(head_dims, args.max_scores or 300 * 1000, args.only) else 1
        good = True
        for config in configs:
            print(f"== config {config}")
            grads = _kernel_grads(config)
            extra = _same_bits_over_reruns(grads) if config in ORDERED else None
            good &= check(cases(head_dims), grads, "cuda", args.max_scores, args.only, extra=extra)
        return 0 if good else 1
    time_all(tuple(int(s) for s in args.seqlens.split(",")), head_dims, configs, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
