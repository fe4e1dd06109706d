// The mixed-load benchmark (`pdserve bench mixed`): S short streams decode while L
// long prompts arrive at a fixed spacing. It answers one question: does prefill work for the
// long prompts disturb the streams that are already decoding? So it runs the short streams
// twice against the same server in the same run: alone (the solo baseline) and with the long
// prompts arriving, and compares their inter-token gaps.
//
// Contract: plain functions over values (planning and summarising); the network side is
// runLoad(). Safe from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "tools/bench/stats.h"
#include "tools/bench/workload.h"

namespace pd::bench {

struct MixedOptions {
  int shortStreams = 2;
  int64_t shortPromptTokens = 100;
  int64_t shortOutputTokens = 400;
  int longPrompts = 4;
  int64_t longPromptTokens = 2000;
  int64_t longOutputTokens = 16;
  double longStartS = 1.0;    // the first long prompt, after the short streams started
  double longSpacingS = 1.0;  // between long prompts
};
Status validate(const MixedOptions& o);

// Short streams are indices [0, shortStreams); in the mixed plan the long prompts follow.
Workload soloWorkload(const MixedOptions& o);
Workload mixedWorkload(const MixedOptions& o);

struct GapStats {
  size_t count = 0;
  double p50Ms = kNaN, p99Ms = kNaN, maxMs = kNaN;
};
// The inter-token gaps of the given records, pooled.
GapStats gapStats(const std::vector<RequestRecord>& records);

struct MixedResult {
  GapStats solo;                    // short streams alone
  GapStats mixed;                   // short streams while the long prompts arrive
  Summary longTtftMs;               // long prompts' TTFT
  std::vector<std::string> errors;  // "short #1: HTTP 503: ..." for every failed request
  double maxOverSoloP99() const { return mixed.maxMs / solo.p99Ms; }
  double p99OverSoloP99() const { return mixed.p99Ms / solo.p99Ms; }
};
MixedResult summarizeMixed(const std::vector<RequestRecord>& solo, const std::vector<RequestRecord>& mixed,
                           const MixedOptions& o);

// The table printed for one configuration.
std::string formatMixed(const std::string& label, const MixedResult& r);

// The acceptance bound: no error, mixed max gap <= maxRatio x solo p99 and mixed p99
// <= p99Ratio x solo p99. An empty string when it holds, else what failed.
std::string checkMixed(const MixedResult& r, double maxRatio, double p99Ratio);

}  // namespace pd::bench
