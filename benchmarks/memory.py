"""Peak extra memory of one call, beyond its inputs.

GPU: ``torch.cuda.max_memory_allocated`` minus what was allocated before the call.
CPU: torch's allocations are invisible to tracemalloc, so each point runs in a
fresh subprocess (``python -m benchmarks.memory``) that resets the kernel's
high-water mark (``/proc/self/clear_refs``) after building its inputs and
reports ``VmHWM - VmRSS`` around one call.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from .settings import Point

REPO_ROOT = Path(__file__).resolve().parent.parent


def available_bytes(device: str) -> int:
    """Memory a new allocation could still get on `device`."""
    if device == "cuda":
        free, _total = torch.cuda.mem_get_info()
        # blocks torch's caching allocator holds but does not use are free to this process too
        return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def measure_cuda(call) -> tuple[int, float]:
    """(peak bytes allocated during `call(0)` beyond what was allocated before it, seconds it took)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    call(0)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, time.perf_counter() - start


def _proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure_cpu(peer_name: str, point: Point, timeout_s: float) -> tuple[int, float]:
    """Run one point in a fresh interpreter: (its peak extra RSS in bytes, seconds the call took)."""
    request = json.dumps({"peer": peer_name, "point": point.as_dict(), "threads": torch.get_num_threads()})
    proc = subprocess.run([sys.executable, "-m", "benchmarks.memory", request], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        if proc.returncode < 0:
            tail = [f"killed by signal {-proc.returncode} (out of memory?)"]
        raise RuntimeError(f"memory probe failed: {tail[0]}")
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    return int(answer["extra_bytes"]), float(answer["seconds"])


def _probe(request: dict) -> dict:
    """Child side: build the inputs, warm the code path on a tiny problem, reset the peak, run once."""
    from dataclasses import replace

    from .peers import by_name
    from .timing import make_call, make_inputs

    torch.set_num_threads(request["threads"])
    point = Point(**request["point"])
    peer = by_name(request["peer"], "cpu")
    tiny = replace(point, seqlen_q=min(point.seqlen_q, 64), seqlen_k=min(point.seqlen_k, 64))
    make_call(peer.build(tiny), tiny, make_inputs(tiny, "cpu"))(0)  # load kernels, thread pools
    call = make_call(peer.build(point), point, make_inputs(point, "cpu"))
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before_kib = _proc_status_kib("VmRSS")
    start = time.perf_counter()
    call(0)
    seconds = time.perf_counter() - start
    return {"extra_bytes": max(0, _proc_status_kib("VmHWM") - before_kib) * 1024, "seconds": seconds}


if __name__ == "__main__":
    print(json.dumps(_probe(json.loads(sys.argv[1]))))
