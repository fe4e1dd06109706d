// Shared by the libFuzzer targets (tests/fuzz/*_fuzz.cpp): the fixture paths and a check
// that turns a broken invariant into a crash libFuzzer records.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/tokenizer/tokenizer.h"

namespace pd::fuzz {

// A broken invariant is a finding: abort so libFuzzer saves the input.
#define PD_FUZZ_CHECK(cond, what)                                            \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::fprintf(stderr, "fuzz invariant failed: %s (%s)\n", what, #cond); \
      std::abort();                                                          \
    }                                                                        \
  } while (0)

// The source tree and tests/fuzz/data, compiled in.
inline std::string repoDir() { return PD_FUZZ_REPO_DIR; }
inline std::string dataDir() { return repoDir() + "/tests/fuzz/data"; }

// Where a target writes its seed inputs, made by the project's own encoders, when
// $PD_FUZZ_WRITE_SEEDS names a folder (how tests/fuzz/corpus/<target>/ was made); empty: no.
inline std::string seedDir() {
  const char* d = std::getenv("PD_FUZZ_WRITE_SEEDS");
  return d ? d : "";
}

// A tokenizer directory, or abort: a fuzzer with no fixture tests nothing.
inline std::shared_ptr<const tok::Tokenizer> loadTokenizerOrDie(const std::string& dir) {
  auto t = tok::Tokenizer::loadDir(dir);
  if (!t.ok()) {
    std::fprintf(stderr, "fuzz: cannot load the tokenizer in %s: %s\n", dir.c_str(), t.status().toString().c_str());
    std::abort();
  }
  return *t;
}

// The directories in $PD_FUZZ_TOKENIZERS (colon-separated; run.sh passes the npm reference
// tokenizers when tests/npm is installed), always with the committed tiny byte-level one.
inline std::vector<std::string> tokenizerDirs() {
  std::vector<std::string> dirs = {dataDir() + "/tiny_tokenizer"};
  if (const char* env = std::getenv("PD_FUZZ_TOKENIZERS")) {
    std::stringstream ss(env);
    std::string d;
    while (std::getline(ss, d, ':')) {
      if (!d.empty()) dirs.push_back(d);
    }
  }
  return dirs;
}

}  // namespace pd::fuzz
