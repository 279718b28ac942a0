"""attnx.attention from many Python threads at once, and on the caller's CUDA stream and device.

CPU (CI): 8 threads run a mix of problems (dispatch to naive and blocked, forward and backward,
GQA, masks, sinks, offsets, bshd, varlen, `plan`, growing-Sk decode steps) in different orders
and must reproduce the results computed beforehand in one thread; the dispatch cache is also
forced to clear itself while they run. A fresh process whose first call is made by 8 threads at
once must work as well (the registry loads the built-in backends on first use). The Triton
interpreter gets the same treatment in a subprocess (TRITON_INTERPRET=1).

GPU (skipped without CUDA): each GPU backend computed on a non-default stream whose inputs are
written on that stream after a sleep (a kernel launched on any other stream reads them unwritten),
from 8 threads with a stream each, and on a second device while the current device is another.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import attnx
from attnx import dispatch

ROOT = Path(__file__).resolve().parent.parent
THREADS = 8


def _problems(device="cpu", backends=(None,)):
    """(name, thunk) pairs; each thunk computes fresh outputs (and gradients) from fixed inputs."""
    gen = torch.Generator().manual_seed(1234)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    found = []
    for backend in backends:
        tag = backend or "auto"

        def dense(q, k, v, backend=backend, grad=True, **options):
            def go():
                leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
                out, lse = attnx.attention(*leaves, backend=backend, return_lse=True, **options)
                results = {"out": out.detach(), "lse": lse}
                if grad:
                    out.backward(torch.ones_like(out))
                    results.update({f"d{n}": t.grad for n, t in zip("qkv", leaves)})
                return results
            return go

        small = [rand(1, 2, 16, 32) for _ in range(3)]
        big = [rand(1, 4, 256, 32), rand(1, 2, 256, 32), rand(1, 2, 256, 32)]   # blocked's thread pool
        tall = [rand(2, 24, 4, 16), rand(2, 40, 2, 16), rand(2, 40, 2, 16)]      # bshd
        sinks = torch.randn(4, generator=gen).to(device)
        mask = (torch.rand(24, 40, generator=gen) < 0.7).to(device)
        found += [
            (f"{tag}-small-causal", dense(*small, causal=True)),
            (f"{tag}-gqa-window", dense(*big, window=(37, 5))),
            (f"{tag}-gqa-causal-fwd", dense(*big, causal=True, grad=False)),
            (f"{tag}-bshd-mask-sinks", dense(*tall, layout="bshd", mask=mask, sinks=sinks)),
            (f"{tag}-bshd-offset-softcap", dense(*tall, layout="bshd", causal=True, offset=3, softcap=20.0)),
            (f"{tag}-float64-alibi", dense(*(t.double() for t in small), alibi_slopes=torch.rand(2, generator=gen)
                                          .to(device))),
        ]
        if backend in (None, "naive"):
            cu = torch.tensor([0, 5, 5, 17], dtype=torch.int32, device=device)
            packed = [rand(17, 4, 16), rand(17, 2, 16), rand(17, 2, 16)]
            found.append((f"{tag}-varlen", dense(*packed, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)))

        def decode(backend=backend):
            # one query against a cache that grows by a key each step: a dispatch cache hit per bucket
            q = torch.ones(1, 2, 1, 16, device=device)
            k = torch.linspace(-1, 1, 2 * 40 * 16, device=device).reshape(1, 2, 40, 16)
            return {f"step{n}": attnx.attention(q, k[:, :, :n], k[:, :, :n], backend=backend) for n in range(1, 40, 3)}

        def planned(backend=backend):
            q, k, v = small
            step = attnx.plan(q, k, v, causal=True, backend=backend)
            return {f"run{i}": step.run(q * i, k, v) for i in range(3)}

        found += [(f"{tag}-decode", decode), (f"{tag}-plan", planned)]
    return found


def _compare(expected: dict, got: dict, name: str) -> None:
    assert set(got) == set(expected), name
    for key, want in expected.items():
        # blocked splits query tiles among as many workers as torch allows at that moment; the sums
        # over workers may round differently from the single-threaded run, nothing more
        torch.testing.assert_close(got[key], want, rtol=1e-5, atol=1e-5, equal_nan=True, msg=f"{name}: {key}")


def _run_threads(problems, expected, rounds=3):
    errors, barrier = [], threading.Barrier(THREADS)

    def worker(index):
        try:
            barrier.wait()
            for r in range(rounds):
                order = problems[index + r:] + problems[:index + r]  # each thread its own order
                for name, thunk in order:
                    _compare(expected[name], thunk(), name)
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(f"thread {index}: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, "\n".join(errors[:5])


@pytest.mark.parametrize("backends", [(None,), ("naive", "blocked")], ids=["dispatched", "forced"])
def test_eight_threads_cpu(backends):
    problems = _problems(backends=backends)
    expected = {name: thunk() for name, thunk in problems}
    threads_before = torch.get_num_threads()
    _run_threads(problems, expected)
    assert torch.get_num_threads() == threads_before, "blocked's pool left torch's thread count changed"


def test_eight_threads_while_the_dispatch_cache_clears(monkeypatch):
    """A cache that empties itself every few decisions (its size limit) never hands a thread a wrong backend."""
    problems = _problems()
    expected = {name: thunk() for name, thunk in problems}
    monkeypatch.setattr(dispatch, "_CACHE_LIMIT", 3)
    dispatch.clear_cache()
    _run_threads(problems, expected, rounds=2)


def test_threads_pick_what_one_thread_picks():
    """The backend each problem goes to does not depend on what other threads are doing."""
    q = torch.randn(1, 2, 16, 32)
    big = torch.randn(1, 2, 512, 32)
    expected = {n: attnx.explain(t, t, t).chosen for n, t in (("small", q), ("big", big))}
    seen, lock = [], threading.Lock()

    def worker():
        for _ in range(50):
            for n, t in (("small", q), ("big", big)):
                chosen = dispatch.choose(attnx.make_problem(t, t, t)).name
                with lock:
                    seen.append((n, chosen))

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {(n, c) for n, c in seen} == set(expected.items())


_COLD_START = textwrap.dedent("""
    import sys, threading, torch
    import attnx  # nothing else: the first attention call below loads the backends
    barrier, errors, outs = threading.Barrier(8), [], {}
    q = torch.randn(1, 2, 16, 16)
    def go(i):
        barrier.wait()
        try:
            outs[i] = attnx.attention(q, q, q, causal=True)
        except Exception as err:
            errors.append(f"{type(err).__name__}: {err}")
    threads = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    ref = attnx.attention(q, q, q, causal=True, backend="naive")
    bad = [i for i, o in outs.items() if not torch.allclose(o, ref, atol=1e-6)]
    print(f"{len(errors)} errors {errors[:1]}, {len(bad)} wrong")
    sys.exit(1 if errors or bad else 0)
