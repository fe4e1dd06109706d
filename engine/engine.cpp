#include "engine/engine.h"

#include <algorithm>
#include <cmath>

#include "common/base/log.h"
#include "engine/kv_tiers.h"
#include "engine/logits_processors.h"

namespace pd::engine {

namespace {
std::string reqName(uint64_t id) { return "request " + std::to_string(id); }
}  // namespace

Engine::Engine(std::unique_ptr<Backend> backend, std::unique_ptr<KvCacheManager> kv, EngineOptions options,
               const Clock& clock)
    : backend_(std::move(backend)),
      kv_(std::move(kv)),
      options_(options),
      scheduler_(options.scheduler),
      clock_(clock) {}

Engine::~Engine() = default;

void Engine::setKvTiers(std::unique_ptr<KvTierStore> tiers) { tiers_ = std::move(tiers); }

void Engine::pollKvTiers() {
  if (tiers_) tiers_->poll();
}

void Engine::promoteFromLowerTiers() {
  if (!tiers_ || !options_.scheduler.enablePrefixCaching) return;
  tiers_->poll();
  // Bounded per step: the head of the queue is what admission takes next, and at most the
  // free blocks in all: a promoted block stays free (cached), so this step's promotions never
  // evict each other while uncached free blocks last.
  constexpr int kMaxRequests = 4;
  int budget = kv_->numFreeBlocks();
  int n = 0;
  for (uint64_t id : waiting_) {
    if (n++ >= kMaxRequests || budget <= 0) break;
    const Request& r = requests_.at(id);
    const std::vector<TokenId>& tokens = r.tokens();
    const int limit = int(tokens.size()) - 1;
    if (limit < kv_->blockSize()) continue;
    budget -= tiers_->promote(tokens, limit, budget);
  }
}

int32_t Engine::eosTokenId() const {
  const auto& eos = backend_->config().eosTokenIds;
  return eos.empty() ? -1 : eos.front();
}

const Request* Engine::find(uint64_t id) const {
  auto it = requests_.find(id);
  return it == requests_.end() ? nullptr : &it->second;
}

Status Engine::checkFits(const Request& request) const {
  const int limit = maxPromptTokens();
  if (request.numPromptTokens() <= limit) return Status::ok();
  return invalidArgument(reqName(request.id()) + ": its prompt of " + std::to_string(request.numPromptTokens()) +
                         " tokens can never run on this worker: its KV cache (" +
                         std::to_string(kv_->numTotalBlocks()) + " blocks of " + std::to_string(kv_->blockSize()) +
                         " tokens: engine.num_blocks, engine.block_size) takes prompts of at most " +
                         std::to_string(limit) + " tokens");
}

void Engine::setConstraintVocabulary(std::shared_ptr<const constraint::TokenVocabulary> vocab, size_t cacheCapacity) {
  constraints_ = std::make_unique<constraint::ConstraintCache>(std::move(vocab), cacheCapacity);
}

Status Engine::attachConstraint(Request& request) {
  const auto& spec = request.params().constraint;
  if (!spec.active()) return Status::ok();
  if (!constraints_) {
    return failedPrecondition(
        reqName(request.id()) +
        ": constrained decoding needs the model's tokenizer.json, which this engine was not given");
  }
  PD_ASSIGN_OR_RETURN(auto matcher, constraints_->get(spec));
  return request.setConstraint(std::move(matcher));
}

Status Engine::submit(Request request) {
  uint64_t id = request.id();
  if (requests_.count(id)) return failedPrecondition(reqName(id) + ": already in the engine");
  PD_RETURN_IF_ERROR(checkFits(request));
  PD_RETURN_IF_ERROR(attachConstraint(request));
  requests_.emplace(id, std::move(request));
  waiting_.push_back(id);
  return Status::ok();
}

Result<std::vector<BlockId>> Engine::submitRemote(Request request) {
  uint64_t id = request.id();
  if (requests_.count(id)) return failedPrecondition(reqName(id) + ": already in the engine");
  PD_RETURN_IF_ERROR(checkFits(request));
  PD_RETURN_IF_ERROR(attachConstraint(request));
  PD_RETURN_IF_ERROR(kv_->reserve(id, request.numPromptTokens()));
  auto table = kv_->blockTable(id);
  std::vector<BlockId> blocks(table.begin(), table.end());
  auto& r = requests_.emplace(id, std::move(request)).first->second;
  Status s = r.transition(RequestState::kWaitingKv);
  if (!s.isOk()) {
    eraseRequest(id, /*freeKv=*/true);
    return s;
  }
  remote_.insert(id);
  return blocks;
}

Status Engine::completeRemote(uint64_t id, const SampledToken& first, std::vector<EngineEvent>* events) {
  if (!remote_.count(id)) return notFound(reqName(id) + ": not waiting for remote KV");
  // Checked before anything changes: a bad id from a peer must fail this request alone (it
  // stays waiting for KV, so the caller can recompute it), never the next batch it joins.
  if (first.id < 0 || first.id >= modelConfig().vocabSize) {
    return invalidArgument(reqName(id) + ": first token id " + std::to_string(first.id) +
                           " is outside the vocabulary of " + std::to_string(modelConfig().vocabSize));
  }
  Request& r = requests_.at(id);
  remote_.erase(id);
  PD_RETURN_IF_ERROR(r.setNumComputed(r.numPromptTokens()));
  PD_RETURN_IF_ERROR(kv_->cacheComputedBlocks(id, r.tokens(), r.numComputed()));
  PD_RETURN_IF_ERROR(r.transition(RequestState::kDecoding));
  running_.push_back(id);
  return sampleInto(r, nullptr, events, first);
}

Status Engine::recomputeRemote(uint64_t id) {
  if (!remote_.count(id)) return notFound(reqName(id) + ": not waiting for remote KV");
  Request& r = requests_.at(id);
  remote_.erase(id);
  if (kv_->hasSequence(id)) PD_RETURN_IF_ERROR(kv_->free(id));
  PD_RETURN_IF_ERROR(r.transition(RequestState::kQueued));
  waiting_.push_front(id);
  return Status::ok();
}

Status Engine::quarantineRemote(uint64_t id, SeqId holder) {
  if (!remote_.count(id)) return notFound(reqName(id) + ": not waiting for remote KV");
  if (requests_.count(holder)) {
    return Status(StatusCode::kAlreadyExists,
                  reqName(id) + ": quarantine holder " + std::to_string(holder) + " is a request id");
  }
  return kv_->rename(id, holder);
}

void Engine::cancel(uint64_t id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  if (!isTerminal(it->second.state())) (void)it->second.cancel();
  eraseRequest(id, /*freeKv=*/true);
}

void Engine::release(uint64_t id) {
  if (heldKv_.erase(id) && kv_->hasSequence(id)) (void)kv_->free(id);
}

void Engine::eraseRequest(uint64_t id, bool freeKv) {
  running_.erase(std::remove(running_.begin(), running_.end(), id), running_.end());
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), id), waiting_.end());
  remote_.erase(id);
  requests_.erase(id);
  if (freeKv) {
    heldKv_.erase(id);
    if (kv_->hasSequence(id)) (void)kv_->free(id);
  } else if (kv_->hasSequence(id)) {
    heldKv_.insert(id);
  }
}

