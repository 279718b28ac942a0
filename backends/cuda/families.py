"""Kernel families, declared as data: which GPUs each serves, its sources, how NVRTC targets it.

A family is one implementation of the kernels (its sources under ``kernels/``, sharing
``kernels/common/``): the Ampere-class mma.sync kernels (sm_80..sm_89) and the Hopper family
(sm_90: a wgmma/TMA warp-specialised forward and backward; the Ampere backward built for sm_90a for
head dims above 128 and the deterministic mode). Both also carry the split-KV decode kernel
(``sm80/fa_decode.cu``: mma.sync, built for each family's target; not dispatched yet, see
``launch_decode``). Among the families that cover a GPU, the one of
highest priority runs there. `nvrtc_arch` is the one place the ``-arch`` flag is derived.
"""
from __future__ import annotations

from typing import Mapping, NamedTuple, Optional

# Compute capabilities compiled for their arch-specific target ("sm_90a": wgmma, TMA and
# setmaxnreg need it). One target per GPU, so every family shares one cached binary set per GPU.
ARCH_SPECIFIC = frozenset({(9, 0)})


class Family(NamedTuple):
    name: str                          # the family's tile tables in variants.py are keyed by it
    min_capability: tuple[int, int]
    max_capability: tuple[int, int]    # inclusive
    sources: Mapping[str, str]         # kernel kind ("fwd", "bwd", "bwd_dq", ...) -> file under kernels/
    priority: int                      # among families covering a GPU, the highest runs
    tensor_maps: bool = False          # the forward reads q/k/v and writes out through TMA tensor maps
    bulk_copies: bool = False          # its GPUs have the TMA engine's plain bulk copies (cp.async.bulk, sm_90+)

    def covers(self, capability) -> bool:
        return self.min_capability <= tuple(capability) <= self.max_capability

    def source(self, kernel: str) -> str:
        return self.sources[kernel]


AMPERE = Family(name="sm80", min_capability=(8, 0), max_capability=(8, 9),
                sources={"fwd": "sm80/fa_fwd.cu", "bwd": "sm80/fa_bwd.cu", "bwd_dq": "sm80/fa_bwd_dq.cu",
                         "decode": "sm80/fa_decode.cu", "decode_combine": "sm80/fa_decode.cu"},
                priority=0)
# Hopper: warp-specialised wgmma/TMA forward ("fwd") and backward ("bwd_wgmma", head dims up to 128);
# "bwd" (the Ampere kernel built for sm_90a) runs the larger head dims and, with "bwd_dq" (both
# families), the deterministic backward (launch_deterministic).
HOPPER = Family(name="sm90", min_capability=(9, 0), max_capability=(9, 0),
                sources={"fwd": "sm90/fa_fwd.cu", "bwd": "sm80/fa_bwd.cu", "bwd_wgmma": "sm90/fa_bwd.cu",
                         "bwd_dq": "sm80/fa_bwd_dq.cu", "decode": "sm80/fa_decode.cu",
                         "decode_combine": "sm80/fa_decode.cu"},
                priority=1, tensor_maps=True, bulk_copies=True)

FAMILIES: dict[str, Family] = {f.name: f for f in (AMPERE, HOPPER)}


# The family `forced_family` (forced_family.py) sets for its block, or None: the newest covering one runs.
# Process-wide, not per thread: autograd runs a CUDA backward on its own threads.
_forced: Optional[Family] = None


def swap_forced(family: Optional[Family]) -> Optional[Family]:
    """Set the forced family (None: none), returning the previous one (forced_family.py's context manager)."""
    global _forced
    previous, _forced = _forced, family
    return previous


def family_for(capability) -> Optional[Family]:
    """The family that runs on a GPU of `capability`, or None when none covers it (inside `forced_family`, the
    forced one wherever the GPU is at least as new as its oldest GPU)."""
    forced = _forced
    if forced is not None and capability is not None and tuple(capability) >= forced.min_capability:
        return forced
    fits = [f for f in FAMILIES.values() if capability is not None and f.covers(capability)]
    return max(fits, key=lambda f: f.priority, default=None)


def nvrtc_arch(capability) -> str:
    """NVRTC's ``-arch`` value for a GPU of `capability`: ``sm_80``, ``sm_90a``, ..."""
    major, minor = capability
    suffix = "a" if (major, minor) in ARCH_SPECIFIC else ""
    return f"sm_{major}{minor}{suffix}"


def capability_range() -> tuple[tuple[int, int], tuple[int, int]]:
    """The lowest and highest compute capability some family covers."""
    return (min(f.min_capability for f in FAMILIES.values()), max(f.max_capability for f in FAMILIES.values()))
