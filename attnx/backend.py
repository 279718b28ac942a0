"""The base class of every backend: support declared as data, turned into reasons.

A backend subclasses `Backend`, sets the class attributes that describe what it
can compute, and implements `forward` (and `backward` when it declares
`supports_backward`). `reasons(problem)` turns the declarations into the list of
human-readable reasons it declines a problem; an empty list means it accepts.
A backend whose paths differ by device states the differences as data too:
`device_declarations` maps a device class ("cuda", "cuda:sm_90", ...) to the
declarations that differ there, and `declarations(device_classes)` gives the
declarations in force on a device (`Declarations`). Limits no declaration can
express (sizes) go in `extra_reasons`.
"""
from __future__ import annotations

import functools
from typing import ClassVar, Mapping, Optional

import torch

from .capability import has_module
from .inputs import Grads, Inputs
from .problem import Problem

ALL_FLOAT = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _dtype_names(dtypes) -> str:
    return ", ".join(sorted(str(d).replace("torch.", "") for d in dtypes))


class Backend:
    """A way to compute attention, with what it supports declared as data."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    # where it runs
    device_types: ClassVar[frozenset] = frozenset({"cpu", "cuda", "mps"})
    vendors: ClassVar[Optional[frozenset]] = None          # None = any vendor of those device types
    min_capability: ClassVar[Optional[tuple]] = None        # NVIDIA only
    max_capability: ClassVar[Optional[tuple]] = None
    amd_archs: ClassVar[Optional[frozenset]] = None        # gfx prefixes, None = any
    # what it computes
    dtypes: ClassVar[frozenset] = ALL_FLOAT
    max_head_dim: ClassVar[Optional[int]] = None
    head_dims: ClassVar[Optional[frozenset]] = None        # exact set, None = any up to max_head_dim
    head_dim_multiple: ClassVar[Optional[int]] = None      # head dims must be multiples of this (None = any)
    supports_dv_differs: ClassVar[bool] = True
    supports_gqa: ClassVar[bool] = True
    supports_causal: ClassVar[bool] = True
    supports_window: ClassVar[bool] = True
    # a causal or window rule only when Sq == Sk (dense): kernels whose causal flag has no alignment
    causal_needs_equal_lengths: ClassVar[bool] = False
    mask_kinds: ClassVar[frozenset] = frozenset({"bool", "additive"})
    supports_mask_grad: ClassVar[bool] = True
    supports_alibi: ClassVar[bool] = True
    supports_softcap: ClassVar[bool] = True
    supports_backward: ClassVar[bool] = True
    deterministic: ClassVar[bool] = True
    # dtypes for which `backward` computes the probabilities from the lse it is given, P = exp(s - lse),
    # not from a normaliser it recomputes over its own keys: `attnx.attention_backward` (whose lse may
    # come from a wider softmax, e.g. merged over ring-attention blocks) runs only these. float64 is
    # left out by default: a float64 backward may refine the float32 lse over its own keys.
    backward_uses_given_lse: ClassVar[frozenset] = frozenset({torch.float16, torch.bfloat16, torch.float32})
    uses_tf32: ClassVar[bool] = False                      # float32 products on TF32 units (looser bound)
    # features added to the contract later default to "not supported", so a backend
    # written before them declines instead of computing something else
    supports_offset: ClassVar[bool] = False               # an explicit (not bottom-right) alignment
    supports_sinks: ClassVar[bool] = False
    formats: ClassVar[frozenset] = frozenset({("dense", "dense")})  # (q format, kv format) pairs
    # the pairs of `formats` whose backward exists; None: all of them (a forward-only format, e.g. a
    # decode kernel's cache and paged keys, is left out here)
    backward_formats: ClassVar[Optional[frozenset]] = None
    # Where the backend stands, by device class (most specific key wins: "cuda:sm_90",
    # "cuda:nvidia", "cuda", "*"); higher runs first. Set from measurements (docs/backends.md).
    priority: ClassVar[Mapping[str, int]] = {"*": 0}
    # Declarations that differ by device class, e.g. {"cuda": {"dtypes": ..., "mask_kinds": frozenset()}}:
    # on a device, every key of its classes applies, the most specific last (so it wins), attribute by
    # attribute; what no key names keeps the class attribute. Only names in DECLARATION_NAMES.
    device_declarations: ClassVar[Mapping[str, Mapping[str, object]]] = {}
    # what it needs installed: import names, and the hint printed when they are missing
    required_modules: ClassVar[tuple] = ()
    install_hint: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for device_class, changes in cls.device_declarations.items():
            unknown = set(changes) - DECLARATION_NAMES
            if unknown:
                raise TypeError(f"{cls.__name__}.device_declarations[{device_class!r}] names {sorted(unknown)}: "
                                f"not declarations (those are {', '.join(sorted(DECLARATION_NAMES))})")

    # -- availability: once per process -------------------------------------------------
    @functools.cached_property
    def unavailable_reasons(self) -> tuple[str, ...]:
        """Why this backend cannot run on this machine at all (missing packages, ...)."""
        missing = [m for m in self.required_modules if not has_module(m)]
        reasons = []
        if missing:
            hint = f" (install with: {self.install_hint})" if self.install_hint else ""
            reasons.append(f"needs {', '.join(missing)}, not installed{hint}")
        reasons += self.environment_reasons()
        return tuple(reasons)

    @property
    def available(self) -> bool:
        return not self.unavailable_reasons

    def environment_reasons(self) -> list[str]:
        """Override: machine-level reasons beyond missing modules (e.g. no driver)."""
        return []

    # -- per problem -----------------------------------------------------------------
    def reasons(self, p: Problem) -> list[str]:
        """Every reason this backend declines `p`; empty when it accepts."""
        reasons = list(self.unavailable_reasons) + self.device_reasons(p) + self.declared_reasons(p)
        if not reasons:
            reasons += self.extra_reasons(p)
        return reasons

    def device_reasons(self, p: Problem) -> list[str]:
        """Why the declared devices, vendors and architectures exclude `p`'s device."""
        return device_reasons(self._declarations_of(p), p)

    def declared_reasons(self, p: Problem) -> list[str]:
        """Why the declared dtypes, head dims and features exclude `p` (device and machine aside)."""
        return declared_reasons(self._declarations_of(p), p)

    def _declarations_of(self, p: Problem) -> "Backend | Declarations":
        """`declarations` for `p`'s device, looked up by (device type, vendor, arch): a decode loop's
        confirmation asks this every step, and `Problem.device_classes` formats four strings."""
        if not self.device_declarations:
            return self
        cache = self.__dict__.setdefault("_declarations_by_machine", {})
        machine = (p.device_type, p.vendor, p.arch)
        found = cache.get(machine)
        if found is None:
            found = cache[machine] = self.declarations(p.device_classes)
        return found

    def declarations(self, device_classes: tuple) -> "Backend | Declarations":
        """The declarations in force on a device (`Problem.device_classes` names it): the backend itself
        when `device_declarations` changes nothing there, else a `Declarations` view (cached)."""
        if not self.device_declarations:
            return self
        cache = self.__dict__.setdefault("_declarations_by_device", {})
        found = cache.get(device_classes)
        if found is None:
            changes: dict = {}
            for device_class in reversed(device_classes):  # least specific first: the most specific wins
                changes.update(self.device_declarations.get(device_class, {}))
            found = cache[device_classes] = Declarations(self, changes) if changes else self
        return found

    def extra_reasons(self, p: Problem) -> list[str]:
        """Override: limits that the declarations above cannot express."""
        return []

    # -- priority ----------------------------------------------------------------------
    def rank(self, p: Problem) -> int:
        """Where this backend stands for `p` (higher first): the most specific `priority` entry.

        Override only for a size rule; `p` is the dispatch key (`Problem.bucketed`).
        """
        for device_class in p.device_classes:
            if device_class in self.priority:
                return self.priority[device_class]
        return 0

    # -- compute -----------------------------------------------------------------------
    def forward(self, p: Problem, x: Inputs):
        """Return ``(out, lse)`` for the tensors in `x` (`attnx.Inputs` says their shapes).

        Dense format: ``out`` must be made with `attnx.alloc_out` (so it comes back in the
        caller's layout), ``lse`` is float32 ``(B, Hq, Sq)``. Varlen q: ``out`` is
        ``(total_q, Hq, Dv)`` and ``lse`` float32 ``(Hq, total_q)``.
        """
        raise NotImplementedError(f"backend {self.name!r} did not implement forward")

    def dense_forward(self, p: Problem):
        """Override: `forward` of `p` as a function of ``(q, k, v)`` alone, or None (the default).

        Asked once per remembered plain call (`attnx.call_memo.Run`: dense ``bhsd``, no mask, ALiBi or
        gradients), which then runs it instead of `forward` with an `Inputs`; it computes what `forward` does.
        """
        return None

    def backward(self, p: Problem, x: Inputs, out, lse, dout) -> Grads:
        """Return the `Grads` of the forward's differentiable inputs (`attnx.Grads` says which)."""
        raise NotImplementedError(f"backend {self.name!r} did not implement backward")

    def prepare(self, p: Problem) -> None:
        """Override: get ready for `p` (compile kernels, pick launch parameters); `attnx.plan` calls it."""

    def doctor_details(self) -> dict:
        """Override: extra facts for ``python -m attnx.doctor`` (e.g. first-call compile time)."""
        return {}

    def __repr__(self) -> str:
        return f"<attnx backend {self.name!r}>"


