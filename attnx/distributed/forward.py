"""The forward of one rank's queries against one K/V block: `attnx.attention` per pair, merged online.

Every (query chunk, key chunk) pair with something to compute (`schedule.pairs`) calls
`attnx.attention(..., return_lse=True)` (any backend, or the one named) with the pair's global
``offset``, so causal masks, windows and ALiBi use global positions; the partial results of a
query chunk are merged exactly through their lse, as `attnx.merge` does, in place.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..api import attention
from ..reference import accumulation_dtype
from .schedule import SOME, pairs, rows
from .sharding import Chunk
from .spec import RingSpec

INF = float("inf")


def attend_pair(spec: RingSpec, q, k, v, qc: Chunk, kc: Chunk, seen: str):
    """``(out, lse)`` of query chunk `qc` of ``q`` against key chunk `kc` of ``k``/``v`` (``bhsd``)."""
    positional = seen == SOME or spec.alibi_slopes is not None
    return attention(rows(q, qc), rows(k, kc), rows(v, kc),
                     window=(spec.window_left, spec.window_right) if seen == SOME else None,
                     offset=qc.position + spec.offset - kc.position if positional else None,
                     scale=spec.scale, softcap=spec.softcap, alibi_slopes=spec.alibi_slopes,
                     deterministic=spec.deterministic, backend=spec.backend, return_lse=True)


class Partials:
    """The running ``(out, lse)`` of each query chunk, merged in place as blocks arrive.

    ``buffers[i]`` holds chunk i's output in the accumulation dtype (for float32 inputs: a view
    of the final output itself, so merging allocates nothing of the output's size). Each block
    is merged as `attnx.merge` does, online: ``lse = logaddexp(lse, lse_b)``,
    ``out = out * exp(lse_old - lse) + out_b * exp(lse_b - lse)``.
    """

    def __init__(self, buffers: Sequence[torch.Tensor]):
        self.out = list(buffers)
        self.lse: list = [None] * len(self.out)

    def add(self, i: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        acc, old = self.out[i], self.lse[i]
        lse = lse.to(acc.dtype)
        if old is None:
            acc.copy_(out)
            self.lse[i] = lse
            return
        new = torch.logaddexp(old, lse)
        shift = new.masked_fill(new == -INF, 0.0)  # rows no block saw keep out = 0, lse = -inf
        acc.mul_((old - shift).exp_().unsqueeze(-1))
        acc.addcmul_(out.to(acc.dtype), (lse - shift).exp_().unsqueeze(-1))
        self.lse[i] = new

    def finish(self, i: int, sinks: Optional[torch.Tensor]) -> torch.Tensor:
        """Chunk i's final lse (its buffer holds the final output), with the sinks merged in.

        A sink is one more block of score ``sinks[h]`` and value zero: it only rescales.
        """
        acc = self.out[i]
        if self.lse[i] is None:  # no key of the whole sequence is visible to this chunk
            acc.zero_()
            self.lse[i] = torch.full(acc.shape[:-1], -INF, dtype=acc.dtype, device=acc.device)
        if sinks is not None:
            old = self.lse[i]
            new = torch.logaddexp(old, sinks.detach().to(acc.dtype)[None, :, None].expand(old.shape))
            shift = new.masked_fill(new == -INF, 0.0)
            acc.mul_((old - shift).exp_().unsqueeze(-1))
            self.lse[i] = new
        return self.lse[i]


def forward_block(spec: RingSpec, q, k, v, q_chunks, k_chunks, partials: Partials) -> None:
    """Add the rank's queries `q` against the K/V block `k`, `v` (chunks `k_chunks`) to `partials`."""
    for i, qc, kc, seen in pairs(spec, q_chunks, k_chunks):
        partials.add(i, *attend_pair(spec, q, k, v, qc, kc, seen))


def new_partials(q_chunks, out: torch.Tensor) -> Partials:
    """Partials accumulating into `out` (``bhsd`` view) itself, or into float32 buffers for half inputs."""
    acc = accumulation_dtype(out.dtype)
    chunks = [rows(out, c) for c in q_chunks]
    if acc != out.dtype:
        chunks = [torch.empty(t.shape, dtype=acc, device=t.device) for t in chunks]
    return Partials(chunks)


def finish(q_chunks, partials: Partials, sinks, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Write each chunk's merged result (with the sinks) into `out` (``bhsd`` view) and float32 `lse`."""
    for i, c in enumerate(q_chunks):
        lse.narrow(2, c.start, c.length).copy_(partials.finish(i, sinks))
        target = rows(out, c)
        if partials.out[i].data_ptr() != target.data_ptr():  # half inputs: float32 buffers
            target.copy_(partials.out[i])


