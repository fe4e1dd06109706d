#include "router/router_service.h"

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "common/base/clock.h"
#include "common/base/log.h"
#include "common/metrics/pdserve_metrics.h"
#include "common/net/framed.h"
#include "common/net/http_server.h"
#include "common/net/io_pool.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/detokenizer.h"
#include "common/tokenizer/tokenizer.h"
#include "router/adaptive_threshold.h"
#include "router/autoscaler.h"
#include "router/openai_api.h"
#include "router/prefix_index.h"
#include "router/routing_policy.h"

namespace pd::router {
namespace {

using nlohmann::json;
using namespace std::chrono;
constexpr const char* kTag = "router";
// How often pdserve_desired_replicas is recomputed: one autoscaler window slice (60 s / 12).
constexpr auto kAutoscaleTick = std::chrono::seconds(5);

int64_t unixSeconds() {
  return duration_cast<seconds>(system_clock::now().time_since_epoch()).count();
}

std::string finishName(proto::FinishReason r) {
  switch (r) {
    case proto::FINISH_STOP: return "stop";
    case proto::FINISH_LENGTH: return "length";
    case proto::FINISH_ABORT: return "abort";
    case proto::FINISH_ERROR: return "error";
    default: return "";
  }
}

// A worker error as the HTTP status and OpenAI error object the client sees.
ApiError apiErrorFor(const Status& s) {
  ApiError e;
  e.message = s.message();
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange: e.status = 400; break;
    case StatusCode::kResourceExhausted:
      e.status = 429;
      e.type = "rate_limit_exceeded";
      e.code = "admission_refused";
      break;
    case StatusCode::kUnavailable:
    case StatusCode::kDeadlineExceeded:
      e.status = 503;
      e.type = "service_unavailable";
      break;
    default:
      e.status = 500;
      e.type = "internal_error";
  }
  return e;
}

struct Worker {
  std::string id;
  WorkerRole role = WorkerRole::kDecode;
  std::string address;  // prefill: where decode workers dial it
  net::ConnectionPtr conn;
  proto::LoadReport report;
  SteadyTime lastReport;
};

// One choice of one HTTP request: a request on a decode worker.
struct Choice {
  int index = 0;
  uint64_t workerRequestId = 0;
  std::string decodeWorker;
  std::unique_ptr<tok::IncrementalDetokenizer> detok;
  std::string held;        // text not yet sent: may be the start of a stop string
  std::string text;        // everything sent (non-streaming: the answer)
  std::vector<TokenLogprob> logprobs;  // non-streaming
  std::vector<int32_t> tokenIds;       // non-streaming, with return_token_ids
  int completionTokens = 0;
  bool done = false;
  std::string finishReason;  // set when done
  std::optional<SteadyTime> lastTokenAt;
};

struct Stream {
  GenerationRequest req;
  std::shared_ptr<net::HttpResponder> http;
  ResponseMeta meta;
  std::vector<Choice> choices;
  int promptTokens = 0;
  std::string promptText;  // for echo
  Route route = Route::kColocated;
  SteadyTime received;
  Deadline deadline;
  bool firstTokenSeen = false;
  bool finished = false;
  std::string decodeWorker, prefillWorker;  // for the x-pdserve-* headers
};

class RouterServiceImpl final : public RouterService {
 public:
  RouterServiceImpl(RouterOptions o, std::shared_ptr<const tok::Tokenizer> tokenizer,
                    std::unique_ptr<tok::ChatTemplate> chat, std::string modelName, int64_t maxModelLen,
                    int vocab)
      : options_(std::move(o)),
        cfg_(options_.config),
        tokenizer_(std::move(tokenizer)),
        chat_(std::move(chat)),
        modelName_(std::move(modelName)),
        maxModelLen_(maxModelLen),
        vocab_(vocab),
        policy_({cfg_.router.shortPromptTokens}),
        prefixAware_(cfg_.router.prefixAwareRouting && cfg_.engine.enablePrefixCaching),
        prefixIndex_(cfg_.engine.blockSize),
        autoscaler_(PoolSlo{cfg_.pools.prefill.slo.ttftMs / 1e3, cfg_.pools.prefill.slo.percentile,
                            cfg_.pools.prefill.minReplicas, cfg_.pools.prefill.maxReplicas},
                    PoolSlo{cfg_.pools.decode.slo.itlMs / 1e3, cfg_.pools.decode.slo.percentile,
                            cfg_.pools.decode.minReplicas, cfg_.pools.decode.maxReplicas}),
        threshold_(cfg_.router.adaptiveThreshold
                       ? std::optional<AdaptiveThreshold>(AdaptiveThreshold(cfg_.router.shortPromptTokens))
                       : std::nullopt),
        io_(2, "router-io"),
        metrics_(registry_, metrics::LatencyBuckets{cfg_.router.ttftBucketsS, cfg_.router.itlBucketsS,
                                                    cfg_.router.e2eBucketsS}) {
    metrics_.setSlo(metrics::kPoolPrefill, cfg_.pools.prefill.slo.ttftMs / 1e3, cfg_.pools.prefill.slo.percentile);
    metrics_.setSlo(metrics::kPoolDecode, cfg_.pools.decode.slo.itlMs / 1e3, cfg_.pools.decode.slo.percentile);
    metrics_.setShortPromptTokens(cfg_.router.shortPromptTokens);
  }

