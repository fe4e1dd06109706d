#include "prefill_worker/prefill_service.h"

#include <atomic>
#include <thread>
#include <unordered_map>

#include "common/base/log.h"
#include "common/metrics/pdserve_metrics.h"
#include "common/net/io_pool.h"
#include "kvtransfer/agent.h"
#include "kvtransfer/transceiver.h"

namespace pd::prefill {
namespace {

using engine::EngineEvent;
using namespace std::chrono;

constexpr const char* kTag = "prefill";

class PrefillServiceImpl final : public PrefillService, private worker::WorkerParts {
 public:
  PrefillServiceImpl(config::ClusterConfig config, worker::WorkerFlags flags,
                     worker::EngineBundle bundle)
      : WorkerParts(std::move(config), std::move(flags), std::move(bundle), "prefill") {}

  ~PrefillServiceImpl() override { stop(); }

  Status start() override {
    PD_RETURN_IF_ERROR(status_.start(flags_.advertiseHost, flags_.metricsPort));
    PD_ASSIGN_OR_RETURN(agent_, worker::startTransferAgent(config_, flags_, bundle_.kvRegions, registry_));
    metrics_.setCacheConfig(engine_.kv().layout().blockSize, engine_.kv().numTotalBlocks());

    net::ConnectionOptions opts;
    opts.hello = worker::workerHello(proto::ROLE_PREFILL, flags_, bundle_);
    net::ConnectionCallbacks cb;
    cb.onOpen = [this](const net::ConnectionPtr& c) {
      if (c->peerHello().model_fingerprint() != bundle_.fingerprint) {
        c->close(failedPrecondition("peer serves '" + c->peerHello().model_fingerprint() +
                                    "', this prefill worker '" + bundle_.fingerprint + "'"));
      }
    };
    cb.onMessage = [this](const net::ConnectionPtr& c, proto::Envelope&& env) {
      auto shared = std::make_shared<proto::Envelope>(std::move(env));
      inbox_.post([this, c, shared] { onDecodeMessage(c, std::move(*shared)); });
    };
    cb.onClose = [this](const net::ConnectionPtr& c, const Status& why) {
      inbox_.post([this, c, why] { onDecodeClosed(c, why); });
    };
    PD_ASSIGN_OR_RETURN(server_, net::FramedServer::listen(io_, config_.pools.prefill.host,
                                                           flags_.port, opts, cb));
    proto::Hello hello = opts.hello;
    hello.set_address(flags_.advertiseHost + ":" + std::to_string(server_->port()));
    int routerPort = flags_.routerPort ? flags_.routerPort : config_.router.controlPort;
    router_ = std::make_unique<worker::RouterLink>(
        io_, inbox_, flags_.routerHost, routerPort, hello,
        worker::RouterLink::Handlers{
            [](proto::Envelope&& env) {
              PD_LOG(kWarn, kTag) << "ignoring '" << net::bodyName(env) << "' from the router";
            },
            [this](bool up, const Status&) { ready_ = up; }});
    loop_ = std::thread([this] { loop(); });
    router_->start();
    PD_LOG(kInfo, kTag) << flags_.workerId << ": model " << bundle_.modelName << ", control port "
                        << server_->port() << ", metrics port " << status_.port();
    return Status::ok();
  }

  void stop() override {
    if (stopping_.exchange(true)) return;
    if (router_) router_->stop();
    if (server_) server_->stop();
    inbox_.post([] {});
    if (loop_.joinable()) loop_.join();
    io_.stop();
  }

  int controlPort() const override { return server_ ? server_->port() : 0; }
  int metricsPort() const override { return status_.port(); }

 private:
  struct Job {
    net::ConnectionPtr decode;
    kvt::AgentPeer peer = 0;
    std::vector<engine::BlockId> targetBlocks;
    std::vector<MemDesc> targetRegions;  // one per tensor-parallel rank, as ours
    engine::KvLayout targetLayout;  // ours (per rank), with the target pool's block count
    std::vector<kvt::AgentTransfer> inflight;
    int pushedTokens = 0;  // prompt tokens whose KV was posted for every layer
    std::optional<engine::SampledToken> first;
    bool computed = false;
    Status failed;
    Deadline deadline;
    SteadyTime received;
    std::optional<SteadyTime> computedAt;
    uint64_t bytes = 0;
  };