void Engine::finishRequest(uint64_t id, FinishReason reason, std::vector<EngineEvent>* events) {
  Request& r = requests_.at(id);
  (void)r.finish(reason);
  EngineEvent e;
  e.kind = EngineEvent::Kind::kFinished;
  e.requestId = id;
  e.reason = reason;
  e.timings = r.timings();
  events->push_back(std::move(e));
  eraseRequest(id, options_.releaseKvOnFinish);
}

void Engine::failRequest(uint64_t id, Status error, std::vector<EngineEvent>* events) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  if (!isTerminal(it->second.state())) (void)it->second.fail(error);
  EngineEvent e;
  e.kind = EngineEvent::Kind::kFailed;
  e.requestId = id;
  e.timings = it->second.timings();
  e.error = std::move(error);
  events->push_back(std::move(e));
  eraseRequest(id, /*freeKv=*/true);
}

Status Engine::sampleInto(Request& r, const float* logits, std::vector<EngineEvent>* events,
                          std::optional<SampledToken> given) {
  const int vocab = backend_->config().vocabSize;
  const SamplingParams& params = r.params();
  std::optional<ConstraintRow> constraint;
  if (!given && r.constraint()) {
    const constraint::TokenMatcher& m = *r.constraint();
    const constraint::State state = r.constraintState();
    constraint = ConstraintRow{&m.allowed(state), m.canEnd(state)};
    if (constraint->allowed->count == 0 && !constraint->canEnd) {
      failRequest(r.id(),
                  invalidArgument(reqName(r.id()) + ": no token of the vocabulary continues the constrained text"),
                  events);
      return Status::ok();
    }
  }
  SampledToken token = given ? *given
                       : params.processesLogits()
                           ? sampleWithProcessors(logits, vocab, params, r.nextSampleStep(), r.tokens(),
                                                  size_t(r.numPromptTokens() - params.generatedInPrompt), eosTokenId(),
                                                  constraint ? &*constraint : nullptr)
                           : sample(logits, vocab, params, r.nextSampleStep());
  auto reason = r.appendToken(token, eosTokenId());
  if (!reason.ok()) {
    failRequest(r.id(), reason.status(), events);
    return Status::ok();
  }
  uint64_t id = r.id();
  EngineEvent e;
  e.kind = EngineEvent::Kind::kToken;
  e.requestId = id;
  e.token = std::move(token);
  events->push_back(std::move(e));
  if (*reason != FinishReason::kNone) {
    finishRequest(id, *reason, events);
  } else if (r.state() == RequestState::kPrefilling) {
    (void)r.transition(RequestState::kDecoding);
  }
  return Status::ok();
}