  ~RouterServiceImpl() override { stop(); }

  Status start() override {
    net::ConnectionOptions copts;
    copts.hello.set_role(proto::ROLE_ROUTER);
    copts.hello.set_worker_id("router");
    net::ConnectionCallbacks cb;
    cb.onOpen = [this](const net::ConnectionPtr& c) { onWorkerOpen(c); };
    cb.onMessage = [this](const net::ConnectionPtr& c, proto::Envelope&& env) { onWorkerMessage(c, std::move(env)); };
    cb.onClose = [this](const net::ConnectionPtr& c, const Status& why) { onWorkerClose(c, why); };
    int controlPort = options_.controlPort >= 0 ? options_.controlPort : cfg_.router.controlPort;
    std::string host = options_.host.empty() ? cfg_.router.host : options_.host;
    PD_ASSIGN_OR_RETURN(control_, net::FramedServer::listen(io_, host, controlPort, copts, cb));

    net::HttpServerOptions hopts;
    hopts.host = host;
    hopts.port = static_cast<uint16_t>(options_.port >= 0 ? options_.port : cfg_.router.port);
    hopts.maxBodyBytes = static_cast<size_t>(cfg_.router.maxBodyBytes);
    http_ = std::make_unique<net::HttpServer>(io_.context(), hopts,
                                              [this](net::HttpRequest req, std::shared_ptr<net::HttpResponder> r) {
                                                onHttp(std::move(req), std::move(r));
                                              });
    PD_RETURN_IF_ERROR(http_->start());
    sweeper_ = std::thread([this] { sweepLoop(); });
    PD_LOG(kInfo, kTag) << "serving " << modelName_ << " on http://" << host << ":" << http_->port()
                        << ", workers register on port " << control_->port();
    return Status::ok();
  }

  void stop() override {
    if (stopping_.exchange(true)) return;
    if (sweeper_.joinable()) sweeper_.join();
    if (http_) http_->stop();
    if (control_) control_->stop();
    io_.stop();
  }

  int httpPort() const override { return http_ ? http_->port() : 0; }
  int controlPort() const override { return control_ ? control_->port() : 0; }

 private:
  // ---- HTTP ----------------------------------------------------------------------------------
  void onHttp(net::HttpRequest req, std::shared_ptr<net::HttpResponder> r) {
    const std::string path = req.path();
    if (path == "/health") {
      bool ok = healthyDecodeWorkers() > 0;
      return r->sendFull(ok ? 200 : 503, {{"content-type", "text/plain"}}, ok ? "" : "no healthy decode worker\n");
    }
    if (!cfg_.router.apiKeys.empty() && !authorized(req)) {
      ApiError e;
      e.status = 401;
      e.message = "missing or invalid API key (send Authorization: Bearer <key>)";
      e.code = "invalid_api_key";
      metrics_.requestError("authentication_error");
      return sendError(r, e);
    }
    if (path == "/metrics") {
      return r->sendFull(200, {{"content-type", "text/plain; version=0.0.4"}}, registry_.serialize());
    }
    if (path == "/version") return sendJson(r, 200, json{{"version", PD_VERSION}});
    if (path == "/load") return sendJson(r, 200, json{{"server_load", metrics_.inFlight.value()}});
    if (path == "/v1/models" && req.method == "GET") return sendJson(r, 200, modelsJson());
    if (req.method != "POST" && (path == "/v1/completions" || path == "/v1/chat/completions" ||
                                 path == "/tokenize" || path == "/detokenize")) {
      ApiError e;
      e.status = 405;
      e.message = req.method + " " + path + ": use POST";
      return sendError(r, e);
    }
    if (path == "/v1/completions") return onGenerate(req, r, Endpoint::kCompletions);
    if (path == "/v1/chat/completions") return onGenerate(req, r, Endpoint::kChat);
    if (path == "/tokenize") return onTokenize(req, r);
    if (path == "/detokenize") return onDetokenize(req, r);
    ApiError e;
    e.status = 404;
    e.message = "no route for " + req.method + " " + path;
    e.code = "not_found";
    sendError(r, e);
  }

  bool authorized(const net::HttpRequest& req) const {
    std::string h = req.header("authorization");
    const std::string prefix = "Bearer ";
    if (h.compare(0, prefix.size(), prefix) != 0) return false;
    std::string key = h.substr(prefix.size());
    for (const auto& k : cfg_.router.apiKeys)
      if (k == key) return true;
    return false;
  }

  static void sendJson(const std::shared_ptr<net::HttpResponder>& r, int status, const json& j,
                       net::HttpHeaders headers = {}) {
    headers["content-type"] = "application/json";
    r->sendFull(status, std::move(headers), j.dump(-1, ' ', false, json::error_handler_t::replace));
  }

  void sendError(const std::shared_ptr<net::HttpResponder>& r, const ApiError& e) {
    net::HttpHeaders h;
    if (e.status == 429 || e.status == 503) h["retry-after"] = "1";
    sendJson(r, e.status, e.toJson(), std::move(h));
  }

