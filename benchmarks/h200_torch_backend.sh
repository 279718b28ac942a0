#!/usr/bin/env bash
# One device call: the torch backend's per-device declarations checked on the H200.
#   1. the declaration tests (the CUDA walk of the grid runs only with a GPU),
#   2. full-profile conformance on CUDA, generated from what the backend declares there
#      (no --allow-extra-declines: an extra-only decline is a failure),
#   3. a fuzz run on CUDA with strict declines.
# Usage on the device machine: bash benchmarks/h200_torch_backend.sh "$OUT"
set -uo pipefail
out=${1:?usage: h200_torch_backend.sh OUTDIR}
day=$(date -u +%F)
export PYTHONUNBUFFERED=1
mkdir -p "$out"
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$out/install.log" 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_torch_declarations.py \
    tests/test_compat_torch_backend.py tests/test_call_memo.py > "$out/pytest.log" 2>&1
echo "pytest rc=$?" >> "$out/pytest.log"
timeout 150 python3 -m attnx.conformance --backend torch --profile full --device cuda -q \
    --report "$out/torch-h200-$day" > "$out/conformance.log" 2>&1
echo "conformance rc=$?" >> "$out/conformance.log"
timeout 150 python3 -m attnx.conformance.fuzz --backend torch --device cuda --count 500 --seed 12 \
    --strict-declines --time-limit 120 --report "$out" > "$out/fuzz.log" 2>&1
echo "fuzz rc=$?" >> "$out/fuzz.log"
tail -3 "$out/pytest.log" "$out/conformance.log" "$out/fuzz.log"
