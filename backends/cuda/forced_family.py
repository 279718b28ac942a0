"""Run the cuda backend's calls on one kernel family whatever the GPU: a switch for tests and benchmarks.

The family that runs on a GPU is normally the newest that covers it (`families.family_for`), so on a
Hopper GPU the Ampere family's forward never runs. Inside ``with forced_family("sm80"):`` it does: the
same kernels an A100 runs, built for the GPU's own target (``sm_90a``), with the tile choices that GPU's
shared memory allows. That is how the Ampere family is checked (conformance, compute-sanitizer) on the
H200. Choices cached per problem (the dispatcher's, the decode and varlen launchers') are forgotten on
entry and on exit, so no choice made under one family is reused under the other. The setting is the
process's, like torch.backends' flags (autograd runs a CUDA backward on its own threads, which must see it
too): not for concurrent use beside other attention calls.
"""
from __future__ import annotations

import contextlib

from .families import FAMILIES, swap_forced


def _forget_choices() -> None:
    from attnx import dispatch

    from . import launch_decode, launch_varlen
    dispatch.clear_cache()
    for cached in (launch_decode.decode_candidates_for, launch_decode.pick_decode_variant,
                   launch_varlen.varlen_variant_for, launch_varlen.varlen_backward_for):
        cached.cache_clear()


@contextlib.contextmanager
def forced_family(name: str):
    """Within the block the cuda backend runs kernel family `name` ("sm80", "sm90") on every GPU at least as
    new as the family's oldest (older GPUs keep their own). Raises ValueError for an unknown name.

    Equivalent PyTorch: none; a testing switch, as ``torch.backends.cuda.preferred_linalg_library``."""
    family = FAMILIES.get(name)
    if family is None:
        raise ValueError(f"unknown cuda kernel family {name!r}; known: {', '.join(FAMILIES)}")
    previous = swap_forced(family)
    _forget_choices()
    try:
        yield family
    finally:
        swap_forced(previous)
        _forget_choices()
