// plan::StepSpread: how a cluster's real steps ran against the cost model's time for the
// same steps (`pdserve plan --step-trace`), kept as distributions the simulator samples.
//
// The cost model prices a step as if its worker had the device to itself and went straight
// from one step to the next. A serving worker's step period also holds what shares its host
// (on the CPU test bed: the router, the I/O threads, the other workers' engines; on a GPU:
// the host work around launches) and the loop's work between steps. From workers' step
// traces (worker/step_trace.h), each step's period (gap + step) is divided by
// CostModel::stepSeconds of the step the row describes, and kept by kind:
//   - kPrefillPrompt: a prefill worker's steps (its prompt chunks);
//   - kDecodeOnly:    a decode worker's steps without prompt tokens;
//   - kDecodeMixed:   a decode worker's steps with prompt tokens (colocated prompts);
// and within a kind by size class: the step's decode rows (decode-only) or prompt tokens
// (the others) rounded up to a power of two. The simulator multiplies each step's modelled
// time by a ratio drawn from its size class, or from its whole kind where the class has
// fewer than kMinSamples rows: the offset and the step-to-step spread of the measured
// cluster, not only their mean. Size matters because the cost model's own error differs by
// size (one decode stream may be priced high and three low), and the longest steps make the
// p90s. A kind with fewer than kMinSamples rows keeps the modelled time (ratio 1): a prompt
// step is compute, a decode step memory, so one kind does not stand in for another.
//
// The ratios describe the host, layout and load the traces came from (docs/plan.md says
// when they carry over to another layout). Immutable after read(); sample() is const and
// takes the caller's generator, so any number of simulations may share one.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "common/base/enum_names.h"
#include "common/base/status.h"
#include "engine/backend.h"
#include "tools/plan/cost_model.h"

namespace pd::plan {

enum class StepKind { kPrefillPrompt = 0, kDecodeOnly = 1, kDecodeMixed = 2 };
inline constexpr EnumNames<StepKind, 3> kStepKindNames{
    {{StepKind::kPrefillPrompt, "prefill worker, prompt steps"},
     {StepKind::kDecodeOnly, "decode worker, decode-only steps"},
     {StepKind::kDecodeMixed, "decode worker, steps with prompt tokens"}}};
inline const char* toString(StepKind k) { return enumName(kStepKindNames, k); }

// Where a step's ratio is drawn from: its kind, and its size class (the smallest power of
// two >= its decode rows for kDecodeOnly, >= its prompt tokens otherwise).
struct StepClass {
  StepKind kind;
  int64_t size;
  static StepClass of(bool prefillWorker, std::span<const engine::SeqChunk> batch);
};

class StepSpread {
 public:
  static constexpr size_t kMinSamples = 20;

  // Reads every trace in `paths` and prices its rows with `cost`. Errors name the file and
  // line: a missing column, a value that is not a number, a row that computed nothing.
  static Result<StepSpread> read(const std::vector<std::string>& paths, const CostModel& cost);
  // From ratios already measured (tests).
  static StepSpread fromRatios(const std::vector<std::pair<StepClass, double>>& ratios);

  // A ratio for a step of class `c` (linear between the sorted samples it draws from).
  double sample(const StepClass& c, std::mt19937_64& rng) const;
  size_t rows() const { return rows_; }
  // One line per kind: rows, size classes of their own, and the ratio's p10 / p50 / p90.
  std::string describe() const;

 private:
  struct Kind {
    std::vector<double> all;                        // sorted; empty below kMinSamples
    std::map<int64_t, std::vector<double>> bySize;  // sorted; only classes with kMinSamples
  };
  std::array<Kind, 3> kinds_;
  size_t rows_ = 0;  // read, of every kind
};

}  // namespace pd::plan
