#include "router/request_stream.h"

#include <algorithm>
#include <span>

#include <boost/asio/post.hpp>

#include "common/base/log.h"
#include "router/http_reply.h"

namespace pd::router {
namespace {

constexpr const char* kTag = "router";

// The finish_reason a worker's reason becomes; any other (unset) is "".
constexpr EnumNames<proto::FinishReason, 4> kFinishNames{{{proto::FINISH_STOP, "stop"},
                                                          {proto::FINISH_LENGTH, "length"},
                                                          {proto::FINISH_ABORT, "abort"},
                                                          {proto::FINISH_ERROR, "error"}}};

}  // namespace

std::shared_ptr<RequestStream> RequestStream::create(boost::asio::io_context& io, RequestSpec spec,
                                                     std::shared_ptr<net::HttpResponder> http,
                                                     std::shared_ptr<const tok::Tokenizer> tokenizer,
                                                     StreamOwner& owner, metrics::RouterMetrics& metrics,
                                                     const StreamSettings& settings) {
  return std::shared_ptr<RequestStream>(
      new RequestStream(io, std::move(spec), std::move(http), std::move(tokenizer), owner, metrics, settings));
}

RequestStream::RequestStream(boost::asio::io_context& io, RequestSpec spec, std::shared_ptr<net::HttpResponder> http,
                             std::shared_ptr<const tok::Tokenizer> tokenizer, StreamOwner& owner,
                             metrics::RouterMetrics& metrics, const StreamSettings& settings)
    : strand_(boost::asio::make_strand(io)),
      deadlineTimer_(strand_),
      heartbeatTimer_(strand_),
      spec_(std::move(spec)),
      http_(std::move(http)),
      tokenizer_(std::move(tokenizer)),
      owner_(owner),
      metrics_(metrics),
      settings_(settings) {
  meta_ = {std::string(spec_.parsed.req.responses                     ? "resp_"
                       : spec_.parsed.req.endpoint == Endpoint::kChat ? "chatcmpl-"
                                                                      : "cmpl-"),
           spec_.createdUnixSeconds, settings_.modelName};
}

template <typename F>
void RequestStream::onStrand(F&& f) {
  boost::asio::post(strand_, [self = shared_from_this(), f = std::forward<F>(f)]() mutable { f(); });
}

void RequestStream::start(Dispatch dispatch) {
  onStrand([this, d = std::move(dispatch)]() mutable { startOnStrand(std::move(d)); });
}

void RequestStream::refuse(ApiError error, std::string errorMetric, std::string_view pool) {
  onStrand([this, error = std::move(error), metric = std::move(errorMetric), pool = std::string(pool)] {
    finished_ = true;
    metrics_.requestError(metric, pool);
    sendError(http_, error);
  });
}

void RequestStream::deliver(proto::TokenChunk chunk) {
  onStrand([this, chunk = std::move(chunk)] { onChunk(chunk); });
}

void RequestStream::fail(Status why) {
  onStrand([this, why = std::move(why)] { failOnStrand(why); });
}

void RequestStream::workerLost(Status why) {
  onStrand([this, why = std::move(why)] { migrateOnStrand(why, "worker_lost"); });
}

void RequestStream::resume(std::optional<Dispatch> dispatch, Status why) {
  onStrand([this, d = std::move(dispatch), why = std::move(why)]() mutable {
    migrating_ = false;
    if (finished_) {  // the deadline or the client ended it meanwhile: the new ids go unused
      if (d) owner_.choicesEnded(std::move(d->workerRequestIds));
      return;
    }
    if (!d) return failOnStrand(unavailable(lostWhy_.message() + "; " + why.message()));
    resumeOnStrand(std::move(*d));
  });
}

// ---- dispatch ---------------------------------------------------------------------------------

void RequestStream::setDispatch(const Dispatch& d) {
  route_ = d.plan.route;
  predictedCached_ = d.plan.predictedCachedTokens;
  exactCached_ = d.plan.exactCachedTokens;
  plannedPrefiller_ = d.plan.route == Route::kDisaggregated ? d.plan.prefillWorker : d.plan.decodeWorker;
  decodeWorker_ = d.plan.decodeWorker;
  prefillWorker_ = d.plan.prefillWorker;
  decodeConn_ = d.decodeConn;
}

void RequestStream::startOnStrand(Dispatch d) {
  meta_.id += d.responseId;
  if (spec_.parsed.req.responses)
    responses_ = std::make_unique<ResponsesWriter>(*spec_.parsed.req.responses, meta_.id, meta_.created, meta_.model);
  setDispatch(d);
  // Set before anything is answered: a client leaving while we dispatch still cancels.
  std::weak_ptr<RequestStream> weak = weak_from_this();
  http_->onDisconnect([weak] {
    if (auto self = weak.lock()) self->onStrand([raw = self.get()] { raw->abort("client disconnected"); });
  });
  std::vector<uint64_t> unsent;
  dispatchedAt_ = steadyNow();
  for (size_t i = 0; i < d.workerRequestIds.size(); ++i) {
    Choice c;
    c.index = int(i);
    c.workerRequestId = d.workerRequestIds[i];
    c.detok = std::make_unique<tok::IncrementalDetokenizer>(tokenizer_, /*skipSpecialTokens=*/true);
    if (spec_.parsed.toolFormat)
      c.tools = std::make_unique<ToolCallStreamer>(*spec_.parsed.toolFormat, !spec_.parsed.req.tools.parallelToolCalls);
    if (!sendGenerate(c, d)) {
      c.done = true;
      unsent.push_back(c.workerRequestId);
    }
    choices_.push_back(std::move(c));
  }
  if (!unsent.empty()) owner_.choicesEnded(std::move(unsent));
  metrics_.inFlight.inc();
  startResponse();
  deadlineTimer_.expires_at(spec_.received + std::chrono::milliseconds(settings_.requestTimeoutMs));
  deadlineTimer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (ec) return;  // the request ended first
    self->failOnStrand(
        deadlineExceeded("request did not finish within " + std::to_string(self->settings_.requestTimeoutMs) + " ms"));
  });
  bool anySent = false;
  for (const auto& c : choices_) anySent |= !c.done;
  if (!anySent) failOnStrand(unavailable("decode worker " + decodeWorker_ + " is unreachable"));
}

