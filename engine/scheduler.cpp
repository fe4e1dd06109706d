#include "engine/scheduler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <unordered_map>

namespace pd::engine {
namespace {

std::string seqName(SeqId seq) { return "sequence " + std::to_string(seq); }

// The plan's private picture of the pool: free blocks and reference-count changes that
// applying the plan will cause, so decisions later in the step see earlier ones.
class PoolSim {
 public:
  explicit PoolSim(const KvCacheManager& kv) : kv_(kv), free_(kv.numFreeBlocks()) {}

  int free() const { return free_; }
  void take(int n) { free_ -= n; }
  int ref(BlockId b) const {
    auto it = delta_.find(b);
    return kv_.refCount(b) + (it == delta_.end() ? 0 : it->second);
  }
  // free(seq): blocks nobody else holds come back.
  void release(SeqId seq) {
    for (BlockId b : kv_.blockTable(seq)) {
      if (--delta_[b] + kv_.refCount(b) == 0) ++free_;
    }
  }
  // Attaching cached blocks: those that sit in the pool leave it.
  int attachCost(const std::vector<BlockId>& blocks) const {
    int cost = 0;
    for (BlockId b : blocks) cost += ref(b) == 0 ? 1 : 0;
    return cost;
  }
  void attach(const std::vector<BlockId>& blocks) {
    for (BlockId b : blocks) {
      if (ref(b) == 0) --free_;
      ++delta_[b];
    }
  }

