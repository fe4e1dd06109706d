// Peer-pull cost model (docs/kv_cache.md, "Peer pulls"): whether the worker a request is
// routed to should pull a prefix another worker holds instead of recomputing it, and from whom.
// Pure: no I/O, no clock, no state; every figure comes from the workers' load reports (the
// target's measured prefill rate, the lanes' measured bandwidth and fixed cost, the KV bytes
// of one token). There is no token threshold: a pull is chosen exactly when its predicted
// time is below the predicted time to compute the same tokens on the target.
//
//   pull_ms      = lane.setupMs + movedTokens * kvBytesPerToken / lane.bytesPerS * 1e3
//                  + diskTokens * kvBytesPerToken / kDiskReadBytesPerS * 1e3
//   recompute_ms = pullTokens / targetPrefillTokensPerS * 1e3
//
// The source serves the prefix from whichever tier holds it (decode_worker/pull_sources.h
// promotes its host and disk tiers' blocks into its region first). A host-tier block costs
// what a region block does (a memcpy, far above any lane); a block only its disk tier holds
// adds a read at kDiskReadBytesPerS, a conservative figure (workers do not report a disk
// rate): a SATA SSD or a network volume, where an NVMe drive reads several GB/s.
//
// Only the tokens the pull would save are computed either way: the rest of the prompt is
// computed on the target in both cases. A pull moves the prefix from its start (movedTokens),
// which is more than it saves when the target already holds the prefix's first blocks. A figure not known yet (0) means
// no prediction, hence no pull.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace pd::router {

// One kvtransfer lane's measured cost (LoadReport.lanes): a transfer of b bytes takes about
// setupMs + b / bytesPerS.
struct LaneCost {
  std::string transport;  // "cma", "tcp", "ucx", "verbs"
  double bytesPerS = 0;   // 0: not measured
  double setupMs = 0;     // the fixed part of one pull: link set-up and a transfer's round trip
};

// The disk read rate a pull's cost assumes for blocks only a source's disk tier holds.
inline constexpr double kDiskReadBytesPerS = 200e6;

struct PullInputs {
  int64_t pullTokens = 0;       // prompt tokens the source holds beyond the target's own hit
  int64_t movedTokens = 0;      // tokens whose KV moves (the prefix from its start); 0: pullTokens
  int64_t kvBytesPerToken = 0;  // the model's KV bytes per token (every layer, every rank)
  double targetPrefillTokensPerS = 0;
  LaneCost lane;
  int64_t diskTokens = 0;  // of movedTokens, those only the source's disk tier holds
};

struct PullDecision {
  bool pull = false;
  double pullMs = 0;       // predicted (0 when not predictable)
  double recomputeMs = 0;  // predicted (0 when not predictable)
  std::string why;         // for logs and tests: the comparison or the missing figure
};

PullDecision decidePull(const PullInputs& in);

// A worker as the source picker sees it.
struct PullCandidate {
  std::string id;
  bool healthy = false;
  bool servesPulls = false;   // it advertised a peer address (LoadReport/Hello)
  std::string host;           // the host part of its address (same host: cma)
  int64_t cachedTokens = -1;  // of this prompt, in any tier, from the exact index (-1: index not current)
  std::vector<LaneCost> lanes;
  int64_t diskTokens = 0;  // of cachedTokens, those only its disk tier holds
};

struct PullChoice {
  std::string source;
  int64_t pullTokens = 0;    // beyond the target's hit: what the pull saves computing
  int64_t prefixTokens = 0;  // the prefix pulled, from the prompt's start (what moves)
  LaneCost lane;
  PullDecision decision;
};

// The lane a pull from `source` to a target on `targetHost` would use: cma when both share a
// host and the source measured cma, else the fastest other lane the source measured, else
// nullopt (no figure: no prediction).
std::optional<LaneCost> pullLane(const PullCandidate& source, const std::string& targetHost);

// Among healthy, pull-serving candidates other than the target whose index is current and
// that hold more of the prompt than the target's `targetCached` tokens, the one whose pull is
// predicted to save the most time (recompute_ms - pull_ms), and its decision. nullopt: no
// candidate holds more than the target, or no pull is predicted cheaper (then `rejected`,
// when given, says why for the candidate holding the most).
std::optional<PullChoice> choosePull(const std::string& target, const std::string& targetHost, int64_t targetCached,
                                     double targetPrefillTokensPerS, int64_t kvBytesPerToken,
                                     const std::vector<PullCandidate>& candidates, std::string* rejected = nullptr);

}  // namespace pd::router