bool RequestStream::sendGenerate(const Choice& c, const Dispatch& d) {
  const auto& q = spec_.parsed.req;
  proto::Envelope env;
  env.set_request_id(c.workerRequestId);
  auto* g = env.mutable_generate();
  g->set_request_id(c.workerRequestId);
  // After a migration the choice's own tokens so far are part of its prompt.
  for (int32_t id : spec_.parsed.prompt) g->add_prompt_token_ids(uint32_t(id));
  for (int32_t id : c.generated) g->add_prompt_token_ids(uint32_t(id));
  auto* s = g->mutable_sampling();
  s->set_temperature(q.temperature);
  s->set_top_k(q.topK);
  s->set_top_p(q.topP);
  s->set_min_p(q.minP);
  if (q.seed) s->set_seed(*q.seed + uint64_t(c.index));  // n choices differ, each reproducible
  s->set_max_tokens(uint32_t(spec_.parsed.maxTokens - int(c.generated.size())));
  for (int32_t id : q.stopTokenIds) s->add_stop_token_ids(uint32_t(id));
  s->set_ignore_eos(q.ignoreEos);
  s->set_logprobs(uint32_t(q.topLogprobs));
  s->set_return_logprobs(q.logprobs);
  s->set_presence_penalty(q.presencePenalty);
  s->set_frequency_penalty(q.frequencyPenalty);
  s->set_repetition_penalty(q.repetitionPenalty);
  for (const auto& [id, bias] : q.logitBias) {
    auto* b = s->add_logit_bias();
    b->set_token_id(uint32_t(id));
    b->set_bias(bias);
  }
  s->set_min_tokens(uint32_t(q.minTokens));
  s->set_generated_in_prompt(uint32_t(c.generated.size()));  // penalties and min_tokens count them
  if (q.constraint.active()) {
    auto* k = s->mutable_constraint();
    k->set_kind(static_cast<proto::Constraint::Kind>(q.constraint.kind));
    k->set_body(q.constraint.body);
    k->set_prefix(q.constraint.prefix);
    k->set_suffix(q.constraint.suffix);
  }
  g->set_route(d.plan.route == Route::kColocated ? proto::ROUTE_COLOCATED : proto::ROUTE_DISAGGREGATED);
  if (d.plan.route == Route::kDisaggregated) {
    g->set_prefill_worker_id(d.plan.prefillWorker);
    g->set_prefill_worker_address(d.prefillAddress);
  }
  if (!d.plan.pullSource.empty() && !d.pullAddress.empty()) {
    g->set_pull_source_id(d.plan.pullSource);
    g->set_pull_source_address(d.pullAddress);
    g->set_pull_tokens(uint32_t(d.plan.pullTokens));
  }
  const auto left = spec_.received + std::chrono::milliseconds(settings_.requestTimeoutMs) - steadyNow();
  g->set_deadline_ms(
      uint64_t(std::max<int64_t>(1, std::chrono::duration_cast<std::chrono::milliseconds>(left).count())));
  Status sent = d.decodeConn ? d.decodeConn->send(env) : unavailable("not connected");
  if (!sent.isOk()) {
    PD_LOG(kWarn, kTag) << "decode worker " << d.plan.decodeWorker << ": " << sent.toString();
  }
  return sent.isOk();
}

