"""The benchmark settings: which problem sizes each one measures.

A `Point` is one problem (sizes, dtype, causal, forward or forward+backward) and
what to measure on it ("time" or "memory"); a setting is a list of points.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
MODES = ("fwd", "fwd+bwd")
SETTINGS = ("paper", "cpu", "memory", "decode")
BACKWARD_FLOP_FACTOR = 3.5  # forward + backward = 1 + 2.5 forward passes (FlashAttention's count)


@dataclass(frozen=True)
class Point:
    """One problem to measure. Sizes follow the bhsd layout."""

    setting: str
    dtype: str
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    mode: str            # "fwd" or "fwd+bwd"
    measure: str = "time"  # "time" or "memory"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def flops(self) -> float:
        """4*B*H*Sq*Sk*D, halved for causal, x3.5 for forward+backward."""
        flops = 4.0 * self.batch * self.heads_q * self.seqlen_q * self.seqlen_k * self.head_dim
        if self.causal:
            flops /= 2
        if self.mode == "fwd+bwd":
            flops *= BACKWARD_FLOP_FACTOR
        return flops

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V: what a decode step must read at least once."""
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.batch * self.heads_kv * self.seqlen_k * self.head_dim * itemsize

    @property
    def scores(self) -> int:
        return self.batch * self.heads_q * self.seqlen_q * self.seqlen_k

    @property
    def group(self) -> tuple:
        """Points that differ only in sequence length share a group (one table block, one plot line)."""
        return (self.setting, self.dtype, self.head_dim, self.causal, self.mode, self.measure)

    def label(self) -> str:
        seq = f"S={self.seqlen_k}" if self.seqlen_q == self.seqlen_k else f"Sq={self.seqlen_q} Sk={self.seqlen_k}"
        heads = f"H={self.heads_q}" if self.heads_q == self.heads_kv else f"Hq={self.heads_q} Hkv={self.heads_kv}"
        return (f"{self.setting} {self.dtype} B={self.batch} {heads} {seq} D={self.head_dim}"
                f"{' causal' if self.causal else ''} {self.mode}")

    def as_dict(self) -> dict:
        return asdict(self)


def _pow2_range(lo: int, hi: int) -> list[int]:
    values, s = [], lo
    while s <= hi:
        values.append(s)
        s *= 2
    return values


def fixed_tokens(setting, dtype, hidden, tokens, seqlens, head_dims, measure="time", modes=MODES,
                  causals=(False, True)) -> list[Point]:
    """FlashAttention's benchmark shape: batch * S = `tokens`, heads * D = `hidden`."""
    points = []
    for head_dim in head_dims:
        heads = max(1, hidden // head_dim)
        for causal in causals:
            for mode in modes:
                for s in seqlens:
                    batch = max(1, tokens // s)
                    points.append(Point(setting, dtype, batch, heads, heads, s, s, head_dim, causal, mode, measure))
    return points


def paper(quick=False, head_dims=(64, 128), dtypes=("bf16",), seqlens=None, modes=MODES,
          causals=(False, True)) -> list[Point]:
    """FlashAttention paper: hidden 2048, 16k tokens per batch, S 512..16k, causal on/off, fwd and fwd+bwd."""
    if seqlens is None:
        seqlens = [512, 1024] if quick else _pow2_range(512, 16384)
    dims = head_dims[:1] if quick else head_dims
    return [p for dtype in dtypes
            for p in fixed_tokens("paper", dtype, 2048, 16384, seqlens, dims, modes=modes, causals=causals)]


def cpu(quick=False, head_dims=(64, 128), dtypes=("fp32",)) -> list[Point]:
    """CPU-sized: fp32, hidden 256, 8k tokens per batch, S 512..8k."""
    if quick:
        return fixed_tokens("cpu", "fp32", 128, 512, [128, 256], (64,))
    return [p for dtype in dtypes for p in fixed_tokens("cpu", dtype, 256, 8192, _pow2_range(512, 8192), head_dims)]


def memory(device: str, quick=False) -> list[Point]:
    """Peak extra memory against S: one long sequence, B=1 (GPU: bf16 H=16 D=128 to 128k; CPU: fp32 H=1 D=64 to 32k)."""
    if device == "cuda":
        seqlens = [1024, 4096] if quick else _pow2_range(1024, 131072)
        return fixed_tokens("memory", "bf16", 2048, 1, seqlens, (128,), "memory", causals=(False,))
    seqlens = [1024] if quick else _pow2_range(1024, 32768)  # quick: one fresh process per peer
    modes = ("fwd",) if quick else MODES
    return fixed_tokens("memory", "fp32", 64, 1, seqlens, (64,), "memory", modes=modes, causals=(False,))


def decode(device: str, quick=False) -> list[Point]:
    """One query token against a long KV cache, grouped-query heads (Hq=32, Hkv=8 on GPU)."""
    if device == "cuda":
        batch, heads_q, heads_kv, head_dim, dtype = 8, 32, 8, 128, "bf16"
        seqlens = [1024, 4096] if quick else _pow2_range(1024, 131072)
    else:
        batch, heads_q, heads_kv, head_dim, dtype = 1, 8, 2, 64, "fp32"
        seqlens = [512, 2048] if quick else _pow2_range(512, 32768)
    return [Point("decode", dtype, batch, heads_q, heads_kv, 1, s, head_dim, False, "fwd") for s in seqlens]


def default_settings(device: str) -> list[str]:
    return ["paper", "memory"] if device == "cuda" else ["cpu", "memory"]


def build(name: str, device: str, quick=False, head_dims=(64, 128), dtypes=None) -> list[Point]:
    """The points of setting `name` on `device` ("cuda" or "cpu")."""
    if name == "paper":
        return paper(quick, head_dims, tuple(dtypes or ("bf16",)))
    if name == "cpu":
        return cpu(quick, head_dims, tuple(dtypes or ("fp32",)))
    if name == "memory":
        return memory(device, quick)
    if name == "decode":
        return decode(device, quick)
    raise ValueError(f"unknown setting {name!r}; choose from {', '.join(SETTINGS)}")
