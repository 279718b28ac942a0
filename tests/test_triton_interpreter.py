"""CI check 1 for the triton backend: the conformance grid through Triton's CPU interpreter.

`TRITON_INTERPRET=1` is read when kernels are decorated, so the run happens in a fresh
process (``python -m attnx.conformance --profile interp``): a reduced grid that still
touches every feature the backend declares, forward and backward, on CPU tensors.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import attnx

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parent.parent


def _interpreter_env() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence triton 3.9's notice; same default
    return env


def test_declines_cpu_without_interpreter(monkeypatch):
    """Normal runs never send CPU tensors to triton: the dispatcher keeps it for GPUs."""
    import torch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 2, 8, 16)
    reasons = attnx.explain(q, q, q).reasons["triton"]
    assert any("device cpu" in r or "GPU" in r for r in reasons), reasons


def test_conformance_through_interpreter(tmp_path):
    report = tmp_path / "triton-interp"
    proc = subprocess.run(
        [sys.executable, "-m", "attnx.conformance", "--backend", "triton", "--profile", "interp", "-q",
         "--report", str(report)],
        cwd=ROOT, env=_interpreter_env(), capture_output=True, text=True, timeout=900)
    summary = proc.stdout.strip().splitlines()[-2:] if proc.stdout.strip() else []
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
    data = json.loads(report.with_suffix(".json").read_text())
    results = data.get("results", data.get("cases", []))
    assert results, summary
    features = " ".join(r.get("id", r.get("case", {}).get("id", "")) if isinstance(r, dict) else str(r)
                        for r in results)
    for feature in ("causal", "window", "softcap", "alibi", "boolmask", "additivemask", "bshd", "kv", "grad",
                    "float16", "bfloat16", "float32"):
        assert feature in features, f"interp grid lost {feature!r}"
