"""Checks of a ring call, all before any K/V moves.

1. The process group (`group.resolve_group`): raised at once, nothing can be exchanged without it.
2. The rank's own arguments: the contract of `attnx.attention` on the shard (`attnx.make_problem`),
   the ring's own options, and whether the backend accepts every block this rank will compute
   (and, when the backward must be deterministic, a named backend's backward: `agreement.py`).
3. One small all-gather of each rank's signature: when a rank's arguments were rejected, or the
   ranks disagree (dense or packed shards, device type, shapes, dtype, options, whether the
   backward must be deterministic, the ALiBi slopes' and the sinks' values, whether gradients
   are needed), every rank raises, so no rank is left waiting in the ring. Dense and packed
   calls send signatures of one length (`SIGNATURE_INTS` ints, then the two checksums), so
   ranks that disagree even on that meet in the same all-gather and raise.
"""
from __future__ import annotations

import operator
import zlib
from typing import Optional

import torch
import torch.distributed as dist

from ..api import plan
from ..errors import AttnxError, InvalidArgumentError, InvalidTypeError
from ..problem import make_problem
from ..registry import get_backend
from .agreement import check_named_backend, slopes_checksum
from .schedule import SOME, pairs
from .group import resolve_group, signature_device
from .kv_pieces import kv_pieces as cut_pieces
from .rule import EXCHANGES, check_kv_pieces, choose_exchange
from .sharding import check_shard_length, check_sharding
from .spec import RingSpec

# every signature, dense or packed, is this many ints (zero padded), then the slopes' and sinks' checksums
SIGNATURE_INTS = 24
CHECKSUMS = ("alibi_slopes values", "sinks values")
_FIELDS = ("rejected", "packed", "device", "batch", "heads_q", "heads_kv", "shard length", "head_dim", "head_dim_v",
           "dtype", "layout", "sharding", "exchange", "needs_grad", "sinks", "alibi_slopes", "kv_pieces", "options",
           "deterministic")
_CODES = {"bhsd": 0, "bshd": 1, "zigzag": 0, "contiguous": 1, "ring": 0, "allgather": 1}
_DTYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
_DEVICE_TYPES = {"cpu": 0, "cuda": 1, "meta": 2}


def device_code(t: torch.Tensor) -> int:
    """A number for the type of `t`'s device (not its index: ranks hold their own GPUs)."""
    kind = t.device.type
    return _DEVICE_TYPES.get(kind, 3 + zlib.crc32(kind.encode()) % 1000)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _check_backend_accepts(spec: RingSpec, q, k, v) -> None:
    """Ask the dispatcher (`attnx.plan`) about every distinct block this rank will compute: NoBackendError now."""
    asked = set()
    q_chunks = spec.chunks(spec.rank)
    if spec.kv_pieces > 1 and spec.world_size > 1:
        blocks = [piece.chunks(spec, src) for piece in cut_pieces(spec) for src in range(spec.world_size)]
    else:
        blocks = [spec.chunks(src) for src in range(spec.world_size)]
    with torch.no_grad():  # blocks run inside the autograd Function, without grad
        for k_chunks in blocks:
            for _, qc, kc, seen in pairs(spec, q_chunks, k_chunks):
                positional = seen == SOME or spec.alibi_slopes is not None
                offset = qc.position + spec.offset - kc.position if positional else None
                if (seen, offset) in asked:
                    continue
                asked.add((seen, offset))
                plan(q.narrow(2, qc.start, qc.length), k.narrow(2, kc.start, kc.length),
                     v.narrow(2, kc.start, kc.length), window=(spec.window_left, spec.window_right)
                     if seen == SOME else None, offset=offset, scale=spec.scale, softcap=spec.softcap,
                     alibi_slopes=spec.alibi_slopes, backend=spec.backend)


def local_spec(q, k, v, group, rank, world_size, *, sharding, causal, window, offset, scale, softcap,
               alibi_slopes, sinks, layout, backend, exchange, kv_pieces, deterministic) -> RingSpec:
    """The rank's checked `RingSpec` (typed errors for its own arguments; no communication)."""
    p = make_problem(q, k, v, causal=causal, window=window, offset=offset, scale=scale, softcap=softcap,
                     alibi_slopes=alibi_slopes, sinks=sinks, layout=layout, deterministic=deterministic)
    if p.seqlen_q != p.seqlen_k:
        raise InvalidArgumentError(f"q, k and v shards must hold the same tokens: q has {p.seqlen_q} rows, "
                                   f"k and v {p.seqlen_k}")
    check_shard_length(p.seqlen_q, check_sharding(sharding))
    if exchange not in EXCHANGES:
        raise InvalidArgumentError(f"`exchange` must be one of {', '.join(EXCHANGES)}, got {exchange!r}")
    kv_pieces = check_kv_pieces(kv_pieces, exchange)
    if backend is not None:
        get_backend(backend)  # unknown names raise
    check_named_backend(backend, p)
    if exchange == "auto" and kv_pieces > 1:  # the least memory: only the ring gives it
        exchange = "ring"
    if exchange == "auto":
        kv_bytes = k.numel() * k.element_size() + v.numel() * v.element_size()
        exchange = choose_exchange(world_size, q.numel() * q.element_size(), kv_bytes)
    spec = RingSpec(group=group, rank=rank, world_size=world_size, sharding=sharding, layout=layout,
                    shard_len=p.seqlen_q, scale=p.scale, softcap=p.softcap, window_left=p.window_left,
                    window_right=p.window_right, offset=0 if offset is None else operator.index(offset),
                    alibi_slopes=alibi_slopes, backend=backend, exchange=exchange, kv_pieces=kv_pieces,
                    deterministic=p.deterministic)
    bhsd = [t.transpose(1, 2) if layout == "bshd" else t for t in (q, k, v)]
    _check_backend_accepts(spec, *bhsd)
    return spec


