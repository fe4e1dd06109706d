// A ctest SKIP for tests that cannot run on this machine (no GPU, no second GPU): never a
// silent pass. Every test registered by pd_add_test treats exit code kSkipExitCode as
// "skipped" (SKIP_RETURN_CODE), and ctest runs one Catch case per process, so skipTest()
// prints the reason and ends the process with that code. (Run by hand, a binary stops at the
// first skipping case; pass a case name to run one.)
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#include <catch2/catch.hpp>

namespace pd::test {

constexpr int kSkipExitCode = 77;  // automake's convention; tests/CMakeLists.txt agrees

[[noreturn]] inline void skipTest(const std::string& reason) {
  std::printf("SKIPPED: %s\n", reason.c_str());
  std::fflush(stdout);
  std::_Exit(kSkipExitCode);
}

// For tests that need a CUDA device: `missing` is empty when one is usable, else why not.
// Without a device the case skips; with PD_REQUIRE_GPU=1 (kernels/check-gpu.sh on the device
// machine) it fails instead, so a device run cannot pass by skipping.
inline void requireGpu(const std::string& missing) {
  if (missing.empty()) return;
  const char* require = std::getenv("PD_REQUIRE_GPU");
  if (require && std::string(require) == "1") FAIL("PD_REQUIRE_GPU=1 but " << missing);
  skipTest(missing);
}

}  // namespace pd::test
