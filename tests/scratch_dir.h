// A per-process scratch directory for a test binary's files: $TMPDIR/pdserve-test-<pid>, made on
// first use and removed with everything in it when the process exits normally (ctest runs
// one case per process, so each case gets a fresh one and none is left behind).
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>

namespace pd::test {

inline const std::filesystem::path& scratchDir() {
  // A static object: its destructor runs at exit, after everything that used the path.
  struct Scratch {
    std::filesystem::path path =
        std::filesystem::temp_directory_path() / ("pdserve-test-" + std::to_string(::getpid()));
    Scratch() { std::filesystem::create_directories(path); }
    ~Scratch() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static const Scratch scratch;
  return scratch.path;
}

}  // namespace pd::test
