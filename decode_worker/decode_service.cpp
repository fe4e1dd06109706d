#include "decode_worker/decode_service.h"

#include <unordered_map>

#include "common/base/log.h"
#include "common/net/framed.h"
#include "decode_worker/pull_sources.h"
#include "decode_worker/remote_prefills.h"
#include "worker/worker_loop.h"

namespace pd::decode {
namespace {

using engine::EngineEvent;

constexpr const char* kTag = "decode";

proto::FinishReason toProtoFinish(engine::FinishReason r) {
  switch (r) {
    case engine::FinishReason::kStop:
      return proto::FINISH_STOP;
    case engine::FinishReason::kLength:
      return proto::FINISH_LENGTH;
    case engine::FinishReason::kCancelled:
      return proto::FINISH_ABORT;
    case engine::FinishReason::kError:
      return proto::FINISH_ERROR;
    case engine::FinishReason::kNone:
      break;
  }
  return proto::FINISH_NONE;
}

// The decode role: the router's requests in, token chunks out.
class DecodeRole final : public worker::RolePolicy {
 public:
  explicit DecodeRole(worker::WorkerLoop& loop)
      : loop_(loop),
        engine_(loop.engine()),
        remote_(loop, RemotePrefills::Callbacks{
                          [this](uint64_t id, const proto::Timings& split, SteadyTime at,
                                 const std::vector<EngineEvent>& events) {
                            if (auto it = streams_.find(id); it != streams_.end()) {
                              it->second.remoteSplit = split;
                              it->second.kvReadyAt = at;
                            }
                            publish(events);
                          },
                          [this](uint64_t id, const Status& why) { sendErrorAndForget(id, why); },
                          [this](uint64_t id, int tokens, double ms, const std::string& transport) {
                            if (auto it = streams_.find(id); it != streams_.end()) {
                              it->second.pulledTokens = tokens;
                              it->second.pullMs = ms;
                              it->second.pullTransport = transport;
                            }
                          },
                          [this](const net::ConnectionPtr& c, kvt::AgentPeer peer, const worker::KvTargetLayout& layout,
                                 proto::Envelope&& env) { onLinkPull(c, peer, layout, std::move(env)); },
                          [this](const net::ConnectionPtr& c, const Status& why) { sources_.dropConnection(c, why); }}),
        sources_(loop) {}

  // I/O threads post a peer's frame on the pull port here (docs/kv_cache.md, "Peer pulls").
  void onPeerMessage(const net::ConnectionPtr& c, proto::Envelope&& env) {
    switch (env.body_case()) {
      case proto::Envelope::kKvConnect:
        return sources_.connect(c, env.kv_connect());
      case proto::Envelope::kPullRequest:
        return sources_.accept(c, env.pull_request());
      case proto::Envelope::kCancel:
        return sources_.cancel(c, env.cancel().request_id());
      default:
        PD_LOG(kWarn, kTag) << "ignoring '" << net::bodyName(env) << "' from peer " << c->remoteAddress();
    }
  }
  void onPeerClosed(const net::ConnectionPtr& c, const Status& why) { sources_.dropConnection(c, why); }

  // A prefill worker's pull over the link to it (docs/kv_cache.md, "Peer pulls", prefill side):
  // served like a peer's on the pull port, the link's peer and the prefill worker's pool
  // standing in for a KvConnect.
  void onLinkPull(const net::ConnectionPtr& c, kvt::AgentPeer peer, const worker::KvTargetLayout& layout,
                  proto::Envelope&& env) {
    if (env.body_case() == proto::Envelope::kPullRequest) {
      sources_.attach(c, peer, layout);
      return sources_.accept(c, env.pull_request());
    }
    if (env.body_case() == proto::Envelope::kCancel) return sources_.cancel(c, env.cancel().request_id());
  }

  void onRouterMessage(worker::RouterId from, proto::Envelope&& env) override {
    switch (env.body_case()) {
      case proto::Envelope::kGenerate:
        return onGenerate(from, std::move(*env.mutable_generate()));
      case proto::Envelope::kCancel: {
        // Only the router that sent a request may cancel it.
        auto it = streams_.find(env.cancel().request_id());
        if (it != streams_.end() && it->second.router == from) cancel(it->first, env.cancel().reason());
        return;
      }
      default:
        PD_LOG(kWarn, kTag) << "ignoring '" << net::bodyName(env) << "' from the router";
    }
  }

  void onRouterState(worker::RouterId router, bool up, const Status& why) override {
    if (up) return;
    // That router lost track of its requests; their clients are gone with it. The requests
    // of other routers go on.
    std::vector<uint64_t> ids;
    for (auto& [id, s] : streams_)
      if (s.router == router) ids.push_back(id);
    for (uint64_t id : ids) cancel(id, "router connection lost: " + why.message());
  }