// Streaming: the headers and, per choice, the chat role delta or the echoed prompt.
// What x-pdserve-route and the metrics' route label say: the route planned, or
// "disaggregated-recomputed" once the first token's Timings said the decode worker computed
// the prompt itself (docs/serving.md, "x-pdserve-route").
const char* RequestStream::routeLabel() const {
  return recomputed_ && route_ == Route::kDisaggregated ? kRecomputedRoute : routeName(route_);
}

void RequestStream::startResponse() {
  const auto& req = spec_.parsed.req;
  if (!req.stream) return;
  net::HttpHeaders h{
      {"x-pdserve-route", routeLabel()}, {"x-pdserve-decode-worker", decodeWorker_}, {"x-request-id", meta_.id}};
  if (!prefillWorker_.empty()) h["x-pdserve-prefill-worker"] = prefillWorker_;
  http_->startStream(200, std::move(h));
  if (responses_) {
    http_->sendEvent(responses_->start());
  } else {
    for (const auto& c : choices_) {
      ChoiceDelta d;
      d.index = c.index;
      d.first = req.endpoint == Endpoint::kChat;
      if (req.echo) d.text = spec_.parsed.promptText;
      if (d.first || !d.text.empty()) http_->sendEvent(sseEvent(streamChunk(req.endpoint, meta_, d, false)));
    }
  }
  lastSentAt_ = steadyNow();
  armHeartbeat();
}

void RequestStream::armHeartbeat() {
  if (settings_.streamHeartbeatMs <= 0 || finished_) return;
  heartbeatTimer_.expires_at(lastSentAt_ + std::chrono::milliseconds(settings_.streamHeartbeatMs));
  heartbeatTimer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (ec || self->finished_) return;  // cancelled: the request ended
    const SteadyTime now = steadyNow();
    // Due only if nothing went out since the wait began; else the next wait starts from the
    // last event.
    if (now - self->lastSentAt_ >= std::chrono::milliseconds(self->settings_.streamHeartbeatMs)) {
      // An SSE comment (a line starting with ':'): every client ignores it, OpenAI's SDKs included.
      self->http_->sendEvent(": keepalive\n\n");
      self->metrics_.sseHeartbeats.inc();
      self->lastSentAt_ = now;
    }
    self->armHeartbeat();
  });
}

// ---- stream -----------------------------------------------------------------------------------

