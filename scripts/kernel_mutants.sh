#!/usr/bin/env bash
# Planted kernel bugs the GPU tier must catch.  Each tests/gpu/mutants/NAME.patch changes csrc/ in
# one place; its header says what it breaks and which GPU tests must fail:
#   # bug: what the patch breaks
#   # tests: arguments of scripts/gpu_tests.sh (mode, test files, -k ...)
#   # ranks: OVERSUB_RANKS for gpu_tests.sh (optional: ranks sharing the GPUs)
#   # build: arguments of `megamoe build` for the variants those tests launch (one line each)
# For each mutant the tree is copied to a scratch folder, the patch applied there, and the tests
# run from that copy (its kernels compile into MEGAMOE_CACHE_DIR under their own source hash).
# A mutant is killed when a test fails; one that passes, or a patch that does not apply, makes
# the exit status 1.  --build compiles the mutants' variants instead (no GPU needed), so a GPU
# machine sharing MEGAMOE_CACHE_DIR loads them instead of compiling.
#
#   scripts/kernel_mutants.sh [--build] [NAME...]      (default: every mutant)
#   scripts/kernel_mutants.sh rs_l1_column rs_scale_swap
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

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
status=0
for name in "${names[@]}"; do
  patch="$ROOT/tests/gpu/mutants/$name.patch"
  tree="$scratch/$name"
  mkdir -p "$tree"
  cp -r "$ROOT/csrc" "$ROOT/megamoe_cli" "$ROOT/tests" "$ROOT/scripts" "$tree/"
  echo "=== mutant $name: $(header bug "$patch")"
  if ! (cd "$tree" && git apply "$patch"); then
    echo "=== mutant $name: the patch does not apply to this tree"
    status=1
    continue
  fi
  if [ "$BUILD" -eq 1 ]; then
    while IFS= read -r args; do
      [ -n "$args" ] || continue
      # shellcheck disable=SC2086  # the header's words are the command's arguments
      (cd "$tree" && eval "PYTHONPATH=\"$tree\" python3 -m megamoe_cli build $args") || status=1
    done < <(header build "$patch")
    continue
  fi
  tests=$(header tests "$patch")
  ranks=$(header ranks "$patch")
  log="$scratch/$name.log"
  (cd "$tree" && eval "OVERSUB_RANKS=\"$ranks\" bash scripts/gpu_tests.sh $tests") > "$log" 2>&1
  rc=$?
  grep -E "^=== |passed|failed|^FAILED" "$log" | grep -v "^=== world size [0-9].*: exit" | cut -c1-200 | tail -12
  if [ "$rc" -ne 0 ] && grep -qE "[0-9]+ failed" "$log"; then
    echo "=== mutant $name: killed"
  elif [ "$rc" -ne 0 ]; then
    echo "=== mutant $name: the tests did not run to a failure (exit status $rc); log:"
    tail -20 "$log"
    status=1
  else
    echo "=== mutant $name: SURVIVED (the tests passed with the bug planted)"
    status=1
  fi
done
exit "$status"
