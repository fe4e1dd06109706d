// Workloads for `pdserve bench`: which requests to send, when, and with what prompt.
//
// A workload is a plan: per request its send time (or "as soon as a concurrency slot is
// free"), its prompt and output lengths in tokens and, for Mooncake traces, its prefix-block
// hash ids. Prompts are materialised only when a request is sent (promptTokenIds), so a plan
// of thousands of long prompts stays small. Everything is deterministic in the seed.
//
// Contract: plain functions over values, safe from any thread. Bad options give a Status
// that names the option ("--prompt-len: 'lognormal:x' ...").
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/base/enum_names.h"
#include "common/base/status.h"
#include "tools/bench/trace.h"

namespace pd::bench {

// A length distribution: "512" or "fixed:512"; "uniform:MIN:MAX" (inclusive);
// "lognormal:MEAN:SIGMA" where MEAN is the distribution's mean in tokens and SIGMA the
// standard deviation of its logarithm (0.5 is a moderate spread, 1.0 a heavy tail).
struct LengthSpec {
  enum class Kind { kFixed, kUniform, kLognormal } kind = Kind::kFixed;
  double a = 0, b = 0;
  std::string describe() const;
};
Result<LengthSpec> parseLengthSpec(std::string_view text, std::string_view option);

enum class ArrivalMode {
  kTrace,      // the trace's own timestamps, multiplied by timeScale
  kPoisson,    // exponential gaps at `rate` requests/s
  kImmediate,  // all at t = 0; with a concurrency cap this is a closed loop
};
// The names the reports carry (RunInfo::arrival).
inline constexpr EnumNames<ArrivalMode, 3> kArrivalModeNames{
    {{ArrivalMode::kTrace, "trace"}, {ArrivalMode::kPoisson, "poisson"}, {ArrivalMode::kImmediate, "immediate"}}};
inline const char* arrivalModeName(ArrivalMode m) { return enumName(kArrivalModeNames, m); }

// One phase of a phased synthetic workload (`--phase`, repeatable): Poisson arrivals at
// `rate` for `durationS`, lengths from its own distributions; phases run back to back.
struct PhaseSpec {
  LengthSpec promptLen{LengthSpec::Kind::kFixed, 256, 0};
  LengthSpec outputLen{LengthSpec::Kind::kFixed, 64, 0};
  double rate = 0;               // requests/s, > 0
  double durationS = 0;          // > 0
  std::string describe() const;  // "prompt uniform[16,128], output 32, 3/s for 30 s"
};
// Parses "prompt-len=uniform:16:128,output-len=32,rate=3,duration=30". Fields left out take
// `defaults`' values (the run's --prompt-len / --output-len / --rate); duration must be given
// and rate must end up > 0. Errors name the phase ("--phase 2") and the bad field.
Result<PhaseSpec> parsePhaseSpec(std::string_view text, int number, const PhaseSpec& defaults);

struct WorkloadOptions {
  std::string tracePath;  // empty: synthetic lengths from promptLen / outputLen
  LengthSpec promptLen{LengthSpec::Kind::kFixed, 256, 0};
  LengthSpec outputLen{LengthSpec::Kind::kFixed, 64, 0};
  double rate = 0;              // > 0: Poisson arrivals at this rate
  double timeScale = 1.0;       // trace replay: gaps are multiplied by this (0.5 = twice as fast)
  int64_t numRequests = 0;      // 0: all trace rows (trace) / required unless durationS (synthetic)
  double durationS = 0;         // > 0: plan only requests scheduled before this
  int64_t maxPromptTokens = 0;  // > 0: scale prompt lengths so the longest fits (see lengthScale)
  int64_t maxOutputTokens = 0;  // > 0: cap output lengths at this
  double lengthScale = 0;       // > 0: multiply prompt lengths by this (else derived from maxPromptTokens)
  int64_t warmup = 0;           // warm-up requests (run first, excluded from every figure)
  uint64_t seed = 0;
  bool closedLoop = false;  // a concurrency cap without a rate: ignore trace timestamps
  // Trace replay: rows that share one timestamp (the Mooncake conversation trace records
  // arrivals in 3-second ticks) are spread evenly over the gap to the next timestamp.
  bool spreadTicks = false;
  // Mooncake traces: replay conversations (multiturn.h). Each request whose prefix blocks
  // extend an earlier request's full blocks is that request's next turn.
  bool multiTurn = false;
  int64_t turnMinTokens = 16;  // the shortest new message of a next turn
  // Mooncake traces: keep one conversation in K (rows whose second prefix block, the first
  // past the shared system block, is a multiple of K; a one-block row by its row number), so
  // a replay thins the load without cutting conversations apart. 1: every row.
  int64_t sampleConversations = 1;
  // Not empty: a phased synthetic workload; promptLen / outputLen / rate / durationS and a
  // trace are then not used (buildWorkload refuses a trace, --duration and --num-requests).
  std::vector<PhaseSpec> phases;
};

struct PlannedRequest {
  int64_t index = 0;
  double scheduledS = 0;  // seconds after the measured phase starts
  int64_t promptTokens = 1;
  int64_t outputTokens = 1;
  std::vector<int64_t> hashIds;  // shared prefix blocks, blockTokens each (may be empty)
  int64_t blockTokens = 0;
  bool warmup = false;
  int phase = -1;  // index into Workload::phases; -1 when the workload has none
  // Multi-turn replay (multiturn.h): the previous turn of the conversation (its position in
  // Workload::requests, -1: none) and the new message's length. The prompt is then the
  // previous turn's prompt and generated ids, then newTokens fresh ids; it is sent once the
  // previous turn finished, never before its own scheduledS.
  int64_t parent = -1;
  int64_t newTokens = 0;
};

// Where a phase of a phased workload sits in the schedule: [startS, endS).
struct PhaseWindow {
  double startS = 0, endS = 0;
  PhaseSpec spec;
};

struct Workload {
  std::vector<PlannedRequest> warmups;
  std::vector<PlannedRequest> requests;
  ArrivalMode arrival = ArrivalMode::kImmediate;
  double lengthScale = 1.0;         // the factor applied to trace prompt lengths
  std::string traceFormat;          // "" for synthetic
  std::string describe;             // one line for the report
  std::vector<PhaseWindow> phases;  // phased workloads only, in order, contiguous from 0
  int64_t chainedTurns = 0;         // multi-turn: requests with a previous turn
};

// Limits for closed-loop runs bounded only by --duration (the plan must be finite).
constexpr int64_t kMaxDurationOnlyRequests = 200000;

Result<Workload> buildWorkload(const WorkloadOptions& opts);

// Token ids for a prompt. Ids are drawn from [minId, maxId) (choose a range free of the
// model's special tokens). Requests sharing hash ids share exactly those leading blocks: block
// h is always the same blockTokens ids for the same seed; tokens past the hashed blocks, and
// whole prompts without hash ids, are unique to the request.
struct TokenIdRange {
  int64_t minId = 0;
  int64_t maxId = 0;  // exclusive
};
std::vector<int32_t> promptTokenIds(const PlannedRequest& r, const TokenIdRange& range, uint64_t seed);

// Text prompts for chat. The seam for the model's tokenizer: an implementation turns the
// request's token ids into text that the server's tokenizer maps back to (about) as many
// tokens. ByteTextPrompter is the approximation used until common/tokenizer lands: one
// ASCII letter or space per token, which a byte-level tokenizer without merges (the default
// model's) reads as exactly one token per byte. The chat template adds a few tokens on top;
// the report uses usage.prompt_tokens, so the figures stay exact either way.
class TextPrompter {
 public:
  virtual ~TextPrompter() = default;
  virtual std::string textFor(const std::vector<int32_t>& ids) const = 0;
  virtual std::string name() const = 0;
};
class ByteTextPrompter final : public TextPrompter {
 public:
  std::string textFor(const std::vector<int32_t>& ids) const override;
  std::string name() const override { return "byte-approx"; }
};

enum class Endpoint { kCompletions, kChat };
const char* endpointPath(Endpoint e);  // "/v1/completions" | "/v1/chat/completions"

struct BodyOptions {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string model;
  TokenIdRange ids;
  uint64_t seed = 0;
  bool ignoreEos = true;                   // exact output lengths (vLLM / pdserve extension)
  bool continuousUsage = false;            // vLLM's stream_options.continuous_usage_stats
  double temperature = -1;                 // < 0: not sent (server default)
  std::string extraJson;                   // a JSON object merged into every body (may be empty)
  const TextPrompter* prompter = nullptr;  // chat only; ByteTextPrompter when null
  bool returnTokenIds = false;             // ask for the generated ids (vLLM's return_token_ids)
};
// The streaming request body for one planned request.
std::string buildRequestBody(const PlannedRequest& r, const BodyOptions& o);
// The same with the prompt's ids given (a multi-turn request's history and new message).
std::string buildRequestBodyIds(const PlannedRequest& r, const std::vector<int32_t>& ids, const BodyOptions& o);

}  // namespace pd::bench