void RequestStream::onChunk(const proto::TokenChunk& chunk) {
  Choice* c = nullptr;
  for (auto& ch : choices_)
    if (ch.workerRequestId == chunk.request_id()) c = &ch;
  // Late: the choice or the request ended meanwhile, or the choice is moving to another
  // worker (what its old one still sends is not part of the answer: it was cancelled there).
  if (finished_ || migrating_ || !c || c->done) return;
  const auto& req = spec_.parsed.req;
  if (chunk.token_ids_size() > 0) observeTiming(*c, chunk, steadyNow());
  if (chunk.finish_reason() == proto::FINISH_ERROR) {
    Status why = net::fromProtoError(chunk.error());
    if (why.isOk()) why = internalError("the worker failed the request without a reason");
    // unavailable: the worker gave the request up (draining, shutting down): another may
    // take it. Anything else is about the request itself.
    if (why.code() == StatusCode::kUnavailable) return migrateOnStrand(why, "worker_gave_up");
    return failOnStrand(why);
  }
  if (spec_.parsed.discardOutput) {  // echo-only: the one token run is not answered
    if (chunk.finish_reason() == proto::FINISH_NONE) return;
    emit(*c, "", {}, {}, std::string("length"));
    endChoice(*c);
    maybeComplete();
    return;
  }
  std::string delta;
  std::vector<TokenLogprob> lps;
  std::vector<int32_t> ids(chunk.token_ids().begin(), chunk.token_ids().end());
  for (int k = 0; k < chunk.token_ids_size(); ++k) {
    delta += c->detok->push(int32_t(chunk.token_ids(k)));
    // The tool-call syntax's special tokens stay in the text its parser reads.
    for (const auto& [id, marker] : spec_.parsed.markerTokens)
      if (id == int32_t(chunk.token_ids(k))) delta += marker;
    c->generated.push_back(int32_t(chunk.token_ids(k)));
    ++c->completionTokens;
    if (req.logprobs && k < chunk.logprobs_size()) lps.push_back(logprobOf(chunk.logprobs(k)));
  }
  std::optional<std::string> finish;
  if (chunk.finish_reason() != proto::FINISH_NONE) {
    delta += c->detok->finish();
    finish = enumName(kFinishNames, chunk.finish_reason(), "");
  }
  const bool stopped = applyStop(*c, delta, finish.has_value());
  if (stopped) {
    finish = "stop";
    cancelOnWorker(*c, "stop string matched");
  }
  emit(*c, delta, std::move(lps), std::move(ids), finish);
  if (finish) {
    if (chunk.has_timings()) metrics_.observeQueueTime(routeLabel(), chunk.timings().queue_ms() / 1e3);
    endChoice(*c);
    if (chunk.has_usage() && !stopped)
      c->completionTokens = c->tokensBeforeMove + int(chunk.usage().completion_tokens());
    // A migrated choice's prompt was recomputed (or found) on its new worker: its last word.
    if (chunk.has_usage()) c->cachedPromptTokens = int(chunk.usage().cached_tokens());
    // The prediction against the worker's actual prefix hit, once per request, for the
    // prompt as first routed (a migrated choice was routed without prefix hashes), when it
    // was prefilled where planned (not recomputed elsewhere after a failed remote prefill).
    if (chunk.has_usage() && !hitCounted_ && c->tokensBeforeMove == 0 && chunk.finish_reason() != proto::FINISH_ERROR &&
        chunk.timings().prefill_worker_id() == plannedPrefiller_) {
      hitCounted_ = true;
      metrics_.prefixHit(predictedCached_, exactCached_, int64_t(chunk.usage().cached_tokens()));
    }
    maybeComplete();
  }
}

