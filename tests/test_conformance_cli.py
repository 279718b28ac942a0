"""`python -m attnx.conformance`'s case selection: shards split the grid among processes, --exclude resumes."""
import attnx
import pytest

from attnx.conformance.__main__ import main


def _listed(capsys, *extra):
    assert main(["--backend", "naive", "--list", *extra]) == 0
    return capsys.readouterr().out.split()


def test_shards_partition_the_grid(capsys):
    everything = _listed(capsys)
    shards = [_listed(capsys, "--shard", f"{i}/3") for i in range(3)]
    assert sorted(sum(shards, [])) == sorted(everything) and all(shards)
    assert not set(shards[0]) & set(shards[1])


@pytest.mark.parametrize("bad", ["3/3", "-1/2", "1", "a/b"])
def test_bad_shard_is_a_usage_error(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--backend", "naive", "--list", "--shard", bad])
    assert exit_info.value.code == 2 and "--shard" in capsys.readouterr().err


def test_exclude_skips_the_listed_ids_and_reads_progress_lines(capsys, tmp_path):
    """`--exclude FILE` resumes a sanitizer run: bare ids and the tool's own `[pass    ] ID (..s)` lines."""
    everything = _listed(capsys)
    done = tmp_path / "done.txt"
    done.write_text(f"# cleared by racecheck\n{everything[0]}\n[pass    ] {everything[1]} (38.59s) \n\n")
    rest = _listed(capsys, "--exclude", str(done))
    assert rest == everything[2:]
    assert _listed(capsys, "--exclude", str(done), "--shard", "0/2") == rest[0::2]


def test_summary_of_a_check_that_raised_after_measuring():
    """A check that raised between measuring a quantity and bounding it (the failure holds the exception)
    still prints its line, so the run goes on to the next case."""
    from attnx.conformance.cases import generate_cases
    from attnx.conformance.check import Result

    case = generate_cases(attnx.get_backend("naive"), "quick")[0]
    r = Result(case=case, backend="naive", device="cpu", errors={"out": 1e-4, "dq": 2.0}, bounds={"out": 1e-3})
    r.fail("raised RuntimeError: boom")
    assert r.summary() == "fail: out 0.0001<=0.001, dq 2<=? | raised RuntimeError: boom"


def test_calls_only_runs_the_calls_and_never_reports_a_pass(capsys, monkeypatch):
    """`--calls-only` (for compute-sanitizer) makes the backend's calls and stops before the oracle: every
    case `ran`, none `pass`; a backend that raises still fails."""
    from attnx.conformance import check
    monkeypatch.setattr(check, "_formula", lambda *a, **k: pytest.fail("the oracle ran"))
    assert main(["--backend", "blocked", "--calls-only", "-k", "base:"]) == 0
    out = capsys.readouterr().out
    assert "[ran     ] base:" in out and "[pass" not in out and "0 pass, 0 fail" in out and "ran (calls only)" in out

    def broken(*a, **k):
        raise RuntimeError("kernel crashed")
    monkeypatch.setattr(attnx, "attention", broken)
    assert main(["--backend", "blocked", "--calls-only", "-k", "base:"]) == 1
    assert "[fail" in capsys.readouterr().out