  json modelsJson() const {
    return json{{"object", "list"},
                {"data", json::array({json{{"id", modelName_},
                                           {"object", "model"},
                                           {"created", startedAt_},
                                           {"owned_by", "pdserve"},
                                           {"root", cfg_.model.path},
                                           {"max_model_len", maxModelLen_}}})}};
  }

  // Tokenizes the prompt of a parsed request; errors are 400s naming the field.
  std::variant<std::vector<int32_t>, ApiError> promptIds(const GenerationRequest& req, std::string* text) {
    if (req.endpoint == Endpoint::kChat) {
      nlohmann::ordered_json messages = nlohmann::ordered_json::array();
      for (const auto& m : req.messages) messages.push_back({{"role", m.role}, {"content", m.content}});
      tok::ChatOptions opts;
      opts.addGenerationPrompt = req.addGenerationPrompt;
      auto rendered = chat_->render(messages, opts);
      if (!rendered.ok()) return badRequest("messages: " + rendered.status().message(), "messages");
      *text = rendered.value();
      auto ids = tokenizer_->encode(*text, /*addSpecialTokens=*/false);
      if (!ids.ok()) return badRequest("messages: " + ids.status().message(), "messages");
      return ids.value();
    }
    if (req.promptIds) {
      for (int32_t id : *req.promptIds)
        if (id >= vocab_) return badRequest("prompt: token id " + std::to_string(id) + " is outside the vocabulary of " + std::to_string(vocab_), "prompt");
      if (req.echo) *text = tokenizer_->decode(*req.promptIds);
      return *req.promptIds;
    }
    *text = *req.promptText;
    auto ids = tokenizer_->encode(*req.promptText, /*addSpecialTokens=*/true);
    if (!ids.ok()) return badRequest("prompt: " + ids.status().message(), "prompt");
    return ids.value();
  }