  void loop() {
    auto nextReport = steadyNow();
    while (!stopping_) {
      inbox_.runPending(engine_.hasWork() || hasTransfers() ? milliseconds(0) : milliseconds(20));
      agent_->progress();
      (void)agent_->takeNotifications();
      if (engine_.hasWork()) {
        std::vector<EngineEvent> events;
        Status s = engine_.step(&events, [this](int layer, const engine::StepView& step) {
          pushLayer(layer, step);
        });
        if (!s.isOk()) {
          PD_LOG(kError, kTag) << "step failed: " << s.toString();
        }
        onEvents(events);
      }
      settleJobs();
      if (steadyNow() >= nextReport) {
        sendLoadReport();
        nextReport = steadyNow() + milliseconds(config_.router.loadReportIntervalMs);
      }
    }
    std::vector<uint64_t> ids;
    for (auto& [id, job] : jobs_) ids.push_back(id);
    for (uint64_t id : ids) endJob(id, unavailable("prefill worker " + flags_.workerId + " is shutting down"));
  }

  bool hasTransfers() const {
    for (const auto& [id, job] : jobs_)
      if (!job.inflight.empty()) return true;
    return false;
  }

  void onDecodeMessage(const net::ConnectionPtr& c, proto::Envelope&& env) {
    switch (env.body_case()) {
      case proto::Envelope::kKvConnect: return onKvConnect(c, env.kv_connect());
      case proto::Envelope::kPrefillRequest: return onPrefillRequest(c, env.prefill_request());
      case proto::Envelope::kCancel: return endJob(env.cancel().request_id(), Status::ok(), /*notify=*/false);
      default:
        PD_LOG(kWarn, kTag) << "ignoring '" << net::bodyName(env) << "' from " << c->remoteAddress();
    }
  }

  void onDecodeClosed(const net::ConnectionPtr& c, const Status& why) {
    std::vector<uint64_t> ids;
    for (auto& [id, job] : jobs_)
      if (job.decode == c) ids.push_back(id);
    if (!ids.empty()) {
      PD_LOG(kWarn, kTag) << "decode worker " << c->peerHello().worker_id() << " went away ("
                          << why.message() << "); dropping " << ids.size() << " request(s)";
    }
    for (uint64_t id : ids) endJob(id, Status::ok(), /*notify=*/false);
  }

  void reject(const net::ConnectionPtr& c, uint64_t id, const Status& why) {
    proto::Envelope env;
    env.set_request_id(id);
    *env.mutable_error() = net::toProtoError(why);
    (void)c->send(std::move(env));
  }

  // Step 2 of the kvtransfer exchange (KvConnect in pdserve.proto): load the decode worker's
  // offer and answer with what it needs to connect back to us; an Error with request_id 0
  // when that fails, so the decode worker fails its queued requests at once.
  void onKvConnect(const net::ConnectionPtr& c, const proto::KvConnect& kc) {
    auto peer = agent_->loadPeer(kc.metadata());
    Result<std::string> reply = peer.ok() ? agent_->peerMetadata(*peer) : Result<std::string>(peer.status());
    if (!reply.ok()) {
      Status why = reply.status().withContext("prefill worker " + flags_.workerId + ": KvConnect from " +
                                              c->peerHello().worker_id());
      PD_LOG(kWarn, kTag) << why.toString();
      return reject(c, 0, why);
    }
    proto::Envelope env;
    env.set_request_id(0);
    env.mutable_kv_connect()->set_metadata(std::move(reply).value());
    (void)c->send(std::move(env));
    PD_LOG(kInfo, kTag) << "decode worker " << c->peerHello().worker_id() << ": KV over "
                        << agent_->peerTransport(*peer).value();
  }

