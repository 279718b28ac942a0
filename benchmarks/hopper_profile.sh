#!/usr/bin/env bash
# One device call: an Nsight Compute profile of the Hopper forward (d128 and d64, bf16, S = 16k,
# paper setting) -- speed of light, tensor-pipe use, warp stalls -- for backends/cuda/NOTES.md.
# Usage on the device machine: bash benchmarks/hopper_profile.sh "$OUT"
set -uo pipefail
out=${1:?usage: hopper_profile.sh OUTDIR}
cat > /tmp/hopper_one.py <<'PY'
import sys, torch, attnx
d = int(sys.argv[1]); causal = sys.argv[2] == "1"
h, s = 2048 // d, 16384
q, k, v = (torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(3):
    attnx.attention(q, k, v, causal=causal, backend="cuda")
torch.cuda.synchronize()
PY
for cfg in "128 0" "128 1" "64 0"; do
    set -- $cfg
    timeout 150 ncu --clock-control none --kernel-name attnx_fwd --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section Occupancy \
        python3 /tmp/hopper_one.py "$1" "$2" > "$out/ncu_d$1_causal$2.txt" 2>&1
    echo "d$1 causal=$2 rc=$?"
done
