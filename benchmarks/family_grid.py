"""The conformance grid with the cuda backend on one kernel family, whatever the GPU (the Ampere family on the H200).

    python -m benchmarks.family_grid sm80 --backend cuda --profile full --device cuda [conformance options]

Runs ``python -m attnx.conformance`` with the given options inside
``attnx.backends.cuda.forced_family.forced_family(FAMILY)``: on a Hopper GPU the Ampere family's forward
(``kernels/sm80/fa_fwd.cu``) and backward run every case the Hopper kernels would, so the kernels an
A100 runs are checked against float64 (and, under compute-sanitizer, for memory, race and barrier errors)
on the H200. Exit status: the conformance tool's.
"""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    from attnx.backends.cuda.forced_family import forced_family
    from attnx.conformance.__main__ import main as conformance

    with forced_family(argv[0]):
        return conformance(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
