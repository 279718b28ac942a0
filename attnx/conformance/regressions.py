"""Regression records (tests/fuzz_regressions.json): a fuzz failure's shrunk case and what it did, read
back as `Case`s for replaying (`python -m attnx.conformance.fuzz --replay`, tests/test_fuzz.py)."""
from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
from typing import Optional

from .cases import Case
from .check import Result


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


def load_regressions(path) -> list[dict]:
    data = json.loads(pathlib.Path(path).read_text())
    return data["cases"] if isinstance(data, dict) else data
