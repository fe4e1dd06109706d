// Helpers shared by the end-to-end tests (tests/e2e): the served model and reading /metrics.
// Test code only: failures are Catch2 REQUIREs; no state but the model made once per build tree.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "common/base/ports_file.h"
#include "engine/model_maker.h"
#include "tools/local_cluster.h"

namespace pd::test {

// The default served model (preset small), made once per build tree and shared by the tests.
inline std::string e2eModelDir() {
  static std::string dir = [] {
    std::string d = std::string(PD_BINARY_DIR) + "/test_models/e2e_small";
    if (!std::filesystem::exists(d + "/config.json")) {
      engine::MakeModelOptions o;
      o.preset = "small";
      std::string tmp = d + ".tmp." + std::to_string(::getpid());
      REQUIRE(engine::makeModel(o, tmp).isOk());
      std::filesystem::rename(tmp, d);
    }
    return d;
  }();
  return dir;
}

// A prompt of `n` ids: BOS, then bytes drawn from `seed` (the same ids for the same seed).
inline std::vector<int32_t> randomPrompt(int n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> p{engine::kMadeBosId};
  while (int(p.size()) < n) p.push_back(int32_t(rng() % 256));
  return p;
}

// A whole file's text ("" when it cannot be read): a process's log for a failure message.
inline std::string readFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Starts `pdserve up --config config --port 0 --control-port 0` in `up` under the name "up", its
// output into `log`; the router's port once the cluster is healthy (the test fails if pdserve
// up exits first). `pid`, when given, receives pdserve up's.
inline int startPdserveUp(tools::ProcessGroup& up, const std::string& config, const std::string& log,
                          pid_t* pid = nullptr) {
  using namespace std::chrono;
  // Through a shell only to send its output to a file the test reads afterwards; exec keeps
  // its pid, so signals reach pdserve up itself.
  auto spawned = up.spawn("up", {"/bin/sh", "-c",
                                 "exec " + std::string(PD_BINARY_DIR) + "/bin/pdserve up --config " + config +
                                     " --port 0 --control-port 0 > " + log + " 2>&1"});
  REQUIRE(spawned.ok());
  if (pid) *pid = spawned.value();
  // The router's port, from the line pdserve up prints once the cluster is healthy.
  int port = 0;
  for (const auto until = steady_clock::now() + seconds(120); port == 0 && steady_clock::now() < until;) {
    if (auto dead = up.waitAny(milliseconds(100))) FAIL("pdserve up " << dead->description << ":\n" << readFile(log));
    const std::string text = readFile(log);
    const std::string upLine = "pdserve is up: http://127.0.0.1:";
    if (const size_t at = text.find(upLine); at != std::string::npos)
      port = std::atoi(text.c_str() + at + upLine.size());
  }
  REQUIRE(port != 0);
  return port;
}

// The port a process started with --ports-file says it bound as `name` (ports_file.h), once it
// wrote the file; 0 when it did not within `timeout`.
inline int waitForPort(const std::string& portsFile, const std::string& name, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    auto ports = readPortsFile(portsFile);
    if (ports.ok()) return ports->count(name) ? ports->at(name) : 0;
    if (std::chrono::steady_clock::now() >= deadline) return 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// What `pdserve generate` (one process, no cluster) produces for `prompt`: the reference a
// served request's token ids must equal. `flags` are more generate flags (sampling, seed).
// generateCliOn: the same on another model directory.
inline std::vector<int32_t> generateCliOn(const std::string& model, const std::vector<int32_t>& prompt, int maxTokens,
                                          int threads, const std::string& flags = "") {
  std::string ids;
  for (size_t i = 0; i < prompt.size(); ++i) ids += (i ? "," : "") + std::to_string(prompt[i]);
  const std::string cmd = std::string(PD_BINARY_DIR) + "/bin/pdserve generate --model " + model + " --prompt-ids " +
                          ids + " --max-tokens " + std::to_string(maxTokens) + " --ignore-eos --threads " +
                          std::to_string(threads) + " " + flags + " 2>/dev/null";
  FILE* f = ::popen(cmd.c_str(), "r");
  REQUIRE(f);
  std::string out;
  char buf[256];
  while (size_t n = std::fread(buf, 1, sizeof buf, f)) out.append(buf, n);
  REQUIRE(::pclose(f) == 0);
  std::vector<int32_t> result;
  for (size_t at = 0; at < out.size();) {
    result.push_back(std::atoi(out.c_str() + at));
    at = out.find(',', at);
    if (at == std::string::npos) break;
    ++at;
  }
  return result;
}
inline std::vector<int32_t> generateCli(const std::vector<int32_t>& prompt, int maxTokens, int threads,
                                        const std::string& flags = "") {
  return generateCliOn(e2eModelDir(), prompt, maxTokens, threads, flags);
}

// The value of the first series in a /metrics body named `name{...}` or `name`, whose labels
// contain each of `labels` ("" for any), or -1. `series` is `name` or `name{a="x",b="y"}`:
// the labels given must appear in that order, as Prometheus writes them after any constant
// labels (a worker's role and worker).
inline double metricValue(const std::string& body, const std::string& series) {
  const auto brace = series.find('{');
  const std::string name = series.substr(0, brace);
  const std::string labels = brace == std::string::npos ? "" : series.substr(brace + 1, series.size() - brace - 2);
  std::istringstream in(body);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(name, 0) != 0 || (line[name.size()] != ' ' && line[name.size()] != '{')) continue;
    if (!labels.empty() && line.find(labels) == std::string::npos) continue;
    return std::atof(line.c_str() + line.rfind(' ') + 1);
  }
  return -1;
}

// A TCP socket connected to 127.0.0.1:port whose reads give up after timeoutS seconds.
inline int connectLoopback(int port, int timeoutS) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  timeval tv{timeoutS, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

// A local cluster of this build's programs (PD_BINARY_DIR/bin) from `yaml`, written to
// workDir/name.yaml and run in workDir/name.run (emptied first), on free ports. generateSecret:
// pdserve up's cluster secret (false: open mode, as a config without cluster.secret_file runs).
inline std::unique_ptr<tools::LocalCluster> startLocalCluster(const std::string& workDir, const std::string& name,
                                                              const std::string& yaml, bool generateSecret = true) {
  std::filesystem::create_directories(workDir);
  tools::LocalClusterOptions o;
  o.configPath = workDir + "/" + name + ".yaml";
  std::ofstream(o.configPath) << yaml;
  o.binDir = std::string(PD_BINARY_DIR) + "/bin";
  o.httpPort = 0;
  o.controlPort = 0;
  o.runDir = workDir + "/" + name + ".run";
  o.generateSecret = generateSecret;
  std::filesystem::remove_all(o.runDir);
  auto c = tools::LocalCluster::start(o);
  INFO(c.status().toString());
  REQUIRE(c.ok());
  return std::move(c).value();
}

inline double routerMetric(tools::LocalCluster& c, const std::string& series) {
  auto r = tools::httpGet(c.httpPort(), "/metrics", std::chrono::seconds(5));
  return r.ok() ? metricValue(r->body, series) : -1;
}

inline double workerMetric(tools::LocalCluster& c, const std::string& worker, const std::string& series) {
  auto r = tools::httpGet(c.metricsPort(worker), "/metrics", std::chrono::seconds(5));
  return r.ok() ? metricValue(r->body, series) : -1;
}

}  // namespace pd::test
