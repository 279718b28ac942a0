"""Every generated conformance case of every selected backend, one test each.

The cases come from `attnx.conformance` (grid generated from each backend's declarations);
conftest.py adds --backend, --profile, --device, --max-seqlen and --allow-extra-declines.
"""
from __future__ import annotations

import pytest

from attnx.conformance import run_case


def test_conformance(conformance_case, request):
    name, case, device = conformance_case
    result = run_case(name, case, device, allow_extra_declines=request.config.getoption("--allow-extra-declines"))
    if result.status == "declined":
        pytest.skip(result.summary())
    assert result.status == "pass", f"{name} on {device}: {case.id}\n" + result.summary()
