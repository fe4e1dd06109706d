// Service wiring: the HTTP endpoints, the control port, and the order things start and stop.
// The request path: parse (router/request_parser.h, on the HTTP I/O thread) -> route
// (router/router_loop.h, on the loop's strand) -> dispatch and stream
// (router/request_stream.h, on the request's strand).
#include "router/router_service.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <thread>
#include <variant>

#include <nlohmann/json.hpp>

#include "common/base/clock.h"
#include "common/base/log.h"
#include "common/metrics/pdserve_metrics.h"
#include "common/net/framed.h"
#include "common/net/http_server.h"
#include "common/net/io_pool.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "router/api_keys.h"
#include "router/http_reply.h"
#include "router/openai_api.h"
#include "router/rate_limiter.h"
#include "router/request_parser.h"
#include "router/request_stream.h"
#include "router/router_loop.h"

namespace pd::router {
namespace {

using nlohmann::json;
constexpr const char* kTag = "router";
constexpr size_t kControlMaxFrameBytes = size_t{16} << 20;

int64_t unixSeconds() {
  using namespace std::chrono;
  return duration_cast<seconds>(system_clock::now().time_since_epoch()).count();
}

class RouterServiceImpl final : public RouterService {
 public:
  RouterServiceImpl(RouterOptions o, std::shared_ptr<const tok::Tokenizer> tokenizer,
                    std::unique_ptr<tok::ChatTemplate> chat, std::string modelName, int64_t maxModelLen, int vocab,
                    KeySet apiKeys)
      : options_(std::move(o)),
        apiKeys_(std::move(apiKeys)),
        rateLimiter_(options_.config.router.rateLimits),
        cfg_(options_.config),
        modelName_(modelName),
        parser_(std::move(tokenizer), std::move(chat),
                ParserLimits{modelName, maxModelLen, vocab, cfg_.router.maxPromptTokens,
                             cfg_.router.toolCallParser == config::ToolCallParser::kAuto
                                 ? std::nullopt
                                 : toolCallFormatFromName(
                                       enumName(config::kToolCallParserNames, cfg_.router.toolCallParser, ""))}),
        io_(2, "router-io"),
        metrics_(registry_,
                 metrics::LatencyBuckets{cfg_.router.ttftBucketsS, cfg_.router.itlBucketsS, cfg_.router.e2eBucketsS}),
        loop_(io_.context(), cfg_, modelName_, registry_, metrics_),
        streamSettings_{modelName_, cfg_.router.requestTimeoutMs, cfg_.router.maxMigrations,
                        cfg_.router.streamHeartbeatMs} {
    metrics_.setSlo(metrics::kPoolPrefill, cfg_.pools.prefill.slo.ttftMs / 1e3, cfg_.pools.prefill.slo.percentile);
    metrics_.setSlo(metrics::kPoolDecode, cfg_.pools.decode.slo.itlMs / 1e3, cfg_.pools.decode.slo.percentile);
    metrics_.setShortPromptTokens(cfg_.router.shortPromptTokens);
    rateLimitedRequests_ =
        registry_.counter("pdserve_router_rate_limited_total",
                          "Requests refused with 429 by router.admission.rate_limits", {{"limit", "requests_per_s"}});
    rateLimitedTokens_ =
        registry_.counter("pdserve_router_rate_limited_total",
                          "Requests refused with 429 by router.admission.rate_limits", {{"limit", "tokens_per_s"}});
    httpConnections_ = registry_.gauge("pdserve_router_http_connections", "Open connections on the HTTP API port");
    httpRefused_ =
        registry_.counter("pdserve_router_http_connections_closed_total",
                          "Connections closed because router.http.max_connections were open", {{"reason", "refused"}});
    httpEvicted_ = registry_.counter("pdserve_router_http_connections_closed_total",
                                     "Connections closed because router.http.max_connections were open",
                                     {{"reason", "evicted_idle"}});
  }

  ~RouterServiceImpl() override { stop(); }

