// engine::Engine: the per-step core both workers run (docs/design.md §3, §4). It owns the
// requests, the KV cache manager, the scheduler and the backend, and turns one call of
// step() into: schedule -> apply the plan to the KV cache -> one forward over the
// flattened batch -> sample -> update request states. What happened comes back as events.
//
// Two ways in:
//   - submit(): a request prefilled here (colocated on a decode worker; every request on a
//     prefill worker);
//   - submitRemote() + completeRemote() (decode worker, disaggregated): blocks are reserved
//     for the whole prompt at once (no blocks, no admission), the prompt's KV is written
//     into them from outside, and completeRemote() hands over the first token, after which
//     the request decodes here like any other. recomputeRemote() falls back to a local
//     prefill when the remote one failed.
//
// KV of finished requests: with releaseKvOnFinish (decode workers) it is freed at once; a
// prefill worker turns it off and calls release() once its KV push is confirmed, so no
// block is reused while a transfer still reads it.
//
// Threads: not thread-safe; owned and called by one worker loop thread. The layer callback
// of step() runs on that thread during forward().
#pragma once

#include <array>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/base/clock.h"
#include "common/base/status.h"
#include "engine/backend.h"
#include "engine/kv_cache_manager.h"
#include "engine/request.h"
#include "engine/sampling.h"
#include "engine/scheduler.h"
#include "engine/step_cost_model.h"