  void onGenerate(const net::HttpRequest& httpReq, const std::shared_ptr<net::HttpResponder>& r,
                  Endpoint endpoint) {
    auto parsed = parseGenerationRequest(httpReq.body, endpoint);
    if (auto* e = std::get_if<ApiError>(&parsed)) {
      metrics_.requestError(e->type);
      return sendError(r, *e);
    }
    GenerationRequest req = std::move(std::get<GenerationRequest>(parsed));
    if (!req.model.empty() && req.model != modelName_) {
      metrics_.requestError("model_not_found");
      return sendError(r, modelNotFound(req.model));
    }
    std::string promptText;
    auto ids = promptIds(req, &promptText);
    if (auto* e = std::get_if<ApiError>(&ids)) {
      metrics_.requestError(e->type);
      return sendError(r, *e);
    }
    std::vector<int32_t> prompt = std::move(std::get<std::vector<int32_t>>(ids));
    const int64_t limit = cfg_.router.maxPromptTokens > 0 ? std::min<int64_t>(cfg_.router.maxPromptTokens, maxModelLen_) : maxModelLen_;
    if (int64_t(prompt.size()) >= limit) {
      ApiError e;
      e.status = 413;
      e.message = "This model's maximum context length is " + std::to_string(limit) +
                  " tokens; the prompt has " + std::to_string(prompt.size()) + " tokens.";
      e.param = endpoint == Endpoint::kChat ? "messages" : "prompt";
      e.code = "context_length_exceeded";
      metrics_.requestError("context_length_exceeded");
      return sendError(r, e);
    }
    if (prompt.empty()) return sendError(r, badRequest("prompt: must not be empty", "prompt"));
    int maxTokens = req.maxTokens ? *req.maxTokens
                                  : endpoint == Endpoint::kCompletions ? 16 : int(maxModelLen_ - int64_t(prompt.size()));
    if (int64_t(prompt.size()) + maxTokens > maxModelLen_) {
      return sendError(r, badRequest("max_tokens: " + std::to_string(maxTokens) + " + " +
                                         std::to_string(prompt.size()) + " prompt tokens exceeds the context of " +
                                         std::to_string(maxModelLen_) + " tokens",
                                     "max_tokens"));
    }
    if (maxTokens == 0) maxTokens = 1;  // echo-only requests still run one step

    auto stream = std::make_shared<Stream>();
    stream->req = std::move(req);
    stream->http = r;
    stream->promptTokens = int(prompt.size());
    stream->promptText = std::move(promptText);
    stream->received = steadyNow();
    stream->deadline = Deadline::in(milliseconds(cfg_.router.requestTimeoutMs));
    stream->meta = {std::string(endpoint == Endpoint::kChat ? "chatcmpl-" : "cmpl-"), unixSeconds(), modelName_};

    const std::vector<uint64_t> blocks = prefixAware_ ? prefixIndex_.blockHashes(prompt) : std::vector<uint64_t>{};
    std::lock_guard<std::mutex> lock(mu_);
    stream->meta.id += std::to_string(nextRequestId_);
    std::vector<WorkerView> views = snapshotLocked();
    if (!blocks.empty())
      for (auto& v : views) v.cachedTokens = prefixIndex_.cachedTokens(v.id, blocks);
    auto plan = policy_.select(int64_t(prompt.size()), views);
    if (!plan) {
      ApiError e;
      e.status = 503;
      e.type = "service_unavailable";
      e.message = "no healthy decode worker; retry later";
      metrics_.requestError("no_worker");
      return sendError(r, e);
    }
    stream->route = plan->route;
    stream->decodeWorker = plan->decodeWorker;
    stream->prefillWorker = plan->prefillWorker;
    metrics_.routeDecision(routeName(plan->route), plan->reason);
    metrics_.predictedCachedTokens(plan->cachedTokens);
    // Both workers hold the prompt's blocks afterwards (the decode worker caches what it
    // received), as far as their pools keep them.
    for (const std::string& w : {plan->decodeWorker, plan->prefillWorker})
      if (!w.empty() && !blocks.empty()) prefixIndex_.record(w, blocks, totalBlocksLocked(w));
    for (int i = 0; i < stream->req.n; ++i) {
      Choice c;
      c.index = i;
      c.workerRequestId = nextRequestId_++;
      c.decodeWorker = plan->decodeWorker;
      c.detok = std::make_unique<tok::IncrementalDetokenizer>(tokenizer_, /*skipSpecialTokens=*/true);
      proto::Envelope env;
      env.set_request_id(c.workerRequestId);
      auto* g = env.mutable_generate();
      g->set_request_id(c.workerRequestId);
      for (int32_t id : prompt) g->add_prompt_token_ids(uint32_t(id));
      auto* s = g->mutable_sampling();
      const auto& q = stream->req;
      s->set_temperature(q.temperature);
      s->set_top_k(q.topK);
      s->set_top_p(q.topP);
      s->set_min_p(q.minP);
      if (q.seed) s->set_seed(*q.seed + uint64_t(i));  // n choices differ, each reproducible
      s->set_max_tokens(uint32_t(maxTokens));
      for (int32_t id : q.stopTokenIds) s->add_stop_token_ids(uint32_t(id));
      s->set_ignore_eos(q.ignoreEos);
      s->set_logprobs(uint32_t(q.topLogprobs));
      s->set_return_logprobs(q.logprobs);
      g->set_route(plan->route == Route::kColocated ? proto::ROUTE_COLOCATED : proto::ROUTE_DISAGGREGATED);
      if (plan->route == Route::kDisaggregated) {
        g->set_prefill_worker_id(plan->prefillWorker);
        g->set_prefill_worker_address(workers_.at(plan->prefillWorker).address);
      }
      g->set_deadline_ms(uint64_t(cfg_.router.requestTimeoutMs));
      Status sent = workers_.at(plan->decodeWorker).conn->send(std::move(env));
      if (!sent.isOk()) {
        c.done = true;
        PD_LOG(kWarn, kTag) << "decode worker " << plan->decodeWorker << ": " << sent.toString();
      }
      byWorkerRequest_[c.workerRequestId] = stream;
      stream->choices.push_back(std::move(c));
    }
    metrics_.inFlight.inc();
    if (stream->req.stream) {
      net::HttpHeaders h{{"x-pdserve-route", routeName(plan->route)},
                         {"x-pdserve-decode-worker", plan->decodeWorker},
                         {"x-request-id", stream->meta.id}};
      if (!plan->prefillWorker.empty()) h["x-pdserve-prefill-worker"] = plan->prefillWorker;
      r->startStream(200, std::move(h));
      for (auto& c : stream->choices) {
        ChoiceDelta d;
        d.index = c.index;
        d.first = endpoint == Endpoint::kChat;
        if (stream->req.echo) d.text = stream->promptText;
        if (d.first || !d.text.empty()) r->sendEvent(sseEvent(streamChunk(endpoint, stream->meta, d, false)));
      }
    }
    std::weak_ptr<Stream> weak = stream;
    r->onDisconnect([this, weak] {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto s = weak.lock()) abortLocked(*s, "client disconnected");
    });
    bool anySent = false;
    for (auto& c : stream->choices) anySent |= !c.done;
    if (!anySent) failStreamLocked(*stream, unavailable("decode worker " + plan->decodeWorker + " is unreachable"));
  }

