// A whole pdserve cluster on this machine: a router, N prefill and M decode workers as child
// processes, started in order and checked for health. `pdserve up` runs one interactively;
// the end-to-end tests run one per test. Workers can be added and drained while it runs
// (startWorker / drainWorker), which is what the local actuator does (tools/local_actuator.h).
//
// Threads: not thread-safe; one owner. The destructor stops every process.
#pragma once

#include <chrono>
#include <map>
#include <optional>
#include <string>

#include "common/base/enum_names.h"
#include "common/base/ports_file.h"
#include "common/base/status.h"
#include "common/config/cluster_config.h"
#include "tools/process_group.h"

namespace pd::tools {

struct LocalClusterOptions {
  std::string configPath = "deploy/configs/local.yaml";
  std::string binDir;  // where pdserve-router/-prefill/-decode/-worker are
  // Override router.http.port / router.workers.control_port when >= 0; 0: the router binds an OS-chosen
  // port and says which in its ports file (common/base/ports_file.h), read back here.
  int httpPort = -1;
  int controlPort = -1;
  int prefillReplicas = -1;  // overrides pools.prefill.replicas when >= 0
  int decodeReplicas = -1;   // overrides pools.decode.replicas when >= 0
  std::chrono::seconds startTimeout{120};
  // Where the cluster's generated files go (each process's ports file; its secret and the
  // config that names it). Empty: a fresh private directory under $TMPDIR, removed when the
  // cluster is destroyed.
  std::string runDir;
  // When the config names no cluster.secret_file: generate a fresh 0600 secret in runDir and
  // start every process with a copy of the config that points at it, so the default local
  // cluster's internal planes are authenticated (docs/security.md). false: run the
  // config as it is (unauthenticated when it names no secret).
  bool generateSecret = true;
};

enum class Pool { kPrefill, kDecode };
// "prefill", "decode": the router's pool label.
inline constexpr EnumNames<Pool, 2> kPoolNames{{{Pool::kPrefill, "prefill"}, {Pool::kDecode, "decode"}}};
inline const char* poolName(Pool pool) { return enumName(kPoolNames, pool); }

class LocalCluster {
 public:
  // Makes the configured model when its directory is missing (model.preset), starts the
  // processes and waits until the router reports every worker healthy. Errors name the
  // process that failed and point at its log lines.
  static Result<std::unique_ptr<LocalCluster>> start(const LocalClusterOptions& options);
  ~LocalCluster();

  int httpPort() const { return httpPort_; }        // the bound ones, also after a 0 was asked for
  int controlPort() const { return controlPort_; }  // the router's, which workers dial
  // The /health + /metrics port of a running worker ("prefill-0", "decode-0"), from its
  // ports file: known for every worker once start() returned, for one startWorker() started
  // once it has started; 0 before, and for a name that is no worker.
  int metricsPort(const std::string& worker) const;
  const config::ClusterConfig& config() const { return config_; }
  // The config file the processes were started with (the generated one when a secret was made).
  const std::string& configPath() const { return configPath_; }
  const std::string& runDir() const { return runDir_; }
  ProcessGroup& processes() { return group_; }
  // Sends SIGKILL to the named process ("prefill-0", "decode-0", "router").
  Status kill(const std::string& name);
  void stop();

  // One more worker of `pool`, started now (not waited for): its id is the pool's next
  // unused number ("decode-2"; ids are never reused, so the router never confuses a new
  // worker with a gone one), its port slot the lowest one no live or draining worker holds
  // (pools.<pool>.base_port + slot when base_port is set; its metrics port OS-chosen).
  // With router.autoscaler.role_moves every worker is a pdserve-worker started in `pool`'s
  // role, named "worker-<n>", and all take their slot from one space (prefill's base_port).
  Result<std::string> startWorker(Pool pool);
  // role_moves only: sends SIGUSR1, so the worker drains and serves `to` in-process under the
  // same id (docs/serving.md "Role switching"); from now on it counts in `to`'s pool. It is
  // registered there once the router says so (pdserve_pool_workers). An error for a worker
  // that is not live, or when role_moves is off (the workers are not pdserve-worker).
  Status switchRole(const std::string& id, Pool to);
  // Sends SIGTERM to the worker: it drains (stops taking work, finishes its streams within
  // engine.drain_timeout_ms, exits 0; worker/). From now on it is not live; its exit is
  // expected (expectedExit) and it is SIGKILLed only once drainDeadline() has passed.
  Status drainWorker(const std::string& id);
  // The pool's workers that are running and not draining, oldest first; and those draining.
  std::vector<std::string> liveWorkers(Pool pool) const;
  std::vector<std::string> drainingWorkers(Pool pool) const;
  // How long a drained worker may take before it is killed: its drain timeout plus a grace
  // for the process to exit.
  std::chrono::milliseconds drainDeadline() const;
  // SIGKILLs every draining worker past drainDeadline(); returns their ids.
  std::vector<std::string> killOverdueDrains();
  // An exit reaped from processes(): true (and the worker forgotten) when it is a worker this
  // cluster drained; false for anything else (a crash: the caller decides).
  bool expectedExit(const ChildExit& exit);
  // The router's /metrics body, with whatever router.http.metrics_auth asks for.
  Result<std::string> routerMetrics(std::chrono::milliseconds timeout) const;

 private:
  LocalCluster() = default;
  // The ports file of `process` once it wrote one; an error naming the process when any child
  // dies first or `deadline` passes.
  Result<PortMap> waitForPorts(const std::string& process, std::chrono::steady_clock::time_point deadline);
  config::ClusterConfig config_;
  std::string configPath_;
  std::string runDir_;
  bool ownsRunDir_ = false;
  ProcessGroup group_;
  int httpPort_ = 0;
  int controlPort_ = 0;
  std::string binDir_;
  std::vector<std::string> metricsAuth_;             // headers for the router's /metrics
  mutable std::map<std::string, int> metricsPorts_;  // read from the ports files, by worker id
  struct Worker {
    Pool pool = Pool::kDecode;  // its role now
    int slot = 0;
    uint64_t started = 0;  // start order, for "the newest first"
    bool draining = false;
    std::chrono::steady_clock::time_point killAt{};
  };
  std::map<std::string, Worker> workers_;  // running workers by id
  int nextId_[2] = {0, 0};                 // per pool (role_moves: [0] numbers every worker)
  uint64_t started_ = 0;
};

// The value of `name{pool="<pool>"}` in a Prometheus text, or -1 when absent.
double poolGauge(const std::string& metrics, const std::string& name, const std::string& pool);

struct HttpReply {
  int status = 0;
  std::string headers;  // the raw header block, lower-cased names
  std::string body;     // chunked bodies are de-chunked
};

// One HTTP/1.1 request to 127.0.0.1:port with Connection: close; deadline-bound.
Result<HttpReply> httpRequest(int port, const std::string& method, const std::string& path, const std::string& body,
                              std::chrono::milliseconds timeout, const std::vector<std::string>& extraHeaders = {});
inline Result<HttpReply> httpGet(int port, const std::string& path, std::chrono::milliseconds timeout) {
  return httpRequest(port, "GET", path, "", timeout);
}

// A free TCP port on 127.0.0.1, bound and released: any other socket can take it before the
// caller binds it. Only for a test that must name a fixed port in a config (base_port);
// processes started on port 0 say theirs in a ports file instead.
Result<int> freePort();

}  // namespace pd::tools
