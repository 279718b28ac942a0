"""Huge problems (issue #13 item 5): S = 1M tokens, tensors past 2**31 elements, grids past CUDA's limits.

    python -m benchmarks.huge [--backends cuda,triton] [--scale full|small] [--out DIR] [--max-seconds N]
    python -m benchmarks.huge --backends blocked --device cpu --scale small    # the logic, on the CPU

One row per (problem, mode, backend), run through `attnx.attention(q, k, v, causal=..., backend=name,
return_lse=True)`: ok, declined (the reasons `attnx.explain` gives), skipped, or FAIL (a wrong value,
memory above the limit, any exception: an invalid-configuration launch is a FAIL, never a pass).

* long / long causal: B = H = 1, S = 2**20, D = 128, bf16, forward and forward+backward. No S x S
  reference: 64 query rows spread over S (first and last included) against every key, and dout
  nonzero on those rows only, so their dq, dq = 0 on every other row, and dk, dv (sums over those
  rows alone) are exact from the 64 rows. Peak memory must stay a constant times S*D (`MEMORY_LIMIT`).
* wide-heads / wide-batch: q, k, v, dout each 2**31 + 65536 elements (B=1, H=32769 or B=32769, H=1;
  S=512, D=128): the last head's (batch's) offset h * stride (b * stride) is 2**31 elements, out's
  too; B*H <= 65535 keeps triton in. lse has B*H*S = 2**24 elements: no shape that fits in 139 GiB
  takes its index past 2**31. Checked on whole (b, h) slices: first, middle, the first whose offset
  passes 2**31, last.
* grid-bh: B*H = 70000 (> gridDim.y's 65535), S = 16, D = 64; grid-edge: B*H = 65535 exactly (triton's
  limit: must run), S = 576 (a partial last tile), D = 64, 2.4e9 elements a tensor. Each runs
  correctly or is declined with a reason. (cuda's 1-D grid of B*H*ceil(S/128) blocks cannot pass 2**31 - 1
  in 139 GiB.)

Errors: a float64 reference of the checked rows (keys in chunks) on inputs with q ~ N(0, 3^2) (`Q_STD`:
peaked rows); the bound is attnx/conformance/bounds.py's: twice the error of the same rows computed in
bf16 and in float32 (the larger), plus 1e-3 (lse: 1e-3 + 16 float32 ulps), and beside it
benchmarks/backward_check.py's relative-norm guard (3 %). Time: `timing.time_cuda`'s median where a
call is cheap, else the synchronized wall time of the one measured call (after a warm-up call that
compiles/autotunes). Memory: `memory.measure_cuda`'s peak beyond what was allocated before the call,
in units of one q tensor; not measured on the CPU. Full scale on an H200: ~30 s of kernels for the
cuda backend and as much for triton, plus triton's autotuning at S = 2**20 (~1 min); rows that would
end past `--max-seconds` (default 140 at full scale) are "skipped: time" (400 runs everything).
Exit status 1 on any FAIL row.
"""
from __future__ import annotations

import argparse
import json
import math
import time
import traceback
from pathlib import Path
from typing import NamedTuple

import torch

import attnx
from attnx.conformance.bounds import bound, max_abs_error

from .backward_check import MAX_REL_ERR, context_alive, rel_err
from .memory import measure_cuda
from .timing import time_cuda

DTYPE = torch.bfloat16
SAMPLE_ROWS = 64
KEY_CHUNK = 1 << 16      # float64 reference: 64 rows x 65536 keys = 32 MiB a score tile
# Peak extra memory in units of one q tensor (S*D*2 bytes for `long`); bounded by a constant = linear in S.
# forward: out (1), lse (1/64 at D=128), a padded copy of out where a kernel needs one (1): under 3.
# forward+backward: out (1); dq, dk, dv (3); a float32 dq accumulator (2); lse, delta (< 0.1); the
# float32 temporaries of rowsum(dout * out) (up to 3, gone before the accumulator exists): under 10.
# Any S x S term at S = 2**20 would be 2**19 units.
MEMORY_LIMIT = {"fwd": 3.0, "fwd+bwd": 10.0}
CHEAP_S = 0.05           # calls estimated faster than this get time_cuda's median of repeats
GPU_FLOPS = 300e12       # a conservative H200 bf16 rate, for the --max-seconds estimates only
GPU_BYTES_S = 2e12
# triton autotunes its dense kernels on the first call of a shape this large (backends/triton/launch.py:
# two candidates a kernel, ~8 timed runs each): that warm-up costs ~16 calls, the others' one
WARMUP_CALLS = {"triton": 16}
NAMES = ("out", "lse", "dq", "dk", "dv")
# q ~ N(0, 3^2): logits of spread 3 put each row's weight on ~S*e^-9 keys (~100 at S = 2**20). With
# N(0, 1) logits every weight at S = 2**20 is ~1e-6 and out ~1e-3: under the bound's 1e-3 slack, so
# out = 0 would pass. Peaked rows keep out, dq, dk, dv O(0.1..1), as in trained models.
Q_STD = 3.0