// TTFT once per request, ITL per token after a choice's first; tokens that arrive together
// are 0 s apart. The metrics are observed here, the autoscaler's window in the loop.
void RequestStream::observeTiming(Choice& c, const proto::TokenChunk& chunk, SteadyTime now) {
  TokenTiming t;
  t.at = now;
  if (!firstTokenSeen_) {
    firstTokenSeen_ = true;
    recomputed_ = chunk.has_timings() && chunk.timings().recomputed();
    const double ttft = secondsBetween(spec_.received, now);
    metrics_.observeTtft(routeLabel(), ttft);
    if (chunk.has_timings() && chunk.timings().ttft_split()) {
      ttftSplit_ = assembleTtftSplit(ttft, secondsBetween(spec_.received, dispatchedAt_), chunk.timings());
      for (const auto& [phase, seconds] : ttftSplit_->phases) metrics_.observeTtftPhase(routeLabel(), phase, seconds);
    }
    t.ttft = ttft;
    t.route = route_;
  } else if (c.lastTokenAt) {
    const double itl = secondsBetween(*c.lastTokenAt, now);
    metrics_.observeItl(routeLabel(), itl);
    t.itl = itl;
  }
  for (int k = 1; k < chunk.token_ids_size(); ++k) metrics_.observeItl(routeLabel(), 0.0);
  t.zeroItls = chunk.token_ids_size() - 1;
  c.lastTokenAt = now;
  if (t.ttft || t.itl || t.zeroItls > 0) owner_.observeTokens(t);
}

TokenLogprob RequestStream::logprobOf(const proto::TokenLogprob& lp) const {
  TokenLogprob t;
  int32_t id = int32_t(lp.token_id());
  t.token = tokenizer_->decode(std::span<const int32_t>(&id, 1));
  t.logprob = lp.logprob();
  for (const auto& top : lp.top()) {
    int32_t tid = int32_t(top.token_id());
    t.top.emplace_back(tokenizer_->decode(std::span<const int32_t>(&tid, 1)), top.logprob());
    t.topIds.push_back(tid);
  }
  return t;
}

// Appends `delta` to the choice's held text and moves to `delta` what can be sent: text
// that cannot be the start of a stop string. Returns true when a stop string matched
// (the text is cut before it).
bool RequestStream::applyStop(Choice& c, std::string& delta, bool final) {
  const auto& stops = spec_.parsed.req.stop;
  if (stops.empty()) return false;
  // min_tokens holds stop strings back too, as vLLM does: matching starts with the chunk that
  // reaches min_tokens (the worker masks the stop ids and EOS until then).
  if (int(c.generated.size()) < spec_.parsed.req.minTokens) return false;
  c.held += delta;
  delta.clear();
  size_t cut = std::string::npos;
  for (const auto& stop : stops) cut = std::min(cut, c.held.find(stop));
  if (cut != std::string::npos) {
    delta = c.held.substr(0, cut);
    c.held.clear();
    return true;
  }
  size_t keep = 0;
  if (!final) {
    for (const auto& stop : stops) {
      for (size_t k = std::min(stop.size() - 1, c.held.size()); k > keep; --k) {
        if (c.held.compare(c.held.size() - k, k, stop, 0, k) == 0) {
          keep = k;
          break;
        }
      }
    }
    // Never split a UTF-8 sequence: back up to a character boundary.
    while (keep < c.held.size() && (static_cast<unsigned char>(c.held[c.held.size() - keep]) & 0xC0) == 0x80) ++keep;
  }
  delta = c.held.substr(0, c.held.size() - keep);
  c.held.erase(0, c.held.size() - keep);
  return false;
}

