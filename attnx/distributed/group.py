"""The process group a call runs over: checked before any communication."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import InvalidArgumentError, InvalidTypeError


def resolve_group(group):
    """``(group, rank, world_size)`` for `group` (None: the default group); typed errors when unusable."""
    if not dist.is_available():
        raise InvalidArgumentError("torch.distributed is not available in this build of torch")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise InvalidTypeError(f"`group` must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    if not dist.is_initialized():
        raise InvalidArgumentError("torch.distributed is not initialized: call "
                                   "torch.distributed.init_process_group first (or run under torchrun)")
    if group is None:
        group = dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise InvalidArgumentError("this process is not a member of `group`")
    return group, rank, dist.get_world_size(group)


def global_rank(group, rank: int) -> int:
    """The default group's number of `group`'s rank `rank` (what point-to-point ops name peers by)."""
    return dist.get_global_rank(group, rank)


def signature_device(group) -> torch.device:
    """Where the small agreement tensors of a collective over `group` live: the current GPU for NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