 private:
  const KvCacheManager& kv_;
  int free_;
  std::unordered_map<BlockId, int> delta_;
};

}  // namespace

Status SchedulerConfig::validate() const {
  if (maxBatchTokens < 1) {
    return invalidArgument("scheduler: max_batch_tokens " + std::to_string(maxBatchTokens) + " must be at least 1");
  }
  if (maxNumSeqs < 1 || maxNumSeqs > maxBatchTokens) {
    return invalidArgument("scheduler: max_num_seqs " + std::to_string(maxNumSeqs) +
                           " must be in [1, max_batch_tokens = " + std::to_string(maxBatchTokens) +
                           "] so every running sequence can decode in one step");
  }
  if (!(admissionWatermark >= 0.0 && admissionWatermark < 1.0)) {
    return invalidArgument("scheduler: admission_watermark " + std::to_string(admissionWatermark) +
                           " must be in [0, 1)");
  }
  return Status::ok();
}

SeqView seqViewOf(const Request& request, Deadline deadline) {
  SeqView v;
  v.id = request.id();
  v.numTokens = request.numTokens();
  v.numPromptTokens = request.numPromptTokens();
  v.numComputed = request.numComputed();
  v.tokens = request.tokens();
  v.deadline = deadline;
  return v;
}

double promptChunkCost(int start, int count, double span) {
  if (count <= 0) return 0;
  if (span <= 0) return count;
  // Token i (0-based) of the chunk attends to start + i + 1 positions.
  const double keys = double(count) * start + double(count) * (count + 1) / 2;
  return count + keys / span;
}

int promptTokensWithin(int start, double budget, double span) {
  if (budget < 1) return 0;
  if (span <= 0) return int(std::min<double>(budget, std::numeric_limits<int>::max()));
  // cost(n) = n (1 + (start + 1/2) / span) + n^2 / (2 span): the positive root, then the
  // integer steps that rounding may have missed.
  const double b = 1 + (start + 0.5) / span;
  double n = std::floor(span * (std::sqrt(b * b + 2 * budget / span) - b));
  n = std::clamp(n, 0.0, double(std::numeric_limits<int>::max() - 1));
  int k = int(n);
  while (k > 0 && promptChunkCost(start, k, span) > budget) --k;
  while (promptChunkCost(start, k + 1, span) <= budget) ++k;
  return k;
}

StepPlan Scheduler::schedule(const SchedulerView& view) const {
  StepPlan plan;
  const KvCacheManager& kv = *view.kv;
  const int bs = kv.blockSize();
  const int totalBlocks = kv.numTotalBlocks();
  PoolSim pool(kv);
  int budget = config_.maxBatchTokens;

  const size_t numRunning = view.running.size();
  std::vector<uint8_t> scheduled(numRunning, 0), gone(numRunning, 0);
  auto tooBig = [&](const SeqView& s, int tokens) -> bool {
    if (kv.blocksFor(tokens) <= totalBlocks) return false;
    plan.rejected.push_back(
        {s.id, resourceExhausted(seqName(s.id) + ": " + std::to_string(tokens) + " tokens need " +
                                 std::to_string(kv.blocksFor(tokens)) + " KV blocks, more than the " +
                                 std::to_string(totalBlocks) + " the cache has")});
    return true;
  };
  // Preempts the newest running sequence not yet scheduled this step; returns its index.
  auto preemptNewest = [&]() -> size_t {
    for (size_t j = numRunning; j-- > 0;) {
      if (scheduled[j] || gone[j]) continue;
      gone[j] = 1;
      pool.release(view.running[j].id);
      plan.preempted.push_back(view.running[j].id);
      return j;
    }
    return numRunning;  // unreachable while the caller itself is a candidate
  };
  // A decode step computes exactly the one newest token of a sequence past its prompt; a
  // recomputed (preempted) sequence prefills its generated tokens in chunks like a prompt.
  auto isDecode = [](const SeqView& s) {
    return s.numComputed >= s.numPromptTokens && s.numTokens - s.numComputed == 1;
  };

  // A running sequence with nothing to compute (its KV is being sent, say) is left alone:
  // it is neither scheduled nor a preemption victim.
  for (size_t i = 0; i < numRunning; ++i) {
    if (view.running[i].numTokens <= view.running[i].numComputed) scheduled[i] = 1;
  }

  // 1. Decode first: one step for every running sequence past its prompt.
  for (size_t i = 0; i < numRunning; ++i) {
    const SeqView& s = view.running[i];
    if (gone[i] || scheduled[i] || !isDecode(s)) continue;
    const int count = std::min(s.numTokens - s.numComputed, budget);
    if (count <= 0) continue;
    if (tooBig(s, s.numComputed + count)) {
      gone[i] = 1;
      pool.release(s.id);
      continue;
    }
    const int need = kv.blocksNeeded(s.id, s.numComputed + count);
    while (need > pool.free() && !gone[i]) preemptNewest();
    if (gone[i]) continue;
    pool.take(need);
    budget -= count;
    scheduled[i] = 1;
    plan.entries.push_back({s.id, s.numComputed, count, true, true});
    plan.numDecodeTokens += count;
  }

  // Streams are waiting on this step: its prompt work is what the ITL target leaves, each
  // chunk priced by its attention context.
  const bool priced = plan.numDecodeTokens > 0 && view.prefillTokenBudget >= 0;
  double promptBudget = priced ? view.prefillTokenBudget : 0;
  auto affordable = [&](int start, int want) {
    if (!priced) return want;
    const int n = std::min(want, promptTokensWithin(start, promptBudget, view.attentionSpan));
    return plan.numPrefillTokens == 0 ? std::max(n, std::min(want, view.prefillTokenFloor)) : n;
  };
  auto charge = [&](int start, int count) {
    budget -= count;
    if (priced) promptBudget -= promptChunkCost(start, count, view.attentionSpan);
  };

  // 2. Running prefills continue, oldest first, each as far as budget and blocks allow.
  for (size_t i = 0; i < numRunning && budget > 0; ++i) {
    const SeqView& s = view.running[i];
    if (gone[i] || scheduled[i] || isDecode(s)) continue;
    const int remaining = s.numTokens - s.numComputed;
    if (remaining <= 0) continue;
    if (tooBig(s, s.numTokens)) {
      gone[i] = 1;
      pool.release(s.id);
      continue;
    }
    const int held = int(kv.blockTable(s.id).size());
    auto fit = [&] { return (held + pool.free()) * bs - s.numComputed; };
    // Not even one token fits: make room from newer sequences (or step back itself).
    while (fit() <= 0 && !gone[i]) preemptNewest();
    if (gone[i]) continue;
    const int count = affordable(s.numComputed, std::min({remaining, budget, fit()}));
    if (count <= 0) continue;
    pool.take(kv.blocksNeeded(s.id, s.numComputed + count));
    charge(s.numComputed, count);
    scheduled[i] = 1;
    plan.entries.push_back({s.id, s.numComputed, count, s.numComputed + count == s.numTokens, false});
    plan.numPrefillTokens += count;
  }

  // 3. Admission in queue order.
  int runningSeqs = view.numExternalSeqs;
  for (size_t i = 0; i < numRunning; ++i) runningSeqs += gone[i] ? 0 : 1;
  const int watermark = watermarkBlocks(totalBlocks);
  bool blocked = false;
  for (const SeqView& w : view.waiting) {
    if (w.deadline.isSet() && view.now >= w.deadline.at()) {
      plan.rejected.push_back({w.id, deadlineExceeded(seqName(w.id) + ": still queued at its deadline")});
      continue;
    }
    if (!canEverAdmit(kv, w.numTokens)) {
      // A prompt that can never fit is the request's fault (a 400; Engine::checkFits refuses
      // it before it queues); a sequence that grew while generating ran out of cache.
      const std::string why = seqName(w.id) + ": " + std::to_string(w.numTokens) +
                              " tokens can never be admitted to a cache of " + std::to_string(totalBlocks) +
                              " blocks of " + std::to_string(bs) + " tokens, " + std::to_string(watermark) +
                              " of them kept free (at most " + std::to_string(maxPromptTokens(kv)) + " prompt tokens)";
      plan.rejected.push_back({w.id, w.numTokens <= w.numPromptTokens ? invalidArgument(why) : resourceExhausted(why)});
      continue;
    }
    if (blocked || budget <= 0 || runningSeqs >= config_.maxNumSeqs) {
      blocked = true;  // keep scanning only for rejections: FCFS admission stops here
      continue;
    }
    PrefixMatch match;
    if (config_.enablePrefixCaching && !w.tokens.empty()) {
      match = kv.findCachedPrefix(w.tokens, std::min<int>(w.numTokens, int(w.tokens.size())) - 1);
    }
    const int start = match.numTokens;
    const int count = affordable(start, std::min(w.numTokens - start, budget));
    if (count <= 0) {
      blocked = true;
      continue;
    }
    const int attachCost = pool.attachCost(match.blocks);
    const int fresh = std::max(0, kv.blocksFor(start + count) - int(match.blocks.size()));
    if (attachCost + fresh > pool.free() - watermark) {
      blocked = true;
      continue;
    }
    pool.attach(match.blocks);  // takes the cached blocks that sit in the pool
    pool.take(fresh);
    charge(start, count);
    ++runningSeqs;
    plan.admitted.push_back({w.id, start, w.tokens});
    plan.entries.push_back({w.id, start, count, start + count == w.numTokens, false});
    plan.numPrefillTokens += count;
  }
  return plan;
}

int Scheduler::watermarkBlocks(int totalBlocks) const {
  return int(std::ceil(config_.admissionWatermark * totalBlocks));
}

bool Scheduler::canEverAdmit(const KvCacheManager& kv, int numTokens) const {
  const int total = kv.numTotalBlocks();
  return kv.blocksFor(numTokens) <= total &&
         kv.blocksFor(std::min(numTokens, config_.maxBatchTokens)) <= total - watermarkBlocks(total);
}

int Scheduler::maxPromptTokens(const KvCacheManager& kv) const {
  const int total = kv.numTotalBlocks();
  int tokens = total * kv.blockSize() - 1;  // room for the first generated token's KV
  // The first chunk must fit the cache less the watermark: binding when a chunk may be that big.
  const int admissible = (total - watermarkBlocks(total)) * kv.blockSize();
  if (config_.maxBatchTokens > admissible) tokens = std::min(tokens, admissible);
  return std::max(0, tokens);
}

Status applyPlanToKv(const StepPlan& plan, KvCacheManager& kv) {
  for (SeqId seq : plan.preempted) PD_RETURN_IF_ERROR(kv.free(seq));
  for (const Rejection& r : plan.rejected) {
    if (kv.hasSequence(r.seq)) PD_RETURN_IF_ERROR(kv.free(r.seq));
  }
  // Attach every cached prefix before any fresh allocation, so no allocation evicts a
  // cached block that an admission in this plan counted on.
  for (const Admission& a : plan.admitted) {
    Result<int> got = kv.attachCachedPrefix(a.seq, a.tokens, a.cachedTokens);
    if (!got.ok()) return got.status().withContext("applying step plan");
    if (*got != a.cachedTokens) {
      return internalError("applying step plan: " + seqName(a.seq) + " planned " + std::to_string(a.cachedTokens) +
                           " cached tokens, found " + std::to_string(*got) + " (the cache changed since scheduling)");
    }
  }
  for (const PlanEntry& e : plan.entries) {
    Status st = kv.extend(e.seq, e.start + e.count);
    if (!st.isOk()) {
      return internalError("applying step plan: " + st.message() + " (the cache changed since scheduling)");
    }
  }
  return Status::ok();
}

}  // namespace pd::engine
