#!/usr/bin/env bash
# Device calls for what was built without a GPU on 2026-12-01 (third session). Each part fits in
# one 10-minute device call; run them as separate calls, in this order:
#   hopper    the Hopper backward's first run: the numbered grid against float64 (exits 1 on any
#             failure), then its timings beside the Ampere backward, cuDNN and SDPA-flash
#   det       the cuda deterministic backward (separate dQ pass): float64 + bitwise check, then its
#             cost against the atomic backward
#   tests     GPU tests written on a CPU-only machine, and triton decode bandwidth
# Usage on the device machine: bash benchmarks/h200_next.sh "$OUT" PART; read "$OUT/summary.txt".
set -uo pipefail
out=${1:?usage: h200_next.sh OUTDIR hopper|det|tests}
part=${2:?usage: h200_next.sh OUTDIR hopper|det|tests}
export PYTHONUNBUFFERED=1
mkdir -p "$out/logs"
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$out/logs/install.log" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/logs/gpu.txt"

case "$part" in
hopper)
    timeout 300 python3 -m benchmarks.hopper_backward check > "$out/logs/check.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] && timeout 200 python3 -m benchmarks.hopper_backward time > "$out/logs/time.log" 2>&1 ;;
det)
    timeout 300 python3 -m benchmarks.cuda_deterministic check > "$out/logs/check.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] && timeout 200 python3 -m benchmarks.cuda_deterministic time > "$out/logs/time.log" 2>&1 ;;
tests)
    timeout 300 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_deterministic.py tests/test_index_bounds.py \
        tests/test_index_validation.py tests/test_kvcache_object.py tests/test_cuda_gpu.py \
        > "$out/logs/check.log" 2>&1
    rc=$?
    timeout 120 python3 -m attnx.backends.triton.bench_decode --batch 8 --seqlen 32768 > "$out/logs/time.log" 2>&1 ;;
*)
    echo "unknown part $part (hopper, det or tests)"; exit 2 ;;
esac

tar -C "$out" -czf "$out/logs.tgz" logs
{ echo "$part: check rc=$rc"; tail -30 "$out/logs/check.log"; tail -25 "$out/logs/time.log" 2>/dev/null; } \
    | tee "$out/summary.txt"