  void onStepEvents(const std::vector<EngineEvent>& events) override { publish(events); }
  void poll() override {
    remote_.admitWaiting();
    remote_.pollQuarantine();
    remote_.exportStates();
    sources_.settle();
  }
  std::chrono::microseconds pollInterval() const override {
    if (sources_.hasTransfers()) return std::chrono::microseconds(0);
    return remote_.anyInFlight() ? std::chrono::milliseconds(1) : std::chrono::milliseconds(20);
  }
  void addLoad(worker::LoadSnapshot& load) const override {
    load.heldWaiting = remote_.waitingForBlocks();
    load.servesPulls = loop_.config().kvTransfer.peerPulls;
  }
  bool idle() const override { return streams_.empty(); }

  void shutdown(const Status& why) override {
    sources_.shutdown(why);
    remote_.shutdown(why);
    std::vector<uint64_t> ids;
    for (auto& [id, s] : streams_) ids.push_back(id);
    for (uint64_t id : ids) {
      engine_.cancel(id);
      sendErrorAndForget(id, why);
    }
  }

 private:
  // What the role keeps per request to build its chunks.
  struct Stream {
    worker::RouterId router = 0;  // the router that sent it: its chunks go back there
    proto::Generate gen;
    bool remote = false;
    SteadyTime received;
    double inboxS = 0;  // the Generate's wait for the loop, before the engine saw it
    std::optional<SteadyTime> firstToken;
    std::optional<proto::Timings> remoteSplit;  // PrefillDone's part of the TTFT split
    SteadyTime kvReadyAt;                       // when that PrefillDone arrived
    int completionTokens = 0;
    bool wantLogprobs = false;
    uint32_t cachedPromptTokens = 0;  // the prefix hit where the prompt was prefilled
    bool pull = false;                // the router named a peer pull for its prefix
    int pulledTokens = 0;             // of the prompt, pulled (0: none, or it fell back)
    double pullMs = 0;                // blocks reserved -> PullDone (or the failure)
    std::string pullTransport;
  };

  void onGenerate(worker::RouterId from, proto::Generate gen) {
    // Up to here (before the engine request exists): the wait for the loop.
    const double inboxS = secondsBetween(loop_.postedAt(), steadyNow());
    const uint64_t id = gen.request_id();
    if (streams_.count(id)) {
      return sendError(from, id, failedPrecondition("request " + std::to_string(id) + " is already running here"));
    }
    if (loop_.draining()) {  // sent before the router saw our draining report
      return sendError(from, id, unavailable("decode worker " + loop_.flags().workerId + " is draining"));
    }
    engine::SamplingParams params = worker::fromProto(gen.sampling());
    std::vector<int32_t> prompt(gen.prompt_token_ids().begin(), gen.prompt_token_ids().end());
    const int64_t maxLen = loop_.bundle().maxModelLen;
    if (int64_t(prompt.size()) + params.maxTokens > maxLen) {
      return sendError(from, id,
                       outOfRange("prompt (" + std::to_string(prompt.size()) + " tokens) + max_tokens (" +
                                  std::to_string(params.maxTokens) + ") exceeds the model's context of " +
                                  std::to_string(maxLen) + " tokens"));
    }
    auto request = engine::Request::create(id, std::move(prompt), params, SystemClock::instance(),
                                           engine_.modelConfig().vocabSize);
    if (!request.ok()) return sendError(from, id, request.status());
    // Before it queues anywhere (here or for blocks to receive into): one that can never fit
    // would wait for ever (docs/serving.md, "Limits").
    if (Status fits = engine_.checkFits(*request); !fits.isOk()) return sendError(from, id, fits);
    const auto load = engine_.load();
    if (load.waiting + remote_.waitingForBlocks() >= loop_.config().engine.maxQueue) {
      return sendError(from, id,
                       resourceExhausted("decode worker " + loop_.flags().workerId + ": queue full (" +
                                         std::to_string(load.waiting) + " waiting)"));
    }
    Stream s;
    s.router = from;
    s.received = steadyNow();
    s.inboxS = inboxS;
    s.wantLogprobs = gen.sampling().return_logprobs() || gen.sampling().logprobs() > 0;
    s.remote = !gen.prefill_worker_address().empty();
    if (gen.pull_tokens() > 0) {
      if (Status ok = checkPull(gen); !ok.isOk()) return sendError(from, id, ok);
    }
    // A disaggregated prompt's pull is the prefill worker's (RemotePrefills forwards it): the
    // pull phase here is a colocated prompt's alone.
    s.pull = gen.pull_tokens() > 0 && !s.remote;
    loop_.metrics().promptTokens.inc(double(request->numPromptTokens()));
    s.gen = gen;
    streams_.emplace(id, std::move(s));
    if (streams_.at(id).remote || streams_.at(id).pull)
      return remote_.start(std::move(gen), std::move(request).value());
    if (Status st = engine_.submit(std::move(request).value()); !st.isOk()) sendErrorAndForget(id, st);
  }

