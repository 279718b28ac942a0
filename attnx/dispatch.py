"""Priority policy: which accepting backend runs a problem. Nothing else lives here.

Backends say what they accept (`Backend.reasons`) and where they stand
(`Backend.rank`, from their `priority` tables); this module only orders them and
caches the decision on the exact signature, and the priority order on the problem's
dispatch key (`Problem.bucketed`: lengths rounded to powers of two). A new exact problem
asks the backends in that order and takes the first that accepts: which backend runs
is a function of the problem alone, and a growing decode length asks the chosen backend
(and any above it that decline) once per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from . import registry
from .errors import NoBackendError
from .problem import Problem
from .selection import allowed_backends

_CACHE_LIMIT = 4096
_exact: dict = {}     # (problem, allowed, registry generation) -> backend: decided or confirmed for it
_orders: dict = {}    # (bucketed problem, allowed, generation) -> allowed backends in priority order
_NO_LAST = (None, None, -1, None)
_last = _NO_LAST      # (problem, allowed, generation, backend) of the last decision returned


def no_backend(forced: Optional[str], allowed, what: str, declined: dict) -> NoBackendError:
    """The error when no backend accepts `what` ("this problem", "this backward"), worded after the
    forced backend, the allowed ones or the whole registry; `declined`: name -> reasons."""
    if forced is not None:
        message = f"backend {forced!r} declines {what}"
    elif allowed is not None:
        message = f"none of the allowed backends ({', '.join(allowed)}) accepts {what}"
    else:
        message = f"no registered backend accepts {what}"
    return NoBackendError(message, declined)


def priority(p: Problem) -> list[str]:
    """Registered backend names, best first, for this problem (ties keep registration order)."""
    key = p.bucketed()
    backends = registry.registered_backends()
    return sorted(backends, key=lambda name: -backends[name].rank(key))


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
    reasons = {name: registry.get_backend(name).reasons(p) for name in order}
    chosen = next((n for n in considered if not reasons[n]), None)
    return Decision(p, chosen, reasons, considered)


def choose(p: Problem, forced: Optional[str] = None):
    """The backend object that runs `p`; raises NoBackendError listing every reason."""
    if forced is not None and not isinstance(forced, str):
        registry.get_backend(forced)  # the typed "must be a str" error, before the caches hash it
    allowed = (forced,) if forced is not None else allowed_backends()
    generation = registry.generation()
    # The same Problem object again (a repeated plain call: `make_call` hands back the one it
    # validated before) under the same restriction: the last decision, without hashing `p`.
    last_p, last_allowed, last_generation, last_backend = _last
    if p is last_p and allowed == last_allowed and generation == last_generation:
        return last_backend
    exact_key = (p, allowed, generation)
    backend = _exact.get(exact_key)
    if backend is not None:
        _remember_last(p, allowed, generation, backend)
        return backend
    # A new exact problem asks its bucket's backends in priority order and takes the first that accepts,
    # so which backend runs depends on the problem alone, never on the calls before it (a backend's limits
    # may hang on exact sizes, Sq == Sk for a kernel's causal flag, which the bucket cannot see). The order
    # is kept per bucket: a growing decode length asks the chosen backend, and any above it, once per step.
    bucket_key = (p.bucketed(), allowed, generation)
    order = _orders.get(bucket_key)
    if order is None:
        if forced is not None:
            registry.get_backend(forced)  # unknown names raise
        order = tuple(registry.get_backend(n) for n in priority(p) if allowed is None or n in allowed)
        _remember(_orders, bucket_key, order)
    backend = next((b for b in order if not b.reasons(p)), None)
    if backend is None:
        decision = decide(p, forced)
        declined = {n: decision.reasons[n] for n in decision.considered}
        raise no_backend(forced, allowed, "this problem", declined)
    _remember(_exact, exact_key, backend)
    _remember_last(p, allowed, generation, backend)
    return backend


def _remember(cache: dict, key, backend) -> None:
    if len(cache) >= _CACHE_LIMIT:
        cache.clear()
    cache[key] = backend


def _remember_last(p: Problem, allowed, generation: int, backend) -> None:
    global _last
    _last = (p, allowed, generation, backend)  # one assignment: threads never see a mixed entry


def clear_cache() -> None:
    global _last
    _last = _NO_LAST
    _exact.clear()
    _orders.clear()
