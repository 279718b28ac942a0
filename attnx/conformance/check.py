"""Run one case on one backend through the public API and compare it with the float64 oracle."""
from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

import attnx
from attnx.autograd import sum_to_shape
from attnx.reference import attention_reference

from . import formats
from .bounds import (FLOAT32_ROUNDING_QUANTITIES, FLOAT32_ROUNDING_RULE, LOW_PRECISION, MASK_DTYPE_RULE,
                     NAIVE_RULE, ROUNDING_QUANTITIES, bound, float32_naive_bound, mask_dtype_rounding,
                     max_abs_error, rounding_terms, uses_naive_float32, uses_rounding_alternative)
from .cases import DTYPES, Case
from .inputs import Inputs, make_inputs

GRAD_NAMES = ("q", "k", "v", "mask", "sinks")
# groups where a backend declaring `deterministic = True` is also run twice and compared bit for bit
DETERMINISM_GROUPS = ("base", "gqa", "mask_grad")


@dataclass
class Result:
    """What happened to one case: status "pass", "fail", "declined", or "ran" (calls only, no oracle)."""

    case: Case
    backend: str
    device: str
    status: str = "pass"
    reasons: list = field(default_factory=list)     # the backend's reasons when it declined
    failures: list = field(default_factory=list)    # what went wrong, one line each
    errors: dict = field(default_factory=dict)      # quantity -> max abs error
    bounds: dict = field(default_factory=dict)      # quantity -> bound
    naive_low: dict = field(default_factory=dict)   # quantity -> error of the formula computed in the low dtype
    naive_acc32: dict = field(default_factory=dict)  # quantity -> error of the naive backend (float32 accumulation)
    bound_rules: dict = field(default_factory=dict)  # quantity -> NAIVE_RULE, FLOAT32_ROUNDING_RULE or MASK_DTYPE_RULE
    magnitudes: dict = field(default_factory=dict)  # quantity -> max |finite reference value|
    scale: Optional[float] = None
    seconds: float = 0.0
    rounding: dict = field(default_factory=dict)    # quantity -> float32 rounding allowance (bounds.py),
    #                                                 computed once a quantity is over its bound without it

    def fail(self, message: str) -> None:
        self.status = "fail"
        self.failures.append(message)

    def summary(self) -> str:
        if self.status == "declined":
            return "declined: " + "; ".join(self.reasons)
        # (a quantity whose bound was never set: the check raised after measuring it; the failure says why)
        parts = [f"{n} {self.errors[n]:.3g}<=" + (f"{self.bounds[n]:.3g}" if n in self.bounds else "?")
                 + (f" ({self.bound_rules[n]})" if n in self.bound_rules else "") for n in self.errors]
        text = ", ".join(parts)
        return f"{self.status}: {text}" + ("" if not self.failures else " | " + " | ".join(self.failures))

    def as_dict(self) -> dict:
        def num(x):
            return x if math.isfinite(x) else str(x)
        return {"id": self.case.id, "case": self.case.as_dict(), "backend": self.backend, "device": self.device,
                "status": self.status, "reasons": self.reasons, "failures": self.failures,
                "errors": {k: num(v) for k, v in self.errors.items()},
                "bounds": {k: num(v) for k, v in self.bounds.items()},
                "naive_low_errors": {k: num(v) for k, v in self.naive_low.items()},
                "naive_acc32_errors": {k: num(v) for k, v in self.naive_acc32.items()},
                "bound_rules": dict(self.bound_rules),
                "magnitudes": {k: num(v) for k, v in self.magnitudes.items()},
                "rounding_allowances": {k: num(v) for k, v in self.rounding.items()},
                "scale": self.scale, "seconds": round(self.seconds, 4)}


def _to_bhsd(case: Case, t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2) if case.layout == "bshd" else t


def _call_kwargs(case: Case, inputs: Inputs, views: dict) -> dict:
    return dict(causal=case.causal, window=case.window, offset=case.offset, mask=views.get("mask"),
                scale=inputs.scale, softcap=case.softcap, alibi_slopes=inputs.alibi_slopes, sinks=views.get("sinks"),
                layout=case.layout, **inputs.index)


