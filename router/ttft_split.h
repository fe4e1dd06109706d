// The per-request TTFT split (docs/metrics.md, "TTFT split"): the router's time to first
// token cut into the phases the request went through, assembled from durations that each
// process measured on its own clock (never a difference of two hosts' timestamps).
//
//   phase             measured by     interval
//   router_queue      router          request arrival -> Generate sent (admission, routing)
//   decode_admission  decode worker   Generate receipt -> admitted (colocated: engine queue;
//                                     disaggregated: KV blocks reserved for the prompt)
//   kv_pull           decode worker   blocks reserved -> PullDone, or to the pull's failure
//                                     (a peer pull only; docs/kv_cache.md "Peer pulls")
//   kv_connect        decode worker   blocks reserved -> PrefillRequest sent (disaggregated;
//                                     the connection + KvConnect exchange when it is new)
//   prefill_queue     prefill worker  PrefillRequest receipt -> first scheduled (disagg.)
//   prefill_compute   the worker that prefilled: scheduled -> first token sampled
//   kv_transfer       prefill worker  compute done -> every KV write confirmed (the exposed
//                                     part; layers pushed while later ones computed are not in it)
//   decode_first_token decode worker  PrefillDone receipt -> first token sent (disaggregated:
//                                     the prefill worker samples the first token, so no decode
//                                     step is on the TTFT path; this is the hand-off)
//   other             router          ttft - the sum of the above: network hops between the
//                                     processes, and the router's own handling of the chunk
//
// The phases are disjoint intervals inside the router's [arrival, first token], so their sum
// is at most the TTFT; `other` is clamped at 0 should clock rates differ by a hair.
//
// Threads: plain functions and values.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/proto/pdserve.pb.h"

namespace pd::router {

// The route of a request routed disaggregated whose remote prefill failed and which the decode
// worker recomputed (proto Timings.recomputed): x-pdserve-route and the metrics' route label.
inline constexpr const char* kRecomputedRoute = "disaggregated-recomputed";

struct TtftSplit {
  std::string route;  // "colocated" | "disaggregated" | "disaggregated-recomputed"
  double ttftS = 0;
  // (phase, seconds) in the order of the table above; only the phases of the route.
  std::vector<std::pair<std::string, double>> phases;
};

// `ttftS` and `routerQueueS` are the router's own; `worker` is the first token's chunk's
// Timings (ttft_split set). Negative inputs (never expected) count as 0.
TtftSplit assembleTtftSplit(double ttftS, double routerQueueS, const proto::Timings& worker);

// {"route": ..., "ttft_ms": ..., "<phase>_ms": ...}: the usage object's "pdserve_timing".
nlohmann::json ttftSplitJson(const TtftSplit& split);
// A Server-Timing header value: "router_queue;dur=0.412, decode_admission;dur=0.05, ...,
// ttft;dur=12.3" (milliseconds, as the header's dur is).
std::string serverTimingHeader(const TtftSplit& split);

}  // namespace pd::router
