// Routing policy (DESIGN.md §6): which worker(s) serve a request, decided from an immutable
// snapshot of the workers' load reports. Pure: no I/O, no clock, no locks; the router calls
// select() on its own thread with a snapshot it owns.
//
// Rules:
// - prompt tokens <= shortPromptTokens: colocated on the least-loaded healthy decode worker;
// - longer: the healthy prefill worker with the fewest queued prefill tokens, paired with the
//   healthy decode worker with the most free KV blocks; with no healthy prefill worker the
//   request is served colocated (reason "no_prefill_worker") rather than refused;
// - no healthy decode worker: no route (the router answers 503).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace pd::router {

enum class WorkerRole { kPrefill, kDecode };

struct WorkerView {
  std::string id;
  WorkerRole role = WorkerRole::kDecode;
  bool healthy = false;
  int64_t queuedPrefillTokens = 0;
  int running = 0;
  int waiting = 0;
  int64_t freeBlocks = 0;
  int64_t totalBlocks = 0;
};

enum class Route { kColocated, kDisaggregated };
const char* routeName(Route route);

struct RoutePlan {
  Route route = Route::kColocated;
  std::string decodeWorker;
  std::string prefillWorker;  // empty when colocated
  std::string reason;         // "short_prompt", "long_prompt", "no_prefill_worker"
};

struct RoutingConfig {
  int64_t shortPromptTokens = 256;
};

class RoutingPolicy {
 public:
  explicit RoutingPolicy(RoutingConfig config) : config_(config) {}

  // nullopt when no healthy decode worker exists.
  std::optional<RoutePlan> select(int64_t promptTokens, const std::vector<WorkerView>& workers) const;

  const RoutingConfig& config() const { return config_; }

 private:
  RoutingConfig config_;
};

}  // namespace pd::router
