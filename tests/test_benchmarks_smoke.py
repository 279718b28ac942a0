"""Smoke test of the benchmark harness: `--quick` runs end to end and writes its files.

No timing assertions: speed is measured by `python -m benchmarks.run`, not in tests.
"""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_quick_benchmark_writes_tables_json_and_plots(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--device", "cpu", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "results.md").is_file() and (out / "results.json").is_file()
    results = json.loads((out / "results.json").read_text())
    rows = results["rows"]
    assert rows, "no rows in results.json"
    assert {r["setting"] for r in rows} == {"cpu", "memory"}
    # every registered, available attnx backend and torch's SDPA stand side by side
    peers = {r["peer"] for r in rows}
    assert "attnx.naive" in peers and "torch.sdpa" in peers
    assert all(r["status"] in ("ok", "skipped", "unsupported", "oom", "error") for r in rows)
    assert not [r for r in rows if r["status"] == "error"], [r["note"] for r in rows if r["status"] == "error"]
    assert any(r["status"] == "ok" and r["measure"] == "memory" for r in rows)
    assert results["dispatch"], "the dispatcher check is missing"
    assert "Dispatcher check" in (out / "results.md").read_text()
    assert list(out.glob("*.png")), "no plots written"
    assert "dispatcher check:" in proc.stdout  # the short table printed last
