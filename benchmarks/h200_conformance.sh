#!/usr/bin/env bash
# One device call: full-profile conformance reports of every GPU-capable backend on the H200,
# and the doctor's report. Usage on the device machine: bash benchmarks/h200_conformance.sh "$OUT"
set -uo pipefail
out=${1:?usage: h200_conformance.sh OUTDIR}
day=$(date -u +%F)
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$out/install.log" 2>&1
# compile every kernel variant in parallel first (both caches are on disk), then one report per backend
timeout 170 python3 -m pytest -q conformance --backend triton,cuda --profile full --device cuda -n 12 \
    > "$out/pytest.log" 2>&1
for backend in triton cuda blocked; do
    timeout 70 python3 -m attnx.conformance --backend $backend --profile full --device cuda -q \
        --report "$out/$backend-h200-$day" > "$out/$backend.log" 2>&1
done
timeout 40 python3 -m attnx.doctor > "$out/doctor.txt" 2>&1
tar -C "$out" -czf "$out/logs.tgz" pytest.log install.log triton.log cuda.log blocked.log && \
    rm "$out"/{pytest,install,triton,cuda,blocked}.log
tail -2 "$out/doctor.txt"; grep -h "cases," "$out"/*.md 2>/dev/null | head; tar -xzOf "$out/logs.tgz" pytest.log | tail -3
