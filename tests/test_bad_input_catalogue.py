"""The bad-input catalogue: every argument of every entry point, a typed error naming it, before any
kernel runs (issue 13, item 6). One row per (entry point, argument, condition); docs/errors.md shows
the same rows as one table (`python tests/test_bad_input_catalogue.py` prints it).

Rows of `attnx.attention` with dense tensors point (``ref``) at the calls of tests/test_errors.py's
`BAD` list, which runs them (with `attnx.explain` too); this file runs every other row: the packed,
cache and paged formats, `attnx.merge`, `attnx.plan` / `Plan.run`, and the compat SDPA and flash-attn
functions. A row with ``known`` is an open defect (an untyped error or none): it is an expected
failure until fixed, and the test fails once it is, so the table gets updated.

Each run row checks: the error has the row's type and is an `attnx.AttnxError`; its message names
the argument (``words``); no backend's forward or backward ran (the `ran` fixture).
"""
from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import pytest
import torch

import attnx
import attnx.compat.flash_attn as fa
from attnx import InvalidArgumentError as Arg
from attnx import InvalidTypeError as Type
from attnx import NoBackendError
from attnx.compat import CompatArgumentError as Compat
from attnx.compat import scaled_dot_product_attention as sdpa

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "errors.md"
START, END = "<!-- catalogue:start -->", "<!-- catalogue:end -->"

# open defects the catalogue found outside this change's files (docs/errors.md, "Open")
KNOWN: dict[str, str] = {}  # tag -> one line; none open (C1-C3 and D1 are fixed)


