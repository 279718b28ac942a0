"""`python -m attnx.conformance`'s case selection: shards split the grid among processes."""
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