# -- declarations to reasons, for a backend or its `Declarations` on one device -------------------
DECLARATION_NAMES = frozenset({
    "vendors", "min_capability", "max_capability", "amd_archs", "dtypes", "max_head_dim", "head_dims",
    "head_dim_multiple", "supports_dv_differs", "supports_gqa", "supports_causal", "supports_window",
    "causal_needs_equal_lengths", "mask_kinds", "supports_mask_grad", "supports_alibi", "supports_softcap",
    "supports_backward", "deterministic", "backward_uses_given_lse", "uses_tf32", "supports_offset", "supports_sinks",
    "formats", "backward_formats"})


class Declarations:
    """A backend's declarations on one device: its class attributes with that device's
    `Backend.device_declarations` entries applied. Reads like the backend for every other
    attribute (``name``, ``extra_reasons``, ...), so the conformance grid can be generated from it."""

    def __init__(self, backend: Backend, changes: Mapping[str, object]):
        self.backend = backend
        self.changes = dict(changes)
        self.__dict__.update(changes)

    def __getattr__(self, name):  # only for names not set above: the backend's own
        backend = self.__dict__.get("backend")
        if backend is None:  # half-built (copy, pickle): no attributes yet
            raise AttributeError(name)
        return getattr(backend, name)

    def device_reasons(self, p: Problem) -> list[str]:
        return device_reasons(self, p)

    def declared_reasons(self, p: Problem) -> list[str]:
        return declared_reasons(self, p)

    def __repr__(self) -> str:
        return f"<declarations of {self.backend!r}: {', '.join(sorted(self.changes))} differ>"


