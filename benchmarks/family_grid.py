"""The conformance grid (or the fuzzer) with the cuda backend on one kernel family, whatever the GPU.

    python -m benchmarks.family_grid sm80 --backend cuda --profile full --device cuda [conformance options]
    python -m benchmarks.family_grid sm80 fuzz --backend cuda --space gpu --device cuda [fuzz options]

Runs ``python -m attnx.conformance`` (or ``attnx.conformance.fuzz``) with the given options inside
``attnx.backends.cuda.forced_family.forced_family(FAMILY)``: on a Hopper GPU the Ampere family's forward
(``kernels/sm80/fa_fwd.cu``) and backward run every case the Hopper kernels would, so the kernels an
A100 runs are checked against float64 (and, under compute-sanitizer, for memory, race and barrier errors)
on the H200. Exit status: the tool's.
"""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print("usage: python -m benchmarks.family_grid FAMILY [fuzz] OPTIONS", file=sys.stderr)
        return 2
    from attnx.backends.cuda.forced_family import forced_family

    family, rest = argv[0], argv[1:]
    if rest[:1] == ["fuzz"]:
        from attnx.conformance.fuzz import main as tool
        rest = rest[1:]
    else:
        from attnx.conformance.__main__ import main as tool
    with forced_family(family):
        return tool(rest)


if __name__ == "__main__":
    sys.exit(main())
