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
import json
import pathlib
import re
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Optional

import attnx

from .cases import DTYPES, MASK_SHAPES, MEMORY, Case, head_dim_ok
from .check import Result, run_case
from .runner import declarations_on
from .known_issues import KNOWN_ISSUES, KnownIssue, known_issue  # noqa: F401  (re-exported)
from .fuzz_report import coverage, meta, report_json, report_markdown, write_report  # noqa: F401  (re-exported)
from .regressions import case_from_dict, load_regressions, regression_record  # noqa: F401  (re-exported)

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
def replay(records: Iterable[dict], backend_name: str, device: str = "cpu") -> list[tuple[dict, Result]]:
    """Run every record for `backend_name` again; (record, result) pairs."""
    return [(r, run_case(backend_name, case_from_dict(r["case"]), device, allow_extra_declines=True))
            for r in records if r["backend"] == backend_name]


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
