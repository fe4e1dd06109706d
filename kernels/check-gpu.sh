#!/usr/bin/env bash
# check-gpu.sh: the CUDA backend's GPU check, in one command on a machine with a GPU.
#   1. configures and builds the CUDA targets (PD_WITH_CUDA=ON, the GPU's own architecture
#      unless PD_CUDA_ARCHITECTURES is set) into $BUILD_DIR (default build-gpu);
#   2. runs every GPU test with PD_REQUIRE_GPU=1, so a missing device FAILS instead of
#      skipping: the CUDA kernels (the sampler included) against their CPU twins, the CUDA
#      backend against the CPU backend, graphs, layer KV events, device sampling, the backend
#      factory;
#   3. runs cuda_bench, which prints one table (GEMM and memcpy ceilings, paged decode
#      attention bandwidth, decode tokens/s at batch 1/32/128, prefill tokens/s at 2,048,
#      device sampling us at 1/32/128 rows of a 128k vocabulary).
# Needs only the repo, scripts/setup's packages and the CUDA toolkit (nvcc, cuBLAS, NCCL).
# Sized to finish in well under 8 minutes on one H200 (16 cores): each phase has a timeout.
# Exit status: 0 all passed; 1 a build/test/bench failure; 2 no GPU or no toolchain.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build-gpu}
JOBS=${JOBS:-$(nproc)}
start=$(date +%s)
phase() { echo; echo "=== check-gpu: $* (t+$(( $(date +%s) - start ))s)"; }

phase "device"
if ! nvidia-smi -L; then
  echo "check-gpu: no GPU visible (nvidia-smi failed): nothing to check"; exit 2
fi
for tool in cmake ninja /usr/local/cuda/bin/nvcc; do
  command -v "$tool" >/dev/null 2>&1 || [ -x "$tool" ] || {
    echo "check-gpu: $tool is missing (run scripts/setup; the CUDA toolkit goes to /usr/local/cuda)"; exit 2; }
done
if [ -z "${PD_CUDA_ARCHITECTURES:-}" ]; then
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
  PD_CUDA_ARCHITECTURES=${cap:-90}
fi

phase "configure + build (sm_${PD_CUDA_ARCHITECTURES}, -j${JOBS})"
mkdir -p "$BUILD_DIR"
timeout 120 cmake -S . -B "$BUILD_DIR" -G Ninja -DPD_WITH_CUDA=ON \
  -DPD_CUDA_ARCHITECTURES="$PD_CUDA_ARCHITECTURES" -DCMAKE_BUILD_TYPE=Release >"$BUILD_DIR/configure.log" 2>&1 \
  || { cat "$BUILD_DIR/configure.log"; echo "check-gpu: configure failed"; exit 1; }
timeout 300 cmake --build "$BUILD_DIR" -j "$JOBS" --target \
  test_backend_factory test_cuda_kernels test_cuda_sampling test_cuda_backend cuda_bench test_kvt_gpu \
  || { echo "check-gpu: build failed"; exit 1; }

phase "GPU tests"
fail=0
(cd "$BUILD_DIR" && PD_REQUIRE_GPU=1 timeout 180 ctest -R "test_backend_factory|test_cuda_|test_kvt_gpu" \
  --output-on-failure --timeout 120) || fail=1

phase "benchmark"
timeout 180 "$BUILD_DIR/tests/kernels/cuda_bench" || fail=1

phase "done: $([ $fail = 0 ] && echo PASSED || echo FAILED)"
exit $fail
