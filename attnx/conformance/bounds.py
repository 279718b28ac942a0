"""Error bounds (docs/semantics.md, Accuracy), in one place.

All errors are max abs errors against a float64 evaluation of the formula on the same inputs.

* float64 inputs: out <= 1e-10.
* float32 inputs: out <= 1e-4 (5e-3 for a backend that declares ``uses_tf32 = True``), OR <= 2 x the
  error of the naive backend (float32 accumulation, the contract's accumulation rule) on the same
  inputs, whichever is larger; gradients likewise (the fixed part times ``max(1, max |reference|)``,
  below). The fixed part is what float32 gives on ordinary inputs; the naive part covers inputs where
  float32 itself cannot do better: large logits (scale * |q.k| in the tens: a logit's float32
  rounding, amplified by exp, reaches 1e-4 in out) and gradients whose ``dP - delta`` cancels
  exactly (one key: the reference gradient is 0, each float32 dot product is not). The naive error
  is computed only for a quantity over its fixed bound (`NAIVE_FACTOR`, `float32_naive_bound`), and
  never for the naive backend itself, which is held to the fixed bound. lse keeps its own rule.
* float16 / bfloat16: each quantity <= 2 x the error of the naive formula on the same low-dtype
  inputs + 1e-3, where that error is the larger of (a) the formula computed in the low dtype
  (``attention_reference(..., compute_dtype=low)``, gradients by autograd), as docs/semantics.md says, and
  (b) the naive backend (float32 accumulation, the contract's accumulation rule; FlashAttention-style
  backward with ``delta = rowsum(dout * out)``). (b) matters with large logits: there (a) is often
  exactly 0 (one-hot softmax snaps in fp16), while any float32-accumulating backward, the naive
  backend included, has ~4e-3 gradient error from ``scale`` (~250) amplifying float32 rounding.
* The half-precision baseline error is at least one ulp of the largest reference value (`ulp`): a
  backend must round its result to the dtype and, like FlashAttention, rounds P (and dS) to it before
  the second matmuls (relative error 2**-11 fp16, 2**-8 bf16), so one ulp off is the ordinary outcome.
  The low-dtype formula sometimes lands on the exact value by luck (one-hot softmax at large logits,
  D = 1, one key): its error is then 0 and the bound was the 1e-3 slack, below one bf16 ulp past 0.13
  and one fp16 ulp past 1 (E1 in docs/reliability.md: cuda on the H200, fp16 out 0.00195 = one ulp of
  3.64 against 1e-3). With the floor such a result passes (bound 2 ulps + 1e-3); where the formula's
  error is already an ulp or more, nothing changes.
* Gradients in float32/float64: the out tolerance times ``max(1, max |reference gradient|)``:
  gradients (dk, dv summed over many queries, dmask) are not bounded by 1 the way ``out`` is.
* float32 inputs, past both bounds above: the float32 rounding itself (`rounding_terms`, the
  ``FLOAT32_ROUNDING_RULE``), whichever is largest. The naive backend's error is one draw of that
  rounding, and another summation order may land twice as far (the H200's compiled triton, fp32,
  2026-12-02: out 1.01e-4 at logits of ~200 where naive had < 5e-5; dk 2.2e-4 against naive's
  6.8e-5 with one key, where ``dP - delta`` cancels). For out, the logits' rounding: a float32 dot
  product of D terms and the scaling, ``err_s[i, j] = ROUNDING_C * sqrt(D) * u * scale * |q_i| . |k_j|
  + 2 u |s_ij|``, amplified by the softmax, ``sum_j P[i, j] err_s[i, j] (|v_j| + |out_i|)``
  (elementwise over Dv). On ordinary inputs (unit normal, D = 64) it is ~1e-5, below the fixed
  1e-4; at D = 256 and scale 2.9 ~1e-3. For dq, dk, dmask and dsinks, the ``dP - delta`` allowance
  below with the same formula (float32 products are not exact, which ``sqrt(n) u`` covers loosely).
  Held to every backend, the naive one included (it is not circular, unlike 2 x naive's error).
* dmask of an additive mask stored in a coarser dtype than q (a bf16 mask on float32 inputs): the
  gradient comes back in the mask's dtype (autograd returns a leaf's gradient in its dtype), so its
  rounding to that dtype is part of the result: one ulp of the mask's dtype at the largest reference
  value is added (`mask_dtype_rounding`, the ``MASK_DTYPE_RULE``; it was E3 in docs/reliability.md:
  bf16 rounding of up to 6e-3 against float32's 1e-4).
* dsinks: sinks are float32 for every input dtype, so their gradient's bound is at least 1e-6
  (times its size) also for float64 inputs.
* lse: 1e-6 (float64 inputs; lse is float32 for them), 1e-4 (float32), 1e-3 (float16/bfloat16),
  each plus ``2**-20 * max |lse|``: 16 float32 ulps, since a float32 lse cannot resolve 1e-3
  once |lse| passes 8192 (large-logit cases reach 1e4). Past that, for every input dtype but
  float64, the logits' float32 rounding through the logsumexp: ``max_i sum_j P[i, j] err_s[i, j]``
  with the ``err_s`` of the float32 rule below (`uses_rounding_alternative`). It matters only where
  ``scale * |q| . |k|`` is huge beside the logit (it was E4: the blocked backend, which scales q
  before the dot product, 0.0195 off at a logit of -1e4 where ``scale * |q| . |k|`` was 7.1e5).
* The float32 rounding of ``dP - delta`` (float16 and bfloat16 inputs; dq, dk, dmask, dsinks):
  every backward takes the difference of two float32 dot products, ``dP = dout_i . v_j`` and
  ``delta_i = dout_i . out_i``, whose rounding depends on the summation order (a tensor-core MMA
  for one, a separate sum for the other). Where they cancel (one key: exactly, the reference
  gradient is 0) a backend's error is that rounding, amplified by ``scale * |K|`` (dq) or
  ``scale * |Q|`` (dk), while the naive backend, whose two dot products may happen to round alike,
  has none (the H200's cuda fuzz finding of 2026-12-02: dq 0.0137 against the 1e-3 slack). Each of
  these gradients' bounds therefore gets an allowance (`rounding_terms`): with ``u = 2**-24``
  (float32 unit roundoff) and ``n = Dv``, in float64 from absolute values,
  ``err_dS[i, j] = ROUNDING_C * sqrt(n) * u * P[i, j] * (|dout_i| . |v_j| + |dout_i| . |out_i|)``
  with ``ROUNDING_C = 2``: rounding errors of random sign grow like ``sqrt(n) u |x| . |y|`` over a
  dot product of n terms (fp16/bf16 products are exact in float32), one term per dot product;
  the worst case ``n u`` was ~350x the errors measured on one-key problems, this is ~1e2x (D = 40),
  room left for tensor-core accumulators that truncate. The allowance is the max of
  ``scale * err_dS @ |K|`` (dq), ``scale * err_dS^T @ |Q|`` summed over a GQA group (dk),
  ``err_dS`` summed over the mask's broadcast dimensions (dmask) and ``ROUNDING_C * sqrt(n) * u *
  sum_i P_sink[i] |dout_i| . |out_i|`` per head (dsinks: delta's rounding alone). P is recomputed in
  float64 as the reference does (0 where masked; softcap's derivative factor <= 1 is left out, an
  upper bound). The allowance is added to the half-precision bound above; never to out, dv or lse
  (no cancellation there), nor to float32 inputs, whose bound already admits 2 x the naive
  backend's error and whose fixed 1e-4 it would loosen on ordinary inputs (D = 128, S = 1k causal:
  ~4e-4), nor to float64. On ordinary inputs it is ~1e-5 (unit normal, D = 64, S = 128;
  tests/test_bounds.py). It is computed only for a gradient over its bound without it (check.py).
"""
from __future__ import annotations