Status Engine::step(std::vector<EngineEvent>* events, const StepLayerFn& onLayer) {
  const SteadyTime stepStart = clock_.now();
  promoteFromLowerTiers();
  const double gapSeconds = workSince_ ? secondsBetween(*workSince_, stepStart) : 0;
  workSince_.reset();
  std::vector<SeqView> running, waiting;
  running.reserve(running_.size());
  waiting.reserve(waiting_.size());
  for (uint64_t id : running_) running.push_back(seqViewOf(requests_.at(id)));
  for (uint64_t id : waiting_) waiting.push_back(seqViewOf(requests_.at(id)));
  SchedulerView view;
  view.running = running;
  view.waiting = waiting;
  view.kv = kv_.get();
  view.numExternalSeqs = static_cast<int>(remote_.size());
  view.now = clock_.now();
  const bool remoteKvExpected = !remote_.empty();
  // Without SLO-sized chunks, max_batch_tokens alone bounds a step, counting tokens.
  const bool sloSized = options_.prefillChunks.periodBudgetMs() > 0;
  view.prefillTokenBudget = sloSized ? prefillChunkTokens(remoteKvExpected, decodingStreams()) : -1;
  view.attentionSpan = attentionSpan();
  view.prefillTokenFloor = options_.prefillChunks.minTokens;
  StepPlan plan = scheduler_.schedule(view);
  lastStep_ = {};
  lastStep_.gapSeconds = gapSeconds;
  lastStep_.remoteKvExpected = remoteKvExpected;
  lastStep_.promptBudget = view.prefillTokenBudget;
  for (const auto& e : plan.entries) {
    if (e.isDecode) {
      ++lastStep_.decodeRows;
      lastStep_.decodeContextTokens += e.start;
      continue;
    }
    ++lastStep_.promptChunks;
    lastStep_.promptContextTokens += e.start;
    lastStep_.promptTokens += e.count;
    lastStep_.promptCost += promptChunkCost(e.start, e.count, view.attentionSpan);
  }
  PD_RETURN_IF_ERROR(applyPlanToKv(plan, *kv_));

  for (const auto& rej : plan.rejected) failRequest(rej.seq, rej.reason, events);
  preemptions_ += int64_t(plan.preempted.size());
  for (uint64_t id : plan.preempted) {
    Request& r = requests_.at(id);
    (void)r.transition(RequestState::kQueued);
    running_.erase(std::remove(running_.begin(), running_.end(), id), running_.end());
    waiting_.push_front(id);
  }
  for (const auto& adm : plan.admitted) {
    Request& r = requests_.at(adm.seq);
    prefixQueryTokens_ += r.numPromptTokens();
    prefixHitTokens_ += adm.cachedTokens;
    (void)r.transition(RequestState::kPrefilling);
    r.setNumCachedPromptTokens(adm.cachedTokens);
    (void)r.setNumComputed(adm.cachedTokens);
    waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), adm.seq), waiting_.end());
    running_.push_back(adm.seq);
  }
  if (plan.empty()) return Status::ok();

  std::vector<SeqChunk> chunks;
  chunks.reserve(plan.entries.size());
  int numLogits = 0;
  for (const auto& e : plan.entries) {
    const Request& r = requests_.at(e.seq);
    auto table = kv_->blockTable(e.seq);
    SeqChunk c;
    c.tokens = r.tokens().data() + e.start;
    c.numTokens = e.count;
    c.startPos = e.start;
    c.blockTable = table.data();
    c.numBlocks = static_cast<int>(table.size());
    c.wantLogits = e.wantLogits;
    numLogits += e.wantLogits ? 1 : 0;
    chunks.push_back(c);
  }
  const int vocab = backend_->config().vocabSize;
  // Logits processors run on the host (logits_processors.h): a step with such a row brings
  // every row's logits back and samples them all here, the same tokens the device would pick
  // for the rows without processors (sampling.h: one definition, two twins).
  bool sampleOnDevice = backend_->samplesOnDevice();
  for (const auto& e : plan.entries)
    if (e.wantLogits && requests_.at(e.seq).params().processesLogits()) sampleOnDevice = false;
  if (!sampleOnDevice) logits_.resize(size_t(std::max(numLogits, 1)) * vocab);
  LayerKvReadyFn layerFn;
  if (onLayer) {
    StepView sv{plan.entries, kv_.get()};
    layerFn = [&onLayer, sv](int layer) { onLayer(layer, sv); };
  }
  // A backend that samples on the device gets every row's params and returns tokens; the
  // others return logits, sampled below on the host. Either way the same tokens come back.
  std::vector<SampledToken> sampled;
  Status s;
  const SteadyTime forwardStart = clock_.now();
  if (sampleOnDevice) {
    std::vector<pd::kernels::SampleRowParams> params;
    int topN = 0;
    for (const auto& e : plan.entries) {
      if (!e.wantLogits) continue;
      const Request& r = requests_.at(e.seq);
      params.push_back(rowParams(r.params(), r.nextSampleStep()));
      topN = std::max(topN, std::min(r.params().logprobs, vocab));
    }
    sampled.resize(params.size());
    s = backend_->forwardAndSample(chunks, params, topN, sampled.data(), layerFn);
  } else {
    s = backend_->forward(chunks, logits_.data(), layerFn);
  }
  if (!s.isOk()) {
    PD_LOG(kError, "engine") << "forward failed: " << s.toString();
    for (const auto& e : plan.entries) failRequest(e.seq, s, events);
    return s;
  }

  noteStep(secondsBetween(forwardStart, clock_.now()));
  int row = 0;
  for (const auto& e : plan.entries) {
    Request& r = requests_.at(e.seq);
    PD_RETURN_IF_ERROR(r.setNumComputed(e.start + e.count));
    PD_RETURN_IF_ERROR(kv_->cacheComputedBlocks(e.seq, r.tokens(), r.numComputed()));
    if (!e.wantLogits) continue;
    if (!sampled.empty()) {
      SampledToken& t = sampled[size_t(row++)];
      t.topLogprobs.resize(size_t(std::min<int>(r.params().logprobs, int(t.topLogprobs.size()))));
      PD_RETURN_IF_ERROR(sampleInto(r, nullptr, events, std::move(t)));
      continue;
    }
    PD_RETURN_IF_ERROR(sampleInto(r, logits_.data() + size_t(row++) * vocab, events));
  }
  const SteadyTime end = clock_.now();
  lastStep_.seconds = secondsBetween(stepStart, end);
  sizePrefillChunks(1e3 * (lastStep_.gapSeconds + lastStep_.seconds));
  if (hasWork()) workSince_ = end;
  return Status::ok();
}