namespace pd::engine {

class KvTierStore;  // engine/kv_tiers.h

struct EngineEvent {
  enum class Kind { kToken, kFinished, kFailed };
  Kind kind = Kind::kToken;
  uint64_t requestId = 0;
  SampledToken token;                         // kToken
  FinishReason reason = FinishReason::kNone;  // kFinished
  Status error;                               // kFailed
  RequestTimings timings;                     // kFinished, kFailed: the request's latencies
};

// SLO-sized chunked prefill (docs/serving.md): in a step that also decodes, the prompt work
// computed is capped so the step's period stays within its budget (below), never below
// minTokens (prefills always progress) nor above max_batch_tokens. The cap counts tokens at
// position 0: with priceAttention a token at position p counts 1 + p / the model's attention
// span (ModelConfig::attentionSpanTokens), so a cap taught at the start of prompts does
// not overrun deep in one (the small model: 335 tokens at positions 1,024-1,359 took 156 ms
// where 175 at the start of prompts took 49). The cap follows the measured steps: each step
// that decoded and prefilled scales it by aim / its period (what its streams waited:
// Engine::sizePrefillChunks; at most x1.25 or /2 a step: one quiet step among contended ones
// says little, one overrun says enough), so it settles on
// the largest chunk whose step meets the budget at the current batch and context, whatever
// fixed costs a prefill adds to a step (a per-token model misses those and shrinks the
// chunks it measures, and with them its own estimate). A cap taught beside n streams is
// used beside m less the prompt work that the decode cost line's m - n more streams take
// (a cap taught beside 1 stream ran 106 ms beside 4 and 5 in a code-mix run). It starts from the
// measured prefill rate and pure-decode step time, or from minTokens while either is
// unmeasured (a fresh worker, or a decode worker that has only received remote prefills).
//
// Two caps are taught, one for the steps taken while a remote prefill's KV is on its way
// to this engine and one for the others. While it is, a prefill worker computes that prompt,
// maybe on this host's cores (the CPU backend under `pdserve up`), and its KV lands in this
// engine's memory: mixed steps on this 2-core machine ran up to twice as long then, the same
// chunk at 62 ms and at 131 ms, and one cap chasing both overran each time the neighbour
// started (docs/serving.md "Overload"). Where the neighbour costs nothing, both caps
// learn the same chunk.
//
// The SLO is what the client sees, and a step's period does not see the hop from the worker
// to the router and on to the client: the hop gets kHopShare of the target (5 ms of 100 ms;
// on this 2-core machine the client's gaps were the periods plus 1-5 ms), the period the
// rest, its budget. And the SLO is a percentile, and steps vary, so the cap aims below the
// budget: at budget x aim, where aim (in [0.5, 1]) tracks the percentile: each mixed step
// whose period passes the budget lowers it by ~5% x q per stream it held up, each within it
// raises it by ~5% x (1 - q) per stream, which settles where (1 - q) of the streams' gaps in
// mixed steps overrun (a step beside 5 streams that overruns is 5 late tokens). q leaves the hop
// half the overruns the percentile allows: q = 1 - (1 - percentile) / 2, 99.5% for p99.
struct PrefillChunkOptions {
  static constexpr double kHopShare = 0.05;
  double periodBudgetMs() const { return itlTargetMs * (1 - kHopShare); }  // <= 0: off
  double itlTargetMs = 0;                                                  // 0: off (max_batch_tokens alone)
  double percentile = 99;                                                  // of the ITL target, (0, 100]
  int minTokens = 32;
  bool priceAttention = true;  // false: every prompt token costs 1 (unit tests of the cap)
};

struct EngineOptions {
  SchedulerConfig scheduler;
  bool releaseKvOnFinish = true;
  PrefillChunkOptions prefillChunks;
};

struct EngineLoad {
  int running = 0;                  // holding KV and computing (prefill or decode)
  int decoding = 0;                 // of those, past their prompt: streams that a long step stalls
  int waiting = 0;                  // queued for admission
  int remote = 0;                   // blocks reserved, waiting for a prefill worker's KV
  int64_t queuedPrefillTokens = 0;  // prompt tokens not yet computed
  int freeBlocks = 0;
  int totalBlocks = 0;
  int maxPromptTokens = 0;  // the longest prompt that can ever run here (Engine::checkFits)
  // Since the engine started:
  int64_t preemptions = 0;
  int64_t prefixQueryTokens = 0;  // prompt tokens of admitted requests
  int64_t prefixHitTokens = 0;    // of those, found in the prefix cache
  // Prompt tokens computed per second in steps that computed some (an exponential moving
  // average of tokens / step time; decode rows in the same step count against it, so it
  // errs low). 0 until the first such step. The router predicts queue waits from it.
  double prefillTokensPerS = 0;
  // Steps that carried decode rows: their forward time (ms), a moving average like the rate
  // above: what every stream's inter-token latency is now. The router refuses new streams
  // at a worker past its ITL target (router/admission.h). 0 until the first such step. With
  // SLO-sized chunks, only the steps without prompt tokens: the streams' own cost (the
  // chunks beside them are sized to the target).
  double decodeStepMs = 0;
  // The prompt tokens a step with decode rows may compute now (PrefillChunkOptions), or
  // max_batch_tokens when chunks are not SLO-sized or nothing is measured yet.
  int prefillChunkTokens = 0;
  // Decode step time against batch size (step_cost_model.h), once the steps taught it: the
  // router predicts one more stream's effect from it (router/admission.h). Its smallChunkMs
  // is 0 once no small chunk was computed beside streams for kSmallChunkTtl: the router then
  // sends a colocated prompt again (routing_policy.h, "protect_itl"), which measures anew,
  // so an old figure cannot keep prompts off a worker for good.
  std::optional<StepCostModel::Line> decodeStepCost;
  static constexpr std::chrono::seconds kSmallChunkTtl{10};
};

// The plan entries of the step being computed, with their block tables; valid only inside
// the layer callback.
struct StepView {
  std::span<const PlanEntry> entries;
  const KvCacheManager* kv = nullptr;
};
using StepLayerFn = std::function<void(int layer, const StepView& step)>;

// What one step() computed and how long its streams waited for it.
struct StepRecord {
  int decodeRows = 0;  // both 0: nothing ran
  int64_t promptTokens = 0;
  int promptChunks = 0;  // sequences whose prompt tokens the step computed
  // Tokens already in the KV cache before the step, summed over its decode rows and over its
  // prompt chunks: with the counts above, what a cost model needs to price the step
  // (plan::CostModel prices a step trace's rows from them).
  int64_t decodeContextTokens = 0;
  int64_t promptContextTokens = 0;
  double promptCost = 0;  // the prompt tokens priced by their context (PrefillChunkOptions)
  int promptBudget = -1;  // the prompt work it was allowed beside its streams (-1: any)
  // From step()'s start to its sampled tokens; 0 when the step failed or had nothing to run.
  double seconds = 0;
  // From the previous step's end to this one's start, when that step left work to do (the
  // caller's loop between steps); 0 otherwise. gapSeconds + seconds is the step's period.
  double gapSeconds = 0;
  // Whether a remote prefill's KV was on its way when the step was planned (which of the
  // two chunk caps it used and teaches: PrefillChunkOptions).
  bool remoteKvExpected = false;
};

class Engine {
 public:
  Engine(std::unique_ptr<Backend> backend, std::unique_ptr<KvCacheManager> kv, EngineOptions options,
         const Clock& clock = SystemClock::instance());
  ~Engine();

