"""Property-based fuzzing against the float64 oracle (attnx.conformance.fuzz), and its regression cases.

CI runs FUZZ_COUNTS problems (2,000 in all) drawn by hypothesis with fixed seeds from the space
each backend declares: naive and blocked in this process, the triton backend through its CPU
interpreter in a subprocess started first, so that it runs beside them on the second core.
Every problem checks out, lse and the gradients with the error model of docs/semantics.md; a
failure that no known issue (`KNOWN_ISSUES`: open defects and gaps of the error model, see
docs/reliability.md) explains fails the test, with the shrunk case to add to
tests/fuzz_regressions.json. ``ATTNX_FUZZ_SCALE=0.1`` runs a tenth of the problems.

tests/fuzz_regressions.json holds the shrunk failures found so far; each is replayed: "fixed"
records must pass, "open" and "known" ones must still fail the way recorded (when one starts
passing, mark it fixed).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

import attnx
from attnx.conformance import run_case
from attnx.conformance.cases import MASK_SHAPES, MEMORY
from attnx.conformance.fuzz import (KNOWN_ISSUES, SPACES, case_from_dict, case_strategy, coverage, fuzz,
                                    known_issue, load_regressions, regression_record)

ROOT = Path(__file__).resolve().parent.parent
REGRESSIONS = ROOT / "tests" / "fuzz_regressions.json"
SCALE = float(os.environ.get("ATTNX_FUZZ_SCALE", "1"))
FUZZ_COUNTS = {"naive": 800, "blocked": 800, "triton": 400}
SEEDS = {"naive": 20261201, "blocked": 20261202, "triton": 20261203}


def _count(backend: str) -> int:
    return max(1, round(FUZZ_COUNTS[backend] * SCALE))


def _interpreter_env() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return env


# -- the CI fuzz run -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def triton_fuzz(tmp_path_factory):
    """The triton fuzz run, started in a subprocess as soon as this module's first test asks for it."""
    pytest.importorskip("triton")
    report = tmp_path_factory.mktemp("fuzz-triton")
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnx.conformance.fuzz", "--backend", "triton", "--count", str(_count("triton")),
         "--seed", str(SEEDS["triton"]), "--report", str(report), "--shrink-seconds", "60", "-q"],
        cwd=ROOT, env=_interpreter_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield proc, report, start
    if proc.poll() is None:
        proc.kill()


@pytest.fixture(scope="module", autouse=True)
def _start_triton_first(request):
    """Start the triton run before the in-process runs take the first core (only when it is selected)."""
    if any(item.name == "test_fuzz_triton_interpreter" for item in request.session.items):
        try:
            request.getfixturevalue("triton_fuzz")
        except pytest.skip.Exception:
            pass


def _check_run(run, count: int) -> None:
    c = run.counts
    new = run.new_failures()
    lines = [f"{r.case.id}: " + " | ".join(f.splitlines()[0] for f in r.failures) for r in new[:10]]
    lines += [f"shrunk: {f.minimal.case.id}: " + " | ".join(x.splitlines()[0] for x in f.minimal.failures) + "\n"
              + json.dumps(regression_record(run.backend, f.minimal, seed=run.seed, original=f.original))
              for f in run.findings]
    assert not new, f"{len(new)} new failures (add the shrunk cases to tests/fuzz_regressions.json):\n" \
                    + "\n".join(lines)
    assert c["pass"] + c["fail"] >= count, f"{c} (stopped: {run.stopped})"
    print(f"\n{run.backend}: {c['problems']} problems in {run.seconds:.1f} s ({run.seconds / max(1, c['problems']):.3f} "
          f"s each), known issues {c['known_by_tag']}")


@pytest.mark.parametrize("backend", ["naive", "blocked"])
def test_fuzz(backend):
    count = _count(backend)
    run = fuzz(backend, count, SEEDS[backend], space="ci", shrink_seconds=60)
    _check_run(run, count)


def test_fuzz_triton_interpreter(triton_fuzz):
    proc, report, start = triton_fuzz
    out, _ = proc.communicate(timeout=1500)
    seconds = time.perf_counter() - start
    files = list(report.glob("*.json"))
    assert files, out[-4000:]
    data = json.loads(files[0].read_text())
    c = data["summary"]
    new = [r for r in data["results"] if r["status"] == "fail" and not r.get("known")]
    assert not new, out[-6000:] + "\n" + json.dumps(data["regressions"], indent=1)
    assert c["pass"] + c["fail"] >= _count("triton"), (c, data["meta"]["stopped"])
    print(f"\ntriton (interpreter): {c['problems']} problems in {data['meta']['seconds']:.1f} s "
          f"(wall {seconds:.1f} s), known issues {c['known_by_tag']}")


