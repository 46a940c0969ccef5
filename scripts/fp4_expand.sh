#!/usr/bin/env bash
# The MXFP4 expansion microbenchmark (csrc/microbench/fp4_expand.cu: the fused kernel's consumer K
# loop with MXFP4 weights on data resident in shared memory) built for sm_90a and run on one GPU;
# its own header lists the modes.  Every mode runs twice: with normal scales only, then with a
# subnormal one in every fourth row (the table path).
#
#   scripts/fp4_expand.sh [--kblocks N] [modes]        e.g. scripts/fp4_expand.sh kernel mma expand
set -uo pipefail
cd "$(dirname "$0")/.."
NVCC=$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | head -1)
[ -n "$NVCC" ] || { echo "scripts/fp4_expand.sh: nvcc not found (set PATH or install the CUDA toolkit)" >&2; exit 2; }
BIN="${TMPDIR:-/tmp}/megamoe-fp4-expand"
"$NVCC" -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -o "$BIN" csrc/microbench/fp4_expand.cu \
  || exit 2
"$BIN" "$@" && "$BIN" --subnormal "$@"
