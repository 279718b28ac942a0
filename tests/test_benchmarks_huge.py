"""benchmarks/huge.py on the CPU: `--scale small` runs end to end with every row ok, and its checks
catch a wrong value where the full-size problems would hide one (the last slice, an unsampled row)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import attnx
from attnx.backends.blocked.backend import BlockedBackend
from benchmarks import huge

REPO = Path(__file__).resolve().parent.parent


def test_small_scale_runs_every_problem_ok(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.huge", "--backends", "blocked", "--device", "cpu",
                           "--scale", "small", "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "huge.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok"] * len(rows), rows
    assert {(r["problem"], r["mode"]) for r in rows} == {(s.name, m) for s in huge.shapes("small") for m in s.modes}
    assert all(set(r["errors"]) == ({"out", "lse"} if r["mode"] == "fwd" else set(huge.NAMES)) for r in rows)
    assert "| long causal |" in (tmp_path / "huge.md").read_text()
    assert "huge problems:" in proc.stdout


class Broken(BlockedBackend):
    """blocked with one wrong value: in out's last (b, h) slice, or in dq of a row outside the sample."""

    def __init__(self, where):
        super().__init__()
        self.name, self.where = f"broken_{where}", where

    def forward(self, p, x):
        out, lse = super().forward(p, x)
        if self.where == "out":
            out[-1, -1, -1, 0] += 2.0
        return out, lse

    def backward(self, p, x, out, lse, dout):
        grads = super().backward(p, x, out, lse, dout)
        if self.where == "dq":
            grads.dq[0, 0, 1, 0] += 2.0  # row 1 is not sampled: its dout is 0, so its dq must be too
        return grads


@pytest.mark.parametrize("where, shape", [
    ("out", huge.Shape("wide", 3, 2, 16, 8, False, ("fwd+bwd",), False)),
    ("dq", huge.Shape("long", 1, 1, 512, 32, True, ("fwd+bwd",), True)),
])
def test_a_wrong_value_where_only_the_checks_look_fails_the_row(where, shape):
    with attnx.registered(Broken(where)):
        row = huge.run_one(shape, "fwd+bwd", f"broken_{where}", huge.make_inputs(shape, "cpu"), "cpu")
    assert row["status"].startswith(f"FAIL: {where} "), row


def test_a_grid_past_the_y_limit_is_declined_with_the_dispatchers_reason():
    # triton under its CPU interpreter (read once per process: a fresh one) gives the problem's own reasons
    probe = ("from benchmarks import huge; sh = huge.shapes('small')[1]; assert sh.name == 'grid-bh'; "
             "print(huge.run_one(sh, 'fwd+bwd', 'triton', huge.make_inputs(sh, 'cpu'), 'cpu')['status'])")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "declined: batch * heads = 65537 above the grid limit 65535"
