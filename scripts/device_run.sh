#!/usr/bin/env bash
# One call on a GPU machine: environment facts, kernel builds (ptxas report), the GPU
# test tier at world size 1 and at every GPU, then benchmarks.  Logs go to $OUT.
#   MEGAMOE_GIT_COMMIT=<sha> scripts/device_run.sh quick|full|mainloop|microsweep|ab|knob|iterate|cycles|power|tiers|oversub|final|publish|record|profile|stalls|bench|pack [args]
# Every mode rewrites $OUT/env.txt. Chain modes in one call with ';' and end with 'pack' when they write more
# than 8 files (a device call returns at most 8).
# (the copied tree has no git history: the commit recorded in result rows comes from that variable)
# mainloop [args]: the main-loop microbenchmark (microsweep: under each operand source); ab: AB_PATCH=<diff inside the tree, e.g. an untracked
# file> is reverse-applied to a copy and both kernels are timed alternately (AB_TOKENS, AB_CONFIGS,
# AB_SKIP_TESTS, AB_NPROC=N: an expert-parallel layer over N GPUs, AB_ARGS: more profile_fused.py options
# (e.g. "--b2b --iters 10": 20 calls back to back; add --b2b-given for calls given their inputs too),
# AB_VARIANT_ENV="VAR=value ...": a third timing of this tree under that environment)
# knob: KNOB=<environment variable> KNOB_VALUES="<v1> <v2> ..." timed alternately in this one tree, each value
# checked by the quick fused tier first (e.g. KNOB=MEGAMOE_PROMOTION_HINTS KNOB_VALUES="off yield hold")
set -uo pipefail
MODE=${1:-quick}
shift || true
OUT=${OUT:-/tmp/megamoe-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MEGAMOE_CACHE_DIR=${MEGAMOE_CACHE_DIR:-/tmp/megamoe-jit} MEGAMOE_TIMEOUT_S=${MEGAMOE_TIMEOUT_S:-20}
NGPU=$(nvidia-smi -L | wc -l)
{
  date -u +%FT%TZ; echo "commit ${MEGAMOE_GIT_COMMIT:-unknown (pass MEGAMOE_GIT_COMMIT=<sha> from the checkout)}"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvidia-smi topo -m 2>/dev/null | head -5
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
} 2>&1 | tee "$OUT/env.txt"

run() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "=== $name rc=$rc"
}

