// A whole pdserve cluster on this machine: a router, N prefill and M decode workers as child
// processes, started in order and checked for health. `pdserve up` runs one interactively;
// the end-to-end tests run one per test.
//
// Threads: not thread-safe; one owner. The destructor stops every process.
#pragma once

#include <chrono>
#include <map>
#include <optional>
#include <string>

#include "common/base/status.h"
#include "common/config/cluster_config.h"
#include "tools/process_group.h"

namespace pd::tools {

struct LocalClusterOptions {
  std::string configPath = "deploy/configs/local.yaml";
  std::string binDir;              // where pdserve-router/-prefill/-decode are
  int httpPort = -1;               // overrides router.port when >= 0 (0: a free port)
  int controlPort = -1;            // overrides router.control_port when >= 0
  int prefillReplicas = -1;        // overrides pools.prefill.replicas when >= 0
  int decodeReplicas = -1;         // overrides pools.decode.replicas when >= 0
  std::chrono::seconds startTimeout{120};
  // Where the cluster's generated files go (its secret, the config that names it). Empty: a
  // fresh private directory under $TMPDIR, removed when the cluster is destroyed.
  std::string runDir;
  // When the config names no cluster.secret_file: generate a fresh 0600 secret in runDir and
  // start every process with a copy of the config that points at it, so the default local
  // cluster's internal planes are authenticated (docs/security.md). false: run the
  // config as it is (unauthenticated when it names no secret).
  bool generateSecret = true;
};

class LocalCluster {
 public:
  // Makes the configured model when its directory is missing (model.preset), starts the
  // processes and waits until the router reports every worker healthy. Errors name the
  // process that failed and point at its log lines.
  static Result<std::unique_ptr<LocalCluster>> start(const LocalClusterOptions& options);
  ~LocalCluster();

  int httpPort() const { return httpPort_; }
  int controlPort() const { return controlPort_; }  // the router's, which workers dial
  // The /health + /metrics port of a worker ("prefill-0", "decode-0"); 0 when unknown.
  int metricsPort(const std::string& worker) const;
  const config::ClusterConfig& config() const { return config_; }
  // The config file the processes were started with (the generated one when a secret was made).
  const std::string& configPath() const { return configPath_; }
  const std::string& runDir() const { return runDir_; }
  ProcessGroup& processes() { return group_; }
  // Sends SIGKILL to the named process ("prefill-0", "decode-0", "router").
  Status kill(const std::string& name);
  void stop();

 private:
  LocalCluster() = default;
  config::ClusterConfig config_;
  std::string configPath_;
  std::string runDir_;
  bool ownsRunDir_ = false;
  ProcessGroup group_;
  int httpPort_ = 0;
  int controlPort_ = 0;
  std::map<std::string, int> metricsPorts_;
};

struct HttpReply {
  int status = 0;
  std::string headers;  // the raw header block, lower-cased names
  std::string body;     // chunked bodies are de-chunked
};

// One HTTP/1.1 request to 127.0.0.1:port with Connection: close; deadline-bound.
Result<HttpReply> httpRequest(int port, const std::string& method, const std::string& path,
                              const std::string& body, std::chrono::milliseconds timeout,
                              const std::vector<std::string>& extraHeaders = {});
inline Result<HttpReply> httpGet(int port, const std::string& path, std::chrono::milliseconds timeout) {
  return httpRequest(port, "GET", path, "", timeout);
}

// A free TCP port on 127.0.0.1 (bound and released; another process could take it).
Result<int> freePort();

}  // namespace pd::tools
