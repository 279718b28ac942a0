"""Conformance cases: the record of one case, and the grid generated from a backend's declarations.

The grid is a covering design, not a cartesian product:
  * every axis value is varied alone against a base case (dtype, head dim, sizes, GQA ratio,
    causal/window sides, mask kinds and shapes, alibi, softcap, scale, layout, memory layout,
    fully masked rows, large logits, Dv != D, forward-only vs gradients, mask gradients);
  * the mask features (positional mask, mask tensor, alibi, softcap) in pairwise combinations,
    at Sq < Sk and Sq > Sk so bottom-right alignment matters;
  * a diagonal across dtypes x head dims x sizes.
A case is kept only when the backend's declarations (class attributes) say it supports it, and
everything the declarations allow appears at least once. Profiles: ``quick`` (CI), ``full``
(minutes on a GPU), ``interp`` (small sizes for the Triton interpreter on a CPU).
"""
from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass, replace
from typing import Optional

import torch

from attnx.problem import Problem

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
DTYPE_ORDER = ("float32", "float16", "bfloat16", "float64")
HEAD_DIMS = (16, 32, 40, 64, 72, 80, 96, 128, 160, 192, 256)
MEMORY = ("contiguous", "sliced", "transposed", "strided", "expanded")
MASK_SHAPES = ("full", "heads", "keys", "2d", "1d")  # (B,Hq,Sq,Sk), (1,Hq,Sq,Sk), (B,1,1,Sk), (Sq,Sk), (Sk,)
PROFILES = ("quick", "full", "interp")
SOFTCAP = 5.0   # small enough that tanh bends typical scores
WINDOW = 7      # "positive" window side


@dataclass(frozen=True)
class Case:
    """One conformance case: sizes in the bhsd sense, whatever the layout."""

    group: str                        # which part of the design produced it
    dtype: str
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    head_dim_v: int
    layout: str = "bhsd"
    causal: bool = False
    window: Optional[tuple] = None    # (left, right), each None or int >= 0
    mask: Optional[str] = None        # None, "bool", "additive"
    mask_shape: str = "full"          # one of MASK_SHAPES
    mask_grad: bool = False           # additive mask with requires_grad
    mask_dtype: Optional[str] = None  # additive mask dtype when it differs from q's
    alibi: Optional[str] = None       # None, "h" (Hq,), "bh" (B, Hq)
    softcap: Optional[float] = None
    scale: Optional[float] = None     # None = default 1/sqrt(D); large_logits picks its own
    memory: str = "contiguous"        # one of MEMORY
    masked_rows: bool = False         # some query rows see no key at all
    large_logits: bool = False        # max |scaled score| = 1e4
    grad: bool = True
    offset: Optional[int] = None      # explicit aligned position of query 0 (None = bottom-right)
    sinks: bool = False               # per-head attention-sink logits
    nan: bool = False                 # one NaN in k: the rows that see it must come out NaN
    q_format: str = "dense"           # "dense" or "varlen"
    kv_format: str = "dense"          # "dense", "varlen", "cache" or "paged"
    page_size: Optional[int] = None   # paged kv only

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def key(self) -> str:
        """Readable identity without the group (duplicates across groups share it)."""
        parts = [f"{self.dtype}", f"B{self.batch}H{self.heads_q}" + (f"kv{self.heads_kv}" if self.heads_kv != self.heads_q else ""),
                 f"S{self.seqlen_q}x{self.seqlen_k}", f"D{self.head_dim}" + (f"v{self.head_dim_v}" if self.head_dim_v != self.head_dim else "")]
        if self.layout != "bhsd":
            parts.append(self.layout)
        if self.causal:
            parts.append("causal")
        if self.window is not None:
            parts.append("win" + "_".join("N" if w is None else str(w) for w in self.window))
        if self.mask:
            parts.append(f"{self.mask}mask-{self.mask_shape}" + (f"-{self.mask_dtype}" if self.mask_dtype else "")
                         + ("-dmask" if self.mask_grad else ""))
        if self.alibi:
            parts.append(f"alibi{self.alibi}")
        if self.softcap is not None:
            parts.append(f"softcap{self.softcap:g}")
        if self.scale is not None:
            parts.append(f"scale{self.scale:g}")
        if self.memory != "contiguous":
            parts.append(self.memory)
        if self.masked_rows:
            parts.append("maskedrows")
        if self.large_logits:
            parts.append("large")
        if self.offset is not None:
            parts.append(f"offset{self.offset}")
        if self.sinks:
            parts.append("sinks")
        if self.nan:
            parts.append("nan")
        if (self.q_format, self.kv_format) != ("dense", "dense"):
            parts.append(f"{self.q_format}q-{self.kv_format}kv" + (f"{self.page_size}" if self.page_size else ""))
        parts.append("grad" if self.grad else "fwd")
        return "-".join(parts)

    @property
    def id(self) -> str:
        return f"{self.group}:{self.key}"

    @property
    def seed(self) -> int:
        """Per-case seed: the same case always gets the same inputs."""
        return zlib.crc32(self.key.encode())

    @property
    def is_dense(self) -> bool:
        return (self.q_format, self.kv_format) == ("dense", "dense")

    def problem(self) -> Problem:
        """The case's signature as `make_problem` would build it (device fields: the CPU's)."""
        return Problem.create(
            device="cpu", dtype=self.torch_dtype, batch=self.batch, heads_q=self.heads_q, heads_kv=self.heads_kv,
            seqlen_q=self.seqlen_q, seqlen_k=self.seqlen_k, head_dim=self.head_dim, head_dim_v=self.head_dim_v,
            layout=self.layout, causal=self.causal, window=self.window, offset=self.offset, mask_kind=self.mask,
            mask_shape=(self.batch, self.heads_q, self.seqlen_q, self.seqlen_k) if self.mask else None,
            mask_requires_grad=self.mask_grad, alibi=self.alibi is not None, sinks=self.sinks,
            softcap=self.softcap, scale=self.scale, needs_grad=self.grad or self.mask_grad, deterministic=False,
            q_format=self.q_format, kv_format=self.kv_format, page_size=self.page_size)

    def as_dict(self) -> dict:
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d["window"] = list(self.window) if self.window is not None else None
        d["id"] = self.id
        d["seed"] = self.seed
        return d


