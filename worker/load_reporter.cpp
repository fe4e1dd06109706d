#include "worker/load_reporter.h"

#include <algorithm>
#include <atomic>

#include <boost/asio/steady_timer.hpp>

namespace pd::worker {

// Everything the timer's handlers touch, kept alive by them until the last one ran.
struct LoadReporter::Shared {
  Shared(net::IoPool& io, RouterLinks& r, metrics::WorkerMetrics& m, proto::Role ro, std::string id,
         std::chrono::milliseconds iv)
      : timer(io.context()), routers(r), metrics(m), role(ro), workerId(std::move(id)), interval(iv) {}
  boost::asio::steady_timer timer;
  RouterLinks& routers;
  metrics::WorkerMetrics& metrics;
  const proto::Role role;
  const std::string workerId;
  const std::chrono::milliseconds interval;
  std::atomic<int64_t> stepStartNs{0};  // 0: no step running
  std::mutex mu;                        // guards snapshot, stopped, and every use of routers/metrics by the timer
  LoadSnapshot snapshot;
  bool stopped = false;
};

LoadReporter::LoadReporter(net::IoPool& io, RouterLinks& router, metrics::WorkerMetrics& metrics, proto::Role role,
                           std::string workerId, std::chrono::milliseconds interval)
    : shared_(std::make_shared<Shared>(io, router, metrics, role, std::move(workerId), interval)) {}

LoadReporter::~LoadReporter() { stop(); }

int64_t LoadReporter::nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void LoadReporter::stepStarted() { shared_->stepStartNs.store(nowNs(), std::memory_order_relaxed); }
void LoadReporter::stepEnded() { shared_->stepStartNs.store(0, std::memory_order_relaxed); }

void LoadReporter::start() { schedule(shared_); }

void LoadReporter::stop() {
  std::lock_guard<std::mutex> lock(shared_->mu);
  shared_->stopped = true;
  shared_->timer.cancel();
}

void LoadReporter::publish(const LoadSnapshot& snapshot) {
  std::lock_guard<std::mutex> lock(shared_->mu);
  shared_->snapshot = snapshot;
  shared_->snapshot.takenAt = std::chrono::steady_clock::now();
}

proto::Envelope LoadReporter::reportFor(proto::Role role, const std::string& workerId, const LoadSnapshot& s,
                                        double stepRunningMs) {
  proto::Envelope env;
  auto* r = env.mutable_load_report();
  r->set_role(role);
  r->set_worker_id(workerId);
  r->set_queued_prefill_tokens(static_cast<uint64_t>(s.engine.queuedPrefillTokens));
  r->set_running(static_cast<uint32_t>(s.engine.running + s.engine.remote));
  r->set_waiting(static_cast<uint32_t>(s.engine.waiting + s.heldWaiting));
  r->set_free_blocks(static_cast<uint64_t>(s.engine.freeBlocks));
  r->set_total_blocks(static_cast<uint64_t>(s.engine.totalBlocks));
  r->set_max_prompt_tokens(static_cast<uint64_t>(std::max(0, s.engine.maxPromptTokens)));
  if (s.takenAt != std::chrono::steady_clock::time_point{}) {
    const auto age = std::chrono::steady_clock::now() - s.takenAt;
    r->set_snapshot_age_us(
        uint64_t(std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::microseconds>(age).count())));
  }
  r->set_inflight_transfers(s.inflightTransfers);
  r->set_step_running_ms(stepRunningMs);
  r->set_prefill_tokens_per_s(s.engine.prefillTokensPerS);
  r->set_decode_step_ms(s.engine.decodeStepMs);
  if (const auto& cost = s.engine.decodeStepCost) {
    r->mutable_decode_step_cost()->set_base_ms(cost->baseMs);
    r->mutable_decode_step_cost()->set_per_stream_ms(cost->perStreamMs);
    r->mutable_decode_step_cost()->set_small_chunk_ms(cost->smallChunkMs);
  }
  r->set_draining(s.draining);
  r->set_kv_event_seq(s.kvEventSeq);
  r->set_kv_bytes_per_token(s.kvBytesPerToken);
  r->set_serves_pulls(s.servesPulls);
  for (const auto& lane : s.lanes) {
    auto* l = r->add_lanes();
    l->set_transport(lane.transport);
    l->set_bytes_per_s(lane.bytesPerS);
    l->set_setup_ms(lane.setupMs);
    l->set_samples(uint32_t(lane.samples));
  }
  r->set_sent_at_unix_us(static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count()));
  return env;
}

void LoadReporter::schedule(std::shared_ptr<Shared> shared) {
  {
    std::lock_guard<std::mutex> lock(shared->mu);
    if (shared->stopped) return;
    const LoadSnapshot& s = shared->snapshot;
    const auto& load = s.engine;
    auto& m = shared->metrics;
    m.running.set(load.running);
    m.waiting.set(load.waiting + s.heldWaiting);
    m.queuedPrefillTokens.set(double(load.queuedPrefillTokens));
    m.prefillChunkTokens.set(load.prefillChunkTokens);
    if (load.decodeStepCost) {
      m.decodeStepBaseSeconds.set(load.decodeStepCost->baseMs / 1e3);
      m.decodeStepPerStreamSeconds.set(load.decodeStepCost->perStreamMs / 1e3);
      m.decodeSmallChunkSeconds.set(load.decodeStepCost->smallChunkMs / 1e3);
    }
    m.kvFreeBlocks.set(load.freeBlocks);
    m.kvCacheUsage.set(load.totalBlocks ? 1.0 - double(load.freeBlocks) / load.totalBlocks : 0);
    m.transfersInFlight.set(s.inflightTransfers);
    m.syncEngineCounters(load.preemptions, load.prefixQueryTokens, load.prefixHitTokens);
    const int64_t started = shared->stepStartNs.load(std::memory_order_relaxed);
    const double stepMs = started ? double(nowNs() - started) / 1e6 : 0.0;
    shared->routers.broadcast(reportFor(shared->role, shared->workerId, s, stepMs));
    shared->timer.expires_after(shared->interval);
  }
  shared->timer.async_wait([shared](boost::system::error_code ec) {
    if (!ec) schedule(shared);
  });
}

}  // namespace pd::worker
