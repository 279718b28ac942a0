"""8 Python threads calling attnx at once, each on many different problems, every result checked
against the float64 oracle (issue 13, item 4; docs/testing.md).

The problems are drawn from the fuzzer's space for the backend (`attnx.conformance.fuzz.case_strategy`,
hypothesis with a fixed seed): every one has its own shapes, dtype, features and tensor format, so
the dispatch cache (exact and length-bucket entries), the blocked backend's worker pool and thread
count, and `attnx.plan` all see new keys from several threads at the same moment. Each problem runs
through `attnx.conformance.check.run_case` — forward, lse and gradients against the float64 formula
with the documented error bounds, outputs poisoned with NaN first, NaN never passing. Thread `i`
runs its own window of the pool, so every problem runs in two threads at once.

Modes: a forced backend (naive, blocked), the dispatcher's own choice, and `attnx.plan(...).run`
(the plan made in the thread, then run). The Triton interpreter (TRITON_INTERPRET=1) runs the
same harness in a subprocess (its launches are serialised by the triton launcher: R2).

A failure counts only when it is new: a result the fuzzer's `KNOWN_ISSUES` explain (the error
model's E1, E2) must fail the same way when the problem runs alone.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

import attnx
from attnx.conformance import check, fuzz

ROOT = Path(__file__).resolve().parent.parent
THREADS = 8

# mode -> (backend whose declared space the problems come from, problems in the pool, per thread, seed)
MODES = {
    "naive": ("naive", 32, 8, 11),
    "blocked": ("blocked", 32, 8, 12),
    "dispatched": ("blocked", 32, 8, 13),   # what blocked declares, the dispatcher can always run on CPU
    "planned": ("blocked", 24, 6, 14),
}


def draw_cases(backend_name: str, count: int, seed: int) -> list:
    """`count` distinct problems from the fuzzer's `ci` space for `backend_name` (reproducible)."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hypothesis_seed

    strategy = fuzz.case_strategy(attnx.get_backend(backend_name), "ci")
    found = {}

    @hypothesis_seed(seed)
    @settings(max_examples=8 * count, database=None, deadline=None, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet)
    @given(strategy)
    def collect(case):
        # one problem per shape and format: hypothesis likes to vary one field at a time
        key = (case.batch, case.heads_q, case.heads_kv, case.seqlen_q, case.seqlen_k, case.head_dim,
               case.head_dim_v, case.q_format, case.kv_format)
        if len(found) < count:
            found.setdefault(key, case)

    collect()
    assert len(found) == count, f"drew {len(found)} distinct problems, wanted {count}"
    return list(found.values())


class _Through(types.ModuleType):
    """Stands in for `attnx` inside `check`: the call goes to the dispatcher, or through a plan.

    `run_case` asks `get_backend(name)` for the declarations (reasons, bounds) and then calls
    `attention(..., backend=name)`; here `name` is only the declaring backend, and the call is
    made without forcing it.
    """

    def __init__(self, planned: bool):
        super().__init__("attnx_through")
        self.planned = planned

    def __getattr__(self, name):
        return getattr(attnx, name)

    def attention(self, q, k, v, *, backend=None, return_lse=False, **options):
        if not self.planned:
            return attnx.attention(q, k, v, return_lse=return_lse, **options)
        tensors = {n: options.pop(n) for n in list(options) if n in attnx.Plan._TENSOR_OPTIONS}
        step = attnx.plan(q, k, v, return_lse=return_lse, **options, **tensors)
        return step.run(q, k, v, **{n: t for n, t in tensors.items() if t is not None})


def _outcome(result) -> str:
    if result.status != "fail":
        return result.status
    issue = fuzz.known_issue(result)
    return f"known {issue.tag}" if issue else "new failure: " + " | ".join(result.failures)[:600]


