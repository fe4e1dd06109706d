#include "prefill_worker/prefill_service.h"

#include "common/base/log.h"
#include "common/net/framed.h"
#include "prefill_worker/prefill_jobs.h"
#include "worker/worker_loop.h"

namespace pd::prefill {
namespace {

constexpr const char* kTag = "prefill";

// The prefill role: decode workers' control connections in, PrefillJobs for the requests.
class PrefillRole final : public worker::RolePolicy {
 public:
  explicit PrefillRole(worker::WorkerLoop& loop) : loop_(loop), jobs_(loop) {}

  // I/O threads: a decode worker's frame, posted to the loop.
  void onDecodeMessage(const net::ConnectionPtr& c, proto::Envelope&& env) {
    switch (env.body_case()) {
      case proto::Envelope::kKvConnect:
        return jobs_.connect(c, env.kv_connect());
      case proto::Envelope::kPrefillRequest:
        return jobs_.accept(c, env.prefill_request());
      case proto::Envelope::kCancel:
        // An acknowledgement answers this worker's Cancel of a pull (PrefillPulls).
        if (env.cancel().ack()) return jobs_.onPullReply(c, env);
        return jobs_.cancel(c, env.cancel().request_id());
      case proto::Envelope::kPullDone:
      case proto::Envelope::kError:
        return jobs_.onPullReply(c, env);
      default:
        PD_LOG(kWarn, kTag) << "ignoring '" << net::bodyName(env) << "' from " << c->remoteAddress();
    }
  }
  void onDecodeClosed(const net::ConnectionPtr& c, const Status& why) { jobs_.dropConnection(c, why); }

  void onRouterMessage(worker::RouterId, proto::Envelope&& env) override {
    PD_LOG(kWarn, kTag) << "ignoring '" << net::bodyName(env) << "' from the router";
  }
  void onLayerDone(int layer, const engine::StepView& step) override { jobs_.onLayerDone(layer, step); }
  void onStepEvents(const std::vector<engine::EngineEvent>& events) override { jobs_.onStepEvents(events); }
  void poll() override {
    jobs_.settle();
    jobs_.exportStates();
  }
  std::chrono::microseconds pollInterval() const override {
    return jobs_.hasTransfers() ? std::chrono::microseconds(0) : std::chrono::milliseconds(20);
  }
  void addLoad(worker::LoadSnapshot& load) const override { load.inflightTransfers = jobs_.transfersInFlight(); }
  void shutdown(const Status& why) override { jobs_.shutdown(why); }
  bool idle() const override { return jobs_.empty(); }

 private:
  worker::WorkerLoop& loop_;
  PrefillJobs jobs_;
};

class PrefillServiceImpl final : public PrefillService {
 public:
  PrefillServiceImpl(config::ClusterConfig config, worker::WorkerFlags flags, worker::EngineBundle bundle)
      : loop_(std::move(config), std::move(flags), std::move(bundle), proto::ROLE_PREFILL), role_(loop_) {}
  ~PrefillServiceImpl() override { stop(); }

  Status start() override {
    PD_RETURN_IF_ERROR(loop_.prepare());
    const auto& bundle = loop_.bundle();
    const auto& flags = loop_.flags();
    // Decode workers must prove the cluster secret before anything of theirs is read: no
    // fingerprint check, no KvConnect (which loads their transfer endpoint) before that.
    net::ConnectionOptions opts = loop_.leasedControlOptions("prefill_control");
    opts.hello = worker::workerHello(proto::ROLE_PREFILL, flags, bundle);
    net::ConnectionCallbacks cb;
    cb.onOpen = [fingerprint = bundle.fingerprint](const net::ConnectionPtr& c) {
      if (c->peerHello().model_fingerprint() != fingerprint) {
        c->close(failedPrecondition("peer serves '" + c->peerHello().model_fingerprint() + "', this prefill worker '" +
                                    fingerprint + "'"));
      }
    };
    cb.onMessage = [this](const net::ConnectionPtr& c, proto::Envelope&& env) {
      auto shared = std::make_shared<proto::Envelope>(std::move(env));
      loop_.post([this, c, shared] { role_.onDecodeMessage(c, std::move(*shared)); });
    };
    cb.onClose = [this](const net::ConnectionPtr& c, const Status& why) {
      loop_.post([this, c, why] { role_.onDecodeClosed(c, why); });
    };
    PD_ASSIGN_OR_RETURN(server_, net::FramedServer::listen(loop_.io(), loop_.bindHost(), flags.port, opts, cb));
    proto::Hello hello = opts.hello;
    hello.set_address(flags.advertiseHost + ":" + std::to_string(server_->port()));
    loop_.run(role_, std::move(hello));
    PD_LOG(kInfo, kTag) << flags.workerId << ": model " << bundle.modelName << ", control port " << server_->port()
                        << ", metrics port " << loop_.metricsPort();
    return Status::ok();
  }

  void drain(std::chrono::milliseconds timeout) override { loop_.drain(timeout); }
  void stop() override {
    if (server_) server_->stop();
    loop_.stop();
  }

  int controlPort() const override { return server_ ? server_->port() : 0; }
  int metricsPort() const override { return loop_.metricsPort(); }
  std::shared_ptr<const engine::ModelWeights> weights() const override { return loop_.bundle().model; }
  metrics::Registry& registry() override { return loop_.registry(); }

 private:
  worker::WorkerLoop loop_;
  PrefillRole role_;
  std::unique_ptr<net::FramedServer> server_;
};

}  // namespace

Result<std::unique_ptr<PrefillService>> PrefillService::create(config::ClusterConfig config, worker::WorkerFlags flags,
                                                               std::shared_ptr<const engine::ModelWeights> weights) {
  if (!flags.modelPath.empty()) config.model.path = flags.modelPath;
  PD_ASSIGN_OR_RETURN(auto bundle, worker::buildEngine(config, /*releaseKvOnFinish=*/false, std::move(weights)));
  return std::unique_ptr<PrefillService>(
      new PrefillServiceImpl(std::move(config), std::move(flags), std::move(bundle)));
}

}  // namespace pd::prefill
