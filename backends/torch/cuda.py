"""torch's fused NVIDIA kernels: cuDNN (``_scaled_dot_product_cudnn_attention``) and FlashAttention-2
(``_scaled_dot_product_flash_attention``), forward with logsumexp and their backward ops.

Kept to the problems both compute exactly as the contract says (`CUDA_DECLARATIONS`, what the
backend declares on CUDA): fp16/bf16, ``D == Dv``, ``D % 8 == 0``, ``D <= 256``, no mask tensor,
no window or offset, and causal only when ``Sq == Sk`` (torch's kernels disagree on the alignment
otherwise). cuDNN runs the measured winners on Hopper (`cudnn_wins`); flash the rest (it does GQA
itself).
"""
from __future__ import annotations

import functools

import torch

from attnx.autograd import alloc_out
from attnx.inputs import Grads, Inputs
from attnx.problem import Problem, length_bucket

from .masks import uses_is_causal

HALF = (torch.float16, torch.bfloat16)
CUDNN_HEAD_DIMS = (64, 128)     # measured (benchmarks/results/h200-2026-11-29)
CUDNN_MIN_SEQLEN = 512          # the shortest sequence measured; a power of two (dispatch buckets)


# What torch's fused NVIDIA kernels compute exactly as the contract says, as declarations
# (`Backend.device_declarations`); the shared reason code turns them into reasons.
CUDA_DECLARATIONS = {
    "vendors": frozenset({"nvidia"}),            # ROCm's kernels are not checked
    "dtypes": frozenset(HALF),                   # the fused kernels with logsumexp
    "max_head_dim": 256,
    "head_dim_multiple": 8,
    "mask_kinds": frozenset(),                   # a hidden NaN key would leak through an additive mask
    "supports_window": False,                    # is_causal is the only positional rule they take
    "supports_offset": False,
    "causal_needs_equal_lengths": True,          # their causal alignments differ when Sq != Sk
    "deterministic": False,                      # the fused backward is not checked bit for bit
}


def cudnn_wins(p: Problem) -> bool:
    """The problems cuDNN was measured fastest on: H200 (sm_90), fp16/bf16, MHA, D 64/128, S >= 512.

    Decided on power-of-two length buckets, so the dispatcher's rank (asked with
    `Problem.bucketed`) and the kernel that runs always agree.
    """
    return (p.arch == "sm_90" and p.dtype in HALF and p.heads_q == p.heads_kv
            and p.head_dim == p.head_dim_v and p.head_dim in CUDNN_HEAD_DIMS
            and length_bucket(min(p.seqlen_q, p.seqlen_k)) >= CUDNN_MIN_SEQLEN)


DECODE_MIN_SEQLEN_K = 2048      # the shortest cache measured (2k: benchmarks/results/h200-2026-12-03-run14, where
#                                 the cuda decode kernel ran 0.83-0.99x cuDNN at B = 1-64)


def cudnn_decodes(p: Problem) -> bool:
    """One-token decoding calls without lse that cuDNN ran fastest on the H200 (2026-12-02, bf16, d128,
    32 query / 8 kv heads, 4k-128k keys, B 1-64): 1.03-1.22x the cuda backend's decode kernel and
    1.0-2.1x SDPA's flash (benchmarks/results/h200-2026-12-02/decode-cuda-time.log); 2k keys since 2026-12-03
    (run 14: 1.01-1.21x at B = 1-64). GQA is cuDNN's own (K/V read once per kv head). Not measured, so not claimed: lse,
    several queries, d64, shorter caches."""
    return (p.arch == "sm_90" and p.dtype in HALF and not p.wants_lse and p.seqlen_q == 1
            and p.head_dim == p.head_dim_v == 128
            and length_bucket(p.seqlen_k) >= DECODE_MIN_SEQLEN_K)


def runs_cudnn(p: Problem) -> bool:
    """Whether `p` runs on cuDNN (else on FlashAttention-2)."""
    return cudnn_wins(p) or cudnn_decodes(p)