case "$MODE" in
  quick|full)
    [ "$MODE" = quick ] && export MEGAMOE_GPU_QUICK=1
    run gpu_ws1 300 python3 -m pytest tests/gpu -x -q -s -p no:cacheprovider
    if [ "$NGPU" -gt 1 ]; then
      run gpu_wsN 400 torchrun --standalone --nproc-per-node "$NGPU" -m pytest tests/gpu -x -q -s -p no:cacheprovider
    fi
    ;;
  mainloop)  # the main-loop microbenchmark (csrc/microbench/mainloop.cu): loop shapes alone, one GPU
    NVCC=$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | head -1)
    run mainloop_build 300 "$NVCC" -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -o /tmp/mainloop csrc/microbench/mainloop.cu
    run mainloop 300 /tmp/mainloop "$@"
    run mainloop_noload 300 /tmp/mainloop --no-load "$@"
    ;;
  microsweep)  # the main-loop microbenchmark under each operand source, one GPU, one build
    NVCC=$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | head -1)
    run mainloop_build 300 "$NVCC" -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -o /tmp/mainloop csrc/microbench/mainloop.cu
    i=0
    for opts in "" "--random" "--tma2d" "--tma2d --random" "--tma2d --random --copy-mib 64" \
                "--tma2d --random --tile-kb 56 2000"; do
      i=$((i + 1))
      run "microsweep_$i" 120 /tmp/mainloop $opts ${MICROSWEEP_MODES:-halves nopromo128 quarters}
    done
    ;;
  ab)  # A/B of a kernel change on one GPU: AB_PATCH (a diff from the base tree to this one) is
       # reverse-applied to a copy; both trees are timed alternately, after this tree's quick tier
    export MEGAMOE_GPU_QUICK=1
    BASE=/tmp/ab_base; rm -rf "$BASE"; mkdir -p "$BASE"
    tar --exclude=./.git -cf - . | tar -xf - -C "$BASE"
    (cd "$BASE" && patch -s -R -p1 < "$PWD/${AB_PATCH:?set AB_PATCH}") || { echo "patch -R failed"; exit 1; }
    [ -z "${AB_SKIP_TESTS:-}" ] && run gpu_ws1 300 python3 -m pytest tests/gpu/test_fused.py -x -q -s -p no:cacheprovider
    # AB_NPROC=N times an expert-parallel layer over N GPUs (torchrun) instead of one GPU
    PY=(python3); [ "${AB_NPROC:-1}" -gt 1 ] && PY=(torchrun --standalone --nproc-per-node "$AB_NPROC")
    for r in 1 2; do
      run timing_base$r 300 env PYTHONPATH="$BASE" MEGAMOE_CACHE_DIR=/tmp/megamoe-jit-base "${PY[@]}" "$BASE/scripts/profile_fused.py" --preset deepseek-v3 --tokens ${AB_TOKENS:-64,16384} --configs ${AB_CONFIGS:-64:4,128:4} ${AB_ARGS:-}
      run timing_new$r 300 "${PY[@]}" scripts/profile_fused.py --preset deepseek-v3 --tokens ${AB_TOKENS:-64,16384} --configs ${AB_CONFIGS:-64:4,128:4} ${AB_ARGS:-}
      # AB_VARIANT_ENV="VAR=value ...": a third timing, of this tree under that environment
      if [ -n "${AB_VARIANT_ENV:-}" ]; then
        run timing_variant$r 300 env $AB_VARIANT_ENV MEGAMOE_CACHE_DIR=/tmp/megamoe-jit-variant "${PY[@]}" scripts/profile_fused.py --preset deepseek-v3 --tokens ${AB_TOKENS:-64,16384} --configs ${AB_CONFIGS:-64:4,128:4} ${AB_ARGS:-}
      fi
    done
    ;;
  knob)  # A/B of an environment knob in this tree: KNOB=<variable> KNOB_VALUES="<v1> <v2> ..." timed
          # alternately, twice, after the quick fused tier at each value (AB_TOKENS, AB_CONFIGS,
          # AB_SKIP_TESTS, AB_NPROC, AB_ARGS as in ab); logs timing_knob_<index>_<value>_<round>
    export MEGAMOE_GPU_QUICK=1
    : "${KNOB:?set KNOB}" "${KNOB_VALUES:?set KNOB_VALUES}"
    tag() { echo "$1" | tr -c 'A-Za-z0-9.\n' '_'; }
    i=0
    for v in $KNOB_VALUES; do
      i=$((i + 1))
      [ -z "${AB_SKIP_TESTS:-}" ] && run "gpu_ws1_knob_${i}_$(tag "$v")" 300 env "$KNOB=$v" python3 -m pytest tests/gpu/test_fused.py -x -q -s -p no:cacheprovider
    done
    PY=(python3); [ "${AB_NPROC:-1}" -gt 1 ] && PY=(torchrun --standalone --nproc-per-node "$AB_NPROC")
    for r in 1 2; do
      i=0
      for v in $KNOB_VALUES; do
        i=$((i + 1))
        run "timing_knob_${i}_$(tag "$v")_$r" 300 env "$KNOB=$v" "${PY[@]}" scripts/profile_fused.py --preset deepseek-v3 --tokens ${AB_TOKENS:-64,16384} --configs ${AB_CONFIGS:-64:4,128:4} ${AB_ARGS:-}
      done
    done
    ;;
  bench)
    run bench 500 python3 -m megamoe_cli bench --out "$OUT/bench.csv" "$@"
    ;;
  quickbench)
    export MEGAMOE_GPU_QUICK=1
    run gpu_wsN 300 torchrun --standalone --nproc-per-node "$NGPU" -m pytest tests/gpu -x -q -s -p no:cacheprovider
    run bench_dsv3 300 python3 -m megamoe_cli bench --preset deepseek-v3 --tokens 128,8192 --backend fused,torch --out "$OUT/bench.csv"
    run bench_seed 300 python3 -m megamoe_cli bench --preset seed-default --tokens 128,8192 --backend fused,torch --out "$OUT/bench.csv"
    ;;
  iterate)
    export MEGAMOE_GPU_QUICK=1
    run gpu_wsN 300 torchrun --standalone --nproc-per-node "$NGPU" -m pytest tests/gpu/test_fused.py -x -q -s -p no:cacheprovider
    run timing 300 python3 scripts/profile_fused.py --preset deepseek-v3 --tokens 64,16384 --configs ${TIMING_CONFIGS:-64:4,128:3,128:3:0:2}
    run bench_dsv3 300 python3 -m megamoe_cli bench --preset deepseek-v3 --tokens 128,8192 --backend fused,torch --iters 10 --out "$OUT/bench.csv"
    ;;
  cycles)  # correctness at every world size, kernel-alone timing, cycle counters, EP layer times
    export MEGAMOE_GPU_QUICK=1
    run gpu_wsN 300 torchrun --standalone --nproc-per-node "$NGPU" -m pytest tests/gpu/test_fused.py -x -q -s -p no:cacheprovider
    run timing 300 python3 scripts/profile_fused.py --preset deepseek-v3 --tokens 64,16384 --configs ${TIMING_CONFIGS:-64:4,128:4}
    CUOBJDUMP=$(command -v cuobjdump || ls /usr/local/cuda*/bin/cuobjdump 2>/dev/null | head -1)
    for d in "$MEGAMOE_CACHE_DIR"/megamoe_h7168_i2048_e256_k8_r1_t16384_m128_s4_c1-*; do
      [ -f "$d/kernel.cubin" ] && "$CUOBJDUMP" -sass "$d/kernel.cubin" > "$OUT/sass_m128_s4.txt" 2>&1
    done
    run cycles_prefill 200 python3 scripts/profile_fused.py --profile --tokens 16384 --configs ${PROFILE_PREFILL:-128:4} --iters 3 --warmup 1
    if [ "$NGPU" -gt 1 ]; then
      run ep_decode 200 torchrun --standalone --nproc-per-node "$NGPU" scripts/profile_fused.py --tokens 1,128 --configs 64:4 --iters 10
      run ep_cycles_decode 200 torchrun --standalone --nproc-per-node "$NGPU" scripts/profile_fused.py --profile --tokens 1,128 --configs 64:4 --iters 3 --warmup 1
      run ep_cycles_prefill 200 torchrun --standalone --nproc-per-node "$NGPU" scripts/profile_fused.py --profile --tokens 8192 --configs 128:4 --iters 3 --warmup 1
    fi
    run bench_dsv3 300 python3 -m megamoe_cli bench --preset deepseek-v3 --tokens 1,128,8192 --backend fused,torch --iters 10 --out "$OUT/bench.csv"
    ;;
  power)  # SM clock and power per config on GPU 0 (nvidia-smi every 50 ms while POWER_ITERS calls run),
          # POWER_CONFIGS alternated twice at POWER_TOKENS (one GPU), then their cycle counters
    CONFIGS=${POWER_CONFIGS:-128:4 128:4:0:2}
    for r in 1 2; do
      for c in $CONFIGS; do
        tag=$(echo "$c" | tr ':' '_')
        nvidia-smi -i 0 --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.sw_power_cap \
          --format=csv,noheader,nounits -lms 50 > "$OUT/smi_${tag}_$r.csv" 2>&1 &
        SMI=$!
        run "power_${tag}_$r" 300 python3 scripts/profile_fused.py --preset deepseek-v3 --tokens ${POWER_TOKENS:-16384} \
          --configs "$c" --iters ${POWER_ITERS:-100} --warmup 3
        kill $SMI 2>/dev/null; wait $SMI 2>/dev/null
        python3 - "$OUT/smi_${tag}_$r.csv" <<'PY'