class Row(NamedTuple):
    entry: str                       # entry point (and format)
    argument: str                    # the argument the error must name
    condition: str                   # what is wrong, for the docs table
    error: type                      # the typed error raised
    call: Optional[Callable] = None  # makes fresh inputs and the call (None: `ref` runs it)
    words: Optional[str] = None      # text the message must hold (default: `argument` in backticks)
    ref: Optional[str] = None        # id of the call in tests/test_errors.py BAD
    known: Optional[str] = None      # open defect tag (KNOWN)

    @property
    def value_check(self) -> bool:
        """Index values: naive/blocked check them inside their forward, on the host, before reading a row."""
        return "checked on the host" in self.condition

    @property
    def id(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", f"{self.entry} {self.argument} {self.condition}".lower()).strip("-")


r = torch.randn
B, HQ, HKV, SQ, SK, D = 2, 4, 2, 5, 7, 8


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def dense():
    return r(B, HQ, SQ, D), r(B, HKV, SK, D), r(B, HKV, SK, D)


def packed():        # 2 sequences: 3 + 4 queries, 4 + 5 keys
    return r(7, HQ, D), r(9, HKV, D), r(9, HKV, D)


CU_Q, CU_K = (0, 3, 7), (0, 4, 9)


def cache():         # 2 sequences, 6 cache positions each
    return r(B, HQ, 1, D), r(B, HKV, 6, D), r(B, HKV, 6, D)


def pools():         # 3 pages of 4 rows
    return r(B, HQ, 1, D), r(3, 4, HKV, D), r(3, 4, HKV, D)


def table(*rows):
    return torch.tensor(rows, dtype=torch.int32)


def varlen(**kw):
    kw.setdefault("cu_seqlens_q", i32(*CU_Q))
    kw.setdefault("cu_seqlens_k", i32(*CU_K))
    tensors = kw.pop("tensors", None) or packed()
    return attnx.attention(*tensors, **kw)


def cached(**kw):
    kw.setdefault("seqlens_k", i32(3, 5))
    tensors = kw.pop("tensors", None) or cache()
    return attnx.attention(*tensors, **kw)


def paged(**kw):
    kw.setdefault("seqlens_k", i32(3, 5))
    kw.setdefault("page_table", table([0, 1], [2, 0]))
    tensors = kw.pop("tensors", None) or pools()
    return attnx.attention(*tensors, **kw)


def out_lse(layout="bhsd", dtype=torch.float32):
    if layout == "varlen":
        return r(7, HQ, D).to(dtype), r(HQ, 7)
    if layout == "bshd":
        return r(B, SQ, HQ, D).to(dtype), r(B, HQ, SQ)
    return r(B, HQ, SQ, D).to(dtype), r(B, HQ, SQ)


def merge(outs=None, lses=None, n=2, **kw):
    parts = [out_lse(kw.get("layout", "bhsd")) for _ in range(n)]
    return attnx.merge([o for o, _ in parts] if outs is None else outs,
                       [l for _, l in parts] if lses is None else lses, **kw)


def inference_cache():
    with torch.inference_mode():
        return attnx.KVCache.allocate(B, 8, HKV, D)


def planned(**kw):
    return attnx.plan(*dense(), **kw)


def run_plan(plan_kw=None, **run_kw):
    step = attnx.plan(*dense(), **(plan_kw or {}))
    tensors = run_kw.pop("tensors", None) or dense()
    return step.run(*tensors, **run_kw)


def bshd(*shape):    # flash-attn layout: (batch, seqlen, heads, d)
    return r(*shape)


def fa_dense(**kw):
    return fa.flash_attn_func(bshd(1, 3, 2, 4), bshd(1, 3, 2, 4), bshd(1, 3, 2, 4), **kw)


def fa_varlen(**kw):
    args = dict(cu_seqlens_q=i32(*CU_Q), cu_seqlens_k=i32(*CU_K), max_seqlen_q=4, max_seqlen_k=5)
    args.update(kw)
    tensors = args.pop("tensors", None) or packed()
    return fa.flash_attn_varlen_func(*tensors, **args)


def validated(call, **kw):
    """``call(**kw)`` inside `attnx.validate_indices()`: index values read before any backend runs."""
    with attnx.validate_indices():
        return call(**kw)


def kvc(**kw):
    tensors = kw.pop("tensors", None) or (r(B, 1, HQ, D), r(B, 6, HKV, D), r(B, 6, HKV, D))
    return fa.flash_attn_with_kvcache(*tensors, **kw)


def kvc_pools(**kw):
    return kvc(tensors=(r(B, 1, HQ, D), r(3, 4, HKV, D), r(3, 4, HKV, D)), **kw)


def _causal_bias(seqlen_q, seqlen_k):
    """torch's lower-right causal bias object (`torch.nn.attention.bias`), as SDPA takes it for attn_mask."""
    import warnings

    from torch.nn.attention.bias import causal_lower_right

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about NaN rows when seq_len_q > seq_len_kv
        return causal_lower_right(seqlen_q, seqlen_k)


def qkv3(*shape):    # sdpa tensors (N, H, L, E) or (L, E)
    return r(*shape)


A = "attention"
AV, AC, AP = "attention (packed)", "attention (KV cache)", "attention (paged cache)"
VI = "attention (validate_indices)"
FA, FAV, FAC = "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"

ROWS = [
    # -- attention, dense tensors: run by tests/test_errors.py ------------------------------
    Row(A, "q", "not a tensor", Type, ref="q-not-tensor"),
    Row(A, "q", "not 4-D", Arg, ref="q-rank3"),
    Row(A, "q", "not a float dtype", Type, ref="q-int-dtype"),
    Row(A, "q", "on another device than k, v", Arg, ref="q-other-device"),
    Row(A, "k", "not 4-D", Arg, ref="k-rank5"),
    Row(A, "k", "complex dtype", Type, ref="k-complex-dtype"),
    Row(A, "k", "dtype differs from q", Type, ref="k-dtype-differs"),
    Row(A, "k", "head dim differs from q", Arg, ref="k-head-dim"),
    Row(A, "k", "batch differs from q", Arg, ref="batch-differs"),
    Row(A, "k", "on another device", Arg, ref="k-other-device"),
    Row(A, "k", "heads do not divide q's heads", Arg, ref="heads-not-multiple"),
    Row(A, "v", "not a tensor", Type, ref="v-numpy"),
    Row(A, "v", "not 4-D", Arg, ref="v-rank2"),
    Row(A, "v", "dtype differs from q", Type, ref="v-dtype-differs"),
    Row(A, "v", "sequence length differs from k", Arg, ref="v-seqlen"),
    Row(A, "v", "heads differ from k", Arg, ref="v-heads"),
    Row(A, "q, k", "head dim 0", Arg, ref="d-zero"),
    Row(A, "layout", "not 'bhsd' or 'bshd'", Arg, ref="layout-unknown"),
    Row(A, "layout", "not a str", Arg, ref="layout-not-str"),
    Row(A, "mask", "not a tensor", Type, ref="mask-not-tensor"),
    Row(A, "mask", "integer dtype", Type, ref="mask-int-dtype"),
    Row(A, "mask", "does not broadcast to (B, Hq, Sq, Sk)", Arg, ref="mask-wrong-shape"),
    Row(A, "mask", "more than 4 dims", Arg, ref="mask-rank5"),
    Row(A, "mask", "on another device", Arg, ref="mask-other-device"),
    Row(A, "alibi_slopes", "not a tensor", Type, ref="alibi-not-tensor"),
    Row(A, "alibi_slopes", "not float32", Type, ref="alibi-float16"),
    Row(A, "alibi_slopes", "not (Hq,) or (B, Hq)", Arg, ref="alibi-wrong-heads"),
    Row(A, "alibi_slopes", "on another device", Arg, ref="alibi-other-device"),
    Row(A, "sinks", "not a tensor", Type, ref="sinks-list"),
    Row(A, "sinks", "not float32", Type, ref="sinks-float16"),
    Row(A, "sinks", "not (Hq,)", Arg, ref="sinks-kv-heads"),
    Row(A, "sinks", "on another device", Arg, ref="sinks-other-device"),
    Row(A, "window", "not a (left, right) pair", Type, ref="window-int"),
    Row(A, "window", "a side not an int or None", Type, ref="window-float-side"),
    Row(A, "window", "a side negative", Arg, ref="window-negative-left"),
    Row(A, "offset", "not an int", Type, ref="offset-float"),
    Row(A, "offset", "|offset| >= 2**28", Arg, ref="offset-huge"),
    Row(A, "softcap", "not a number", Type, ref="softcap-str"),
    Row(A, "softcap", "<= 0", Arg, ref="softcap-zero"),
    Row(A, "softcap", "NaN or infinite", Arg, ref="softcap-nan"),
    Row(A, "scale", "not a number (bool, str, tensor)", Type, ref="scale-str"),
    Row(A, "scale", "NaN or infinite", Arg, ref="scale-nan"),
    Row(A, "causal", "not a bool", Type, ref="causal-int"),
    Row(A, "return_lse", "not a bool", Type, ref="return-lse-str"),
    Row(A, "deterministic", "not a bool or None", Type, ref="deterministic-str"),
    Row(A, "backend", "unknown name", Arg, ref="backend-unknown"),
    Row(A, "backend", "not a str", Type, ref="backend-not-str"),
    Row(A, "backend", "a list (unhashable)", Type, lambda: attnx.attention(*dense(), backend=["naive"]), words="backend"),
    Row(A, "backend", "declines the problem", NoBackendError,
        lambda: attnx.attention(*dense(), sinks=torch.zeros(HQ), backend="torch"), words="torch"),
    Row(A, "max_seqlen_q", "given without packed q", Arg, lambda: attnx.attention(*dense(), max_seqlen_q=SQ)),
    Row(A, "max_seqlen_k", "given without packed k/v", Arg, lambda: attnx.attention(*dense(), max_seqlen_k=SK)),

    # -- attention, packed sequences --------------------------------------------------------
    Row(AV, "q", "not 3-D (total_q, Hq, D)", Arg, ref="varlen-q-rank4"),
    Row(AV, "k", "not 3-D (total_k, Hkv, D)", Arg, lambda: varlen(tensors=(r(7, HQ, D), r(1, 9, HKV, D), r(1, 9, HKV, D)))),
    Row(AV, "v", "holds another number of tokens than k", Arg,
        lambda: varlen(tensors=(r(7, HQ, D), r(9, HKV, D), r(8, HKV, D))), words="`k` and `v`"),
    Row(AV, "cu_seqlens_q", "not a tensor", Type, lambda: varlen(cu_seqlens_q=list(CU_Q))),
    Row(AV, "cu_seqlens_q", "not int32", Type, ref="cu-seqlens-int64"),
    Row(AV, "cu_seqlens_q", "not 1-D", Arg, lambda: varlen(cu_seqlens_q=i32(*CU_Q)[None])),
    Row(AV, "cu_seqlens_q", "no entries", Arg, lambda: varlen(cu_seqlens_q=i32(), cu_seqlens_k=i32())),
    Row(AV, "cu_seqlens_q", "on another device", Arg, lambda: varlen(cu_seqlens_q=i32(*CU_Q).to("meta"))),
    Row(AV, "max_seqlen_q", "not given, with meta tensors (offsets that cannot be read)", Arg,
        lambda: attnx.attention(*(t.to("meta") for t in packed()), cu_seqlens_q=i32(*CU_Q).to("meta"),
                                cu_seqlens_k=i32(*CU_K).to("meta"), max_seqlen_k=5), words="`max_seqlen_q`"),
    Row(AV, "cu_seqlens_q", "without packed k/v or a cache", Arg, ref="cu-seqlens-q-alone"),
    Row(AV, "cu_seqlens_q", "values fall or do not start at 0 (naive/blocked: checked on the host)", Arg,
        lambda: varlen(cu_seqlens_q=i32(0, 5, 3), max_seqlen_q=5, backend="naive")),
    Row(AV, "cu_seqlens_k", "not B + 1 entries", Arg, ref="cu-seqlens-k-length"),
    Row(AV, "cu_seqlens_k", "without packed q", Arg, lambda: attnx.attention(*dense(), cu_seqlens_k=i32(0, 3, 7)),
        words="`cu_seqlens_k`"),
    Row(AV, "cu_seqlens_k", "together with seqlens_k or page_table", Arg, lambda: varlen(seqlens_k=i32(3, 5)),
        words="`cu_seqlens_k`"),
    Row(AV, "cu_seqlens_k", "values past the packed keys (naive/blocked: checked on the host)", Arg,
        lambda: varlen(cu_seqlens_k=i32(0, 4, 11), max_seqlen_k=7, backend="naive")),
    Row(AV, "max_seqlen_q", "not an int", Type, lambda: varlen(max_seqlen_q=4.0)),
    Row(AV, "max_seqlen_q", "negative", Arg, lambda: varlen(max_seqlen_q=-1)),
    Row(AV, "max_seqlen_k", "not an int", Type, lambda: varlen(max_seqlen_k="5")),
    Row(AV, "mask", "with packed tensors", Arg, lambda: varlen(mask=torch.ones(3, 4, dtype=torch.bool))),
    Row(AV, "sinks", "not (Hq,)", Arg, lambda: varlen(sinks=torch.zeros(HKV))),
    Row(AV, "alibi_slopes", "(B, Hq) with another B", Arg, lambda: varlen(alibi_slopes=torch.ones(3, HQ))),

    # -- attention, KV cache ----------------------------------------------------------------
    Row(AC, "k", "not 4-D", Arg, lambda: cached(tensors=(r(B, HQ, 1, D), r(B, 6, D), r(B, 6, D)))),
    Row(AC, "k", "batch differs from q", Arg, lambda: cached(tensors=(r(B, HQ, 1, D), r(3, HKV, 6, D), r(3, HKV, 6, D))),
        words="batch"),
    Row(AC, "seqlens_k", "not a tensor", Type, lambda: cached(seqlens_k=[3, 5])),
    Row(AC, "seqlens_k", "not int32", Type, lambda: cached(seqlens_k=torch.tensor([3, 5]))),
    Row(AC, "seqlens_k", "not 1-D", Arg, lambda: cached(seqlens_k=i32(3, 5)[None])),
    Row(AC, "seqlens_k", "not B entries", Arg, ref="seqlens-k-length"),
    Row(AC, "seqlens_k", "on another device", Arg, lambda: cached(seqlens_k=i32(3, 5).to("meta"))),
    Row(AC, "seqlens_k", "values outside [0, capacity] (naive/blocked: checked on the host)", Arg,
        lambda: cached(seqlens_k=i32(3, 7), backend="naive")),
    Row(AC, "mask", "with a cache", Arg, ref="mask-with-cache"),
    Row(AC, "max_seqlen_k", "given with a cache", Arg, lambda: cached(max_seqlen_k=6)),

    # -- attention, paged cache -------------------------------------------------------------
    Row(AP, "k", "not a 4-D page pool", Arg, lambda: paged(tensors=(r(B, HQ, 1, D), r(3, 4, D), r(3, 4, D)))),
    Row(AP, "v", "pool differs from k's in pages", Arg,
        lambda: paged(tensors=(r(B, HQ, 1, D), r(3, 4, HKV, D), r(2, 4, HKV, D))), words="pools"),
    Row(AP, "k", "pages of 0 rows", Arg, lambda: paged(tensors=(r(B, HQ, 1, D), r(3, 0, HKV, D), r(3, 0, HKV, D))),
        words="pages"),
    Row(AP, "page_table", "not a tensor", Type, lambda: paged(page_table=[[0, 1], [2, 0]])),
    Row(AP, "page_table", "not int32", Type, ref="page-table-int64"),
    Row(AP, "page_table", "not 2-D", Arg, lambda: paged(page_table=table([0, 1], [2, 0]).flatten())),
    Row(AP, "page_table", "not one row per sequence", Arg, ref="page-table-rows"),
    Row(AP, "page_table", "on another device", Arg, lambda: paged(page_table=table([0, 1], [2, 0]).to("meta"))),
    Row(AP, "page_table", "a used page outside the pool (naive/blocked: checked on the host)", Arg,
        lambda: paged(page_table=table([3, 1], [2, 0]), backend="naive")),
    Row(AP, "seqlens_k", "missing", Arg, ref="page-table-without-lengths"),
    Row(AP, "seqlens_k", "past the page table (naive/blocked: checked on the host)", Arg,
        lambda: paged(seqlens_k=i32(3, 9), backend="naive")),

    # -- attention inside attnx.validate_indices(): values read first, the bad entry named -----
    Row(VI, "cu_seqlens_q", "does not start at 0", Arg, lambda: validated(varlen, cu_seqlens_q=i32(1, 3, 7)),
        words="`cu_seqlens_q`[0] = 1"),
    Row(VI, "cu_seqlens_q", "an entry below the one before", Arg,
        lambda: validated(varlen, cu_seqlens_q=i32(0, 5, 3), max_seqlen_q=5), words="`cu_seqlens_q`[2] = 3 <"),
    Row(VI, "cu_seqlens_k", "does not end at the packed length", Arg,
        lambda: validated(varlen, cu_seqlens_k=i32(0, 4, 8)), words="`cu_seqlens_k`[2] = 8"),
    Row(VI, "max_seqlen_q", "below a packed sequence's length", Arg, lambda: validated(varlen, max_seqlen_q=3)),
    Row(VI, "max_seqlen_k", "below a packed sequence's length", Arg, lambda: validated(varlen, max_seqlen_k=4)),
    Row(VI, "seqlens_k", "above the cache capacity", Arg, lambda: validated(cached, seqlens_k=i32(3, 7)),
        words="`seqlens_k`[1] = 7"),
    Row(VI, "seqlens_k", "negative", Arg, lambda: validated(cached, seqlens_k=i32(-1, 5)), words="`seqlens_k`[0] = -1"),
    Row(VI, "seqlens_k", "past the page table", Arg, lambda: validated(paged, seqlens_k=i32(3, 9)),
        words="`seqlens_k`[1] = 9"),
    Row(VI, "page_table", "a used entry outside the pool", Arg,
        lambda: validated(paged, page_table=table([0, 1], [2, -1])), words="`page_table`[1, 1] = -1"),
    Row("plan (validate_indices)", "page_table", "a used entry outside the pool", Arg,
        lambda: validated(attnx.plan, q=pools()[0], k=pools()[1], v=pools()[2], seqlens_k=i32(3, 5),
                          page_table=table([0, 1], [2, 3])), words="`page_table`[1, 1] = 3"),
    Row("check_indices", "cu_seqlens_k", "an entry below the one before", Arg,
        lambda: attnx.check_indices(*packed(), cu_seqlens_q=i32(*CU_Q), cu_seqlens_k=i32(0, 10, 9)),
        words="`cu_seqlens_k`[2] = 9 <"),

    # -- merge --------------------------------------------------------------------------------
    Row("merge", "outs", "a tensor, not a list of parts", Type, lambda: attnx.merge(*out_lse())),
    Row("merge", "outs", "None", Type, lambda: attnx.merge(None, None)),
    Row("merge", "outs", "empty", Arg, lambda: attnx.merge([], [])),
    Row("merge", "lses", "another number of parts than outs", Arg, lambda: merge(lses=[out_lse()[1]])),
    Row("merge", "outs", "holds something else than tensors", Type, lambda: merge(outs=[[0.0], [0.0]])),
    Row("merge", "outs", "not a float dtype", Type, lambda: merge(outs=[torch.ones(B, HQ, SQ, D, dtype=torch.int64)] * 2)),
    Row("merge", "lses", "not a float dtype", Type, lambda: merge(lses=[torch.zeros(B, HQ, SQ, dtype=torch.int64)] * 2)),
    Row("merge", "outs", "not 4-D (bhsd/bshd) or 3-D (varlen)", Arg, lambda: merge(outs=[r(HQ, SQ, D)] * 2)),
    Row("merge", "lses", "not 3-D (bhsd/bshd) or 2-D (varlen)", Arg, lambda: merge(lses=[r(B, HQ)] * 2)),
    Row("merge", "outs", "parts differ in shape or dtype", Arg,
        lambda: merge(outs=[r(B, HQ, SQ, D), r(B, HQ, SQ, D).double()]), words="part 1"),
    Row("merge", "lses", "does not match out in the layout", Arg, lambda: merge(lses=[r(B, HQ, SQ + 1)] * 2),
        words="lse"),
    Row("merge", "outs", "parts on different devices", Arg, lambda: merge(outs=[r(B, HQ, SQ, D), r(B, HQ, SQ, D, device="meta")]),
        words="`outs` must be on"),
    Row("merge", "lses", "on another device than outs", Arg, lambda: merge(lses=[r(B, HQ, SQ, device="meta")] * 2),
        words="`lses` must be on"),
    Row("merge", "layout", "not 'bhsd', 'bshd' or 'varlen'", Arg, lambda: merge(layout="thd")),
    Row("merge", "layout", "not a str", Arg, lambda: merge(layout=["bhsd"])),

    # -- plan and Plan.run --------------------------------------------------------------------
    Row("plan", "(every attention argument)", "as attention (same checks)", Arg, lambda: planned(window=(-1, 0)),
        words="`window`"),
    Row("plan", "return_lse", "not a bool", Type, lambda: planned(return_lse=1)),
    Row("plan", "backend", "unknown name", Arg, lambda: planned(backend="no-such-backend"), words="backend"),
    Row("plan", "backend", "declines the problem", NoBackendError, lambda: planned(sinks=torch.zeros(HQ), backend="torch"),
        words="torch"),
    Row("Plan.run", "(options)", "a non-tensor option (fixed at plan time)", Arg, lambda: run_plan(causal=True),
        words="causal"),

    # -- make_problem ---------------------------------------------------------------------------
    Row("make_problem", "(every attention argument)", "as attention (same checks)", Arg,
        lambda: attnx.make_problem(*dense(), window=(-1, 0)), words="`window`"),
    Row("make_problem", "wants_lse", "not a bool", Type, lambda: attnx.make_problem(*dense(), wants_lse=1),
        words="`wants_lse`"),
    Row("Plan.run", "(options)", "an unknown keyword", Arg, lambda: run_plan(dropout=0.1), words="dropout"),
    Row("Plan.run", "q", "not a tensor", Type, lambda: run_plan(tensors=([0.0],) + dense()[1:])),
    Row("Plan.run", "q", "another shape than planned", Arg,
        lambda: run_plan(tensors=(r(B, HQ, SQ + 1, D),) + dense()[1:]), words="seqlen_q"),
    Row("Plan.run", "q, k, v", "another dtype than planned", Arg,
        lambda: run_plan(tensors=tuple(t.double() for t in dense())), words="dtype"),
    Row("Plan.run", "mask", "missing when planned with one", Arg,
        lambda: run_plan({"mask": torch.ones(SQ, SK, dtype=torch.bool)}), words="mask"),
    Row("Plan.run", "mask", "bad as in attention", Arg,
        lambda: run_plan({"mask": torch.ones(SQ, SK, dtype=torch.bool)}, mask=torch.ones(SQ, SK + 1, dtype=torch.bool))),
    Row("Plan.run", "q", "needs gradients when the plan did not", Arg,
        lambda: run_plan(tensors=(r(B, HQ, SQ, D).requires_grad_(),) + dense()[1:]), words="needs_grad"),

    # -- KVCache (more rows in tests/test_kvcache_object.py and tests/test_serving_review.py) ---------
    Row("KVCache", "v", "shares memory with k (the same tensor)", Arg, lambda: attnx.KVCache(*[torch.zeros(B, 6, HKV, D)] * 2)),
    Row("KVCache", "page_table", "a meta tensor", Arg,
        lambda: attnx.KVCache(*(torch.zeros(3, 4, HKV, D, device="meta") for _ in range(2)),
                              page_table=torch.zeros(B, 2, dtype=torch.int32, device="meta"))),
    Row("KVCache.attend", "max_seqlen_q", "below a sequence's packed new tokens", Arg,
        lambda: attnx.KVCache.allocate(B, 8, HKV, D).attend(r(7, HQ, D), r(7, HKV, D), r(7, HKV, D), cu_seqlens=i32(*CU_Q),
                                                            max_seqlen_q=3)),
    Row("KVCache.append", "(the cache)", "made inside torch.inference_mode, changed outside it", Arg,
        lambda: inference_cache().append(r(B, HKV, 1, D), r(B, HKV, 1, D)), words="inference_mode"),

    # -- compat: scaled_dot_product_attention ---------------------------------------------------
    Row("compat sdpa", "query", "not a tensor", Type, lambda: sdpa([[1.0]], qkv3(3, 4), qkv3(3, 4))),
    Row("compat sdpa", "query", "fewer than 2 dims", Compat, lambda: sdpa(qkv3(4), qkv3(3, 4), qkv3(3, 4))),
    Row("compat sdpa", "key", "last dim differs from query's", Arg, lambda: sdpa(qkv3(2, 3, 4), qkv3(2, 3, 5), qkv3(2, 3, 4)),
        words="`k` head dim"),
    Row("compat sdpa", "value", "sequence length differs from key's", Arg,
        lambda: sdpa(qkv3(2, 3, 4), qkv3(2, 3, 4), qkv3(2, 2, 4)), words="`v`"),
    Row("compat sdpa", "key", "dtype differs from query's", Type,
        lambda: sdpa(qkv3(2, 3, 4), qkv3(2, 3, 4).double(), qkv3(2, 3, 4)), words="`k`"),
    Row("compat sdpa", "query", "integer dtype", Type,
        lambda: sdpa(*(torch.ones(2, 3, 4, dtype=torch.int64) for _ in range(3))), words="`q`"),
    Row("compat sdpa", "query, key, value", "batch dims do not broadcast", Compat,
        lambda: sdpa(qkv3(2, 1, 3, 4), qkv3(3, 1, 3, 4), qkv3(3, 1, 3, 4)), words="batch"),
    Row("compat sdpa", "key", "heads neither equal nor 1, without enable_gqa", Compat,
        lambda: sdpa(qkv3(1, 4, 3, 4), qkv3(1, 2, 3, 4), qkv3(1, 2, 3, 4)), words="heads"),
    Row("compat sdpa", "enable_gqa", "key heads do not divide query heads", Compat,
        lambda: sdpa(qkv3(1, 4, 3, 4), qkv3(1, 3, 3, 4), qkv3(1, 3, 3, 4), enable_gqa=True), words="enable_gqa"),
    Row("compat sdpa", "enable_gqa", "not a bool", Type,
        lambda: sdpa(qkv3(1, 4, 3, 4), qkv3(1, 2, 3, 4), qkv3(1, 2, 3, 4), enable_gqa="yes")),
    Row("compat sdpa", "attn_mask", "not a tensor", Type, lambda: sdpa(*(qkv3(2, 3, 4) for _ in range(3)), attn_mask=[[True]])),
    Row("compat sdpa", "attn_mask", "integer dtype", Compat,
        lambda: sdpa(*(qkv3(2, 3, 4) for _ in range(3)), attn_mask=torch.ones(3, 3, dtype=torch.int32)), words="attn_mask"),
    Row("compat sdpa", "attn_mask", "does not broadcast", Arg,
        lambda: sdpa(*(qkv3(2, 3, 4) for _ in range(3)), attn_mask=torch.ones(3, 4, dtype=torch.bool)), words="`mask`"),
    Row("compat sdpa", "attn_mask", "given with is_causal=True", Compat,
        lambda: sdpa(*(qkv3(2, 3, 4) for _ in range(3)), is_causal=True, attn_mask=torch.ones(3, 3, dtype=torch.bool)),
        words="attn_mask"),
    Row("compat sdpa", "dropout_p", "not 0 (attnx has no dropout)", Compat,
        lambda: sdpa(*(qkv3(2, 3, 4) for _ in range(3)), dropout_p=0.1), words="dropout_p"),
    Row("compat sdpa", "dropout_p", "not a number", Type, lambda: sdpa(*(qkv3(2, 3, 4) for _ in range(3)), dropout_p="0")),
    Row("compat sdpa", "is_causal", "not a bool", Type, lambda: sdpa(*(qkv3(2, 3, 4) for _ in range(3)), is_causal=1)),
    Row("compat sdpa", "scale", "not a number", Type, lambda: sdpa(*(qkv3(2, 3, 4) for _ in range(3)), scale="1")),
    Row("compat sdpa", "scale", "NaN or infinite", Compat,
        lambda: sdpa(*(qkv3(2, 3, 4) for _ in range(3)), scale=math.nan), words="`scale`"),
    Row("compat sdpa", "attn_mask", "more dims than the scores", Compat,
        lambda: sdpa(*(qkv3(3, 4) for _ in range(3)), attn_mask=torch.ones(1, 3, 3, dtype=torch.bool)),
        words="attn_mask"),
    Row("compat sdpa", "attn_mask", "a causal bias object with is_causal=True", Compat,
        lambda: sdpa(*(qkv3(1, 2, 3, 4) for _ in range(3)), attn_mask=_causal_bias(3, 3), is_causal=True)),
    Row("compat sdpa", "attn_mask", "a causal bias object for other lengths", Compat,
        lambda: sdpa(*(qkv3(1, 2, 3, 4) for _ in range(3)), attn_mask=_causal_bias(5, 3))),

    # -- compat: flash-attn -------------------------------------------------------------------
    Row(FA, "q", "not a tensor", Type, lambda: fa.flash_attn_func([1.0], bshd(1, 3, 2, 4), bshd(1, 3, 2, 4))),
    Row(FA, "q", "not 4-D (batch, seqlen, nheads, d)", Arg, lambda: fa.flash_attn_func(r(3, 2, 4), bshd(1, 3, 2, 4),
                                                                                       bshd(1, 3, 2, 4))),
    Row(FA, "dropout_p", "not 0", Compat, lambda: fa_dense(dropout_p=0.1), words="dropout_p"),
    Row(FA, "window_size", "not a pair", Type, lambda: fa_dense(window_size=3)),
    Row(FA, "window_size", "a side not an int", Type, lambda: fa_dense(window_size=(1.5, 0))),
    Row(FA, "softcap", "not a number", Type, lambda: fa_dense(softcap="1")),
    Row(FA, "softcap", "NaN or infinite", Arg, lambda: fa_dense(softcap=math.inf)),
    Row(FA, "causal", "not a bool", Type, lambda: fa_dense(causal="yes")),
    Row(FA, "softmax_scale", "not a number", Type, lambda: fa_dense(softmax_scale="1"), words="`scale`"),
    Row(FA, "alibi_slopes", "not float32", Type, lambda: fa_dense(alibi_slopes=torch.ones(2, dtype=torch.float64))),
    Row(FA, "deterministic", "not a bool", Type, lambda: fa_dense(deterministic="yes")),
    Row(FA, "return_attn_probs", "not a bool", Type, lambda: fa_dense(return_attn_probs=1)),
    Row("flash_attn_kvpacked_func", "kv", "not a tensor", Type,
        lambda: fa.flash_attn_kvpacked_func(bshd(1, 3, 2, 4), [1.0])),
    Row("flash_attn_kvpacked_func", "kv", "dim 2 is not 2 (k, v)", Arg,
        lambda: fa.flash_attn_kvpacked_func(bshd(1, 3, 2, 4), r(1, 3, 3, 2, 4))),
    Row("flash_attn_qkvpacked_func", "qkv", "not a tensor", Type, lambda: fa.flash_attn_qkvpacked_func([1.0])),
    Row("flash_attn_qkvpacked_func", "qkv", "dim 2 is not 3 (q, k, v)", Arg,
        lambda: fa.flash_attn_qkvpacked_func(r(1, 3, 2, 2, 4))),
    Row(FAV, "cu_seqlens_k", "not a tensor", Type, lambda: fa_varlen(cu_seqlens_k=list(CU_K))),
    Row(FAV, "max_seqlen_q", "not an int", Type, lambda: fa_varlen(max_seqlen_q="4")),
    Row(FAV, "block_table", "not int32", Type, lambda: fa_varlen(tensors=(r(7, HQ, D),) + pools()[1:],
                                                               cu_seqlens_k=i32(0, 3, 5),
                                                               block_table=table([0, 1], [2, 0]).float()),
        words="`page_table`"),
    Row(FAV, "cu_seqlens_k", "not int32, with block_table", Type,
        lambda: fa_varlen(tensors=(r(7, HQ, D),) + pools()[1:], cu_seqlens_k=torch.tensor([0.0, 3.0, 5.0]),
                          block_table=table([0, 1], [2, 0])), words="`cu_seqlens_k`"),
    Row(FAV, "cu_seqlens_k", "not a tensor, with block_table", Type,
        lambda: fa_varlen(tensors=(r(7, HQ, D),) + pools()[1:], cu_seqlens_k=[0, 3, 5], block_table=table([0, 1], [2, 0]))),
    Row("flash_attn_varlen_qkvpacked_func", "qkv", "not a tensor", Type,
        lambda: fa.flash_attn_varlen_qkvpacked_func([1.0], i32(*CU_Q), 4)),
    Row(FAC, "q", "not a tensor", Type, lambda: kvc(tensors=([1.0], r(B, 6, HKV, D), r(B, 6, HKV, D)))),
    Row(FAC, "k_cache", "not a tensor", Type, lambda: kvc(tensors=(r(B, 1, HQ, D), [1.0], r(B, 6, HKV, D))), words="`k`"),
    Row(FAC, "k", "given without v", Arg, lambda: kvc(k=r(B, 1, HKV, D)), words="`k` and `v`"),
    Row(FAC, "k", "not a tensor", Type, lambda: kvc(k=[1.0], v=[1.0], cache_seqlens=2)),
    Row(FAC, "k", "heads differ from the cache's", Arg, lambda: kvc(k=r(B, 1, HKV + 1, D), v=r(B, 1, HKV + 1, D),
                                                                   cache_seqlens=2)),
    Row(FAC, "k", "head dim differs from the cache's", Arg, lambda: kvc(k=r(B, 1, HKV, D + 8), v=r(B, 1, HKV, D),
                                                                       cache_seqlens=2)),
    Row(FAC, "k_cache", "not 4-D, with new keys", Arg,
        lambda: kvc(tensors=(r(B, 1, HQ, D), r(B, 6, HKV * D), r(B, 6, HKV * D)), k=r(B, 1, HKV, D), v=r(B, 1, HKV, D),
                    cache_seqlens=2), words="`k_cache`"),
    Row(FAC, "k", "batch differs from q", Arg, lambda: kvc(k=r(B + 1, 1, HKV, D), v=r(B + 1, 1, HKV, D), cache_seqlens=2)),
    Row(FAC, "cache_seqlens", "missing when k, v are appended", Arg,
        lambda: kvc(k=r(B, 1, HKV, D), v=r(B, 1, HKV, D))),
    Row(FAC, "cache_seqlens", "the new keys do not fit the cache", Arg,
        lambda: kvc(k=r(B, 2, HKV, D), v=r(B, 2, HKV, D), cache_seqlens=5), words="cache_seqlens"),
    Row(FAC, "cache_seqlens", "not an int or a tensor", Type, lambda: kvc(cache_seqlens=2.0)),
    Row(FAC, "cache_seqlens", "a float tensor", Arg, lambda: kvc(cache_seqlens=torch.tensor([2.0, 3.0]))),
    Row(FAC, "cache_seqlens", "a bool", Type, lambda: kvc(cache_seqlens=True)),
    Row(FAC, "cache_seqlens", "a meta tensor (its values are read on the host)", Arg,
        lambda: kvc(k=r(B, 1, HKV, D), v=r(B, 1, HKV, D), cache_seqlens=torch.empty(B, dtype=torch.int32,
                                                                                    device="meta"))),
    Row(FAC, "k", "dtype differs from the cache's", Arg,
        lambda: kvc(k=r(B, 1, HKV, D).double(), v=r(B, 1, HKV, D).double(), cache_seqlens=2), words="dtype"),
    Row(FAC, "v_cache", "shares memory with k_cache, with new keys", Arg,
        lambda: (lambda c: kvc(tensors=(r(B, 1, HQ, D), c, c), k=r(B, 1, HKV, D), v=r(B, 1, HKV, D),
                               cache_seqlens=2))(r(B, 6, HKV, D)), words="share memory"),
    Row(FAC, "cache_seqlens", "past the cache (naive/blocked: checked on the host)", Arg,
        lambda: kvc(cache_seqlens=9, ), words="seqlens_k"),
    Row(FAC, "cache_seqlens", "one sequence without room for the new keys", Arg,
        lambda: kvc(k=r(B, 2, HKV, D), v=r(B, 2, HKV, D), cache_seqlens=i32(1, 5)), words="`cache_seqlens`[1] + new"),
    Row(FAC, "block_table", "a page the new keys go to outside the pool", Arg,
        lambda: kvc_pools(k=r(B, 1, HKV, D), v=r(B, 1, HKV, D), cache_seqlens=i32(2, 4), block_table=table([0, 1], [2, -1])),
        words="`block_table`[1, 1] = -1"),
    Row(FAC, "block_table", "not int32, with new keys", Type,
        lambda: kvc_pools(k=r(B, 1, HKV, D), v=r(B, 1, HKV, D), cache_seqlens=2, block_table=table([0, 1], [2, 0]).long())),
    Row(FAC, "cache_batch_idx", "not an integer tensor", Type, lambda: kvc(cache_seqlens=2,
                                                                          cache_batch_idx=torch.tensor([0.0, 1.0]))),
    Row(FAC, "cache_batch_idx", "a row outside the cache", Arg, lambda: kvc(cache_seqlens=2, cache_batch_idx=i32(0, 5))),
    Row(FAC, "cache_batch_idx", "with a paged cache", Compat,
        lambda: kvc_pools(cache_seqlens=2, cache_batch_idx=i32(0, 1), block_table=table([0, 1], [2, 0])),
        words="cache_batch_idx"),
    Row(FAC, "block_table", "not int32", Type, lambda: kvc_pools(cache_seqlens=2, block_table=table([0, 1], [2, 0]).float()),
        words="`page_table`"),
    Row(FAC, "rotary_cos", "given (rotary embedding is not supported)", Compat, lambda: kvc(rotary_cos=r(6, 4)),
        words="rotary"),
    Row(FAC, "cache_leftpad", "given (not supported)", Compat, lambda: kvc(cache_leftpad=i32(0, 0)), words="cache_leftpad"),
    Row(FAC, "num_splits", "not an int >= 0", Type, lambda: kvc(num_splits=-1)),
]


def _load_test_errors():
    spec = importlib.util.spec_from_file_location("_attnx_test_errors_rows", ROOT / "tests" / "test_errors.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {bad_id: error for bad_id, _, error, _ in module.BAD}


RUN = [row for row in ROWS if row.call is not None]
REFS = [row for row in ROWS if row.ref is not None]


def test_rows_are_distinct_and_well_formed():
    ids = [row.id for row in ROWS]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    for row in ROWS:
        assert (row.call is None) != (row.ref is None), f"{row.id}: give a call or a ref, not both"
        assert row.known is None or row.known in KNOWN, row.id
        assert issubclass(row.error, attnx.AttnxError), row.id


@pytest.mark.parametrize("row", RUN, ids=lambda row: row.id)
def test_bad_input_raises_a_typed_error_naming_the_argument(row, ran):
    words = row.words or f"`{row.argument}`"
    try:
        row.call()
    except Exception as err:  # noqa: BLE001 - judged below
        raised = err
    else:
        raised = None
    if row.known and not (isinstance(raised, row.error) and words in str(raised)):
        pytest.xfail(f"{row.known} (open): {type(raised).__name__ if raised else 'no error'}: {KNOWN[row.known]}")
    assert raised is not None, f"{row.id}: no error"
    assert isinstance(raised, row.error), f"{row.id}: {type(raised).__name__}: {raised}"
    assert words in str(raised), f"{row.id}: the message does not name {words}: {raised}"
    assert row.known is None, f"{row.id}: {row.known} is fixed: drop `known` from the row and the docs"
    if row.value_check:
        assert set(ran) <= {("naive", "forward"), ("blocked", "forward")}, f"{row.id}: {ran}"
    else:
        assert ran == [], f"{row.id}: a backend ran before the error: {ran}"


def test_dense_rows_are_run_by_test_errors():
    """`ref` rows name calls of tests/test_errors.py (which checks them the same way) with the same error."""
    bad = _load_test_errors()
    for row in REFS:
        assert row.ref in bad, f"{row.id}: no {row.ref!r} in tests/test_errors.py BAD"
        assert issubclass(row.error, bad[row.ref]), f"{row.id}: {row.error.__name__} here, {bad[row.ref].__name__} there"


def markdown_table() -> str:
    lines = ["| entry point | argument | condition | error |", "| --- | --- | --- | --- |"]
    for row in ROWS:
        error = row.error.__name__
        if row.known:
            error += f" (open: {row.known})"
        lines.append(f"| {row.entry} | `{row.argument}` | {row.condition} | {error} |")
    return "\n".join(lines)


def test_docs_table_matches_the_catalogue():
    text = DOC.read_text()
    assert START in text and END in text, f"{DOC} lacks the {START} ... {END} markers"
    table = text.split(START, 1)[1].split(END, 1)[0].strip()
    assert table == markdown_table(), ("docs/errors.md drifted from tests/test_bad_input_catalogue.py: "
                                       "run `python tests/test_bad_input_catalogue.py` and paste its table")
    for tag in {row.known for row in ROWS if row.known}:
        assert f"**{tag}**" in text, f"docs/errors.md does not describe open defect {tag}"


if __name__ == "__main__":
    print(markdown_table())