def cudnn_beats_hopper_forward(p: Problem) -> bool:
    """Forward-only problems without lse where cuDNN's forward beat the cuda backend's Hopper forward
    on the H200 (2026-12-01, bf16, SDPA-cuDNN beside attnx.cuda in one run): d64 at every length
    (1.02-1.39x) and d128 up to 4k tokens (1.0-1.1x); not d128 at 16k (0.87-0.98x). Decided from
    SDPA's numbers for the same aten call; the next paper run's dispatcher check confirms it."""
    return p.head_dim == 64 or length_bucket(min(p.seqlen_q, p.seqlen_k)) <= 4096


def cudnn_forward_wins(p: Problem) -> bool:
    """Forward-only problems where the cuDNN forward, asked for lse as this backend must, still beat triton
    on the H200 (2026-12-01, bf16, benchmarks/results/h200-2026-12-01-backward): 16k tokens (d128 580 vs
    488, d64 430 vs 411), and d128 without causal from 4k (492-508 vs 465). Below that its lse costs it
    the lead (d64 1k: 196 vs 349; d128 causal 4k: 350-368 vs 404)."""
    length = length_bucket(min(p.seqlen_q, p.seqlen_k))
    return length >= 16384 or (p.head_dim == 128 and not uses_is_causal(p) and length >= 4096)


def _kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """`t` as torch's fused kernels read it, else a contiguous copy: unit last stride, a 16-byte aligned
    start and 16-byte multiples for every other stride of a dimension longer than 1 (their vector loads:
    a sliced view with an odd offset or padded rows would fault), no broadcast (stride 0) dimension."""
    size = t.element_size()
    if t.is_contiguous() and t.data_ptr() % 16 == 0 and t.shape[-1] * size % 16 == 0:
        return t  # the common case, in one C++ call (host time counts at 1k tokens)
    if (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(n == 1 or (stride and stride * size % 16 == 0) for n, stride in zip(t.shape[:-1], t.stride()[:-1]))):
        return t
    return t.contiguous()


def _operands(x: Inputs):
    return _kernel_ready(x.q), _kernel_ready(x.k), _kernel_ready(x.v)


def _no_rng(device) -> torch.Tensor:
    # philox seed/offset: read only when dropout_p > 0, and attnx never drops out
    return torch.empty((), dtype=torch.int64, device=device)


def forward(p: Problem, x: Inputs):
    """(out, lse); lse is None when the caller does not use it (`Problem.wants_lse`): cuDNN then skips it
    and the NaN rows need no mapping (their out is NaN already)."""
    q, k, v = _operands(x)
    causal = uses_is_causal(p)
    if runs_cudnn(p):
        result = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, p.wants_lse, 0.0, causal, False, scale=p.scale)
    else:
        result = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=p.scale)
    out_k, lse_k = result[0], result[1]
    if _in_caller_layout(p, out_k):
        out = out_k  # no copy: a pass over out is not small beside cuDNN's forward at short lengths
    else:
        out = alloc_out(p, x.q)
        out.copy_(out_k)
    if not p.wants_lse:
        return out, None
    lse = lse_k.reshape(p.batch, p.heads_q, p.seqlen_q).to(torch.float32)
    return out, nan_rows_to_lse(p, q, k, lse)


def _in_caller_layout(p: Problem, out: torch.Tensor) -> bool:
    """Whether `out` ((B, H, S, Dv) view) is laid out as `alloc_out` would make it: contiguous in the
    caller's layout."""
    return (out.transpose(1, 2) if p.layout == "bshd" else out).is_contiguous()