import math

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)
SLACK_LOW = 1e-3
LSE_ABS = {torch.float64: 1e-6, torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-3}
LSE_REL = 2.0 ** -20
NAIVE_FACTOR = 2.0  # float32: a quantity over its fixed bound passes within this times the naive backend's error
NAIVE_RULE = "2x naive"  # Result.bound_rules' label for a bound that came from the naive backend
ROUNDING_U = 2.0 ** -24  # float32 unit roundoff: dP and delta are float32 dot products in every backend
ROUNDING_C = 2.0  # times sqrt(n) u: the rounding of one float32 dot product of n terms, errors of random sign
ROUNDING_QUANTITIES = ("dq", "dk", "dmask", "dsinks")  # the gradients that go through dS = P * (dP - delta)
FLOAT32_ROUNDING_QUANTITIES = ("out", *ROUNDING_QUANTITIES)  # float32: bounded below by `rounding_terms` too
FLOAT32_ROUNDING_RULE = "float32 rounding"  # Result.bound_rules' label for a bound that came from it
MASK_DTYPE_RULE = "mask dtype rounding"  # ... for a dmask bound that includes its rounding to the mask's dtype


def high_precision_tolerance(dtype: torch.dtype, backend) -> float:
    if dtype == torch.float64:
        return 1e-10
    return 5e-3 if backend.uses_tf32 else 1e-4


