#include "decode_worker/decode_service.h"

#include <atomic>
#include <deque>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "common/base/log.h"
#include "common/metrics/pdserve_metrics.h"
#include "common/net/io_pool.h"
#include "kvtransfer/agent.h"

namespace pd::decode {
namespace {

using engine::EngineEvent;
using namespace std::chrono;

constexpr const char* kTag = "decode";

proto::FinishReason toProtoFinish(engine::FinishReason r) {
  switch (r) {
    case engine::FinishReason::kStop: return proto::FINISH_STOP;
    case engine::FinishReason::kLength: return proto::FINISH_LENGTH;
    case engine::FinishReason::kCancelled: return proto::FINISH_ABORT;
    case engine::FinishReason::kError: return proto::FINISH_ERROR;
    case engine::FinishReason::kNone: break;
  }
  return proto::FINISH_NONE;
}

class DecodeServiceImpl final : public DecodeService, private worker::WorkerParts {
 public:
  DecodeServiceImpl(config::ClusterConfig config, worker::WorkerFlags flags,
                    worker::EngineBundle bundle)
      : WorkerParts(std::move(config), std::move(flags), std::move(bundle), "decode") {}

  ~DecodeServiceImpl() override { stop(); }

  Status start() override {
    PD_RETURN_IF_ERROR(status_.start(flags_.advertiseHost, flags_.metricsPort));
    PD_ASSIGN_OR_RETURN(agent_, worker::startTransferAgent(config_, flags_, bundle_.kvRegions, registry_));
    metrics_.setCacheConfig(engine_.kv().layout().blockSize, engine_.kv().numTotalBlocks());
    proto::Hello hello = worker::workerHello(proto::ROLE_DECODE, flags_, bundle_);
    int routerPort = flags_.routerPort ? flags_.routerPort : config_.router.controlPort;
    router_ = std::make_unique<worker::RouterLink>(
        io_, inbox_, flags_.routerHost, routerPort, hello,
        worker::RouterLink::Handlers{[this](proto::Envelope&& env) { onRouterMessage(std::move(env)); },
                                     [this](bool up, const Status& why) { onRouterState(up, why); }});
    loop_ = std::thread([this] { loop(); });
    router_->start();
    PD_LOG(kInfo, kTag) << flags_.workerId << ": model " << bundle_.modelName << ", "
                        << engine_.kv().numTotalBlocks() << " KV blocks, transports "
                        << agent_->transportNames().size() << ", metrics on port " << status_.port();
    return Status::ok();
  }

  void stop() override {
    if (stopping_.exchange(true)) return;
    if (router_) router_->stop();
    inbox_.post([] {});
    if (loop_.joinable()) loop_.join();
    io_.stop();
  }

  int metricsPort() const override { return status_.port(); }

 private:
  struct Tracked {
    proto::Generate gen;
    bool remote = false;           // asked a prefill worker for the prompt's KV
    bool awaitingPrefill = false;  // PrefillRequest out, PrefillDone not yet in
    std::string prefillAddress;
    Deadline remoteDeadline;
    SteadyTime received;
    std::optional<SteadyTime> firstToken;
    int completionTokens = 0;
    bool wantLogprobs = false;
  };
  struct Blocked {  // a disaggregated request waiting for free blocks
    uint64_t id;
    engine::Request request;
    Deadline deadline;
  };
  // One connection per prefill worker. After the hello comes the kvtransfer exchange
  // (KvConnect in pdserve.proto): PrefillRequests wait in `queued` until the reply is loaded.
  struct PrefillPeer {
    net::ConnectionPtr conn;
    bool connecting = false;
    bool kvReady = false;      // the prefill worker's KvConnect reply is loaded
    std::string offer;         // our KvConnect offer on this connection; every request carries it
    Deadline kvDeadline;       // for the reply
    std::vector<proto::Envelope> queued;  // sent once kvReady
    std::unordered_set<uint64_t> requests;
  };

