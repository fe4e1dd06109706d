#include "router/routing_policy.h"

#include <tuple>

namespace pd::router {

const char* routeName(Route route) {
  return route == Route::kColocated ? "colocated" : "disaggregated";
}

namespace {

// Lower is better: requests in flight first, then KV pressure; the id breaks ties so the
// choice is deterministic.
auto decodeLoadKey(const WorkerView& w) {
  return std::make_tuple(w.running + w.waiting, -w.freeBlocks, w.id);
}

}  // namespace

std::optional<RoutePlan> RoutingPolicy::select(int64_t promptTokens,
                                               const std::vector<WorkerView>& workers) const {
  const WorkerView* leastLoadedDecode = nullptr;
  const WorkerView* mostFreeDecode = nullptr;
  const WorkerView* leastQueuedPrefill = nullptr;
  for (const auto& w : workers) {
    if (!w.healthy) continue;
    if (w.role == WorkerRole::kDecode) {
      if (!leastLoadedDecode || decodeLoadKey(w) < decodeLoadKey(*leastLoadedDecode))
        leastLoadedDecode = &w;
      if (!mostFreeDecode || std::make_tuple(-w.freeBlocks, w.running + w.waiting, w.id) <
                                 std::make_tuple(-mostFreeDecode->freeBlocks,
                                                 mostFreeDecode->running + mostFreeDecode->waiting,
                                                 mostFreeDecode->id))
        mostFreeDecode = &w;
    } else if (!leastQueuedPrefill ||
               std::tie(w.queuedPrefillTokens, w.id) <
                   std::tie(leastQueuedPrefill->queuedPrefillTokens, leastQueuedPrefill->id)) {
      leastQueuedPrefill = &w;
    }
  }
  if (!leastLoadedDecode) return std::nullopt;

  RoutePlan plan;
  if (promptTokens <= config_.shortPromptTokens) {
    plan.reason = "short_prompt";
  } else if (!leastQueuedPrefill) {
    plan.reason = "no_prefill_worker";
  } else {
    plan.route = Route::kDisaggregated;
    plan.prefillWorker = leastQueuedPrefill->id;
    plan.decodeWorker = mostFreeDecode->id;
    plan.reason = "long_prompt";
    return plan;
  }
  plan.decodeWorker = leastLoadedDecode->id;
  return plan;
}

}  // namespace pd::router
