// The router (`pdserve-router`, DESIGN.md §1, §6): the OpenAI HTTP API in front of the
// worker pools. It tokenizes each request once, routes it by prompt length (RoutingPolicy),
// sends Generate to a decode worker (naming the prefill worker for long prompts), and
// streams the decode worker's TokenChunks back as SSE, detokenized incrementally, with stop
// strings matched on the text (a match cancels the request on the worker).
//
// Workers dial the control port and say Hello (role, id, model fingerprint); their
// LoadReports feed the routing snapshot, and a worker silent for
// router.worker_report_timeout_ms gets no new work. A worker that disconnects fails its
// requests with an error event; a client that disconnects cancels its request everywhere.
//
// Threads: HTTP and control-plane callbacks run on the router's I/O threads; all router
// state is behind one mutex (work per event is small: a table lookup, a detokenizer step).
#pragma once

#include <memory>
#include <string>

#include "common/base/status.h"
#include "common/config/cluster_config.h"

namespace pd::router {

struct RouterOptions {
  config::ClusterConfig config;
  std::string host;      // overrides router.host when set
  int port = -1;         // overrides router.port when >= 0 (0: OS-chosen)
  int controlPort = -1;  // overrides router.control_port when >= 0
};

class RouterService {
 public:
  // Loads the tokenizer and chat template from model.path.
  static Result<std::unique_ptr<RouterService>> create(RouterOptions options);
  virtual ~RouterService() = default;
  virtual Status start() = 0;
  virtual void stop() = 0;
  virtual int httpPort() const = 0;
  virtual int controlPort() const = 0;
};

}  // namespace pd::router
