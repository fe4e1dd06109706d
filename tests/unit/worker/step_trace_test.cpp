// worker::StepTrace: the CSV a worker writes with logging.step_trace_dir.
#include "worker/step_trace.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

namespace {

std::vector<std::string> linesOf(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

}  // namespace

TEST_CASE("step trace: a row per step that ran, flushed as it is written") {
  const auto dir = std::filesystem::temp_directory_path() / ("pd_step_trace_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto trace = pd::worker::StepTrace::open(dir.string(), "decode-0", "decode");
  REQUIRE(trace.ok());
  CHECK((*trace)->path() == (dir / "decode-0.steps.csv").string());
  pd::engine::StepRecord step;
  step.decodeRows = 3;
  step.decodeContextTokens = 900;
  step.promptChunks = 1;
  step.promptTokens = 64;
  step.promptContextTokens = 128;
  step.seconds = 0.0125;
  step.gapSeconds = 0.0002;
  (*trace)->record(step);
  (*trace)->record(pd::engine::StepRecord{});    // nothing ran: no row
  const auto lines = linesOf((*trace)->path());  // read while the trace is open
  REQUIRE(lines.size() == 2);
  CHECK(lines[0] ==
        "time_s,role,seconds,gap_seconds,decode_rows,decode_context_tokens,prompt_chunks,prompt_tokens,"
        "prompt_context_tokens");
  const std::string row = lines[1];
  CHECK(row.substr(row.find(',')) == ",decode,0.012500,0.000200,3,900,1,64,128");
  CHECK(std::stod(row.substr(0, row.find(','))) > 1.7e9);  // Unix seconds
  std::filesystem::remove_all(dir);
}

TEST_CASE("step trace: a directory that cannot be written is named") {
  auto trace = pd::worker::StepTrace::open("/nonexistent/pd_steps", "prefill-0", "prefill");
  REQUIRE_FALSE(trace.ok());
  CHECK(trace.status().message().find("/nonexistent/pd_steps/prefill-0.steps.csv") != std::string::npos);
  CHECK(trace.status().message().find("No such file") != std::string::npos);
}