  void onPrefillRequest(const net::ConnectionPtr& c, const proto::PrefillRequest& pr) {
    const uint64_t id = pr.request_id();
    if (jobs_.count(id)) return reject(c, id, failedPrecondition("request " + std::to_string(id) + " is already being prefilled here"));
    const auto& target = pr.kv_target();
    if (target.layout_fingerprint() != bundle_.fingerprint) {
      return reject(c, id, failedPrecondition("KV layout '" + target.layout_fingerprint() +
                                              "' does not match this worker's '" + bundle_.fingerprint + "'"));
    }
    if (target.layers_size() != 1) {
      return reject(c, id, invalidArgument("kv_target: expected one block table for all layers, got " +
                                           std::to_string(target.layers_size())));
    }
    std::vector<int32_t> prompt(pr.prompt_token_ids().begin(), pr.prompt_token_ids().end());
    Job job;
    job.targetBlocks.assign(target.layers(0).block_ids().begin(), target.layers(0).block_ids().end());
    if (int(job.targetBlocks.size()) < engine_.kv().blocksFor(int(prompt.size()))) {
      return reject(c, id, invalidArgument("kv_target: " + std::to_string(job.targetBlocks.size()) +
                                           " blocks cannot hold a " + std::to_string(prompt.size()) +
                                           "-token prompt"));
    }
    engine::KvLayout targetLayout = engine_.kv().layout();
    targetLayout.numBlocks = static_cast<int>(target.num_blocks());
    for (auto b : job.targetBlocks) {
      if (b < 0 || uint32_t(b) >= target.num_blocks()) return reject(c, id, invalidArgument("kv_target: block " + std::to_string(b) + " is outside the target's " + std::to_string(target.num_blocks()) + " blocks"));
    }
    if (size_t(target.regions_size()) != bundle_.kvRegions.size()) {
      return reject(c, id, invalidArgument("kv_target: " + std::to_string(target.regions_size()) +
                                           " KV regions, this worker has " +
                                           std::to_string(bundle_.kvRegions.size()) +
                                           " (one per tensor-parallel rank)"));
    }
    for (const auto& r : target.regions()) {
      if (r.kind() > static_cast<uint32_t>(MemKind::kCuda))
        return reject(c, id, invalidArgument("kv_target.regions: kind " + std::to_string(r.kind()) +
                                             " is not a memory kind (0 host, 1 pinned, 2 cuda)"));
      job.targetRegions.push_back(MemDesc{static_cast<uintptr_t>(r.base()), targetLayout.totalBytes(),
                                          static_cast<int>(r.device()), static_cast<MemKind>(r.kind())});
    }
    auto peer = agent_->loadPeer(target.transfer_conn_info());
    if (!peer.ok()) return reject(c, id, peer.status());
    engine::SamplingParams params = worker::fromProto(pr.sampling());
    params.maxTokens = 1;  // the first token; the decode worker samples the rest
    auto request = engine::Request::create(id, std::move(prompt), params, SystemClock::instance(),
                                           engine_.modelConfig().vocabSize);
    if (!request.ok()) return reject(c, id, request.status());
    metrics_.promptTokens.inc(double(request->numPromptTokens()));
    Status s = engine_.submit(std::move(request).value());
    if (!s.isOk()) return reject(c, id, s);
    job.decode = c;
    job.peer = peer.value();
    job.targetLayout = targetLayout;
    job.received = steadyNow();
    job.deadline = Deadline::in(milliseconds(pr.deadline_ms() ? int64_t(pr.deadline_ms()) : config_.kvTransfer.timeoutMs));
    jobs_.emplace(id, std::move(job));
  }

  // Layer `layer` of this step is in our cache: push the blocks each chunk touched.
  void pushLayer(int layer, const engine::StepView& step) {
    const engine::KvLayout& layout = step.kv->layout();
    for (const auto& e : step.entries) {
      auto it = jobs_.find(e.seq);
      if (it == jobs_.end() || !it->second.failed.isOk()) continue;
      Job& job = it->second;
      // The blocks this chunk wrote; the target's table was reserved for the whole prompt.
      auto table = step.kv->blockTable(e.seq);
      // From the first block not yet pushed: on the first chunk that is block 0, so a prefix
      // this worker had cached (and did not recompute) travels too.
      const int firstBlock = job.pushedTokens / layout.blockSize;
      const int endBlock = (e.start + e.count + layout.blockSize - 1) / layout.blockSize;
      const std::vector<int> blocks(table.begin() + firstBlock, table.begin() + endBlock);
      const std::vector<int> targetBlocks(job.targetBlocks.begin() + firstBlock,
                                          job.targetBlocks.begin() + endBlock);
      // Tensor parallelism: rank r's region goes to the target's rank r region (same block
      // ids, the same share of the kv heads), one transfer per rank.
      for (size_t r = 0; r < bundle_.kvRegions.size() && job.failed.isOk(); ++r) {
        const MemDesc& mine = bundle_.kvRegions[r];
        const MemDesc& theirs = job.targetRegions[r];
        kvt::KvSource source{mine.addr, layout, blocks, mine.kind, mine.device};
        kvt::KvTarget target{job.peer, theirs.addr, job.targetLayout, targetBlocks, theirs.kind,
                             theirs.device};
        auto pairs = kvt::KvTransceiver::buildSegments(source, target, layer, layer + 1);
        if (!pairs.ok()) {
          job.failed = pairs.status();
          break;
        }
        auto t = agent_->post(pairs->local, pairs->remote, job.peer, std::nullopt);
        if (!t.ok()) {
          job.failed = t.status();
          break;
        }
        job.inflight.push_back(t.value());
        job.bytes += totalBytes(pairs->local);
      }
      if (job.failed.isOk() && layer == layout.numLayers - 1) job.pushedTokens = e.start + e.count;
    }
    agent_->progress();
  }