def bound(name: str, dtype: torch.dtype, backend, ref: torch.Tensor, naive_low_err: float | None,
          rounding: float = 0.0) -> float:
    """The bound for quantity `name` ("out", "lse", "dq", "dk", "dv", "dmask", "dsinks"); `rounding` is
    the quantity's allowance from `rounding_terms`, added for ROUNDING_QUANTITIES of half-precision inputs."""
    finite = ref[torch.isfinite(ref)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    if name == "lse":
        return LSE_ABS[dtype] + LSE_REL * scale
    extra = rounding if name in ROUNDING_QUANTITIES and dtype in LOW_PRECISION and math.isfinite(rounding) else 0.0
    if dtype in LOW_PRECISION:
        if naive_low_err is None or not math.isfinite(naive_low_err):
            # the low-dtype naive formula overflowed: fall back to "no worse than the values' size"
            return 2 * scale + SLACK_LOW + extra
        return 2 * max(naive_low_err, ulp(dtype, scale)) + SLACK_LOW + extra
    tol = high_precision_tolerance(dtype, backend)
    if name == "dsinks":  # sinks are float32 whatever the inputs' dtype: their gradient is float32 too
        tol = max(tol, 1e-6)
    return tol if name == "out" else tol * max(1.0, scale) + extra


def mask_dtype_rounding(dtype: torch.dtype, mask_dtype: torch.dtype | None, magnitude: float) -> float:
    """What rounding dmask to the mask's dtype adds to its error: one ulp of that dtype at the largest
    reference value, when the mask's dtype is coarser than the inputs' (else 0)."""
    if mask_dtype is None or torch.finfo(mask_dtype).eps <= torch.finfo(dtype).eps:
        return 0.0
    return ulp(mask_dtype, magnitude)


def ulp(dtype: torch.dtype, value: float) -> float:
    """The spacing of `dtype`'s numbers at `value` (`value` >= 0): the least error a result of that size
    rounded to `dtype` can be said to have."""
    info = torch.finfo(dtype)
    if value < info.smallest_normal:
        return info.eps * info.smallest_normal
    return info.eps * 2.0 ** math.floor(math.log2(value))


def _max(t: torch.Tensor) -> float:
    t = torch.nan_to_num(t, nan=0.0)  # a NaN row is compared as NaN, not against the bound
    return float(t.max()) if t.numel() else 0.0


def rounding_terms(q, k, v, dout, *, scale, softcap=None, alibi_slopes=None, mask=None, window_left=None,
                   window_right=None, offset=None, sinks=None) -> dict:
    """The float32 rounding of the logits (out) and of ``dP - delta`` (gradients; module docstring) for
    one dense problem, in float64.

    ``q``, ``k``, ``v``, ``dout`` are ``(B, H, S, D)`` (GQA: fewer kv heads; ``dout`` None for a forward);
    the rest as `attnx.reference.scores` takes them. Returns {"out": max, "lse": max, and with ``dout``: "dq": max,
    "dk": max, "dS": err_dS ``(B, Hq, Sq, Sk)`` (dmask: sum it to the mask's shape), "dsinks": per-head
    sums ``(Hq,)`` or None}; the caller adds sequences' dsinks up and takes maxima. Costs about one
    float64 forward + backward.
    """
    from attnx.reference import scores

    f64 = torch.float64
    q, k, v = (t.detach().to(f64) for t in (q, k, v))
    dout = dout.detach().to(f64) if dout is not None else None
    mask = mask.detach() if mask is not None else None
    sinks = sinks.detach() if sinks is not None else None
    s = scores(q, k, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes, mask=mask, window_left=window_left,
               window_right=window_right, offset=offset, compute_dtype=f64)
    with_sink = s if sinks is None else torch.cat(
        [s, sinks.to(f64).reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    lse = torch.logsumexp(with_sink, dim=-1, keepdim=True) if with_sink.shape[-1] else \
        torch.full((*s.shape[:-1], 1), float("-inf"), dtype=f64)
    dead = lse == float("-inf")
    lse = torch.where(dead, torch.zeros_like(lse), lse)
    p = torch.where(dead, torch.zeros_like(s), torch.exp(s - lse))
    group = q.shape[1] // max(k.shape[1], 1)
    k_rep = k.repeat_interleave(group, dim=1) if group > 1 else k
    v_rep = v.repeat_interleave(group, dim=1) if group > 1 else v
    # NaN (a NaN-case key and the rows that see it) counts as 0: those places are compared as NaN
    q_abs, k_abs, v_abs = (torch.nan_to_num(t.abs(), nan=0.0) for t in (q, k_rep, v_rep))
    p = torch.nan_to_num(p, nan=0.0)
    out = p @ torch.nan_to_num(v_rep, nan=0.0)
    # out: each logit's float32 rounding (its dot product, then the scaling), through the softmax
    err_s = (ROUNDING_C * math.sqrt(q.shape[-1]) * ROUNDING_U * abs(scale) * (q_abs @ k_abs.transpose(-2, -1))
             + 2 * ROUNDING_U * torch.nan_to_num(s.abs(), nan=0.0, posinf=0.0))
    p_err = p * err_s
    # lse moves by P_ij per unit of s_ij: its rounding is the P-weighted sum of the logits' (sinks are exact)
    terms = {"out": _max(p_err @ v_abs + p_err.sum(-1, keepdim=True) * out.abs()), "lse": _max(p_err.sum(-1))}
    if dout is None:
        return terms
    dout_abs = torch.nan_to_num(dout.abs(), nan=0.0)
    delta_abs = (dout_abs * out.abs()).sum(-1, keepdim=True)    # |dout_i| . |out_i|
    dp_abs = dout_abs @ v_abs.transpose(-2, -1)                 # |dout_i| . |v_j|
    unit = ROUNDING_C * math.sqrt(v.shape[-1]) * ROUNDING_U
    err_ds = unit * p * (dp_abs + delta_abs)
    dq = scale * (err_ds @ k_abs)
    dk = scale * (err_ds.transpose(-2, -1) @ q_abs)
    if group > 1:
        dk = dk.reshape(dk.shape[0], dk.shape[1] // group, group, *dk.shape[2:]).sum(2)
    dsinks = None
    if sinks is not None:  # d sink_h = -sum_i P_sink[i] delta_i: delta's rounding alone
        p_sink = torch.where(dead, torch.zeros_like(lse), torch.exp(with_sink[..., -1:] - lse))
        dsinks = (unit * torch.nan_to_num(p_sink, nan=0.0) * delta_abs).sum(dim=(0, 2, 3))
    return {**terms, "dq": _max(dq), "dk": _max(dk), "dS": err_ds, "dsinks": dsinks}


def uses_rounding_alternative(name: str, dtype: torch.dtype) -> bool:
    """Whether quantity `name` over its bound may still pass within its float32 rounding (`rounding_terms`):
    out and the gradients through dS for float32 inputs, and lse for every input dtype but float64 (lse is
    float32 for all of them, and so is the arithmetic of its logits)."""
    if name == "lse":
        return dtype != torch.float64
    return dtype == torch.float32 and name in FLOAT32_ROUNDING_QUANTITIES


def uses_naive_float32(name: str, dtype: torch.dtype, backend_name: str) -> bool:
    """Whether quantity `name` of a float32 problem over its fixed bound may still pass within
    NAIVE_FACTOR x the naive backend's error on the same inputs (never for naive itself, nor lse)."""
    return dtype == torch.float32 and name != "lse" and backend_name != "naive"


def float32_naive_bound(fixed: float, naive_err: float | None) -> float:
    """The float32 bound once the naive backend's error is known: the larger of the fixed bound and
    NAIVE_FACTOR x that error (the fixed bound alone when the naive backend gave no finite error)."""
    if naive_err is None or not math.isfinite(naive_err):
        return fixed
    return max(fixed, NAIVE_FACTOR * naive_err)


def max_abs_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error; inf when `got` is non-finite where `ref` is finite or the infinities differ."""
    got = got.detach().to(torch.float64)
    ref = ref.detach().to(torch.float64)
    if got.shape != ref.shape:
        return math.inf
    both_finite = torch.isfinite(got) & torch.isfinite(ref)
    if not bool((torch.isfinite(got) == torch.isfinite(ref)).all()) or bool(torch.isnan(got).any()):
        return math.inf
    if not bool((got[~both_finite] == ref[~both_finite]).all()):  # -inf vs +inf
        return math.inf
    if not bool(both_finite.any()):
        return 0.0
    return float((got[both_finite] - ref[both_finite]).abs().max())
