#!/usr/bin/env bash
# check-gpu.sh: the whole device check, one prepared command for a machine with a GPU.
#   device     nvidia-smi, the GPU's compute capability (the build's architecture);
#   build      configures PD_WITH_CUDA=ON (Release) into $BUILD_DIR (default build-gpu) and
#              builds the GPU tests, cuda_bench, the e2e test and the cluster's binaries;
#   gpu-tests  every GPU test with PD_REQUIRE_GPU=1, so a missing device FAILS instead of
#              skipping: the CUDA kernels (the sampler, Qwen3's per-head q/k norm and the
#              mixture-of-experts gather/combine included) against their CPU twins, the CUDA
#              backend against the CPU backend (logits within bf16 tolerance on generated
#              models: Llama, Qwen2, Qwen3, and the mixture-of-experts Qwen3-MoE, Mixtral and
#              DeepSeek-V3 (sigmoid group routing, shared experts) with f32 greedy ids
#              identical and batched decode rows routed to different experts; an FP8 Mixtral
#              streamed), weights streamed from bf16 checkpoints against host-uploaded ones
#              (Qwen3's norms, MoE routers and experts included),
#              FP8 block-scaled checkpoints held as FP8 on the device (the W8A16 kernels
#              fp8Dequantize/fp8Gemv against their definition, the backend at TP 1 and 2
#              against the CPU backend, its device memory against bf16's),
#              DeepseekV3 multi-head latent attention (the MLA kernels against their host
#              definitions up to a 576-value latent; a dense made DeepSeek-V3 on the backend
#              against the CPU backend: logits, greedy ids, the latent KV region),
#              KV sized by gpu_memory_utilization, graphs, layer KV
#              events, device sampling,
#              the backend factory, the worker's cuda engine set-up, GPU-memory transfers,
#              the KV tiers on cuda (blocks demoted from and promoted into device regions
#              byte for byte at TP 1 and 2, a prompt served after eviction with the cold
#              run's greedy ids);
#   e2e-cuda   a cuda cluster end to end (tests/e2e/cluster_test.cpp "greedy ids are identical
#              with cuda workers"): colocated, and disaggregated over tcp-staged GPU memory,
#              greedy ids identical between the two cuda paths (and the CPU's);
#   bench      cuda_bench: GEMM against the cuBLAS peak and device copies measured in the same
#              run, paged decode attention, decode/prefill tokens/s of a 1B-shaped bf16 model,
#              the FP8-weight GEMV and dequantization against cuBLAS bf16 on one weight;
#   rdma       when ibv_devices lists a device: the verbs unit tests and the transport
#              conformance suite (which includes verbs once a device initialises).
# Results: every phase's log and a summary (results.txt: phase, PASS/FAIL/SKIP, seconds) under
# $OUT when set (the device tool's output folder), else $BUILD_DIR/check-gpu.
# Every phase has a timeout, and the phases share one deadline (CHECK_GPU_BUDGET_S, default
# 470 s) so the whole check ends within 8 minutes on a 16-core H200 machine.
# Exit status: 0 all passed; 1 a build/test/bench failure; 2 no GPU or no toolchain.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build-gpu}
JOBS=${JOBS:-$(nproc)}
RESULTS=${OUT:-$BUILD_DIR/check-gpu}
BUDGET=${CHECK_GPU_BUDGET_S:-470}
mkdir -p "$RESULTS"
: >"$RESULTS/results.txt"
start=$(date +%s)
fail=0

