#!/usr/bin/env bash
# One device call (under 10 minutes) for what was built without a GPU on 2026-12-01, third
# session: the Hopper backward (first run: correctness, then speed), the GPU tests that have
# not run yet (determinism, index bounds, cache object replay), and triton decode bandwidth.
# Usage on the device machine: bash benchmarks/h200_next.sh "$OUT"; read "$OUT/summary.txt".
set -uo pipefail
out=${1:?usage: h200_next.sh OUTDIR}
export PYTHONUNBUFFERED=1
mkdir -p "$out/logs"
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$out/logs/install.log" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/logs/gpu.txt"

# 1. Hopper backward: the numbered grid against float64 (exits 1 on any failure), then timings
timeout 240 python3 -m benchmarks.hopper_backward check > "$out/logs/hopper_bwd_check.log" 2>&1
check_rc=$?
if [ $check_rc -eq 0 ]; then
    timeout 120 python3 -m benchmarks.hopper_backward time > "$out/logs/hopper_bwd_time.log" 2>&1
fi
# 2. GPU tests written on a CPU-only machine
timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_deterministic.py tests/test_index_bounds.py \
    tests/test_index_validation.py tests/test_kvcache_object.py tests/test_cuda_gpu.py \
    > "$out/logs/gpu_tests.log" 2>&1
# 3. triton decode bandwidth (Llama-3-8B shape) beside SDPA
timeout 60 python3 -m attnx.backends.triton.bench_decode --batch 8 --seqlen 32768 > "$out/logs/decode.log" 2>&1

timeout 200 python3 -m benchmarks.cuda_deterministic check > "$out/logs/cuda_det_check.log" 2>&1 && timeout 90 python3 -m benchmarks.cuda_deterministic time > "$out/logs/cuda_det_time.log" 2>&1  # 4. cuda deterministic backward (issue 11): float64 + bitwise check, then vs the atomic backward

tar -C "$out" -czf "$out/logs.tgz" logs
{
    echo "hopper_backward check rc=$check_rc"; tail -25 "$out/logs/hopper_bwd_check.log"
    tail -20 "$out/logs/hopper_bwd_time.log" 2>/dev/null
    tail -5 "$out/logs/gpu_tests.log"; tail -8 "$out/logs/decode.log"
} | tee "$out/summary.txt"
