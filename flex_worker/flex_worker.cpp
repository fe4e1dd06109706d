#include "flex_worker/flex_worker.h"

#include <chrono>
#include <cstdio>

#include "common/base/log.h"
#include "decode_worker/decode_service.h"
#include "prefill_worker/prefill_service.h"

namespace pd::flex {

namespace {
constexpr const char* kTag = "flex";
constexpr const char* kSwitchesHelp =
    "Role switches of this pdserve-worker process (drained in one role, restarted in the other on "
    "the same "
    "weights), by the role it left and the one it took.";
}  // namespace

Result<Role> parseRole(std::string_view text) {
  if (const std::optional<Role> role = enumFromName(kRoleNames, text)) return *role;
  return invalidArgument("--role: expected " + enumNameList(kRoleNames, " or ") + ", got '" + std::string(text) + "'");
}

Result<std::unique_ptr<worker::Service>> createService(Role role, config::ClusterConfig config,
                                                       worker::WorkerFlags flags,
                                                       std::shared_ptr<const engine::ModelWeights> weights) {
  if (role == Role::kPrefill) {
    PD_ASSIGN_OR_RETURN(auto s,
                        prefill::PrefillService::create(std::move(config), std::move(flags), std::move(weights)));
    return std::unique_ptr<worker::Service>(std::move(s));
  }
  PD_ASSIGN_OR_RETURN(auto s, decode::DecodeService::create(std::move(config), std::move(flags), std::move(weights)));
  return std::unique_ptr<worker::Service>(std::move(s));
}

FlexWorker::FlexWorker(config::ClusterConfig config, worker::WorkerFlags flags, Role initial)
    : config_(std::move(config)), flags_(std::move(flags)), role_(initial) {}

FlexWorker::~FlexWorker() { shutdown(); }

Role FlexWorker::role() const {
  std::lock_guard<std::mutex> lock(mu_);
  return role_;
}

std::shared_ptr<const engine::ModelWeights> FlexWorker::weights() const {
  std::lock_guard<std::mutex> lock(mu_);
  return service_ ? service_->weights() : nullptr;
}

std::optional<Status> FlexWorker::failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void FlexWorker::exportSwitches(worker::Service& service) const {
  // Both directions from the start, so a scrape before the first switch sees 0, not nothing.
  for (Role from : {Role::kPrefill, Role::kDecode}) {
    const Role to = otherRole(from);
    auto it = switches_.find({from, to});
    metrics::Counter c = service.registry().counter(kRoleSwitchesMetric, kSwitchesHelp,
                                                    {{"from", roleName(from)}, {"to", roleName(to)}});
    if (it != switches_.end()) c.inc(double(it->second));
  }
}

Status FlexWorker::start() {
  std::lock_guard<std::mutex> lock(mu_);
  PD_ASSIGN_OR_RETURN(auto service, createService(role_, config_, flags_, nullptr));
  exportSwitches(*service);
  PD_RETURN_IF_ERROR(service->start());
  PD_RETURN_IF_ERROR(worker::writeServicePorts(flags_, *service));
  service_ = std::move(service);
  PD_LOG(kInfo, kTag) << flags_.workerId << ": serving as " << roleName(role_)
                      << " (SIGUSR1 switches to the other role)";
  return Status::ok();
}

bool FlexWorker::requestSwitch() {
  if (shuttingDown_.load()) return false;
  if (switching_.load()) {
    PD_LOG(kInfo, kTag) << flags_.workerId << ": a role switch is already in progress; ignoring this request";
    return false;
  }
  Role from;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!service_) {
      PD_LOG(kWarn, kTag) << flags_.workerId << ": no role is running; ignoring the switch request";
      return false;
    }
    from = role_;
  }
  if (switcher_.joinable()) switcher_.join();  // the previous switch, finished
  switching_ = true;
  switcher_ = std::thread([this, from] { runSwitch(from, otherRole(from)); });
  return true;
}

