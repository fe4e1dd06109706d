// LaneRates: what each kvtransfer lane costs, measured from this agent's own completed
// transfers, for the router's peer-pull cost model (LoadReport.lanes, docs/kv_cache.md "Peer
// pulls"). A transfer's time is post -> its completion seen by the owner's poll, so it holds
// the owner's wait before it polled (a prefill worker polls after the step that posted it):
// every sample's bytes/seconds is at most the lane's true rate. Per transport, over the last
// kWindow completed transfers: bytesPerS is the best sample's rate (the tightest of those lower
// bounds), setupMs the quickest sample's whole time (what even the smallest transfer costs: a
// round trip and the transport's bookkeeping; it holds that sample's bytes too, so the sum
// errs towards recomputing).
//
// Threads: not thread-safe; the agent's owner (the worker loop) records and reads.
#pragma once

#include <cstddef>
#include <deque>
#include <map>
#include <string>
#include <vector>

namespace pd::kvt {

class LaneRates {
 public:
  static constexpr size_t kWindow = 64;

  struct Figure {
    std::string transport;
    double bytesPerS = 0;
    double setupMs = 0;
    size_t samples = 0;
  };

  // One completed transfer of `bytes` that took `seconds`. Non-positive values are ignored.
  void record(const std::string& transport, size_t bytes, double seconds);
  // One figure per transport that has samples, by name.
  std::vector<Figure> figures() const;

 private:
  std::map<std::string, std::deque<std::pair<size_t, double>>> samples_;
};

}  // namespace pd::kvt
