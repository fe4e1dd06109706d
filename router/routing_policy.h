// Routing policy (docs/design.md §6): which worker(s) serve a request, decided from an immutable
// snapshot of the workers' load reports. Pure: no I/O, no clock, no locks; the router calls
// select() on its own thread with a snapshot it owns.
//
// Rules (WorkerView::cachedTokens is how much of this prompt a worker is believed to hold in
// its prefix cache, router/prefix_index.h; 0 everywhere without prefix-aware routing):
// - the colocated candidate is the healthy decode worker holding the most of the prompt among
//   those with at most cacheLoadSlack more requests (running + waiting) than the least
//   loaded; with nothing cached, simply the least loaded;
// - prompt tokens <= shortPromptTokens: colocated there ("short_prompt");
// - longer, but its uncached part there <= shortPromptTokens: colocated there
//   ("cached_prefix"): recomputing the prefix elsewhere would cost more than it saves;
// - longer: disaggregated ("long_prompt") on the healthy prefill worker with the least work
//   ahead of it -- queued prefill tokens plus this prompt's uncached tokens there -- paired
//   with the healthy decode worker with the most free KV blocks; with no healthy prefill
//   worker the request is served colocated ("no_prefill_worker") rather than refused;
// - with itlTargetMs set (overload control on), a prompt that would go colocated goes
//   disaggregated instead ("protect_itl") when the colocated worker cannot prefill beside its
//   streams within the target: its fitted step cost with one more stream plus what its
//   smallest prompt chunk adds, times the ITL prediction scale, passes itlTargetMs (the chunks cannot shrink further,
//   so every stream there would miss its ITL while the prompt is prefilled) and a prefill worker is up;
// - no healthy decode worker: no route (the router answers 503).
// Admission may then turn a disaggregated plan into a colocated one ("prefill_overflow",
// router/admission.h admitOverflow, colocatedOn) when the prefill pool cannot serve it in time.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/base/enum_names.h"
#include "router/pull_cost.h"

