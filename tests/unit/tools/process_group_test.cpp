#include "tools/process_group.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <string>
#include <thread>

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

TEST_CASE("a program that cannot be started is an error naming it and why") {
  ProcessGroup group;
  auto r = group.spawn("ghost", {"/nonexistent/pdserve-ghost"});
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message() == "spawn ghost: /nonexistent/pdserve-ghost: No such file or directory");
  CHECK(group.running() == 0);
}

// The supervisor is a forked copy of this test (one thread: the one that spawns), SIGKILLed
// as the OOM killer would; its child must not outlive it.
TEST_CASE("children die with their supervisor, even a SIGKILLed one") {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  const pid_t supervisor = ::fork();
  REQUIRE(supervisor >= 0);
  if (supervisor == 0) {
    ProcessGroup group;
    auto child = group.spawn("sleeper", {"/bin/sleep", "60"});
    const pid_t pid = child.ok() ? child.value() : 0;
    (void)!::write(fds[1], &pid, sizeof pid);
    ::pause();
    ::_exit(0);
  }
  ::close(fds[1]);
  pid_t child = 0;
  REQUIRE(::read(fds[0], &child, sizeof child) == ssize_t(sizeof child));
  ::close(fds[0]);
  REQUIRE(child > 0);
  ::kill(supervisor, SIGKILL);
  REQUIRE(::waitpid(supervisor, nullptr, 0) == supervisor);
  // Reparented to init (or a subreaper), which reaps it: gone, or a zombie at most.
  const auto gone = [child] {
    std::ifstream in("/proc/" + std::to_string(child) + "/stat");
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto close = stat.rfind(')');
    return close == std::string::npos || stat.compare(close + 1, 2, " Z") == 0;
  };
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!gone() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(20ms);
  const bool died = gone();
  if (!died) ::kill(child, SIGKILL);  // no orphan of this test either way
  CHECK(died);
}
