#include "engine/scheduler.h"

#include <algorithm>
#include <deque>
#include <map>
#include <random>

#include <catch2/catch.hpp>

using namespace pd;
using namespace pd::engine;
using namespace std::chrono_literals;

namespace {

#define REQUIRE_OK(expr)      \
  do {                        \
    ::pd::Status s_ = (expr); \
    INFO(s_.toString());      \
    REQUIRE(s_.isOk());       \
  } while (0)

struct SimSeq {
  SeqId id = 0;
  std::vector<TokenId> tokens;
  int numPrompt = 0;
  int numComputed = 0;
  int maxNew = 1;
  int generated = 0;
  Deadline deadline;
  int admittedStep = -1;
  int finishedStep = -1;
  int preemptions = 0;
  bool rejected = false;
  Status rejection;
};

// A worker loop in miniature: builds the view, schedules, applies the plan to the KV cache,
// "runs" it (a token appears for every entry that wants logits) and checks the policy's
// promises on every step.
class Sim {
 public:
  Sim(int numBlocks, int blockSize, SchedulerConfig cfg) : sched_(cfg), cfg_(cfg) {
    KvLayout l;
    l.numLayers = 1;
    l.numBlocks = numBlocks;
    l.blockSize = blockSize;
    l.numKvHeads = 1;
    l.headDim = 4;
    auto kv = KvCacheManager::create(l, KvCacheManager::Backing::kAccountingOnly);
    REQUIRE(kv.ok());
    kv_ = std::move(kv).value();
    REQUIRE_OK(cfg.validate());
  }

  SimSeq& add(std::vector<TokenId> prompt, int maxNew, Deadline deadline = {}) {
    SimSeq& s = seqs_[next_];
    s.id = next_++;
    s.numPrompt = int(prompt.size());
    s.tokens = std::move(prompt);
    s.maxNew = maxNew;
    s.deadline = deadline;
    waiting_.push_back(s.id);
    return s;
  }
  SimSeq& add(int promptLen, int maxNew) {
    std::vector<TokenId> p;
    for (int i = 0; i < promptLen; ++i) p.push_back(TokenId((next_ * 7919 + uint64_t(i)) % 1000));
    return add(std::move(p), maxNew);
  }

  StepPlan step(int prefillTokenBudget = -1, double attentionSpan = 0, int prefillTokenFloor = 1) {
    std::vector<SeqView> run, wait;
    for (SeqId id : running_) run.push_back(view(seqs_[id]));
    for (SeqId id : waiting_) wait.push_back(view(seqs_[id]));
    SchedulerView v;
    v.running = run;
    v.waiting = wait;
    v.kv = kv_.get();
    v.now = clock_.now();
    v.prefillTokenBudget = prefillTokenBudget;
    v.attentionSpan = attentionSpan;
    v.prefillTokenFloor = prefillTokenFloor;
    StepPlan plan = sched_.schedule(v);
    checkPlan(plan);
    REQUIRE_OK(applyPlanToKv(plan, *kv_));
    REQUIRE_OK(kv_->checkInvariants());

    for (const Rejection& r : plan.rejected) {
      SimSeq& s = seqs_[r.seq];
      s.rejected = true;
      s.rejection = r.reason;
      erase(running_, r.seq);
      erase(waiting_, r.seq);
    }
    for (SeqId p : plan.preempted) {  // newest first: the oldest ends up at the front
      erase(running_, p);
      waiting_.push_front(p);
      seqs_[p].numComputed = 0;
      ++seqs_[p].preemptions;
    }
    for (const Admission& a : plan.admitted) {
      erase(waiting_, a.seq);
      running_.push_back(a.seq);
      seqs_[a.seq].numComputed = a.cachedTokens;
      if (seqs_[a.seq].admittedStep < 0) seqs_[a.seq].admittedStep = stepNo_;
    }
    for (const PlanEntry& e : plan.entries) {
      SimSeq& s = seqs_[e.seq];
      REQUIRE(e.start == s.numComputed);
      REQUIRE(kv_->numTokens(s.id) >= e.start + e.count);
      s.numComputed += e.count;
      if (e.wantLogits) {
        REQUIRE(s.numComputed == int(s.tokens.size()));
        s.tokens.push_back(TokenId((s.id * 31 + s.tokens.size()) % 1000));
        if (++s.generated == s.maxNew) {
          s.finishedStep = stepNo_;
          REQUIRE_OK(kv_->free(s.id));
          erase(running_, s.id);
        }
      }
    }
    for (SeqId id : running_) {
      REQUIRE_OK(kv_->cacheComputedBlocks(id, seqs_[id].tokens, seqs_[id].numComputed));
    }
    REQUIRE_OK(kv_->checkInvariants());
    ++stepNo_;
    clock_.advance(10ms);
    return plan;
  }

