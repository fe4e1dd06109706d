// StepTrace: one CSV row per engine step a worker runs (logging.step_trace_dir). What the
// step computed and how long it took, as the worker saw it: `pdserve plan --step-trace`
// compares each row with the cost model's time for the same step (tools/plan/step_spread.h),
// and a person can line two workers' traces up by their clocks.
//
// File: <dir>/<worker id>.steps.csv, truncated at open; the header names the columns:
//   time_s                 wall-clock (Unix) time at the step's end
//   role                   prefill | decode
//   seconds, gap_seconds   engine::StepRecord: the step, and the loop's time before it
//   decode_rows, decode_context_tokens, prompt_chunks, prompt_tokens, prompt_context_tokens
// Each row is flushed as it is written (a worker that is killed loses none).
//
// Threads: one owner, the worker loop. Errors: open() names the path and the reason; a row
// that cannot be written is logged once and the trace stops (serving goes on).
#pragma once

#include <cstdio>
#include <memory>
#include <string>

#include "common/base/status.h"
#include "engine/engine.h"

namespace pd::worker {

class StepTrace {
 public:
  static Result<std::unique_ptr<StepTrace>> open(const std::string& dir, const std::string& workerId, std::string role);
  ~StepTrace();
  StepTrace(const StepTrace&) = delete;
  StepTrace& operator=(const StepTrace&) = delete;

  // A row for a step that ran (StepRecord::seconds > 0); nothing for the others.
  void record(const engine::StepRecord& step);
  const std::string& path() const { return path_; }

 private:
  StepTrace(std::string path, std::FILE* file, std::string role);
  std::string path_;
  std::FILE* file_;  // null once a write failed
  std::string role_;
};

}  // namespace pd::worker
