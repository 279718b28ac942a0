"""The contestants: every available attnx backend, torch SDPA with each kernel forced,
FlexAttention (compiled, CUDA only) and the plain formula in torch ops.

A `Peer` says why it skips a point (or None) and builds ``fn(q, k, v) -> out``.
Peers are rebuilt by name in the memory-probe subprocess, so `by_name` must work
in a fresh process.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import attnx

from .settings import Point

# Extra bytes per score element a score-materialising method needs at its peak
# (scores, softmax, temporaries); a rough upper bound used to skip points that would not fit.
FORWARD_SCORE_COPIES = 4
BACKWARD_SCORE_COPIES = 8


class Peer:
    """One way to compute attention, timed beside the others."""

    name = ""
    family = "torch"           # "attnx" or "torch"
    materialises_scores = False

    def skip_reason(self, point: Point, device: str) -> Optional[str]:
        return None

    def build(self, point: Point) -> Callable:
        raise NotImplementedError

    def memory_estimate(self, point: Point) -> int:
        """Rough peak extra bytes; only score-materialising peers report a nonzero estimate."""
        if not self.materialises_scores:
            return 0
        copies = BACKWARD_SCORE_COPIES if point.mode == "fwd+bwd" else FORWARD_SCORE_COPIES
        return point.scores * 4 * copies


class AttnxPeer(Peer):
    """An attnx backend forced by name, called through `attnx.attention` as a user would."""

    family = "attnx"

    def __init__(self, backend: str):
        self.backend = backend
        self.name = f"attnx.{backend}"
        self.materialises_scores = backend == "naive"

    def skip_reason(self, point, device):
        return None  # the runner asks the dispatcher (attnx.explain) for this backend's reasons

    def build(self, point):
        causal, backend = point.causal, self.backend
        return lambda q, k, v: attnx.attention(q, k, v, causal=causal, backend=backend)


def _sdpa_kernel():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return SDPBackend, sdpa_kernel


def _sdpa_call(point: Point):
    gqa = point.heads_q != point.heads_kv
    causal = point.causal
    if causal and point.seqlen_q != point.seqlen_k:
        raise ValueError("torch SDPA's is_causal is top-left aligned; attnx's is bottom-right")
    if gqa:
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)


class SdpaPeer(Peer):
    """torch.nn.functional.scaled_dot_product_attention with one kernel forced (or torch's own choice)."""

    KERNELS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
               "math": "MATH", "default": None}

    def __init__(self, kernel: str):
        self.kernel = kernel
        self.name = "torch.sdpa" if kernel == "default" else f"torch.sdpa.{kernel}"
        self.materialises_scores = kernel == "math"

    def skip_reason(self, point, device):
        if point.causal and point.seqlen_q != point.seqlen_k:
            return "is_causal is top-left aligned in torch SDPA"
        return None

    def build(self, point):
        call = _sdpa_call(point)
        if self.KERNELS[self.kernel] is None:
            return call
        backend_enum, sdpa_kernel = _sdpa_kernel()
        forced = [getattr(backend_enum, self.KERNELS[self.kernel])]

        def fn(q, k, v):
            with sdpa_kernel(forced):
                return call(q, k, v)
        return fn


class FormulaPeer(Peer):
    """softmax(q k^T * scale) v in torch ops, in the input dtype: what people write by hand."""

    name = "torch.formula"
    materialises_scores = True

    def build(self, point):
        scale = 1.0 / math.sqrt(point.head_dim)
        group = point.heads_q // point.heads_kv
        sq, sk = point.seqlen_q, point.seqlen_k

        def fn(q, k, v):
            if group > 1:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            s = (q @ k.transpose(-2, -1)) * scale
            if point.causal:  # bottom-right, as attnx
                keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
                s = s.masked_fill(~keep, float("-inf"))
            return torch.softmax(s, dim=-1) @ v
        return fn


class FlexPeer(Peer):
    """torch FlexAttention, compiled (CUDA only: on the CPU it needs a C++ toolchain and long compiles).

    Compiled with dynamic shapes by default: once per head dim, mask and mode instead of once
    per sequence length (static compiles of every point would eat most of a run's time budget).
    `FlexPeer.static_shapes = True` (``--flex-static``) compiles each shape for its best speed.
    """

    name = "torch.flex"
    static_shapes = False
    _compiled = None

    def __init__(self, seqlens=None, head_dims=None):
        """Measure only at these sequence lengths / head dims (None: all); static compiles are slow."""
        self.seqlens = None if seqlens is None else frozenset(seqlens)
        self.head_dims = None if head_dims is None else frozenset(head_dims)

    def skip_reason(self, point, device):
        if device != "cuda":
            return "FlexAttention is benchmarked on CUDA only"
        if self.seqlens is not None and point.seqlen_k not in self.seqlens:
            return "FlexAttention measured only at S in {" + ",".join(map(str, sorted(self.seqlens))) + "}"
        if self.head_dims is not None and point.head_dim not in self.head_dims:
            return "FlexAttention measured only at D in {" + ",".join(map(str, sorted(self.head_dims))) + "}"
        return None

    @classmethod
    def _flex(cls):
        if cls._compiled is None:
            import torch._dynamo.config as dynamo_config
            from torch.nn.attention.flex_attention import flex_attention

            # every new shape recompiles; the default limit (8) would fall back to slow eager code
            for option in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                           "accumulated_cache_size_limit"):
                try:
                    setattr(dynamo_config, option, 1024)
                except (AttributeError, KeyError):
                    pass
            cls._compiled = torch.compile(flex_attention, dynamic=not cls.static_shapes)
        return cls._compiled

    def build(self, point):
        from torch.nn.attention.flex_attention import create_block_mask

        flex = self._flex()
        block_mask = None
        if point.causal:
            offset = point.seqlen_k - point.seqlen_q

            def bottom_right(b, h, q_idx, kv_idx):
                return kv_idx <= q_idx + offset
            block_mask = create_block_mask(bottom_right, None, None, point.seqlen_q, point.seqlen_k, device="cuda")
        gqa = point.heads_q != point.heads_kv
        return lambda q, k, v: flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)


def attnx_backend_names() -> list[str]:
    """Every registered backend available on this machine, in registration order."""
    return [entry["name"] for entry in attnx.list_backends() if entry["available"]]


def all_peers(device: str) -> list[Peer]:
    """attnx backends first, then torch's methods for this device."""
    peers: list[Peer] = [AttnxPeer(name) for name in attnx_backend_names()]
    if device == "cuda":
        peers += [SdpaPeer("flash"), SdpaPeer("efficient"), SdpaPeer("cudnn"), SdpaPeer("math"), FlexPeer()]
    else:
        peers += [SdpaPeer("default"), FormulaPeer()]
    return peers


def by_name(name: str, device: str) -> Peer:
    for peer in all_peers(device):
        if peer.name == name:
            return peer
    raise ValueError(f"no peer named {name!r} on {device}")
