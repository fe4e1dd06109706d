// A worker's /health (200 "ok" when healthy, else 503 with a JSON body
// {"status":"draining"|"stopping"|"unregistered"|"refused","reason":"..."}) and /metrics (the
// registry) on one port. Served from the I/O pool's threads, so both answer while the loop
// thread computes a long step.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "common/base/status.h"
#include "common/metrics/metrics.h"
#include "common/net/http_server.h"
#include "common/net/io_pool.h"

namespace pd::worker {

class StatusEndpoint {
 public:
  struct Unhealthy {
    std::string status;  // one word: "draining", "refused", ...
    std::string reason;  // for an operator: why
  };
  // unhealthy() runs on an I/O thread: nullopt when healthy, else why not.
  StatusEndpoint(net::IoPool& io, metrics::Registry& registry, std::function<std::optional<Unhealthy>()> unhealthy);
  // Binds host:port (0: OS-chosen).
  Status start(const std::string& host, int port);
  int port() const;

 private:
  net::IoPool& io_;
  metrics::Registry& registry_;
  std::function<std::optional<Unhealthy>()> unhealthy_;
  std::unique_ptr<net::HttpServer> server_;
};

}  // namespace pd::worker