  Status start() override {
    net::ConnectionOptions copts;
    copts.hello.set_role(proto::ROLE_ROUTER);
    // Workers send KV events only to a router that says it takes them (docs/kv_events.md).
    copts.hello.set_kv_events(cfg_.router.prefixAwareRouting && cfg_.router.exactPrefixRouting &&
                              cfg_.engine.enablePrefixCaching);
    copts.hello.set_worker_id("router");
    // Real control messages are small (the largest, a Generate, is ~4 bytes per prompt
    // token): 16 MiB holds a 4M-token prompt, and bounds what one worker connection buffers.
    copts.maxFrameBytes = kControlMaxFrameBytes;
    copts.plane = "router_control";
    metrics::setInternalAuth(registry_, cfg_.cluster.authenticated());
    metrics::exportProcessInfo(registry_, "router");
    if (cfg_.metrics.vllmCompatibleNames)
      metrics::exportVllmNames(registry_, metrics::MetricsProcess::kRouter, modelName_);
    if (cfg_.cluster.authenticated()) {
      copts.clusterSecret = std::make_shared<const std::string>(cfg_.cluster.secret);
    } else {
      PD_LOG(kWarn, kTag) << "internal planes are UNAUTHENTICATED (no cluster.secret_file): any peer that reaches "
                             "the control port can register as a worker and receive user traffic "
                             "(docs/security.md)";
    }
    copts.onAuthFailure = [this](const std::string& plane, const Status&) { metrics::authFailure(registry_, plane); };
    copts.onHandshakeFailure = [this](const std::string& plane, const char* why) {
      metrics::handshakeFailure(registry_, plane, why);
    };
    net::ConnectionCallbacks cb;
    cb.onOpen = [this](const net::ConnectionPtr& c) { loop_.workerOpened(c); };
    cb.onMessage = [this](const net::ConnectionPtr& c, proto::Envelope&& env) {
      loop_.workerMessage(c, std::move(env));
    };
    cb.onClose = [this](const net::ConnectionPtr& c, const Status& why) { loop_.workerClosed(c, why); };
    int controlPort = options_.controlPort >= 0 ? options_.controlPort : cfg_.router.controlPort;
    std::string host = options_.host.empty() ? cfg_.router.host : options_.host;
    PD_ASSIGN_OR_RETURN(control_, net::FramedServer::listen(io_, host, controlPort, copts, cb));

    if (cfg_.router.metricsAuth == config::MetricsAuth::kBearerFile) {
      PD_RETURN_IF_ERROR(loadMetricsToken());
    }
    net::HttpServerOptions hopts;
    hopts.host = host;
    hopts.port = static_cast<uint16_t>(options_.port >= 0 ? options_.port : cfg_.router.port);
    hopts.maxBodyBytes = static_cast<size_t>(cfg_.router.maxBodyBytes);
    hopts.maxConnections = static_cast<size_t>(cfg_.router.maxConnections);
    hopts.headerTimeoutMs = cfg_.router.headerTimeoutMs;
    hopts.bodyTimeoutMs = cfg_.router.bodyTimeoutMs;
    hopts.keepAliveTimeoutMs = cfg_.router.keepaliveTimeoutMs;
    // A backstop behind the request streams' own deadline: whatever goes wrong inside the
    // router, a request is answered (504) or its connection closed.
    hopts.responseTimeoutMs = cfg_.router.requestTimeoutMs + 10000;
    hopts.tlsCertFile = cfg_.router.tlsCertFile;
    hopts.tlsKeyFile = cfg_.router.tlsKeyFile;
    http_ = std::make_unique<net::HttpServer>(
        io_.context(), hopts,
        [this](net::HttpRequest req, std::shared_ptr<net::HttpResponder> r) { onHttp(std::move(req), std::move(r)); });
    if (Status s = http_->start(); !s.isOk()) {
      return cfg_.router.tlsCertFile.empty() ? s : Status(s.code(), "router.http.tls: " + s.message());
    }
    loop_.start();
    PD_LOG(kInfo, kTag) << "serving " << modelName_ << " on " << (hopts.tlsCertFile.empty() ? "http" : "https") << "://"
                        << host << ":" << http_->port() << ", workers register on port " << control_->port();
    return Status::ok();
  }

