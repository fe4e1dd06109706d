#include "router/routing_policy.h"

#include <tuple>

namespace pd::router {

std::optional<int64_t> longestServablePrompt(const std::vector<WorkerView>& workers) {
  std::optional<int64_t> longest;
  for (const auto& w : workers) {
    if (!w.healthy || w.role != WorkerRole::kDecode) continue;
    if (w.maxPromptTokens <= 0) return std::nullopt;
    longest = std::max(longest.value_or(0), w.maxPromptTokens);
  }
  return longest;
}

namespace {

// Lower is better: requests in flight first, then KV pressure; the id breaks ties so the
// choice is deterministic.
auto decodeLoadKey(const WorkerView& w) { return std::make_tuple(w.running + w.waiting, -w.freeBlocks, w.id); }

}  // namespace

std::optional<RoutePlan> RoutingPolicy::select(int64_t promptTokens, const std::vector<WorkerView>& workers) const {
  const WorkerView* leastLoadedDecode = nullptr;
  const WorkerView* mostFreeDecode = nullptr;
  for (const auto& w : workers) {
    if (!w.healthy || w.role != WorkerRole::kDecode) continue;
    if (!leastLoadedDecode || decodeLoadKey(w) < decodeLoadKey(*leastLoadedDecode)) leastLoadedDecode = &w;
    if (!mostFreeDecode || std::make_tuple(-w.freeBlocks, w.running + w.waiting, w.id) <
                               std::make_tuple(-mostFreeDecode->freeBlocks,
                                               mostFreeDecode->running + mostFreeDecode->waiting, mostFreeDecode->id))
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
    if (w.healthy && w.role == WorkerRole::kPrefill && (!prefill || prefillKey(w) < prefillKey(*prefill))) prefill = &w;
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
  if (prefill && plan.reason != "long_prompt" && !fitsBesideStreams(*colocated)) plan.reason = "protect_itl";
  if (plan.reason == "long_prompt" || plan.reason == "protect_itl") {
    plan.route = Route::kDisaggregated;
    plan.prefillWorker = prefill->id;
    plan.decodeWorker = mostFreeDecode->id;
    plan.cachedTokens = prefill->cachedTokens;
    return plan;
  }
  return colocatedOn(*colocated, std::move(plan.reason));
}

bool planPrefillPull(RoutePlan& plan, const std::vector<WorkerView>& views,
                     const std::vector<PullCandidate>& candidates, double fallbackRate, std::string* why) {
  if (plan.route != Route::kDisaggregated) {
    if (why) *why = "not disaggregated";
    return false;
  }
  const WorkerView* prefill = nullptr;
  int64_t kvBytesPerToken = 0;
  for (const auto& v : views) {
    if (v.id == plan.prefillWorker) prefill = &v;
    kvBytesPerToken = std::max(kvBytesPerToken, v.kvBytesPerToken);  // one model: the same everywhere
  }
  if (!prefill) {
    if (why) *why = "prefill worker " + plan.prefillWorker + " not in the snapshot";
    return false;
  }
  // The prefill worker's own hit: the exact index's figure when current, else the prediction.
  const int64_t held = std::max<int64_t>(0, prefill->cachedTokens);
  const double rate = prefill->prefillTokensPerS > 0 ? prefill->prefillTokensPerS : fallbackRate;
  std::string rejected;
  auto c = choosePull(prefill->id, prefill->host, held, rate, kvBytesPerToken, candidates, &rejected);
  if (!c) {
    if (why) *why = rejected;
    return false;
  }
  plan.decodeWorker = c->source;
  plan.pullSource = c->source;
  plan.pullTokens = c->prefixTokens;
  plan.pullWhy = c->decision.why;
  plan.cachedTokens = c->prefixTokens;
  plan.reason = "prefill_pull";
  if (why) *why = c->decision.why;
  return true;
}

bool RoutingPolicy::fitsBesideStreams(const WorkerView& w) const {
  if (config_.itlTargetMs <= 0 || w.streams() == 0) return true;
  const auto step = w.predictedDecodeStepMs(w.streams() + 1);
  return !step || (*step + w.decodeSmallChunkMs) * itlScale_ <= config_.itlTargetMs;
}

RoutePlan RoutingPolicy::colocatedOn(const WorkerView& w, std::string reason) {
  RoutePlan plan;
  plan.reason = std::move(reason);
  plan.decodeWorker = w.id;
  plan.cachedTokens = w.cachedTokens;
  plan.exactCachedTokens = w.exactCachedTokens;
  plan.predictedCachedTokens = w.predictedCachedTokens;
  return plan;
}

}  // namespace pd::router