  // A Generate naming a peer pull: whole blocks short of the prompt's last token, a source
  // address, and pulls on here. Colocated: this worker pulls from the source. Disaggregated:
  // the prefill worker pulls, over the link this worker keeps to it, from this worker alone
  // (docs/kv_cache.md, "Peer pulls").
  Status checkPull(const proto::Generate& gen) const {
    const int bs = engine_.kv().blockSize();
    const uint32_t n = gen.pull_tokens();
    if (!loop_.config().kvTransfer.peerPulls) {
      return failedPrecondition("Generate.pull_tokens: peer pulls are off on decode worker " + loop_.flags().workerId +
                                " (kv_transfer.peer_pulls)");
    }
    if (!gen.prefill_worker_address().empty() && gen.pull_source_id() != loop_.flags().workerId) {
      return invalidArgument("Generate: pull_tokens with a prefill worker names source '" + gen.pull_source_id() +
                             "'; a prefill worker pulls only from its decode worker ('" + loop_.flags().workerId +
                             "')");
    }
    if (gen.pull_source_address().empty()) return invalidArgument("Generate.pull_tokens without pull_source_address");
    if (n % uint32_t(bs) != 0 || int64_t(n) >= gen.prompt_token_ids_size()) {
      return invalidArgument("Generate.pull_tokens: " + std::to_string(n) + " is not a multiple of the block size " +
                             std::to_string(bs) + " below the prompt's " + std::to_string(gen.prompt_token_ids_size()) +
                             " tokens");
    }
    return Status::ok();
  }

  // Turns a step's events into one TokenChunk per request and sends them.
  void publish(const std::vector<EngineEvent>& events) {
    std::vector<uint64_t> order, first;
    std::unordered_map<uint64_t, proto::Envelope> chunks;
    std::unordered_map<uint64_t, engine::RequestTimings> finished;
    for (const auto& e : events) {
      auto it = streams_.find(e.requestId);
      if (it == streams_.end()) continue;
      Stream& s = it->second;
      auto [cit, fresh] = chunks.try_emplace(e.requestId);
      if (fresh) {
        order.push_back(e.requestId);
        cit->second.set_request_id(e.requestId);
        cit->second.mutable_token_chunk()->set_request_id(e.requestId);
      }
      auto* chunk = cit->second.mutable_token_chunk();
      switch (e.kind) {
        case EngineEvent::Kind::kToken:
          chunk->add_token_ids(static_cast<uint32_t>(e.token.id));
          if (s.wantLogprobs) *chunk->add_logprobs() = worker::toProto(e.token);
          if (!s.firstToken) {
            s.firstToken = steadyNow();
            first.push_back(e.requestId);
          }
          ++s.completionTokens;
          loop_.metrics().generationTokens.inc();
          break;
        case EngineEvent::Kind::kFinished:
          chunk->set_finish_reason(toProtoFinish(e.reason));
          // Where the prompt was prefilled: the prefill worker's hit, or ours (colocated, or
          // recomputed here after a failed remote prefill: no split then).
          s.cachedPromptTokens =
              s.remoteSplit ? s.remoteSplit->prefill_cached_tokens() : uint32_t(e.timings.cachedPromptTokens);
          fillSummary(s, chunk);
          chunk->mutable_timings()->set_queue_ms(1e3 * e.timings.queueSeconds);
          finished.emplace(e.requestId, e.timings);
          break;
        case EngineEvent::Kind::kFailed:
          chunk->set_finish_reason(proto::FINISH_ERROR);
          *chunk->mutable_error() = net::toProtoError(e.error);
          fillSummary(s, chunk);
          break;
      }
    }
    for (uint64_t id : first) {
      const auto f = finished.find(id);
      const engine::Request* r = engine_.find(id);
      if (f != finished.end())
        fillSplit(streams_.at(id), f->second, chunks.at(id).mutable_token_chunk());
      else if (r)
        fillSplit(streams_.at(id), r->timings(), chunks.at(id).mutable_token_chunk());
    }
    for (uint64_t id : order) {
      auto& env = chunks.at(id);
      const bool last = env.token_chunk().finish_reason() != proto::FINISH_NONE;
      (void)loop_.routers().send(streams_.at(id).router, std::move(env));
      if (last) streams_.erase(id);
    }
  }

