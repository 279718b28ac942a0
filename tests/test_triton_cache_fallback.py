"""attnx's answer to Triton's cache failing a compile (backends/triton/cache_fallback.py; reliability.md T2, T3):
the call runs again with Triton pointed at a private directory, a warning says so, later calls while the same
directory is configured go there directly, and errors that are not the cache's are not retried."""
import json
import os
import warnings

import pytest

pytest.importorskip("triton")
from attnx.backends.triton import cache_fallback  # noqa: E402


@pytest.fixture
def broken_dir(tmp_path, monkeypatch):
    directory = tmp_path / "triton-cache"
    monkeypatch.setenv(cache_fallback.ENV, str(directory))
    monkeypatch.setattr(cache_fallback, "_redirects", {})
    return str(directory)


def _recording(fail_in: str, error: Exception):
    """A stand-in launch: raises `error` while Triton's cache is `fail_in`, else returns the directory."""
    seen = []

    @cache_fallback.survives_cache_errors
    def launch(x):
        seen.append(cache_fallback.configured_dir())
        if cache_fallback.configured_dir() == fail_in:
            raise error
        return x * 2

    return launch, seen


def test_a_cache_permission_error_runs_again_in_a_private_directory(broken_dir):
    err = PermissionError(13, "Permission denied", os.path.join(broken_dir, "tmp.pid_1_x"))
    launch, seen = _recording(broken_dir, err)
    with pytest.warns(RuntimeWarning, match="kernel cache"):
        assert launch(21) == 42
    private = seen[-1]
    assert seen[0] == broken_dir and private != broken_dir and os.path.isdir(private)
    assert os.environ[cache_fallback.ENV] == broken_dir  # the caller's setting is back
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the next call goes to the private directory directly
        assert launch(1) == 2
    assert seen[-1] == private and len(seen) == 3


def test_a_directory_that_cannot_be_created_counts_as_the_cache(broken_dir):
    launch, seen = _recording(broken_dir, PermissionError(13, "Permission denied", broken_dir))
    with pytest.warns(RuntimeWarning):
        assert launch(2) == 4


@pytest.mark.parametrize("error", [PermissionError(13, "Permission denied", "/somewhere/else/out.bin"),
                                   ValueError("a bad argument"), KeyError("BLOCK_M")])
def test_errors_that_are_not_the_caches_are_raised_without_a_retry(broken_dir, error):
    launch, seen = _recording(broken_dir, error)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(type(error)):
            launch(1)
    assert seen == [broken_dir] and cache_fallback._redirects == {}


def test_unreadable_metadata_counts_only_when_triton_reads_its_cache(broken_dir):
    try:
        json.loads("{not json")
    except json.JSONDecodeError as err:
        outside = err
    assert not cache_fallback.is_cache_error(outside, broken_dir)  # raised here, not in Triton's cache code
    assert cache_fallback.is_cache_error(NotADirectoryError(20, "Not a directory", broken_dir + "/x"), broken_dir)
    assert not cache_fallback.is_cache_error(OSError(28, "No space left on device"), broken_dir)