  // ---- control plane -------------------------------------------------------------------------
  void onWorkerOpen(const net::ConnectionPtr& c) {
    const auto& hello = c->peerHello();
    if (hello.role() != proto::ROLE_PREFILL && hello.role() != proto::ROLE_DECODE) {
      return c->close(failedPrecondition("only prefill and decode workers register here"));
    }
    if (hello.model_fingerprint().rfind(modelName_ + "/", 0) != 0) {
      return c->close(failedPrecondition("worker serves '" + hello.model_fingerprint() +
                                         "', this router serves '" + modelName_ + "'"));
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (workers_.count(hello.worker_id()) && workers_.at(hello.worker_id()).conn->isOpen()) {
      return c->close(failedPrecondition("worker id '" + hello.worker_id() + "' is already registered"));
    }
    Worker w;
    w.id = hello.worker_id();
    w.role = hello.role() == proto::ROLE_PREFILL ? WorkerRole::kPrefill : WorkerRole::kDecode;
    w.address = hello.address();
    w.conn = c;
    w.lastReport = steadyNow();
    w.report.set_total_blocks(hello.total_blocks());
    w.report.set_free_blocks(hello.total_blocks());
    workers_[w.id] = std::move(w);
    PD_LOG(kInfo, kTag) << (hello.role() == proto::ROLE_PREFILL ? "prefill" : "decode") << " worker '"
                        << hello.worker_id() << "' registered from " << c->remoteAddress();
    updatePoolGaugesLocked();
  }

  void onWorkerClose(const net::ConnectionPtr& c, const Status& why) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = workers_.begin(); it != workers_.end(); ++it) {
      if (it->second.conn != c) continue;
      PD_LOG(kWarn, kTag) << "worker '" << it->first << "' left: " << why.message();
      const std::string id = it->first;
      workers_.erase(it);
      prefixIndex_.forget(id);
      std::vector<std::shared_ptr<Stream>> affected;
      for (auto& [rid, s] : byWorkerRequest_)
        for (auto& ch : s->choices)
          if (ch.workerRequestId == rid && ch.decodeWorker == id && !ch.done) affected.push_back(s);
      for (auto& s : affected) failStreamLocked(*s, unavailable("decode worker '" + id + "' disconnected"));
      break;
    }
    updatePoolGaugesLocked();
  }

  void onWorkerMessage(const net::ConnectionPtr& c, proto::Envelope&& env) {
    std::lock_guard<std::mutex> lock(mu_);
    switch (env.body_case()) {
      case proto::Envelope::kLoadReport: {
        auto it = workers_.find(env.load_report().worker_id());
        if (it != workers_.end() && it->second.conn == c) {
          it->second.report = env.load_report();
          it->second.lastReport = steadyNow();
          exportWorkerLoad(it->second);
        }
        return;
      }
      case proto::Envelope::kTokenChunk: return onChunkLocked(env.token_chunk());
      default:
        PD_LOG(kWarn, kTag) << "ignoring '" << net::bodyName(env) << "' from " << c->remoteAddress();
    }
  }

  // The router's view of each worker, from its load reports: what routing decided on.
  void exportWorkerLoad(const Worker& w) {
    metrics::Labels labels{{"worker", w.id},
                           {"pool", std::string(w.role == WorkerRole::kPrefill ? metrics::kPoolPrefill : metrics::kPoolDecode)}};
    const auto& r = w.report;
    registry_.gauge("pdserve_worker_kv_free_blocks", "Free KV blocks per worker (load reports).", labels)
        .set(double(r.free_blocks()));
    registry_.gauge("pdserve_worker_kv_total_blocks", "KV blocks per worker (load reports).", labels)
        .set(double(r.total_blocks()));
    registry_.gauge("pdserve_worker_running", "Running requests per worker (load reports).", labels)
        .set(double(r.running()));
    registry_.gauge("pdserve_worker_queued_prefill_tokens", "Queued prefill tokens per worker (load reports).", labels)
        .set(double(r.queued_prefill_tokens()));
  }

  void onChunkLocked(const proto::TokenChunk& chunk) {
    auto it = byWorkerRequest_.find(chunk.request_id());
    if (it == byWorkerRequest_.end()) return;  // finished or cancelled meanwhile
    std::shared_ptr<Stream> s = it->second;
    Choice* c = nullptr;
    for (auto& ch : s->choices)
      if (ch.workerRequestId == chunk.request_id()) c = &ch;
    if (!c || c->done) return;
    const auto routeLabel = routeName(s->route);
    const SteadyTime now = steadyNow();
    if (chunk.token_ids_size() > 0) {
      if (!s->firstTokenSeen) {
        s->firstTokenSeen = true;
        const double ttft = secondsBetween(s->received, now);
        metrics_.observeTtft(routeLabel, ttft);
        if (s->route == Route::kDisaggregated) autoscaler_.observeTtft(now, ttft);
      } else if (c->lastTokenAt) {
        const double itl = secondsBetween(*c->lastTokenAt, now);
        metrics_.observeItl(routeLabel, itl);
        autoscaler_.observeItl(now, itl);
      }
      for (int k = 1; k < chunk.token_ids_size(); ++k) {
        metrics_.observeItl(routeLabel, 0.0);
        autoscaler_.observeItl(now, 0.0);
      }
      c->lastTokenAt = now;
    }
    if (chunk.finish_reason() == proto::FINISH_ERROR) {
      Status why = net::fromProtoError(chunk.error());
      if (why.isOk()) why = internalError("the worker failed the request without a reason");
      return failStreamLocked(*s, why);
    }
    std::string delta;
    std::vector<TokenLogprob> lps;
    std::vector<int32_t> ids(chunk.token_ids().begin(), chunk.token_ids().end());
    for (int k = 0; k < chunk.token_ids_size(); ++k) {
      int32_t id = int32_t(chunk.token_ids(k));
      delta += c->detok->push(id);
      ++c->completionTokens;
      if (s->req.logprobs && k < chunk.logprobs_size()) lps.push_back(logprobOf(chunk.logprobs(k)));
    }
    std::optional<std::string> finish;
    if (chunk.finish_reason() != proto::FINISH_NONE) {
      delta += c->detok->finish();
      finish = finishName(chunk.finish_reason());
    }
    bool stopped = applyStop(*s, *c, delta, finish.has_value());
    if (stopped) {
      finish = "stop";
      cancelOnWorkerLocked(*c, "stop string matched");
    }
    emitLocked(*s, *c, delta, std::move(lps), std::move(ids), finish);
    if (finish) {
      if (chunk.has_timings()) metrics_.observeQueueTime(routeLabel, chunk.timings().queue_ms() / 1e3);
      c->done = true;
      byWorkerRequest_.erase(c->workerRequestId);
      if (chunk.has_usage() && !stopped) c->completionTokens = int(chunk.usage().completion_tokens());
      maybeCompleteLocked(*s);
    }
  }

  TokenLogprob logprobOf(const proto::TokenLogprob& lp) const {
    TokenLogprob t;
    int32_t id = int32_t(lp.token_id());
    t.token = tokenizer_->decode(std::span<const int32_t>(&id, 1));
    t.logprob = lp.logprob();
    for (const auto& top : lp.top()) {
      int32_t tid = int32_t(top.token_id());
      t.top.emplace_back(tokenizer_->decode(std::span<const int32_t>(&tid, 1)), top.logprob());
    }
    return t;
  }

  // Appends `delta` to the choice's held text and moves to `delta` what can be sent: text
  // that cannot be the start of a stop string. Returns true when a stop string matched
  // (the text is cut before it).
  bool applyStop(const Stream& s, Choice& c, std::string& delta, bool final) {
    if (s.req.stop.empty()) return false;
    c.held += delta;
    delta.clear();
    size_t cut = std::string::npos;
    for (const auto& stop : s.req.stop) cut = std::min(cut, c.held.find(stop));
    if (cut != std::string::npos) {
      delta = c.held.substr(0, cut);
      c.held.clear();
      return true;
    }
    size_t keep = 0;
    if (!final) {
      for (const auto& stop : s.req.stop) {
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

  void emitLocked(Stream& s, Choice& c, const std::string& delta, std::vector<TokenLogprob> lps,
                  std::vector<int32_t> ids, const std::optional<std::string>& finish) {
    if (s.req.stream) {
      // One event per step that produced tokens, even when their text is held back (an
      // unfinished UTF-8 sequence, a possible stop string): clients time tokens by events.
      if (delta.empty() && !finish && ids.empty()) return;
      ChoiceDelta d;
      d.index = c.index;
      d.text = delta;
      d.logprobs = std::move(lps);
      d.finishReason = finish;
      if (s.req.returnTokenIds) d.tokenIds = std::move(ids);
      s.http->sendEvent(sseEvent(streamChunk(s.req.endpoint, s.meta, d, s.req.logprobs)));
    } else {
      for (auto& lp : lps) c.logprobs.push_back(std::move(lp));
      c.tokenIds.insert(c.tokenIds.end(), ids.begin(), ids.end());
    }
    c.text += delta;
    if (finish) c.finishReason = *finish;
  }

  void maybeCompleteLocked(Stream& s) {
    for (const auto& c : s.choices)
      if (!c.done) return;
    if (s.finished) return;
    s.finished = true;
    Usage usage;
    usage.promptTokens = s.promptTokens;
    for (const auto& c : s.choices) usage.completionTokens += c.completionTokens;
    std::string reason;
    if (s.req.stream) {
      if (s.req.includeUsage) s.http->sendEvent(sseEvent(usageChunk(s.req.endpoint, s.meta, usage)));
      s.http->sendEvent(kSseDone);
      s.http->endStream();
    } else {
      std::vector<ChoiceDelta> out;
      for (auto& c : s.choices) {
        ChoiceDelta d;
        d.index = c.index;
        d.text = (s.req.echo ? s.promptText : std::string()) + c.text;
        d.logprobs = c.logprobs;
        d.finishReason = c.finishReason;
        if (s.req.returnTokenIds) d.tokenIds = c.tokenIds;
        out.push_back(std::move(d));
      }
      net::HttpHeaders headers{{"x-pdserve-route", routeName(s.route)},
                               {"x-pdserve-decode-worker", s.decodeWorker},
                               {"x-request-id", s.meta.id}};
      if (!s.prefillWorker.empty()) headers["x-pdserve-prefill-worker"] = s.prefillWorker;
      sendJson(s.http, 200, fullResponse(s.req.endpoint, s.meta, out, usage, s.req.logprobs), std::move(headers));
    }
    for (const auto& c : s.choices) reason = c.finishReason;
    const auto routeLabel = routeName(s.route);
    metrics_.observeE2e(routeLabel, secondsBetween(s.received, steadyNow()));
    metrics_.requestFinished(reason, usage.promptTokens, usage.completionTokens);
    metrics_.inFlight.dec();
  }

  // Ends every unfinished choice of the stream with an error.
  void failStreamLocked(Stream& s, const Status& why) {
    if (s.finished) return;
    for (auto& c : s.choices) {
      if (!c.done) cancelOnWorkerLocked(c, "request failed: " + why.message());
      c.done = true;
      byWorkerRequest_.erase(c.workerRequestId);
    }
    s.finished = true;
    ApiError e = apiErrorFor(why);
    metrics_.requestError(e.type);
    metrics_.inFlight.dec();
    if (s.req.stream) {
      s.http->sendEvent(sseEvent(e.toJson()));
      s.http->sendEvent(kSseDone);
      s.http->endStream();
    } else {
      sendError(s.http, e);
    }
  }

  // The client went away: cancel everything, answer nothing.
  void abortLocked(Stream& s, const std::string& reason) {
    if (s.finished) return;
    s.finished = true;
    for (auto& c : s.choices) {
      if (!c.done) cancelOnWorkerLocked(c, reason);
      c.done = true;
      byWorkerRequest_.erase(c.workerRequestId);
    }
    metrics_.requestFinished("abort", s.promptTokens, 0);
    metrics_.inFlight.dec();
  }

  void cancelOnWorkerLocked(const Choice& c, const std::string& reason) {
    auto w = workers_.find(c.decodeWorker);
    if (w == workers_.end()) return;
    proto::Envelope env;
    env.set_request_id(c.workerRequestId);
    env.mutable_cancel()->set_request_id(c.workerRequestId);
    env.mutable_cancel()->set_reason(reason);
    (void)w->second.conn->send(std::move(env));
  }

  // ---- tokenize / detokenize ------------------------------------------------------------------
  void onTokenize(const net::HttpRequest& req, const std::shared_ptr<net::HttpResponder>& r) {
    json body = json::parse(req.body, nullptr, false);
    if (body.is_discarded() || !body.is_object()) return sendError(r, badRequest("request body must be a JSON object"));
    if (body.contains("model") && body["model"].is_string() && body["model"] != modelName_) {
      return sendError(r, modelNotFound(body["model"].get<std::string>()));
    }
    std::vector<int32_t> ids;
    if (body.contains("messages")) {
      auto parsed = parseGenerationRequest(req.body, Endpoint::kChat);
      if (auto* e = std::get_if<ApiError>(&parsed)) return sendError(r, *e);
      std::string text;
      auto got = promptIds(std::get<GenerationRequest>(parsed), &text);
      if (auto* e = std::get_if<ApiError>(&got)) return sendError(r, *e);
      ids = std::get<std::vector<int32_t>>(got);
    } else {
      if (!body.contains("prompt") || !body["prompt"].is_string()) return sendError(r, badRequest("prompt: required string", "prompt"));
      bool addSpecial = body.value("add_special_tokens", true);
      auto got = tokenizer_->encode(body["prompt"].get<std::string>(), addSpecial);
      if (!got.ok()) return sendError(r, badRequest("prompt: " + got.status().message(), "prompt"));
      ids = got.value();
    }
    json out{{"count", ids.size()}, {"max_model_len", maxModelLen_}, {"tokens", ids}};
    if (body.value("return_token_strs", false)) {
      json strs = json::array();
      for (int32_t id : ids) strs.push_back(tokenizer_->idToToken(id));
      out["token_strs"] = strs;
    }
    sendJson(r, 200, out);
  }

  void onDetokenize(const net::HttpRequest& req, const std::shared_ptr<net::HttpResponder>& r) {
    json body = json::parse(req.body, nullptr, false);
    if (body.is_discarded() || !body.is_object() || !body.contains("tokens") || !body["tokens"].is_array()) {
      return sendError(r, badRequest("tokens: required array of token ids", "tokens"));
    }
    std::vector<int32_t> ids;
    for (const auto& t : body["tokens"]) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= vocab_) {
        return sendError(r, badRequest("tokens: " + t.dump() + " is not a token id of this model", "tokens"));
      }
      ids.push_back(int32_t(t.get<int64_t>()));
    }
    sendJson(r, 200, json{{"prompt", tokenizer_->decode(ids)}});
  }

  // ---- registry --------------------------------------------------------------------------------
  std::vector<WorkerView> snapshotLocked() const {
    std::vector<WorkerView> out;
    const auto now = steadyNow();
    for (const auto& [id, w] : workers_) {
      WorkerView v;
      v.id = id;
      v.role = w.role;
      v.healthy = w.conn->isOpen() &&
                  now - w.lastReport <= milliseconds(cfg_.router.workerReportTimeoutMs);
      v.queuedPrefillTokens = int64_t(w.report.queued_prefill_tokens());
      v.running = int(w.report.running());
      v.waiting = int(w.report.waiting());
      v.freeBlocks = int64_t(w.report.free_blocks());
      v.totalBlocks = int64_t(w.report.total_blocks());
      out.push_back(v);
    }
    return out;
  }

  int64_t totalBlocksLocked(const std::string& worker) const {
    auto it = workers_.find(worker);
    return it == workers_.end() ? 0 : int64_t(it->second.report.total_blocks());
  }

  int healthyDecodeWorkers() {
    std::lock_guard<std::mutex> lock(mu_);
    int n = 0;
    for (const auto& v : snapshotLocked()) n += v.healthy && v.role == WorkerRole::kDecode;
    return n;
  }

  void updatePoolGaugesLocked() {
    int prefill = 0, decode = 0;
    for (const auto& [id, w] : workers_) (w.role == WorkerRole::kPrefill ? prefill : decode)++;
    metrics_.setPoolWorkers(metrics::kPoolPrefill, prefill);
    metrics_.setPoolWorkers(metrics::kPoolDecode, decode);
  }

  // Every tick: pdserve_desired_replicas and the SLO window gauges of both pools (a change of
  // recommendation is logged with its reason), and the adaptive threshold when it is on.
  void autoscaleLocked(SteadyTime now) {
    int prefill = 0, decode = 0;
    for (const auto& v : snapshotLocked()) (v.role == WorkerRole::kPrefill ? prefill : decode) += v.healthy;
    const std::pair<std::string_view, ScalingDecision> pools[] = {
        {metrics::kPoolPrefill, autoscaler_.decidePrefill(prefill, now)},
        {metrics::kPoolDecode, autoscaler_.decideDecode(decode, now)}};
    if (threshold_) {
      std::string why;
      const int64_t before = threshold_->value();
      const int64_t after = threshold_->update({pools[0].second.ratio, pools[0].second.enoughSamples},
                                               {pools[1].second.ratio, pools[1].second.enoughSamples}, &why);
      if (after != before) {
        policy_.setShortPromptTokens(after);
        metrics_.setShortPromptTokens(after);
        PD_LOG(kInfo, kTag) << "short_prompt_tokens " << before << " -> " << after << " (" << why << ")";
      }
    }
    for (const auto& [pool, d] : pools) {
      metrics_.setSloWindow(pool, d.observedSeconds, d.attainment);
      metrics_.setDesiredReplicas(pool, d.desired);
      int& last = pool == metrics::kPoolPrefill ? lastDesiredPrefill_ : lastDesiredDecode_;
      if (d.desired != last) {
        PD_LOG(kInfo, kTag) << pool << " pool: " << d.current << " healthy, recommending " << d.desired
                            << " (" << d.reason << ", " << d.samples << " samples)";
        last = d.desired;
      }
    }
  }

  // Request deadlines: a request past router.request_timeout_ms ends with a 503-class error.
  // The autoscaler's recommendation is refreshed every kAutoscaleTick.
  void sweepLoop() {
    SteadyTime nextAutoscale = steadyNow();
    while (!stopping_) {
      std::this_thread::sleep_for(milliseconds(100));
      std::lock_guard<std::mutex> lock(mu_);
      if (const SteadyTime now = steadyNow(); now >= nextAutoscale) {
        autoscaleLocked(now);
        nextAutoscale = now + kAutoscaleTick;
      }
      std::vector<std::shared_ptr<Stream>> late;
      for (auto& [rid, s] : byWorkerRequest_)
        if (!s->finished && s->deadline.expired()) late.push_back(s);
      for (auto& s : late)
        failStreamLocked(*s, deadlineExceeded("request did not finish within " +
                                              std::to_string(cfg_.router.requestTimeoutMs) + " ms"));
    }
  }

  RouterOptions options_;
  const config::ClusterConfig& cfg_;
  std::shared_ptr<const tok::Tokenizer> tokenizer_;
  std::unique_ptr<tok::ChatTemplate> chat_;
  std::string modelName_;
  int64_t maxModelLen_;
  int vocab_;
  RoutingPolicy policy_;
  const bool prefixAware_;
  PrefixIndex prefixIndex_;  // under mu_ (blockHashes() is const and safe without it)
  Autoscaler autoscaler_;  // under mu_
  std::optional<AdaptiveThreshold> threshold_;  // under mu_; set when router.adaptive_threshold
  int lastDesiredPrefill_ = -1, lastDesiredDecode_ = -1;  // under mu_: for the change log
  net::IoPool io_;
  metrics::Registry registry_;
  metrics::RouterMetrics metrics_;
  std::unique_ptr<net::FramedServer> control_;
  std::unique_ptr<net::HttpServer> http_;
  std::thread sweeper_;
  std::atomic<bool> stopping_{false};
  const int64_t startedAt_ = unixSeconds();

  std::mutex mu_;
  std::unordered_map<std::string, Worker> workers_;
  std::unordered_map<uint64_t, std::shared_ptr<Stream>> byWorkerRequest_;
  uint64_t nextRequestId_ = 1;
};

}  // namespace