""")


def test_eight_threads_on_a_cold_start():
    """R1 (fixed): threads racing the first call all see the built-in backends."""
    for _ in range(3):  # a race: give it three fresh processes
        proc = subprocess.run([sys.executable, "-c", _COLD_START], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


_TRITON_THREADS = textwrap.dedent("""
    import sys, threading, torch, attnx
    gen = torch.Generator().manual_seed(0)
    cases = []
    for i, (sq, sk, d, causal) in enumerate([(16, 16, 16, True), (24, 40, 32, False), (40, 24, 16, True),
                                             (17, 33, 64, False)]):
        q, k, v = (torch.randn(1, 2, s, d, generator=gen) for s in (sq, sk, sk))
        cases.append((q, k, v, causal))
    expected = [attnx.attention(q, k, v, causal=c, backend="naive") for q, k, v, c in cases]
    barrier, errors = threading.Barrier(8), []
    def go(i):
        barrier.wait()
        try:
            for r in range(2):
                for j in range(len(cases)):
                    q, k, v, c = cases[(i + j + r) % len(cases)]
                    out = attnx.attention(q, k, v, causal=c, backend="triton")
                    want = expected[(i + j + r) % len(cases)]
                    if not torch.allclose(out, want, atol=2e-4, rtol=1e-4):
                        errors.append(f"thread {i} case {(i + j + r) % len(cases)}: max err "
                                      f"{(out - want).abs().max().item():.3g}")
        except Exception as err:
            errors.append(f"thread {i}: {type(err).__name__}: {str(err)[:300]}")
    threads = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print("\\n".join(errors[:5]) or "ok")
    sys.exit(1 if errors else 0)