  bool idle() const { return running_.empty() && waiting_.empty(); }
  int runUntilIdle(int maxSteps) {
    int n = 0;
    while (!idle() && n < maxSteps) {
      step();
      ++n;
    }
    return n;
  }

  KvCacheManager& kv() { return *kv_; }
  SimSeq& seq(SeqId id) { return seqs_[id]; }
  const std::vector<SeqId>& running() const { return running_; }
  const std::deque<SeqId>& waiting() const { return waiting_; }
  ManualClock& clock() { return clock_; }
  int stepNo() const { return stepNo_; }

 private:
  static SeqView view(const SimSeq& s) {
    SeqView v;
    v.id = s.id;
    v.numTokens = int(s.tokens.size());
    v.numPromptTokens = s.numPrompt;
    v.numComputed = s.numComputed;
    v.tokens = s.tokens;
    v.deadline = s.deadline;
    return v;
  }
  template <typename C>
  static void erase(C& c, SeqId id) {
    c.erase(std::remove(c.begin(), c.end(), id), c.end());
  }
  void checkPlan(const StepPlan& plan) {
    int total = 0;
    bool sawPrefill = false;
    for (const PlanEntry& e : plan.entries) {
      REQUIRE(e.count > 0);
      total += e.count;
      if (e.isDecode) {
        REQUIRE_FALSE(sawPrefill);  // decode first
        REQUIRE(e.count == 1);
      } else {
        sawPrefill = true;
      }
    }
    REQUIRE(total == plan.numTokens());
    REQUIRE(total <= cfg_.maxBatchTokens);
    size_t stillRunning = running_.size() - plan.preempted.size() + plan.admitted.size();
    for (const Rejection& r : plan.rejected) {
      if (std::find(running_.begin(), running_.end(), r.seq) != running_.end()) --stillRunning;
    }
    REQUIRE(int(stillRunning) <= cfg_.maxNumSeqs);
  }

  std::unique_ptr<KvCacheManager> kv_;
  Scheduler sched_;
  SchedulerConfig cfg_;
  ManualClock clock_;
  std::map<SeqId, SimSeq> seqs_;
  std::vector<SeqId> running_;
  std::deque<SeqId> waiting_;
  SeqId next_ = 1;
  int stepNo_ = 0;
};

SchedulerConfig config(int budget, int maxSeqs, double watermark = 0.0) {
  SchedulerConfig c;
  c.maxBatchTokens = budget;
  c.maxNumSeqs = maxSeqs;
  c.admissionWatermark = watermark;
  return c;
}

}  // namespace

