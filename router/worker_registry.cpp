#include "router/worker_registry.h"

#include <algorithm>

#include "common/base/log.h"

namespace pd::router {

namespace {
constexpr const char* kTag = "router";
constexpr const char* kHealthyHelp =
    "1 while the worker is connected, reports within router.worker_report_timeout_ms and is not draining (it gets new "
    "work), else 0.";
constexpr const char* kRefusedHelp =
    "Worker registrations this router refused, by the worker's pool and the reason (duplicate_id, model, weights, "
    "block_size, dtype, layout, role).";

// A worker's Hello.model_fingerprint, "<model>/<KV layout>[.tpN]/w<weights>" (worker/engine_setup.h),
// split from the right: the model name may itself hold '/'.
struct Identity {
  std::string layout, weights;
};
Identity parseIdentity(const std::string& fp) {
  Identity id;
  const size_t w = fp.rfind('/');
  if (w == std::string::npos) return id;
  id.weights = fp.substr(w + 1);
  if (!id.weights.empty() && id.weights[0] == 'w') id.weights.erase(0, 1);  // "w<hex>"
  const size_t l = fp.rfind('/', w - 1);
  id.layout = fp.substr(l == std::string::npos ? 0 : l + 1, w - (l == std::string::npos ? 0 : l + 1));
  return id;
}

// The layout's field starting with `tag` ("B16" for "B"), or "" (KvLayout::fingerprint's order).
std::string layoutField(const std::string& layout, char tag) {
  size_t start = 0;
  while (start <= layout.size()) {
    size_t end = layout.find('.', start);
    if (end == std::string::npos) end = layout.size();
    if (end > start && layout[start] == tag) return layout.substr(start + 1, end - start - 1);
    start = end + 1;
  }
  return "";
}

// The KV dtype: the layout's last field before an optional ".tpN".
std::string layoutDtype(const std::string& layout) {
  std::string l = layout;
  if (size_t tp = l.find(".tp"); tp != std::string::npos) l.resize(tp);
  const size_t dot = l.rfind('.');
  return dot == std::string::npos ? "" : l.substr(dot + 1);
}
}  // namespace

std::string WorkerRegistry::mismatch(const std::string& id, const std::string& fp, const Worker& ref,
                                     std::string* reason) {
  if (fp == ref.fingerprint) return "";
  const Identity a = parseIdentity(fp), b = parseIdentity(ref.fingerprint);
  const std::string cluster = "the cluster (worker '" + ref.id + "', registered first)";
  if (a.layout != b.layout) {
    const std::string both = " (KV layout " + a.layout + "; " + cluster + ": " + b.layout + ")";
    if (layoutField(a.layout, 'B') != layoutField(b.layout, 'B')) {
      *reason = "block_size";
      return "worker '" + id + "' has KV block size " + layoutField(a.layout, 'B') + " but the cluster has " +
             layoutField(b.layout, 'B') + both + ": engine.block_size must match";
    }
    if (layoutDtype(a.layout) != layoutDtype(b.layout)) {
      *reason = "dtype";
      return "worker '" + id + "' keeps its KV cache in " + layoutDtype(a.layout) + " but the cluster in " +
             layoutDtype(b.layout) + both + ": engine.kv_cache_dtype must match (auto: model.dtype and engine.backend)";
    }
    *reason = "layout";
    const bool latentA = a.layout.rfind("MLA.", 0) == 0, latentB = b.layout.rfind("MLA.", 0) == 0;
    if (latentA != latentB)
      return "worker '" + id + "' keeps " +
             (latentA ? "latent KV (multi-head latent attention)" : "K and V per kv head") + " but the cluster " +
             (latentB ? "latent KV (multi-head latent attention)" : "K and V per kv head") + both +
             ": prefill and decode workers must serve the same model";
    return "worker '" + id + "' has another KV layout than the cluster" + both +
           ": the model config and engine.tensor_parallel_size must match";
  }
  *reason = "weights";
  return "worker '" + id + "' serves weights " + a.weights + " but " + cluster + " serves " + b.weights +
         ": every worker must load the same checkpoint (docs/security.md, \"Weights fingerprint\")";
}

Status WorkerRegistry::refuse(const proto::Hello& hello, const std::string& reason, std::string message) {
  const char* pool = hello.role() == proto::ROLE_PREFILL  ? "prefill"
                     : hello.role() == proto::ROLE_DECODE ? "decode"
                                                          : "other";
  registry_.counter("pdserve_worker_registrations_refused_total", kRefusedHelp, {{"pool", pool}, {"reason", reason}})
      .inc();
  PD_LOG(kError, kTag) << "refused the registration of worker '" << hello.worker_id() << "': " << message;
  return failedPrecondition(std::move(message));
}

WorkerRegistry::WorkerRegistry(boost::asio::any_io_executor executor, std::string modelName,
                               std::chrono::milliseconds reportTimeout, metrics::Registry& registry,
                               metrics::RouterMetrics& metrics)
    : executor_(std::move(executor)),
      modelName_(std::move(modelName)),
      reportTimeout_(reportTimeout),
      registry_(registry),
      metrics_(metrics) {}

Status WorkerRegistry::add(const net::ConnectionPtr& c) {
  const auto& hello = c->peerHello();
  if (hello.role() != proto::ROLE_PREFILL && hello.role() != proto::ROLE_DECODE) {
    return refuse(hello, "role", "only prefill and decode workers register here");
  }
  if (hello.model_fingerprint().rfind(modelName_ + "/", 0) != 0) {
    return refuse(hello, "model",
                  "worker '" + hello.worker_id() + "' serves '" + hello.model_fingerprint() +
                      "', this router serves '" + modelName_ + "' (model.name)");
  }
  // The cluster's identity is the earliest registered worker's (docs/security.md, "Weights
  // fingerprint"): the router never loads weights, and a worker that disagrees with the ones
  // already serving would pair with them per request.
  const Worker* first = nullptr;
  for (const auto& [id, w] : workers_)
    if (w->id != hello.worker_id() && (!first || w->seq < first->seq)) first = w.get();
  if (first) {
    std::string reason;
    if (std::string why = mismatch(hello.worker_id(), hello.model_fingerprint(), *first, &reason); !why.empty())
      return refuse(hello, reason, std::move(why));
  }
  if (auto it = workers_.find(hello.worker_id()); it != workers_.end() && it->second->conn->isOpen()) {
    // A live worker keeps its id. One that stopped reporting is presumed gone (its process
    // restarted, or the connection died without a reset reaching us): the id is released to
    // the new connection instead of locking the worker out until TCP gives up.
    if (it->second->reportsFresh && steadyNow() - it->second->lastReport < reportTimeout_) {
      return refuse(hello, "duplicate_id",
                    "worker id '" + hello.worker_id() + "' is already registered by a live worker from " +
                        it->second->conn->remoteAddress() + ": every worker needs its own --id");
    }
    PD_LOG(kWarn, kTag) << "worker '" << hello.worker_id() << "' registers again from " << c->remoteAddress()
                        << "; its old connection from " << it->second->conn->remoteAddress() << " sent no report for "
                        << reportTimeout_.count() << " ms: closing it";
    it->second->conn->close(unavailable("replaced by a new registration of worker '" + hello.worker_id() + "'"));
  }
  auto w = std::make_unique<Worker>(executor_);
  w->id = hello.worker_id();
  w->role = hello.role() == proto::ROLE_PREFILL ? WorkerRole::kPrefill : WorkerRole::kDecode;
  w->address = hello.address();
  w->fingerprint = hello.model_fingerprint();
  w->seq = nextSeq_++;
  w->conn = c;
  w->lastReport = steadyNow();
  w->report.set_total_blocks(hello.total_blocks());
  w->report.set_free_blocks(hello.total_blocks());
  armReportTimer(*w, w->lastReport + reportTimeout_);
  PD_LOG(kInfo, kTag) << (hello.role() == proto::ROLE_PREFILL ? "prefill" : "decode") << " worker '"
                      << hello.worker_id() << "' registered from " << c->remoteAddress();
  // A worker that re-registers under its id (its old connection closed, the close not yet
  // seen) replaces the old entry, whose timer is cancelled with it.
  workers_[w->id] = std::move(w);
  updatePoolGauges();
  return Status::ok();
}

std::string WorkerRegistry::remove(const net::ConnectionPtr& c) {
  std::string id;
  for (auto it = workers_.begin(); it != workers_.end(); ++it) {
    if (it->second->conn != c) continue;
    id = it->first;
    registry_.gauge("pdserve_worker_healthy", kHealthyHelp, labelsFor(*it->second)).set(0);
    workers_.erase(it);
    break;
  }
  updatePoolGauges();
  return id;
}

void WorkerRegistry::onLoadReport(const net::ConnectionPtr& c, const proto::LoadReport& report) {
  auto it = workers_.find(report.worker_id());
  if (it == workers_.end() || it->second->conn != c) return;
  Worker& w = *it->second;
  w.report = report;
  w.lastReport = steadyNow();
  // What finished before the report's figures were taken, they no longer count as queued;
  // what finished after, they still do. An older worker sends no age: its report is as of now.
  const SteadyTime takenAt = w.lastReport - std::chrono::microseconds(report.snapshot_age_us());
  while (!w.settled.empty() && w.settled.front().first <= takenAt) {
    w.settledSinceReport -= w.settled.front().second;
    w.settled.pop_front();
  }
  if (!w.reportsFresh) {
    PD_LOG(kInfo, kTag) << "worker '" << w.id << "' reports again";
    w.reportsFresh = true;
    armReportTimer(w, w.lastReport + reportTimeout_);
  }
  // A fresh report does not touch the pending timer: when it fires it re-arms itself for
  // lastReport + timeout, so a report costs no timer cancellation.
  exportLoad(w);
}

void WorkerRegistry::armReportTimer(Worker& w, SteadyTime at) {
  w.reportTimer.expires_at(at);
  w.reportTimer.async_wait(
      [this, id = w.id, conn = std::weak_ptr<net::FramedConnection>(w.conn)](const boost::system::error_code& ec) {
        if (ec) return;  // cancelled: the worker left or was replaced (its entry is gone)
        if (auto c = conn.lock()) onReportTimer(id, c);
      });
}

void WorkerRegistry::onReportTimer(const std::string& id, const net::ConnectionPtr& conn) {
  auto it = workers_.find(id);
  if (it == workers_.end() || it->second->conn != conn) return;
  Worker& w = *it->second;
  const SteadyTime due = w.lastReport + reportTimeout_;
  if (steadyNow() < due) return armReportTimer(w, due);
  w.reportsFresh = false;
  registry_.gauge("pdserve_worker_healthy", kHealthyHelp, labelsFor(w)).set(0);
  PD_LOG(kWarn, kTag) << "worker '" << w.id << "' sent no load report for " << reportTimeout_.count()
                      << " ms: no new work until it does";
  if (onSilent_) onSilent_(w.id);
}

void WorkerRegistry::noteRouted(const std::string& prefilling, int64_t tokens, const std::string& decoding,
                                int streams) {
  if (auto it = workers_.find(prefilling); it != workers_.end()) {
    it->second->routedPrefillTokens += tokens;
    exportRouted(*it->second);
  }
  if (auto it = workers_.find(decoding); it != workers_.end()) {
    it->second->routedStreams += streams;
    exportRouted(*it->second);
  }
}

void WorkerRegistry::prefillSettled(const std::string& prefilling, int64_t tokens) {
  if (auto it = workers_.find(prefilling); it != workers_.end()) {
    it->second->routedPrefillTokens = std::max<int64_t>(0, it->second->routedPrefillTokens - tokens);
    Worker& w = *it->second;
    w.settled.emplace_back(steadyNow(), tokens);
    w.settledSinceReport += tokens;
    if (w.settled.size() > kMaxSettled) {  // forgetting one only overstates the queue
      w.settledSinceReport -= w.settled.front().second;
      w.settled.pop_front();
    }
    exportRouted(*it->second);
  }
}

void WorkerRegistry::streamEnded(const std::string& decoding) {
  if (auto it = workers_.find(decoding); it != workers_.end()) {
    it->second->routedStreams = std::max(0, it->second->routedStreams - 1);
    exportRouted(*it->second);
  }
}

std::vector<WorkerView> WorkerRegistry::snapshot() const {
  std::vector<WorkerView> out;
  out.reserve(workers_.size());
  for (const auto& [id, w] : workers_) {
    WorkerView v;
    v.id = id;
    v.role = w->role;
    v.healthy = w->conn->isOpen() && w->reportsFresh && !w->report.draining();
    v.queuedPrefillTokens = std::max<int64_t>(0, int64_t(w->report.queued_prefill_tokens()) - w->settledSinceReport);
    v.running = int(w->report.running());
    v.waiting = int(w->report.waiting());
    v.freeBlocks = int64_t(w->report.free_blocks());
    v.totalBlocks = int64_t(w->report.total_blocks());
    v.maxPromptTokens = int64_t(w->report.max_prompt_tokens());
    v.prefillTokensPerS = w->report.prefill_tokens_per_s();
    v.decodeStepMs = w->report.decode_step_ms();
    if (w->report.has_decode_step_cost()) {
      v.decodeStepBaseMs = w->report.decode_step_cost().base_ms();
      v.decodeStepPerStreamMs = w->report.decode_step_cost().per_stream_ms();
      v.decodeSmallChunkMs = w->report.decode_step_cost().small_chunk_ms();
    }
    v.routedPrefillTokens = w->routedPrefillTokens;
    v.routedStreams = w->routedStreams;
    v.servesPulls = w->role == WorkerRole::kDecode && w->report.serves_pulls() && !w->address.empty();
    v.host = w->address.substr(0, w->address.rfind(':'));
    v.kvBytesPerToken = int64_t(w->report.kv_bytes_per_token());
    for (const auto& l : w->report.lanes()) v.lanes.push_back({l.transport(), l.bytes_per_s(), l.setup_ms()});
    out.push_back(v);
  }
  return out;
}

const WorkerRegistry::Worker* WorkerRegistry::find(const std::string& id) const {
  auto it = workers_.find(id);
  return it == workers_.end() ? nullptr : it->second.get();
}

int64_t WorkerRegistry::totalBlocks(const std::string& id) const {
  const Worker* w = find(id);
  return w ? int64_t(w->report.total_blocks()) : 0;
}

void WorkerRegistry::updatePoolGauges() {
  int prefill = 0, decode = 0;
  for (const auto& [id, w] : workers_) (w->role == WorkerRole::kPrefill ? prefill : decode)++;
  metrics_.setPoolWorkers(metrics::kPoolPrefill, prefill);
  metrics_.setPoolWorkers(metrics::kPoolDecode, decode);
}

metrics::Labels WorkerRegistry::labelsFor(const Worker& w) {
  return {{"worker", w.id},
          {"pool", std::string(w.role == WorkerRole::kPrefill ? metrics::kPoolPrefill : metrics::kPoolDecode)}};
}

// The router's view of each worker, from its load reports: what routing decided on.
void WorkerRegistry::exportLoad(const Worker& w) {
  const metrics::Labels labels = labelsFor(w);
  const auto& r = w.report;
  registry_.gauge("pdserve_worker_healthy", kHealthyHelp, labels).set(r.draining() ? 0 : 1);
  registry_.gauge("pdserve_worker_kv_free_blocks", "Free KV blocks per worker (load reports).", labels)
      .set(double(r.free_blocks()));
  registry_.gauge("pdserve_worker_kv_total_blocks", "KV blocks per worker (load reports).", labels)
      .set(double(r.total_blocks()));
  registry_.gauge("pdserve_worker_running", "Running requests per worker (load reports).", labels)
      .set(double(r.running()));
  registry_.gauge("pdserve_worker_queued_prefill_tokens", "Queued prefill tokens per worker (load reports).", labels)
      .set(double(r.queued_prefill_tokens()));
  registry_
      .gauge("pdserve_worker_prefill_tokens_per_second",
             "Prompt tokens per second the worker measured (load reports; admission predicts queue waits from it).",
             labels)
      .set(r.prefill_tokens_per_s());
}

// This router's outstanding work per worker (noteRouted): what admission counts next to the
// reports; both back at 0 when the router is idle (anything else is a leak).
void WorkerRegistry::exportRouted(const Worker& w) {
  const metrics::Labels labels = labelsFor(w);
  registry_
      .gauge("pdserve_router_routed_prefill_tokens",
             "Prompt tokens this router routed to the worker that have no first token yet.", labels)
      .set(double(w.routedPrefillTokens));
  registry_
      .gauge("pdserve_router_routed_streams", "Streams this router routed to the worker that have not ended.", labels)
      .set(double(w.routedStreams));
}

}  // namespace pd::router
