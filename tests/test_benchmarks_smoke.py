"""Smoke tests of the benchmark harness: `--quick` runs end to end and writes its files.

No speed assertions: speed is measured by `python -m benchmarks.run`, not in tests. The
overhead benchmark's count of dispatcher questions is exact, so it is asserted.
"""
import json
import subprocess
import sys
from pathlib import Path

from benchmarks import overhead, paper, settings
from benchmarks.peers import AttnxPeer, FlexPeer, SdpaPeer
from benchmarks.runner import Budget, Runner

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


def test_paper_runner_writes_the_harness_tables_and_kernel_reports(tmp_path):
    """The paper runner's output on a tiny CPU run (its timer and points need a GPU; its writer does not)."""
    points = settings.cpu(quick=True)[:1]
    peers = [AttnxPeer("naive"), AttnxPeer("cuda"), SdpaPeer("default"), FlexPeer(seqlens=[16384])]
    runner = Runner("cpu", peers, Budget(None, 2.0), quick=True)
    runner.run(points)
    meta = {"device": "cpu", "device_name": "test CPU", "date": "2026-12-01", "command": "test", "versions": "-",
            "attnx_backends": ["naive", "cuda"], "statistic": "min"}
    kernels = {"naive": [], "cuda": [{"variant": "fwd d64", "registers": 128}]}
    paper.write(tmp_path / "naive_paper", meta, runner.rows, runner.picks, kernels)
    record = json.loads((tmp_path / "naive_paper.json").read_text())
    assert record["kernels"] == kernels
    by_peer = {r["peer"]: r for r in record["rows"]}
    assert by_peer["attnx.naive"]["status"] == by_peer["torch.sdpa"]["status"] == "ok"
    assert by_peer["attnx.cuda"]["status"] == "skipped"  # declines on the CPU, with the dispatcher's reasons
    text = (tmp_path / "naive_paper.md").read_text()
    assert "| S | attnx.naive |" in text and "## cuda kernels compiled in this run" in text
    assert "| fwd d64 | 128 |" in text


def test_flex_peer_measures_only_the_lengths_and_head_dims_asked_for():
    flex = FlexPeer(seqlens=[16384], head_dims=[128])
    at = {(p.seqlen_k, p.head_dim): flex.skip_reason(p, "cuda")
          for p in settings.paper(head_dims=(64, 128), seqlens=[2048, 16384], modes=("fwd",), causals=(False,))}
    assert at[(16384, 128)] is None
    assert "S in {16384}" in at[(2048, 128)] and "D in {128}" in at[(16384, 64)]


def test_quick_overhead_asks_each_new_length_in_priority_order(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/overhead.py", "--quick", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "overhead.json").read_text())
    assert (tmp_path / "overhead.md").read_text().startswith("# attnx per-call overhead")
    assert {row["case"] for row in record["dispatch_only"]} >= {"`plan.run(q, k, v)`", "inside `use_backend(...)`"}
    assert [row["shape"] for row in record["real_calls"]] == list(overhead.SHAPES)
    growing = record["growing_decode"]
    # every new length asks the bucket's backends from the top (dispatch is a function of the problem:
    # reliability.md D2), so the spy, first in priority and declining, is asked for each of the 101
    # lengths, as is the forced null backend
    assert growing["attnx"]["backend_asks_per_sweep"] == 101
    assert growing["null"]["backend_asks_per_sweep"] == 101
    assert set(growing["null"]["median_us_by_bucket"]) == {"1024", "2048"}


def test_call_profile_reports_the_pick_and_the_tables(capsys):
    """benchmarks/call_profile.py on the CPU (on the H200 it profiles the cuda decode call's host time and
    the torch backend's training step beside SDPA-cuDNN)."""
    from benchmarks import call_profile

    assert call_profile.main(["decode", "--device", "cpu", "--calls", "3", "--keys", "64", "--format", "paged"]) == 0
    out = capsys.readouterr().out
    assert "the dispatcher picks blocked" in out and "ms per eager call" in out and "tottime" in out
    assert call_profile.main(["training", "--device", "cpu", "--seqlen", "32", "--tokens", "64", "--steps", "1",
                              "--causal"]) == 0
    out = capsys.readouterr().out
    assert out.count("ms per step (queued") == 2 and "attnx picks" in out and "causal=True" in out
    assert "Python profile" in out and "tottime" in out


def test_family_grid_runs_the_conformance_tools_under_the_forced_family(monkeypatch, capsys):
    """`python -m benchmarks.family_grid FAMILY [fuzz] ...`: the conformance CLI (or the fuzzer's) runs inside
    forced_family(FAMILY), which is off again afterwards; no family name is a usage error (exit 2)."""
    import attnx.conformance.__main__ as conformance_cli
    from attnx.backends.cuda import families
    from benchmarks import family_grid

    seen = []
    monkeypatch.setattr(conformance_cli, "main", lambda argv: seen.append(
        (list(argv), families.family_for((9, 0)).name)) or 0)
    assert family_grid.main(["sm80", "--backend", "cuda", "--list"]) == 0
    assert seen == [(["--backend", "cuda", "--list"], "sm80")]
    assert families.family_for((9, 0)).name == "sm90"
    import attnx.conformance.fuzz as fuzz_cli
    monkeypatch.setattr(fuzz_cli, "main", lambda argv: seen.append((list(argv), families.family_for((9, 0)).name)) or 1)
    assert family_grid.main(["sm80", "fuzz", "--count", "3"]) == 1  # the tool's exit status
    assert seen[-1] == (["--count", "3"], "sm80") and families.family_for((9, 0)).name == "sm90"
    assert family_grid.main([]) == 2 and family_grid.main(["--backend", "cuda"]) == 2


def test_bench_rounds_times_the_names_in_turn_and_keeps_each_ones_median(monkeypatch):
    """benchmarks.backward_check.bench_rounds (the Hopper backward's configurations, timed beside each other):
    each round times every name once, in order, and a name's result is the median of its rounds, so one slow
    round (a clock or host drift) moves no name."""
    from benchmarks import backward_check

    calls, readings = [], iter([1.0, 5.0, 9.0, 2.0, 4.0, 8.0])
    monkeypatch.setattr(backward_check, "bench", lambda fn: (calls.append(fn()), next(readings))[1])
    got = backward_check.bench_rounds({"a": lambda: "a", "b": lambda: "b"}, rounds=3)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert got == {"a": 4.0, "b": 5.0}  # a: 1, 9, 4; b: 5, 2, 8