def _reference(case: Case, q, k, v, mask, alibi, sinks, scale: float, compute_dtype):
    left, right = case.window if case.window is not None else (None, None)
    if case.causal:
        right = 0 if right is None else min(right, 0)
    return attention_reference(q, k, v, scale=scale, softcap=case.softcap, alibi_slopes=alibi, mask=mask,
                               window_left=left, window_right=right, offset=case.offset, sinks=sinks,
                               compute_dtype=compute_dtype)


def _formula(case: Case, inputs: Inputs, views: dict, scale: float, compute_dtype, dout) -> tuple:
    """(out in the case's layout or format, lse, {name: grad of each view}, rows that see no key)."""
    with torch.enable_grad() if dout is not None else torch.no_grad():
        if inputs.packing is None:
            q, k, v = (_to_bhsd(case, views[n]) for n in ("q", "k", "v"))
            out, lse = _reference(case, q, k, v, views.get("mask"), inputs.alibi_slopes, views.get("sinks"), scale,
                                  compute_dtype)
            out = _to_bhsd(case, out)
        else:
            outs, lses = [], []
            for b, (q, k, v) in enumerate(formats.unpack(case, inputs.packing, views)):
                alibi = inputs.alibi_slopes
                if alibi is not None and alibi.dim() == 2:
                    alibi = alibi[b:b + 1]
                o, l = _reference(case, q, k, v, None, alibi, views.get("sinks"), scale, compute_dtype)
                outs.append(o)
                lses.append(l)
            out, lse = formats.pack_outputs(case, outs, lses, views)
        grads = {}
        if dout is not None:
            out.backward(dout.to(out.dtype))
            grads = {n: views[n].grad for n in GRAD_NAMES if n in views and views[n].requires_grad}
    dead = torch.isneginf(lse)
    if case.sinks:  # a sink keeps lse finite: rows that see no key are those whose lse is the sink's alone
        with torch.no_grad():
            plain = _formula(replace(case, sinks=False, grad=False), inputs,
                             {n: t for n, t in views.items() if n != "sinks"}, scale, compute_dtype, None)
        dead = plain[3]
    return out.detach(), lse.detach(), grads, dead


def _rounding_allowances(case: Case, inputs: Inputs, views: dict, scale: float) -> dict:
    """{quantity: its `rounding_terms` allowance (bounds.py)} from the float64 views: out and lse, and the
    ROUNDING_QUANTITIES that the case has when it has gradients; {} for float64 cases."""
    if case.torch_dtype == torch.float64:
        return {}
    dout = inputs.dout.detach() if case.grad else None
    kw = dict(softcap=case.softcap, sinks=views.get("sinks"))
    left, right = case.window if case.window is not None else (None, None)
    if case.causal:
        right = 0 if right is None else min(right, 0)
    kw.update(window_left=left, window_right=right, offset=case.offset)
    if inputs.packing is None:
        q, k, v = (_to_bhsd(case, views[n]) for n in ("q", "k", "v"))
        dout = _to_bhsd(case, dout) if dout is not None else None
        parts = [rounding_terms(q, k, v, dout, scale=scale, alibi_slopes=inputs.alibi_slopes, mask=views.get("mask"),
                                **kw)]
    else:
        sequences = formats.unpack(case, inputs.packing, views)
        douts = ([d[0] for d in formats.unpack(case, inputs.packing, {"q": dout, "k": views["k"], "v": views["v"]})]
                 if dout is not None else [None] * len(sequences))
        parts = []
        for b, (q, k, v) in enumerate(sequences):
            alibi = inputs.alibi_slopes
            if alibi is not None and alibi.dim() == 2:
                alibi = alibi[b:b + 1]
            parts.append(rounding_terms(q, k, v, douts[b], scale=scale, alibi_slopes=alibi, **kw))
    terms = {n: max((t[n] for t in parts), default=0.0) for n in ("out", "lse")}
    if dout is None:
        return terms
    terms.update(dq=max((t["dq"] for t in parts), default=0.0), dk=max((t["dk"] for t in parts), default=0.0))
    if case.mask_grad and "mask" in views:
        mask = views["mask"]
        err = parts[0]["dS"]
        dims = tuple(range(err.dim() - mask.dim()))  # leading dimensions the mask does not have
        err = sum_to_shape(err.sum(dims) if dims else err, tuple(mask.shape))
        terms["dmask"] = float(err.max()) if err.numel() else 0.0
    if case.sinks:
        sums = [t["dsinks"] for t in parts if t["dsinks"] is not None]
        terms["dsinks"] = float(torch.stack(sums).sum(0).max()) if sums and sums[0].numel() else 0.0
    return {n: t for n, t in terms.items() if n in FLOAT32_ROUNDING_QUANTITIES or n == "lse"}