void RequestStream::emit(Choice& c, std::string delta, std::vector<TokenLogprob> lps, std::vector<int32_t> ids,
                         std::optional<std::string> finish) {
  const auto& req = spec_.parsed.req;
  std::vector<ToolCallStreamer::CallDelta> calls;
  if (c.tools) {  // the answer's tool calls come out of its text (router/tool_calls.h)
    auto out = c.tools->push(delta);
    delta = std::move(out.content);
    calls = std::move(out.calls);
    if (finish) {
      auto last = c.tools->finish();
      delta += last.content;
      for (auto& call : last.calls) calls.push_back(std::move(call));
      if (*finish == "stop" && c.tools->sawCalls()) finish = "tool_calls";
    }
    for (const auto& call : calls) {
      if (call.id)
        c.calls.push_back({*call.id, call.name.value_or(""), ""});
      else if (!c.calls.empty())
        c.calls.back().arguments += call.arguments;
    }
  }
  if (req.stream) {
    // One event per step that produced tokens, even when their text is held back (an
    // unfinished UTF-8 sequence, a possible stop string): clients time tokens by events.
    if (delta.empty() && !finish && ids.empty() && calls.empty()) return;
    if (responses_) {
      // The Responses stream has no per-token event without text; its end is maybeComplete's.
      if (std::string events = responses_->delta(delta, calls); !events.empty()) {
        http_->sendEvent(std::move(events));
        lastSentAt_ = steadyNow();
      }
    } else {
      ChoiceDelta d;
      d.index = c.index;
      d.text = delta;
      d.logprobs = std::move(lps);
      d.finishReason = finish;
      d.toolCallDeltas = std::move(calls);
      if (req.returnTokenIds) d.tokenIds = std::move(ids);
      http_->sendEvent(sseEvent(streamChunk(req.endpoint, meta_, d, req.logprobs)));
      lastSentAt_ = steadyNow();
    }
  } else {
    for (auto& lp : lps) c.logprobs.push_back(std::move(lp));
    c.tokenIds.insert(c.tokenIds.end(), ids.begin(), ids.end());
  }
  c.text += delta;
  if (finish) c.finishReason = *finish;
}

void RequestStream::endChoice(Choice& c) {
  if (c.done) return;
  c.done = true;
  owner_.choicesEnded({c.workerRequestId});
}

void RequestStream::maybeComplete() {
  for (const auto& c : choices_)
    if (!c.done) return;
  if (finished_) return;
  endRequest();
  const auto& req = spec_.parsed.req;
  Usage usage;
  usage.promptTokens = int(spec_.parsed.prompt.size());
  for (const auto& c : choices_) usage.completionTokens += c.completionTokens;
  // One prompt, n choices: the tokens the prompt did not compute for the first choice.
  if (!choices_.empty()) usage.cachedTokens = std::min(usage.promptTokens, choices_.front().cachedPromptTokens);
  if (ttftSplit_) usage.pdserveTiming = ttftSplitJson(*ttftSplit_);
  if (responses_ && req.stream) {
    http_->sendEvent(responses_->finish(choices_.front().finishReason, usage));
    http_->endStream();
  } else if (req.stream) {
    if (req.includeUsage) http_->sendEvent(sseEvent(usageChunk(req.endpoint, meta_, usage)));
    http_->sendEvent(kSseDone);
    http_->endStream();
  } else {
    std::vector<ChoiceDelta> out;
    for (auto& c : choices_) {
      ChoiceDelta d;
      d.index = c.index;
      d.text = (req.echo ? spec_.parsed.promptText : std::string()) + c.text;
      d.logprobs = c.logprobs;
      d.finishReason = c.finishReason;
      if (req.returnTokenIds) d.tokenIds = c.tokenIds;
      d.toolCalls = c.calls;
      out.push_back(std::move(d));
    }
    net::HttpHeaders headers{
        {"x-pdserve-route", routeLabel()}, {"x-pdserve-decode-worker", decodeWorker_}, {"x-request-id", meta_.id}};
    if (!prefillWorker_.empty()) headers["x-pdserve-prefill-worker"] = prefillWorker_;
    if (ttftSplit_) headers["server-timing"] = serverTimingHeader(*ttftSplit_);
    sendJson(http_, 200,
             responses_ ? responses_->full(out.front().text, out.front().toolCalls,
                                           out.front().finishReason.value_or(""), usage)
                        : fullResponse(req.endpoint, meta_, out, usage, req.logprobs),
             std::move(headers));
  }
  std::string reason;
  for (const auto& c : choices_) reason = c.finishReason;
  if (reason == "tool_calls") reason = "stop";  // the metric counts how the generation ended (vLLM's labels)
  metrics_.observeE2e(routeLabel(), secondsBetween(spec_.received, steadyNow()));
  metrics_.requestFinished(reason, usage.promptTokens, usage.completionTokens);
  metrics_.inFlight.dec();
}

