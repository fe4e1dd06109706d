#include "tools/local_actuator.h"

#include <algorithm>
#include <cstdio>

#include "common/base/log.h"

namespace pd::tools {
namespace {

constexpr const char* kTag = "up";

Pool other(Pool pool) { return pool == Pool::kPrefill ? Pool::kDecode : Pool::kPrefill; }

std::pair<int, int> ownBounds(const config::ClusterConfig& cfg, Pool pool) {
  return pool == Pool::kPrefill ? std::pair{cfg.pools.prefill.minReplicas, cfg.pools.prefill.maxReplicas}
                                : std::pair{cfg.pools.decode.minReplicas, cfg.pools.decode.maxReplicas};
}

// With role moves, a pool may take the slots of the budget the other pool does not hold at
// its minimum (router/autoscaler.h AutoscalerOptions::sharedBudget, which the router applies).
std::pair<int, int> bounds(const config::ClusterConfig& cfg, Pool pool) {
  auto [lo, hi] = ownBounds(cfg, pool);
  if (!cfg.router.autoscaler.roleMoves) return {lo, hi};
  auto [otherLo, otherHi] = ownBounds(cfg, other(pool));
  return {lo, hi + otherHi - otherLo};
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

ClusterStep planCluster(const PoolActuation& prefill, const PoolActuation& decode, bool roleMoves) {
  ClusterStep c{planPool(prefill), planPool(decode)};
  if (!roleMoves) return c;
  for (Pool from : {Pool::kPrefill, Pool::kDecode}) {
    ActuationStep& give = from == Pool::kPrefill ? c.prefill : c.decode;
    ActuationStep& take = from == Pool::kPrefill ? c.decode : c.prefill;
    const PoolActuation& to = from == Pool::kPrefill ? decode : prefill;
    if (!give.drainOne) continue;
    const std::string toName = poolName(other(from));
    give.drainOne = false;
    if (take.start > 0) {
      --take.start;
      c.move = true;
      c.moveFrom = from;
      give.why = "moving a worker to the " + toName + " pool, which wants one (" + give.why + ")";
    } else if (to.desired > to.live) {
      give.why = "keeping the worker to move it: the " + toName + " pool wants one once it is ready (" + take.why + ")";
    } else {
      give.drainOne = true;
    }
  }
  return c;
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
    out += std::string(out.empty() ? "" : ", ") + poolName(pool) + " " + std::to_string(lo) + ".." + std::to_string(hi);
  }
  if (out.empty()) return "off";
  return cluster_.config().router.autoscaler.roleMoves ? out + " (one budget of workers; role moves)" : out;
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
  const PoolActuation prefill = read(Pool::kPrefill, *metrics), decode = read(Pool::kDecode, *metrics);
  const ClusterStep step = planCluster(prefill, decode, cluster_.config().router.autoscaler.roleMoves);
  if (step.move) move(step.moveFrom, step.moveFrom == Pool::kPrefill ? prefill : decode);
  if (pools_[int(Pool::kPrefill)]) act(Pool::kPrefill, prefill, step.prefill);
  if (pools_[int(Pool::kDecode)]) act(Pool::kDecode, decode, step.decode);
}

PoolActuation LocalActuator::read(Pool pool, const std::string& metrics) const {
  const char* name = poolName(pool);
  auto [lo, hi] = bounds(cluster_.config(), pool);
  PoolActuation p;
  p.minReplicas = lo;
  p.maxReplicas = hi;
  p.desired = int(poolGauge(metrics, "pdserve_desired_replicas", name));
  p.live = int(cluster_.liveWorkers(pool).size());
  p.registered = int(poolGauge(metrics, "pdserve_pool_workers", name));
  p.draining = int(cluster_.drainingWorkers(pool).size());
  return p;
}

void LocalActuator::move(Pool from, const PoolActuation& source) {
  const Pool to = other(from);
  const std::string id = cluster_.liveWorkers(from).back();
  if (Status s = cluster_.switchRole(id, to); !s.isOk()) {
    PD_LOG(kWarn, kTag) << "moving " << id << " to the " << poolName(to) << " pool: " << s.message();
    return;
  }
  announce("moving " + id + " from the " + poolName(from) + " pool (" + std::to_string(source.live) + " -> " +
           std::to_string(source.live - 1) + ", router recommends " + std::to_string(source.desired) + ") to the " +
           poolName(to) + " pool: it drains, then serves as " + poolName(to) + " in-process");
}

void LocalActuator::act(Pool pool, const PoolActuation& p, const ActuationStep& step) {
  const char* name = poolName(pool);
  const auto live = cluster_.liveWorkers(pool);
  const std::string sizes = std::string(name) + " pool " + std::to_string(p.live) + " -> ";
  for (int i = 0; i < step.start; ++i) {
    auto id = cluster_.startWorker(pool);
    if (!id.ok()) {
      PD_LOG(kWarn, kTag) << "scaling " << name << ": cannot start a worker: " << id.status().message();
      return;
    }
    announce("scaling " + sizes + std::to_string(p.live + i + 1) + ": started " + *id + " (router recommends " +
             std::to_string(p.desired) + "; " + step.why + ")");
  }
  if (step.drainOne) {
    const std::string& id = live.back();
    if (Status s = cluster_.drainWorker(id); !s.isOk()) {
      PD_LOG(kWarn, kTag) << "scaling " << name << ": cannot drain " << id << ": " << s.message();
      return;
    }
    announce("scaling " + sizes + std::to_string(p.live - 1) + ": draining " + id + " (router recommends " +
             std::to_string(p.desired) + "; " + step.why + "; it finishes its streams within " +
             std::to_string(cluster_.config().engine.drainTimeoutMs) + " ms, then exits)");
  }
}

}  // namespace pd::tools