def nan_rows_to_lse(p: Problem, q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """`lse` with NaN in every row that sees a NaN in its q row or in a visible key (only the latter when
    the caller does not receive lse, `Problem.returns_lse`: the backward's P row of a NaN q row is NaN
    from its scores, whatever its lse, so a training step reads k alone).

    The fused kernels leave such rows' lse finite (H200, 2026-12-01, flash; their out is NaN, as
    the contract says) where the contract's lse is NaN, and the backward needs it NaN. The keys a row
    sees here are all of them, or keys 0..i under causal with Sq == Sk (the only masks this path
    declares). On CUDA with Triton installed: two Triton launches (`nan_rows_triton`, measured
    cheaper); otherwise `nan_rows_by_ops`. Either way on the device, with no host synchronisation.
    """
    q_rows = p.returns_lse  # kept only for the backward: a NaN q row's probabilities are NaN anyway
    marker = _triton_marker() if lse.is_cuda else None
    if marker is None:
        return nan_rows_by_ops(p, q, k, lse, q_rows)
    lse = lse.contiguous()
    with torch.cuda.device(lse.device):  # Triton launches on the current device
        return marker(uses_is_causal(p), q, k, lse, q_rows)


@functools.cache
def _triton_marker():
    """`nan_rows_triton.mark_nan_rows`, or None where Triton is not installed (an optional extra)."""
    try:
        from .nan_rows_triton import mark_nan_rows
    except ImportError:
        return None
    return mark_nan_rows


def nan_rows_by_ops(p: Problem, q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor,
                    q_rows: bool = True) -> torch.Tensor:
    """`nan_rows_to_lse` in torch ops (any device): a running "any" over the keys a row sees (and the q
    rows' own NaN with `q_rows`)."""
    key_nan = _rows_with_nan(k)                                              # (B, Hkv, Sk)
    if p.group_size > 1:
        key_nan = key_nan.repeat_interleave(p.group_size, dim=1)
    if uses_is_causal(p):
        seen = key_nan.cumsum(-1).bool()                                      # keys 0..i, Sq == Sk
    else:
        seen = key_nan.any(-1, keepdim=True)
    return lse.masked_fill(_rows_with_nan(q) | seen if q_rows else seen, float("nan"))


def _rows_with_nan(t: torch.Tensor) -> torch.Tensor:
    """Whether each row (last dim) of `t` holds a NaN: |t| summed by a matrix-vector product keeps a NaN
    and makes none (absolute values: no inf - inf; an overflow is inf, not NaN). On the H200 it took
    66 us for a B16 H32 S1k d64 bf16 tensor where `isnan(t.amax(-1))` took 166 us
    (benchmarks/nan_rows.py, 2026-12-02): torch's last-dim max reduction reads at ~400 GB/s."""
    if t.shape[-1] == 0:
        return torch.zeros(t.shape[:-1], dtype=torch.bool, device=t.device)
    ones = torch.ones(t.shape[-1], 1, dtype=t.dtype, device=t.device)
    return torch.isnan((t.abs().reshape(-1, t.shape[-1]) @ ones).reshape(t.shape[:-1]))


def backward(p: Problem, x: Inputs, out, lse, dout) -> Grads:
    q, k, v = _operands(x)
    causal = uses_is_causal(p)
    rng = _no_rng(q.device)
    if cudnn_wins(p):
        # cuDNN wants out and dout in one layout
        dout = dout.contiguous()
        out = out.contiguous()
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.reshape(p.batch, p.heads_q, p.seqlen_q, 1).contiguous(), rng, rng, None,
            None, None, p.seqlen_q, p.seqlen_k, 0.0, causal, scale=p.scale)
    else:
        dout, out = _kernel_ready(dout), _kernel_ready(out)  # dout of a .sum() is all stride 0
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, p.seqlen_q, p.seqlen_k, 0.0, causal, rng, rng,
            scale=p.scale)
    return Grads(dq, dk, dv)


def kernel_name(p: Problem) -> str:
    """Which torch kernel runs an accepted CUDA problem `p`: "cudnn" or "flash"."""
    return "cudnn" if runs_cudnn(p) else "flash"
