// End to end (docs/reliability.md, "The fault suite"; docs/serving.md, "Processes and threads"):
// a cluster does not outlive its `pdserve up`. SIGKILL to pdserve up (as the OOM killer or a
// closed terminal's SIGKILL would send) ends its router and workers within seconds, and their
// ports are free again; and a start whose port a stale router still holds fails naming that
// router's pid and how to stop it, instead of the router's bind error.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include <catch2/catch.hpp>

#include "tests/e2e/e2e_util.h"
#include "tests/faults/fault_report.h"
#include "tools/port_holder.h"
#include "tools/process_group.h"

using namespace pd;
using namespace pd::tools;
using namespace std::chrono;
using namespace std::chrono_literals;
using pd::test::readFile;

namespace {

const std::string kWork = std::string(PD_BINARY_DIR) + "/test_e2e_up";

std::string writeConfig(const std::string& name) {
  std::filesystem::create_directories(kWork);
  const std::string path = kWork + "/" + name + ".yaml";
  std::ofstream(path) << "model: {path: " << pd::test::e2eModelDir() << ", name: small}\n"
                      << "pools: {prefill: {replicas: 1}, decode: {replicas: 1}}\n"
                      << "engine: {backend: cpu, threads: 1, kv_cache_bytes: 16777216, drain_timeout_ms: 5000}\n"
                      << "logging: {level: info}\n";
  return path;
}

// Live (not zombie) processes whose parent is `parent`.
std::set<pid_t> childrenOf(pid_t parent) {
  std::set<pid_t> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(e.path() / "stat");
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    char state = 0;
    int ppid = 0;
    if (std::sscanf(stat.c_str() + close + 1, " %c %d", &state, &ppid) == 2 && ppid == parent && state != 'Z')
      out.insert(pid_t(std::stoi(name)));
  }
  return out;
}

// Alive: exists and is no zombie (a reparented child may wait for its new parent to reap it).
bool alive(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] != 'Z';
}

}  // namespace

TEST_CASE("pdserve up killed with SIGKILL leaves no router or worker running") {
  const std::string config = writeConfig("kill");
  const std::string log = kWork + "/kill.log";
  ProcessGroup up;
  pid_t upPid = 0;
  const int port = pd::test::startPdserveUp(up, config, log, &upPid);
  const std::set<pid_t> cluster = childrenOf(upPid);
  // Whatever the outcome, nothing of this test outlives it.
  struct KillLeft {
    const std::set<pid_t>& pids;
    ~KillLeft() {
      for (pid_t p : pids)
        if (alive(p)) ::kill(p, SIGKILL);
    }
  } killLeft{cluster};
  INFO(readFile(log));
  REQUIRE(cluster.size() == 3);  // router, prefill-0, decode-0

  const auto killed = steady_clock::now();
  REQUIRE(up.signal("up", SIGKILL).isOk());
  auto exit = up.waitAny(10s);
  REQUIRE(exit.has_value());
  CHECK(exit->description == "killed by signal 9 (Killed)");
  // Each gets SIGTERM and drains (an idle cluster: at once); 30 s is for a loaded machine.
  const auto deadline = killed + 30s;
  while (steady_clock::now() < deadline &&
         std::any_of(cluster.begin(), cluster.end(), [](pid_t p) { return alive(p); })) {
    std::this_thread::sleep_for(100ms);
  }
  for (pid_t p : cluster) {
    INFO("pid " << p);
    CHECK(!alive(p));
  }
  const auto goneMs = duration_cast<milliseconds>(steady_clock::now() - killed).count();
  CHECK(checkPortFree(port, "router.http.port").isOk());
  pd::test::recordFault({"pdserve up killed (SIGKILL) with its cluster running",
                         "its router and both workers exit (no orphan) and the router's port is free again",
                         "the kernel's parent-death signal (PR_SET_PDEATHSIG): SIGTERM at once, then each drain",
                         "router and 2 workers gone " + std::to_string(goneMs) + " ms after the SIGKILL"});
}

TEST_CASE("pdserve up names the process that holds its port, and how to stop it") {
  const std::string config = writeConfig("held");
  const std::string portsFile = kWork + "/stale-router.ports";
  std::filesystem::remove(portsFile);
  // A router of no running pdserve up, as one whose pdserve up died before this fix would be.
  ProcessGroup stale;
  auto router = stale.spawn("stale-router", {std::string(PD_BINARY_DIR) + "/bin/pdserve-router", "--config", config,
                                             "--port", "0", "--control-port", "0", "--ports-file", portsFile});
  REQUIRE(router.ok());
  const int held = pd::test::waitForPort(portsFile, "http", 60s);
  REQUIRE(held > 0);

  const std::string log = kWork + "/held.log";
  ProcessGroup up;
  REQUIRE(up.spawn("up", {"/bin/sh", "-c",
                          "exec " + std::string(PD_BINARY_DIR) + "/bin/pdserve up --config " + config + " --port " +
                              std::to_string(held) + " --control-port 0 > " + log + " 2>&1"})
              .ok());
  auto exit = up.waitAny(60s);
  const std::string text = readFile(log);
  INFO(text);
  REQUIRE(exit.has_value());
  CHECK(exit->description == "exited with status 1");
  const std::string pid = std::to_string(router.value());
  CHECK(text.find("port " + std::to_string(held) + " (router.http.port) is held by pid " + pid +
                  " (pdserve-router, not under a running pdserve up): stop it with kill " + pid) != std::string::npos);
  // Nothing was started: the holder is untouched and still the only listener.
  CHECK(stale.running() == 1);
}
