// LoadReporter: the worker's LoadReports to the router and its load gauges, OFF the loop
// thread. The loop publishes a snapshot after every iteration (cheap: a copy under a mutex);
// a timer on the I/O pool sends the latest one to every router every
// router.load_report_interval_ms. So the
// router keeps hearing from a worker whose loop is inside a long step (a 2,000-token prefill
// chunk on one core takes seconds), instead of marking it unhealthy and routing around it.
// A report says how long the current step has been running, so a stuck loop stays visible.
//
// Threads: publish(), stepStarted()/stepEnded() from the loop thread; start()/stop() from the
// owner; the timer runs on an I/O thread.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include "common/metrics/pdserve_metrics.h"
#include "common/net/io_pool.h"
#include "common/proto/pdserve.pb.h"
#include "engine/engine.h"
#include "kvtransfer/lane_rates.h"
#include "worker/router_links.h"

namespace pd::worker {

struct LoadSnapshot {
  engine::EngineLoad engine;
  int heldWaiting = 0;             // requests the role holds outside the engine (waiting for blocks)
  uint32_t inflightTransfers = 0;  // KV transfers posted and not yet settled
  bool draining = false;           // the worker takes no new work (WorkerLoop::drain)
  uint64_t kvEventSeq = 0;         // the last KvEventBatch sent (worker/kv_event_publisher.h)
  // When publish() took it: a report says how old its figures are (LoadReport.snapshot_age_us),
  // so the router counts the work that finished after them as done.
  std::chrono::steady_clock::time_point takenAt{};
  // Peer pulls (LoadReport.kv_bytes_per_token, lanes, serves_pulls; docs/kv_cache.md).
  uint64_t kvBytesPerToken = 0;
  std::vector<kvt::LaneRates::Figure> lanes;
  bool servesPulls = false;
};

class LoadReporter {
 public:
  LoadReporter(net::IoPool& io, RouterLinks& routers, metrics::WorkerMetrics& metrics, proto::Role role,
               std::string workerId, std::chrono::milliseconds interval);
  ~LoadReporter();

  void start();
  void stop();  // no report is sent after it returns
  void publish(const LoadSnapshot& snapshot);
  void stepStarted();
  void stepEnded();

 private:
  // The LoadReport for a snapshot.
  static proto::Envelope reportFor(proto::Role role, const std::string& workerId, const LoadSnapshot& s,
                                   double stepRunningMs);
  struct Shared;
  static int64_t nowNs();
  static void schedule(std::shared_ptr<Shared> shared);

  std::shared_ptr<Shared> shared_;
};

}  // namespace pd::worker