void Engine::noteStep(double seconds) {
  if (seconds <= 0) return;
  constexpr double kWeight = 0.3;  // of the newest step: follows a change within a few steps
  const auto fold = [](double& avg, double v) { avg = avg == 0 ? v : (1 - kWeight) * avg + kWeight * v; };
  const int64_t prefillTokens = lastStep_.promptTokens;
  const int decodeRows = lastStep_.decodeRows;
  const bool anyDecode = decodeRows > 0;
  if (prefillTokens > 0) fold(prefillTokensPerS_, double(prefillTokens) / seconds);
  if (anyDecode) fold(decodeStepMs_, seconds * 1e3);
  if (anyDecode && prefillTokens == 0) {
    fold(pureDecodeStepMs_, seconds * 1e3);
    decodeCost_.observe(decodeRows, seconds * 1e3);
  }
  if (options_.prefillChunks.itlTargetMs > 0 && anyDecode && prefillTokens > 0 &&
      prefillTokens <= options_.prefillChunks.minTokens) {
    decodeCost_.observeSmallChunk(decodeRows, seconds * 1e3);
    smallChunkSeenAt_ = clock_.now();
  }
}

void Engine::sizePrefillChunks(double periodMs) {
  const double budgetMs = options_.prefillChunks.periodBudgetMs();
  const double promptCost = lastStep_.promptCost;
  if (budgetMs <= 0 || lastStep_.decodeRows == 0 || promptCost <= 0 || periodMs <= 0) return;
  // The aim tracks the percentile (PrefillChunkOptions), over the streams' gaps: a step
  // counts once per stream it held up.
  constexpr double kAimStep = 0.05;
  const int rows = lastStep_.decodeRows;
  const double q = 1 - (1 - std::clamp(options_.prefillChunks.percentile / 100, 0.0, 1.0)) / 2;
  prefillChunkAim_ = std::clamp(
      prefillChunkAim_ * std::exp(rows * (periodMs > budgetMs ? -kAimStep * q : kAimStep * (1 - q))), 0.5, 1.0);
  // A step that used (nearly) its cap, or overran the aim whatever it used, says where the
  // cap should be; a step short of prompt work and within the aim says nothing.
  const double aimMs = budgetMs * prefillChunkAim_;
  if (periodMs > aimMs || promptCost * 10 >= lastStep_.promptBudget * 9) {
    const double scale = std::clamp(aimMs / periodMs, 0.5, 1.25);
    ChunkCap& cap = prefillChunkCaps_[lastStep_.remoteKvExpected];
    cap.cost = clampChunk(std::lround(promptCost * scale));
    cap.decodeRows = rows;
    // The prompt work's pace net of the streams and of the fixed cost any prefill adds (a
    // small chunk's excess over the line; it holds a few tokens too, so this errs fast).
    const auto line = decodeCost_.line();
    const double otherMs = line ? line->stepMs(rows) + line->smallChunkMs : pureDecodeStepMs_;
    cap.costPerMs = promptCost / std::max(periodMs - otherMs, periodMs / 2);
  }
}

