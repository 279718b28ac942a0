"""Priority policy: which accepting backend runs a problem. Nothing else lives here.

Backends say what they accept (`Backend.reasons`); this module only orders them
and caches the decision on the problem's signature.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .errors import NoBackendError
from .problem import Problem
from .registry import get_backend, registered_backends
from .selection import allowed_backends

# Best first. Compiled kernels beat the torch-op backends wherever they accept.
PRIORITY = ("cuda", "triton", "blocked", "naive")
# On Hopper, Triton's tl.dot lowers to wgmma while the cuda backend's kernels are the
# Ampere-class mma.sync family: on the H200 (2026-11-29, bf16, d64/d128, S 512..16k)
# triton ran 5-45% faster, forward and forward+backward (benchmarks/results/h200-2026-11-29).
TRITON_FIRST_FROM_CAPABILITY = (9, 0)
# On the CPU the plain formula wins while the whole score matrix is small. Measured on a 2-core
# EPYC (fp32, D=64, fwd and fwd+bwd, causal or not): naive ~10% faster at 64k scores, blocked
# 10-40% faster at 128k and 1.5-4x at 256k+ (benchmarks/ docs/benchmarks.md).
NAIVE_MAX_SCORES = 1 << 16
_CACHE_LIMIT = 4096
_cache: dict = {}


def priority(p: Problem) -> list[str]:
    """Registered backend names, best first, for this problem."""
    order = list(PRIORITY)
    capability = p.capability
    if capability is not None and capability >= TRITON_FIRST_FROM_CAPABILITY:
        order.remove("triton")
        order.insert(order.index("cuda"), "triton")
    # naive repeats K/V per query head, so under GQA blocked (which batches the group) stays ahead
    if (p.device_type != "cuda" and p.heads_q == p.heads_kv
            and p.batch * p.heads_q * p.seqlen_q * p.seqlen_k <= NAIVE_MAX_SCORES):
        order.remove("naive")
        order.insert(order.index("blocked"), "naive")
    names = [n for n in order if n in registered_backends()]
    return names + [n for n in registered_backends() if n not in names]


@dataclass(frozen=True)
class Decision:
    """What the dispatcher decided for one problem, and why."""

    problem: Problem
    chosen: Optional[str]
    reasons: dict = field(default_factory=dict)  # name -> [] (would work) or its reasons
    considered: tuple = ()                        # names allowed, in priority order

    def __str__(self) -> str:
        lines = [f"chosen: {self.chosen or 'none'}"]
        for name, why in self.reasons.items():
            status = "chosen" if name == self.chosen else ("would work" if not why else "; ".join(why))
            tag = "" if name in self.considered else " (not allowed here)"
            lines.append(f"  {name}{tag}: {status}")
        return "\n".join(lines)


def decide(p: Problem, forced: Optional[str] = None) -> Decision:
    """Full decision with every backend's reasons (uncached; used by `explain`)."""
    allowed = (forced,) if forced is not None else allowed_backends()
    order = priority(p)
    considered = tuple(n for n in order if allowed is None or n in allowed)
    reasons = {name: get_backend(name).reasons(p) for name in order}
    chosen = next((n for n in considered if not reasons[n]), None)
    return Decision(p, chosen, reasons, considered)


def choose(p: Problem, forced: Optional[str] = None):
    """The backend object that runs `p`; raises NoBackendError listing every reason."""
    allowed = (forced,) if forced is not None else allowed_backends()
    key = (p, allowed)
    backend = _cache.get(key)
    if backend is not None:
        return backend
    if forced is not None:
        get_backend(forced)  # unknown names raise ValueError
    decision = decide(p, forced)
    if decision.chosen is None:
        declined = {n: decision.reasons[n] for n in decision.considered}
        if forced is not None:
            message = f"backend {forced!r} declines this problem"
        elif allowed is not None:
            message = f"none of the allowed backends ({', '.join(allowed)}) accepts this problem"
        else:
            message = "no registered backend accepts this problem"
        raise NoBackendError(message, declined)
    if len(_cache) >= _CACHE_LIMIT:
        _cache.clear()
    backend = _cache[key] = get_backend(decision.chosen)
    return backend


def clear_cache() -> None:
    _cache.clear()
