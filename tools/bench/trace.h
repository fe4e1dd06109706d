// Request traces for `pdserve bench`: the Azure LLM inference 2023 CSVs (and BurstGPT's CSV
// layout) and the Mooncake FAST'25 JSONL, read into one shape.
//
// Contract: plain functions, no shared state; safe from any thread. Errors are Status values
// whose message names the file and 1-based line ("trace.csv:17: ContextTokens: 'x' is not an
// integer"), so a person can open the file at the offending line.
#pragma once

#include <cstdint>
#include <istream>
#include <string>
#include <vector>

#include "common/base/enum_names.h"
#include "common/base/status.h"

namespace pd::bench {

enum class TraceFormat { kAzureCsv, kBurstGptCsv, kMooncakeJsonl };
inline constexpr EnumNames<TraceFormat, 3> kTraceFormatNames{{{TraceFormat::kAzureCsv, "azure-csv"},
                                                              {TraceFormat::kBurstGptCsv, "burstgpt-csv"},
                                                              {TraceFormat::kMooncakeJsonl, "mooncake-jsonl"}}};
inline const char* traceFormatName(TraceFormat f) { return enumName(kTraceFormatNames, f); }

struct TraceRow {
  double arrivalS = 0;  // seconds since the trace's first row (never negative)
  int64_t promptTokens = 0;
  int64_t outputTokens = 0;
  std::vector<int64_t> hashIds;  // Mooncake only: one id per prefix block of blockTokens
};

struct Trace {
  std::string path;
  TraceFormat format = TraceFormat::kAzureCsv;
  int blockTokens = 0;         // 512 for Mooncake; 0 when the trace has no block hashes
  std::vector<TraceRow> rows;  // in file order (all shipped traces are sorted by time)
};

// Reads a trace file, choosing the parser from its first non-empty line: '{' means JSONL,
// anything else a CSV with a header. Rows whose timestamps go backwards are an error.
Result<Trace> loadTrace(const std::string& path);

// One line of a comma-separated file, each field trimmed of spaces (and a CRLF's CR); no
// quoting. Also reads worker step traces (tools/plan/step_spread.cpp).
std::vector<std::string> splitCsv(const std::string& line);

// The parsers behind loadTrace; `name` is used in messages only.
// CSV: columns are matched by header name. Required: a timestamp column (TIMESTAMP or
// Timestamp), a prompt-length column (ContextTokens or "Request tokens") and an output-length
// column (GeneratedTokens or "Response tokens"). BurstGPT's other columns are accepted and
// ignored; any other column is an error naming it. Timestamps are either
// "YYYY-MM-DD hh:mm:ss[.fffffff]" or a number of seconds.
Result<Trace> parseTraceCsv(std::istream& in, const std::string& name);
// JSONL: one object per line with timestamp (ms), input_length, output_length and an optional
// hash_ids array; unknown keys are an error. len(hash_ids) must equal ceil(input_length/512).
Result<Trace> parseMooncakeJsonl(std::istream& in, const std::string& name);

// "2023-11-16 18:17:03.9799600" -> seconds since 1970-01-01 (UTC assumed; only differences
// are used). Returns false when the text is not such a datetime.
bool parseDateTimeSeconds(const std::string& text, double* out);

}  // namespace pd::bench
