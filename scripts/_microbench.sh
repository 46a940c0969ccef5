# Sourced by the microbenchmark scripts: build_microbench NAME builds csrc/microbench/NAME.cu for
# sm_90a (ptxas -v to stderr) and sets BIN to the binary; exits 2 without nvcc or on a failed build.
build_microbench() {
  local nvcc
  nvcc=$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | head -1)
  [ -n "$nvcc" ] || { echo "scripts/$1.sh: nvcc not found (set PATH or install the CUDA toolkit)" >&2; exit 2; }
  BIN="${TMPDIR:-/tmp}/megamoe-$1"
  "$nvcc" -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -o "$BIN" "csrc/microbench/$1.cu" || exit 2
}