def _errors(out, grads: dict, ref_out, ref_grads: dict) -> dict:
    errors = {"out": max_abs_error(out, ref_out)}
    errors.update({f"d{n}": max_abs_error(g, ref_grads[n]) if g is not None else math.inf for n, g in grads.items()})
    return errors


def _naive_backend_outputs(case: Case, inputs: Inputs, twin, dout) -> Optional[tuple]:
    """(out, {name: grad}) of the naive backend (the formula with float32 accumulation, the contract's
    accumulation rule) on fresh copies of the same inputs; None when it is not registered."""
    if "naive" not in attnx.registered_backends():
        return None
    _, views = twin(None, case.grad)
    out = attnx.attention(views["q"], views["k"], views["v"], **_call_kwargs(case, inputs, views), backend="naive")
    grads = {}
    if dout is not None:
        out.backward(dout)
        grads = {n: views[n].grad for n in GRAD_NAMES if n in views and views[n].requires_grad}
    return out.detach(), grads


def _naive_backend_errors(case: Case, inputs: Inputs, twin, dout, ref_out, ref_grads: dict) -> dict:
    """Errors of the naive backend on the same low-precision inputs: the second half of the
    low-precision baseline."""
    naive = _naive_backend_outputs(case, inputs, twin, dout)
    return {} if naive is None else _errors(naive[0], naive[1], ref_out, ref_grads)


def _naive_float32_errors(case: Case, inputs: Inputs, twin, dout, refs: dict) -> dict:
    """Errors of the naive backend on the same float32 inputs against `refs` ({quantity: reference as the
    oracle gave it, NaN included}): the other half of the float32 bound. A NaN row of the reference
    counts as 0 where naive is NaN too (as `_check_nan_rows` does for the backend); a NaN anywhere
    else is an infinite error, so no bound is loosened by it. A naive backend that raises gives no
    errors (the fixed bound stands)."""
    try:
        naive = _naive_backend_outputs(case, inputs, twin, dout)
    except Exception:  # noqa: BLE001 - no baseline: the fixed bound applies
        return {}
    if naive is None:
        return {}
    got = {"out": naive[0]}
    got.update({f"d{n}": g for n, g in naive[1].items()})
    errors = {}
    for name, ref in refs.items():
        g = got.get(name)
        if g is None:
            continue
        nan_ref = torch.isnan(ref).to(g.device)
        if not torch.equal(torch.isnan(g), nan_ref):
            errors[name] = math.inf
            continue
        zero = torch.zeros((), dtype=g.dtype, device=g.device)
        errors[name] = max_abs_error(torch.where(nan_ref, zero, g), torch.where(nan_ref.to(ref.device),
                                                                                   torch.zeros_like(ref), ref))
    return errors


def _poison(device, numel: int) -> None:
    """Leave NaN in memory the allocator will hand out next, so unwritten outputs show up."""
    if numel:
        junk = torch.full((numel,), float("nan"), device=device)
        del junk