  // Routed disaggregated, yet the prompt was computed here: the remote prefill failed and
  // RemotePrefills recomputed it (no PrefillDone, so no remote split, ever reached us).
  static bool recomputedHere(const Stream& s) { return s.remote && !s.remoteSplit && s.firstToken; }

  void fillSummary(const Stream& s, proto::TokenChunk* chunk) {
    auto* usage = chunk->mutable_usage();
    usage->set_prompt_tokens(static_cast<uint32_t>(s.gen.prompt_token_ids_size()));
    usage->set_completion_tokens(static_cast<uint32_t>(s.completionTokens));
    usage->set_cached_tokens(s.cachedPromptTokens);
    auto* timings = chunk->mutable_timings();
    const std::string& me = loop_.flags().workerId;
    timings->set_decode_worker_id(me);
    // Who computed the prompt: after a failed remote prefill recomputed here, this worker.
    timings->set_prefill_worker_id(s.remote && s.remoteSplit ? s.gen.prefill_worker_id() : me);
    timings->set_route(s.remote ? proto::ROUTE_DISAGGREGATED : proto::ROUTE_COLOCATED);
    timings->set_recomputed(recomputedHere(s));
    if (s.firstToken) timings->set_first_token_ms(1e3 * secondsBetween(s.received, *s.firstToken));
    fillPull(s, timings);
  }

  // The decode worker's part of the TTFT split, on the chunk with the first token (proto
  // Timings.ttft_split): every figure is an interval of this host's clock, or the prefill
  // worker's own intervals as it sent them. `t` is the engine's view of the request.
  void fillSplit(const Stream& s, const engine::RequestTimings& t, proto::TokenChunk* chunk) {
    auto* timings = chunk->mutable_timings();
    timings->set_ttft_split(true);
    timings->set_route(s.remote ? proto::ROUTE_DISAGGREGATED : proto::ROUTE_COLOCATED);
    timings->set_recomputed(recomputedHere(s));
    // The Generate's wait for the loop, then colocated: the engine queue; disaggregated:
    // arrival -> blocks reserved (its queued -> waiting_kv move is the reservation).
    timings->set_queue_ms(1e3 * (s.inboxS + t.queueSeconds));
    if (s.remoteSplit) {
      timings->set_kv_connect_ms(s.remoteSplit->kv_connect_ms());
      timings->set_prefill_queue_ms(s.remoteSplit->prefill_queue_ms());
      timings->set_prefill_ms(s.remoteSplit->prefill_ms());
      timings->set_transfer_ms(s.remoteSplit->transfer_ms());
      timings->set_transport(s.remoteSplit->transport());
      timings->set_handoff_ms(1e3 * secondsBetween(s.kvReadyAt, *s.firstToken));
    } else {
      // Colocated, or a remote prefill that failed and was recomputed here: the local
      // prefill (for a recompute it includes the failed attempt).
      timings->set_prefill_ms(1e3 * t.prefillSeconds.value_or(0));
    }
    if (s.pull) {
      // The engine counts the request out of its queue from the reservation, so its prefill
      // time holds the pull: that is its own phase.
      timings->set_prefill_ms(std::max(0.0, timings->prefill_ms() - s.pullMs));
    }
    fillPull(s, timings);  // a colocated pull's, or the prefill worker's
  }

  static void fillPull(const Stream& s, proto::Timings* timings) {
    if (s.remoteSplit && s.remoteSplit->pull_ms() > 0) {
      // The prefill worker's pull (PrefillDone.timings), part of its prefill.
      timings->set_pull_ms(s.remoteSplit->pull_ms());
      timings->set_pull_tokens(s.remoteSplit->pull_tokens());
      timings->set_pull_transport(s.remoteSplit->pull_transport());
      return;
    }
    if (!s.pull) return;
    timings->set_pull_ms(s.pullMs);
    timings->set_pull_tokens(uint32_t(s.pulledTokens));
    timings->set_pull_transport(s.pullTransport);
  }

  void sendError(worker::RouterId router, uint64_t id, const Status& error) {
    proto::Envelope env;
    env.set_request_id(id);
    auto* chunk = env.mutable_token_chunk();
    chunk->set_request_id(id);
    chunk->set_finish_reason(proto::FINISH_ERROR);
    *chunk->mutable_error() = net::toProtoError(error);
    chunk->mutable_timings()->set_decode_worker_id(loop_.flags().workerId);
    (void)loop_.routers().send(router, std::move(env));
  }