TEST_CASE("scheduler config is validated") {
  CHECK(config(16, 8).validate().isOk());
  CHECK(config(0, 1).validate().message().find("max_batch_tokens 0") != std::string::npos);
  CHECK(config(8, 16).validate().message().find("max_num_seqs 16 must be in [1, max_batch_tokens = 8]") !=
        std::string::npos);
  CHECK(config(8, 4, 1.5).validate().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("long prompts are prefilled in chunks under the token budget") {
  Sim sim(64, 16, config(32, 8));
  SimSeq& s = sim.add(100, 1);
  std::vector<int> chunks;
  std::vector<bool> logits;
  while (!sim.idle()) {
    StepPlan p = sim.step();
    REQUIRE(p.entries.size() == 1);
    chunks.push_back(p.entries[0].count);
    logits.push_back(p.entries[0].wantLogits);
  }
  CHECK(chunks == std::vector<int>{32, 32, 32, 4});
  CHECK(logits == std::vector<bool>{false, false, false, true});
  CHECK(s.generated == 1);
  CHECK(sim.kv().numFreeBlocks() == 64);
}

TEST_CASE("every running decode gets its token before any prefill chunk") {
  Sim sim(256, 16, config(8, 8));
  for (int i = 0; i < 3; ++i) sim.add(4, 50);
  sim.step();  // admits all three (12 prompt tokens > 8: third gets a partial chunk)
  sim.step();
  REQUIRE(sim.running().size() == 3);
  sim.add(100, 1);
  StepPlan p = sim.step();
  REQUIRE(p.entries.size() == 4);
  for (int i = 0; i < 3; ++i) {
    CHECK(p.entries[size_t(i)].isDecode);
    CHECK(p.entries[size_t(i)].count == 1);
  }
  CHECK_FALSE(p.entries[3].isDecode);
  CHECK(p.entries[3].count == 5);  // what the budget leaves
  CHECK(p.numDecodeTokens == 3);
  CHECK(p.numPrefillTokens == 5);
}

TEST_CASE("admission waits for blocks; a decode that cannot grow preempts the newest") {
  // 10 blocks of 4 tokens; two requests that each grow to 24 tokens (6 blocks).
  Sim sim(10, 4, config(64, 4));
  SimSeq& a = sim.add(8, 16);
  SimSeq& b = sim.add(8, 16);
  bool sawPreemption = false;
  for (int i = 0; i < 200 && !sim.idle(); ++i) {
    StepPlan p = sim.step();
    for (SeqId v : p.preempted) {
      sawPreemption = true;
      CHECK(v == b.id);  // the newest goes; the oldest keeps running
    }
  }
  CHECK(sim.idle());
  CHECK(sawPreemption);
  CHECK(a.preemptions == 0);
  CHECK(b.preemptions >= 1);
  CHECK(a.generated == 16);
  CHECK(b.generated == 16);
  CHECK(sim.kv().numFreeBlocks() == 10);
}

TEST_CASE("a waiting request is not admitted without blocks for its next chunk") {
  Sim sim(6, 4, config(64, 4));
  sim.add(20, 4);  // 5 blocks for the prompt, grows to 6
  sim.step();
  SimSeq& late = sim.add(8, 1);  // needs 2 blocks, 1 is free
  StepPlan p = sim.step();
  CHECK(p.admitted.empty());
  for (const PlanEntry& e : p.entries) CHECK(e.seq != late.id);
  CHECK(sim.runUntilIdle(50) < 50);
  CHECK(late.generated == 1);
}

// SLO-sized chunks (docs/serving.md): with streams decoding, prompt tokens stay within the
// prefill budget; with none, the whole max_batch_tokens goes to the prefill.
TEST_CASE("with decode rows in the step, prefill chunks and admissions keep to the prefill budget") {
  Sim sim(256, 16, config(64, 8));
  sim.add(4, 8);
  sim.step(/*prefillTokenBudget=*/10);  // no decode row yet: the budget does not apply
  REQUIRE(sim.running().size() == 1);
  SimSeq& longPrompt = sim.add(100, 1);
  StepPlan p = sim.step(10);
  REQUIRE(p.entries.size() == 2);
  CHECK(p.numDecodeTokens == 1);
  CHECK(p.numPrefillTokens == 10);
  sim.add(30, 1);  // waiting behind the long prompt
  for (int i = 0; i < 5; ++i) {
    p = sim.step(10);
    CHECK(p.numDecodeTokens == 1);
    CHECK(p.numPrefillTokens <= 10);  // the running prefill and the admission share it
  }
  CHECK(longPrompt.numComputed == 60);
  // The stream ends (8 tokens): what is left of the prompts goes at max_batch_tokens again.
  while (sim.seq(1).generated < 8) sim.step(10);
  p = sim.step(10);
  CHECK(p.numDecodeTokens == 0);
  CHECK(p.numPrefillTokens > 10);
  sim.runUntilIdle(100);
  CHECK(sim.kv().numFreeBlocks() == 256);
}

TEST_CASE("promptChunkCost prices each token by the positions it attends to") {
  CHECK(promptChunkCost(500, 10, 0) == 10);  // no span: tokens
  CHECK(promptChunkCost(0, 4, 10) == Approx(4 + (1 + 2 + 3 + 4) / 10.0));
  CHECK(promptChunkCost(100, 4, 10) == Approx(4 + (101 + 102 + 103 + 104) / 10.0));
  CHECK(promptChunkCost(7, 0, 10) == 0);
  for (int start : {0, 1, 15, 300, 4000}) {
    for (double budget : {0.5, 1.0, 7.0, 40.0, 1000.0}) {
      const int n = promptTokensWithin(start, budget, 50);
      CHECK(promptChunkCost(start, n, 50) <= budget);
      CHECK(promptChunkCost(start, n + 1, 50) > budget);
    }
  }
  CHECK(promptTokensWithin(0, 12.9, 0) == 12);
}

TEST_CASE("with decode rows, a chunk deep in a prompt gets fewer tokens of the budget, and at least the floor") {
  Sim sim(256, 16, config(512, 8));
  sim.add(4, 20);
  sim.step();  // the stream's prompt
  SimSeq& longPrompt = sim.add(400, 1);
  StepPlan p = sim.step(/*prefillTokenBudget=*/40, /*attentionSpan=*/100);
  CHECK(p.numPrefillTokens == promptTokensWithin(0, 40, 100));  // 33 at the start
  while (longPrompt.numComputed < 300) sim.step(300);           // no decode-free step: the stream goes on
  const int at = longPrompt.numComputed;
  p = sim.step(40, 100);
  CHECK(p.numPrefillTokens == promptTokensWithin(at, 40, 100));  // ~9 at 300+
  CHECK(p.numPrefillTokens < 12);
  // A budget that buys no token this deep still moves the prompt by the floor.
  p = sim.step(2, 100, /*prefillTokenFloor=*/5);
  CHECK(p.numPrefillTokens == 5);
}

TEST_CASE("a long request is not starved by a stream of short ones") {
  Sim sim(40, 4, config(16, 4));
  std::vector<SeqId> shorts;
  for (int i = 0; i < 3; ++i) shorts.push_back(sim.add(6, 20).id);
  sim.step();
  SimSeq& big = sim.add(120, 2);  // 30 blocks: must wait until the cache drains enough
  for (int i = 0; i < 400 && big.finishedStep < 0; ++i) {
    if (i % 2 == 0 && big.admittedStep < 0) shorts.push_back(sim.add(6, 20).id);
    sim.step();
  }
  CHECK(big.admittedStep >= 0);
  CHECK(big.finishedStep >= 0);
  // Short requests that arrived after it were not admitted before it.
  for (SeqId s : shorts) {
    if (s > big.id && sim.seq(s).admittedStep >= 0) CHECK(sim.seq(s).admittedStep >= big.admittedStep);
  }
  sim.runUntilIdle(2000);
  CHECK(sim.idle());
}

TEST_CASE("requests that can never fit or that outlive their deadline are rejected") {
  Sim sim(4, 4, config(64, 4));
  SimSeq& huge = sim.add(17, 1);  // 5 blocks > 4
  SimSeq& late = sim.add({1, 2, 3}, 1, Deadline(sim.clock().now() + 5ms));
  SimSeq& ok = sim.add(4, 1);
  sim.clock().advance(6ms);
  StepPlan p = sim.step();
  REQUIRE(p.rejected.size() == 2);
  CHECK(huge.rejected);
  // A prompt that can never fit is the request's fault: kInvalidArgument (a 400), naming the limit.
  CHECK(huge.rejection.code() == StatusCode::kInvalidArgument);
  CHECK(huge.rejection.message().find("17 tokens can never be admitted to a cache of 4 blocks of 4 tokens") !=
        std::string::npos);
  CHECK(late.rejected);
  CHECK(late.rejection.code() == StatusCode::kDeadlineExceeded);
  CHECK(p.admitted.size() == 1);
  CHECK(p.admitted[0].seq == ok.id);
  // A decode that would outgrow the whole cache is rejected rather than preempted forever.
  Sim grow(2, 4, config(64, 4));
  SimSeq& g = grow.add(6, 10);
  grow.runUntilIdle(20);
  CHECK(g.rejected);
  CHECK(g.generated == 3);  // 8 tokens fill both blocks; the 9th cannot exist
}

TEST_CASE("a prompt that fits the cache but never beside the admission watermark is rejected, not left waiting") {
  // 4 blocks of 16 tokens, 1 kept free by admission: a whole prompt in one chunk gets 3 blocks
  // at most, so 49-64 tokens would wait for ever (the decode worker spun on it).
  Sim sim(4, 16, config(2048, 4, 0.01));
  Scheduler sched(config(2048, 4, 0.01));
  CHECK(sched.maxPromptTokens(sim.kv()) == 48);
  SimSeq& never = sim.add(49, 1);
  SimSeq& fits = sim.add(48, 2);
  StepPlan p = sim.step();
  REQUIRE(p.rejected.size() == 1);
  CHECK(never.rejected);
  CHECK(never.rejection.code() == StatusCode::kInvalidArgument);
  CHECK(never.rejection.message().find("at most 48 prompt tokens") != std::string::npos);
  sim.runUntilIdle(10);
  CHECK_FALSE(fits.rejected);
  CHECK(fits.generated == 2);  // its second token's KV takes the 4th block: running, no watermark
  // Chunked, the first chunk is what admission must fit: then the cache less one token's room.
  Sim chunked(4, 16, config(16, 4, 0.01));
  CHECK(Scheduler(config(16, 4, 0.01)).maxPromptTokens(chunked.kv()) == 63);
  SimSeq& longest = chunked.add(63, 1);
  chunked.runUntilIdle(10);
  CHECK_FALSE(longest.rejected);
  CHECK(longest.generated == 1);
}

TEST_CASE("admission shares cached prefix blocks") {
  Sim sim(32, 4, config(64, 4));
  std::vector<TokenId> prompt;
  for (int i = 0; i < 18; ++i) prompt.push_back(100 + i);
  SimSeq& first = sim.add(prompt, 3);
  sim.runUntilIdle(10);
  REQUIRE(first.generated == 3);
  std::vector<TokenId> second = prompt;
  second.push_back(7);
  SimSeq& s = sim.add(second, 1);
  StepPlan p = sim.step();
  REQUIRE(p.admitted.size() == 1);
  CHECK(p.admitted[0].cachedTokens == 16);
  REQUIRE(p.entries.size() == 1);
  CHECK(p.entries[0].start == 16);
  CHECK(p.entries[0].count == 3);
  CHECK(s.generated == 1);
  CHECK(sim.kv().stats().prefixHitTokens >= 16);
}

TEST_CASE("random workloads: every plan applies, budgets hold, everything finishes") {
  for (uint32_t seed : {1u, 2u, 3u, 4u}) {
    std::mt19937 rng(seed);
    auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    const int blocks = pick(12, 40);
    Sim sim(blocks, 4, config(pick(8, 48), pick(1, 8), seed % 2 ? 0.05 : 0.0));
    std::vector<TokenId> stem;
    for (int i = 0; i < 12; ++i) stem.push_back(pick(0, 50));
    int added = 0;
    for (int stepI = 0; stepI < 3000 && (added < 60 || !sim.idle()); ++stepI) {
      if (added < 60 && pick(0, 2) == 0) {
        std::vector<TokenId> p = pick(0, 1) ? stem : std::vector<TokenId>{};
        const int len = pick(1, 30);
        p.resize(size_t(std::min<int>(len, int(p.size()))));
        while (int(p.size()) < len) p.push_back(pick(0, 50));
        sim.add(std::move(p), pick(1, 12));
        ++added;
      }
      sim.step();
    }
    INFO("seed " << seed);
    CHECK(sim.idle());
    CHECK(sim.kv().numFreeBlocks() == blocks);
    CHECK(sim.kv().numSequences() == 0);
  }
}

TEST_CASE("max_num_seqs counts running and external sequences") {
  SchedulerConfig cfg = config(64, 2);
  KvLayout l;
  l.numLayers = 1;
  l.numBlocks = 64;
  l.blockSize = 4;
  l.numKvHeads = 1;
  l.headDim = 4;
  auto kv = KvCacheManager::create(l, KvCacheManager::Backing::kAccountingOnly);
  REQUIRE(kv.ok());
  std::vector<SeqView> waiting(3);
  for (size_t i = 0; i < waiting.size(); ++i) {
    waiting[i].id = 10 + i;
    waiting[i].numTokens = waiting[i].numPromptTokens = 5;
  }
  Scheduler sched(cfg);
  SchedulerView v;
  v.waiting = waiting;
  v.kv = kv->get();
  CHECK(sched.schedule(v).admitted.size() == 2);
  v.numExternalSeqs = 1;  // e.g. one request receiving KV from a prefill worker
  StepPlan p = sched.schedule(v);
  REQUIRE(p.admitted.size() == 1);
  CHECK(p.admitted[0].seq == 10);
  // A running sequence with nothing to compute (its KV is being sent) is never preempted,
  // even when another needs its blocks.
  REQUIRE((*kv)->allocate(1, 4 * 63).isOk());
  REQUIRE((*kv)->allocate(2, 4).isOk());
  std::vector<SeqView> running(2);
  running[0].id = 1;
  running[0].numTokens = running[0].numComputed = running[0].numPromptTokens = 252;
  running[1].id = 2;
  running[1].numPromptTokens = 4;
  running[1].numComputed = 4;
  running[1].numTokens = 5;  // needs a second block: none free
  SchedulerView r;
  r.running = running;
  r.kv = kv->get();
  StepPlan q = sched.schedule(r);
  REQUIRE(q.preempted.size() == 1);
  CHECK(q.preempted[0] == 2);  // itself, not the idle sequence 1
  CHECK(q.entries.empty());
}
