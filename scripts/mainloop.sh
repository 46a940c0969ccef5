#!/usr/bin/env bash
# The main-loop microbenchmark (csrc/microbench/mainloop.cu: the fused kernel's FP8 K loop of one
# tile per CTA, alone) built for sm_90a and run on one GPU; its own header lists the modes and
# options.  --sweep runs the given modes under each operand source in turn, from one build.
#
#   scripts/mainloop.sh [options] [modes]             e.g. scripts/mainloop.sh --tma2d --random halves
#   scripts/mainloop.sh --sweep [modes]               default modes: halves nopromo128
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/_microbench.sh
. scripts/_microbench.sh
build_microbench mainloop
if [ "${1:-}" != "--sweep" ]; then
  exec "$BIN" "$@"
fi
shift
[ $# -eq 0 ] && set -- halves nopromo128
status=0
for source in "" "--random" "--tma2d" "--tma2d --random" "--tma2d --random --copy-mib 64" \
              "--tma2d --random --tile-kb 56 2000"; do
  echo "=== operands: ${source:-constant, 1-D copies}"
  # shellcheck disable=SC2086
  "$BIN" $source "$@" || status=1
done
exit "$status"
