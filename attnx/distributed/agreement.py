"""Two checks of a ring call that a rank's shapes and flags cannot show: determinism and ALiBi slope values.

`check_named_backend`: a call whose backward must be deterministic (``deterministic=True`` or
torch's switch, while gradients are needed) declines a named backend whose backward is not, as
`attnx.attention` does; with the dispatcher choosing, the blocks' backward calls skip such
backends themselves (they get ``deterministic`` too).

`slopes_checksum`: every rank adds its own ALiBi slopes, so a rank whose slopes differ would
get wrong dK/dV without any error. The ranks already all-gather a signature once per call;
this checksum of the slopes' bits is computed on their device and travels in that same
all-gather, so comparing the values costs no collective and no host read of its own.
"""
from __future__ import annotations

import zlib
from typing import Optional

import torch

from ..errors import InvalidArgumentError, NoBackendError
from ..problem import Problem
from ..registry import get_backend

# the dispatcher's words for this decline (attnx/backend.py), so both read alike
DECLINE = ("backward is not deterministic, and the call requires one (deterministic=True or "
           "torch.use_deterministic_algorithms(True))")


def check_named_backend(backend: Optional[str], p: Problem) -> None:
    """NoBackendError when `p` requires a deterministic backward and the named `backend`'s may run and is not.

    ``p`` is the rank's shard problem (its ``deterministic`` already holds torch's switch and
    whether gradients are needed). A backend without a backward never runs one here (the ring's
    torch-ops rule does, and it is deterministic).
    """
    if backend is None or not p.deterministic:
        return
    declared = get_backend(backend).declarations(p.device_classes)
    if declared.supports_backward and not declared.deterministic:
        raise NoBackendError(f"backend {backend!r} declines this ring call's backward", {backend: [DECLINE]})


def slopes_checksum(alibi_slopes: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    """int64 ``(1,)`` on `device`: ``sum((i + 1) * bits_i)`` over the float32 slopes' bit patterns (0 for None).

    Position-weighted, so swapped heads differ too; exact (no overflow for fewer than 2**31
    entries). Runs on the slopes' device; no host read.
    """
    if alibi_slopes is None:
        return torch.zeros(1, dtype=torch.int64, device=device)
    bits = alibi_slopes.detach().reshape(-1).contiguous().view(torch.int32).to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
    return (bits * weights).sum().reshape(1).to(device)


def agree_or_raise(group, world_size: int, error: Optional[Exception], fields: dict, what: str, device) -> None:
    """One small all-gather for a collective helper (`gather`, `gather_varlen`) before its data moves.

    `error` is the rank's own argument error (None when its arguments were fine) and `fields` the
    ints every rank must agree on (the same keys on every rank). Every rank raises a typed error
    when any rank rejected its arguments (that rank its own) or the ranks' `fields` differ, so no
    rank is left waiting in, or crashed by, an all-gather of tensors of other shapes.
    """
    import torch.distributed as dist

    mine = [1] + [0] * len(fields) if error is not None else [0] + [int(x) for x in fields.values()]
    t = torch.tensor(mine, dtype=torch.int64, device=device)
    rows = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(rows, t, group=group)
    rows = [r.tolist() for r in rows]
    if error is not None:
        raise error
    rejected = [r for r, row in enumerate(rows) if row[0]]
    if rejected:
        raise InvalidArgumentError(f"rank(s) {rejected} rejected their arguments to {what} (see the error raised "
                                   "there); nothing was gathered")
    differ = [name for i, name in enumerate(fields, 1) if len({row[i] for row in rows}) > 1]
    if differ:
        raise InvalidArgumentError(f"the ranks of the group called {what} with different {', '.join(differ)}; "
                                   "every rank must pass a shard of one shape, dtype and device type, and the "
                                   "same options")


def code(value) -> int:
    """A stable int for a small value (a dtype, a shape, a name): what `agree_or_raise` compares."""
    return zlib.crc32(repr(value).encode())