void FlexWorker::runSwitch(Role from, Role to) {
  const auto t0 = std::chrono::steady_clock::now();
  PD_LOG(kInfo, kTag) << flags_.workerId << ": switching role " << roleName(from) << " -> " << roleName(to)
                      << " (draining up to " << config_.engine.drainTimeoutMs << " ms)";
  // The running service is only touched by this thread until switching_ is cleared: the
  // owner's shutdown() joins us first.
  worker::Service* old = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    old = service_.get();
  }
  old->drain(std::chrono::milliseconds(config_.engine.drainTimeoutMs));
  // KV fencing (docs/reliability.md): blocks quarantined over a one-sided lane may still be
  // written by a prefill worker that has not acknowledged its cancel. A process that exits is
  // safe (the writes then fail); this one would free that memory and map the new role's KV
  // cache, possibly at the same addresses. The drained loop still runs and resolves the
  // quarantine (acknowledgements, redials); wait for it, as long as a remote prefill may
  // take. Still held then: never freed on a timer -- the process exits instead.
  if (const int64_t held = old->kvBlocksQuarantined(); held > 0) {
    PD_LOG(kInfo, kTag) << flags_.workerId << ": " << held << " KV block(s) quarantined; waiting up to "
                        << config_.kvTransfer.timeoutMs << " ms for their writers before the switch";
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(config_.kvTransfer.timeoutMs);
    while (old->kvBlocksQuarantined() > 0 && !shuttingDown_.load() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (const int64_t still = old->kvBlocksQuarantined(); still > 0 && !shuttingDown_.load()) {
      Status why = unavailable(flags_.workerId + ": role switch " + roleName(from) + " -> " + roleName(to) + ": " +
                               std::to_string(still) +
                               " KV block(s) still quarantined (a remote writer may still write into them): not "
                               "reusing this process's memory; exiting for the supervisor to restart it");
      PD_LOG(kError, kTag) << why.toString();
      old->stop();  // the process exits next (main sees failure()); the memory is never reused
      std::lock_guard<std::mutex> lock(mu_);
      failure_ = why;
      switching_ = false;
      return;
    }
  }
  old->stop();
  std::shared_ptr<const engine::ModelWeights> weights = old->weights();
  {
    // Destroyed before the new one is built: its ports, KV cache (device memory on cuda) and
    // threads are released, so the new role can bind the same ports and size its cache.
    std::unique_ptr<worker::Service> gone;
    {
      std::lock_guard<std::mutex> lock(mu_);
      gone = std::move(service_);
    }
    gone.reset();
  }
  if (shuttingDown_.load()) {
    PD_LOG(kInfo, kTag) << flags_.workerId << ": shutting down during the switch; " << roleName(to) << " not started";
    switching_ = false;
    return;
  }
  auto created = createService(to, config_, flags_, std::move(weights));
  Status started = created.ok() ? Status::ok() : created.status();
  if (started.isOk()) {
    {
      // Counted before start: the first scrape of the new /metrics already says so.
      std::lock_guard<std::mutex> lock(mu_);
      ++switches_[{from, to}];
      exportSwitches(**created);
    }
    started = created.value()->start();
    // Rewritten for the new role: with --metrics-port 0 its port is a new one.
    if (started.isOk()) started = worker::writeServicePorts(flags_, **created);
    if (started.isOk()) {
      std::lock_guard<std::mutex> lock(mu_);
      service_ = std::move(created).value();
      role_ = to;
    }
  }
  if (!started.isOk()) {
    Status why = started.withContext(flags_.workerId + ": role switch " + roleName(from) + " -> " + roleName(to));
    PD_LOG(kError, kTag) << why.toString();
    std::lock_guard<std::mutex> lock(mu_);
    failure_ = why;
  } else {
    char secs[32];
    std::snprintf(secs, sizeof secs, "%.2f s",
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    PD_LOG(kInfo, kTag) << flags_.workerId << ": switched role " << roleName(from) << " -> " << roleName(to) << " in "
                        << secs << "; registering with the router as " << roleName(to);
  }
  switching_ = false;
}

void FlexWorker::shutdown() {
  if (shuttingDown_.exchange(true)) {
    if (switcher_.joinable()) switcher_.join();
    return;
  }
  if (switcher_.joinable()) switcher_.join();
  std::unique_ptr<worker::Service> service;
  {
    std::lock_guard<std::mutex> lock(mu_);
    service = std::move(service_);
  }
  if (!service) return;
  service->drain(std::chrono::milliseconds(config_.engine.drainTimeoutMs));
  service->stop();
}

}  // namespace pd::flex
