#include "worker/worker_loop.h"

#include <algorithm>
#include <cmath>

#include "common/base/log.h"

namespace pd::worker {

using namespace std::chrono;

namespace {
// With nothing to do the loop sleeps at most this long between looks at its timers.
constexpr auto kMaxIdleWait = milliseconds(20);
}  // namespace

WorkerLoop::WorkerLoop(config::ClusterConfig config, WorkerFlags flags, EngineBundle bundle, proto::Role role)
    : config_(std::move(config)),
      flags_(std::move(flags)),
      bundle_(std::move(bundle)),
      role_(role),
      secret_(config_.cluster.authenticated() ? std::make_shared<const std::string>(config_.cluster.secret) : nullptr),
      bindHost_(!flags_.bindHost.empty()      ? flags_.bindHost
                : role == proto::ROLE_PREFILL ? config_.pools.prefill.host
                                              : config_.pools.decode.host),
      io_(2, std::string(roleName()) + "-io"),
      registry_(metrics::Labels{{"role", roleName()}, {"worker", flags_.workerId}}),
      metrics_(registry_),
      status_(io_, registry_, [this]() -> std::optional<StatusEndpoint::Unhealthy> {
        if (stopping_.load()) return StatusEndpoint::Unhealthy{"stopping", "the worker is shutting down"};
        if (draining_.load()) return StatusEndpoint::Unhealthy{"draining", "the worker takes no new requests"};
        // A refusal outranks "up": the router refuses just after the hello, so the link is
        // briefly open before its Error arrives.
        const RouterLinks* links = healthLinks_.load();
        if (std::string why = links ? links->refusal() : std::string(); !why.empty())
          return StatusEndpoint::Unhealthy{"refused", why};
        if (!routersUp_.load()) return StatusEndpoint::Unhealthy{"unregistered", "not registered with a router"};
        return std::nullopt;
      }) {}

WorkerLoop::~WorkerLoop() { stop(); }

const char* WorkerLoop::roleName() const { return role_ == proto::ROLE_PREFILL ? "prefill" : "decode"; }

Status WorkerLoop::prepare() {
  config::WorkerEndpoints endpoints{
      roleName(),
      bindHost_,
      flags_.bindHost.empty() ? "pools." + std::string(roleName()) + ".host" : "--bind-host",
      config_.kvTransfer.listenHost,
      flags_.advertiseHost,
      routerHosts()};
  PD_RETURN_IF_ERROR(config::checkEndpoints(endpoints));
  metrics::setInternalAuth(registry_, secret_ != nullptr);
  metrics::exportProcessInfo(registry_, roleName());
  if (config_.metrics.vllmCompatibleNames)
    metrics::exportVllmNames(registry_, metrics::MetricsProcess::kWorker, bundle_.modelName);
  if (!secret_) {
    PD_LOG(kWarn, roleName())
        << flags_.workerId
        << ": internal planes are UNAUTHENTICATED (no cluster.secret_file): any peer that reaches "
           "the control and KV ports can register, take traffic and write KV "
           "(docs/security.md)";
  }
  PD_RETURN_IF_ERROR(status_.start(bindHost_, flags_.metricsPort));
  PD_ASSIGN_OR_RETURN(agent_, startTransferAgent(config_, flags_, bundle_.kvRegions, registry_));
  metrics_.setCacheConfig(engine().kv().layout().blockSize, engine().kv().numTotalBlocks());
  PD_RETURN_IF_ERROR(attachKvTiers(config_, flags_.workerId, bundle_));
  kvTierMetrics_ = std::make_unique<KvTierMetrics>(registry_);
  if (const auto& ev = config_.engine.kvEvents; !ev.zmqEndpoint.empty() && config_.engine.enablePrefixCaching) {
    PD_ASSIGN_OR_RETURN(zmq_, ZmqKvPublisher::bind(ev.zmqEndpoint, ev.zmqTopic, engine().kv().layout().blockSize,
                                                   config_.engine.backend == config::Backend::kCuda ? "GPU" : "CPU"));
    PD_LOG(kInfo, roleName()) << flags_.workerId << ": KV events on " << zmq_->endpoint() << " (topic '" << ev.zmqTopic
                              << "')";
  }
  if (const std::string& dir = config_.logging.stepTraceDir; !dir.empty()) {
    PD_ASSIGN_OR_RETURN(stepTrace_, StepTrace::open(dir, flags_.workerId, roleName()));
    PD_LOG(kInfo, roleName()) << flags_.workerId << ": tracing steps to " << stepTrace_->path();
  }
  metrics_.modelLoadSeconds.set(bundle_.loadSeconds);
  return Status::ok();
}

std::vector<std::string> WorkerLoop::routerHosts() const {
  std::vector<std::string> hosts;
  for (const auto& r : flags_.routers) hosts.push_back(r.host);
  return hosts;
}

void WorkerLoop::run(RolePolicy& role, proto::Hello hello) {
  policy_ = &role;
  std::vector<RouterTarget> targets = flags_.routers;
  for (auto& t : targets)
    if (t.port == 0) t.port = config_.router.controlPort;
  const bool publish = config_.engine.kvEvents.publish && config_.engine.enablePrefixCaching;
  kvToRouters_ = publish;
  hello.set_kv_events(publish);
  routers_ = std::make_unique<RouterLinks>(
      io_, inbox_, std::move(targets),
      [&] {
        net::ConnectionOptions o = controlOptions("router_link");
        o.hello = std::move(hello);
        return o;
      }(),
      RouterLinks::Handlers{[this](RouterId from, proto::Envelope&& env) { onRouterMessage(from, std::move(env)); },
                            [this](RouterId router, bool up, const Status& why) { onRouterState(router, up, why); }});
  healthLinks_ = routers_.get();
  if (publish || zmq_) {
    KvEventPublisher::Sink sink{[this, publish](const proto::Envelope& env) {
                                  if (publish) routers_->broadcast(env, true);
                                },
                                [this](RouterId to, proto::Envelope env) { (void)routers_->send(to, std::move(env)); },
                                nullptr};
    if (zmq_) {
      sink.tap = [this](std::span<const engine::KvBlockEvent> events, uint64_t createdUs) {
        zmq_->publish(events, createdUs);
      };
    }
    kvEvents_ = std::make_unique<KvEventPublisher>(engine().kv(), std::move(sink), registry_);
  }
  reporter_ = std::make_unique<LoadReporter>(io_, *routers_, metrics_, role_, flags_.workerId,
                                             milliseconds(config_.router.loadReportIntervalMs));
  thread_ = std::thread([this] { loop(); });
  routers_->start();
  reporter_->start();
}

// KV events are the loop's, not the role's: a router's resync request is answered here.
void WorkerLoop::onRouterMessage(RouterId from, proto::Envelope&& env) {
  if (env.body_case() == proto::Envelope::kKvResync) {
    if (kvToRouters_ && kvEvents_ && routers_->takesKvEvents(from)) kvEvents_->snapshotTo(from);
    return;
  }
  policy_->onRouterMessage(from, std::move(env));
}

// A router that registered us starts from a snapshot of our cache (docs/kv_events.md).
void WorkerLoop::onRouterState(RouterId router, bool up, const Status& why) {
  routersUp_ = routers_->anyUp();
  if (up && kvToRouters_ && kvEvents_ && routers_->takesKvEvents(router)) kvEvents_->snapshotTo(router);
  policy_->onRouterState(router, up, why);
}

void WorkerLoop::drain(milliseconds timeout) {
  if (!thread_.joinable() || draining_.exchange(true)) return;
  PD_LOG(kInfo, roleName()) << flags_.workerId << ": draining";
  const auto deadline = steadyNow() + timeout;
  while (steadyNow() < deadline) {
    // The loop refreshes idle_ after every iteration: clear it and wake the loop, so what is
    // read next is from an iteration that saw the draining flag.
    idle_ = false;
    post([] {});
    std::this_thread::sleep_for(milliseconds(20));
    if (idle_.load()) break;
  }
  PD_LOG(kInfo, roleName()) << flags_.workerId << ": " << (idle_.load() ? "drained" : "drain timed out");
}

// The loop thread ends before the router links do: its last iteration ends every request
// through the links (their clients read why), and the closures the links posted to the inbox
// hold the links, so none may run after the links are gone (an ASan use-after-free before).
void WorkerLoop::stop() {
  if (stopping_.exchange(true)) return;
  if (reporter_) reporter_->stop();
  inbox_.post([] {});
  if (thread_.joinable()) thread_.join();
  if (routers_) routers_->stop();
  io_.stop();
}

net::ConnectionOptions WorkerLoop::controlOptions(std::string plane) {
  net::ConnectionOptions o;
  o.clusterSecret = secret_;
  o.plane = std::move(plane);
  o.onAuthFailure = [this](const std::string& p, const Status&) { metrics::authFailure(registry_, p); };
  o.onHandshakeFailure = [this](const std::string& p, const char* why) {
    metrics::handshakeFailure(registry_, p, why);
  };
  return o;
}

net::ConnectionOptions WorkerLoop::leasedControlOptions(std::string plane) {
  net::ConnectionOptions o = controlOptions(std::move(plane));
  o.keepaliveInterval = std::chrono::milliseconds(config_.kvTransfer.heartbeatMs);
  o.leaseTimeout = std::chrono::milliseconds(config_.kvTransfer.leaseMs);
  o.onLeaseExpired = [this](const std::string& p, const Status&) { metrics::leaseExpired(registry_, p); };
  return o;
}

WorkerLoop::TimerId WorkerLoop::at(SteadyTime when, std::function<void()> fn) {
  const TimerId id = nextTimer_++;
  insertTimer(id, when, std::move(fn));
  return id;
}

void WorkerLoop::insertTimer(TimerId id, SteadyTime when, std::function<void()> fn) {
  timers_.emplace(std::make_pair(when, id), std::move(fn));
  timerAt_.emplace(id, when);
}

struct WorkerLoop::Lease {
  std::function<SteadyTime()> expiry;
  std::function<void()> fn;
};

WorkerLoop::TimerId WorkerLoop::lease(std::function<SteadyTime()> expiry, std::function<void()> fn) {
  const TimerId id = nextTimer_++;
  const SteadyTime first = expiry();
  armLease(id, first, std::make_shared<Lease>(Lease{std::move(expiry), std::move(fn)}));
  return id;
}

// Re-armed under the same id, so the owner's TimerId stays valid for cancelTimer.
void WorkerLoop::armLease(TimerId id, SteadyTime when, std::shared_ptr<Lease> lease) {
  insertTimer(id, when, [this, id, lease] {
    const SteadyTime until = lease->expiry();
    if (steadyNow() < until) return armLease(id, until, lease);
    lease->fn();
  });
}

void WorkerLoop::cancelTimer(TimerId id) {
  auto it = timerAt_.find(id);
  if (it == timerAt_.end()) return;
  timers_.erase({it->second, id});
  timerAt_.erase(it);
}

void WorkerLoop::runDueTimers() {
  const SteadyTime now = steadyNow();
  while (!timers_.empty() && timers_.begin()->first.first <= now) {
    auto node = timers_.extract(timers_.begin());
    timerAt_.erase(node.key().second);
    node.mapped()();  // may add or cancel timers
  }
}

microseconds WorkerLoop::idleWait() const {
  // A stalled engine changes only when something arrives (the inbox wakes the loop), a timer
  // fires or the role's poll frees blocks: it waits as an idle one does.
  if (bundle_.engine->hasWork() && !stalled_) return microseconds(0);
  auto wait = std::min(duration_cast<microseconds>(kMaxIdleWait), policy_->pollInterval());
  if (!timers_.empty()) {
    auto untilNext = duration_cast<microseconds>(timers_.begin()->first.first - steadyNow());
    wait = std::clamp(untilNext, microseconds(0), wait);
  }
  return wait;
}

void WorkerLoop::loop() {
  std::vector<engine::EngineEvent> events;
  while (!stopping_) {
    inbox_.runPending(idleWait());
    runDueTimers();
    agent_->progress();
    policy_->poll();
    stalled_ = false;
    if (engine().hasWork()) {
      events.clear();
      reporter_->stepStarted();
      Status s = engine().step(&events,
                               [this](int layer, const engine::StepView& step) { policy_->onLayerDone(layer, step); });
      reporter_->stepEnded();
      const engine::StepRecord& step = engine().lastStep();
      stalled_ = s.isOk() && events.empty() && step.decodeRows == 0 && step.promptTokens == 0;
      metrics_.observeStep(step.decodeRows, step.promptTokens, step.seconds, step.gapSeconds);
      if (stepTrace_) stepTrace_->record(step);
      PD_LOG(kDebug, roleName()) << "step: " << step.decodeRows << " streams, " << step.promptTokens
                                 << " prompt tokens in " << std::lround(step.seconds * 1e4) / 10.0 << " ms after "
                                 << std::lround(step.gapSeconds * 1e4) / 10.0 << " ms between steps"
                                 << (step.remoteKvExpected ? ", remote KV expected" : "");
      if (!s.isOk()) {
        PD_LOG(kError, roleName()) << "step failed: " << s.toString();
      }
      // The blocks this step named go out before its tokens: a router that has a request's
      // last chunk has the KV events of its prompt.
      if (kvEvents_) kvEvents_->flush();
      policy_->onStepEvents(events);
    }
    // What the role's handlers changed (frees, reservations that evicted), and the disk
    // tier's finished writes. Before the load snapshot: a report never names a batch that
    // was not sent yet.
    engine().pollKvTiers();
    if (kvEvents_) kvEvents_->flush();
    if (kvTierMetrics_) kvTierMetrics_->sync(engine().kv(), engine().kvTiers());
    LoadSnapshot snapshot;
    snapshot.engine = engine().load();
    snapshot.kvEventSeq = kvEvents_ ? kvEvents_->seq() : 0;
    snapshot.draining = draining_.load();
    {
      const engine::KvLayout& kl = engine().kv().layout();
      snapshot.kvBytesPerToken =
          uint64_t(kl.numLayers) * kl.blockBytes() / uint64_t(std::max(1, kl.blockSize)) * bundle_.kvRegions.size();
    }
    snapshot.lanes = agent().laneRates().figures();
    policy_->addLoad(snapshot);
    reporter_->publish(snapshot);
    idle_ = policy_->idle() && !engine().hasWork();
  }
  // Stopping: the role ends every request with an error its client can read.
  policy_->shutdown(unavailable(std::string(roleName()) + " worker " + flags_.workerId + " is shutting down"));
}

}  // namespace pd::worker