class Shape(NamedTuple):
    name: str
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    causal: bool
    modes: tuple
    sampled: bool        # True: SAMPLE_ROWS rows of the one head, dout zero elsewhere; False: whole slices


def shapes(scale: str) -> list:
    both, bwd = ("fwd", "fwd+bwd"), ("fwd+bwd",)
    if scale == "full":
        s, (wh, ws, wd), (bh, bs, bd), (eh, es, ed) = 1 << 20, (32769, 512, 128), (70000, 16, 64), (65535, 576, 64)
    else:  # CPU-sized stand-ins with the same structure (grids past 2**16 still, as they are cheap)
        s, (wh, ws, wd), (bh, bs, bd), (eh, es, ed) = 4096, (5, 64, 32), (65537, 4, 16), (65535, 8, 16)
    # cheap and headline problems first, so a --max-seconds cut drops the long non-causal ones
    return [Shape("long causal", 1, 1, s, 128, True, both, True),
            Shape("grid-bh", bh, 1, bs, bd, False, bwd, False),
            Shape("wide-heads", 1, wh, ws, wd, False, bwd, False),
            Shape("wide-batch", wh, 1, ws, wd, True, bwd, False),
            Shape("grid-edge", 1, eh, es, ed, True, bwd, False),
            Shape("long", 1, 1, s, 128, False, both, True)]


def describe(sh: Shape) -> str:
    return f"B={sh.batch} H={sh.heads} S={sh.seqlen} D={sh.head_dim}{' causal' if sh.causal else ''}"


def estimate_s(sh: Shape, mode: str) -> float:
    """Seconds one call should take on an H200 (for --max-seconds): flops or bytes, whichever dominates."""
    flops = 4.0 * sh.batch * sh.heads * sh.seqlen ** 2 * sh.head_dim * (0.5 if sh.causal else 1.0)
    tensors = 2 if mode == "fwd" else 10
    return (flops * (3.5 if mode == "fwd+bwd" else 1.0)) / GPU_FLOPS + tensors * q_bytes(sh) / GPU_BYTES_S


def q_bytes(sh: Shape) -> int:
    return sh.batch * sh.heads * sh.seqlen * sh.head_dim * DTYPE.itemsize


