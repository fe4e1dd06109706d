#include "tools/process_group.h"

#include <catch2/catch.hpp>

using namespace pd::tools;
using namespace std::chrono_literals;

TEST_CASE("children are reaped with their exit status") {
  ProcessGroup group;
  REQUIRE(group.spawn("ok", {"/bin/sh", "-c", "echo hello; exit 0"}).ok());
  REQUIRE(group.spawn("bad", {"/bin/sh", "-c", "sleep 0.2; exit 3"}).ok());
  auto first = group.waitAny(5s);
  REQUIRE(first);
  CHECK(first->name == "ok");
  CHECK(first->description == "exited with status 0");
  auto second = group.waitAny(5s);
  REQUIRE(second);
  CHECK(second->name == "bad");
  CHECK(second->description == "exited with status 3");
  CHECK(group.running() == 0);
}

TEST_CASE("stopAll terminates, then kills what ignores SIGTERM") {
  ProcessGroup group;
  REQUIRE(group.spawn("polite", {"/bin/sleep", "30"}).ok());
  REQUIRE(group.spawn("stubborn", {"/bin/sh", "-c", "trap '' TERM; sleep 30"}).ok());
  CHECK_FALSE(group.waitAny(100ms).has_value());
  auto start = std::chrono::steady_clock::now();
  group.stopAll(300ms);
  CHECK(group.running() == 0);
  CHECK(std::chrono::steady_clock::now() - start < 5s);
}

TEST_CASE("a missing program is a clear error") {
  ProcessGroup group;
  auto r = group.spawn("ghost", {"/nonexistent/pdserve-ghost"});
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message() == "spawn ghost: /nonexistent/pdserve-ghost: No such file or directory");
}
