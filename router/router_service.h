// The router (`pdserve-router`, docs/design.md §1, §6): the OpenAI HTTP API in front of the
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
// Threads: no router-wide lock. HTTP handlers and control-plane callbacks run on the
// router's I/O threads; they parse there and post everything else. One loop strand owns the
// worker and request tables and the routing state (router/router_loop.h); each request's
// detokenizer, stop matching and sends run on that request's own strand
// (router/request_stream.h), so requests stream in parallel. Deadlines (request timeout,
// worker report timeout, autoscaler tick) are Asio timers on those strands, not a poller.
// create() and the methods below are called from one controlling thread (main); stop() must
// not be called from an I/O thread (it joins them).
#pragma once

#include <chrono>
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
  // SIGTERM: /health says 503 draining and new requests are refused with a 503; streams in
  // flight get up to `timeout` to finish, then end with an error event and [DONE].
  virtual void drain(std::chrono::milliseconds timeout) = 0;
  virtual void stop() = 0;
  virtual int httpPort() const = 0;
  virtual int controlPort() const = 0;
};

}  // namespace pd::router
