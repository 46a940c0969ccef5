#!/usr/bin/env bash
# The GPU test tier on this machine: at world size 1, then under torchrun with one rank per GPU
# when there are several, then with more ranks than GPUs (rank r on GPU r % GPUs, correctness
# only) for each count in OVERSUB_RANKS.  Exits non-zero when any of them fails.
#
#   scripts/gpu_tests.sh [quick|full] [pytest arguments]      (default: quick tests/gpu)
#   scripts/gpu_tests.sh quick tests/gpu -m "not soak"
#   OVERSUB_RANKS="4 8" scripts/gpu_tests.sh quick tests/gpu/test_fused.py
#
# quick sets MEGAMOE_GPU_QUICK=1 (fewer shapes and calls per case); full runs every case.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-quick}
shift || true
case "$MODE" in
  quick) export MEGAMOE_GPU_QUICK=1 ;;
  full) unset MEGAMOE_GPU_QUICK ;;
  *) echo "usage: scripts/gpu_tests.sh [quick|full] [pytest arguments]" >&2; exit 2 ;;
esac
[ $# -eq 0 ] && set -- tests/gpu
# NVLink multicast stays off, as megamoe's launcher sets it for every rank.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())") || exit 2
if [ "$NGPU" -lt 1 ]; then
  echo "scripts/gpu_tests.sh: torch sees no CUDA device; the CPU tests run with python3 -m pytest" >&2
  exit 2
fi
status=0
step() {  # name, command...
  local name=$1; shift
  echo "=== $name"
  "$@"
  local rc=$?
  echo "=== $name: exit status $rc"
  [ "$rc" -eq 0 ] || status=1
}
step "world size 1" python3 -m pytest -q -p no:cacheprovider "$@"
if [ "$NGPU" -gt 1 ]; then
  step "world size $NGPU" torchrun --standalone --nproc-per-node "$NGPU" -m pytest -q -p no:cacheprovider "$@"
fi
for n in ${OVERSUB_RANKS:-}; do
  step "world size $n on $NGPU GPU(s)" torchrun --standalone --nproc-per-node "$n" -m pytest -q -p no:cacheprovider "$@"
done
exit "$status"