""")


def test_eight_threads_triton_interpreter():
    """R2 (fixed): the interpreter keeps launch state in globals; attnx's launcher serialises interpreted launches."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", _TRITON_THREADS], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


# -- streams and devices (GPU only) ----------------------------------------------------------
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU_BACKENDS = ["blocked", "naive", "triton", "cuda"]


def _gpu_backend_or_skip(name):
    backend = attnx.get_backend(name)
    if not backend.available:
        pytest.skip(f"{name} unavailable: {'; '.join(backend.unavailable_reasons)}")
    return backend


def _late_inputs(stream, device, dtype=torch.float16, shape=(2, 4, 300, 64)):
    """q, k, v written on `stream` only after ~50 ms of sleep there; their reference computed on it too."""
    gen = torch.Generator(device="cpu").manual_seed(7)
    host = [torch.randn(shape, generator=gen).to(dtype).pin_memory() for _ in range(3)]
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)   # the stream is busy; anything launched elsewhere runs before the copies
        q, k, v = (torch.empty(shape, dtype=dtype, device=device).copy_(h, non_blocking=True) for h in host)
    return host, (q, k, v)


def _reference(host, device, causal):
    q, k, v = (h.to(device).double() for h in host)
    return attnx.attention(q, k, v, causal=causal, backend="naive").float()


@cuda_only
@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_uses_the_callers_stream(name):
    _gpu_backend_or_skip(name)
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(device)
    host, (q, k, v) = _late_inputs(stream, device)
    with torch.cuda.stream(stream):
        q.requires_grad_()
        out = attnx.attention(q, k, v, causal=True, backend=name)
        out.float().sum().backward()
        grad = q.grad
    stream.synchronize()
    want = _reference(host, device, causal=True)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=0)
    assert torch.isfinite(grad).all()


@cuda_only
@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_eight_threads_eight_streams(name):
    _gpu_backend_or_skip(name)
    device = torch.device("cuda", torch.cuda.current_device())
    errors, barrier = [], threading.Barrier(THREADS)

    def worker(i):
        try:
            torch.cuda.set_device(device)
            stream = torch.cuda.Stream(device)
            barrier.wait()
            for causal in (True, False):
                host, (q, k, v) = _late_inputs(stream, device, shape=(1, 2, 100 + 37 * i, 64))
                with torch.cuda.stream(stream):
                    out = attnx.attention(q, k, v, causal=causal, backend=name)
                stream.synchronize()
                err = (out.float() - _reference(host, device, causal)).abs().max().item()
                if not err < 2e-2:
                    errors.append(f"thread {i} causal={causal}: max error {err:.3g}")
        except BaseException as err:  # noqa: BLE001
            errors.append(f"thread {i}: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, "\n".join(errors)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_tensors_on_another_device_than_the_current_one(name):
    """Device 0 is current, the tensors live on device 1: the kernels must run on device 1's current stream."""
    _gpu_backend_or_skip(name)
    torch.cuda.set_device(0)
    other = torch.device("cuda", 1)
    with torch.cuda.device(other):
        host, (q, k, v) = _late_inputs(torch.cuda.current_stream(other), other)
    assert torch.cuda.current_device() == 0
    out = attnx.attention(q, k, v, causal=True, backend=name)
    assert out.device == other
    torch.cuda.synchronize(other)
    torch.testing.assert_close(out.float(), _reference(host, other, causal=True), atol=2e-2, rtol=0)
