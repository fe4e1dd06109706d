// pdserve-worker: one worker process that serves either role and switches between them at run
// time (docs/serving.md "Role switching"). It owns one worker::Service at a time --
// a prefill_worker/ or a decode_worker/ service -- and on requestSwitch() replaces it with
// the other role's, in-process:
//
//   drain the current service exactly as SIGTERM does (no new work, /health 503 draining,
//   the router routes around it, in-flight work finishes within engine.drain_timeout_ms,
//   what is left ends `unavailable` and the router migrates it) -> stop it and destroy it
//   (its ports, KV cache and threads are released) -> create the other role's service on the
//   SAME weights (worker::buildEngine's `preloaded`: cpu shares the f32 host weights, cuda
//   streams them to the device again) with a KV cache built for the new role -> start it:
//   it binds the same --port / --transfer-port / --metrics-port (a 0 is chosen anew, and
//   --ports-file rewritten) and registers with the router under the same --id in its new role.
//
// pdserve_role_switches_total{from,to} counts the switches of this process; each service has
// its own metrics registry, so the count is kept here and written into every new one.
//
// Threads: the constructor, start(), requestSwitch(), shutdown() and failure() are for the
// owner thread (main's signal loop). A switch runs on a thread of its own so the owner keeps
// answering signals: a second requestSwitch() during it is refused (false, and a log line);
// shutdown() during it lets the drain finish, starts no new role, and stops what runs.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

#include "common/base/enum_names.h"
#include "common/base/status.h"
#include "common/config/cluster_config.h"
#include "engine/model_weights.h"
#include "worker/flags.h"
#include "worker/worker_main.h"

namespace pd::flex {

enum class Role { kPrefill, kDecode };
inline constexpr EnumNames<Role, 2> kRoleNames{{{Role::kPrefill, "prefill"}, {Role::kDecode, "decode"}}};
inline const char* roleName(Role role) { return enumName(kRoleNames, role); }
// "prefill" or "decode"; anything else is an error naming --role.
Result<Role> parseRole(std::string_view text);
inline Role otherRole(Role role) { return role == Role::kPrefill ? Role::kDecode : Role::kPrefill; }

// The role's service (prefill_worker/ or decode_worker/), built on `weights` when set.
Result<std::unique_ptr<worker::Service>> createService(Role role, config::ClusterConfig config,
                                                       worker::WorkerFlags flags,
                                                       std::shared_ptr<const engine::ModelWeights> weights);

inline constexpr const char* kRoleSwitchesMetric = "pdserve_role_switches_total";

class FlexWorker {
 public:
  FlexWorker(config::ClusterConfig config, worker::WorkerFlags flags, Role initial);
  ~FlexWorker();  // shutdown()
  FlexWorker(const FlexWorker&) = delete;
  FlexWorker& operator=(const FlexWorker&) = delete;

  // Creates and starts the initial role's service. Errors as the services' create/start.
  Status start();
  // Begins a switch to the other role. false (and a log line) while one is in progress or
  // after shutdown(); the switch's own failure is reported by failure().
  bool requestSwitch();
  // Set once a switch could not build or start the new role: the process should exit 1 (its
  // supervisor restarts it). The old role is already drained and stopped then.
  std::optional<Status> failure() const;
  bool switching() const { return switching_.load(); }
  Role role() const;
  // The running service's model (worker::Service::weights); null between roles.
  std::shared_ptr<const engine::ModelWeights> weights() const;
  // Drains the running service (engine.drain_timeout_ms) and stops it; a switch in progress
  // is waited for first (and starts no new role). Idempotent.
  void shutdown();

 private:
  void runSwitch(Role from, Role to);
  void exportSwitches(worker::Service& service) const;

  const config::ClusterConfig config_;
  const worker::WorkerFlags flags_;
  mutable std::mutex mu_;
  std::unique_ptr<worker::Service> service_;           // guarded by mu_; null between roles
  Role role_;                                          // guarded by mu_
  std::optional<Status> failure_;                      // guarded by mu_
  std::map<std::pair<Role, Role>, int64_t> switches_;  // guarded by mu_
  std::atomic<bool> switching_{false};
  std::atomic<bool> shuttingDown_{false};
  std::thread switcher_;  // owner thread only
};

}  // namespace pd::flex
