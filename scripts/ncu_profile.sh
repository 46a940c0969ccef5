#!/usr/bin/env bash
# Nsight Compute on one fused kernel call, as `megamoe profile` launches it (one GPU, the inputs
# already in the buffer; the first launch fills it and is skipped): the speed-of-light, memory,
# warp-state, scheduler and compute sections, or with --stalls the warp stalls per SASS
# instruction, exported as gzipped CSV beside the report's details.
#
#   scripts/ncu_profile.sh TOKENS CONFIG [megamoe profile flags]       e.g. 16384 128:4 --preset seed-default
#   scripts/ncu_profile.sh --stalls OUTDIR TOKENS CONFIG [flags]        OUTDIR/stalls_source.csv.gz, stalls_details.txt
set -uo pipefail
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "scripts/ncu_profile.sh: ncu not found (install Nsight Compute or set PATH)" >&2; exit 2; }
STALLS=""
if [ "${1:-}" = "--stalls" ]; then STALLS=$2; shift 2; fi
[ $# -ge 2 ] || { echo "usage: scripts/ncu_profile.sh [--stalls OUTDIR] TOKENS CONFIG [megamoe profile flags]" >&2; exit 2; }
TOKENS=$1 CONFIG=$2
shift 2
PROFILE=(python3 -m megamoe_cli profile --tokens "$TOKENS" --configs "$CONFIG" --iters 1 --warmup 0 "$@")
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "$STALLS" ]; then
  exec "$NCU" --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section SchedulerStats --section ComputeWorkloadAnalysis -k megamoe_kernel --launch-skip 1 --launch-count 1 \
    "${PROFILE[@]}"
fi
mkdir -p "$STALLS"
"$NCU" --clock-control none --section WarpStateStats --section SourceCounters -k megamoe_kernel --launch-skip 1 \
  --launch-count 1 -o "$STALLS/stalls" -f "${PROFILE[@]}" || exit 1
"$NCU" --import "$STALLS/stalls.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip > "$STALLS/stalls_source.csv.gz"
"$NCU" --import "$STALLS/stalls.ncu-rep" --page details > "$STALLS/stalls_details.txt" 2>&1
echo "$STALLS/stalls_source.csv.gz, $STALLS/stalls_details.txt, $STALLS/stalls.ncu-rep"