# -- declarations --------------------------------------------------------------------------
def head_dim_ok(backend, dim: int) -> bool:
    if backend.head_dims is not None and dim not in backend.head_dims:
        return False
    multiple = getattr(backend, "head_dim_multiple", None)
    if multiple is not None and dim % multiple:
        return False
    return backend.max_head_dim is None or dim <= backend.max_head_dim


def declared_reasons(backend, case: Case) -> list[str]:
    """Why the backend's declarations (class attributes only) exclude `case`; [] = declared supported."""
    return backend.declared_reasons(case.problem())


# -- profiles ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Profile:
    name: str
    batch: int
    heads: int                 # base Hq
    seqlen: int                # base Sq = Sk
    uneven: tuple              # (Sq, Sk) with Sq < Sk for the mask-feature cases (and its mirror)
    sizes: tuple               # (Sq, Sk) pairs for the size axis, run at B = H = 1
    gqa_heads: int             # Hq of the GQA axis; Hkv runs over its divisors down to 1 (MQA)
    windows: tuple             # (causal, window) pairs
    mask_levels: tuple         # (kind, shape) levels of the pairwise design
    pos_levels: tuple          # (causal, window) levels of the pairwise design
    full_diagonal: bool        # dtypes x head dims product instead of a zip


_WINDOWS = (
    (True, None), (False, (None, None)), (False, (None, 0)), (False, (None, WINDOW)), (False, (0, None)),
    (False, (0, 0)), (False, (0, WINDOW)), (False, (WINDOW, None)), (False, (WINDOW, 0)),
    (False, (WINDOW, WINDOW)), (True, (WINDOW, None)), (True, (WINDOW, 3)),
)
_ALL_MASKS = ((None, "full"),) + tuple((kind, shape) for kind in ("bool", "additive") for shape in MASK_SHAPES)