  void onEvents(const std::vector<EngineEvent>& events) {
    for (const auto& e : events) {
      auto it = jobs_.find(e.requestId);
      if (it == jobs_.end()) continue;
      switch (e.kind) {
        case EngineEvent::Kind::kToken: it->second.first = e.token; break;
        case EngineEvent::Kind::kFinished:
          it->second.computed = true;
          it->second.computedAt = steadyNow();
          break;
        case EngineEvent::Kind::kFailed: it->second.failed = e.error; break;
      }
    }
  }

  // Polls transfers; answers the decode worker for every job that is done or failed.
  void settleJobs() {
    std::vector<uint64_t> done, failed;
    for (auto& [id, job] : jobs_) {
      for (size_t i = 0; i < job.inflight.size();) {
        Status s = agent_->poll(job.inflight[i]);
        if (s.inProgress()) {
          ++i;
          continue;
        }
        if (!s.isOk() && job.failed.isOk()) job.failed = s;
        job.inflight.erase(job.inflight.begin() + long(i));
      }
      if (job.failed.isOk() && job.deadline.expired()) {
        job.failed = deadlineExceeded("prefill and KV push did not finish within the request's deadline");
      }
      if (!job.failed.isOk()) failed.push_back(id);
      else if (job.computed && job.inflight.empty()) done.push_back(id);
    }
    for (uint64_t id : done) finishJob(id);
    for (uint64_t id : failed) endJob(id, jobs_.at(id).failed);
  }

  void finishJob(uint64_t id) {
    Job& job = jobs_.at(id);
    proto::Envelope env;
    env.set_request_id(id);
    auto* d = env.mutable_prefill_done();
    d->set_request_id(id);
    d->set_first_token_id(static_cast<uint32_t>(job.first->id));
    *d->mutable_first_logprob() = worker::toProto(*job.first);
    d->set_bytes_transferred(job.bytes);
    auto* t = d->mutable_timings();
    t->set_prefill_worker_id(flags_.workerId);
    t->set_route(proto::ROUTE_DISAGGREGATED);
    t->set_prefill_ms(1e3 * secondsBetween(job.received, *job.computedAt));
    t->set_transfer_ms(1e3 * secondsBetween(*job.computedAt, steadyNow()));
    if (auto name = agent_->peerTransport(job.peer); name.ok()) t->set_transport(name.value());
    (void)job.decode->send(std::move(env));
    engine_.release(id);
    jobs_.erase(id);
  }

  // Ends a job: cancels its transfers, frees its blocks, and tells the decode worker why
  // (unless it asked for the end itself).
  void endJob(uint64_t id, const Status& why, bool notify = true) {
    auto it = jobs_.find(id);
    if (it == jobs_.end()) return;
    for (auto t : it->second.inflight) (void)agent_->cancel(t);
    if (notify && !why.isOk()) {
      PD_LOG(kWarn, kTag) << "request " << id << ": " << why.toString();
      reject(it->second.decode, id, why);
    }
    engine_.cancel(id);
    engine_.release(id);
    jobs_.erase(it);
  }

  void sendLoadReport() {
    uint32_t inflight = 0;
    for (const auto& [id, job] : jobs_) inflight += uint32_t(job.inflight.size());
    worker::publishLoad(proto::ROLE_PREFILL, flags_.workerId, engine_.load(), inflight, metrics_, *router_);
  }

  std::unique_ptr<net::FramedServer> server_;
  std::unique_ptr<worker::RouterLink> router_;
  std::thread loop_;
  std::atomic<bool> stopping_{false};
  std::unordered_map<uint64_t, Job> jobs_;
};

}  // namespace

Result<std::unique_ptr<PrefillService>> PrefillService::create(config::ClusterConfig config,
                                                               worker::WorkerFlags flags) {
  if (!flags.modelPath.empty()) config.model.path = flags.modelPath;
  PD_ASSIGN_OR_RETURN(auto bundle, worker::buildEngine(config, /*releaseKvOnFinish=*/false));
  return std::unique_ptr<PrefillService>(
      new PrefillServiceImpl(std::move(config), std::move(flags), std::move(bundle)));
}

}  // namespace pd::prefill
