#include "tools/local_actuator.h"

#include <algorithm>
#include <cstdio>

#include "common/base/log.h"

namespace pd::tools {
namespace {

constexpr const char* kTag = "up";

std::pair<int, int> bounds(const config::ClusterConfig& cfg, Pool pool) {
  return pool == Pool::kPrefill
             ? std::pair{cfg.pools.prefill.minReplicas, cfg.pools.prefill.maxReplicas}
             : std::pair{cfg.pools.decode.minReplicas, cfg.pools.decode.maxReplicas};
}

// Logged and on the console: the person running `pdserve up` sees each scaling action.
void announce(const std::string& line) {
  PD_LOG(kInfo, kTag) << line;
  std::printf("pdserve up: %s\n", line.c_str());
  std::fflush(stdout);
}

}  // namespace

ActuationStep planPool(const PoolActuation& p) {
  ActuationStep s;
  if (p.desired < 0) {
    s.why = "no recommendation from the router yet";
    return s;
  }
  const int target = std::clamp(p.desired, p.minReplicas, std::max(p.minReplicas, p.maxReplicas));
  if (p.draining > 0) {
    s.why = "waiting for the drained worker to exit";
  } else if (p.registered >= 0 && p.registered < p.live) {
    s.why = "waiting for the started workers to register";
  } else if (p.live < target) {
    s.start = target - p.live;
    s.why = std::to_string(target) + " wanted, " + std::to_string(p.live) + " running";
  } else if (p.live > target) {
    s.drainOne = true;
    s.why = std::to_string(target) + " wanted, " + std::to_string(p.live) + " running";
  } else {
    s.why = "at the recommended size";
  }
  return s;
}

LocalActuator::LocalActuator(LocalCluster& cluster, bool enabled) : cluster_(cluster) {
  const auto& cfg = cluster.config();
  if (!enabled || !cfg.router.autoscaler.localActuator) return;
  for (Pool pool : {Pool::kPrefill, Pool::kDecode}) {
    auto [lo, hi] = bounds(cfg, pool);
    pools_[int(pool)] = hi > lo;
  }
}

std::string LocalActuator::describe() const {
  std::string out;
  for (Pool pool : {Pool::kPrefill, Pool::kDecode}) {
    if (!pools_[int(pool)]) continue;
    auto [lo, hi] = bounds(cluster_.config(), pool);
    out += std::string(out.empty() ? "" : ", ") + poolName(pool) + " " + std::to_string(lo) + ".." +
           std::to_string(hi);
  }
  return out.empty() ? "off" : out;
}

void LocalActuator::poll() {
  if (!active()) return;
  for (const auto& id : cluster_.killOverdueDrains()) {
    announce("worker " + id + " did not exit within its drain deadline (" +
             std::to_string(cluster_.drainDeadline().count()) + " ms): killed");
  }
  auto metrics = cluster_.routerMetrics(std::chrono::seconds(2));
  if (!metrics.ok()) {
    if (!routerUnreadable_) {
      PD_LOG(kWarn, kTag) << "autoscaling paused: " << metrics.status().message();
    }
    routerUnreadable_ = true;
    return;
  }
  routerUnreadable_ = false;
  for (Pool pool : {Pool::kPrefill, Pool::kDecode}) {
    if (pools_[int(pool)]) act(pool, *metrics);
  }
}

void LocalActuator::act(Pool pool, const std::string& metrics) {
  const char* name = poolName(pool);
  auto [lo, hi] = bounds(cluster_.config(), pool);
  const auto live = cluster_.liveWorkers(pool);
  PoolActuation p;
  p.minReplicas = lo;
  p.maxReplicas = hi;
  p.desired = int(poolGauge(metrics, "pdserve_desired_replicas", name));
  p.live = int(live.size());
  p.registered = int(poolGauge(metrics, "pdserve_pool_workers", name));
  p.draining = int(cluster_.drainingWorkers(pool).size());
  const ActuationStep step = planPool(p);
  const std::string sizes = std::string(name) + " pool " + std::to_string(p.live) + " -> ";
  for (int i = 0; i < step.start; ++i) {
    auto id = cluster_.startWorker(pool);
    if (!id.ok()) {
      PD_LOG(kWarn, kTag) << "scaling " << name
                          << ": cannot start a worker: " << id.status().message();
      return;
    }
    announce("scaling " + sizes + std::to_string(p.live + i + 1) + ": started " + *id +
             " (router recommends " + std::to_string(p.desired) + "; " + step.why + ")");
  }
  if (step.drainOne) {
    const std::string& id = live.back();
    if (Status s = cluster_.drainWorker(id); !s.isOk()) {
      PD_LOG(kWarn, kTag) << "scaling " << name << ": cannot drain " << id << ": " << s.message();
      return;
    }
    announce("scaling " + sizes + std::to_string(p.live - 1) + ": draining " + id +
             " (router recommends " + std::to_string(p.desired) + "; " + step.why +
             "; it finishes its streams within " +
             std::to_string(cluster_.config().engine.drainTimeoutMs) + " ms, then exits)");
  }
}

}  // namespace pd::tools
