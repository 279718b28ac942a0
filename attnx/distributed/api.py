"""`ring_attention`: exact attention over a sequence sharded across the ranks of a process group."""
from __future__ import annotations

from ..errors import InvalidArgumentError
from .allgather import AllGatherAttention
from .ring import RingAttention
from .ring_pieces import PiecedRingAttention
from .validate import check_call, check_return_lse
from .varlen_ring import VarlenAllGatherAttention, VarlenRingAttention
from .varlen_ring_pieces import VarlenPiecedRingAttention
from .varlen_validate import check_varlen_call


def ring_attention(q, k, v, *, group=None, sharding="zigzag", causal=False, window=None, offset=None, scale=None,
                   softcap=None, alibi_slopes=None, sinks=None, layout="bhsd", backend=None, exchange="auto",
                   kv_pieces=1, deterministic=None, return_lse=False, cu_seqlens_q=None, cu_seqlens_k=None,
                   max_seqlen_q=None, max_seqlen_k=None):
    """This rank's shard of exact attention over a sequence sharded across `group` (context parallelism).

    Every rank of `group` calls it at the same time with its shard of one sequence of
    ``S = P * S_local`` tokens (``P`` ranks), cut as `sharding` says (`attnx.distributed.shard`
    makes the shards). Dense shards: queries and keys are the same tokens (self-attention), so
    q, k and v shards hold the same ``S_local`` rows (packed shards may differ, below).

    Args:
        q, k, v: the rank's shards, ``(B, Hq, S_local, D)``, ``(B, Hkv, S_local, D)``,
            ``(B, Hkv, S_local, Dv)`` (``layout="bhsd"``) or ``(B, S_local, H, D)`` (``"bshd"``);
            ``Hq % Hkv == 0``.
        group: the ``torch.distributed`` process group (None: the default group).
        sharding: ``"zigzag"`` (rank r holds chunks r and 2P-1-r of 2P: balanced for causal
            masks; ``S_local`` even) or ``"contiguous"`` (rank r holds the r-th of P pieces).
        causal, window, scale, softcap, alibi_slopes, sinks: as in `attnx.attention`, over
            **global** positions: global query g sits at ``p_g = g + offset`` and sees global
            key j iff the causal/window rules allow it; ALiBi adds ``-slope * |p_g - j|``.
        offset: aligned position of global query 0; None is 0 (queries and keys are the
            same tokens: bottom-right and top-left agree).
        backend: the attnx backend for every block (None: the dispatcher chooses per block).
        exchange: ``"ring"`` (K/V travel around the ring), ``"allgather"`` (every rank gathers
            the whole K/V once) or ``"auto"``: `attnx.distributed.choose_exchange` (the ring
            when ``kv_pieces > 1``).
        kv_pieces: the ring's K/V blocks (and in the backward their dK/dV) travel in this many
            pieces, each all the way round the ring before the next leaves: a rank then holds
            two pieces of other ranks' K/V instead of two blocks, so its peak memory falls as
            1/P from one rank on. Transfers still overlap compute, piece by piece; the cost is
            ``kv_pieces`` times as many messages and local calls, each that much smaller.
            1 (the default): whole blocks. 8 suits long sequences (docs/distributed.md,
            "Memory per rank"). Not with ``exchange="allgather"``.
        deterministic: as in `attnx.attention`, for every block's backward: None (default) follows
            ``torch.use_deterministic_algorithms``; True requires a deterministic backward (a named
            `backend` whose backward is not raises `attnx.NoBackendError` on every rank; the
            dispatcher skips such backends, or the ring's own torch-ops rule runs the block);
            False never overrides torch's switch. The ring merges blocks and adds dK/dV in a fixed
            order, so with deterministic blocks the gradients are bitwise identical run to run
            (``exchange="allgather"``: as far as the process group's reduce-scatter is). Fixed at
            the forward; every rank must require it alike.
        return_lse: also return ``lse``, float32 ``(B, Hq, S_local)`` (not differentiable).
        cu_seqlens_q, cu_seqlens_k: packed (varlen) shards: q ``(Tq_rank, Hq, D)``, k and v
            ``(Tk_rank, Hkv, D)`` hold this rank's piece(s) of every sequence of the batch, one
            sequence after the other, and int32 ``(B + 1,)`` ``cu_seqlens`` say how many rows of
            each sequence (`attnx.distributed.shard_varlen` cuts queries and keys so, each by
            its own ``cu_seqlens``). Every sequence is aligned on its own global positions:
            bottom-right (its queries are the last ``Sq_b`` of its ``Sk_b`` key positions) or
            ``offset``, as in `attnx.attention`; ``lse`` is ``(Hq, Tq_rank)``; ``layout`` is unused.
            ``max_seqlen_q``/``max_seqlen_k`` are checked as in `attnx.attention` and
            otherwise unused (the ring reads ``cu_seqlens`` on the host: one sync per call).

    Returns:
        ``out``, this rank's rows of the output, in q's dtype and layout; or ``(out, lse)``.

    Gradients reach q, k, v (this rank's shards: dK/dV travel back around the ring, so each is
    the gradient of the loss summed over every rank) and ``sinks`` (this rank's share, like any
    replicated parameter's: sum over the group, as DDP/FSDP do, for the full gradient).
    Every rank must call backward. Typed errors (`attnx.InvalidArgumentError`,
    `attnx.InvalidTypeError`, `attnx.NoBackendError`) are raised before any K/V moves, on
    every rank when any rank's arguments are rejected or the ranks disagree (the values of
    ``alibi_slopes`` included: a checksum of them travels with the signature the ranks compare).

    Equivalent PyTorch (``full`` gathers a sequence from every rank's shard)::

        full = lambda t: attnx.distributed.gather(t, group=group, sharding=sharding)
        out = attnx.attention(full(q), full(k), full(v), causal=causal, window=window,
                              offset=0 if offset is None else offset, ...)
        attnx.distributed.shard(out, rank, P, sharding=sharding)

    and for packed shards (``full`` = `attnx.distributed.gather_varlen`, which also returns the
    whole batch's ``cu``)::

        (q_all, cu_q), (k_all, cu_k), (v_all, _) = full(q, cu_seqlens_q), full(k, cu_seqlens_k), full(v, cu_seqlens_k)
        out = attnx.attention(q_all, k_all, v_all, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal, ...)
        attnx.distributed.shard_varlen(out, cu_q, rank, P, sharding=sharding)[0]
    """
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None

    def own_checks():  # checked with the rest of the rank's arguments, so every rank raises (validate.py)
        check_return_lse(return_lse)
        if packed:
            return
        for name, given in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if given is not None:
                raise InvalidArgumentError(f"`{name}` describes packed shards (`cu_seqlens_q`/`cu_seqlens_k`); "
                                           f"this call has none (got {name}={given!r})")

    if packed:
        spec = check_varlen_call(q, k, v, group=group, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, sinks=sinks,
                                 sharding=sharding, causal=causal, window=window, offset=offset, scale=scale,
                                 softcap=softcap, alibi_slopes=alibi_slopes, layout=layout, backend=backend,
                                 exchange=exchange, kv_pieces=kv_pieces, deterministic=deterministic,
                                 own_checks=own_checks)
        function = VarlenAllGatherAttention
        if spec.ring.exchange == "ring":
            pieced = spec.ring.kv_pieces > 1 and spec.ring.world_size > 1
            function = VarlenPiecedRingAttention if pieced else VarlenRingAttention
        out, lse = function.apply(spec, q, k, v, sinks)
        return (out, lse) if return_lse else out
    spec = check_call(q, k, v, group=group, sinks=sinks, own_checks=own_checks, sharding=sharding, causal=causal,
                      window=window, offset=offset, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
                      layout=layout, backend=backend, exchange=exchange, kv_pieces=kv_pieces,
                      deterministic=deterministic)
    function = AllGatherAttention
    if spec.exchange == "ring":  # one rank: nothing travels, pieces or not
        function = PiecedRingAttention if spec.kv_pieces > 1 and spec.world_size > 1 else RingAttention
    out, lse = function.apply(spec, q, k, v, sinks)
    return (out, lse) if return_lse else out
