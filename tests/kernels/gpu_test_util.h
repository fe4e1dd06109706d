// Helpers for the CUDA tests: device detection with a skip message, device buffers that are
// poisoned (NaN-filled) before each run, bf16 rounding on the host, and the relative error
// the thresholds are stated in: max |got - want| / max |want|.
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "pd/kernels/cuda/dtype.h"
#include "pd/kernels/cuda/ops.h"
#include "tests/test_skip.h"

namespace pd::kernels::cuda::test {

// True when a CUDA device is usable. Otherwise the case is a ctest skip naming the reason, or
// a failure under PD_REQUIRE_GPU=1 (tests/test_skip.h): this never returns false.
inline bool haveGpu() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    pd::test::requireGpu("no CUDA device (cudaGetDeviceCount: " +
                         (e != cudaSuccess ? std::string(cudaGetErrorName(e)) : std::string("0 devices")) + ")");
  }
  return true;
}

#define PD_CUDA_CHECK(call) REQUIRE(std::string(cudaGetErrorName(call)) == "cudaSuccess")

// A device buffer of `bytes`, NaN-poisoned (all bits set is a NaN in f32, f16 and bf16).
class DevBuf {
 public:
  explicit DevBuf(size_t bytes) : bytes_(std::max<size_t>(bytes, 16)) {
    PD_CUDA_CHECK(cudaMalloc(&p_, bytes_));
    poison();
  }
  ~DevBuf() { cudaFree(p_); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  void poison() { PD_CUDA_CHECK(cudaMemset(p_, 0xff, bytes_)); }
  template <typename T = void>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_;
};

template <typename T>
inline std::unique_ptr<DevBuf> upload(const std::vector<T>& v) {
  auto b = std::make_unique<DevBuf>(v.size() * sizeof(T));
  PD_CUDA_CHECK(cudaMemcpy(b->as(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return b;
}

template <typename T>
inline std::vector<T> download(const void* d, size_t n) {
  std::vector<T> v(n);
  PD_CUDA_CHECK(cudaDeviceSynchronize());
  PD_CUDA_CHECK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

// Uploads f32 values as dtype (converted on the device, round to nearest even).
inline std::unique_ptr<DevBuf> uploadAs(const std::vector<float>& v, DType dt) {
  auto f = upload(v);
  auto b = std::make_unique<DevBuf>(v.size() * dtypeBytes(dt));
  PD_CUDA_CHECK(convertFromF32(f->as<float>(), b->as(), dt, v.size(), nullptr));
  PD_CUDA_CHECK(cudaDeviceSynchronize());
  return b;
}
// Downloads n values of dtype as f32.
inline std::vector<float> downloadAs(const void* d, DType dt, size_t n) {
  DevBuf f(n * 4);
  PD_CUDA_CHECK(convertToF32(d, dt, f.as<float>(), n, nullptr));
  return download<float>(f.as(), n);
}

// Host rounding of f32 to the value a 16-bit dtype stores (for CPU-side inputs).
inline float roundTo(float x, DType dt) {
  if (dt == DType::kF32) return x;
  if (dt == DType::kBF16) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even (finite inputs)
    u &= 0xffff0000u;
    std::memcpy(&x, &u, 4);
    return x;
  }
  // f16: 11 significant bits; inputs in tests are well inside the normal range.
  int e;
  const float m = std::frexp(x, &e);
  return std::ldexp(std::nearbyint(std::ldexp(m, 11)), e - 11);
}
inline std::vector<float> roundedTo(std::vector<float> v, DType dt) {
  for (float& x : v) x = roundTo(x, dt);
  return v;
}

inline std::vector<float> randomVec(size_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) {
    do x = d(rng);
    while (x == 0.0f);  // never zeros
  }
  return v;
}

// max |got - want| / max |want|; NaN anywhere in got gives +inf.
inline double relError(const std::vector<float>& got, const std::vector<float>& want) {
  REQUIRE(got.size() == want.size());
  double maxDiff = 0, maxRef = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    maxDiff = std::max(maxDiff, double(std::fabs(got[i] - want[i])));
    maxRef = std::max(maxRef, double(std::fabs(want[i])));
  }
  return maxRef > 0 ? maxDiff / maxRef : maxDiff;
}

inline double tolerance(DType dt) { return dt == DType::kF32 ? 1e-5 : 1e-2; }

}  // namespace pd::kernels::cuda::test