def device_reasons(d, p: Problem) -> list[str]:
    """Why the declared devices, vendors and architectures exclude `p`'s device."""
    reasons = []
    if p.device_type not in d.device_types:
        reasons.append(f"device {p.device_type} not supported (needs {', '.join(sorted(d.device_types))})")
    elif d.vendors is not None and p.vendor not in d.vendors:
        reasons.append(f"{p.vendor} devices not supported (needs {', '.join(sorted(d.vendors))})")
    else:
        cap = p.capability
        if cap is not None and d.min_capability is not None and cap < d.min_capability:
            reasons.append(f"compute capability {cap[0]}.{cap[1]} below the minimum "
                           f"{d.min_capability[0]}.{d.min_capability[1]}")
        if cap is not None and d.max_capability is not None and cap > d.max_capability:
            reasons.append(f"compute capability {cap[0]}.{cap[1]} above the maximum "
                           f"{d.max_capability[0]}.{d.max_capability[1]}")
        if p.vendor == "amd" and d.amd_archs is not None and not p.arch.startswith(tuple(d.amd_archs)):
            reasons.append(f"AMD arch {p.arch} not supported (needs {', '.join(sorted(d.amd_archs))})")
    return reasons


def declared_reasons(d, p: Problem) -> list[str]:
    """Why the declared dtypes, head dims and features exclude `p` (device and machine aside)."""
    reasons = []
    if p.dtype not in d.dtypes:
        reasons.append(f"dtype {str(p.dtype).replace('torch.', '')} not supported "
                       f"(needs {_dtype_names(d.dtypes)})")
    for label, dim in (("head_dim", p.head_dim), ("head_dim_v", p.head_dim_v)):
        if d.head_dims is not None and dim not in d.head_dims:
            reasons.append(f"{label} {dim} not supported (needs one of {sorted(d.head_dims)})")
        elif d.max_head_dim is not None and dim > d.max_head_dim:
            reasons.append(f"{label} {dim} above the maximum {d.max_head_dim}")
        if d.head_dim_multiple is not None and dim % d.head_dim_multiple:
            reasons.append(f"{label} {dim} not a multiple of {d.head_dim_multiple}")
    if p.head_dim != p.head_dim_v and not d.supports_dv_differs:
        reasons.append("head_dim_v different from head_dim not supported")
    if p.heads_q != p.heads_kv and not d.supports_gqa:
        reasons.append("grouped-query attention (Hq != Hkv) not supported")
    if p.is_causal_only and not d.supports_causal:
        reasons.append("causal mask not supported")
    elif p.has_window and not p.is_causal_only and not d.supports_window:
        reasons.append("sliding window not supported")
    if p.has_window and d.causal_needs_equal_lengths and (not p.is_dense or p.seqlen_q != p.seqlen_k):
        reasons.append("causal or window rules only with Sq == Sk (the kernel's causal flag has no alignment)")
    if p.mask_kind is not None and p.mask_kind not in d.mask_kinds:
        reasons.append(f"{p.mask_kind} mask tensor not supported")
    if p.mask_requires_grad and not d.supports_mask_grad:
        reasons.append("gradient of the mask not supported")
    if p.has_alibi and not d.supports_alibi:
        reasons.append("alibi_slopes not supported")
    if p.softcap is not None and not d.supports_softcap:
        reasons.append("softcap not supported")
    if p.offset is not None and not d.supports_offset:
        reasons.append(f"an explicit alignment offset ({p.offset}) not supported (bottom-right only)")
    if p.has_sinks and not d.supports_sinks:
        reasons.append("attention sinks not supported")
    if (p.q_format, p.kv_format) not in d.formats:
        reasons.append(f"tensor format q={p.q_format}, k/v={p.kv_format} not supported (needs "
                       + ", ".join(f"{qf}/{kf}" for qf, kf in sorted(d.formats)) + ")")
    if p.needs_grad and not d.supports_backward:
        reasons.append("backward (inputs require grad) not supported")
    elif p.needs_grad and d.backward_formats is not None and (p.q_format, p.kv_format) not in d.backward_formats:
        reasons.append(f"backward with q={p.q_format}, k/v={p.kv_format} tensors not supported (forward only)")
    elif p.deterministic and not d.deterministic:
        reasons.append("backward is not deterministic, and the call requires one (deterministic=True or "
                       "torch.use_deterministic_algorithms(True))")
    return reasons
