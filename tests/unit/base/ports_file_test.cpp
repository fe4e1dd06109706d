#include "common/base/ports_file.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <catch2/catch.hpp>

#include "tests/scratch_dir.h"

using namespace pd;

namespace {
std::string scratch(const std::string& name) { return (pd::test::scratchDir() / name).string(); }
}  // namespace

TEST_CASE("a ports file reads back what was written, and is whole or absent") {
  const std::string path = scratch("router.ports");
  std::filesystem::remove(path);
  CHECK(readPortsFile(path).status().code() == StatusCode::kNotFound);
  REQUIRE(writePortsFile(path, {{"http", 40123}, {"control", 40125}}).isOk());
  CHECK_FALSE(std::filesystem::exists(path + ".tmp"));
  auto ports = readPortsFile(path);
  REQUIRE(ports.ok());
  CHECK(*ports == PortMap{{"control", 40125}, {"http", 40123}});
  // A rewrite (a role switch's new port) replaces the whole file.
  REQUIRE(writePortsFile(path, {{"metrics", 40200}}).isOk());
  CHECK(readPortsFile(path).value() == PortMap{{"metrics", 40200}});
}

TEST_CASE("a ports file with a bad line names the file and the line") {
  const std::string path = scratch("bad.ports");
  for (const char* text : {"metrics\n", "metrics 0\n", "metrics 70000\n", "metrics 12 13\n", "metrics x\n"}) {
    std::ofstream(path, std::ios::trunc) << "http 1\n" << text;
    auto ports = readPortsFile(path);
    INFO(text);
    REQUIRE_FALSE(ports.ok());
    CHECK(ports.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(ports.status().message(), Catch::Contains(path + ":2"));
  }
  CHECK(writePortsFile(scratch("no/such/dir/x.ports"), {{"http", 1}}).code() == StatusCode::kUnavailable);
}
