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

from typing import Optional

import torch

from ..errors import NoBackendError
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
