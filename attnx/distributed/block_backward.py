"""The backward of the rank's queries against one K/V block, added into the block's dK/dV accumulators.

Each (query chunk, key chunk) pair runs `attnx.attention_backward` with the **global** ``out``
and ``lse`` of the rank's rows and the pair's global ``offset``: the backend's own backward
kernel (the dispatcher's choice, or the backend named), whose dQ/dK/dV of the pair are its
share of the whole sequence's gradients. When no backend takes a given lse for a pair (float64
inputs; a named backend, like ``naive``, that recomputes its own softmax normaliser:
`attnx.Backend.backward_uses_given_lse`), or none that does has a deterministic backward when the
call requires one (``spec.deterministic``), that pair runs the same rule in torch ops
(`backward.backward_block`: fixed order, deterministic).

Each pair is cut into pieces of about ``1 / PIECES`` of its query rows and key columns (at least
``MIN_PIECE_ROWS`` each): with the global lse any piece's gradients are exact on their own, so
a backend's per-call outputs and scratch (dQ, dK, dV of the call, its float32 accumulators)
stay a fraction of a chunk, pieces wholly outside the causal/window band are skipped and pieces
wholly inside it run unmasked.
"""
from __future__ import annotations

from ..backward_api import attention_backward
from ..errors import NoBackendError
from .backward import backward_block
from .schedule import SOME, pairs, rows
from .sharding import Chunk
from .spec import RingSpec

# pieces per chunk, each way, and the fewest rows of a piece. Measured on a 2-core CPU (fp32, D = 64,
# S = 16k, benchmarks/ring_memory.py): quarters keep the backend's per-call outputs and scratch to a
# few MiB of the peak; eighths saved 4 MiB more (of 70) for twice the calls.
PIECES = 4
MIN_PIECE_ROWS = 512


def pieces(chunks) -> list:
    """`chunks` cut into consecutive pieces of ``max(MIN_PIECE_ROWS, ceil(length / PIECES))`` rows."""
    cut = []
    for c in chunks:
        size = max(MIN_PIECE_ROWS, -(-c.length // PIECES))
        cut += [Chunk(c.start + a, c.position + a, min(size, c.length - a)) for a in range(0, c.length, size)]
    return cut


class BlockBackward:
    """The rank's side of the backward: ``add`` one K/V block's share into its dK/dV accumulators.

    ``q``, ``out``, ``dout`` are the rank's ``bhsd`` views, ``lse`` the global float32 lse,
    ``delta = rowsum(dout * out)`` (for the torch-ops rule) and ``dq`` the rank's dQ accumulator.
    """

    def __init__(self, spec: RingSpec, q, out, dout, lse, delta, dq):
        self.spec, self.q, self.out, self.dout, self.lse, self.delta, self.dq = spec, q, out, dout, lse, delta, dq
        self.q_chunks = spec.chunks(spec.rank)
        self._on_kernel: dict = {}  # (visibility, offset) -> whether a backend takes the given lse
        self.kernel_pairs = self.torch_pairs = 0  # what ran, for tests and docs

    def computes(self, k_chunks) -> bool:
        """Whether the block of `k_chunks` has anything to compute for this rank's queries."""
        return any(True for _ in pairs(self.spec, self.q_chunks, k_chunks))

    def add(self, k, v, k_chunks, dk, dv) -> None:
        """Add this rank's queries' gradients against the block `k`, `v` to `dk`, `dv` and the rank's dQ."""
        spec = self.spec
        for _, qc, kc, seen in pairs(spec, pieces(self.q_chunks), pieces(k_chunks)):
            positional = seen == SOME or spec.alibi_slopes is not None
            offset = qc.position + spec.offset - kc.position if positional else None
            key = (seen, offset)
            if self._on_kernel.get(key, True):
                try:
                    grads = attention_backward(
                        rows(self.q, qc), rows(k, kc), rows(v, kc), rows(self.out, qc),
                        self.lse.narrow(2, qc.start, qc.length), rows(self.dout, qc),
                        window=(spec.window_left, spec.window_right) if seen == SOME else None, offset=offset,
                        scale=spec.scale, softcap=spec.softcap, alibi_slopes=spec.alibi_slopes,
                        deterministic=spec.deterministic, backend=spec.backend)
                except NoBackendError:
                    self._on_kernel[key] = False
                else:
                    self._on_kernel[key] = True
                    self.kernel_pairs += 1
                    rows(self.dq, qc).add_(grads[0])
                    rows(dk, kc).add_(grads[1])
                    rows(dv, kc).add_(grads[2])
                    del grads
                    continue
            self.torch_pairs += 1
            backward_block(spec, self.q, k, v, self.dout, self.lse, self.delta, (qc,), (kc,), self.dq, dk, dv)