def test_ci_runs_two_thousand_problems():
    if SCALE == 1:
        assert sum(FUZZ_COUNTS.values()) >= 2000


# -- the strategy covers the declared space ----------------------------------------------------
def _draw(backend_name: str, n: int, space="ci") -> list:
    from hypothesis import HealthCheck, given, seed, settings

    backend = attnx.get_backend(backend_name)
    drawn = []

    @seed(7)
    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case_strategy(backend, space))
    def collect(case):
        drawn.append(case)

    collect()
    return drawn


def test_strategy_draws_only_declared_problems():
    for name in ("naive", "blocked", "triton", "cuda"):
        backend = attnx.get_backend(name)
        for case in _draw(name, 150):
            assert backend.declared_reasons(case.problem()) == [], (name, case.id)
            if name == "cuda":
                assert case.mask is None and case.dtype in ("float16", "bfloat16")


def test_strategy_covers_the_problem_space():
    cases = _draw("naive", 1500)
    seen = coverage(cases)
    wanted = [f"dtype {d}" for d in ("float32", "float64", "float16", "bfloat16")]
    wanted += [f"format {q}/{kv}" for q, kv in (("dense", "dense"), ("dense", "cache"), ("dense", "paged"),
                                                ("varlen", "varlen"), ("varlen", "cache"), ("varlen", "paged"))]
    wanted += [f"memory {m}" for m in MEMORY] + ["layout bshd", "layout bhsd", "gradients", "forward only"]
    wanted += [f"zero-size {n}" for n in ("batch", "heads_q", "seqlen_q", "seqlen_k")]
    wanted += ["GQA ratio 2", "GQA ratio 3", "Dv != D", "D 1-8", "D 129-256", "Sq > Sk", "Sq <= Sk"]
    wanted += ["causal", "sinks", "nan", "large_logits", "masked_rows", "mask_grad", "mask dtype differs",
               "softcap", "explicit scale", "alibi h", "alibi bh", "offset 0", "offset <0", "offset >0",
               "page size 1", "page size > 1", "window N/0", "window k/k", "window 0/0"]
    missing = [w for w in wanted if not seen.get(w)]
    assert not missing, f"never drawn: {missing}"
    # every mask kind and every mask shape (their 10 combinations are left to chance)
    assert {c.mask for c in cases if c.mask} == {"bool", "additive"}
    assert {c.mask_shape for c in cases if c.mask} == set(MASK_SHAPES)
    dims = {c.head_dim for c in cases}
    assert 1 in dims and 256 in dims and len(dims) > 60


def test_gpu_space_reaches_tile_boundaries():
    cases = _draw("triton", 1000, "gpu")
    lengths = {c.seqlen_q for c in cases} | {c.seqlen_k for c in cases}
    assert {63, 64, 65, 127, 128, 129} <= lengths and max(lengths) > 256
    assert max(SPACES["gpu"].edge_seqlens) > 500


# -- the machinery: shrinking, known issues, reports ------------------------------------------------
class _BrokenOverD20(attnx.Backend):
    """Right, except that causal problems with head dim above 20 use a wrong scale."""

    name = "broken_fuzz"
    device_types = frozenset({"cpu"})
    supports_backward = False
    mask_kinds = frozenset()

    def forward(self, p, x):
        from attnx.reference import attention_reference

        scale = p.scale * (1.5 if p.is_causal_only and p.head_dim > 20 else 1.0)
        out, lse = attention_reference(x.q, x.k, x.v, scale=scale, softcap=p.softcap, alibi_slopes=x.alibi_slopes,
                                       window_left=p.window_left, window_right=p.window_right, offset=p.offset)
        result = attnx.alloc_out(p, x.q)
        result.copy_(out)
        return result, lse.float()


