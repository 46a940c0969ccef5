#!/usr/bin/env bash
# Planted kernel bugs the GPU tier must catch.  Each tests/gpu/mutants/NAME.patch changes csrc/ in
# one place; its header says what it breaks and which GPU tests must fail:
#   # bug: what the patch breaks
#   # tests: arguments of scripts/gpu_tests.sh (mode, test files, -k ...)
#   # ranks: OVERSUB_RANKS for gpu_tests.sh (optional: ranks sharing the GPUs)
#   # build: arguments of `megamoe build` for the variants those tests launch (one line each)
# tests/gpu/mutants/README.md lists the mutants by the part of the kernel they break.
# For each mutant the tree is copied to a scratch folder, the patch applied there, and the tests
# run from that copy (its kernels compile into MEGAMOE_CACHE_DIR under their own source hash).
# A mutant is killed when a test fails; one that passes, or a patch that does not apply, makes
# the exit status 1.  The kernel's deadlines run at MEGAMOE_TIMEOUT_S (default here 20 s, not
# the library's 30 s), since several mutants are caught by a wait that times out; one mutant's
# tests get MUTANT_TIMEOUT_S (default 480 s) before they are stopped (NO RESULT).  The run ends
# with a table: each mutant and the tests that failed with it (by world size), or SURVIVED.
# --build compiles the mutants' variants instead (no GPU needed), so a GPU machine sharing
# MEGAMOE_CACHE_DIR loads them instead of compiling.
#
#   scripts/kernel_mutants.sh [--build] [NAME...]      (default: every mutant)
#   scripts/kernel_mutants.sh rs_l1_column rs_scale_swap
#   MEGAMOE_CACHE_DIR=$PWD/jit-mutants scripts/kernel_mutants.sh --build
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=0
if [ "${1:-}" = "--build" ]; then BUILD=1; shift; fi
case "${1:-}" in
  -*) echo "usage: scripts/kernel_mutants.sh [--build] [NAME...]" >&2; exit 2 ;;
esac
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for f in tests/gpu/mutants/*.patch; do names+=("$(basename "$f" .patch)"); done
fi
for name in "${names[@]}"; do
  if [ ! -f "tests/gpu/mutants/$name.patch" ]; then
    echo "scripts/kernel_mutants.sh: no mutant $name (expected tests/gpu/mutants/$name.patch)" >&2
    exit 2
  fi
done

header() {  # field, patch: the field's lines, without "# field: "
  sed -n "s/^# $1: //p" "$2"
}

export MEGAMOE_TIMEOUT_S=${MEGAMOE_TIMEOUT_S:-20}
MUTANT_TIMEOUT_S=${MUTANT_TIMEOUT_S:-480}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
status=0
table=()
for name in "${names[@]}"; do
  patch="$ROOT/tests/gpu/mutants/$name.patch"
  tree="$scratch/$name"
  mkdir -p "$tree"
  cp -r "$ROOT/csrc" "$ROOT/megamoe_cli" "$ROOT/tests" "$ROOT/scripts" "$tree/"
  echo "=== mutant $name: $(header bug "$patch")"
  if ! (cd "$tree" && git apply "$patch"); then
    echo "=== mutant $name: the patch does not apply to this tree"
    table+=("$name|DOES NOT APPLY")
    status=1
    continue
  fi
  if [ "$BUILD" -eq 1 ]; then
    built="built"
    while IFS= read -r args; do
      [ -n "$args" ] || continue
      # shellcheck disable=SC2086  # the header's words are the command's arguments
      if ! (cd "$tree" && eval "PYTHONPATH=\"$tree\" python3 -m megamoe_cli build $args"); then
        built="BUILD FAILED: $args"
        status=1
      fi
    done < <(header build "$patch")
    table+=("$name|$built")
    continue
  fi
  tests=$(header tests "$patch")
  ranks=$(header ranks "$patch")
  log="$scratch/$name.log"
  # (a whole process group: a kernel that hangs past its deadlines cannot hold the run)
  (cd "$tree" && eval "OVERSUB_RANKS=\"$ranks\" timeout -k 30 \"$MUTANT_TIMEOUT_S\" bash scripts/gpu_tests.sh $tests") \
    > "$log" 2>&1
  rc=$?
  grep -E "^=== |passed|failed|^FAILED" "$log" | grep -v "^=== world size [0-9].*: exit" | cut -c1-200 | tail -12
  # The failed tests, each with the world size of the step it failed in (gpu_tests.sh's "=== world
  # size N" lines; pytest's summary lines "FAILED path::test[id] - message")
  failed=$(awk '/^=== world size [0-9]+/ && !/: exit status/ { ws = "ws" $4 }
                /^(FAILED|ERROR) / { sub(/ - .*/, "", $2); n = split($2, part, "::"); print ws ":" part[n] }' "$log" |
           sort -u | paste -sd' ' -)
  if [ "$rc" -ne 0 ] && grep -qE "[0-9]+ (failed|error)" "$log"; then
    echo "=== mutant $name: killed"
    table+=("$name|${failed:-(failed; no test named)}")
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "=== mutant $name: the tests ran past $MUTANT_TIMEOUT_S s and were stopped; log:"
    tail -20 "$log"
    table+=("$name|NO RESULT (stopped after $MUTANT_TIMEOUT_S s)")
    status=1
  elif [ "$rc" -ne 0 ]; then
    echo "=== mutant $name: the tests did not run to a failure (exit status $rc); log:"
    tail -20 "$log"
    table+=("$name|NO RESULT (exit status $rc)")
    status=1
  else
    echo "=== mutant $name: SURVIVED (the tests passed with the bug planted)"
    table+=("$name|SURVIVED")
    status=1
  fi
done
echo
if [ "$BUILD" -eq 1 ]; then echo "=== mutant -> build"; else echo "=== mutant -> tests that failed"; fi
for row in "${table[@]}"; do
  printf '%-32s %s\n' "${row%%|*}" "${row#*|}"
done
exit "$status"