  // ---- loop thread ---------------------------------------------------------------------------
  void loop() {
    auto nextReport = steadyNow();
    while (!stopping_) {
      // While KV is arriving, stay responsive: fabric transports progress in agent_->progress().
      inbox_.runPending(engine_.hasWork() ? milliseconds(0)
                        : engine_.load().remote > 0 ? milliseconds(1) : milliseconds(20));
      agent_->progress();
      (void)agent_->takeNotifications();  // PrefillDone, not notifications, drives the decode side
      checkDeadlines();
      admitBlocked();
      if (engine_.hasWork()) {
        std::vector<EngineEvent> events;
        Status s = engine_.step(&events);
        if (!s.isOk()) {
          PD_LOG(kError, kTag) << "step failed: " << s.toString();
        }
        publish(events);
      }
      if (steadyNow() >= nextReport) {
        sendLoadReport();
        nextReport = steadyNow() + milliseconds(config_.router.loadReportIntervalMs);
      }
    }
    // Shutting down: every request still here ends with an error the client can read.
    std::vector<uint64_t> ids;
    for (auto& [id, t] : tracked_) ids.push_back(id);
    for (uint64_t id : ids) failRequest(id, unavailable("decode worker " + flags_.workerId + " is shutting down"));
  }

  void onRouterState(bool up, const Status& why) {
    ready_ = up;
    if (up) return;
    // The router lost track of these requests; their clients are gone with it.
    std::vector<uint64_t> ids;
    for (auto& [id, t] : tracked_) ids.push_back(id);
    for (uint64_t id : ids) cancelRequest(id, "router connection lost: " + why.message());
  }

  void onRouterMessage(proto::Envelope&& env) {
    switch (env.body_case()) {
      case proto::Envelope::kGenerate: onGenerate(std::move(*env.mutable_generate())); break;
      case proto::Envelope::kCancel: cancelRequest(env.cancel().request_id(), env.cancel().reason()); break;
      default:
        PD_LOG(kWarn, kTag) << "ignoring '" << net::bodyName(env) << "' from the router";
    }
  }

  void onGenerate(proto::Generate gen) {
    const uint64_t id = gen.request_id();
    if (tracked_.count(id)) return sendError(id, failedPrecondition("request " + std::to_string(id) + " is already running here"));
    engine::SamplingParams params = worker::fromProto(gen.sampling());
    std::vector<int32_t> prompt(gen.prompt_token_ids().begin(), gen.prompt_token_ids().end());
    if (int64_t(prompt.size()) + params.maxTokens > bundle_.maxModelLen) {
      return sendError(id, outOfRange("prompt (" + std::to_string(prompt.size()) +
                                      " tokens) + max_tokens (" + std::to_string(params.maxTokens) +
                                      ") exceeds the model's context of " +
                                      std::to_string(bundle_.maxModelLen) + " tokens"));
    }
    auto request = engine::Request::create(id, std::move(prompt), params, SystemClock::instance(),
                                           engine_.modelConfig().vocabSize);
    if (!request.ok()) return sendError(id, request.status());
    auto load = engine_.load();
    if (load.waiting + int(blocked_.size()) >= config_.engine.maxQueue) {
      return sendError(id, resourceExhausted("decode worker " + flags_.workerId + ": queue full (" +
                                             std::to_string(load.waiting) + " waiting)"));
    }
    Tracked t;
    t.received = steadyNow();
    t.wantLogprobs = gen.sampling().return_logprobs() || gen.sampling().logprobs() > 0;
    t.remote = !gen.prefill_worker_address().empty();
    t.prefillAddress = gen.prefill_worker_address();
    t.gen = std::move(gen);
    metrics_.promptTokens.inc(double(request->numPromptTokens()));
    tracked_.emplace(id, std::move(t));
    if (!tracked_.at(id).remote) {
      (void)engine_.submit(std::move(request).value());
      return;
    }
    blocked_.push_back({id, std::move(request).value(),
                        Deadline::in(milliseconds(config_.kvTransfer.timeoutMs))});
    admitBlocked();
  }

  // Disaggregated requests get all their prompt's blocks at once, in arrival order.
  void admitBlocked() {
    while (!blocked_.empty()) {
      Blocked& b = blocked_.front();
      int needed = engine_.kv().blocksFor(b.request.numPromptTokens());
      if (needed > engine_.kv().numFreeBlocks()) return;
      uint64_t id = b.id;
      auto blocks = engine_.submitRemote(std::move(b.request));
      blocked_.pop_front();
      if (!blocks.ok()) {
        failRequest(id, blocks.status());
        continue;
      }
      sendPrefillRequest(id, blocks.value());
    }
  }