// Ends every unfinished choice with an error.
void RequestStream::failOnStrand(const Status& why) {
  if (finished_) return;
  for (auto& c : choices_) {
    if (!c.done) cancelOnWorker(c, "request failed: " + why.message());
  }
  endRequest();
  ApiError e = apiErrorFor(why);
  // Before its first token a disaggregated request fails in its remote prefill; after it (or
  // colocated) on its decode worker.
  metrics_.requestError(
      e.type, route_ == Route::kDisaggregated && !firstTokenSeen_ ? metrics::kPoolPrefill : metrics::kPoolDecode);
  metrics_.inFlight.dec();
  if (spec_.parsed.req.stream && responses_) {
    http_->sendEvent(responses_->failed(e));
    http_->endStream();
  } else if (spec_.parsed.req.stream) {
    http_->sendEvent(sseEvent(e.toJson()));
    http_->sendEvent(kSseDone);
    http_->endStream();
  } else {
    sendError(http_, e);
  }
}

// Cancels the unfinished choices where they run and asks the loop for another decode worker;
// resume() continues them there. Without migrations left the request fails with `why`.
void RequestStream::migrateOnStrand(const Status& why, const char* reason) {
  if (finished_ || migrating_) return;
  if (migrations_ >= settings_.maxMigrations) return failOnStrand(why);
  std::vector<uint64_t> oldIds;
  size_t longest = 0;
  for (auto& c : choices_) {
    if (c.done) continue;
    cancelOnWorker(c, "moving to another decode worker");
    oldIds.push_back(c.workerRequestId);
    longest = std::max(longest, c.generated.size());
  }
  if (oldIds.empty()) return;
  ++migrations_;
  migrating_ = true;
  lostWhy_ = why;
  metrics_.requestMigrated(reason);
  PD_LOG(kInfo, kTag) << meta_.id << ": moving " << oldIds.size() << " choice(s) off decode worker " << decodeWorker_
                      << " (" << why.message() << "), migration " << migrations_ << " of " << settings_.maxMigrations;
  owner_.migrate(shared_from_this(), std::move(oldIds), int64_t(spec_.parsed.prompt.size() + longest), decodeWorker_);
}

// The gap of the move counts as one inter-token latency: it is what the client waited.
void RequestStream::resumeOnStrand(Dispatch d) {
  setDispatch(d);
  size_t next = 0;
  bool allSent = true;
  for (auto& c : choices_) {
    if (c.done) continue;
    c.workerRequestId = d.workerRequestIds.at(next++);
    c.tokensBeforeMove = int(c.generated.size());
    allSent = allSent && sendGenerate(c, d);
  }
  if (!allSent) failOnStrand(unavailable(lostWhy_.message() + "; decode worker " + decodeWorker_ + " is unreachable"));
}

// The client went away: cancel everything, answer nothing.
void RequestStream::abort(const std::string& reason) {
  if (finished_) return;
  for (auto& c : choices_)
    if (!c.done) cancelOnWorker(c, reason);
  endRequest();
  metrics_.requestFinished("abort", int64_t(spec_.parsed.prompt.size()), 0);
  metrics_.inFlight.dec();
}

// The request ended: no deadline any more, and every choice leaves the request table.
void RequestStream::endRequest() {
  finished_ = true;
  deadlineTimer_.cancel();
  heartbeatTimer_.cancel();
  std::vector<uint64_t> ended;
  for (auto& c : choices_) {
    if (!c.done) ended.push_back(c.workerRequestId);
    c.done = true;
  }
  if (!ended.empty()) owner_.choicesEnded(std::move(ended));
}

void RequestStream::cancelOnWorker(const Choice& c, const std::string& reason) {
  // A closed connection refuses the send: the worker left and holds nothing of it any more.
  if (!decodeConn_) return;
  proto::Envelope env;
  env.set_request_id(c.workerRequestId);
  env.mutable_cancel()->set_request_id(c.workerRequestId);
  env.mutable_cancel()->set_reason(reason);
  (void)decodeConn_->send(env);
}

}  // namespace pd::router