def declined_reasons_kind(backend, p) -> str:
    """"extra" when the decline comes from extra_reasons alone (the declarations accept)."""
    try:
        extra = set(backend.extra_reasons(p))
    except Exception:  # noqa: BLE001 - a crashing extra_reasons is reported by the caller
        extra = set()
    reasons = backend.reasons(p)
    return "extra" if reasons and set(reasons) <= extra else "declarations"


def run_case(backend_name: str, case: Case, device, *, allow_extra_declines: bool = False,
             calls_only: bool = False) -> Result:
    """Run `case` on `backend_name` on `device`; never raises for a backend's failure.

    `calls_only`: make the backend's calls (forward, backward, the layout and input checks) and stop
    before the float64 oracle, status "ran": for compute-sanitizer, which instruments every kernel
    of the process, the oracle's matmuls included, and spends most of a case's time in them."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # outputs report cuda:N; compare like with like
        device = torch.device("cuda", torch.cuda.current_device())
    result = Result(case, backend_name, str(device))
    start = time.perf_counter()
    try:
        _run(result, backend_name, case, device, allow_extra_declines, calls_only)
    except Exception as err:  # noqa: BLE001 - a crash is a failure of the case
        tb = traceback.format_exception(type(err), err, err.__traceback__)
        result.fail(f"raised {type(err).__name__}: {err}".strip() + "\n" + "".join(tb[-3:]))
    result.seconds = time.perf_counter() - start
    return result


def _run(result: Result, backend_name: str, case: Case, device, allow_extra_declines: bool,
         calls_only: bool = False) -> None:
    backend = attnx.get_backend(backend_name)
    inputs, twin = make_inputs(case, device)
    views = inputs.views
    kwargs = _call_kwargs(case, inputs, views)
    p = attnx.make_problem(views["q"], views["k"], views["v"], **kwargs)
    result.scale = p.scale
    reasons = [] if p.is_empty else backend.reasons(p)  # zero-size problems never reach a backend
    if reasons:
        result.reasons = list(reasons)
        if declined_reasons_kind(backend, p) == "extra" and not allow_extra_declines:
            result.fail("declined a case its declarations support: " + "; ".join(reasons))
        else:
            result.status = "declined"
        return
    snapshot = {n: t.detach().clone() for n, t in inputs.leaves.items()}
    out_numel = max(1, case.batch * case.heads_q * case.seqlen_q * max(case.head_dim, case.head_dim_v))

    # -- the backend, through the public API ----------------------------------------------
    _poison(device, out_numel)
    out, lse = attnx.attention(views["q"], views["k"], views["v"], **kwargs, backend=backend_name, return_lse=True)
    grads = {}
    if case.grad:
        _poison(device, out_numel)
        out.backward(inputs.dout)
        grads = {n: views[n].grad for n in GRAD_NAMES if n in views and views[n].requires_grad}
    _check_layout(result, case, inputs, out, lse, grads, views, device)
    if backend.declarations(p.device_classes).deterministic and case.group in DETERMINISM_GROUPS:
        _check_deterministic(result, backend_name, case, device, out, grads)
    for name, leaf in inputs.leaves.items():
        if not torch.equal(torch.nan_to_num(leaf.detach()), torch.nan_to_num(snapshot[name])):
            result.fail(f"input {name} was modified")
    if calls_only:
        if result.status == "pass":
            result.status = "ran"
        return

    # -- the oracle: float64 copies of the same inputs ------------------------------------
    _, views64 = twin(torch.float64, case.grad)
    ref_out, ref_lse, ref_grads, dead = _formula(case, inputs, views64, p.scale, torch.float64, inputs.dout)
    low = {}
    if case.torch_dtype in LOW_PRECISION:
        _, views_low = twin(None, case.grad)
        low_out, _, low_grads, _ = _formula(case, inputs, views_low, p.scale, case.torch_dtype, inputs.dout)
        result.naive_low = _errors(low_out, low_grads, ref_out, ref_grads)
        result.naive_acc32 = _naive_backend_errors(case, inputs, twin, inputs.dout, ref_out, ref_grads)
        low = {n: max(e, result.naive_acc32.get(n, 0.0)) for n, e in result.naive_low.items()}

    quantities = {"out": (out, ref_out), "lse": (lse, ref_lse)}
    quantities.update({f"d{n}": (grads.get(n), ref_grads[n]) for n in ref_grads})
    refs = {name: ref for name, (_, ref) in quantities.items()}  # before NaN rows are zeroed
    if case.nan:
        quantities = _check_nan_rows(result, quantities)
    naive32 = None  # float32: the naive backend's errors, computed for the first quantity over its fixed bound
    rounding = None  # the rounding allowances of dP - delta, computed for the first gradient over its bound
    for name, (got, ref) in quantities.items():
        if got is None:
            result.fail(f"{name} missing (no gradient reached the input)")
            continue
        result.errors[name] = err = max_abs_error(got, ref)
        finite = ref[torch.isfinite(ref)]
        result.magnitudes[name] = float(finite.abs().max()) if finite.numel() else 0.0
        b = bound(name, case.torch_dtype, backend, ref, low.get(name))
        if not err <= b and math.isfinite(err) and name in ROUNDING_QUANTITIES and case.torch_dtype in LOW_PRECISION:
            if rounding is None:
                rounding = result.rounding = _rounding_allowances(case, inputs, views64, p.scale)
            b = bound(name, case.torch_dtype, backend, ref, low.get(name), rounding.get(name, 0.0))
        if not err <= b and math.isfinite(err) and uses_naive_float32(name, case.torch_dtype, backend_name):
            if naive32 is None:
                naive32 = result.naive_acc32 = _naive_float32_errors(case, inputs, twin, inputs.dout, refs)
            fixed, b = b, float32_naive_bound(b, naive32.get(name))
            if b > fixed:
                result.bound_rules[name] = NAIVE_RULE
        if not err <= b and math.isfinite(err) and uses_rounding_alternative(name, case.torch_dtype):
            if rounding is None:
                rounding = result.rounding = _rounding_allowances(case, inputs, views64, p.scale)
            if rounding.get(name, 0.0) > b:
                b = rounding[name]
                result.bound_rules[name] = FLOAT32_ROUNDING_RULE
        if not err <= b and math.isfinite(err) and name == "dmask" and case.mask_dtype:
            extra = mask_dtype_rounding(case.torch_dtype, DTYPES[case.mask_dtype], result.magnitudes[name])
            if extra > 0:
                b += extra
                result.bound_rules[name] = MASK_DTYPE_RULE
        result.bounds[name] = b
        if not err <= b:
            result.fail(f"{name} error {err:.3g} > bound {b:.3g}")
    _check_dead_rows(result, case, inputs, out, lse, grads, dead)


def _check_nan_rows(result: Result, quantities: dict) -> dict:
    """NaN exactly where the oracle is NaN (never a quiet zero); the rest compared as usual."""
    kept = {}
    for name, (got, ref) in quantities.items():
        if got is None:
            kept[name] = (got, ref)
            continue
        nan_ref = torch.isnan(ref)
        if not bool(nan_ref.any()) and name in ("out", "lse"):
            result.fail(f"case design error: no NaN reached {name}")
        if not torch.equal(torch.isnan(got.detach().cpu()), nan_ref.cpu()):
            result.fail(f"{name} is NaN at {int(torch.isnan(got).sum())} places, the formula at {int(nan_ref.sum())}")
        zero = torch.zeros((), dtype=ref.dtype, device=ref.device)
        kept[name] = (torch.where(nan_ref.to(got.device), zero.to(got.dtype).to(got.device), got.detach()),
                      torch.where(nan_ref, zero, ref))
    return kept


def _check_deterministic(result: Result, backend_name: str, case: Case, device, out, grads) -> None:
    """A second run on fresh copies of the same inputs must give bitwise equal `out` and gradients: what a
    backend declaring ``deterministic = True`` promises (docs/usage.md, "Deterministic gradients"). lse is
    not compared: it is not differentiable and no gradient reads the caller's copy, and the naive
    backend's float32 lse on a CPU once came out one bit apart between two runs (CI, 2026-12-02; out and
    every gradient equal; not reproduced in 500 local reruns: BLAS kernels may sum in another order for
    another alignment of fresh inputs)."""
    again, _ = make_inputs(case, device)
    views = again.views
    out2, _ = attnx.attention(views["q"], views["k"], views["v"], **_call_kwargs(case, again, views),
                              backend=backend_name, return_lse=True)
    pairs = {"out": (out, out2)}
    if case.grad:
        out2.backward(again.dout)
        pairs.update({f"d{n}": (g, views[n].grad) for n, g in grads.items()})
    for name, (first, second) in pairs.items():
        if second is None or not torch.equal(torch.nan_to_num(first), torch.nan_to_num(second)):
            result.fail(f"{name} differs between two runs (the backend declares deterministic = True)")


def _expected_shapes(case: Case, inputs: Inputs) -> tuple[tuple, tuple]:
    if inputs.packing is not None:
        return formats.out_shape(case, inputs.packing), formats.lse_shape(case, inputs.packing)
    out = ((case.batch, case.heads_q, case.seqlen_q, case.head_dim_v) if case.layout == "bhsd"
           else (case.batch, case.seqlen_q, case.heads_q, case.head_dim_v))
    return out, (case.batch, case.heads_q, case.seqlen_q)


def _check_layout(result: Result, case: Case, inputs: Inputs, out, lse, grads: dict, views: dict, device) -> None:
    """Shapes, dtypes, devices and the caller's layout of every output."""
    want, want_lse = _expected_shapes(case, inputs)
    if tuple(out.shape) != want or out.dtype != case.torch_dtype or out.device != device:
        result.fail(f"out is {tuple(out.shape)} {out.dtype} on {out.device}, expected {want} {case.torch_dtype}")
    elif not out.is_contiguous():
        result.fail(f"out is not contiguous in the caller's layout (strides {out.stride()})")
    if tuple(lse.shape) != want_lse or lse.dtype != torch.float32:
        result.fail(f"lse is {tuple(lse.shape)} {lse.dtype}, expected {want_lse} float32")
    for name, g in grads.items():
        if g is not None and (g.shape != views[name].shape or g.dtype != views[name].dtype):
            result.fail(f"d{name} is {tuple(g.shape)} {g.dtype}, expected {tuple(views[name].shape)} {views[name].dtype}")


