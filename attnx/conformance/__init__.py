"""The attnx conformance suite: the Accuracy rules of docs/semantics.md, checked on a grid generated from
each backend's declarations.

    python -m attnx.conformance --backend naive --profile quick --report out/naive
    python -m pytest conformance --backend naive,blocked --profile quick
"""
from .cases import PROFILES, Case, declared_reasons, generate_cases
from .check import Result, run_case
from .runner import available_backends, default_device, run_cases, select_cases

__all__ = ["PROFILES", "Case", "Result", "available_backends", "declared_reasons", "default_device",
           "generate_cases", "run_case", "run_cases", "select_cases"]
