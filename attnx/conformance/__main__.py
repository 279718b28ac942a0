"""``python -m attnx.conformance --backend NAME``: run the conformance grid, print and write a report."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import attnx

from .cases import PROFILES
from .report import _meta, counts, write_reports
from .runner import default_device, device_problem, run_cases, select_cases


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m attnx.conformance",
        description="Check a backend against the Accuracy rules of docs/semantics.md on a grid generated from its declarations.",
        epilog="Exit status: 0 when no case fails (declined cases are not failures), 1 when any case fails, "
               "2 when the backend cannot run here at all. Examples: "
               "`python -m attnx.conformance --backend naive --report out/naive` writes out/naive.md and "
               "out/naive.json; `TRITON_INTERPRET=1 python -m attnx.conformance --backend triton --profile interp`.")
    parser.add_argument("--backend", required=True, help="registered backend name (see attnx.list_backends())")
    parser.add_argument("--profile", choices=PROFILES, default="quick",
                        help="quick: every axis value once, for CI (default); full: covering design, minutes on a "
                             "GPU; interp: small sizes for the Triton interpreter on a CPU")
    parser.add_argument("--device", default=None,
                        help="cpu or cuda[:N]; default cuda when the backend runs there and a GPU is present, "
                             "else cpu (cpu whenever TRITON_INTERPRET=1)")
    parser.add_argument("--report", metavar="PATH", default=None,
                        help="write PATH.md and PATH.json (a trailing .md/.json on PATH is dropped); "
                             "default: print only")
    parser.add_argument("--max-seqlen", type=int, default=None, help="skip cases with Sq or Sk above this")
    parser.add_argument("-k", "--match", default=None, help="only cases whose id contains this substring")
    parser.add_argument("--shard", metavar="I/N", default=None, type=_shard,
                        help="only every N-th case starting at case I (0-based), so N processes split the grid "
                             "(under compute-sanitizer, which is slow per process)")
    parser.add_argument("--exclude", metavar="FILE", default=None,
                        help="skip the case ids FILE lists, one per line (this tool's own `[pass    ] ID` "
                             "lines too): resume a sanitizer run over the grid where an earlier one stopped")
    parser.add_argument("--allow-extra-declines", action="store_true",
                        help="report a case declined by extra_reasons (though the declarations support it) "
                             "as declined instead of failed")
    parser.add_argument("--calls-only", action="store_true",
                        help="make each case's calls (forward, backward) without the float64 comparison: status "
                             "`ran`, never `pass`; for compute-sanitizer, whose instrumentation of the oracle's "
                             "own kernels takes most of a case's time")
    parser.add_argument("--list", action="store_true", help="list the case ids and exit")
    parser.add_argument("-q", "--quiet", action="store_true", help="print failures and the summary only")
    return parser.parse_args(argv)


def _shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N, got {text!r}") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"expected 0 <= I < N, got {text!r}")
    return index, count


def excluded_ids(text: str) -> set:
    """Case ids of an --exclude file: bare ids, or progress lines `[status  ] ID (1.2s) ...`."""
    ids = set()
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            line = line.partition("]")[2].strip()
        if line and not line.startswith("#"):
            ids.add(line.split()[0])
    return ids


def main(argv=None) -> int:
    args = parse_args(argv)
    backend = attnx.get_backend(args.backend)
    device = args.device or default_device(backend)
    problem = device_problem(backend, device)
    if problem and not args.list:
        print(f"cannot test: {problem}", file=sys.stderr)
        return 2
    # the grid of what the backend declares on that device (the CPU's where it cannot run here)
    cases = select_cases(args.backend, args.profile, max_seqlen=args.max_seqlen, match=args.match,
                         device=None if problem else device)
    if args.exclude:
        done = excluded_ids(Path(args.exclude).read_text())
        cases = [c for c in cases if c.id not in done]
    if args.shard:
        index, count = args.shard
        cases = cases[index::count]
    if args.list:
        print("\n".join(c.id for c in cases))
        return 0

    def progress(r):
        if not args.quiet or r.status == "fail":
            print(f"[{r.status:8}] {r.case.id} ({r.seconds:.2f}s) {r.summary() if r.status not in ('pass', 'ran') else ''}",
                  flush=True)

    start = time.perf_counter()
    results = run_cases(args.backend, cases, device, allow_extra_declines=args.allow_extra_declines,
                        progress=progress, calls_only=args.calls_only)
    meta = _meta(args.backend, args.profile, device, time.perf_counter() - start)
    c = counts(results)
    print(f"{args.backend} {args.profile} on {device}: {c['cases']} cases, {c['pass']} pass, {c['fail']} fail, "
          f"{c['declined']} declined" + (f", {c['ran']} ran (calls only)" if "ran" in c else "")
          + f" in {meta['seconds']:.1f} s")
    if args.report:
        md_path, json_path = write_reports(results, args.report, meta)
        print(f"wrote {md_path} and {json_path}")
    return 1 if c["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