  // The pool goes last but before the loop and the streams it runs: once its threads are
  // joined nothing touches them, and what its queue still holds is dropped with it.
  void drain(std::chrono::milliseconds timeout) override {
    loop_.startDrain();
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto streaming = [this] {
      auto n = std::make_shared<std::promise<size_t>>();
      auto f = n->get_future();
      loop_.inFlight([n](size_t count) { n->set_value(count); });
      return f.wait_for(std::chrono::seconds(2)) == std::future_status::ready ? f.get() : size_t(1);
    };
    size_t left = streaming();
    while (left > 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      left = streaming();
    }
    if (left == 0) return;
    PD_LOG(kWarn, "router") << "drain timed out with " << left << " request(s) streaming: ending them";
    loop_.failAll(unavailable(
        "this router is shutting down; the request did not finish within router.requests.drain_timeout_ms"));
    // Let the streams write their error events before the servers stop.
    for (int i = 0; i < 40 && streaming() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }

  void stop() override {
    if (stopping_.exchange(true)) return;
    if (http_) http_->stop();
    if (control_) control_->stop();
    io_.stop();
  }

  int httpPort() const override { return http_ ? http_->port() : 0; }
  int controlPort() const override { return control_ ? control_->port() : 0; }

 private:
  // On an HTTP I/O thread: answers at once, or hands the request to the loop.
  void onHttp(net::HttpRequest req, std::shared_ptr<net::HttpResponder> r) {
    const std::string path = req.path();
    if (path == "/health") {
      if (loop_.draining()) return r->sendFull(503, {{"content-type", "text/plain"}}, "draining\n");
      return loop_.healthyDecodeWorkers([r](int healthy) {
        bool ok = healthy > 0;
        r->sendFull(ok ? 200 : 503, {{"content-type", "text/plain"}}, ok ? "" : "no healthy decode worker\n");
      });
    }
    // /metrics has its own rule (router.http.metrics_auth): Prometheus and KEDA scrape it, and they
    // hold no API key by default.
    if (path == "/metrics") {
      using config::MetricsAuth;
      const auto mode = cfg_.router.metricsAuth;
      const std::string authorization = req.header("authorization");  // token views into it
      const std::string_view token = KeySet::bearerToken(authorization);
      if ((mode == MetricsAuth::kApiKey && apiKeys_.match(token) < 0) ||
          (mode == MetricsAuth::kBearerFile && metricsToken_.match(token) < 0)) {
        metrics_.requestError("authentication_error", "router");
        return sendError(r,
                         ApiError::unauthorized(mode == MetricsAuth::kApiKey
                                                    ? "/metrics needs an API key (router.http.metrics_auth: api_key); "
                                                      "send Authorization: Bearer <key>"
                                                    : "/metrics needs the token of router.http.metrics_bearer_file; "
                                                      "send Authorization: Bearer <token>"));
      }
      publishConnectionStats();
      return r->sendFull(200, {{"content-type", "text/plain; version=0.0.4"}}, registry_.serialize());
    }
    int keyIndex = -1;
    if (!apiKeys_.empty()) {
      keyIndex = apiKeys_.match(KeySet::bearerToken(req.header("authorization")));
      if (keyIndex < 0) {
        metrics_.requestError("authentication_error", "router");
        return sendError(r, ApiError::unauthorized("missing or invalid API key (send Authorization: Bearer <key>)"));
      }
    }
    // Without keys, a client is its address (behind a proxy: the proxy's; docs/security.md).
    const std::string client = keyIndex >= 0 ? "key:" + std::to_string(keyIndex) : "addr:" + hostOf(req.remoteAddress);
    const bool generate = path == "/v1/completions" || path == "/v1/chat/completions" || path == "/v1/responses";
    const bool limited = generate || path == "/tokenize" || path == "/detokenize";
    if (limited && rateLimiter_.enabled()) {
      auto d = rateLimiter_.admitRequest(client);
      if (!d.ok) return sendError(r, rateLimited(d));
    }
    if (path == "/version") return sendJson(r, 200, json{{"version", PD_VERSION}});
    if (path == "/load") return sendJson(r, 200, json{{"server_load", metrics_.inFlight.value()}});
    if (path == "/v1/models" && req.method == "GET") return sendJson(r, 200, modelsJson());
    if (req.method != "POST" && limited) {
      return sendError(r, ApiError::methodNotAllowed(req.method + " " + path + ": use POST"));
    }
    if (path == "/v1/completions") return onGenerate(req, r, Endpoint::kCompletions, client);
    if (path == "/v1/chat/completions") return onGenerate(req, r, Endpoint::kChat, client);
    if (path == "/v1/responses") return onGenerate(req, r, Endpoint::kResponses, client);
    if (path == "/tokenize") return answer(r, parser_.tokenize(req.body));
    if (path == "/detokenize") return answer(r, parser_.detokenize(req.body));
    // Any other OpenAI path (/v1/embeddings, /v1/audio/..., /v1/images/...) answers in the
    // OpenAI error shape, so SDKs raise NotFoundError naming the endpoint, not "model not found".
    if (path.starts_with("/v1/") || path == "/v1") return sendError(r, ApiError::endpointNotServed(req.method, path));
    sendError(r, ApiError::notFound("no route for " + req.method + " " + path));
  }

  // Parse here; route, dispatch and stream happen on the loop and the request's strand.
  void onGenerate(const net::HttpRequest& httpReq, const std::shared_ptr<net::HttpResponder>& r, Endpoint endpoint,
                  const std::string& client) {
    auto parsed = parser_.parseGenerate(httpReq.body, endpoint);
    if (auto* no = std::get_if<Rejection>(&parsed)) {
      if (!no->errorMetric.empty()) metrics_.requestError(no->errorMetric, "router");
      return sendError(r, no->error);
    }
    RequestSpec spec;
    spec.parsed = std::move(std::get<ParsedGenerate>(parsed));
    if (rateLimiter_.enabled()) {
      // What the request may cost, charged now (router/rate_limiter.h says why).
      const int64_t tokens = int64_t(spec.parsed.prompt.size()) + int64_t(spec.parsed.req.n) * spec.parsed.maxTokens;
      auto d = rateLimiter_.admitTokens(client, tokens);
      if (!d.ok) return sendError(r, rateLimited(d));
    }
    spec.prefixBlocks = loop_.blockHashes(spec.parsed.prompt);
    spec.received = steadyNow();
    spec.createdUnixSeconds = unixSeconds();
    loop_.submit(RequestStream::create(io_.context(), std::move(spec), r, parser_.tokenizer(), loop_, metrics_,
                                       streamSettings_));
  }

  void answer(const std::shared_ptr<net::HttpResponder>& r, const std::variant<json, ApiError>& result) {
    if (const auto* e = std::get_if<ApiError>(&result)) return sendError(r, *e);
    sendJson(r, 200, std::get<json>(result));
  }

  ApiError rateLimited(const RateLimiter::Decision& d) {
    (d.limit == "tokens_per_s" ? rateLimitedTokens_ : rateLimitedRequests_).inc();
    return ApiError::rateLimited(d.message, "rate_limit_exceeded", d.limit, d.retryAfterS);
  }

  static std::string hostOf(const std::string& address) {
    auto colon = address.rfind(':');
    return colon == std::string::npos ? address : address.substr(0, colon);
  }

  // The token of router.http.metrics_bearer_file (surrounding whitespace dropped: files written by
  // `echo` end in a newline), held as its hash like the API keys.
  Status loadMetricsToken() {
    const std::string& path = cfg_.router.metricsBearerFile;
    std::ifstream in(path);
    if (!in) return notFound("router.http.metrics_bearer_file: cannot read '" + path + "'");
    std::string token((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    auto notSpace = [](unsigned char c) { return !std::isspace(c); };
    token.erase(token.begin(), std::find_if(token.begin(), token.end(), notSpace));
    token.erase(std::find_if(token.rbegin(), token.rend(), notSpace).base(), token.end());
    if (token.empty()) return invalidArgument("router.http.metrics_bearer_file: '" + path + "' is empty");
    std::vector<std::string> one{token};
    wipeSecret(&token);
    auto set = KeySet::fromEntries(one, "router.http.metrics_bearer_file");
    wipeSecrets(&one);
    if (!set.ok()) return set.status();
    metricsToken_ = std::move(set).value();
    return Status::ok();
  }

  void publishConnectionStats() {
    if (!http_) return;
    const auto st = http_->stats();
    httpConnections_.set(double(st.openConnections));
    // The server counts; the registry's counters follow it at each scrape.
    const uint64_t refused = refusedSeen_.exchange(st.refusedConnections);
    if (st.refusedConnections > refused) httpRefused_.inc(double(st.refusedConnections - refused));
    const uint64_t evicted = evictedSeen_.exchange(st.evictedConnections);
    if (st.evictedConnections > evicted) httpEvicted_.inc(double(st.evictedConnections - evicted));
  }

  json modelsJson() const {
    return json{{"object", "list"},
                {"data", json::array({json{{"id", modelName_},
                                           {"object", "model"},
                                           {"created", startedAt_},
                                           {"owned_by", "pdserve"},
                                           {"root", cfg_.model.path},
                                           {"max_model_len", parser_.limits().maxModelLen}}})}};
  }

  RouterOptions options_;
  const KeySet apiKeys_;  // hashes only; options_.config.router.apiKeys was wiped in create()
  KeySet metricsToken_;   // router.http.metrics_bearer_file, set in start()
  RateLimiter rateLimiter_;
  const config::ClusterConfig& cfg_;
  const std::string modelName_;
  const RequestParser parser_;
  // Declared before what runs on it (loop, servers, streams) so that it is destroyed after.
  net::IoPool io_;
  metrics::Registry registry_;
  metrics::RouterMetrics metrics_;
  RouterLoop loop_;
  const StreamSettings streamSettings_;
  std::unique_ptr<net::FramedServer> control_;
  std::unique_ptr<net::HttpServer> http_;
  std::atomic<bool> stopping_{false};
  metrics::Counter rateLimitedRequests_, rateLimitedTokens_, httpRefused_, httpEvicted_;
  metrics::Gauge httpConnections_;
  std::atomic<uint64_t> refusedSeen_{0}, evictedSeen_{0};
  const int64_t startedAt_ = unixSeconds();
};

}  // namespace

Result<std::unique_ptr<RouterService>> RouterService::create(RouterOptions options) {
  // Only hashes stay in memory: the plain entries are wiped from this copy of the config.
  PD_ASSIGN_OR_RETURN(KeySet keys, KeySet::fromEntries(options.config.router.apiKeys, "router.http.api_keys"));
  wipeSecrets(&options.config.router.apiKeys);
  const auto& cfg = options.config;
  PD_ASSIGN_OR_RETURN(auto tokenizer, tok::Tokenizer::loadDir(cfg.model.path));
  PD_ASSIGN_OR_RETURN(auto chat, tok::ChatTemplate::forTokenizer(*tokenizer));
  // The router never loads weights: the context length and vocabulary come from config.json.
  std::ifstream in(cfg.model.path + "/config.json");
  json mc = json::parse(in, nullptr, false);
  if (mc.is_discarded() || !mc.is_object()) return notFound(cfg.model.path + "/config.json: missing or not JSON");
  int64_t maxModelLen =
      cfg.model.maxModelLen > 0 ? cfg.model.maxModelLen : mc.value("max_position_embeddings", int64_t(2048));
  int vocab = mc.value("vocab_size", int(tokenizer->vocabSize()));
  std::string name =
      cfg.model.name.empty() ? std::filesystem::path(cfg.model.path).filename().string() : cfg.model.name;
  return std::unique_ptr<RouterService>(new RouterServiceImpl(std::move(options), std::move(tokenizer),
                                                              std::make_unique<tok::ChatTemplate>(std::move(chat)),
                                                              std::move(name), maxModelLen, vocab, std::move(keys)));
}

}  // namespace pd::router