int Engine::clampChunk(int64_t tokens) const {
  const int most = options_.scheduler.maxBatchTokens;
  return int(std::clamp<int64_t>(tokens, std::min(options_.prefillChunks.minTokens, most), most));
}

double Engine::attentionSpan() const {
  return options_.prefillChunks.priceAttention ? backend_->config().attentionSpanTokens() : 0;
}

int Engine::decodingStreams() const {
  int n = 0;
  for (uint64_t id : running_) n += requests_.at(id).numComputed() >= requests_.at(id).numPromptTokens();
  return n;
}

int Engine::prefillChunkTokens(bool remoteKvExpected, int decodeRows) const {
  const double budgetMs = options_.prefillChunks.periodBudgetMs();
  if (budgetMs <= 0) return options_.scheduler.maxBatchTokens;
  const ChunkCap& cap = prefillChunkCaps_[remoteKvExpected].cost > 0 ? prefillChunkCaps_[remoteKvExpected]
                                                                     : prefillChunkCaps_[!remoteKvExpected];
  if (cap.cost > 0) {
    // Taught beside cap.decodeRows streams: beside more, their own share of the step grows
    // by what the decode cost line says, and the prompt's shrinks by as much.
    const auto line = decodeCost_.line();
    if (!line || decodeRows == cap.decodeRows) return cap.cost;
    const double moreDecodeMs = line->stepMs(decodeRows) - line->stepMs(cap.decodeRows);
    return clampChunk(std::lround(cap.cost - cap.costPerMs * moreDecodeMs));
  }
  // Not taught yet: what the prefill rate fits beside a pure decode step, or, with either
  // unmeasured, the floor: each mixed step then grows the cap (x1.25 at most) until it meets the
  // budget (sizePrefillChunks). A decode worker that has only received remote prefills has no
  // rate: a whole prompt beside its streams was the likely 661 ms gap of a Mooncake run.
  if (prefillTokensPerS_ <= 0 || pureDecodeStepMs_ <= 0) return clampChunk(options_.prefillChunks.minTokens);
  return clampChunk(std::llround(prefillTokensPerS_ * (budgetMs * prefillChunkAim_ - pureDecodeStepMs_) / 1e3));
}

