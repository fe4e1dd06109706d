// pdserve-prefill / pdserve-decode command-line flags (docs/deploy.md lists them).
#pragma once

#include <string>
#include <vector>

#include "common/base/status.h"

namespace CLI {
class App;  // CLI11 (common/base/cli.h)
}

namespace pd::worker {

// One --router entry. A host that resolves to several addresses (a headless Service) is one
// router per address (worker/router_links.h).
struct RouterTarget {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: the config's router.workers.control_port
};

struct WorkerFlags {
  std::string configPath = "deploy/configs/local.yaml";
  std::vector<RouterTarget> routers{RouterTarget{}};  // --router HOST:PORT[,HOST:PORT...]
  std::string workerId;                               // required
  // The address peers on other hosts dial (prefill control, tcp KV): this host's own address,
  // never a wildcard (the chart passes the pod IP). See common/config/endpoints.h.
  std::string advertiseHost = "127.0.0.1";
  // Where the control and metrics endpoints bind; empty: the config's pools.<role>.host.
  std::string bindHost;
  int port = 0;           // control RPC from peers (prefill); 0 = OS-chosen
  int transferPort = 0;   // kvtransfer tcp data port; 0 = --port + 1 when --port is set
  int metricsPort = 0;    // /health and /metrics; 0 = OS-chosen
  std::string modelPath;  // overrides model.path
  // --ports-file: where the started worker writes the ports it bound (worker_main.h,
  // common/base/ports_file.h); empty: nowhere.
  std::string portsFile;
};

// Adds the flags every worker program shares (pdserve-prefill, pdserve-decode,
// pdserve-worker) to `app`, bound to `flags`; --id is required. Errors name the flag.
void addWorkerFlags(CLI::App& app, WorkerFlags& flags);

// What the flags imply once parsed: --transfer-port defaults to --port + 1 when --port is set.
void applyWorkerFlagDefaults(WorkerFlags& flags);

// --router's value: HOST:PORT[,HOST:PORT...]; the error names --router.
Result<std::vector<RouterTarget>> parseRouterTargets(const std::string& value);

}  // namespace pd::worker
