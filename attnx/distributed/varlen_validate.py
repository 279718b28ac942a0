"""Checks of a packed (varlen) ring call, all before any K/V moves.

As the dense ring (`validate.py`): the rank's own arguments first (the varlen contract of
`attnx.attention` on the shard, whether a backend takes the calls), then one all-gather of a
signature (the ALiBi slopes' checksum included: `agreement.py`) so every rank raises when one
rank's arguments were rejected or the ranks disagree.
Then a second small all-gather of each rank's share of every sequence (its ``cu_seqlens``):
every rank learns the whole batch's cut of queries and of keys (`VarlenLayout`, one each) and
checks it is the sharding's, so every rank raises the same error when it is not.
"""
from __future__ import annotations

import operator
import zlib

import torch

from ..api import plan
from ..errors import AttnxError, InvalidArgumentError
from ..problem import make_problem
from ..registry import get_backend
from .agreement import check_named_backend
from .rule import EXCHANGES, check_kv_pieces, choose_exchange
from .sharding import check_sharding
from .spec import RingSpec
from .group import resolve_group
from .validate import (_CODES, _DTYPES, _agree, _needs_grad, _signature_device, checksums, device_code,
                       raise_on_disagreement)
from .varlen_calls import VarlenSpec
from .varlen_sharding import _layout_from_shards, read_cu_seqlens

_FIELDS = ("rejected", "packed", "device", "batch", "heads_q", "heads_kv", "head_dim", "head_dim_v", "dtype",
           "sharding", "exchange", "needs_grad", "sinks", "alibi_slopes", "kv_pieces", "options", "deterministic")


def _local(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, sharding, causal, window, offset,
           scale, softcap, alibi_slopes, sinks, layout, backend, exchange, kv_pieces, deterministic):
    """``(Problem, this rank's cu_seqlens_q and cu_seqlens_k values, one list)``: typed errors for the rank's own
    arguments, no communication."""
    p = make_problem(q, k, v, causal=causal, window=window, offset=offset, scale=scale, softcap=softcap,
                     alibi_slopes=alibi_slopes, sinks=sinks, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                     max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, layout=layout, deterministic=deterministic)
    cu = read_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q")
    cu += read_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], "k")  # as long: make_problem checked B
    check_sharding(sharding)
    if exchange not in EXCHANGES:
        raise InvalidArgumentError(f"`exchange` must be one of {', '.join(EXCHANGES)}, got {exchange!r}")
    check_kv_pieces(kv_pieces, exchange)
    if backend is not None:
        get_backend(backend)  # unknown names raise
    check_named_backend(backend, p)
    positional = p.window_left is not None or p.window_right is not None or alibi_slopes is not None
    with torch.no_grad():  # the kinds of local call the blocks make: NoBackendError now, on this rank
        kinds = [dict(window=None, offset=None, alibi_slopes=None)]
        if positional:
            band = None if p.window_left is None and p.window_right is None else (p.window_left, p.window_right)
            kinds += [dict(window=band, offset=0, alibi_slopes=alibi_slopes),
                      dict(window=band, offset=None, alibi_slopes=alibi_slopes)]
        for kind in kinds:
            plan(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, scale=p.scale, softcap=softcap,
                 backend=backend, **kind)
    return p, cu


def _signature(p, q, k, v, sinks, alibi_slopes, sharding, exchange, offset, backend, kv_pieces) -> list[int]:
    if p is None:
        return [1, 1]  # the rest is padding (`_agree`); the checksums follow
    options = repr((p.window_left, p.window_right, offset, p.scale, p.softcap, backend))
    slopes = 0 if alibi_slopes is None else alibi_slopes.dim()
    return [0, 1, device_code(q), p.batch, q.shape[1], k.shape[1], q.shape[-1], v.shape[-1], _DTYPES[q.dtype], _CODES[sharding],
            EXCHANGES.index(exchange), int(_needs_grad(q, k, v, sinks)), int(sinks is not None), slopes,
            operator.index(kv_pieces), zlib.crc32(options.encode()), int(p.deterministic)]


