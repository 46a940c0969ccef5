#!/usr/bin/env bash
# SM clock and power of one GPU while a command runs: nvidia-smi samples them every 50 ms, and
# the mean over the busy samples (power above BUSY_W, default 300 W) is printed with how often the
# software power cap was active.  The samples stay in SAMPLES (default: a temporary file).
#
#   scripts/gpu_power.sh [-i GPU] -- COMMAND...
#   scripts/gpu_power.sh -- megamoe profile --tokens 16384 --configs 128:4 --iters 100
set -uo pipefail
GPU=0
if [ "${1:-}" = "-i" ]; then GPU=$2; shift 2; fi
[ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || { echo "usage: scripts/gpu_power.sh [-i GPU] -- COMMAND..." >&2; exit 2; }
SAMPLES=${SAMPLES:-$(mktemp "${TMPDIR:-/tmp}/megamoe-power.XXXXXX.csv")}
nvidia-smi -i "$GPU" --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.sw_power_cap \
  --format=csv,noheader,nounits -lms 50 > "$SAMPLES" 2>&1 &
SMI=$!
trap 'kill "$SMI" 2>/dev/null' EXIT
"$@"
rc=$?
kill "$SMI" 2>/dev/null
wait "$SMI" 2>/dev/null
python3 - "$SAMPLES" "${BUSY_W:-300}" <<'PY'
import sys

rows = []
for line in open(sys.argv[1]):
    fields = [x.strip() for x in line.split(",")]
    try:
        rows.append((float(fields[1]), float(fields[2]), fields[3] == "Active"))
    except (IndexError, ValueError):
        pass
busy = [r for r in rows if r[1] > float(sys.argv[2])]
if busy:
    n = len(busy)
    print(f"{sys.argv[1]}: {n} busy samples (power > {sys.argv[2]} W) of {len(rows)}: clock "
          f"{sum(r[0] for r in busy) / n:.0f} MHz, power {sum(r[1] for r in busy) / n:.0f} W, "
          f"software power cap active in {sum(r[2] for r in busy)}")
else:
    print(f"{sys.argv[1]}: no busy samples of {len(rows)}")
PY
exit "$rc"
