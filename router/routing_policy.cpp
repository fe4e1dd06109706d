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
  for (const auto& w : workers) {
    if (!w.healthy || w.role != WorkerRole::kDecode) continue;
    if (!leastLoadedDecode || decodeLoadKey(w) < decodeLoadKey(*leastLoadedDecode)) leastLoadedDecode = &w;
    if (!mostFreeDecode || std::make_tuple(-w.freeBlocks, w.running + w.waiting, w.id) <
                               std::make_tuple(-mostFreeDecode->freeBlocks,
                                               mostFreeDecode->running + mostFreeDecode->waiting,
                                               mostFreeDecode->id))
      mostFreeDecode = &w;
  }
  if (!leastLoadedDecode) return std::nullopt;

  // The colocated candidate: most of the prompt cached, among the not-much-busier workers.
  const int loadLimit = leastLoadedDecode->running + leastLoadedDecode->waiting + config_.cacheLoadSlack;
  const WorkerView* colocated = leastLoadedDecode;
  for (const auto& w : workers) {
    if (!w.healthy || w.role != WorkerRole::kDecode || w.running + w.waiting > loadLimit) continue;
    if (std::make_tuple(-w.cachedTokens, decodeLoadKey(w)) <
        std::make_tuple(-colocated->cachedTokens, decodeLoadKey(*colocated)))
      colocated = &w;
  }
  // The prefill worker with the least work ahead of this prompt.
  const WorkerView* prefill = nullptr;
  auto prefillKey = [&](const WorkerView& w) {
    return std::make_tuple(w.queuedPrefillTokens + promptTokens - w.cachedTokens, w.id);
  };
  for (const auto& w : workers) {
    if (w.healthy && w.role == WorkerRole::kPrefill && (!prefill || prefillKey(w) < prefillKey(*prefill)))
      prefill = &w;
  }

  RoutePlan plan;
  if (promptTokens <= config_.shortPromptTokens) {
    plan.reason = "short_prompt";
  } else if (promptTokens - colocated->cachedTokens <= config_.shortPromptTokens) {
    plan.reason = "cached_prefix";
  } else if (!prefill) {
    plan.reason = "no_prefill_worker";
  } else {
    plan.reason = "long_prompt";
  }
  if (prefill && plan.reason != "long_prompt" && config_.itlTargetMs > 0 && colocated->streams() > 0) {
    const auto step = colocated->predictedDecodeStepMs(colocated->streams() + 1);
    if (step && (*step + colocated->decodeSmallChunkMs) * itlScale_ > config_.itlTargetMs) plan.reason = "protect_itl";
  }
  if (plan.reason == "long_prompt" || plan.reason == "protect_itl") {
    plan.route = Route::kDisaggregated;
    plan.prefillWorker = prefill->id;
    plan.decodeWorker = mostFreeDecode->id;
    plan.cachedTokens = prefill->cachedTokens;
    return plan;
  }
  plan.decodeWorker = colocated->id;
  plan.cachedTokens = colocated->cachedTokens;
  return plan;
}

}  // namespace pd::router
