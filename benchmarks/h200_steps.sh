#!/usr/bin/env bash
# One device call running named steps in order under one deadline (a call may last 10 minutes).
# Usage on the device machine: bash benchmarks/h200_steps.sh OUTDIR SECONDS STEP...
# Steps: tests gpu-tests conformance-cuda conformance-torch conformance-triton paper hopper-check hopper-time det-check det-time sanitize
#        decode-bw ordered ncu-bwd fuzz-triton decode-cuda paper-short huge sanitize-ordered
#        fuzz-triton-more fuzz-cuda profile-calls sanitize-grid initcheck-probe exact-alpha nan-rows decode-kernels ncu-decode-full ncu-decode-paged decode-sweep decode-sweep-swz decode-sweep-paged decode-sanitize decode-sanitize-quick serving-flex decode-swizzle decode-splits varlen-cuda varlen-hopper varlen-backward reliability dqlate ncu-bwd-sass replay recheck nan-fixup decode-fused dqwriter conformance-sm80 writer-next decode-bulk decode-rows
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
backward_knob() {  # config check_seconds tool...: see the knob steps below
    local config=$1 check_s=$2; shift 2
    run_step $config-check $check_s python3 -m benchmarks.hopper_backward check --configs $config
    [ -n "${passed[$config-check]:-}" ] || return 0
    run_step $config-time 170 python3 -m benchmarks.hopper_backward time --configs table,$config --seqlens 4096,16384
    for tool in "$@"; do run_step $config-$tool 100 compute-sanitizer --tool $tool --report-api-errors no \
        python3 -m benchmarks.hopper_backward check --configs $config --max-scores 20000; done
}
for step in "$@"; do
    case "$step" in
    tests) run_step tests 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_deterministic.py \
               tests/test_index_bounds.py tests/test_index_validation.py tests/test_kvcache_object.py tests/test_kvcache_gpu.py \
               tests/test_cuda_gpu.py tests/test_compat_torch_backend.py tests/test_call_memo.py \
               tests/test_gpu_integration.py tests/test_torch_declarations.py tests/test_compat_transformers.py ;;
    # this session's changes with GPU parts, quickly: the torch backend (training without lse), bounds,
    # the Triton cache tables (versions before 3.9)
    recheck) run_step recheck 120 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_compat_torch_backend.py \
               tests/test_call_memo.py tests/test_bounds.py tests/test_caches.py::test_triton_damaged_cache_entry \
               tests/test_reliability_cache.py::test_triton_corrupt_group_index_recompiles ;;
    # the torch backend's NaN-row lse fix-up: cheaper ways checked equal, then 1k training steps with each
    # (since 2026-12-03 "triton-keys", what training calls run: rows that see a NaN key only)
    nan-fixup) run_step nan-fixup 120 python3 -m benchmarks.nan_fixup time ;;
    # the fuzz regression records on the GPU backends (CI replays naive, blocked and the triton interpreter):
    # "fixed" records must pass, "known"/"open" ones fail as recorded (`tests/test_fuzz.py` `_expect`)
    replay) run_step replay 150 bash -c 'for b in cuda triton; do
            python3 -m attnx.conformance.fuzz --backend $b --device cuda --replay tests/fuzz_regressions.json; done' ;;
    # issue 13 items 3-4 and issue 12's entry points where they have GPU parts: caches (8 processes, damaged
    # and read-only caches, cuda end to end), threads and streams, the SDPA / flash-attn modules, compile
    reliability) run_step reliability 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_reliability_cache.py \
               tests/test_reliability_threads.py tests/test_caches.py tests/test_threads.py tests/test_compat_sdpa.py \
               tests/test_compat_flash_attn.py tests/test_autograd_compile.py tests/test_inference_mode.py ;;
    hopper-check) run_step hopper-check 220 python3 -m benchmarks.hopper_backward check ;;
    hopper-time) [ -n "${passed[hopper-check]:-}" ] && run_step hopper-time 200 \
               python3 -m benchmarks.hopper_backward time --seqlens 4096,16384 ;;
    det-check) run_step det-check 200 python3 -m benchmarks.cuda_deterministic check ;;
    det-time) [ -n "${passed[det-check]:-}" ] && run_step det-time 150 python3 -m benchmarks.cuda_deterministic time ;;
    # the new kernels' small problems under each tool (racecheck's hazards inside cuBLAS's nvjet kernels,
    # the reference's matmuls, are not ours); `timeout` runs programs, so the loop is its own shell
    sanitize) run_step sanitize 400 bash -c 'for tool in memcheck racecheck synccheck; do
            for m in hopper_backward cuda_deterministic; do
                compute-sanitizer --tool $tool --report-api-errors no python3 -m benchmarks.$m check \
                    --max-scores 20000 > "$0/logs/$tool-$m.txt" 2>&1
                echo "$tool $m: $(grep -c "Race reported.*attnx\|Invalid\|Barrier error" "$0/logs/$tool-$m.txt") findings in attnx kernels, $(grep "cases passed" "$0/logs/$tool-$m.txt")"
            done; done' "$out" ;;
    gpu-tests) run_step gpu-tests 170 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_cuda_gpu.py ;;
    conformance-cuda) run_step conformance-cuda 170 python3 -m attnx.conformance --backend cuda --profile full \
               --device cuda -q --report "$out/cuda-h200-$(date -u +%F)" ;;
    # the same grid on the Ampere family's kernels (what an A100 runs, built for sm_90a): forced_family.py
    conformance-sm80) run_step conformance-sm80 170 python3 -m benchmarks.family_grid sm80 --backend cuda --profile full \
               --device cuda -q --report "$out/cuda-sm80-on-h200-$(date -u +%F)" ;;
    conformance-torch) run_step conformance-torch 150 python3 -m attnx.conformance --backend torch --profile full \
               --device cuda -q --report "$out/torch-h200-$(date -u +%F)" ;;
    # (run 9 call 4: no result in 240 s with -q on a fresh machine, Triton's cache cold; 2026-12-01 took 30 s
    # after other triton steps: no -q, so the log shows how far it got)
    conformance-triton) run_step conformance-triton 420 python3 -m attnx.conformance --backend triton --profile full \
               --device cuda --report "$out/triton-h200-$(date -u +%F)" ;;
    paper) run_step paper 230 python3 -m benchmarks.paper --backend cuda,triton,torch --head-dims 128,64 \
               --sdpa flash,cudnn --flex-seqlens 4096,16384 --seqlens 1024,4096,16384 --max-seconds 190 \
               --out "$out/paper" ;;
    # the forward-only ranks decided from SDPA's numbers (torch backend without lse, 97): d64/d128 at 1k/4k
    paper-short) run_step paper-short 200 python3 -m benchmarks.paper --backend torch,cuda,triton --head-dims 64,128 \
               --sdpa cudnn --no-flex --seqlens 1024,4096,16384 --max-seconds 170 --out "$out/paper" ;;
    decode-bw) run_step decode-bw 90 python3 -m attnx.backends.triton.bench_decode --batch 8 --seqlen 32768 ;;
    # the Hopper backward's configurations (benchmarks/hopper_backward.py), each: 148 cases, then beside the
    # table, then the sanitizers named on the small cases. `dqlate`: the table without DQ_TMA (a step's dQ added
    # by `red` in the next step); `dqwriter`: the table's DQ_TMA adds made by a writer thread (opt-in)
    dqlate) backward_knob dqlate 220 memcheck synccheck racecheck ;;
    dqwriter) backward_knob dqwriter 200 memcheck synccheck ;;
    # the dispatched Hopper backward (DQ_LATE + DQ_TMA) at d128 16k: the full profile's details and SASS source counters (csv)
    ncu-bwd-sass) run_step ncu-bwd-sass 230 bash -c 'ncu --clock-control none --set full --import-source yes \
                -k attnx_bwd_wgmma -s 3 -c 1 -o "$0/logs/bwd" python3 -m benchmarks.hopper_backward time \
                --seqlens 16384 --head-dims 128 > "$0/logs/ncu-bwd-run.txt" 2>&1 &&
                ncu --import "$0/logs/bwd.ncu-rep" --page details > "$0/logs/ncu-bwd-details.txt" &&
                ncu --import "$0/logs/bwd.ncu-rep" --page source --csv --print-source sass > "$0/logs/ncu-bwd-sass.csv" &&
                gzip -f "$0/logs/ncu-bwd-sass.csv" && rm -f "$0/logs/bwd.ncu-rep"' "$out" ;;
    # DQ_WRITER (2026-12-03 run 13; run there as orderedwriter, orderedwriterrot: now ordered, orderedrot) in the
    # ordered twin (alone and with DQ_ROTATE) and over the table: each checked (the ordered ones: same bits over
    # reruns), then timed beside the table and the twin with consumer-thread turns, then the sanitizers
    writer-next) for c in ordered orderedrot dqwriter; do run_step $c-check 200 python3 -m \
                benchmarks.hopper_backward check --configs $c; done
            cfgs=table,orderedfence; for c in dqwriter ordered orderedrot; do
                [ -n "${passed[$c-check]:-}" ] && cfgs+=,$c; done
            [ "$cfgs" != table,orderedfence ] && run_step writer-next-time 200 python3 -m benchmarks.hopper_backward time \
                --configs $cfgs --seqlens 4096,16384
            for c in ordered dqwriter; do for tool in memcheck synccheck racecheck; do
                [ -n "${passed[$c-check]:-}" ] && run_step $c-$tool 100 compute-sanitizer --tool $tool \
                --report-api-errors no python3 -m benchmarks.hopper_backward check --configs $c --max-scores 20000
                done; done ;;
    # the Hopper backward's ordered dQ (deterministic): 148 cases x 3 runs, same bits; then its cost beside the
    # table's and the twin's with red additions in turn (orderedred: before run 12)
    ordered) run_step ordered-check 200 python3 -m benchmarks.hopper_backward check --configs ordered
            [ -n "${passed[ordered-check]:-}" ] && run_step ordered-time 150 python3 -m benchmarks.hopper_backward time \
                --configs table,ordered,orderedred --seqlens 4096,16384 ;;
    # one profile of the Hopper backward at d128 16k (the kernel's 4th launch: past compile and warm-up)
    ncu-bwd) run_step ncu-bwd 240 ncu --clock-control none --set full -k attnx_bwd_wgmma -s 3 -c 1 \
               python3 -m benchmarks.hopper_backward time --seqlens 16384 --head-dims 128 ;;
    # 8 seeds x 250 problems in parallel (Triton compiles on the CPUs; its disk cache is shared)
    fuzz-triton) run_step fuzz-triton 420 bash -c 'for seed in 1 2 3 4 5 6 7 8; do
            python3 -m attnx.conformance.fuzz --backend triton --space gpu --device cuda --count 250 \
                --seed $seed --time-limit 380 --report "$0/fuzz-triton" > "$0/logs/fuzz-triton-$seed.txt" 2>&1 &
            done; wait; tail -n 3 "$0"/logs/fuzz-triton-*.txt' "$out" ;;
    # issue 13 item 5: S = 2**20, tensors past 2**31 elements, grids past 65535 (cuda; triton's autotuning is slow)
    huge) run_step huge 200 python3 -m benchmarks.huge --backends cuda,triton --scale full --max-seconds 170 \
               --out "$out/huge" ;;
    # the ordered dQ's spinning turns under memcheck and synccheck (racecheck sees shared memory only)
    sanitize-ordered) run_step sanitize-ordered 150 bash -c 'for tool in memcheck synccheck; do
            compute-sanitizer --tool $tool --report-api-errors no python3 -m benchmarks.hopper_backward check \
                --configs ordered --max-scores 100000 > "$0/logs/$tool-ordered.txt" 2>&1
            echo "$tool ordered: $(grep -c "Invalid\|Barrier error" "$0/logs/$tool-ordered.txt") findings, $(grep "cases passed" "$0/logs/$tool-ordered.txt")"
            done' "$out" ;;
    # the cuda backend's fuzz since its decode kernel took cache and paged keys: 8 seeds x 250 in parallel
    # FUZZ_SEEDS picks the 8 seeds (default 21-28); FUZZ_MODULE="benchmarks.family_grid sm80 fuzz" fuzzes the
    # Ampere family's kernels (reports then under fuzz-cuda-forced/)
    fuzz-cuda) run_step fuzz-cuda 300 bash -c 'for seed in ${FUZZ_SEEDS:-21 22 23 24 25 26 27 28}; do
            python3 -m ${FUZZ_MODULE:-attnx.conformance.fuzz} --backend cuda --space gpu --device cuda --count 250 \
                --seed $seed --time-limit ${FUZZ_SECONDS:-270} --report "$0/fuzz-cuda${FUZZ_MODULE:+-forced}" \
                > "$0/logs/fuzz-cuda${FUZZ_MODULE:+-forced}-$seed.txt" 2>&1 &
            done; wait; tail -qn 2 "$0"/logs/fuzz-cuda*-*.txt' "$out" ;;
    # more triton fuzz seeds (9-20) for the 2,000-problem count, 85 s each in parallel
    fuzz-triton-more) run_step fuzz-triton-more 110 bash -c 'for seed in 9 10 11 12 13 14 15 16 17 18 19 20; do
            python3 -m attnx.conformance.fuzz --backend triton --space gpu --device cuda --count 250 \
                --seed $seed --time-limit 85 --report "$0/fuzz-triton" > "$0/logs/fuzz-triton-$seed.txt" 2>&1 &
            done; wait; tail -qn 2 "$0"/logs/fuzz-triton-*.txt' "$out" ;;
    # where the time goes: an eager cache/paged decode call's host side (cProfile), the torch backend's
    # training step against SDPA-cuDNN at 1k tokens (torch.profiler tables)
    profile-calls) run_step profile-calls 150 bash -c 'for fmt in cache paged; do
            python3 -m benchmarks.call_profile decode --format $fmt; done
            for d in 64 128; do python3 -m benchmarks.call_profile training --seqlen 1024 --head-dim $d; done
            python3 -m benchmarks.call_profile training --seqlen 1024 --head-dim 128 --causal' ;;
    # the conformance grid of the cuda backend under each compute-sanitizer tool (issue 13: full grid), in
    # 8 shards at once per tool (one process under a tool is slow: memcheck and racecheck each ran past 120 s
    # alone on 2026-12-02; not quiet, so a finding is followed by its case line). SANITIZE_TOOLS picks tools,
    # SANITIZE_SECONDS caps each tool (racecheck did not finish its shards in 140 s); SANITIZE_EXTRA adds
    # options, e.g. "--show-backtrace no --print-limit 5000" (past the default 100 reports); not
    # "--kernel-name kns=attnx_" (2026-12-02: racecheck then fails every case with an internal sanitizer
    # error, and initcheck, blind to the uninstrumented torch kernels' writes, flags every read of delta
    # and lse). SANITIZE_CASES adds conformance options, e.g. "--exclude FILE" (cases a run already cleared), or
    # "--calls-only" (the backend's calls without the float64 oracle, whose cuBLAS kernels the tool slows most).
    # SANITIZE_MODULE="benchmarks.family_grid sm80" runs the grid on the Ampere family's kernels.
    sanitize-grid) run_step sanitize-grid 560 bash -c 'for tool in ${SANITIZE_TOOLS:-memcheck synccheck racecheck initcheck}; do
            for i in 0 1 2 3 4 5 6 7; do
                timeout ${SANITIZE_SECONDS:-130} compute-sanitizer --tool $tool --report-api-errors no ${SANITIZE_EXTRA:-} \
                    python3 -m ${SANITIZE_MODULE:-attnx.conformance} --backend cuda --profile full --device cuda --shard $i/8 ${SANITIZE_CASES:-} \
                    > "$0/logs/grid-$tool-$i.txt" 2>&1 &
            done; wait
            for f in "$0"/logs/grid-$tool-?.txt; do  # findings printed before each case line (a case prints when done)
                awk "/Invalid|Race reported|Barrier error|Uninitialized/ {n++} /^\\[/ {print n + 0, \$0; n = 0}" "$f"
            done > "$0/logs/grid-$tool-cases.txt"
            cat "$0"/logs/grid-$tool-?.txt > "$0/logs/grid-$tool.txt"; rm "$0"/logs/grid-$tool-?.txt
            echo "$tool: $(grep -c "Invalid\|Race reported.*attnx\|Barrier error\|Uninitialized" "$0/logs/grid-$tool.txt") findings; $(grep -h "cases," "$0/logs/grid-$tool.txt" | tr "\n" " ")"
            done' "$out" ;;
    # does initcheck track TMA (bulk-tensor) stores? reads of a TMA-written out vs plain-stored lse
    initcheck-probe) run_step initcheck-probe 120 bash -c 'compute-sanitizer --help | grep -i -A2 "bulk\|tma" | head -20
            for which in out lse; do echo "== $which"; PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool initcheck --report-api-errors no \
                python3 -m benchmarks.initcheck_probe $which 2>&1 | grep -v "Host Frame" | head -30; done' ;;
    # EXACT_ALPHA's cost and lse, the default kernels beside their twins without it
    exact-alpha) run_step exact-alpha 150 python3 -m benchmarks.exact_alpha ;;
    # ways to find NaN rows for the torch backend's lse fix-up (its amax: 0.34 ms of a 1k training step)
    nan-rows) run_step nan-rows 90 python3 -m benchmarks.nan_rows ;;
    # key splits beyond the heuristic's (B = 1: 29 splits x 8 programs on 264 slots ran 0.85x cuDNN)
    decode-splits) run_step decode-splits 240 bash -c 'for b in "1 0,33,66,99" "8 0,8,12"; do set -- $b
            python3 -m benchmarks.cuda_decode sweep --tile n16w4s3 --exact-alpha --batches $1 --formats cache,paged16 \
                --splits $2 || exit 1; done' ;;
    # the decode tile sweep (each candidate checked against float64 first), EXACT_ALPHA's twin included
    # where a replayed decode step's time goes: kernel device times against the replay (launch gaps), then
    # ncu (speed of light, memory, occupancy, stalls) on the decode kernel, its combine and cuDNN's at B = 8, 32k
    decode-kernels) run_step decode-kernels 120 python3 -m benchmarks.decode_kernel_times
            run_step ncu-decode 200 bash -c 'for k in "regex:attnx_decode" "regex:(?i)cudnn|fmha|sdpa"; do
                ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
                    --section WarpStateStats --section LaunchStats --section SchedulerStats -k "$k" -s 6 -c 2 \
                    python3 -m benchmarks.decode_kernel_times --batches 8 --lengths 32768; done' ;;
    # the decode kernel's L2 lookups (34 % hits where cuDNN's kernel has 1 %, run 6): L2 sectors and requests
    # by hit/miss for both kernels at B = 8, 32k, then one full profile with SASS source counters (csv)
    ncu-decode-full) run_step ncu-decode-l2 150 bash -c 'for k in "regex:^attnx_decode$" "regex:cudnn.*fprop"; do
                ncu --clock-control none -k "$k" -s 6 -c 1 --metrics lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum,lts__t_requests_srcunit_tex_op_read.sum,dram__sectors_read.sum,lts__t_sectors_srcunit_ltcfabric.sum,smsp__inst_executed_op_ldgsts.sum \
                    python3 -m benchmarks.decode_kernel_times --batches 8 --lengths 32768; done'
            run_step ncu-decode-sass 240 bash -c 'ncu --clock-control none --set full --import-source yes -k "regex:^attnx_decode$" -s 6 -c 1 \
                -o "$0/logs/decode" python3 -m benchmarks.decode_kernel_times --batches 8 --lengths 32768 >/dev/null &&
                ncu --import "$0/logs/decode.ncu-rep" --page source --csv --print-source sass > "$0/logs/ncu-decode-sass.csv" &&
                gzip -f "$0/logs/ncu-decode-sass.csv" && rm -f "$0/logs/decode.ncu-rep"' "$out" ;;
    # paged pools read 10 % below a cache at B = 64 (run 8): the paged kernel alone (the launcher's tile),
    # L2 sectors and a full profile with SASS source counters (page lookups)
    ncu-decode-paged) run_step ncu-decode-paged 240 bash -c 'for fmt in cache paged16; do ncu --clock-control none \
                -k "regex:^attnx_decode$" -s 3 -c 1 --metrics lts__t_sectors_srcunit_tex_op_read.sum,lts__t_requests_srcunit_tex_op_read.sum,dram__sectors_read.sum,smsp__inst_executed_op_ldgsts.sum,gpu__time_duration.sum \
                python3 -m benchmarks.decode_kernel_times --batches 64 --lengths 32768 --formats $fmt --no-cudnn; done &&
                ncu --clock-control none --set full --import-source yes -k "regex:^attnx_decode$" -s 3 -c 1 -o "$0/logs/paged" \
                python3 -m benchmarks.decode_kernel_times --batches 64 --lengths 32768 --formats paged16 --no-cudnn >/dev/null &&
                ncu --import "$0/logs/paged.ncu-rep" --page source --csv --print-source sass > "$0/logs/ncu-paged-sass.csv" &&
                gzip -f "$0/logs/ncu-paged-sass.csv" && rm -f "$0/logs/paged.ncu-rep"' "$out" ;;
    # page sizes 1 and 16 with the launcher's two d128 tiles, padded and swizzled (run 8 call 3: page 1 lost
    # 7-10 % at B = 64 with the swizzled ring, paged 16 is 0.89x the cache there)
    decode-sweep-paged) run_step decode-sweep-paged 200 python3 -m benchmarks.cuda_decode sweep \
                --tile n16w4s2+ea,n16w4s2+ea+swz,n16w4s3+ea,n16w4s3+ea+swz --formats cache,paged16,paged1 \
                --batches 1,8,64 --lengths 4096,32768 ;;
    decode-sweep) run_step decode-sweep 150 python3 -m benchmarks.cuda_decode sweep --exact-alpha ;;
    # every sweep candidate beside its swizzled-ring twin (run 7 swept only the launcher's tile swizzled)
    decode-sweep-swz) run_step decode-sweep-swz 300 python3 -m benchmarks.cuda_decode sweep --tile all+swz ;;
    # the swizzled K/V ring (KV_SWIZZLE, 2026-12-02): every d128 case and the tile cases at d64/d256, then the
    # launcher's tile padded vs swizzled (and s4, which the smaller rows leave room for) side by side
    decode-swizzle) run_step decode-swizzle-check 200 bash -c 'python3 -m benchmarks.cuda_decode check --tile n16w4s3+ea+swz --all-cases &&
                python3 -m benchmarks.cuda_decode check --head-dim 64 --tile n16w4s4+ea+swz &&
                python3 -m benchmarks.cuda_decode check --head-dim 256 --tile n16w4s2+ea+swz'
            [ -n "${passed[decode-swizzle-check]:-}" ] && run_step decode-swizzle-sweep 200 python3 -m benchmarks.cuda_decode \
                sweep --tile n16w4s3+ea,n16w4s3+ea+swz,n16w4s4+ea+swz --batches 1,8,64 ;;
    # the Ampere-family varlen forward (VARLEN knob, written offline): check, garbage cu_seqlens under
    # memcheck, then time beside triton's varlen and the dense kernel
    varlen-cuda) run_step varlen-cuda-check 120 python3 -m benchmarks.cuda_varlen check
            [ -n "${passed[varlen-cuda-check]:-}" ] && run_step varlen-cuda-memcheck 90 compute-sanitizer \
                --tool memcheck --report-api-errors no python3 -m benchmarks.cuda_varlen check --only garbage
            [ -n "${passed[varlen-cuda-check]:-}" ] && run_step varlen-cuda-time 120 python3 -m benchmarks.cuda_varlen time ;;
    # the opt-in Hopper varlen forward (sm90 fa_fwd.cu VARLEN=1, written offline 2026-12-02): check, garbage
    # cu_seqlens under memcheck, then time beside the Ampere varlen kernel, triton's and the dense Hopper forward
    varlen-hopper) run_step varlen-hopper-check 120 python3 -m benchmarks.cuda_varlen check --hopper
            [ -n "${passed[varlen-hopper-check]:-}" ] && run_step varlen-hopper-memcheck 90 compute-sanitizer \
                --tool memcheck --report-api-errors no python3 -m benchmarks.cuda_varlen check --hopper --only garbage
            [ -n "${passed[varlen-hopper-check]:-}" ] && run_step varlen-hopper-time 150 python3 -m benchmarks.cuda_varlen \
                time --hopper --dims 128,64 ;;
    # the packed backward (the Ampere backward built with VARLEN=1, 2026-12-02): gradients against float64,
    # memcheck on the NaN-tail cases, then fwd+bwd beside triton's varlen and the dense path
    varlen-backward) run_step varlen-backward-check 150 python3 -m benchmarks.cuda_varlen_backward check
            [ -n "${passed[varlen-backward-check]:-}" ] && run_step varlen-backward-memcheck 90 compute-sanitizer \
                --tool memcheck --report-api-errors no python3 -m benchmarks.cuda_varlen_backward check --only tail
            [ -n "${passed[varlen-backward-check]:-}" ] && run_step varlen-backward-time 150 python3 -m \
                benchmarks.cuda_varlen_backward time --dims 128 ;;
    # the decode kernel under the sanitizers: garbage page tables and lengths (memcheck), the rings (racecheck,
    # synccheck) on mixed page sizes
    decode-sanitize) run_step decode-memcheck 120 compute-sanitizer --tool memcheck --report-api-errors no \
                python3 -m benchmarks.cuda_decode check --only "bad index"
            for tool in racecheck synccheck; do run_step decode-$tool 120 compute-sanitizer --tool $tool \
                --report-api-errors no python3 -m benchmarks.cuda_decode check --only mixed; done ;;
    # the serving tables with FlexAttention beside them (dense decode; packed tokens under a document mask)
    serving-flex) run_step decode-flex-time 240 python3 -m benchmarks.cuda_decode time
            run_step varlen-flex-time 330 python3 -m benchmarks.cuda_varlen time --hopper --dims 128 ;;
    # memcheck and synccheck only (racecheck takes ~110 s): garbage tables and lengths, mixed page sizes
    decode-sanitize-quick) run_step decode-memcheck 120 compute-sanitizer --tool memcheck --report-api-errors no \
                python3 -m benchmarks.cuda_decode check --only "bad index"
            run_step decode-synccheck 120 compute-sanitizer --tool synccheck --report-api-errors no \
                python3 -m benchmarks.cuda_decode check --only mixed ;;
    # FUSED_COMBINE (opt-in): every check case against float64, bitwise against the separate combine and over
    # graph replays; memcheck on the split cases; then the time table with its rows beside the launcher's
    decode-fused) run_step decode-fused-check 200 python3 -m benchmarks.cuda_decode check --fused
            run_step decode-fused-memcheck 120 compute-sanitizer --tool memcheck --report-api-errors no \
                python3 -m benchmarks.cuda_decode check --fused --only splits
            [ -n "${passed[decode-fused-check]:-}" ] && run_step decode-fused-time 260 python3 -m \
                benchmarks.cuda_decode time --fused ;;
    # KV_BULK (a K/V row per bulk copy on sm_90, written 2026-12-03 session 18): every d128 case on both d128
    # tiles and the tile cases at d64/d256 against float64, memcheck on garbage tables and lengths, synccheck on
    # mixed page sizes (last); the launcher's swizzled rings beside the bulk twins over key formats and layouts
    decode-bulk) run_step decode-bulk-check 240 bash -c 'python3 -m benchmarks.cuda_decode check --all-cases \
                --tile n16w4s2+ea+bulk,n16w4s3+ea+bulk && python3 -m benchmarks.cuda_decode check --head-dim 64 \
                --tile n16w4s4+ea+bulk && python3 -m benchmarks.cuda_decode check --head-dim 256 --tile n16w4s2+ea+bulk'
            [ -n "${passed[decode-bulk-check]:-}" ] && run_step decode-bulk-sweep 300 python3 -m benchmarks.cuda_decode \
                sweep --tile n16w4s2+ea+swz,n16w4s2+ea+bulk,n16w4s3+ea+swz,n16w4s3+ea+bulk --batches 1,8,64 \
                --lengths 4096,32768,131072 --formats cache,cache-tok,paged16,paged16-hnd,paged1 --max-gb 20
            for tool in memcheck synccheck; do run_step decode-bulk-$tool 100 compute-sanitizer --tool $tool \
                --report-api-errors no python3 -m benchmarks.cuda_decode check --tile n16w4s2+ea+bulk \
                --only "$([ $tool = memcheck ] && echo 'bad index' || echo mixed)"; done ;;
    # the launcher with bulk rings for pools of pages smaller than a key block (DECODE_KV_BULK, run 14 call 2):
    # every check case, memcheck on garbage tables, then the time table with the token-major cache beside
    decode-rows) run_step decode-rows-check 150 python3 -m benchmarks.cuda_decode check
            run_step decode-rows-memcheck 100 compute-sanitizer --tool memcheck --report-api-errors no \
                python3 -m benchmarks.cuda_decode check --only "bad index"
            [ -n "${passed[decode-rows-check]:-}" ] && run_step decode-rows-time 300 python3 -m benchmarks.cuda_decode \
                time --formats dense,cache,cache-tok,paged16,paged1 ;;
    decode-cuda) run_step decode-cuda-check 150 python3 -m benchmarks.cuda_decode check
            [ -n "${passed[decode-cuda-check]:-}" ] && run_step decode-cuda-time 200 python3 -m benchmarks.cuda_decode time ;;
    *) echo "$step: unknown step" >> "$out/summary.txt" ;;
    esac
done

for d in paper fuzz-triton fuzz-cuda fuzz-cuda-forced huge; do [ -d "$out/$d" ] && tar -C "$out" -czf "$out/$d.tgz" "$d" && rm -rf "${out:?}/$d"; done
tar -C "$out" -czf "$out/logs.tgz" logs
for f in "$out"/logs/*.log; do echo "== $(basename "$f")"; tail -25 "$f"; done >> "$out/summary.txt"
rm -rf "$out/logs"  # (in logs.tgz: only 8 files come back from a call)
tail -c 11000 "$out/summary.txt"