def checked(sh: Shape, device) -> list:
    """(b, h, query rows) whose results are checked."""
    if sh.sampled:
        rows = (torch.arange(SAMPLE_ROWS, device=device) * (sh.seqlen - 1) // (SAMPLE_ROWS - 1)).unique()
        return [(0, 0, rows)]
    n, span = sh.batch * sh.heads, sh.seqlen * sh.head_dim
    past = min(n - 1, -(-(1 << 31) // span))  # the first slice that starts at or past element 2**31
    rows = torch.arange(sh.seqlen, device=device)
    return [(*divmod(i, sh.heads), rows) for i in sorted({0, n // 2, past, n - 1})]


def make_inputs(sh: Shape, device) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    grads = "fwd+bwd" in sh.modes

    def rand():
        return torch.randn(sh.batch, sh.heads, sh.seqlen, sh.head_dim, generator=gen, device=device, dtype=DTYPE)
    q, k, v = rand().mul_(Q_STD), rand(), rand()
    for t in (q, k, v):
        t.requires_grad_(grads)
    dout = rand()
    if sh.sampled:  # dout only on the sampled rows: their gradients are then exact from them alone
        keep = torch.zeros(sh.seqlen, dtype=DTYPE, device=device)
        keep[checked(sh, device)[0][2]] = 1
        dout.mul_(keep[:, None])
    return {"q": q, "k": k, "v": v, "dout": dout}


def rows_reference(q, k, v, dout, pos, causal, scale, dtype, chunk):
    """out, lse, dq of query rows q (R, D) at key positions `pos` against k, v (Sk, D), and dk, dv when
    dout (R, D) is the only upstream gradient (None: forward only); computed in `dtype` (lse and
    exponents in float32 at least, as attention_reference does) over `chunk` keys at a time. Two
    passes (lse, then the rest) keep chunking exact; one chunk is the plain formula in `dtype`."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    do = None if dout is None else dout.to(dtype)
    spans = [(j, min(j + chunk, k.shape[0])) for j in range(0, k.shape[0], chunk)]

    def scores(j0, j1):
        s = ((q @ k[j0:j1].T) * scale).to(wide)
        if causal:  # Sq == Sk: key j is seen by the query at position p iff j <= p
            s = s.masked_fill(torch.arange(j0, j1, device=q.device)[None, :] > pos[:, None], -math.inf)
        return s
    lse = torch.full((q.shape[0],), -math.inf, dtype=wide, device=q.device)
    for j0, j1 in spans:
        lse = torch.logaddexp(lse, torch.logsumexp(scores(j0, j1), -1))
    out = torch.zeros(q.shape[0], v.shape[1], dtype=dtype, device=q.device)
    for j0, j1 in spans:
        out += torch.exp(scores(j0, j1) - lse[:, None]).to(dtype) @ v[j0:j1]
    if dout is None:
        return out, lse
    delta = (do * out).sum(-1, keepdim=True)
    dq, dk, dv = torch.zeros_like(q), torch.empty_like(k), torch.empty_like(v)
    for j0, j1 in spans:
        p = torch.exp(scores(j0, j1) - lse[:, None]).to(dtype)
        ds = p * (do @ v[j0:j1].T - delta)
        dq += ds @ k[j0:j1]
        dk[j0:j1] = (ds.T @ q) * scale
        dv[j0:j1] = p.T @ do
    return out, lse, dq * scale, dk, dv


def check(res: dict, x: dict, sh: Shape, backend) -> dict:
    """name -> (err, bound, relative norm error) of the worst checked slice, per quantity the call made;
    relative error (backward_check's guard, MAX_REL_ERR) beside the max-error bound."""
    scale, worst = sh.head_dim ** -0.5, {}
    for b, h, rows in checked(sh, x["q"].device):
        dout = x["dout"][b, h, rows] if "dq" in res else None
        args = (x["q"][b, h, rows].detach(), x["k"][b, h].detach(), x["v"][b, h].detach(), dout, rows,
                sh.causal, scale)
        ref = rows_reference(*args, torch.float64, KEY_CHUNK)
        lows = [rows_reference(*args, dt, sh.seqlen) for dt in (DTYPE, torch.float32)]
        got = [res["out"][b, h, rows], res["lse"][b, h, rows]]
        if "dq" in res:
            got += [res["dq"][b, h, rows], res["dk"][b, h], res["dv"][b, h]]
        for i, g in enumerate(got):
            # (the references are finite where this runs: every row sees a key; NaN falls back in `bound`)
            low_err = max(float((lo[i].to(ref[i].dtype) - ref[i]).abs().max()) for lo in lows)
            err = max_abs_error(g, ref[i])
            if NAMES[i] == "dq" and sh.sampled:  # rows without dout must get exactly zero
                others = torch.ones(sh.seqlen, dtype=torch.bool, device=rows.device)
                others[rows] = False
                stray = float(res["dq"][b, h][others].float().abs().max()) if bool(others.any()) else 0.0
                err = max(err, stray if math.isfinite(stray) else math.inf)
            limit = bound(NAMES[i], DTYPE, backend, ref[i], low_err)
            rel = rel_err(g, ref[i]) if math.isfinite(err) else math.inf
            old = worst.get(NAMES[i])
            if old is None or not max(err / limit, rel / MAX_REL_ERR) <= max(old[0] / old[1], old[2] / MAX_REL_ERR):
                worst[NAMES[i]] = (err, limit, rel)
    return worst


def run_one(sh: Shape, mode: str, name: str, x: dict, device: str) -> dict:
    grads = mode == "fwd+bwd"
    q, k, v = x["q"], x["k"], x["v"]
    opts = dict(causal=sh.causal, backend=name, return_lse=True)
    with torch.set_grad_enabled(grads):
        why = attnx.explain(q, k, v, **opts).reasons.get(name)
    if why:
        return {"status": "declined: " + "; ".join(why)}
    res: dict = {}

    def call(_i):
        res.clear()
        q.grad = k.grad = v.grad = None  # (a second backward would add to the first's)
        with torch.set_grad_enabled(grads):
            out, lse = attnx.attention(q, k, v, **opts)
            if grads:
                out.backward(x["dout"])
        res.update(out=out.detach(), lse=lse)
        if grads:
            res.update(dq=q.grad, dk=k.grad, dv=v.grad)
    row, timing = {}, None
    if device == "cuda":
        if estimate_s(sh, mode) < CHEAP_S:
            timing = time_cuda(call, budget_s=0.3)
        else:
            call(0)  # compile / autotune / first allocations, outside the measured call
        res.clear()
        q.grad = k.grad = v.grad = None
        extra, seconds = measure_cuda(call)
        row["extra_x_q"] = extra / q_bytes(sh)
    else:
        start = time.perf_counter()
        call(0)
        seconds = time.perf_counter() - start
    row["ms"] = timing.median_ms if timing else seconds * 1e3
    row["reps"] = timing.reps if timing else 1
    worst = check(res, x, sh, attnx.get_backend(name))
    row["errors"] = {n: list(e) for n, e in worst.items()}
    bad = [f"{n} {e:.1e} > {b:.1e}" if not e <= b else f"{n} relative error {r:.0e} > {MAX_REL_ERR}"
           for n, (e, b, r) in worst.items() if not (e <= b and r <= MAX_REL_ERR)]
    if row.get("extra_x_q", 0.0) > MEMORY_LIMIT[mode]:
        bad.append(f"peak {row['extra_x_q']:.2f} x q above {MEMORY_LIMIT[mode]}")
    row["status"] = "FAIL: " + "; ".join(bad) if bad else "ok"
    res.clear()
    return row


def first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}"


def check_text(row: dict) -> str:
    errs = row.get("errors")
    if not errs:
        return ""
    n, (e, b, r) = max(errs.items(), key=lambda item: item[1][0] / item[1][1])
    return f"worst {n} {e:.1e}/{b:.1e} (rel {r:.0e})"


def format_row(r: dict) -> list:
    mem = f"{r['extra_x_q']:.2f}" if "extra_x_q" in r else "-"
    ms = f"{r['ms']:.1f}" + (f" (x{r['reps']})" if r.get("reps", 1) > 1 else "") if "ms" in r else "-"
    return [r["problem"], r["shape"], r["mode"], r["backend"], r["status"], ms, mem, check_text(r)]


HEAD = ["problem", "shape", "mode", "backend", "status", "ms", "peak extra / q", "error / bound"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="cuda,triton")
    parser.add_argument("--scale", choices=("full", "small"), default="full")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="write DIR/huge.md and DIR/huge.json")
    parser.add_argument("--max-seconds", type=float, default=None, help="default: 140 at full scale, none at small")
    args = parser.parse_args(argv)
    limit_s = args.max_seconds if args.max_seconds is not None else (140.0 if args.scale == "full" else None)
    start, rows, names = time.monotonic(), [], []
    known = {b["name"]: b for b in attnx.list_backends()}
    for name in args.backends.split(","):
        info = known.get(name, {"available": False, "reasons": ["not a registered backend"]})
        if info["available"]:
            names.append(name)
        else:
            print(f"{name}: skipped: {'; '.join(info['reasons'])}", flush=True)
            rows.append(dict(problem="-", shape="-", mode="-", backend=name,
                             status="skipped: " + "; ".join(info["reasons"])))
    lost = False
    for sh in shapes(args.scale):
        todo = [(mode, name) for mode in sh.modes for name in names]
        base = [dict(problem=sh.name, shape=describe(sh), mode=mode, backend=name) for mode, name in todo]
        try:
            x = make_inputs(sh, args.device) if todo and not lost else None
        except Exception as err:  # out of memory for the inputs themselves: a row each, go on
            x = None
            for r in base:
                r["status"] = f"FAIL: inputs: {first_line(err)}"
        for r in base:
            elapsed = time.monotonic() - start
            if "status" in r:
                pass
            elif lost:
                r["status"] = "skipped: CUDA context lost"
            elif limit_s is not None and elapsed + (1 + WARMUP_CALLS.get(r["backend"], 1)) * estimate_s(
                    sh, r["mode"]) > limit_s:
                r["status"] = "skipped: time"
            else:
                try:
                    r.update(run_one(sh, r["mode"], r["backend"], x, args.device))
                except Exception as err:  # torch.cuda.OutOfMemoryError included: a FAIL row, not a crash
                    traceback.print_exc()
                    r["status"] = f"FAIL: {first_line(err)}"
                    lost = args.device == "cuda" and not context_alive()
                finally:
                    for t in (x["q"], x["k"], x["v"]):
                        t.grad = None
                    if args.device == "cuda":
                        torch.cuda.empty_cache()
            rows.append(r)
            print(" | ".join(format_row(r)), flush=True)
        del x
    table = [HEAD, ["---"] * len(HEAD)] + [format_row(r) for r in rows]
    text = "\n".join("| " + " | ".join(line) + " |" for line in table)
    print("\nhuge problems:\n" + text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        meta = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), device=device, scale=args.scale,
                    backends=args.backends, torch=torch.__version__, attnx=attnx.__version__,
                    seconds=round(time.monotonic() - start, 1), memory_limit_x_q=MEMORY_LIMIT)
        (out / "huge.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (out / "huge.md").write_text(f"# attnx huge problems ({args.scale}, {device}, {meta['date']})\n\n"
                                     f"`python -m benchmarks.huge --backends {args.backends} --scale {args.scale}`"
                                     f", {meta['seconds']} s; what each problem checks: the docstring of "
                                     f"benchmarks/huge.py.\n\n{text}\n")
    return 1 if any(r["status"].startswith("FAIL") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
