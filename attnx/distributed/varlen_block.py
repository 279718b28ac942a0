"""The forward and backward of a packed shard's queries against one packed K/V block.

Forward: each `varlen_calls.SubCall` is `attnx.attention(..., cu_seqlens_q=..., cu_seqlens_k=...,
return_lse=True)` on the spans it covers, merged into the shard's running ``(out, lse)`` exactly
through the lse (as `attnx.merge`). Backward: each is `attnx.attention_backward` with the
shard's **global** ``out`` and ``lse`` (a backend's own kernel, whose gradients are then the
call's share of the whole batch's), added into the accumulators; when no backend takes a given
lse (float64 by default, ``backend="naive"``), or none that does has a deterministic backward when
the call requires one, its pairs run FlashAttention's rule in torch ops
(`backward._pair_backward`, deterministic) one sequence at a time.
"""
from __future__ import annotations

import dataclasses

import torch

from ..api import attention
from ..backward_api import attention_backward
from ..errors import NoBackendError
from .backward import _pair_backward
from .varlen_calls import SubCall, VarlenSpec

INF = float("inf")


def _options(spec: VarlenSpec, call: SubCall) -> dict:
    ring = spec.ring
    return dict(cu_seqlens_q=call.cu_q, cu_seqlens_k=call.cu_k, max_seqlen_q=call.max_q, max_seqlen_k=call.max_k,
                window=call.window, offset=call.offset, scale=ring.scale, softcap=ring.softcap,
                alibi_slopes=call.alibi_slopes, deterministic=ring.deterministic, backend=ring.backend)


class Accumulator:
    """The shard's running ``out`` ``(T, Hq, Dv)`` and ``lse`` ``(T, Hq)`` in the accumulation dtype."""

    def __init__(self, out: torch.Tensor, lse: torch.Tensor):
        self.out, self.lse = out, lse  # out starts at 0, lse at -inf

    def merge(self, lo: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Merge a call's ``out`` ``(n, Hq, Dv)`` and ``lse`` ``(Hq, n)`` into rows ``[lo, lo + n)``."""
        acc, old = self.out.narrow(0, lo, out.shape[0]), self.lse.narrow(0, lo, out.shape[0])
        lse = lse.t().to(acc.dtype)
        new = torch.logaddexp(old, lse)
        shift = new.masked_fill(new == -INF, 0.0)  # rows no block saw keep out = 0, lse = -inf
        acc.mul_((old - shift).exp_().unsqueeze(-1))
        acc.addcmul_(out.to(acc.dtype), (lse - shift).exp_().unsqueeze(-1))
        old.copy_(new)

    def add_sinks(self, sinks) -> None:
        """A sink is one more key of score ``sinks[h]`` and value zero: it only rescales."""
        if sinks is None:
            return
        new = torch.logaddexp(self.lse, sinks.detach().to(self.lse.dtype)[None, :].expand_as(self.lse))
        shift = new.masked_fill(new == -INF, 0.0)
        self.out.mul_((self.lse - shift).exp_().unsqueeze(-1))
        self.lse.copy_(new)


def forward_block(spec: VarlenSpec, q, k, v, calls, acc: Accumulator) -> None:
    """Add the shard's queries `q` against the block `k`, `v` (its `calls`) into `acc`."""
    for call in calls:
        out, lse = attention(q.narrow(0, call.q_lo, call.q_n), k.narrow(0, call.k_lo, call.k_n),
                             v.narrow(0, call.k_lo, call.k_n), return_lse=True, **_options(spec, call))
        acc.merge(call.q_lo, out, lse)


class BlockBackward:
    """Add one block's share of the gradients into its dK/dV accumulators and the shard's dQ.

    ``q``, ``out``, ``dout`` ``(T, H, ...)``, ``lse`` float32 ``(Hq, T)`` (global), ``delta``
    ``(Hq, T)`` ``= rowsum(dout * out)``, ``dq`` the accumulator ``(T, Hq, D)``.
    """

    def __init__(self, spec: VarlenSpec, q, out, dout, lse, delta, dq):
        self.spec, self.q, self.out, self.dout, self.lse, self.delta, self.dq = spec, q, out, dout, lse, delta, dq
        self._on_kernel: dict = {}
        self.kernel_calls = self.torch_pairs = 0  # what ran, for tests

    def add(self, k, v, calls, dk, dv) -> None:
        for call in calls:
            key = (call.window is None, call.offset is None)
            if self._on_kernel.get(key, True):
                rows = lambda t: t.narrow(0, call.q_lo, call.q_n)  # noqa: E731
                keys = lambda t: t.narrow(0, call.k_lo, call.k_n)  # noqa: E731
                try:
                    grads = attention_backward(rows(self.q), keys(k), keys(v), rows(self.out),
                                               self.lse.narrow(1, call.q_lo, call.q_n), rows(self.dout),
                                               **_options(self.spec, call))
                except NoBackendError:
                    self._on_kernel[key] = False
                else:
                    self._on_kernel[key] = True
                    self.kernel_calls += 1
                    rows(self.dq).add_(grads[0])
                    keys(dk).add_(grads[1])
                    keys(dv).add_(grads[2])
                    continue
            for qc, kc, seen in call.pairs:
                self.torch_pairs += 1
                self._pair(k, v, qc, kc, seen, dk, dv)

    def _pair(self, k, v, qc, kc, seen, dk, dv) -> None:
        """One (query piece, key piece) pair by FlashAttention's rule in torch ops, as a dense ``(1, H, n, D)``."""
        ring = self.spec.ring
        if self.spec.per_sequence_slopes:
            ring = dataclasses.replace(ring, alibi_slopes=ring.alibi_slopes[qc.seq:qc.seq + 1])
        acc = self.dq.dtype
        dense = lambda t, c: t.narrow(0, c.start, c.length).transpose(0, 1).unsqueeze(0)  # noqa: E731
        k_d, v_d = (dense(t, kc).to(acc).contiguous() for t in (k, v))
        dk_d, dv_d = torch.zeros_like(k_d), torch.zeros_like(v_d)
        lse = self.lse.narrow(1, qc.start, qc.length).unsqueeze(0)
        delta = self.delta.narrow(1, qc.start, qc.length).unsqueeze(0)
        _pair_backward(ring, dense(self.q, qc), k_d, v_d, dense(self.dout, qc), lse, delta,
                       qc.position + ring.offset, kc.position, seen, dense(self.dq, qc), dk_d, dv_d)
        dense(dk, kc).add_(dk_d)
        dense(dv, kc).add_(dv_d)
