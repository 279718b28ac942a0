#!/usr/bin/env bash
# One device call running named steps in order under one deadline (a call may last 10 minutes).
# Usage on the device machine: bash benchmarks/h200_steps.sh OUTDIR SECONDS STEP...
# Steps: tests gpu-tests conformance-cuda paper hopper-check hopper-time det-check det-time sanitize
#        decode-bw
# A "-time" step runs only when its "-check" step passed earlier in the same call.
# Each step's log is $OUT/logs/STEP.log; $OUT/summary.txt holds rc per step and each log's tail.
set -uo pipefail
out=${1:?usage: h200_steps.sh OUTDIR SECONDS STEP...}
deadline=$((SECONDS + ${2:?seconds}))
shift 2
export PYTHONUNBUFFERED=1
mkdir -p "$out/logs"
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$out/logs/install.log" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/logs/gpu.txt"
declare -A passed

run_step() {  # name max_seconds command...
    local name=$1 max=$2; shift 2
    local left=$((deadline - SECONDS)); local t=$((max < left ? max : left))
    if [ "$t" -lt 15 ]; then echo "$name: skipped, out of time" >> "$out/summary.txt"; return; fi
    local start=$SECONDS
    timeout "$t" "$@" > "$out/logs/$name.log" 2>&1
    local rc=$?
    [ $rc -eq 0 ] && passed[$name]=1
    echo "$name: rc=$rc in $((SECONDS - start)) s (limit $t)" >> "$out/summary.txt"
}
sanitize() {  # small problems of the new kernels under each compute-sanitizer tool
    for tool in memcheck racecheck synccheck; do
        compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 9 \
            python3 -m benchmarks.hopper_backward check --head-dims 64,128 --max-scores 40000 || return $?
        compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 9 \
            python3 -m benchmarks.cuda_deterministic check --max-scores 40000 || return $?
    done
}

for step in "$@"; do
    case "$step" in
    tests) run_step tests 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_deterministic.py \
               tests/test_index_bounds.py tests/test_index_validation.py tests/test_kvcache_object.py \
               tests/test_cuda_gpu.py ;;
    hopper-check) run_step hopper-check 220 python3 -m benchmarks.hopper_backward check ;;
    hopper-time) [ -n "${passed[hopper-check]:-}" ] && run_step hopper-time 200 \
               python3 -m benchmarks.hopper_backward time --seqlens 4096,16384 ;;
    det-check) run_step det-check 200 python3 -m benchmarks.cuda_deterministic check ;;
    det-time) [ -n "${passed[det-check]:-}" ] && run_step det-time 150 python3 -m benchmarks.cuda_deterministic time ;;
    sanitize) run_step sanitize 300 sanitize ;;
    gpu-tests) run_step gpu-tests 170 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_cuda_gpu.py ;;
    conformance-cuda) run_step conformance-cuda 170 python3 -m attnx.conformance --backend cuda --profile full \
               --device cuda -q --report "$out/cuda-h200-$(date -u +%F)" ;;
    paper) run_step paper 230 python3 -m benchmarks.paper --backend cuda,triton,torch --head-dims 128,64 \
               --sdpa flash,cudnn --flex-seqlens 4096,16384 --seqlens 1024,4096,16384 --max-seconds 190 \
               --out "$out/paper" ;;
    decode-bw) run_step decode-bw 90 python3 -m attnx.backends.triton.bench_decode --batch 8 --seqlen 32768 ;;
    *) echo "$step: unknown step" >> "$out/summary.txt" ;;
    esac
done

[ -d "$out/paper" ] && tar -C "$out" -czf "$out/paper.tgz" paper && rm -rf "$out/paper"
tar -C "$out" -czf "$out/logs.tgz" logs
for f in "$out"/logs/*.log; do echo "== $(basename "$f")"; tail -25 "$f"; done >> "$out/summary.txt"
rm -rf "$out/logs"  # (in logs.tgz: only 8 files come back from a call)
tail -c 11000 "$out/summary.txt"