def _rows(case: Case, inputs: Inputs, t: torch.Tensor) -> torch.Tensor:
    """An output or dq in the lse's row order: (B, Hq, Sq, D) dense, (Hq, total_q, D) varlen."""
    if inputs.packing is not None and case.q_format == "varlen":
        return t.transpose(0, 1)
    return _to_bhsd(case, t)


def _check_dead_rows(result: Result, case: Case, inputs: Inputs, out, lse, grads: dict, dead) -> None:
    """Rows that see no key: out exactly 0, lse exactly -inf (the sink with sinks), dq exactly 0."""
    if case.masked_rows and not bool(dead.any()):
        result.fail("case design error: masked_rows case has no fully masked row")
    if not bool(dead.any()):
        return
    dead = dead.to(lse.device)
    if case.sinks:
        sink = inputs.views["sinks"].detach().float()
        expected = sink.reshape(-1, 1).expand_as(lse) if lse.dim() == 2 else sink.reshape(1, -1, 1).expand_as(lse)
        if not bool(((lse - expected).abs() <= 1e-5 * (1 + expected.abs()))[dead].all()):
            result.fail("lse is not the sink on rows that see no key")
    elif not bool(torch.isneginf(lse[dead]).all()):
        result.fail("lse is not -inf on rows that see no key")
    if not bool((_rows(case, inputs, out)[dead] == 0).all()):
        result.fail("out is not exactly 0 on rows that see no key")
    dq = grads.get("q")
    if dq is not None and not bool((_rows(case, inputs, dq)[dead] == 0).all()):
        result.fail("dq is not exactly 0 on rows that see no key")