_PROFILES = {
    "quick": Profile(
        "quick", batch=2, heads=2, seqlen=64, uneven=(48, 80),
        sizes=((1, 1), (17, 17), (127, 127), (128, 128), (1000, 1000), (1, 128), (128, 1), (17, 1000), (1000, 17)),
        gqa_heads=4, windows=_WINDOWS,
        mask_levels=((None, "full"), ("bool", "full"), ("additive", "keys")),
        pos_levels=((False, None), (True, None), (False, (WINDOW, 0)), (False, (None, WINDOW)), (False, (0, 0))),
        full_diagonal=False),
    "full": Profile(
        "full", batch=2, heads=4, seqlen=128, uneven=(100, 160),
        sizes=tuple(itertools.product((1, 17, 127, 128, 1000), repeat=2)) + ((129, 255), (255, 129), (64, 4096)),
        gqa_heads=8, windows=_WINDOWS + ((False, (5000, 5000)), (True, (0, None))),
        mask_levels=_ALL_MASKS,
        pos_levels=((False, None), (True, None), (False, (WINDOW, 0)), (False, (None, WINDOW)), (False, (0, 0)),
                    (False, (WINDOW, WINDOW)), (False, (0, None)), (True, (WINDOW, None))),
        full_diagonal=True),
    "interp": Profile(
        "interp", batch=1, heads=2, seqlen=32, uneven=(24, 40),
        sizes=((1, 1), (17, 17), (33, 33), (1, 40), (40, 1), (17, 48), (48, 17)),
        gqa_heads=4, windows=_WINDOWS,
        mask_levels=((None, "full"), ("bool", "full"), ("additive", "keys")),
        pos_levels=((False, None), (True, None), (False, (WINDOW, 0)), (False, (None, WINDOW))),
        full_diagonal=False),
}


def get_profile(name: str) -> Profile:
    if name not in _PROFILES:
        raise ValueError(f"unknown profile {name!r}; choose one of {', '.join(PROFILES)}")
    return _PROFILES[name]


def _pairwise(levels: list[tuple]) -> list[tuple]:
    """A small set of combinations covering every pair of levels of every two factors (greedy)."""
    uncovered = {(i, a, j, b) for i, j in itertools.combinations(range(len(levels)), 2)
                 for a in range(len(levels[i])) for b in range(len(levels[j]))}
    chosen = []
    while uncovered:
        best, best_gain = None, -1
        for combo in itertools.product(*(range(len(f)) for f in levels)):
            gain = sum((i, combo[i], j, combo[j]) in uncovered for i, j in itertools.combinations(range(len(combo)), 2))
            if gain > best_gain:
                best, best_gain = combo, gain
        chosen.append(tuple(levels[i][c] for i, c in enumerate(best)))
        uncovered -= {(i, best[i], j, best[j]) for i, j in itertools.combinations(range(len(best)), 2)}
    return chosen


