// engine::Scheduler (docs/design.md §3, §4): the batching policy of one worker.
//
// schedule() is a pure function of a read-only view (the running and waiting sequences,
// the KV cache manager, the time) and the config: it returns a StepPlan and changes
// nothing. No I/O and no clock of its own, so the same code runs in the worker loop and in
// `pdserve plan`'s simulator. The policy:
//   - continuous batching: sequences join and leave the batch at every step;
//   - decode first: every running sequence whose prompt is computed gets its next token
//     before any prefill chunk is considered;
//   - chunked prefill under a per-step token budget (max_batch_tokens): running prefills
//     continue (oldest first), then waiting sequences are admitted in queue order; in a step
//     that carries decode rows the prefill chunks also stay within the view's
//     prefillTokenBudget (the engine sizes it to the ITL target: SLO-sized chunks), priced by
//     each token's attention context, so a long colocated prompt does not stretch the
//     streams' step;
//   - admission only when the KV manager has blocks for the sequence's next chunk (after
//     any cached prefix it can share) plus a small watermark kept for decode growth; the
//     queue head blocks those behind it, so a large request is never starved by small ones;
//   - when a running sequence cannot get a block, the newest running sequence not yet
//     scheduled in this step (possibly itself) is preempted: its blocks are freed and it is
//     requeued to be recomputed. The oldest running sequence therefore always progresses;
//   - at most max_num_seqs running sequences;
//   - sequences that can never fit and waiting sequences past their deadline are rejected
//     with a Status saying why: running, when they need more blocks than the whole cache;
//     waiting, when admission can never give them their first chunk (canEverAdmit). A queue
//     head that merely waits for blocks others hold leaves the plan empty: the caller waits
//     for a change (a request ending, one arriving) rather than planning again at once.
//
// The worker loop applies a plan with applyPlanToKv() (which orders the KV operations so
// that the plan's block accounting holds exactly), runs the entries through the backend,
// and moves requests between states (preempted -> queued at the queue front, admitted ->
// prefilling, rejected -> failed).
//
// Threads: Scheduler is immutable after construction; schedule() may be called from any
// thread that may read the view (in practice the worker loop thread).
#pragma once

#include <span>
#include <vector>

#include "common/base/clock.h"
#include "common/base/status.h"
#include "engine/kv_cache_manager.h"
#include "engine/request.h"

namespace pd::engine {

struct SchedulerConfig {
  int maxBatchTokens = 2048;  // tokens per forward step (decode tokens + prefill chunks)
  int maxNumSeqs = 64;        // running sequences at most
  bool enablePrefixCaching = true;
  // Fraction of all blocks that admission leaves free, so running decodes can grow
  // without immediately preempting the newcomer.
  double admissionWatermark = 0.01;

  // Names the field and the allowed values on error.
  Status validate() const;
};

// What the scheduler needs to know of one sequence.
struct SeqView {
  SeqId id = 0;
  int numTokens = 0;  // prompt + generated tokens
  int numPromptTokens = 0;
  int numComputed = 0;              // tokens whose KV is in the cache (0 while waiting)
  std::span<const TokenId> tokens;  // for prefix-cache lookups; may be empty
  Deadline deadline;                // waiting sequences give up at this time (unset: never)
};

// Builds the view of a request (tokens point into the request: keep it alive and unchanged
// until the plan has been applied).
SeqView seqViewOf(const Request& request, Deadline deadline = {});

struct SchedulerView {
  // Sequences holding KV, oldest admission first. One with nothing left to compute
  // (numComputed == numTokens) is neither scheduled nor preempted.
  std::span<const SeqView> running;
  std::span<const SeqView> waiting;  // queue order: preempted sequences first, then FCFS
  const KvCacheManager* kv = nullptr;
  // Sequences holding KV outside both lists (e.g. receiving KV from a prefill worker);
  // they count against max_num_seqs.
  int numExternalSeqs = 0;
  SteadyTime now{};
  // Prompt work a step that has decode rows may also do (chunks of prefills and admissions
  // together), in tokens at position 0: with attentionSpan > 0 a token at position p counts
  // 1 + p / attentionSpan of it (promptChunkCost), so a chunk deep in a long prompt gets
  // fewer tokens. < 0: no limit but max_batch_tokens. Steps without decode rows ignore it
  // (nothing waits on them). The step's first prompt chunk gets at least
  // prefillTokenFloor tokens whatever their price, so a deep prompt still progresses.
  int prefillTokenBudget = -1;
  double attentionSpan = 0;  // ModelConfig::attentionSpanTokens(); 0: every token costs 1
  int prefillTokenFloor = 1;
};

// What `count` prompt tokens from position `start` cost, in tokens at position 0, when a
// token's attention over `span` positions costs as much as the rest of it (span 0: count).
double promptChunkCost(int start, int count, double span);
// The most prompt tokens from position `start` whose promptChunkCost is within `budget`.
int promptTokensWithin(int start, double budget, double span);

// One sequence's share of a step: compute tokens [start, start + count); wantLogits when
// the last of them is the sequence's last token (a token is sampled from its logits).
struct PlanEntry {
  SeqId seq = 0;
  int start = 0;
  int count = 0;
  bool wantLogits = false;
  bool isDecode = false;
};

struct Admission {
  SeqId seq = 0;
  int cachedTokens = 0;             // leading tokens shared from the prefix cache
  std::span<const TokenId> tokens;  // from the view, for attaching the cached prefix
};

struct Rejection {
  SeqId seq = 0;
  Status reason;
};

struct StepPlan {
  std::vector<PlanEntry> entries;   // decode entries first, then prefill chunks
  std::vector<Admission> admitted;  // waiting -> running this step (also in entries)
  std::vector<SeqId> preempted;     // running -> waiting; their KV is freed
  std::vector<Rejection> rejected;  // to fail; any KV they hold is freed
  int numDecodeTokens = 0;
  int numPrefillTokens = 0;

  int numTokens() const { return numDecodeTokens + numPrefillTokens; }
  bool empty() const { return entries.empty(); }
};

class Scheduler {
 public:
  // The config must have passed validate().
  explicit Scheduler(SchedulerConfig config) : config_(config) {}
  const SchedulerConfig& config() const { return config_; }

  StepPlan schedule(const SchedulerView& view) const;

  // Whether a waiting sequence of `numTokens` tokens can ever be admitted to the cache `kv`
  // with nothing else in it: all its tokens fit the cache, and its first chunk (up to
  // max_batch_tokens) fits the cache less the admission watermark.
  bool canEverAdmit(const KvCacheManager& kv, int numTokens) const;
  // The longest prompt that can ever run on `kv`: canEverAdmit holds for it, and its KV and
  // that of its first generated token fit the cache (docs/serving.md, "Limits").
  int maxPromptTokens(const KvCacheManager& kv) const;

 private:
  int watermarkBlocks(int totalBlocks) const;
  SchedulerConfig config_;
};

// Applies the KV side of a plan made from this manager's current state: frees preempted
// and rejected sequences, attaches the admitted sequences' cached prefixes, then extends
// every entry's sequence to start + count tokens. In this order every allocation the plan
// counted on succeeds; a failure means the manager changed since schedule() and is
// returned as kInternal (the plan must then be dropped).
Status applyPlanToKv(const StepPlan& plan, KvCacheManager& kv);

}  // namespace pd::engine
