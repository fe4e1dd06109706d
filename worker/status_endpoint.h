// A worker's /health (200 when healthy() says so, else 503 with the reason) and /metrics (the
// registry) on one port. Served from the I/O pool's threads, so both answer while the loop
// thread computes a long step.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "common/base/status.h"
#include "common/metrics/metrics.h"
#include "common/net/http_server.h"
#include "common/net/io_pool.h"

namespace pd::worker {

class StatusEndpoint {
 public:
  // healthy() runs on an I/O thread.
  StatusEndpoint(net::IoPool& io, metrics::Registry& registry, std::function<bool()> healthy);
  // Binds host:port (0: OS-chosen).
  Status start(const std::string& host, int port);
  int port() const;

 private:
  net::IoPool& io_;
  metrics::Registry& registry_;
  std::function<bool()> healthy_;
  std::unique_ptr<net::HttpServer> server_;
};

}  // namespace pd::worker