# -- the grid ---------------------------------------------------------------------------------
def generate_cases(backend, profile: str = "quick") -> list[Case]:
    """Every case of `profile` that `backend`'s declarations say it supports, de-duplicated."""
    prof = get_profile(profile)
    dtypes = [d for d in DTYPE_ORDER if DTYPES[d] in backend.dtypes]
    if not dtypes:
        return []
    dims = sorted({d for d in HEAD_DIMS if head_dim_ok(backend, d)} | set(backend.head_dims or ()))
    if not dims:
        return []
    grad = bool(backend.supports_backward)
    dim = 64 if 64 in dims else min(dims, key=lambda d: abs(d - 64))
    low = [d for d in dtypes if d in ("float16", "bfloat16")]
    base = Case("base", dtypes[0], prof.batch, prof.heads, prof.heads, prof.seqlen, prof.seqlen, dim, dim, grad=grad)
    sq, sk = prof.uneven
    uneven = (replace(base, seqlen_q=sq, seqlen_k=sk), replace(base, seqlen_q=sk, seqlen_k=sq))
    cases = [base, replace(base, group="base", grad=False)]

    for dt in dtypes:
        cases += [replace(base, group="dtype", dtype=dt), replace(base, group="dtype", dtype=dt, causal=True),
                  replace(base, group="dtype", dtype=dt, grad=False)]
    for d in dims:
        cases.append(replace(base, group="head_dim", head_dim=d, head_dim_v=d))
    for d, dv in ((dim, dims[0]), (dims[0], dim), (dims[-1], dim), (dim, dims[-1]), (72, 40), (40, 72)):
        if d != dv:
            cases.append(replace(base, group="dv", head_dim=d, head_dim_v=dv, causal=d > dv))
    for s_q, s_k in prof.sizes:
        big = s_q * s_k >= 1 << 16
        one = replace(base, group="seqlen", batch=1, heads_q=1, heads_kv=1, seqlen_q=s_q, seqlen_k=s_k)
        cases.append(one)
        if not big or profile == "full":
            cases.append(replace(one, causal=True, batch=prof.batch))
    for ratio in (r for r in (1, 2, 4, 8, 16) if prof.gqa_heads % r == 0 and r <= prof.gqa_heads):
        g = replace(base, group="gqa", heads_q=prof.gqa_heads, heads_kv=prof.gqa_heads // ratio)
        cases += [g, replace(g, seqlen_q=sq, seqlen_k=sk, causal=True)]
    for i, (causal, window) in enumerate(prof.windows):
        cases.append(replace(uneven[i % 2], group="window", causal=causal, window=window))
    for i, (kind, shape) in enumerate(_ALL_MASKS[1:]):
        cases.append(replace(uneven[i % 2], group="mask", mask=kind, mask_shape=shape))
        if kind == "additive":
            cases.append(replace(uneven[(i + 1) % 2], group="mask_grad", mask=kind, mask_shape=shape, mask_grad=True))
    for i, alibi in enumerate(("h", "bh")):
        cases += [replace(uneven[i], group="alibi", alibi=alibi), replace(uneven[1 - i], group="alibi", alibi=alibi, causal=True)]
    cases += [replace(base, group="softcap", softcap=SOFTCAP), replace(uneven[0], group="softcap", softcap=SOFTCAP, causal=True),
              replace(base, group="scale", scale=0.3), replace(base, group="scale", scale=2.0, softcap=SOFTCAP)]
    for layout in ("bshd", "bhsd"):
        for memory in MEMORY:
            cases.append(replace(base, group="memory", layout=layout, memory=memory, causal=memory == "sliced"))
    cases.append(replace(uneven[1], group="layout", layout="bshd", causal=True, heads_kv=1, mask="additive",
                         mask_shape="keys", mask_grad=grad))

    # pairwise mask features; GQA and the other layout ride along on alternate cases
    factors = [list(prof.pos_levels), list(prof.mask_levels), [None, "h", "bh"], [None, SOFTCAP]]
    for i, ((causal, window), (kind, shape), alibi, softcap) in enumerate(_pairwise(factors)):
        c = replace(uneven[i % 2], group="pairwise", causal=causal, window=window, mask=kind, mask_shape=shape,
                    alibi=alibi, softcap=softcap, mask_grad=kind == "additive" and i % 3 == 0,
                    layout="bshd" if i % 4 == 3 else "bhsd")
        cases.append(replace(c, heads_q=2 * c.heads_q, heads_kv=c.heads_q) if i % 2 else c)

    # rows that see no key: from a mask tensor, or from causal/window with Sq > Sk
    tall = replace(base, seqlen_q=prof.uneven[1], seqlen_k=prof.uneven[0])
    cases += [replace(base, group="masked_rows", mask="bool", masked_rows=True),
              replace(base, group="masked_rows", mask="bool", mask_shape="keys", masked_rows=True),
              replace(uneven[0], group="masked_rows", mask="additive", masked_rows=True, mask_grad=grad),
              replace(uneven[1], group="masked_rows", mask="additive", mask_shape="2d", masked_rows=True, alibi="h"),
              replace(tall, group="masked_rows", causal=True, masked_rows=True),
              replace(tall, group="masked_rows", window=(0, 0), masked_rows=True, layout="bshd"),
              replace(tall, group="masked_rows", causal=True, masked_rows=True, softcap=SOFTCAP, grad=False)]

    # large logits in the low-precision dtypes
    for dt in low:
        big = replace(base, group="large_logits", dtype=dt, large_logits=True)
        cases += [big, replace(big, causal=True, seqlen_q=sq, seqlen_k=sk),
                  replace(big, heads_q=2 * big.heads_q, mask="bool", masked_rows=True, layout="bshd"),
                  replace(big, mask="additive", mask_shape="2d", alibi="bh"),
                  replace(big, softcap=30.0, grad=False)]
        cases.append(replace(base, group="mask_dtype", dtype=dt, mask="additive", mask_dtype="float32",
                             mask_grad=grad, causal=True))
        if profile != "interp":
            cases.append(replace(big, batch=1, heads_q=1, heads_kv=1, seqlen_q=1000, seqlen_k=1000, causal=True, grad=False))

    # diagonal across dtypes x head dims x sizes
    diag_sizes = [(17, 17), (prof.seqlen, prof.seqlen), (sq, sk), (sk, sq), (1, sk), (sk - 1, sk + 1)]
    pairs = (list(itertools.product(dtypes, dims)) if prof.full_diagonal else
             [(dtypes[i % len(dtypes)], dims[i % len(dims)]) for i in range(max(len(dtypes), len(dims)))])
    for i, (dt, d) in enumerate(pairs):
        s_q, s_k = diag_sizes[i % len(diag_sizes)]
        cases.append(replace(base, group="diagonal", dtype=dt, head_dim=d, head_dim_v=d, seqlen_q=s_q, seqlen_k=s_k,
                             causal=i % 2 == 1, layout="bshd" if i % 3 == 2 else "bhsd"))

    cases += _contract_2026_12_cases(base, uneven, prof, grad)
    return _finish(cases, backend)


def _contract_2026_12_cases(base: Case, uneven: tuple, prof: Profile, grad: bool) -> list[Case]:
    """Explicit offsets, sinks, NaN inputs, zero-size problems and the varlen/cache/paged formats."""
    cases = []
    # offsets: top-left (SDPA's is_causal), positive, negative, and past every key
    for i, off in enumerate((0, 5, -3, prof.uneven[1] + 4)):
        u = uneven[i % 2]
        cases += [replace(u, group="offset", offset=off, causal=True),
                  replace(u, group="offset", offset=off, window=(WINDOW, WINDOW), alibi="h" if i % 2 else None,
                          layout="bshd" if i == 2 else "bhsd")]
    tall = uneven[1]  # Sq > Sk: with causal, the first rows see no key (lse = sink there)
    cases += [replace(base, group="sinks", sinks=True), replace(uneven[0], group="sinks", sinks=True, causal=True),
              replace(tall, group="sinks", sinks=True, causal=True, masked_rows=True),
              replace(base, group="sinks", sinks=True, heads_q=2 * base.heads_q, softcap=SOFTCAP, layout="bshd"),
              replace(uneven[0], group="sinks", sinks=True, offset=0, causal=True, alibi="bh"),
              replace(base, group="sinks", sinks=True, grad=False)]
    cases += [replace(base, group="nan", nan=True, grad=False),
              replace(uneven[0], group="nan", nan=True, causal=True, grad=False)]
    for sizes in ((0, base.heads_q, base.heads_kv, 9, 9), (1, 0, 0, 9, 9), (1, 2, 1, 0, 9), (1, 2, 1, 9, 0)):
        b, hq, hkv, sq, sk = sizes
        cases.append(replace(base, group="empty", batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=sq, seqlen_k=sk,
                             causal=sq > 0, sinks=sk == 0))
    # tensor formats: 3 sequences (one of them empty) of up to seqlen_q queries and seqlen_k keys
    sq, sk = prof.uneven
    packed = replace(base, group="format", batch=3, seqlen_q=sq, seqlen_k=sk, q_format="varlen", kv_format="varlen")
    cases += [packed, replace(packed, causal=True), replace(packed, window=(WINDOW, 0), alibi="bh"),
              replace(packed, heads_q=2 * base.heads_q, causal=True, sinks=True),
              replace(packed, causal=True, offset=0), replace(packed, seqlen_q=sk, seqlen_k=sq, causal=True,
                                                              softcap=SOFTCAP)]
    decode = replace(base, group="format", batch=3, seqlen_q=1, seqlen_k=sk, kv_format="cache", causal=True)
    cases += [decode, replace(decode, seqlen_q=4, heads_q=2 * base.heads_q, sinks=True, layout="bshd")]
    for page_size in (1, 7, 16):
        paged = replace(decode, kv_format="paged", page_size=page_size)
        cases += [paged, replace(paged, seqlen_q=3, window=(WINDOW, 0), alibi="h")]
    cases += [replace(packed, kv_format="paged", page_size=16, causal=True),
              replace(packed, kv_format="cache", causal=True, layout="bshd")]
    if not grad:
        cases = [replace(c, grad=False) for c in cases]
    return cases


def _finish(cases: list[Case], backend) -> list[Case]:
    """Drop cases the declarations exclude or that are impossible; de-duplicate by key."""
    kept, seen = [], set()
    for c in cases:
        if c.grad is False and c.mask_grad:
            c = replace(c, mask_grad=False)
        if c.mask_grad and not c.grad:
            continue
        if c.heads_kv and c.heads_q % c.heads_kv:
            continue
        if declared_reasons(backend, c):
            # the mask-grad variant of a case the backend supports otherwise: keep it without mask grad
            if c.mask_grad and not declared_reasons(backend, replace(c, mask_grad=False)):
                c = replace(c, mask_grad=False)
            elif c.grad and not declared_reasons(backend, replace(c, grad=False, mask_grad=False)):
                c = replace(c, grad=False, mask_grad=False)
            else:
                continue
        if c.key not in seen:
            seen.add(c.key)
            kept.append(c)
    return kept