  void sendPrefillRequest(uint64_t id, const std::vector<engine::BlockId>& blocks) {
    Tracked& t = tracked_.at(id);
    proto::Envelope env;
    env.set_request_id(id);
    auto* pr = env.mutable_prefill_request();
    pr->set_request_id(id);
    *pr->mutable_prompt_token_ids() = t.gen.prompt_token_ids();
    *pr->mutable_sampling() = t.gen.sampling();
    pr->set_deadline_ms(static_cast<uint64_t>(config_.kvTransfer.timeoutMs));
    auto* target = pr->mutable_kv_target();  // transfer_conn_info: set in sendToPrefill
    auto* layer = target->add_layers();
    for (auto b : blocks) layer->add_block_ids(static_cast<uint32_t>(b));
    target->set_block_size(static_cast<uint32_t>(engine_.kv().layout().blockSize));
    target->set_layout_fingerprint(bundle_.fingerprint);
    for (const MemDesc& region : bundle_.kvRegions) {
      auto* r = target->add_regions();
      r->set_base(region.addr);
      r->set_kind(static_cast<uint32_t>(region.kind));
      r->set_device(static_cast<uint32_t>(region.device));
    }
    target->set_num_blocks(static_cast<uint32_t>(engine_.kv().numTotalBlocks()));
    t.awaitingPrefill = true;
    t.remoteDeadline = Deadline::in(milliseconds(config_.kvTransfer.timeoutMs));
    PrefillPeer& peer = prefillPeers_[t.prefillAddress];
    peer.requests.insert(id);
    if (peer.conn && peer.kvReady) return sendToPrefill(peer, id, std::move(env));
    peer.queued.push_back(std::move(env));
    if (!peer.conn && !peer.connecting) connectPrefill(t.prefillAddress);
  }

  // The offer made for this connection is the request's KV target endpoint: the prefill
  // worker loaded it at KvConnect, so loading it again finds the same (connected) peer.
  void sendToPrefill(PrefillPeer& peer, uint64_t id, proto::Envelope&& env) {
    env.mutable_prefill_request()->mutable_kv_target()->set_transfer_conn_info(peer.offer);
    Status s = peer.conn->send(std::move(env));
    if (!s.isOk()) remotePrefillFailed(id, s);
  }

  void connectPrefill(const std::string& address) {
    auto colon = address.rfind(':');
    PrefillPeer& peer = prefillPeers_[address];
    peer.connecting = true;
    net::ConnectionOptions opts;
    opts.hello.set_role(proto::ROLE_DECODE);
    opts.hello.set_worker_id(flags_.workerId);
    opts.hello.set_model_fingerprint(bundle_.fingerprint);
    net::ConnectionCallbacks cb;
    cb.onMessage = [this, address](const net::ConnectionPtr&, proto::Envelope&& env) {
      auto shared = std::make_shared<proto::Envelope>(std::move(env));
      inbox_.post([this, address, shared] { onPrefillMessage(address, std::move(*shared)); });
    };
    cb.onClose = [this, address](const net::ConnectionPtr& c, const Status& why) {
      inbox_.post([this, address, c, why] { onPrefillClosed(address, c, why); });
    };
    net::FramedClient::connectAsync(
        io_, address.substr(0, colon), std::atoi(address.c_str() + colon + 1), opts, cb,
        seconds(3), [this, address](Result<net::ConnectionPtr> r) {
          inbox_.post([this, address, r = std::move(r)]() mutable { onPrefillConnected(address, std::move(r)); });
        });
  }

