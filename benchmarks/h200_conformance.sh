#!/usr/bin/env bash
# One device call: full-profile conformance reports of every GPU-capable backend on the H200,
# and the doctor's report. Usage on the device machine: bash benchmarks/h200_conformance.sh "$OUT"
# Reports come back as one archive (the device tool returns at most 8 files).
set -uo pipefail
out=${1:?usage: h200_conformance.sh OUTDIR}
day=$(date -u +%F)
export PYTHONUNBUFFERED=1
mkdir -p "$out/reports" "$out/logs"
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$out/logs/install.log" 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/logs/gpu.txt" 2>&1
# compile every kernel variant in parallel first (both caches are on disk), then one report per backend
timeout 200 python3 -m pytest -q -p no:cacheprovider conformance --backend triton,cuda --profile full \
    --device cuda -n 12 > "$out/logs/pytest.log" 2>&1
for backend in triton cuda blocked; do
    timeout 100 python3 -m attnx.conformance --backend $backend --profile full --device cuda -q \
        --report "$out/reports/$backend-h200-$day" > "$out/logs/$backend.log" 2>&1
done
timeout 40 python3 -m attnx.doctor > "$out/logs/doctor.txt" 2>&1
tar -C "$out" -czf "$out/conformance.tgz" reports logs && rm -rf "$out/reports" "$out/logs"
tar -xzOf "$out/conformance.tgz" logs/pytest.log | tail -4
for b in triton cuda blocked; do tar -xzOf "$out/conformance.tgz" logs/$b.log | tail -3; done
