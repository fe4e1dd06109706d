// The local actuator of `pdserve up` (docs/serving.md "Autoscaling"): it makes a
// pool's worker processes follow the router's recommendation, pdserve_desired_replicas{pool},
// within the pool's [min_replicas, max_replicas], so pools really scale on one machine.
//
// How it reads the recommendation: it polls the router's /metrics (the same text KEDA reads;
// no endpoint of its own), so what it acts on is exactly what is exported, and a router that
// does not answer for a while only pauses it (docs/serving.md records the decision).
//
// One action per pool at a time (planPool): it starts what is missing, and drains one worker
// (SIGTERM: the worker stops taking work, finishes its streams within
// engine.drain_timeout_ms and exits 0) when there are too many, the newest first; it acts
// again only when the started workers have registered with the router and the drained one
// has exited. With router.autoscaler.role_moves the workers are pdserve-worker processes,
// the pools' maxima one budget, and a worker one pool gives up while the other wants one
// is moved (planCluster: SIGUSR1, the switch drains it first) rather than stopped and
// another started; the move is done when the router sees it registered in its new pool.
// A drained worker is killed only after its drain timeout (plus a grace), never before.
// Each action is a log line and a console line.
//
// Threads: one owner thread (pdserve up's supervision loop) calls poll().
#pragma once

#include <string>

#include "tools/local_cluster.h"

namespace pd::tools {

// What the actuator knows of one pool at a poll.
struct PoolActuation {
  int minReplicas = 1;
  int maxReplicas = 1;
  int desired = -1;    // the router's recommendation (-1: none read)
  int live = 0;        // workers running and not draining
  int registered = 0;  // the router's pdserve_pool_workers{pool} (-1: unknown)
  int draining = 0;    // workers drained that have not exited yet
};

struct ActuationStep {
  int start = 0;          // workers to start now
  bool drainOne = false;  // drain the newest live worker
  std::string why;        // "2 wanted, 1 running", "waiting for decode to register", ...
};

// Pure: what to do for one pool now.
ActuationStep planPool(const PoolActuation& p);

// Both pools' steps, and with role moves (router.autoscaler.role_moves) whether to move a
// worker instead: when one pool is to start a worker while the other is to drain one, the
// newest live worker of the draining pool switches role (SIGUSR1) and neither the drain nor
// that start happens. A drain waits while the other pool wants more workers but is still
// waiting on an earlier action, so that the next round moves the worker rather than stopping it.
struct ClusterStep {
  ActuationStep prefill, decode;
  bool move = false;
  Pool moveFrom = Pool::kPrefill;  // valid when move: the worker leaves this pool for the other
};
// Pure. With role moves the caller passes each pool's bounds in the shared budget (its
// maximum plus the other's maximum less the other's minimum), as the router applies them.
ClusterStep planCluster(const PoolActuation& prefill, const PoolActuation& decode, bool roleMoves);

class LocalActuator {
 public:
  // Scales the pools whose max_replicas exceeds min_replicas (with role moves: both pools,
  // when either does), when router.autoscaler.local_actuator is on and `enabled`
  // (pdserve up --no-autoscale turns it off).
  LocalActuator(LocalCluster& cluster, bool enabled);
  bool active() const { return pools_[0] || pools_[1]; }
  // "decode 1..2" or "off": for pdserve up's banner.
  std::string describe() const;
  // One round: kills drained workers past their deadline, reads the router's metrics, acts.
  // A router that cannot be read is logged (once per outage) and skipped.
  void poll();

 private:
  PoolActuation read(Pool pool, const std::string& metrics) const;
  void act(Pool pool, const PoolActuation& p, const ActuationStep& step);
  void move(Pool from, const PoolActuation& source);

  LocalCluster& cluster_;
  bool pools_[2] = {false, false};  // by Pool
  bool routerUnreadable_ = false;
};

}  // namespace pd::tools