namespace pd::router {

enum class WorkerRole { kPrefill, kDecode };

struct WorkerView {
  std::string id;
  WorkerRole role = WorkerRole::kDecode;
  bool healthy = false;
  int64_t queuedPrefillTokens = 0;  // its report's, less what this router saw prefilled since
  int running = 0;
  int waiting = 0;
  int64_t freeBlocks = 0;
  int64_t totalBlocks = 0;
  int64_t maxPromptTokens = 0;  // the longest prompt it can ever run (0: not known)
  int64_t cachedTokens = 0;     // of the prompt being routed (filled in per request)
  // Where cachedTokens came from: the exact index's figure when the worker's is current (else
  // -1), and the predicted index's, which it falls back to (docs/kv_events.md).
  int64_t exactCachedTokens = -1;
  int64_t predictedCachedTokens = 0;
  double prefillTokensPerS = 0;  // measured by the worker (0: not known yet)
  double decodeStepMs = 0;       // its decode steps' forward time (0: not known yet)
  // Its decode step time against batch size (perStreamMs < 0: not known yet), and what a
  // minimum prompt chunk adds to a step (engine/step_cost_model.h).
  double decodeStepBaseMs = 0;
  double decodeStepPerStreamMs = -1;
  double decodeSmallChunkMs = 0;
  // The step time predicted with `streams` streams (nullopt: no fitted line yet).
  std::optional<double> predictedDecodeStepMs(int streams) const {
    if (decodeStepPerStreamMs < 0) return std::nullopt;
    return decodeStepBaseMs + decodeStepPerStreamMs * streams;
  }
  // Streams it serves or will: the larger of its report's and this router's count.
  int streams() const { return std::max(running + waiting, routedStreams); }
  // Prompt tokens it will prefill before a new one, the same way.
  int64_t prefillTokensAhead() const { return std::max(queuedPrefillTokens, routedPrefillTokens); }
  // This router's own outstanding work on it (WorkerRegistry::noteRouted): prompt tokens
  // routed to it to prefill that have no first token yet, and streams routed to it that
  // have not ended. Its reports cover every router's requests but lag; these are exact
  // for this router's and current.
  int64_t routedPrefillTokens = 0;
  int routedStreams = 0;
  // Peer pulls (router/pull_cost.h): it serves and takes pulls at `host` (its pull port's),
  // its KV bytes per token and measured lanes, and of the prompt being routed, of
  // exactCachedTokens' run, the tokens only its disk tier holds (a pull reads them from disk
  // first).
  bool servesPulls = false;
  std::string host;
  int64_t kvBytesPerToken = 0;
  std::vector<LaneCost> lanes;
  int64_t diskCachedTokens = 0;
};

// The longest prompt some healthy decode worker can ever run, from their reports' KV cache
// limits (WorkerView::maxPromptTokens); nullopt when there is none or one's is not known (the
// workers refuse what cannot fit themselves). A longer prompt can never succeed: the router
// refuses it with a 400, not a retryable 429 (docs/serving.md, "Limits").
std::optional<int64_t> longestServablePrompt(const std::vector<WorkerView>& workers);

enum class Route { kColocated, kDisaggregated };
inline constexpr EnumNames<Route, 2> kRouteNames{
    {{Route::kColocated, "colocated"}, {Route::kDisaggregated, "disaggregated"}}};
inline const char* routeName(Route route) { return enumName(kRouteNames, route); }

struct RoutePlan {
  Route route = Route::kColocated;
  std::string decodeWorker;
  std::string prefillWorker;  // empty when colocated
  // "short_prompt", "cached_prefix", "long_prompt", "no_prefill_worker", "protect_itl",
  // "prefill_overflow", "pull" (colocated, its prefix pulled from pullSource), "prefill_pull"
  // (disaggregated, the prefill worker pulls its prefix from pullSource, the decode worker)
  std::string reason;
  // A peer pull of the prompt's first pullTokens tokens (from its start, the blocks the target
  // holds included) from worker pullSource (router/pull_cost.h); empty: none. Colocated: the
  // decode worker pulls. Disaggregated: the prefill worker pulls, and pullSource is the
  // decode worker (planPrefillPull).
  std::string pullSource;
  int64_t pullTokens = 0;
  std::string pullWhy;       // the cost comparison, for the log
  int64_t cachedTokens = 0;  // of the prompt, on the worker that will prefill it
  // That worker's WorkerView figures (the router compares them with its actual hit).
  int64_t exactCachedTokens = -1;
  int64_t predictedCachedTokens = 0;
};

struct RoutingConfig {
  int64_t shortPromptTokens = 256;
  int cacheLoadSlack = 4;
  double itlTargetMs = 0;  // 0: no "protect_itl" rule
};

// A disaggregated plan's prefill-side pull (docs/kv_cache.md, "Peer pulls"): when a decode
// worker's KV region holds more of the prompt than the plan's prefill worker does, and pulling
// that prefix into the prefill worker is predicted cheaper than computing it there
// (router/pull_cost.h choosePull, at the prefill worker's measured rate, `fallbackRate` while
// it has none), the plan names that decode worker as pullSource AND as its decode worker: the
// prefill worker pulls over the connection the decode worker keeps to it (the kvtransfer peers
// both already have), so a source is always the request's own decode worker. The reason
// becomes "prefill_pull" and cachedTokens the pulled prefix. Returns false, the plan
// unchanged, otherwise (not disaggregated, no candidate, or recomputing is cheaper); `why`,
// when given, says why. Pure.
bool planPrefillPull(RoutePlan& plan, const std::vector<WorkerView>& views,
                     const std::vector<PullCandidate>& candidates, double fallbackRate, std::string* why = nullptr);

class RoutingPolicy {
 public:
  explicit RoutingPolicy(RoutingConfig config) : config_(config) {}

  // nullopt when no healthy decode worker exists.
  std::optional<RoutePlan> select(int64_t promptTokens, const std::vector<WorkerView>& workers) const;

  // Whether `w` can prefill a prompt beside its streams within the ITL target: no streams, no
  // target, no fitted step line yet, or its step with one more stream plus what its smallest
  // prompt chunk adds, times the ITL prediction scale, within itlTargetMs (the "protect_itl" rule).
  bool fitsBesideStreams(const WorkerView& w) const;
  // The plan that prefills the prompt on decode worker `w` itself, for `reason`.
  static RoutePlan colocatedOn(const WorkerView& w, std::string reason);

  const RoutingConfig& config() const { return config_; }
  // The adaptive threshold (router/adaptive_threshold.h) moves it; the caller serialises.
  void setShortPromptTokens(int64_t tokens) { config_.shortPromptTokens = tokens; }
  // What "protect_itl" multiplies its predicted step by (router/admission.h, PercentileScale).
  void setItlPredictionScale(double scale) { itlScale_ = scale; }

 private:
  RoutingConfig config_;
  double itlScale_ = 1;
};

}  // namespace pd::router
