"""A plain call that forces a backend and the same call that does not keep one remembered Run each.

The memo key holds the ``backend`` argument: two call sites alternating on one signature (a model's
default call and a benchmark's forced one) each run their own backend from their own Run, instead of
replacing each other's on every call (which sent both through the dispatcher each time).
"""
from __future__ import annotations

import pytest
import torch

import attnx
from attnx import call_memo


@pytest.fixture(autouse=True)
def _fresh_memo():
    call_memo.clear()
    yield
    call_memo.clear()


def test_forced_and_default_calls_keep_their_own_runs(ran):
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    default = attnx.explain(q, k, v).chosen
    for _ in range(2):
        for backend in (None, "naive"):
            attnx.attention(q, k, v, backend=backend)
    runs = {run.forced: run for run in call_memo.runs()}
    assert set(runs) == {None, "naive"} and runs[None].backend.name == default
    ran.clear()
    for _ in range(3):
        for backend in (None, "naive"):
            attnx.attention(q, k, v, backend=backend)
    assert ran == [(default, "forward"), ("naive", "forward")] * 3
    assert {run.forced: run for run in call_memo.runs()} == runs  # the same Runs, none replaced


def test_an_unknown_forced_backend_still_raises_after_the_default_is_remembered():
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    for _ in range(3):
        attnx.attention(q, k, v)
    with pytest.raises(attnx.InvalidArgumentError):
        attnx.attention(q, k, v, backend="no-such-backend")