Result<std::unique_ptr<RouterService>> RouterService::create(RouterOptions options) {
  const auto& cfg = options.config;
  PD_ASSIGN_OR_RETURN(auto tokenizer, tok::Tokenizer::loadDir(cfg.model.path));
  PD_ASSIGN_OR_RETURN(auto chat, tok::ChatTemplate::forTokenizer(*tokenizer));
  // The router never loads weights: the context length and vocabulary come from config.json.
  std::ifstream in(cfg.model.path + "/config.json");
  json mc = json::parse(in, nullptr, false);
  if (mc.is_discarded() || !mc.is_object()) return notFound(cfg.model.path + "/config.json: missing or not JSON");
  int64_t maxModelLen = cfg.model.maxModelLen > 0 ? cfg.model.maxModelLen : mc.value("max_position_embeddings", int64_t(2048));
  int vocab = mc.value("vocab_size", int(tokenizer->vocabSize()));
  std::string name = cfg.model.name.empty() ? std::filesystem::path(cfg.model.path).filename().string() : cfg.model.name;
  return std::unique_ptr<RouterService>(new RouterServiceImpl(
      std::move(options), std::move(tokenizer), std::make_unique<tok::ChatTemplate>(std::move(chat)),
      std::move(name), maxModelLen, vocab));
}

}  // namespace pd::router