  void onPrefillConnected(const std::string& address, Result<net::ConnectionPtr> r) {
    PrefillPeer& peer = prefillPeers_[address];
    peer.connecting = false;
    if (!r.ok()) {
      PD_LOG(kWarn, kTag) << "prefill worker " << address << ": " << r.status().toString();
      failPeerRequests(address, r.status());
      return;
    }
    if (r.value()->peerHello().model_fingerprint() != bundle_.fingerprint) {
      Status why = failedPrecondition("prefill worker " + address + " serves '" +
                                      r.value()->peerHello().model_fingerprint() + "', not '" +
                                      bundle_.fingerprint + "'");
      r.value()->close(why);
      failPeerRequests(address, why);
      return;
    }
    peer.conn = r.value();
    peer.kvReady = false;
    // Step 1 of the kvtransfer exchange: a fresh offer for this prefill worker alone (verbs
    // makes one QP per offer; RC cannot share it between peers).
    auto offer = agent_->localMetadata();
    if (!offer.ok()) return dropPrefill(address, offer.status().withContext("KV offer to prefill worker " + address));
    peer.offer = std::move(offer).value();
    peer.kvDeadline = Deadline::in(milliseconds(config_.kvTransfer.timeoutMs));
    proto::Envelope env;
    env.set_request_id(0);
    env.mutable_kv_connect()->set_metadata(peer.offer);
    Status s = peer.conn->send(std::move(env));
    if (!s.isOk()) dropPrefill(address, s);
  }

  // Step 3: the prefill worker's reply (or its refusal). Loading it connects our side; then
  // the queued requests go, minus those that failed or were cancelled meanwhile.
  void onPrefillConnectionMessage(const std::string& address, proto::Envelope&& env) {
    auto it = prefillPeers_.find(address);
    if (it == prefillPeers_.end() || !it->second.conn) return;
    PrefillPeer& peer = it->second;
    if (env.body_case() == proto::Envelope::kError) {
      return dropPrefill(address, net::fromProtoError(env.error()));
    }
    if (env.body_case() != proto::Envelope::kKvConnect || peer.kvReady) {
      PD_LOG(kWarn, kTag) << "ignoring '" << net::bodyName(env) << "' from prefill worker " << address;
      return;
    }
    auto loaded = agent_->loadPeer(env.kv_connect().metadata());
    if (!loaded.ok()) {
      return dropPrefill(address, loaded.status().withContext("loading prefill worker " + address + "'s KV reply"));
    }
    peer.kvReady = true;
    PD_LOG(kInfo, kTag) << "prefill worker " << address << ": KV over " << agent_->peerTransport(*loaded).value();
    std::vector<proto::Envelope> queued;
    queued.swap(peer.queued);
    for (auto& q : queued) {
      const uint64_t id = q.request_id();
      if (peer.requests.count(id) && peer.conn) sendToPrefill(peer, id, std::move(q));
    }
  }

  // Closes the connection (the next request reconnects) and fails its requests with `why`.
  void dropPrefill(const std::string& address, const Status& why) {
    auto it = prefillPeers_.find(address);
    if (it == prefillPeers_.end()) return;
    PD_LOG(kWarn, kTag) << "prefill worker " << address << ": " << why.toString();
    it->second.kvReady = false;
    if (auto c = std::move(it->second.conn)) {
      it->second.conn.reset();
      c->close(why);  // onPrefillClosed ignores it: conn is no longer this connection
    }
    failPeerRequests(address, why);
  }

  void onPrefillClosed(const std::string& address, const net::ConnectionPtr& c, const Status& why) {
    auto it = prefillPeers_.find(address);
    if (it == prefillPeers_.end() || it->second.conn != c) return;
    it->second.conn.reset();
    it->second.kvReady = false;
    failPeerRequests(address, unavailable("prefill worker " + address + " disconnected: " + why.message()));
  }

  void failPeerRequests(const std::string& address, const Status& why) {
    auto it = prefillPeers_.find(address);
    if (it == prefillPeers_.end()) return;
    std::vector<uint64_t> ids(it->second.requests.begin(), it->second.requests.end());
    it->second.queued.clear();
    for (uint64_t id : ids) remotePrefillFailed(id, why);
  }