  // The tiers below the KV cache (engine/kv_tiers.h, docs/kv_cache.md), made over kv(). Each
  // step first promotes, for the requests at the head of the queue, the blocks a lower tier
  // holds past their cached prefix, so admission attaches them instead of computing them.
  void setKvTiers(std::unique_ptr<KvTierStore> tiers);
  KvTierStore* kvTiers() { return tiers_.get(); }
  // Takes the disk writer's results (their KV events); the worker loop calls it every
  // iteration, busy or idle.
  void pollKvTiers();

  // Queues a request for a local prefill. Errors: an id already present; checkFits's.
  Status submit(Request request);
  // kInvalidArgument, naming the limit, when the request's prompt can never run on this
  // engine's KV cache (longer than maxPromptTokens(): docs/serving.md, "Limits"), so it is
  // refused at once instead of waiting for blocks that can never be free.
  Status checkFits(const Request& request) const;
  int maxPromptTokens() const { return scheduler_.maxPromptTokens(*kv_); }

  // Reserves blocks for the request's whole prompt and parks it in waiting_kv; returns its
  // block table (to put in a KvTarget). kResourceExhausted when the blocks are not free,
  // checkFits's error when they never will be: nothing is kept then.
  Result<std::vector<BlockId>> submitRemote(Request request);
  // The prompt's KV is in place and `first` is the token the prefill worker sampled: the
  // request decodes from here. Events for the first token (and its finish) are appended.
  // kInvalidArgument, changing nothing, when `first` is not a token of the model.
  Status completeRemote(uint64_t id, const SampledToken& first, std::vector<EngineEvent>* events);
  // The remote prefill failed: free the reserved blocks and queue a local prefill (into
  // fresh blocks: after quarantineRemote() the request holds none).
  Status recomputeRemote(uint64_t id);
  // KV fencing: the remote prefill of `id` ended but its writer may still land bytes in the
  // reserved blocks. They move, untouched, to the KV sequence `holder` (kv().rename), which
  // keeps them out of the free pool until kv().free(holder); the request keeps waiting for
  // KV without blocks, so recomputeRemote() or cancel() follow as usual. `holder` must be
  // an id no request uses. Errors: kNotFound (not waiting for remote KV), kAlreadyExists.
  Status quarantineRemote(uint64_t id, SeqId holder);

  // Ends a request wherever it is and frees its KV; no event. Unknown ids are ignored
  // (the request may have finished a moment ago).
  void cancel(uint64_t id);
  // Frees the KV that a finished request kept (releaseKvOnFinish off).
  void release(uint64_t id);

  // One scheduling step and forward pass. Events of this step are appended; a backend
  // error fails the step's requests (reported as events) and is returned.
  Status step(std::vector<EngineEvent>* events, const StepLayerFn& onLayer = {});

  bool hasWork() const { return !running_.empty() || !waiting_.empty(); }
  // The last step(): its plan's shape whether or not the forward succeeded, and its times.
  const StepRecord& lastStep() const { return lastStep_; }
  bool contains(uint64_t id) const { return requests_.count(id) != 0; }
  const Request* find(uint64_t id) const;
  EngineLoad load() const;

  // Constrained decoding (common/constraint): the model's tokens as bytes, from which a
  // compile cache of `cacheCapacity` specs is made. Without it, a request with a constraint
  // is refused on submit (kFailedPrecondition, naming why).
  void setConstraintVocabulary(std::shared_ptr<const constraint::TokenVocabulary> vocab, size_t cacheCapacity = 32);
  constraint::ConstraintCache* constraintCache() { return constraints_.get(); }

