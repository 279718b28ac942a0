#!/usr/bin/env bash
# One device call that produces the committed H200 evidence: conformance reports for the
# blocked and triton backends (full profile), the doctor's report, and the paper-setting
# benchmark of every attnx backend beside torch's SDPA backends and FlexAttention.
# Usage on the device machine: bash benchmarks/h200_session.sh "$OUT"
set -uo pipefail
out=${1:?usage: h200_session.sh OUTDIR}
day=$(date -u +%F)
export PYTHONUNBUFFERED=1
mkdir -p "$out/logs"
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$out/logs/install.log" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/logs/gpu.txt"

# triton: compile the variants in parallel first (pytest-xdist), then the report in one process
timeout 180 python3 -m pytest -q conformance --backend triton --profile full --device cuda -n 12 \
    > "$out/logs/triton-pytest.log" 2>&1
timeout 150 python3 -m attnx.conformance --backend triton --profile full --device cuda -q \
    --report "$out/triton-h200-$day" > "$out/logs/triton-conformance.log" 2>&1
timeout 150 python3 -m attnx.conformance --backend blocked --profile full --device cuda -q \
    --report "$out/blocked-h200-$day" > "$out/logs/blocked-conformance.log" 2>&1
timeout 60 python3 -m attnx.doctor > "$out/logs/doctor.txt" 2>&1
timeout 230 python3 benchmarks/run.py --setting paper --device cuda --head-dims 128,64 --dtypes bf16 \
    --max-seconds 200 --out "$out/bench" > "$out/logs/bench.log" 2>&1
tar -C "$out" -czf "$out/bench.tgz" bench && rm -rf "$out/bench"
tar -C "$out" -czf "$out/logs.tgz" logs
tail -3 "$out"/logs/*conformance.log; tail -4 "$out/logs/triton-pytest.log"; tail -40 "$out/logs/bench.log"
