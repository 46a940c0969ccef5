#!/usr/bin/env bash
# The MXFP4 expansion microbenchmark (csrc/microbench/fp4_expand.cu: the fused kernel's consumer K
# loop with MXFP4 weights on data resident in shared memory) built for sm_90a and run on one GPU;
# its own header lists the modes.  Every mode runs twice: with normal scales only, then with a
# subnormal one in every fourth row (the table path).
#
#   scripts/fp4_expand.sh [--kblocks N] [modes]        e.g. scripts/fp4_expand.sh kernel mma expand
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/_microbench.sh
. scripts/_microbench.sh
build_microbench fp4_expand
"$BIN" "$@" && "$BIN" --subnormal "$@"