def _signature(spec: Optional[RingSpec], q, k, v, sinks) -> list[int]:
    if spec is None:
        return [1, 0]  # the rest is padding (`_agree`); the checksums follow
    options = repr((spec.window_left, spec.window_right, spec.offset, spec.scale, spec.softcap, spec.backend))
    heads = 1 if spec.layout == "bhsd" else 2
    return [0, 0, device_code(q), q.shape[0], q.shape[heads], k.shape[heads], spec.shard_len, q.shape[-1],
            v.shape[-1], _DTYPES[q.dtype], _CODES[spec.layout], _CODES[spec.sharding], _CODES[spec.exchange],
            int(_needs_grad(q, k, v, sinks)), int(sinks is not None), int(spec.alibi_slopes is not None),
            spec.kv_pieces, zlib.crc32(options.encode()),
            int(spec.deterministic)]


def _agree(group, world_size: int, mine: list[int], device, *extra: torch.Tensor,
           pad: bool = True) -> list[list[int]]:
    """Every rank's signature `mine` (host ints, zero padded to `SIGNATURE_INTS` unless ``pad=False``)
    followed by `extra` int64 tensors already on `device`."""
    if pad:
        mine = list(mine) + [0] * (SIGNATURE_INTS - len(mine))
    t = torch.tensor(mine, dtype=torch.int64, device=device)
    if extra:
        t = torch.cat([t, *extra])
    gathered = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(gathered, t, group=group)
    return [g.tolist() for g in gathered]


def _signature_device(group) -> torch.device:
    return signature_device(group)


def checksums(alibi_slopes, sinks, device) -> list[torch.Tensor]:
    """The checksums that follow a signature: the ALiBi slopes' and the sinks' values (`CHECKSUMS`)."""
    return [slopes_checksum(alibi_slopes, device), slopes_checksum(None if sinks is None else sinks.detach(), device)]


def resolve(group, own_checks=None):
    """`resolve_group`; when there is no usable group, `own_checks` (the rank's cheap argument checks) first."""
    try:
        return resolve_group(group)
    except AttnxError:
        if own_checks is not None:
            own_checks()
        raise


def check_call(q, k, v, *, group, sinks, own_checks=None, **options) -> RingSpec:
    """The call's `RingSpec`, the same on every rank of the group, or a typed error on every rank.

    ``own_checks()``, if given, checks more of the rank's arguments (typed errors) before its own spec.
    """
    group, rank, world_size = resolve(group, own_checks)
    device = _signature_device(group) if world_size > 1 else None  # (a group of one exchanges nothing)
    spec, error, sums = None, None, None
    try:
        if own_checks is not None:
            own_checks()
        spec = local_spec(q, k, v, group, rank, world_size, sinks=sinks, **options)
        if world_size > 1:
            sums = checksums(spec.alibi_slopes, sinks, device)
    except Exception as e:  # noqa: BLE001 - the rank's arguments were rejected (any error): tell the others first
        spec, error = None, e
    if world_size == 1:
        if error is not None:
            raise error
        return spec
    if error is not None:
        sums = checksums(None, None, device)
    rows = _agree(group, world_size, _signature(spec, q, k, v, sinks), device, *sums)
    if error is not None:
        raise error
    raise_on_disagreement(rows, _FIELDS, "shards of one shape")
    return spec


def raise_on_disagreement(rows: list[list[int]], fields: tuple, shards: str) -> None:
    """Typed errors, on every rank alike, when a rank rejected its arguments or the ranks' signatures differ.

    `rows` are the ranks' signatures (`_agree`): field 0 the "rejected" flag, field 1 whether the
    shards are packed, `fields` naming the first ints, `CHECKSUMS` the last ones.
    """
    rejected = [r for r, row in enumerate(rows) if row[0]]
    if rejected:
        raise InvalidArgumentError(f"rank(s) {rejected} rejected their arguments (see the error raised there); "
                                   "no K/V was exchanged")
    packed = [r for r, row in enumerate(rows) if row[1]]
    if packed and len(packed) < len(rows):
        raise InvalidArgumentError(f"rank(s) {packed} passed packed shards (cu_seqlens_q/cu_seqlens_k) and the "
                                   "others dense ones: every rank must pass the same kind; no K/V was exchanged")
    names = list(fields) + [None] * (SIGNATURE_INTS - len(fields)) + list(CHECKSUMS)
    differ = [name for i, name in enumerate(names) if name and len({row[i] for row in rows}) > 1]
    if differ:
        raise InvalidArgumentError("the ranks of the group called ring attention with different "
                                   + ", ".join(differ) + f"; every rank must pass {shards} and the same "
                                   "options (and all or none of them need gradients)")


def check_return_lse(return_lse) -> None:
    if not isinstance(return_lse, bool):
        raise InvalidTypeError(f"`return_lse` must be a bool, got {return_lse!r}")
