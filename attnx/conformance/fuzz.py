"""Property-based fuzzing of one backend against the float64 oracle (hypothesis).

    python -m attnx.conformance.fuzz --backend blocked --count 1000 --seed 1 --report out/fuzz
    TRITON_INTERPRET=1 python -m attnx.conformance.fuzz --backend triton --count 500 --report out/fuzz
    python -m attnx.conformance.fuzz --backend cuda --space gpu --count 2000 --report out/fuzz   # on a GPU

Every problem is a `Case` drawn by hypothesis from the space the backend *declares*
(`case_strategy`: dtypes, head dims 1-256, GQA ratios, zero-size dims, masks, windows,
offsets, sinks, softcap, ALiBi, layouts, strided/sliced/expanded views, NaN inputs, large
logits, the varlen/cache/paged formats) and is checked by `run_case`, the conformance
suite's own check: forward, lse and gradients against the float64 formula with the error
model of docs/semantics.md; NaN where the formula is finite (or the reverse) never passes.

A failure is shrunk by hypothesis to a minimal case with the same kind of failure, recorded,
and the run goes on with a fresh seed until `count` problems have run; a kind of failure is
shrunk once (`max_shrinks` kinds at most). The report (json + md) lists every problem, the
feature coverage and the shrunk failures as regression records: add those to
tests/fuzz_regressions.json, which tests/test_fuzz.py replays.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import math
import pathlib
import platform
import re
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Optional

import torch

import attnx

from .cases import DTYPES, MASK_SHAPES, MEMORY, Case, head_dim_ok
from .check import Result, run_case
from .runner import declarations_on
from .known_issues import KNOWN_ISSUES, KnownIssue, known_issue  # noqa: F401  (re-exported)

# simplest first: hypothesis shrinks a sampled value toward the front of its list
DTYPE_ORDER = ("float32", "float64", "float16", "bfloat16")
COMMON_HEAD_DIMS = (16, 1, 2, 8, 24, 32, 40, 64, 72, 80, 96, 128, 160, 192, 256)
FORMAT_ORDER = (("dense", "dense"), ("dense", "cache"), ("dense", "paged"), ("varlen", "varlen"),
                ("varlen", "cache"), ("varlen", "paged"))
LOW = ("float16", "bfloat16")


@dataclass(frozen=True)
class Space:
    """The sizes a fuzz run draws from (features come from the backend's declarations)."""

    name: str
    max_batch: int
    max_heads_kv: int
    max_group: int            # Hq / Hkv up to this (when the backend declares GQA)
    max_seqlen: int
    edge_seqlens: tuple       # tile-boundary lengths, drawn often
    max_head_dim: int
    max_page_size: int

    def describe(self) -> str:
        return (f"B<={self.max_batch}, Hkv<={self.max_heads_kv}, Hq/Hkv<={self.max_group}, "
                f"S<={max(self.max_seqlen, *self.edge_seqlens)} (edges {', '.join(map(str, self.edge_seqlens))}), "
                f"D<={self.max_head_dim}, page<={self.max_page_size}")


SPACES = {
    # CI on a 2-core CPU (naive, blocked, the Triton interpreter): small enough for ~0.1 s a problem
    "ci": Space("ci", max_batch=3, max_heads_kv=2, max_group=3, max_seqlen=24, edge_seqlens=(15, 16, 17, 31, 32, 33),
                max_head_dim=256, max_page_size=8),
    # a GPU: every tile boundary of the kernels' block sizes (16..128) and several blocks per row
    "gpu": Space("gpu", max_batch=4, max_heads_kv=4, max_group=4, max_seqlen=300,
                 edge_seqlens=(1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 513), max_head_dim=256,
                 max_page_size=64),
}


# -- the strategy ----------------------------------------------------------------------------
def _head_dim_ok(backend, dim: int) -> bool:
    return head_dim_ok(backend, dim)


def _nan_key_visible(c: Case) -> bool:
    """Whether some query row can see the key the NaN case poisons (key min(3, Sk - 1))."""
    key = min(3, c.seqlen_k - 1)
    left, right = c.window if c.window is not None else (None, None)
    if c.causal:
        right = 0 if right is None else min(right, 0)
    offset = c.seqlen_k - c.seqlen_q if c.offset is None else c.offset
    for i in range(c.seqlen_q):
        pos = i + offset
        if (left is None or key >= pos - left) and (right is None or key <= pos + right):
            return True
    return False


def case_strategy(backend, space: Space | str = "ci"):
    """A hypothesis strategy of `Case`s that `backend`'s declarations support, within `space`."""
    from hypothesis import assume
    from hypothesis import strategies as st

    space = SPACES[space] if isinstance(space, str) else space
    dtypes = [d for d in DTYPE_ORDER if DTYPES[d] in backend.dtypes]
    dims = [d for d in COMMON_HEAD_DIMS if d <= space.max_head_dim and _head_dim_ok(backend, d)]
    if backend.head_dims is None:
        top = min(space.max_head_dim, backend.max_head_dim or space.max_head_dim)
        dim_strategy = st.one_of(st.sampled_from(dims), st.integers(1, top))
    else:
        dim_strategy = st.sampled_from(dims)
    formats = [f for f in FORMAT_ORDER if f in backend.formats]
    seqlen = st.one_of(st.integers(1, space.max_seqlen), st.sampled_from(space.edge_seqlens))
    side = st.one_of(st.none(), st.integers(0, space.max_seqlen + 2))
    reach = max(space.max_seqlen, *space.edge_seqlens) + 4
    mask_kinds = [None] + sorted(backend.mask_kinds)
    if not dtypes or not dims or not formats:
        raise ValueError(f"backend {backend.name!r} declares nothing to fuzz (dtypes {dtypes}, dims {dims})")

    @st.composite
    def cases(draw) -> Case:
        # Every choice is drawn whether or not it applies, in a fixed order, so that hypothesis can
        # shrink one choice (a format, a dtype) without shifting the others.
        dtype = draw(st.sampled_from(dtypes))
        q_format, kv_format = draw(st.sampled_from(formats))
        dense = q_format == kv_format == "dense"
        # zero-size problems are valid; drawn now and then (never a backend's job when dense)
        zero = draw(st.sampled_from((None,) * 16 + ("batch", "heads", "seqlen_q", "seqlen_k")))
        sizes = {"batch": draw(st.integers(1, space.max_batch)), "heads": draw(st.integers(1, space.max_heads_kv)),
                 "seqlen_q": draw(seqlen), "seqlen_k": draw(seqlen)}
        if zero is not None:
            sizes[zero] = 0
        group = draw(st.integers(1, space.max_group)) if backend.supports_gqa else 1
        head_dim = draw(dim_strategy)
        head_dim_v = draw(dim_strategy)
        if not (backend.supports_dv_differs and draw(st.booleans())):
            head_dim_v = head_dim
        layout = draw(st.sampled_from(("bhsd", "bshd")))
        memory = draw(st.sampled_from(MEMORY))
        page_size = draw(st.integers(1, space.max_page_size))
        grad = draw(st.booleans()) and bool(backend.supports_backward)
        causal = draw(st.booleans()) and backend.supports_causal
        window = draw(st.one_of(st.none(), st.tuples(side, side)))
        offset = draw(st.one_of(st.none(), st.integers(-reach, reach)))
        kind = draw(st.sampled_from(mask_kinds))
        mask_shape = draw(st.sampled_from(MASK_SHAPES))
        mask_dtype = draw(st.sampled_from([None] + [d for d in DTYPES if d != dtype]))
        mask_grad = draw(st.booleans())
        masked_rows = draw(st.booleans())
        alibi = draw(st.sampled_from((None, "h", "bh")))
        softcap = draw(st.one_of(st.none(), st.floats(0.25, 64.0)))
        scale = draw(st.one_of(st.none(), st.floats(0.01, 4.0)))
        sinks = draw(st.booleans())
        large = draw(st.sampled_from((False, False, False, True)))
        nan = draw(st.sampled_from((False,) * 5 + (True,)))

        nonempty = zero is None
        c = Case("fuzz", dtype, sizes["batch"], sizes["heads"] * group, sizes["heads"], sizes["seqlen_q"],
                 sizes["seqlen_k"], head_dim, head_dim_v, layout=layout, q_format=q_format, kv_format=kv_format,
                 memory=memory if dense else "contiguous", page_size=page_size if kv_format == "paged" else None,
                 grad=grad, causal=causal, window=window if backend.supports_window else None,
                 offset=offset if backend.supports_offset else None,
                 alibi=alibi if backend.supports_alibi else None,
                 softcap=softcap if backend.supports_softcap else None, sinks=sinks and backend.supports_sinks)
        if dense and kind is not None:
            additive = kind == "additive"
            c = replace(c, mask=kind, mask_shape=mask_shape, mask_dtype=mask_dtype if additive else None,
                        mask_grad=additive and grad and backend.supports_mask_grad and mask_grad,
                        masked_rows=nonempty and masked_rows)
        if dense and nonempty and dtype in LOW and large:
            c = replace(c, large_logits=True)  # the scale makes max |score| = 1e4
        else:
            c = replace(c, scale=scale)
        if dense and nonempty and c.mask is None and not c.large_logits and nan:
            # one NaN in k: exactly the rows that see it must come out NaN (forward only: the contract
            # defines NaN propagation for out and lse); only where some row can see that key
            poisoned = replace(c, nan=True, grad=False)
            if _nan_key_visible(poisoned):
                c = poisoned
        assume(not backend.declared_reasons(c.problem()))
        return c

    return cases()


# -- failures ------------------------------------------------------------------------------
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|inf|nan")


def failure_kinds(result: Result) -> frozenset:
    """The kinds of a result's failures, without the numbers ("dq error > bound", "raised ValueError")."""
    kinds = set()
    for message in result.failures:
        line = message.splitlines()[0]
        if line.startswith("raised "):
            kinds.add(line.split(":")[0])
        else:
            kinds.add(" ".join(_NUMBER.sub("#", line).split()))
    return frozenset(kinds)


def case_from_dict(d: dict) -> Case:
    """The `Case` of a record written by `Case.as_dict` (extra keys such as id and seed are ignored)."""
    names = {f.name for f in dataclasses.fields(Case)}
    fields = {k: v for k, v in d.items() if k in names}
    if fields.get("window") is not None:
        fields["window"] = tuple(fields["window"])
    return Case(**fields)


def regression_record(backend: str, result: Result, *, seed: Optional[int], original: Optional[Result] = None,
                      note: str = "") -> dict:
    """A record for tests/fuzz_regressions.json: the shrunk case and what it did."""
    record = {"backend": backend, "case": _case_dict(result.case), "status": "open",
              "found": datetime.date.today().isoformat(), "seed": seed, "device": result.device,
              "failures": [f.splitlines()[0] for f in result.failures], "note": note}
    if original is not None:
        record["original"] = {"case": _case_dict(original.case),
                              "failures": [f.splitlines()[0] for f in original.failures]}
    return record


def _case_dict(case: Case) -> dict:
    d = case.as_dict()
    d.pop("seed", None)
    return d


# -- the run -------------------------------------------------------------------------------
@dataclass
class Finding:
    """One shrunk failure: the minimal case hypothesis found, and the problem that first failed."""

    kinds: frozenset
    minimal: Result
    original: Result
    shrink_steps: int
    shrink_seconds: float


@dataclass
class FuzzRun:
    backend: str
    device: str
    seed: int
    space: Space
    results: list = dataclasses.field(default_factory=list)      # every generated problem, in order
    findings: list = dataclasses.field(default_factory=list)     # shrunk failures
    seconds: float = 0.0
    stopped: Optional[str] = None                                # why it ended before `count`

    @property
    def counts(self) -> dict:
        tally = collections.Counter(r.status for r in self.results)
        known = collections.Counter(k.tag for k in map(known_issue, self.results) if k is not None)
        return {"problems": len(self.results), "pass": tally["pass"], "fail": tally["fail"],
                "known": sum(known.values()), "new": tally["fail"] - sum(known.values()),
                "known_by_tag": dict(sorted(known.items())), "declined": tally["declined"],
                "shrunk": len(self.findings)}

    def new_failures(self) -> list:
        """Failed results no known issue explains."""
        return [r for r in self.results if r.status == "fail" and known_issue(r) is None]


class _OutOfTime(BaseException):
    """Raised through hypothesis (which lets BaseException pass unshrunk) when the time limit is up."""


class _FuzzFailure(AssertionError):
    """Raised so hypothesis shrinks the failing case."""


def _fail(case: Case) -> None:
    # one raise site: hypothesis tells failures apart by where they were raised, and shrinks one
    raise _FuzzFailure(case.id)


def _seed_for(seed: int, attempt: int) -> int:
    return seed if attempt == 0 else (seed * 1_000_003 + attempt * 7919) % (1 << 32)


def fuzz(backend_name: str, count: int, seed: int = 0, *, device: str = "cpu", space: Space | str = "ci",
         shrink: bool = True, max_shrinks: int = 5, shrink_seconds: float = 120.0,
         time_limit: Optional[float] = None, allow_extra_declines: bool = True, shrink_known: bool = False,
         progress: Optional[Callable[[Result, int], None]] = None) -> FuzzRun:
    """Run `count` hypothesis-drawn problems on `backend_name`; shrink up to `max_shrinks` kinds of failure.

    Declined problems (the backend's `extra_reasons`, when `allow_extra_declines`) are recorded
    and do not count toward `count`. Failures a `KNOWN_ISSUES` entry explains are recorded and,
    unless `shrink_known`, not shrunk. With a fixed `seed` the run is reproducible.
    """
    from hypothesis import HealthCheck, Phase, Verbosity, given, reject, settings
    from hypothesis import seed as hypothesis_seed

    backend = attnx.get_backend(backend_name)
    space = SPACES[space] if isinstance(space, str) else space
    strategy = case_strategy(declarations_on(backend, str(device)), space)  # what it declares on that device
    run = FuzzRun(backend_name, str(device), seed, space)
    known: set = set()
    start = time.perf_counter()

    def executed() -> int:
        return sum(r.status != "declined" for r in run.results)

    attempt = 0
    while executed() < count:
        state = {"target": None, "best": None, "original": None, "steps": 0, "shrink_start": 0.0}
        budget = count - executed()

        def check(case: Case) -> None:
            if time_limit is not None and time.perf_counter() - start > time_limit and state["target"] is None:
                raise _OutOfTime()
            if state["target"] is not None:   # shrinking
                best = state["best"]
                if time.perf_counter() - state["shrink_start"] > shrink_seconds:
                    if case == best.case:      # hypothesis replays the minimal case last: keep it failing
                        _fail(case)
                    return
                state["steps"] += 1
                result = run_case(backend_name, case, device, allow_extra_declines=allow_extra_declines)
                if result.status == "fail" and failure_kinds(result) & state["target"] and \
                        (shrink_known or known_issue(result) is None):
                    state["best"] = result
                    _fail(case)
                return
            result = run_case(backend_name, case, device, allow_extra_declines=allow_extra_declines)
            run.results.append(result)
            if progress is not None:
                progress(result, executed())
            if result.status == "declined":
                reject()
            kinds = failure_kinds(result)
            if result.status == "fail" and shrink and len(run.findings) < max_shrinks and kinds - known and \
                    (shrink_known or known_issue(result) is None):
                state.update(target=kinds - known, best=result, original=result, shrink_start=time.perf_counter())
                _fail(case)

        prop = given(strategy)(check)
        prop = settings(max_examples=budget, database=None, deadline=None, derandomize=False,
                        phases=(Phase.generate, Phase.shrink) if shrink else (Phase.generate,),
                        suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet,
                        report_multiple_bugs=False, print_blob=False)(prop)
        prop = hypothesis_seed(_seed_for(seed, attempt))(prop)
        attempt += 1
        before = executed()
        try:
            prop()
        except _OutOfTime:
            run.stopped = f"time limit of {time_limit:g} s reached"
            break
        except Exception as err:  # noqa: BLE001 - a shrunk failure (or hypothesis' own error) ends this attempt
            if state["target"] is None:
                run.stopped = f"hypothesis stopped: {type(err).__name__}: {str(err)[:300]}"
                break
            known.update(state["target"])
            run.findings.append(Finding(state["target"], state["best"], state["original"], state["steps"],
                                        time.perf_counter() - state["shrink_start"]))
            continue
        if executed() == before or executed() < count and attempt > 50:
            run.stopped = "hypothesis generated no further problems (the declared space is exhausted?)"
            break
    run.seconds = time.perf_counter() - start
    return run


# -- regressions --------------------------------------------------------------------------
def load_regressions(path) -> list[dict]:
    data = json.loads(pathlib.Path(path).read_text())
    return data["cases"] if isinstance(data, dict) else data


def replay(records: Iterable[dict], backend_name: str, device: str = "cpu") -> list[tuple[dict, Result]]:
    """Run every record for `backend_name` again; (record, result) pairs."""
    return [(r, run_case(backend_name, case_from_dict(r["case"]), device, allow_extra_declines=True))
            for r in records if r["backend"] == backend_name]


# -- reports -------------------------------------------------------------------------------
def coverage(cases: Iterable[Case]) -> dict:
    """How many problems exercised each feature value."""
    tally: collections.Counter = collections.Counter()
    for c in cases:
        tally[f"dtype {c.dtype}"] += 1
        tally[f"format {c.q_format}/{c.kv_format}"] += 1
        tally[f"layout {c.layout}"] += 1
        tally[f"memory {c.memory}"] += 1
        tally["gradients" if c.grad else "forward only"] += 1
        zero = [n for n in ("batch", "heads_q", "seqlen_q", "seqlen_k") if getattr(c, n) == 0]
        if zero:
            tally["zero-size " + zero[0]] += 1
        if c.heads_kv and c.heads_q != c.heads_kv:
            tally[f"GQA ratio {c.heads_q // c.heads_kv}"] += 1
        if c.head_dim != c.head_dim_v:
            tally["Dv != D"] += 1
        for label, d in (("D", c.head_dim), ("Dv", c.head_dim_v)):
            tally[f"{label} " + next(b for b, top in (("1-8", 8), ("9-32", 32), ("33-64", 64), ("65-128", 128),
                                                       ("129-256", 256), (">256", math.inf)) if d <= top)] += 1
        longest = max(c.seqlen_q, c.seqlen_k)
        tally["S " + next(b for b, top in (("0", 0), ("1-16", 16), ("17-64", 64), ("65-256", 256), (">256", math.inf))
                          if longest <= top)] += 1
        tally["Sq > Sk" if c.seqlen_q > c.seqlen_k else "Sq <= Sk"] += 1
        for flag in ("causal", "sinks", "nan", "large_logits", "masked_rows", "mask_grad"):
            if getattr(c, flag):
                tally[flag] += 1
        if c.window is not None:
            tally["window " + "/".join("N" if w is None else ("0" if w == 0 else "k") for w in c.window)] += 1
        if c.offset is not None:
            tally["offset " + ("0" if c.offset == 0 else "<0" if c.offset < 0 else ">0")] += 1
        if c.mask:
            tally[f"{c.mask} mask {c.mask_shape}"] += 1
        if c.mask_dtype:
            tally["mask dtype differs"] += 1
        if c.alibi:
            tally[f"alibi {c.alibi}"] += 1
        if c.softcap is not None:
            tally["softcap"] += 1
        if c.scale is not None:
            tally["explicit scale"] += 1
        if c.page_size is not None:
            tally["page size 1" if c.page_size == 1 else "page size > 1"] += 1
    return dict(sorted(tally.items()))


def _worst(result: Result) -> tuple[float, str]:
    ratios = [(result.errors[n] / result.bounds[n] if result.bounds[n] > 0 else math.inf, n)
              for n in result.errors if n in result.bounds]
    return max(ratios) if ratios else (0.0, "")


def _num(x: float):
    return x if math.isfinite(x) else str(x)


def meta(run: FuzzRun, count: int) -> dict:
    return {"backend": run.backend, "device": run.device, "seed": run.seed, "count": count,
            "space": dataclasses.asdict(run.space), "seconds": round(run.seconds, 2), "stopped": run.stopped,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "attnx": attnx.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name() if run.device.startswith("cuda") and torch.cuda.is_available()
            else None, "command": " ".join(sys.argv) if sys.argv and sys.argv[0].endswith("fuzz.py") else None}


def report_json(run: FuzzRun, count: int) -> dict:
    rows = []
    for r in run.results:
        ratio, name = _worst(r)
        row = {"id": r.case.key, "status": r.status, "worst": name, "ratio": _num(round(ratio, 4)),
               "seconds": round(r.seconds, 3)}
        if r.status != "pass":
            issue = known_issue(r)
            row["known"] = issue.tag if issue else None
            row["detail"] = r.as_dict()
        rows.append(row)
    regressions = [regression_record(run.backend, f.minimal, seed=run.seed, original=f.original)
                   for f in run.findings]
    return {"meta": meta(run, count), "summary": run.counts,
            "known_issues": {k.tag: k.summary for k in KNOWN_ISSUES},
            "coverage": coverage(r.case for r in run.results if r.status != "declined"),
            "findings": [{"kinds": sorted(f.kinds), "shrink_steps": f.shrink_steps,
                          "shrink_seconds": round(f.shrink_seconds, 1), "minimal": f.minimal.as_dict(),
                          "original": f.original.as_dict()} for f in run.findings],
            "regressions": regressions, "results": rows}


def report_markdown(run: FuzzRun, count: int) -> str:
    m, c = meta(run, count), run.counts
    lines = [f"# attnx fuzz: {run.backend} on {run.device}", "",
             f"{c['problems']} problems (seed {run.seed}, space `{run.space.name}`: {run.space.describe()}): "
             f"{c['pass']} pass, {c['fail']} fail ({c['new']} new, {c['known']} explained by known issues), "
             f"{c['declined']} declined, in {run.seconds:.1f} s "
             f"({m['date']}; torch {m['torch']}{', ' + m['gpu'] if m['gpu'] else ''}).", ""]
    if run.stopped:
        lines += [f"Stopped early: {run.stopped}.", ""]
    lines += ["Each problem: out, lse and every gradient against the float64 formula, bounds of "
              "docs/semantics.md (Accuracy); NaN where the formula is finite never passes.", ""]
    if run.findings:
        lines += ["## Shrunk failures", ""]
        for f in run.findings:
            lines.append(f"- `{f.minimal.case.id}` ({f.shrink_steps} shrink steps): "
                         + " | ".join(x.splitlines()[0] for x in f.minimal.failures))
            lines.append(f"  - first seen as `{f.original.case.id}`: "
                         + " | ".join(x.splitlines()[0] for x in f.original.failures))
        lines.append("")
    failed = run.new_failures()
    if failed:
        lines += [f"## New failures ({len(failed)})", ""]
        lines += [f"- `{r.case.key}`: " + " | ".join(x.splitlines()[0] for x in r.failures) for r in failed[:200]]
        lines.append("")
    if c["known"]:
        lines += [f"## Failures explained by known issues ({c['known']})", ""]
        for issue in KNOWN_ISSUES:
            hits = [r for r in run.results if known_issue(r) is issue]
            if hits:
                lines.append(f"- **{issue.tag}** ({len(hits)}): {issue.summary}; e.g. `{hits[0].case.key}`: "
                             + " | ".join(x.splitlines()[0] for x in hits[0].failures))
        lines.append("")
    declined = [r for r in run.results if r.status == "declined"]
    if declined:
        reasons = collections.Counter("; ".join(r.reasons) for r in declined)
        lines += ["## Declined (not counted)", ""] + [f"- {n} x {why}" for why, n in reasons.most_common()] + [""]
    lines += ["## Coverage", "", "| feature | problems |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in coverage(r.case for r in run.results if r.status != "declined").items()]
    ranked = sorted((r for r in run.results if r.status == "pass"), key=lambda r: -_worst(r)[0])[:15]
    lines += ["", "## Closest to the bound", "", "| problem | quantity | error / bound |", "| --- | --- | --- |"]
    lines += [f"| `{r.case.key}` | {_worst(r)[1]} | {_worst(r)[0]:.3f} |" for r in ranked]
    slow = sorted(run.results, key=lambda r: -r.seconds)[:5]
    lines += ["", "## Slowest", ""] + [f"- `{r.case.key}`: {r.seconds:.2f} s" for r in slow]
    return "\n".join(lines) + "\n"


def write_report(run: FuzzRun, count: int, directory) -> tuple[pathlib.Path, pathlib.Path]:
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"fuzz-{run.backend}-{run.device.replace(':', '')}-seed{run.seed}"
    md, js = directory / f"{stem}.md", directory / f"{stem}.json"
    md.write_text(report_markdown(run, count))
    js.write_text(json.dumps(report_json(run, count), indent=1))
    return md, js


# -- command line --------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m attnx.conformance.fuzz",
        description="Fuzz one backend with hypothesis-drawn problems against the float64 oracle.",
        epilog="Exit status: 0 when every problem passes, 1 when any fails, 2 when the backend cannot run here. "
               "The Triton interpreter needs TRITON_INTERPRET=1 in the environment.")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--count", type=int, default=200, help="problems to run (declined ones do not count)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--space", choices=sorted(SPACES), default=None,
                        help="sizes to draw from: ci (small, CPU) or gpu (tile boundaries up to 513); "
                             "default gpu on a cuda device, else ci")
    parser.add_argument("--device", default=None, help="cpu or cuda[:N] (default as `python -m attnx.conformance`)")
    parser.add_argument("--report", metavar="DIR", default=None,
                        help="write DIR/fuzz-BACKEND-DEVICE-seedS.md and .json")
    parser.add_argument("--time-limit", type=float, default=None, help="stop after this many seconds")
    parser.add_argument("--no-shrink", action="store_true", help="record failures without shrinking them")
    parser.add_argument("--max-shrinks", type=int, default=5, help="kinds of failure to shrink (default 5)")
    parser.add_argument("--shrink-seconds", type=float, default=120.0, help="time for shrinking one failure")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 on any failure, also those a known issue explains (default: new failures only)")
    parser.add_argument("--strict-declines", action="store_true",
                        help="a problem the declarations allow but extra_reasons declines is a failure")
    parser.add_argument("--replay", metavar="FILE", default=None,
                        help="instead of fuzzing, run the records of FILE (tests/fuzz_regressions.json) for the backend")
    parser.add_argument("-q", "--quiet", action="store_true")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    from .runner import default_device, device_problem

    args = parse_args(argv)
    backend = attnx.get_backend(args.backend)
    device = args.device or default_device(backend)
    why = device_problem(backend, device)
    if why:
        print(f"cannot fuzz: {why}", file=sys.stderr)
        return 2
    if args.replay:
        pairs = replay(load_regressions(args.replay), args.backend, device)
        for record, result in pairs:
            print(f"[{result.status:8}] {result.case.id} (recorded {record.get('status')}) {result.summary()}")
        if args.report:
            path = pathlib.Path(args.report)
            path.mkdir(parents=True, exist_ok=True)
            out = path / f"replay-{args.backend}.json"
            out.write_text(json.dumps([{"record": r, "result": res.as_dict()} for r, res in pairs], indent=1))
            print(f"wrote {out}")
        return 1 if any(res.status == "fail" for _, res in pairs) else 0
    space = args.space or ("gpu" if device.startswith("cuda") else "ci")

    def progress(result: Result, done: int) -> None:
        if result.status == "fail" and known_issue(result) is None:
            print(f"[fail] {result.case.id}: {result.summary()}", flush=True)
        elif not args.quiet and done % 100 == 0 and result.status != "declined":
            print(f"{done}/{args.count} problems", flush=True)

    run = fuzz(args.backend, args.count, args.seed, device=device, space=space, shrink=not args.no_shrink,
               max_shrinks=args.max_shrinks, shrink_seconds=args.shrink_seconds, time_limit=args.time_limit,
               allow_extra_declines=not args.strict_declines, progress=progress)
    c = run.counts
    print(f"{args.backend} on {device}: {c['problems']} problems, {c['pass']} pass, {c['fail']} fail "
          f"({c['new']} new, known: {c['known_by_tag'] or 0}), {c['declined']} declined, {c['shrunk']} shrunk, "
          f"in {run.seconds:.1f} s"
          + (f" (stopped: {run.stopped})" if run.stopped else ""))
    for f in run.findings:
        print(f"shrunk: {f.minimal.case.id}: " + " | ".join(x.splitlines()[0] for x in f.minimal.failures))
    if args.report:
        md, js = write_report(run, args.count, args.report)
        print(f"wrote {md} and {js}")
    failed = c["fail"] if args.strict else c["new"]
    return 1 if failed or run.stopped and c["pass"] < args.count else 0


if __name__ == "__main__":
    sys.exit(main())