EngineLoad Engine::load() const {
  EngineLoad l;
  l.running = static_cast<int>(running_.size());
  l.waiting = static_cast<int>(waiting_.size());
  l.remote = static_cast<int>(remote_.size());
  for (uint64_t id : waiting_) l.queuedPrefillTokens += requests_.at(id).numPromptTokens();
  for (uint64_t id : running_) {
    const Request& r = requests_.at(id);
    l.queuedPrefillTokens += std::max(0, r.numPromptTokens() - r.numComputed());
  }
  l.decoding = decodingStreams();
  l.freeBlocks = kv_->numFreeBlocks();
  l.totalBlocks = kv_->numTotalBlocks();
  l.maxPromptTokens = maxPromptTokens();
  l.preemptions = preemptions_;
  l.prefixQueryTokens = prefixQueryTokens_;
  l.prefixHitTokens = prefixHitTokens_;
  l.prefillTokensPerS = prefillTokensPerS_;
  // With SLO-sized chunks the prompt work in a step yields to the ITL target, so what the
  // streams cost by themselves is the capacity signal (a mixed step sits near the target by
  // design and would read as "full").
  l.decodeStepMs = options_.prefillChunks.itlTargetMs > 0 && pureDecodeStepMs_ > 0 ? pureDecodeStepMs_ : decodeStepMs_;
  l.prefillChunkTokens = prefillChunkTokens(!remote_.empty(), l.decoding);
  l.decodeStepCost = decodeCost_.line();
  if (l.decodeStepCost && clock_.now() - smallChunkSeenAt_ > EngineLoad::kSmallChunkTtl)
    l.decodeStepCost->smallChunkMs = 0;
  return l;
}

}  // namespace pd::engine
