#!/usr/bin/env bash
# The FP8 baseline (torch, torch-graph) on a GPU machine: its GPU tests on one GPU, then
# DeepSeek-V3 (hidden 7168, intermediate 2048, 256 experts, top-8) on one GPU at 1, 128, 1024 and
# 8192 tokens through `megamoe bench`: torch with each GEMM candidate
# (MEGAMOE_TORCH_GEMM=triton | scaled_grouped_mm | scaled_mm), torch-graph (triton and
# scaled_grouped_mm, the capturable ones), and torch-bf16w and fused-graph beside them; then a
# short table.  Each step's log, env.txt and baseline.csv go to OUTDIR.
#   scripts/baseline_gpu.sh [all|tests|bench] [OUTDIR]        (OUTDIR default: $TMPDIR/megamoe-baseline)
# all (default) runs the quick test tier (MEGAMOE_GPU_QUICK=1) and the timings; `tests` runs the
# full test file, `bench` only the timings.  A tree without git history names its commit for the
# rows with MEGAMOE_GIT_COMMIT=<sha>.
set -uo pipefail
MODE=${1:-all}
case "$MODE" in
  all) QUICK=1; TESTS=1; BENCH=1 ;;
  tests) QUICK=0; TESTS=1; BENCH=0 ;;
  bench) QUICK=0; TESTS=0; BENCH=1 ;;
  *) echo "usage: scripts/baseline_gpu.sh [all|tests|bench] [OUTDIR]" >&2; exit 2 ;;
esac

OUT=${2:-${TMPDIR:-/tmp}/megamoe-baseline}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
CSV="$OUT/baseline.csv"
{
  date -u +%FT%TZ; echo "commit ${MEGAMOE_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"

run() {  # name, command...: the output into OUTDIR/<name>.log, its tail here
  local name=$1; shift
  echo "=== $name"
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 12 "$OUT/$name.log"
  echo "=== $name rc=$rc"
}

if [ "$TESTS" = 1 ]; then
  run gpu_baseline env MEGAMOE_GPU_QUICK=$QUICK python3 -m pytest tests/gpu/test_baseline_gpu.py -q -s -rfE -p no:cacheprovider
fi

if [ "$BENCH" = 1 ]; then
  POINTS=(python3 -m megamoe_cli bench --ranks 1 --preset deepseek-v3 --tokens 1,128,1024,8192 --warmup 3 --iters 10
          --point-timeout 150 --out "$CSV")
  run bench_triton env MEGAMOE_TORCH_GEMM=triton "${POINTS[@]}" --backend torch,torch-graph,torch-bf16w,fused-graph
  run bench_scaled_grouped_mm env MEGAMOE_TORCH_GEMM=scaled_grouped_mm "${POINTS[@]}" --backend torch,torch-graph
  run bench_scaled_mm env MEGAMOE_TORCH_GEMM=scaled_mm "${POINTS[@]}" --backend torch
  echo "=== table ($CSV)"
  python3 - "$CSV" <<'PY'
import json, sys
from megamoe_cli.bench.compare import with_speedup
from megamoe_cli.bench.results import read_results

frame = with_speedup(read_results(sys.argv[1]))
frame["gemm"] = [json.loads(c or "{}").get("gemm", "") for c in frame["config"]]
frame = frame.sort_values(["num_tokens", "time_us_median"], kind="stable")
print(f"{'tokens':>6} {'backend':<12} {'gemm':<18} {'time us':>10} {'TFLOPS':>7} {'rel err':>9} "
      f"{'speed-up vs fastest baseline of its run':>40}  status")
for _, r in frame.iterrows():
    ok = r["status"] == "ok"
    t = f"{r['time_us_median']:,.1f}" if ok else "-"
    tf = f"{r['tflops']:.0f}" if ok and r["tflops"] == r["tflops"] else "-"
    err = f"{r['rel_err_layer']:.2e}" if r["rel_err_layer"] == r["rel_err_layer"] else "-"
    vs = f"{r['speedup_vs_baseline']:.2f}x {r['baseline']}" if r["speedup_vs_baseline"] == r["speedup_vs_baseline"] else "-"
    print(f"{int(r['num_tokens']):>6} {r['backend']:<12} {r['gemm']:<18} {t:>10} {tf:>7} {err:>9} {vs:>40}  "
          f"{r['status']} {'' if ok else str(r['error'])[:160]}")
PY
fi
