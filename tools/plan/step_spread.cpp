#include "tools/plan/step_spread.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>

#include "tools/bench/stats.h"
#include "tools/bench/trace.h"

namespace pd::plan {

namespace {

// `rows` sequences that share `tokens` tokens at `context` tokens of context, as evenly as
// integers allow: a step's cost is linear in each chunk's start, so the sums are exact.
void addChunks(int64_t rows, int64_t tokens, int64_t context, std::vector<engine::SeqChunk>* out) {
  for (int64_t i = 0; i < rows; ++i) {
    engine::SeqChunk c;
    c.numTokens = int(tokens / rows + (i < tokens % rows ? 1 : 0));
    c.startPos = int(context / rows + (i < context % rows ? 1 : 0));
    c.wantLogits = true;
    out->push_back(c);
  }
}

}  // namespace

StepClass StepClass::of(bool prefillWorker, std::span<const engine::SeqChunk> batch) {
  int64_t decodeRows = 0, promptTokens = 0;
  for (const auto& c : batch) {
    if (c.numTokens == 1)
      ++decodeRows;
    else
      promptTokens += c.numTokens;
  }
  // A prefill worker's rows are all prompt rows (a one-token prompt too).
  if (prefillWorker) promptTokens += decodeRows, decodeRows = 0;
  const StepKind kind = prefillWorker      ? StepKind::kPrefillPrompt
                        : promptTokens > 0 ? StepKind::kDecodeMixed
                                           : StepKind::kDecodeOnly;
  const int64_t n = kind == StepKind::kDecodeOnly ? decodeRows : promptTokens;
  int64_t size = 1;
  while (size < n) size *= 2;
  return {kind, size};
}

StepSpread StepSpread::fromRatios(const std::vector<std::pair<StepClass, double>>& ratios) {
  StepSpread s;
  s.rows_ = ratios.size();
  std::array<std::map<int64_t, std::vector<double>>, 3> bySize;
  for (const auto& [c, ratio] : ratios) bySize[size_t(c.kind)][c.size].push_back(ratio);
  for (size_t k = 0; k < bySize.size(); ++k) {
    Kind& kind = s.kinds_[k];
    for (auto& [size, v] : bySize[k]) {
      std::sort(v.begin(), v.end());
      kind.all.insert(kind.all.end(), v.begin(), v.end());
      if (v.size() >= kMinSamples) kind.bySize[size] = std::move(v);
    }
    std::sort(kind.all.begin(), kind.all.end());
    if (kind.all.size() < kMinSamples) kind = Kind{};
  }
  return s;
}

Result<StepSpread> StepSpread::read(const std::vector<std::string>& paths, const CostModel& cost) {
  static const char* const kColumns[] = {
      "role",          "seconds",       "gap_seconds",          "decode_rows", "decode_context_tokens",
      "prompt_chunks", "prompt_tokens", "prompt_context_tokens"};
  std::vector<std::pair<StepClass, double>> ratios;
  for (const std::string& path : paths) {
    std::ifstream in(path);
    if (!in) return invalidArgument("--step-trace: cannot read " + path);
    std::string line;
    if (!std::getline(in, line)) return invalidArgument("--step-trace " + path + ": empty (no header)");
    const auto header = bench::splitCsv(line);
    std::map<std::string, size_t> column;
    for (const char* name : kColumns) {
      auto it = std::find(header.begin(), header.end(), name);
      if (it == header.end())
        return invalidArgument("--step-trace " + path + ": no \"" + name + "\" column (a worker's <id>.steps.csv?)");
      column[name] = size_t(it - header.begin());
    }
    for (int lineNo = 2; std::getline(in, line); ++lineNo) {
      if (line.empty()) continue;
      const auto cells = bench::splitCsv(line);
      const std::string where = "--step-trace " + path + ":" + std::to_string(lineNo);
      auto number = [&](const char* name, double* out) -> Status {
        const size_t i = column.at(name);
        char* end = nullptr;
        if (i < cells.size()) *out = std::strtod(cells[i].c_str(), &end);
        if (i >= cells.size() || cells[i].empty() || *end != '\0' || !std::isfinite(*out) || *out < 0)
          return invalidArgument(where + ": \"" + name + "\" is not a non-negative number");
        return Status::ok();
      };
      double seconds = 0, gap = 0, decodeRows = 0, decodeContext = 0, promptChunks = 0, promptTokens = 0,
             promptContext = 0;
      PD_RETURN_IF_ERROR(number("seconds", &seconds));
      PD_RETURN_IF_ERROR(number("gap_seconds", &gap));
      PD_RETURN_IF_ERROR(number("decode_rows", &decodeRows));
      PD_RETURN_IF_ERROR(number("decode_context_tokens", &decodeContext));
      PD_RETURN_IF_ERROR(number("prompt_chunks", &promptChunks));
      PD_RETURN_IF_ERROR(number("prompt_tokens", &promptTokens));
      PD_RETURN_IF_ERROR(number("prompt_context_tokens", &promptContext));
      const std::string role = column.at("role") < cells.size() ? cells[column.at("role")] : "";
      if (role != "prefill" && role != "decode") return invalidArgument(where + ": role must be prefill or decode");
      if (seconds <= 0 || (decodeRows == 0 && promptChunks == 0) || (promptChunks > 0) != (promptTokens > 0) ||
          promptTokens < promptChunks)
        return invalidArgument(where + ": a step that computed nothing (seconds, rows and chunks must agree)");
      std::vector<engine::SeqChunk> batch;
      addChunks(int64_t(decodeRows), int64_t(decodeRows), int64_t(decodeContext), &batch);
      addChunks(int64_t(promptChunks), int64_t(promptTokens), int64_t(promptContext), &batch);
      const double modelled = cost.stepSeconds(batch);
      if (!(modelled > 0)) return invalidArgument(where + ": the cost model gives this step no time");
      ratios.emplace_back(StepClass::of(role == "prefill", batch), (seconds + gap) / modelled);
    }
  }
  return fromRatios(ratios);
}

double StepSpread::sample(const StepClass& c, std::mt19937_64& rng) const {
  const Kind& kind = kinds_[size_t(c.kind)];
  auto own = kind.bySize.find(c.size);
  const std::vector<double>& from = own != kind.bySize.end() ? own->second : kind.all;
  if (from.empty()) return 1;
  return bench::percentileSorted(from, 100 * std::uniform_real_distribution<double>(0, 1)(rng));
}

std::string StepSpread::describe() const {
  std::string out;
  char line[240];
  for (StepKind k : {StepKind::kPrefillPrompt, StepKind::kDecodeOnly, StepKind::kDecodeMixed}) {
    const Kind& kind = kinds_[size_t(k)];
    if (kind.all.empty()) {
      std::snprintf(line, sizeof line, "  %-40s fewer than %zu rows: the modelled time\n", toString(k), kMinSamples);
    } else {
      std::snprintf(line, sizeof line,
                    "  %-40s %6zu rows (%zu size classes of their own), measured / modelled p10 %.2f  p50 %.2f  "
                    "p90 %.2f\n",
                    toString(k), kind.all.size(), kind.bySize.size(), bench::percentileSorted(kind.all, 10),
                    bench::percentileSorted(kind.all, 50), bench::percentileSorted(kind.all, 90));
    }
    out += line;
  }
  return out;
}

}  // namespace pd::plan
