#!/usr/bin/env bash
# One device call for the 2026-12-01 evidence after issues #8, #10, #12 and #13 landed:
# the paper benchmark with the torch backend beside triton/cuda/SDPA/Flex (alone on the GPU), then
# the fuzzers (triton, cuda) in the background while conformance (torch, triton) and the GPU
# integration tests run. Usage on the device machine: bash benchmarks/h200_final.sh "$OUT"
set -uo pipefail
out=${1:?usage: h200_final.sh OUTDIR}
day=$(date -u +%F)
export PYTHONUNBUFFERED=1
mkdir -p "$out/logs" "$out/reports"
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$out/logs/install.log" 2>&1
timeout 130 python3 -m benchmarks.paper --backend triton,cuda,torch --head-dims 128,64 --sdpa flash,cudnn \
    --no-flex --seqlens 1024,4096,16384 --max-seconds 115 --out "$out/paper-torch-h200-$day" \
    > "$out/logs/paper.log" 2>&1
for b in triton cuda; do
    timeout 280 python3 -m attnx.conformance.fuzz --backend $b --count 2000 --seed 1 --time-limit 250 \
        --report "$out/reports" -q > "$out/logs/fuzz-$b.log" 2>&1 &
done
timeout 120 python3 -m attnx.conformance --backend torch --profile full --device cuda -q \
    --report "$out/reports/torch-h200-$day" > "$out/logs/torch.log" 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider conformance --backend triton --profile full --device cuda \
    -n 8 > "$out/logs/triton-pytest.log" 2>&1
timeout 60 python3 -m attnx.conformance --backend triton --profile full --device cuda -q \
    --report "$out/reports/triton-h200-$day" > "$out/logs/triton.log" 2>&1
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_integration.py \
    > "$out/logs/integration.log" 2>&1
wait
tar -C "$out" -czf "$out/evidence.tgz" reports logs && rm -rf "$out/reports" "$out/logs"
for f in paper torch triton-pytest triton integration fuzz-triton fuzz-cuda; do
    echo "== $f"; tar -xzOf "$out/evidence.tgz" logs/$f.log | tail -4
done