def run_threads(backend_name: str, cases: list, per_thread: int, device: str = "cpu") -> list[str]:
    """Run the cases from THREADS threads at once; the problems found (empty when all is well)."""
    barrier = threading.Barrier(THREADS)
    outcomes, lock = [], threading.Lock()

    def worker(index: int) -> None:
        start = index * len(cases) // THREADS
        mine = [cases[(start + j) % len(cases)] for j in range(per_thread)]
        try:
            barrier.wait()
            for case in mine:
                result = check.run_case(backend_name, case, device, allow_extra_declines=True)
                with lock:
                    outcomes.append((case, _outcome(result)))
        except BaseException as err:  # noqa: BLE001 - reported below
            with lock:
                outcomes.append((None, f"thread {index}: {type(err).__name__}: {err}"))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    problems = ["a thread hung"] if any(t.is_alive() for t in threads) else []
    if len(outcomes) != THREADS * per_thread:
        problems.append(f"{len(outcomes)} results for {THREADS * per_thread} runs")
    for case, outcome in outcomes:
        if case is None or outcome.startswith("new failure"):
            problems.append(f"{case.id if case else ''}: {outcome}")
        elif outcome.startswith("known"):  # must be the problem's own failure, not a race
            alone = _outcome(check.run_case(backend_name, case, device, allow_extra_declines=True))
            if alone != outcome:
                problems.append(f"{case.id}: {outcome} in threads, {alone} alone")
    return problems


@pytest.mark.parametrize("mode", list(MODES))
def test_eight_threads_match_the_oracle(mode, monkeypatch):
    pytest.importorskip("hypothesis")
    backend_name, count, per_thread, seed = MODES[mode]
    cases = draw_cases(backend_name, count, seed)
    if mode in ("dispatched", "planned"):
        monkeypatch.setattr(check, "attnx", _Through(planned=mode == "planned"))
    attnx.dispatch.clear_cache()   # every thread meets cold dispatch entries
    problems = run_threads(backend_name, cases, per_thread)
    assert not problems, "\n".join(problems[:8])


def test_a_race_would_be_seen(monkeypatch):
    """The harness fails when results are wrong: a backend that corrupts its output under contention."""
    cases = draw_cases("naive", 8, 21)
    original = attnx.attention
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        out, lse = original(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] % 5 == 0 and out.numel():
            out = out + 1.0   # what a kernel reading another thread's state would give
        return out, lse

    monkeypatch.setattr(check, "attnx", types.SimpleNamespace(**{n: getattr(attnx, n) for n in
                                                                 ("get_backend", "make_problem")},
                                                              attention=flaky))
    problems = run_threads("naive", cases, 2)
    assert any("new failure" in p for p in problems), problems


_INTERPRETER = """
import sys
sys.path.insert(0, {tests!r})
import test_threads as t
cases = t.draw_cases("triton", {count}, 15)
problems = t.run_threads("triton", cases, {per_thread})
print("\\n".join(problems[:8]) or "ok")
sys.exit(1 if problems else 0)
"""


def test_eight_threads_triton_interpreter():
    """R2 (fixed): the interpreter keeps a launch's state in module globals; attnx serialises its launches."""
    pytest.importorskip("triton")
    pytest.importorskip("hypothesis")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    script = _INTERPRETER.format(tests=str(ROOT / "tests"), count=16, per_thread=2)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_only_interpreted_launches_take_the_lock():
    """The lock serialises the CPU interpreter only: compiled (GPU) launches stay concurrent."""
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    from attnx.backends.triton import interpreter_fix

    def launch():
        return interpreter_fix._INTERPRETER_LOCK._is_owned()

    assert interpreter_fix.serialised(object())(launch) is launch          # a compiled kernel: no wrapper
    interpreted = InterpretedFunction.__new__(InterpretedFunction)
    assert interpreter_fix.serialised(interpreted)(launch)() is True      # held while the launch runs
    assert not interpreter_fix._INTERPRETER_LOCK._is_owned()