  void onPrefillMessage(const std::string& address, proto::Envelope&& env) {
    if (env.request_id() == 0) return onPrefillConnectionMessage(address, std::move(env));
    const uint64_t id = env.request_id();
    auto it = tracked_.find(id);
    if (it == tracked_.end() || !it->second.awaitingPrefill) return;  // cancelled meanwhile
    if (env.body_case() == proto::Envelope::kError) {
      return remotePrefillFailed(id, net::fromProtoError(env.error()));
    }
    if (env.body_case() != proto::Envelope::kPrefillDone) return;
    Tracked& t = it->second;
    t.awaitingPrefill = false;
    prefillPeers_[address].requests.erase(id);
    const auto& done = env.prefill_done();
    std::vector<EngineEvent> events;
    Status s = engine_.completeRemote(id, worker::fromProto(done.first_token_id(), done.first_logprob()), &events);
    if (!s.isOk()) return failRequest(id, s);
    metrics_.remotePrefill("ok");
    publish(events);
  }

  void remotePrefillFailed(uint64_t id, const Status& why) {
    auto it = tracked_.find(id);
    if (it == tracked_.end() || !it->second.awaitingPrefill) return;
    Tracked& t = it->second;
    t.awaitingPrefill = false;
    auto peer = prefillPeers_.find(t.prefillAddress);
    if (peer != prefillPeers_.end()) {
      peer->second.requests.erase(id);
      if (peer->second.conn) {
        proto::Envelope cancel;
        cancel.set_request_id(id);
        cancel.mutable_cancel()->set_request_id(id);
        cancel.mutable_cancel()->set_reason(why.message());
        (void)peer->second.conn->send(std::move(cancel));
      }
    }
    if (config_.kvTransfer.onRemotePrefillFailure == config::RemotePrefillFailure::kRecompute &&
        engine_.recomputeRemote(id).isOk()) {
      PD_LOG(kWarn, kTag) << "request " << id << ": remote prefill failed (" << why.message()
                          << "); recomputing here";
      metrics_.remotePrefill("recomputed");
      return;
    }
    metrics_.remotePrefill("failed");
    failRequest(id, unavailable("remote prefill failed: " + why.message()));
  }

  void checkDeadlines() {
    while (!blocked_.empty() && blocked_.front().deadline.expired()) {
      uint64_t id = blocked_.front().id;
      int tokens = blocked_.front().request.numPromptTokens();
      blocked_.pop_front();
      failRequest(id, resourceExhausted("no free KV blocks for a " + std::to_string(tokens) +
                                        "-token prompt within " +
                                        std::to_string(config_.kvTransfer.timeoutMs) + " ms"));
    }
    std::vector<std::string> silent;  // connected, no KvConnect reply in time
    for (auto& [address, p] : prefillPeers_)
      if (p.conn && !p.kvReady && p.kvDeadline.expired()) silent.push_back(address);
    for (const auto& address : silent)
      dropPrefill(address, deadlineExceeded("prefill worker " + address + " did not answer KvConnect within " +
                                            std::to_string(config_.kvTransfer.timeoutMs) + " ms"));
    std::vector<uint64_t> late;
    for (auto& [id, t] : tracked_)
      if (t.awaitingPrefill && t.remoteDeadline.expired()) late.push_back(id);
    for (uint64_t id : late) {
      // Say what it waited for: the prefill worker's KvConnect answer, or its PrefillDone.
      const std::string& address = tracked_.at(id).prefillAddress;
      auto peer = prefillPeers_.find(address);
      const bool handshaking = peer != prefillPeers_.end() && peer->second.conn && !peer->second.kvReady;
      remotePrefillFailed(id, deadlineExceeded((handshaking ? "prefill worker " + address + " did not answer KvConnect"
                                                            : std::string("no PrefillDone")) +
                                               " within " + std::to_string(config_.kvTransfer.timeoutMs) + " ms"));
    }
  }

  // Turns a step's events into one TokenChunk per request and sends them.
  void publish(const std::vector<EngineEvent>& events) {
    std::vector<uint64_t> order;
    std::unordered_map<uint64_t, proto::Envelope> chunks;
    for (const auto& e : events) {
      auto it = tracked_.find(e.requestId);
      if (it == tracked_.end()) continue;
      Tracked& t = it->second;
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
          if (t.wantLogprobs) *chunk->add_logprobs() = worker::toProto(e.token);
          if (!t.firstToken) t.firstToken = steadyNow();
          ++t.completionTokens;
          metrics_.generationTokens.inc();
          break;
        case EngineEvent::Kind::kFinished:
          chunk->set_finish_reason(toProtoFinish(e.reason));
          fillSummary(t, chunk);
          chunk->mutable_timings()->set_queue_ms(1e3 * e.timings.queueSeconds);
          break;
        case EngineEvent::Kind::kFailed:
          chunk->set_finish_reason(proto::FINISH_ERROR);
          *chunk->mutable_error() = net::toProtoError(e.error);
          fillSummary(t, chunk);
          break;
      }
    }
    for (uint64_t id : order) {
      auto& env = chunks.at(id);
      bool last = env.token_chunk().finish_reason() != proto::FINISH_NONE;
      (void)router_->send(std::move(env));
      if (last) forget(id);
    }
  }