elapsed() { echo $(( $(date +%s) - start )); }
# Seconds a phase may take: its own limit, or what is left of the budget if less (>= 1).
limit() { local left=$(( BUDGET - $(elapsed) )); (( left < 1 )) && left=1; (( $1 < left )) && echo "$1" || echo "$left"; }
record() { printf '%-10s %-4s %4ss  %s\n' "$1" "$2" "$3" "${4:-}" | tee -a "$RESULTS/results.txt"; }
# run_phase NAME LIMIT_S CMD...: runs CMD under timeout, its output to the terminal and to
# $RESULTS/NAME.log; records PASS/FAIL (a timeout says so) and sets fail=1 on failure.
run_phase() {
  local name=$1 lim; lim=$(limit "$2"); shift 2
  echo; echo "=== check-gpu: $name (t+$(elapsed)s, limit ${lim}s)"
  local t0; t0=$(date +%s)
  # A shell function of this script runs in a child bash (timeout runs programs only).
  if declare -F "$1" >/dev/null; then set -- bash -c "$(declare -f "$1"); $*"; fi
  timeout --kill-after=10 "$lim" "$@" 2>&1 | tee "$RESULTS/$name.log"
  local rc=${PIPESTATUS[0]}
  local took=$(( $(date +%s) - t0 ))
  if [ "$rc" = 0 ]; then record "$name" PASS "$took"
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then record "$name" FAIL "$took" "timed out after ${lim}s"; fail=1
  else record "$name" FAIL "$took" "exit $rc"; fail=1
  fi
  return "$rc"
}
finish() {
  echo; echo "=== check-gpu: done in $(elapsed)s: $([ "$fail" = 0 ] && echo PASSED || echo FAILED)"
  echo "results in $RESULTS"
  record total "$([ "$fail" = 0 ] && echo PASS || echo FAIL)" "$(elapsed)"
  exit "$fail"
}

echo "=== check-gpu: device"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >"$RESULTS/device.log" 2>&1; then
  cat "$RESULTS/device.log" 2>/dev/null
  echo "check-gpu: no GPU visible (nvidia-smi failed): nothing to check"
  record device SKIP "$(elapsed)" "no GPU visible (nvidia-smi)"
  exit 2
fi
cat "$RESULTS/device.log"
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv >>"$RESULTS/device.log" 2>&1
for tool in cmake ninja /usr/local/cuda/bin/nvcc; do
  command -v "$tool" >/dev/null 2>&1 || [ -x "$tool" ] || {
    echo "check-gpu: $tool is missing (run scripts/setup; the CUDA toolkit goes to /usr/local/cuda)"
    record device SKIP "$(elapsed)" "$tool missing"
    exit 2; }
done
if [ -z "${PD_CUDA_ARCHITECTURES:-}" ]; then
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
  PD_CUDA_ARCHITECTURES=${cap:-90}
fi
export BUILD_DIR JOBS PD_CUDA_ARCHITECTURES  # the phases' functions run in child shells
record device PASS "$(elapsed)" "$(head -1 "$RESULTS/device.log"), sm_${PD_CUDA_ARCHITECTURES}"

build() {
  mkdir -p "$BUILD_DIR"
  cmake -S . -B "$BUILD_DIR" -G Ninja -DPD_WITH_CUDA=ON -DPD_CUDA_ARCHITECTURES="$PD_CUDA_ARCHITECTURES" \
    -DCMAKE_BUILD_TYPE=Release || return 1
  cmake --build "$BUILD_DIR" -j "$JOBS" --target \
    test_backend_factory test_cuda_kernels test_cuda_sampling test_cuda_backend test_cuda_kv_tiers test_kvt_gpu \
    test_worker_engine_setup cuda_bench test_e2e test_kvt_verbs test_kvt_conformance
}
run_phase build 300 build || finish

# The GPU tests through ctest (each case its own process, skips turned into failures).
run_phase gpu-tests 150 env PD_REQUIRE_GPU=1 ctest --test-dir "$BUILD_DIR" \
  -R "test_backend_factory|test_cuda_|test_kvt_gpu|test_worker_engine_setup|gpu_skip_semantics" \
  --output-on-failure --timeout 120 -j 4

run_phase e2e-cuda 150 env PD_REQUIRE_GPU=1 "$BUILD_DIR/tests/e2e/test_e2e" \
  "greedy ids are identical with cuda workers*" --durations yes

run_phase bench 120 "$BUILD_DIR/tests/kernels/cuda_bench"

if command -v ibv_devices >/dev/null 2>&1 && [ "$(ibv_devices 2>/dev/null | tail -n +3 | grep -c .)" -gt 0 ]; then
  rdma() {
    ibv_devices || return 1
    ctest --test-dir "$BUILD_DIR" -R "test_kvt_verbs|test_kvt_conformance" --output-on-failure --timeout 90
  }
  run_phase rdma 90 rdma
else
  echo; echo "=== check-gpu: rdma: no RDMA device (ibv_devices lists none or is missing): skipped"
  record rdma SKIP 0 "no RDMA device"
fi
finish