def test_a_wrong_backend_is_caught_and_shrunk(tmp_path):
    from attnx.conformance.fuzz import write_report

    with attnx.registered(_BrokenOverD20()):
        run = fuzz("broken_fuzz", 150, seed=3, space="ci", shrink_seconds=60)
    assert run.counts["new"] > 0 and run.findings
    minimal = run.findings[0].minimal.case
    # shrunk to the smallest problem with the defect: causal, D = 21, one head, tiny sizes, no extras
    assert minimal.causal and minimal.head_dim in (21, 24) and minimal.batch == 1 and minimal.heads_q == 1
    assert minimal.window is None and minimal.alibi is None and minimal.softcap is None and minimal.dtype == "float32"
    assert max(minimal.seqlen_q, minimal.seqlen_k) <= 2
    md, js = write_report(run, 150, tmp_path)
    data = json.loads(js.read_text())
    assert data["summary"]["new"] == run.counts["new"] and data["regressions"]
    assert "Shrunk failures" in md.read_text()
    # the record replays as the same failure
    record = data["regressions"][0]
    with attnx.registered(_BrokenOverD20()):
        again = run_case("broken_fuzz", case_from_dict(record["case"]), "cpu")
    assert again.status == "fail" and known_issue(again) is None


def test_nan_is_never_a_pass():
    """A backend that turns a NaN row into zeros (the bug issue 8 fixed in naive) fails its NaN problems."""
    from attnx.conformance.cases import Case

    class Zeroing(_BrokenOverD20):
        name = "nan_zeroing"

        def forward(self, p, x):
            out, lse = super().forward(p, x)
            return out.nan_to_num(0.0), lse

    case = Case("fuzz", "float32", 1, 2, 2, 8, 8, 16, 16, nan=True, grad=False)
    with attnx.registered(Zeroing()):
        result = run_case("nan_zeroing", case, "cpu")
    assert result.status == "fail" and known_issue(result) is None


def test_time_limit_stops_the_run():
    run = fuzz("naive", 10_000, seed=1, time_limit=3.0)
    assert run.stopped and "time limit" in run.stopped and run.seconds < 30


def test_known_issues_are_documented():
    doc = (ROOT / "docs" / "reliability.md").read_text()
    for issue in KNOWN_ISSUES:
        assert f"**{issue.tag}**" in doc, issue.tag


# -- regression cases ---------------------------------------------------------------------------
RECORDS = load_regressions(REGRESSIONS)


def _expect(record: dict, result) -> None:
    if record["status"] == "fixed":
        assert result.status == "pass", result.summary()
        return
    if result.status == "pass":
        pytest.fail(f"recorded as {record['status']} ({record['note']}) but passes now: mark it fixed")
    issue = known_issue(result)
    assert issue is not None and issue.tag == record["known_issue"], (record["known_issue"], result.summary())


@pytest.mark.parametrize("record", [r for r in RECORDS if r["backend"] in ("naive", "blocked")],
                         ids=lambda r: f"{r['backend']}-{r['status']}-{r['case']['id']}")
def test_regression(record):
    _expect(record, run_case(record["backend"], case_from_dict(record["case"]), "cpu"))


def test_regressions_triton_interpreter(tmp_path):
    pytest.importorskip("triton")
    records = [r for r in RECORDS if r["backend"] == "triton"]
    proc = subprocess.run([sys.executable, "-m", "attnx.conformance.fuzz", "--backend", "triton", "--replay",
                           str(REGRESSIONS), "--report", str(tmp_path)], cwd=ROOT, env=_interpreter_env(),
                          capture_output=True, text=True, timeout=900)
    replayed = json.loads((tmp_path / "replay-triton.json").read_text())
    assert len(replayed) == len(records), proc.stdout[-3000:] + proc.stderr[-3000:]
    from attnx.conformance.check import Result

    for item in replayed:
        d = item["result"]
        result = Result(case_from_dict(d["case"]), d["backend"], d["device"], d["status"], d["reasons"],
                        d["failures"], {k: float(v) for k, v in d["errors"].items()},
                        {k: float(v) for k, v in d["bounds"].items()},
                        magnitudes={k: float(v) for k, v in d.get("magnitudes", {}).items()})
        _expect(item["record"], result)


def test_regression_records_are_well_formed():
    tags = {k.tag for k in KNOWN_ISSUES}
    for r in RECORDS:
        assert r["status"] in ("fixed", "open", "known") and r["backend"] in attnx.registered_backends()
        assert r["status"] == "fixed" or r["known_issue"] in tags
        case = case_from_dict(r["case"])
        assert replace(case) == case and case.id == r["case"]["id"]