  void fillSummary(const Tracked& t, proto::TokenChunk* chunk) {
    auto* usage = chunk->mutable_usage();
    usage->set_prompt_tokens(static_cast<uint32_t>(t.gen.prompt_token_ids_size()));
    usage->set_completion_tokens(static_cast<uint32_t>(t.completionTokens));
    auto* timings = chunk->mutable_timings();
    timings->set_decode_worker_id(flags_.workerId);
    timings->set_prefill_worker_id(t.remote ? t.gen.prefill_worker_id() : flags_.workerId);
    timings->set_route(t.remote ? proto::ROUTE_DISAGGREGATED : proto::ROUTE_COLOCATED);
    if (t.firstToken) timings->set_first_token_ms(1e3 * secondsBetween(t.received, *t.firstToken));
  }

  void sendError(uint64_t id, const Status& error) {
    proto::Envelope env;
    env.set_request_id(id);
    auto* chunk = env.mutable_token_chunk();
    chunk->set_request_id(id);
    chunk->set_finish_reason(proto::FINISH_ERROR);
    *chunk->mutable_error() = net::toProtoError(error);
    chunk->mutable_timings()->set_decode_worker_id(flags_.workerId);
    (void)router_->send(std::move(env));
  }

  void failRequest(uint64_t id, const Status& error) {
    engine_.cancel(id);
    sendError(id, error);
    forget(id);
  }

  void cancelRequest(uint64_t id, const std::string& reason) {
    auto it = tracked_.find(id);
    if (it == tracked_.end()) return;
    if (it->second.awaitingPrefill) {
      auto peer = prefillPeers_.find(it->second.prefillAddress);
      if (peer != prefillPeers_.end() && peer->second.conn) {
        proto::Envelope cancel;
        cancel.set_request_id(id);
        cancel.mutable_cancel()->set_request_id(id);
        cancel.mutable_cancel()->set_reason(reason);
        (void)peer->second.conn->send(std::move(cancel));
      }
    }
    engine_.cancel(id);
    forget(id);
  }

  void forget(uint64_t id) {
    auto it = tracked_.find(id);
    if (it == tracked_.end()) return;
    auto peer = prefillPeers_.find(it->second.prefillAddress);
    if (peer != prefillPeers_.end()) peer->second.requests.erase(id);
    for (auto b = blocked_.begin(); b != blocked_.end(); ++b) {
      if (b->id == id) {
        blocked_.erase(b);
        break;
      }
    }
    tracked_.erase(it);
  }

  void sendLoadReport() {
    auto load = engine_.load();
    load.waiting += static_cast<int>(blocked_.size());
    worker::publishLoad(proto::ROLE_DECODE, flags_.workerId, load, 0, metrics_, *router_);
  }

  std::unique_ptr<worker::RouterLink> router_;
  std::thread loop_;
  std::atomic<bool> stopping_{false};

  std::unordered_map<uint64_t, Tracked> tracked_;
  std::deque<Blocked> blocked_;
  std::unordered_map<std::string, PrefillPeer> prefillPeers_;
};

}  // namespace

Result<std::unique_ptr<DecodeService>> DecodeService::create(config::ClusterConfig config,
                                                             worker::WorkerFlags flags) {
  if (!flags.modelPath.empty()) config.model.path = flags.modelPath;
  PD_ASSIGN_OR_RETURN(auto bundle, worker::buildEngine(config, /*releaseKvOnFinish=*/true));
  return std::unique_ptr<DecodeService>(
      new DecodeServiceImpl(std::move(config), std::move(flags), std::move(bundle)));
}

}  // namespace pd::decode
