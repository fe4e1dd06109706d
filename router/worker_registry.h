// The router's table of registered workers (docs/design.md §6): who said Hello on the control
// port, their last LoadReport, and the immutable load snapshot routing decides on. A worker
// whose reports stop for report_timeout is unhealthy (it gets no new work) until it reports
// again; a per-worker timer says so, there is no polling.
//
// Threads: not thread-safe. Every method, and the report timers' handlers, run on the
// executor given to the constructor (the router loop's strand, router/router_loop.h); the
// registry must be destroyed on it or after the executor's threads stopped. Sending on the
// connections it hands out is thread-safe (framed.h).
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/steady_timer.hpp>

#include "common/base/clock.h"
#include "common/base/status.h"
#include "common/metrics/pdserve_metrics.h"
#include "common/net/framed.h"
#include "router/routing_policy.h"

namespace pd::router {

class WorkerRegistry {
 public:
  struct Worker {
    explicit Worker(const boost::asio::any_io_executor& ex) : reportTimer(ex) {}
    std::string id;
    WorkerRole role = WorkerRole::kDecode;
    std::string address;      // prefill: where decode workers dial it
    std::string fingerprint;  // Hello.model_fingerprint: model, KV layout, weights
    uint64_t seq = 0;         // registration order: the lowest is the cluster's reference
    net::ConnectionPtr conn;
    proto::LoadReport report;
    SteadyTime lastReport;
    bool reportsFresh = true;  // false once report_timeout passed without a report
    boost::asio::steady_timer reportTimer;
    // This router's own work here (WorkerView::routedPrefillTokens / routedStreams).
    int64_t routedPrefillTokens = 0;
    int routedStreams = 0;
    // Of the routed tokens, those whose first token arrived after the last report's figures
    // were taken (its snapshot_age_us before it arrived): the report still counts them as
    // queued. A report sent after a first token may have been taken before it (the loop
    // takes figures between steps, the report goes out on a timer), so settlements are kept
    // by time, not cleared by any report. Oldest first; at most kMaxSettled are kept.
    std::deque<std::pair<SteadyTime, int64_t>> settled;
    int64_t settledSinceReport = 0;  // their sum
  };

  WorkerRegistry(boost::asio::any_io_executor executor, std::string modelName, std::chrono::milliseconds reportTimeout,
                 metrics::Registry& registry, metrics::RouterMetrics& metrics);

  // A connection finished its handshake: registers the worker, or says why it may not
  // (kFailedPrecondition: not a worker, another model, an id already registered, or weights
  // or a KV layout (block size, dtype, shape) other than the earliest registered worker's);
  // the refusal is logged, counted in pdserve_worker_registrations_refused_total{pool,reason}
  // and the caller tells the worker (an Error frame) before it closes the connection.
  Status add(const net::ConnectionPtr& conn);
  // The connection closed: the id of the worker it registered, or "" when it registered none.
  std::string remove(const net::ConnectionPtr& conn);
  // A LoadReport from conn; ignored unless conn is the registered connection of the worker.
  void onLoadReport(const net::ConnectionPtr& conn, const proto::LoadReport& report);

  // This router's outstanding work per worker, which admission reads next to the reports
  // (a report lags: it is taken between engine steps, and a request reaches a prefill worker
  // through the decode worker). `tokens` uncached prompt tokens were routed to `prefilling`
  // and `streams` streams to `decoding` (the same worker when colocated); the tokens count
  // until the request's first token (prefillSettled), a stream until it ends (streamEnded).
  // The tokens settled after a worker's last report was taken are taken off its reported
  // queue in snapshot() (docs/serving.md, "Overload"). Unknown ids are ignored; the counts never go below 0 (a worker
  // that re-registered under its id starts from 0).
  void noteRouted(const std::string& prefilling, int64_t tokens, const std::string& decoding, int streams);
  void prefillSettled(const std::string& prefilling, int64_t tokens);
  void streamEnded(const std::string& decoding);

  // Called (on the executor) when a worker's reports stop for report_timeout: it is cut off
  // or gone, and what it streams cannot be counted on (the loop migrates it).
  void onSilent(std::function<void(const std::string& id)> callback) { onSilent_ = std::move(callback); }

  // One view per registered worker, healthy = connected and reporting.
  std::vector<WorkerView> snapshot() const;
  // nullptr when no such worker is registered.
  const Worker* find(const std::string& id) const;
  int64_t totalBlocks(const std::string& id) const;

 private:
  void armReportTimer(Worker& w, SteadyTime at);
  // Why a worker `id` with fingerprint `fp` may not join `ref`'s cluster ("" when it may);
  // *reason: the metric's label.
  static std::string mismatch(const std::string& id, const std::string& fp, const Worker& ref, std::string* reason);
  Status refuse(const proto::Hello& hello, const std::string& reason, std::string message);
  void onReportTimer(const std::string& id, const net::ConnectionPtr& conn);
  void updatePoolGauges();
  static metrics::Labels labelsFor(const Worker& w);
  void exportLoad(const Worker& w);
  void exportRouted(const Worker& w);

  static constexpr size_t kMaxSettled = 4096;  // a silent worker's settlements stop here

  boost::asio::any_io_executor executor_;
  const std::string modelName_;
  const std::chrono::milliseconds reportTimeout_;
  metrics::Registry& registry_;
  metrics::RouterMetrics& metrics_;
  // unique_ptr: a timer's handler finds its worker by id; the entry never moves under it.
  std::unordered_map<std::string, std::unique_ptr<Worker>> workers_;
  std::function<void(const std::string&)> onSilent_;
  uint64_t nextSeq_ = 0;
};

}  // namespace pd::router