  void sendErrorAndForget(uint64_t id, const Status& error) {
    auto it = streams_.find(id);
    if (it == streams_.end()) return;
    sendError(it->second.router, id, error);
    streams_.erase(it);
  }

  void cancel(uint64_t id, const std::string& reason) {
    if (!streams_.count(id)) return;
    if (remote_.contains(id))
      remote_.cancel(id, reason);
    else
      engine_.cancel(id);
    streams_.erase(id);
  }

  worker::WorkerLoop& loop_;
  engine::Engine& engine_;
  RemotePrefills remote_;
  PullSources sources_;
  std::unordered_map<uint64_t, Stream> streams_;
};

class DecodeServiceImpl final : public DecodeService {
 public:
  DecodeServiceImpl(config::ClusterConfig config, worker::WorkerFlags flags, worker::EngineBundle bundle)
      : loop_(std::move(config), std::move(flags), std::move(bundle), proto::ROLE_DECODE), role_(loop_) {}
  ~DecodeServiceImpl() override { stop(); }

  Status start() override {
    PD_RETURN_IF_ERROR(loop_.prepare());
    const auto& bundle = loop_.bundle();
    proto::Hello hello = worker::workerHello(proto::ROLE_DECODE, loop_.flags(), bundle);
    if (loop_.config().kvTransfer.peerPulls) {
      // The pull port: peers dial it as decode workers dial a prefill worker, with the same
      // authentication, model check and lease (docs/kv_cache.md, "Peer pulls").
      const auto& flags = loop_.flags();
      net::ConnectionOptions opts = loop_.leasedControlOptions("pull_control");
      opts.hello = hello;
      net::ConnectionCallbacks cb;
      cb.onOpen = [fingerprint = bundle.fingerprint](const net::ConnectionPtr& c) {
        if (c->peerHello().model_fingerprint() != fingerprint) {
          c->close(failedPrecondition("peer serves '" + c->peerHello().model_fingerprint() + "', this decode worker '" +
                                      fingerprint + "'"));
        }
      };
      cb.onMessage = [this](const net::ConnectionPtr& c, proto::Envelope&& env) {
        auto shared = std::make_shared<proto::Envelope>(std::move(env));
        loop_.post([this, c, shared] { role_.onPeerMessage(c, std::move(*shared)); });
      };
      cb.onClose = [this](const net::ConnectionPtr& c, const Status& why) {
        loop_.post([this, c, why] { role_.onPeerClosed(c, why); });
      };
      PD_ASSIGN_OR_RETURN(server_, net::FramedServer::listen(loop_.io(), loop_.bindHost(), flags.port, opts, cb));
      hello.set_address(flags.advertiseHost + ":" + std::to_string(server_->port()));
    }
    loop_.run(role_, std::move(hello));
    PD_LOG(kInfo, kTag) << loop_.flags().workerId << ": model " << bundle.modelName << ", "
                        << loop_.engine().kv().numTotalBlocks() << " KV blocks, transports "
                        << loop_.agent().transportNames().size() << ", metrics on port " << loop_.metricsPort();
    return Status::ok();
  }
  void drain(std::chrono::milliseconds timeout) override { loop_.drain(timeout); }
  void stop() override {
    if (server_) server_->stop();
    loop_.stop();
  }
  int metricsPort() const override { return loop_.metricsPort(); }
  std::shared_ptr<const engine::ModelWeights> weights() const override { return loop_.bundle().model; }
  metrics::Registry& registry() override { return loop_.registry(); }
  // The gauge RemotePrefills keeps on the loop thread: thread-safe to read from here.
  int64_t kvBlocksQuarantined() override { return int64_t(loop_.metrics().kvBlocksQuarantined.value()); }

 private:
  worker::WorkerLoop loop_;
  DecodeRole role_;
  std::unique_ptr<net::FramedServer> server_;  // the pull port (kv_transfer.peer_pulls)
};

}  // namespace

Result<std::unique_ptr<DecodeService>> DecodeService::create(config::ClusterConfig config, worker::WorkerFlags flags,
                                                             std::shared_ptr<const engine::ModelWeights> weights) {
  if (!flags.modelPath.empty()) config.model.path = flags.modelPath;
  PD_ASSIGN_OR_RETURN(auto bundle, worker::buildEngine(config, /*releaseKvOnFinish=*/true, std::move(weights)));
  return std::unique_ptr<DecodeService>(new DecodeServiceImpl(std::move(config), std::move(flags), std::move(bundle)));
}

}  // namespace pd::decode