def check_varlen_call(q, k, v, *, group, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks, sharding,
                      causal, window, offset, scale, softcap, alibi_slopes, layout, backend,
                      exchange, kv_pieces, deterministic, own_checks=None) -> VarlenSpec:
    """The call's `VarlenSpec`, the same on every rank of the group, or a typed error on every rank.

    ``own_checks()``, if given, checks more of the rank's arguments (typed errors) before the rest.
    """
    try:
        group, rank, world_size = resolve_group(group)
    except AttnxError:  # no usable group: the rank's cheap argument checks first
        if own_checks is not None:
            own_checks()
        raise
    device = _signature_device(group) if world_size > 1 else None  # (a group of one exchanges nothing)
    p, cu, error, mine, sums = None, None, None, None, None
    try:
        if own_checks is not None:
            own_checks()
        p, cu = _local(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sharding=sharding,
                       causal=causal, window=window, offset=offset, scale=scale, softcap=softcap,
                       alibi_slopes=alibi_slopes, sinks=sinks, layout=layout, backend=backend,
                       exchange=exchange, kv_pieces=kv_pieces, deterministic=deterministic)
        if world_size > 1:
            mine = _signature(p, q, k, v, sinks, alibi_slopes, sharding, exchange, offset, backend, kv_pieces)
            sums = checksums(alibi_slopes, sinks, device)
    except Exception as e:  # noqa: BLE001 - the rank's arguments were rejected (any error): tell the others first
        p, error = None, e
    if world_size > 1:
        if error is not None:
            mine, sums = _signature(None, q, k, v, sinks, alibi_slopes, sharding, exchange, offset, backend,
                                    kv_pieces), checksums(None, None, device)
        rows = _agree(group, world_size, mine, device, *sums)
    if error is not None:
        raise error
    if world_size > 1:
        raise_on_disagreement(rows, _FIELDS, "shards of one batch")
        cus = _agree(group, world_size, cu, device, pad=False)
    else:
        cus = [cu]
    half = len(cus[0]) // 2
    layout = _layout_from_shards([cu[:half] for cu in cus], sharding, "cu_seqlens_q")
    kv_layout = _layout_from_shards([cu[half:] for cu in cus], sharding, "cu_seqlens_k")
    if kv_layout.lengths == layout.lengths:  # self-attention
        kv_layout = None
    kv_pieces = operator.index(kv_pieces)
    if exchange == "auto" and kv_pieces > 1:  # the least memory: only the ring gives it
        exchange = "ring"
    if exchange == "auto":
        row_bytes = k.shape[1] * k.shape[2] * k.element_size() + v.shape[1] * v.shape[2] * v.element_size()
        q_bytes = q.shape[1] * q.shape[2] * q.element_size() * layout.max_tokens()
        exchange = choose_exchange(world_size, q_bytes, row_bytes * (kv_layout or layout).max_tokens())
    ring = RingSpec(group=group, rank=rank, world_size=world_size, sharding=sharding, layout="varlen",
                    shard_len=layout.tokens(rank), scale=p.scale, softcap=p.softcap, window_left=p.window_left,
                    window_right=p.window_right, offset=0 if offset is None else operator.index(offset),
                    alibi_slopes=alibi_slopes, backend=backend, exchange=exchange, kv_pieces=kv_pieces,
                    deterministic=p.deterministic)
    shift = ()
    if kv_layout is not None and offset is None:  # bottom-right: each sequence's queries end with its keys
        shift = tuple(n_k - n_q for n_q, n_k in zip(layout.lengths, kv_layout.lengths))
    return VarlenSpec(ring=ring, layout=layout, kv_layout=kv_layout, query_shift=shift,
                      per_sequence_slopes=alibi_slopes is not None and alibi_slopes.dim() == 2)