import sys
rows = []
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(",")]
    try:
        rows.append((float(f[1]), float(f[2]), f[3] == "Active"))
    except (IndexError, ValueError):
        pass
busy = [r for r in rows if r[1] > 300]
if busy:
    n = len(busy)
    print(f"{sys.argv[1]}: {n} busy samples (power > 300 W) of {len(rows)}: clock {sum(r[0] for r in busy) / n:.0f} MHz, "
          f"power {sum(r[1] for r in busy) / n:.0f} W, SW power cap active in {sum(r[2] for r in busy)}")
else:
    print(f"{sys.argv[1]}: no busy samples of {len(rows)}")
PY
      done
    done
    run cycles 300 python3 scripts/profile_fused.py --profile --tokens ${POWER_TOKENS:-16384} --configs "$(echo $CONFIGS | tr ' ' ',')" --iters 3 --warmup 1
    ;;
  oversub)  # more ranks than GPUs (OVERSUB_RANKS, default "4 8"): the fused tier at world size 4 and 8 on
            # the GPUs there are (rank r on GPU r % GPUs, gloo group, time-sliced contexts: correctness only)
    # (the full fused tier took ~2 minutes at world size 4 and at 8 on 2 H200s; OVERSUB_QUICK= runs it,
    # the default is the quick one; OVERSUB_K selects tests, e.g. "not deepseek and not seed")
    export MEGAMOE_GPU_QUICK=${OVERSUB_QUICK-1}
    for n in ${OVERSUB_RANKS:-4 8}; do
      run "gpu_ws${n}_on_${NGPU}" ${OVERSUB_TIMEOUT:-400} torchrun --standalone --nproc-per-node "$n" -m pytest \
        tests/gpu/test_fused.py -q -s -p no:cacheprovider -rfE ${OVERSUB_K:+-k "$OVERSUB_K"}
    done
    ;;
  tiers)
    run gpu_ws1 280 python3 -m pytest tests/gpu -q -p no:cacheprovider -m "not soak"
    if [ "$NGPU" -gt 1 ]; then
      run gpu_wsN 300 torchrun --standalone --nproc-per-node "$NGPU" -m pytest tests/gpu -q -p no:cacheprovider
    fi
    ;;
  final)
    run gpu_faults 120 python3 -m pytest tests/gpu/test_fused_faults.py -q -p no:cacheprovider
    export MEGAMOE_TUNED_CONFIG="$OUT/tuned.json"
    run tune 240 python3 -m megamoe_cli tune --preset deepseek-v3 --tokens 128 --block-m 64,128 --stages 3,4 \
      --cluster-m 1 --sms all,120 --json
    run bench_tuned 120 python3 -m megamoe_cli bench --preset deepseek-v3 --tokens 128 --backend fused,torch \
      --out "$OUT/bench_tuned.csv"
    unset MEGAMOE_TUNED_CONFIG
    run record 300 python3 -m megamoe_cli bench --sweep sweeps/record.yaml --out "$OUT/record.csv"
    python3 -m megamoe_cli report "$OUT/record.csv" --markdown --plot "$OUT/record.png" > "$OUT/record.md" 2>/dev/null
    ;;
  verify)
    export MEGAMOE_GPU_QUICK=1
    run gpu_ws1 200 python3 -m pytest tests/gpu/test_fused.py -q -p no:cacheprovider
    run gpu_wsN 240 torchrun --standalone --nproc-per-node "$NGPU" -m pytest tests/gpu/test_fused.py -q -p no:cacheprovider
    run bench_graph 200 python3 -m megamoe_cli bench --preset deepseek-v3 --tokens 1,128,1024 \
      --backend fused,fused-graph,torch --iters 20 --out "$OUT/bench_graph.csv"
    ;;
  publish)  # the quick GPU tier at world size 1 and at every GPU, then the published curve
    export MEGAMOE_GPU_QUICK=1
    run gpu_ws1 180 python3 -m pytest tests/gpu -q -p no:cacheprovider
    if [ "$NGPU" -gt 1 ]; then
      run gpu_wsN 220 torchrun --standalone --nproc-per-node "$NGPU" -m pytest tests/gpu -q -p no:cacheprovider
    fi
    unset MEGAMOE_GPU_QUICK
    [ -n "${PUBLISH_TIMING:-}" ] && run timing 60 python3 scripts/profile_fused.py --tokens 64,16384 --configs 64:4,128:4 --iters 10
    run record 180 python3 -m megamoe_cli bench --sweep sweeps/record.yaml --out "$OUT/record.csv"
    python3 -m megamoe_cli report "$OUT/record.csv" --markdown --plot "$OUT/record.png" > "$OUT/record.md" 2>/dev/null
    ;;
  record)
    run record 560 python3 -m megamoe_cli bench --sweep sweeps/record.yaml --out "$OUT/record.csv"
    python3 -m megamoe_cli report "$OUT/record.csv" --markdown --plot "$OUT/record.png" > "$OUT/record.md" 2>/dev/null
    ;;
  ncu)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    for cfg in "$@"; do
      run "ncu_${cfg//:/_}" 150 "$NCU" --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section LaunchStats -k megamoe_kernel --launch-skip 1 --launch-count 1 \
        python3 scripts/profile_fused.py --tokens 16384 --configs "$cfg" --iters 1 --warmup 0
    done
    ;;
  stalls)  # ncu warp-stall sampling per SASS instruction of the prefill variant (one GPU), as gzipped CSV
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    run ncu_stalls 300 "$NCU" --clock-control none --section WarpStateStats --section SourceCounters \
      -k megamoe_kernel --launch-skip 1 --launch-count 1 -o "$OUT/stalls" -f \
      python3 scripts/profile_fused.py --tokens 16384 --configs ${STALL_CONFIG:-128:4} --iters 1 --warmup 0
    "$NCU" --import "$OUT/stalls.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip > "$OUT/stalls_source.csv.gz"
    "$NCU" --import "$OUT/stalls.ncu-rep" --page details 2>&1 | tail -60 > "$OUT/stalls_details.txt"
    rm -f "$OUT/stalls.ncu-rep"
    ;;
  profile)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    run timing 300 python3 scripts/profile_fused.py --preset deepseek-v3 --tokens 64,16384 --configs 64:4,64:3,128:3,128:2
    for case in "prefill 16384 128:3" "decode 64 64:4"; do
      set -- $case
      run "ncu_$1" 240 "$NCU" --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis -k megamoe_kernel \
        --launch-skip 2 --launch-count 1 python3 scripts/profile_fused.py --tokens "$2" --configs "$3" --iters 1 --warmup 1
    done
    ;;
  pack)  # the last step of a chained call: everything under $OUT into one $OUT/out.tar.gz (a device call
          # returns at most 8 files), e.g. '... tiers; ... record; scripts/device_run.sh pack'
    ( cd "$OUT" && tar --exclude=./out.tar.gz -czf /tmp/megamoe-out.tar.gz . && find . -mindepth 1 -delete &&
      mv /tmp/megamoe-out.tar.gz out.tar.gz && ls -la out.tar.gz && tar -tzf out.tar.gz )
    ;;
  *)
    echo "unknown mode $MODE"; exit 2 ;;
esac