  Backend& backend() { return *backend_; }
  KvCacheManager& kv() { return *kv_; }
  const KvCacheManager& kv() const { return *kv_; }
  const ModelConfig& modelConfig() const { return backend_->config(); }

 private:
  void finishRequest(uint64_t id, FinishReason reason, std::vector<EngineEvent>* events);
  void failRequest(uint64_t id, Status error, std::vector<EngineEvent>* events);
  void eraseRequest(uint64_t id, bool freeKv);
  // Samples from `logits` (or takes `given`), appends the token and finishes the request
  // when it must. Request-level problems become kFailed events, not errors.
  Status sampleInto(Request& r, const float* logits, std::vector<EngineEvent>* events,
                    std::optional<SampledToken> given = std::nullopt);
  int32_t eosTokenId() const;
  // Compiles (or finds) the request's constraint and hands it to the request.
  Status attachConstraint(Request& request);
  // Folds a forward pass of `seconds` over lastStep_ into the step averages of EngineLoad.
  void noteStep(double seconds);
  // SLO-sized chunks (PrefillChunkOptions): after a step that prefilled beside streams, moves
  // the aim and the chunk cap by the step's period, what its streams waited for the token:
  // from the previous step's end (when work was left; else this step's start) to now. The
  // period, not the forward alone: scheduling, sampling and the worker loop's work between
  // steps are in every gap (measured here: a few ms of a ~95 ms mixed step, which put ~1.6%
  // of the gaps past a 100 ms target while the forwards stayed within it).
  void sizePrefillChunks(double periodMs);
  // The scheduler's prefillTokenBudget (PrefillChunkOptions), with or without a remote
  // prefill's KV on its way (the two caps), beside `decodeRows` streams.
  int prefillChunkTokens(bool remoteKvExpected, int decodeRows) const;
  int decodingStreams() const;           // running requests past their prompt
  int clampChunk(int64_t tokens) const;  // into [minTokens, max_batch_tokens]
  void promoteFromLowerTiers();          // before scheduling: see setKvTiers
  double attentionSpan() const;          // SchedulerView::attentionSpan: 0 unless priceAttention

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<constraint::ConstraintCache> constraints_;
  std::unique_ptr<KvCacheManager> kv_;
  std::unique_ptr<KvTierStore> tiers_;  // after kv_: destroyed first, it detaches from it
  EngineOptions options_;
  Scheduler scheduler_;
  const Clock& clock_;

  std::unordered_map<uint64_t, Request> requests_;
  std::vector<uint64_t> running_;  // holding KV, oldest admission first
  std::deque<uint64_t> waiting_;   // queue order
  std::unordered_set<uint64_t> remote_;
  std::unordered_set<uint64_t> heldKv_;  // finished, KV kept until release()
  std::vector<float> logits_;
  int64_t preemptions_ = 0;
  int64_t prefixQueryTokens_ = 0;
  int64_t prefixHitTokens_ = 0;
  double prefillTokensPerS_ = 0;
  double decodeStepMs_ = 0;
  // SLO-sized chunks: the time of steps with decode rows and no prompt tokens (a moving
  // average; 0: not measured) and the caps the steps taught, [remote KV expected] (0: not
  // yet: the other cap, else the start estimate).
  double pureDecodeStepMs_ = 0;
  struct ChunkCap {
    int cost = 0;          // prompt work, tokens at position 0 (0: not taught)
    int decodeRows = 0;    // beside this many streams
    double costPerMs = 0;  // the prompt work's pace in the step that taught it
  };
  std::array<ChunkCap, 2> prefillChunkCaps_{};
  double prefillChunkAim_ = 1;  // PrefillChunkOptions: the fraction of the target aimed at
  StepCostModel decodeCost_;    // over the steps without prompt tokens (and small chunks)
  SteadyTime smallChunkSeenAt_{};
  StepRecord lastStep_;
  std::optional<SteadyTime> workSince_;  // the last step's end, when it left work to do
};

}  // namespace pd::engine
