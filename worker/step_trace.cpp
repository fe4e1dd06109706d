#include "worker/step_trace.h"

#include <cerrno>
#include <chrono>
#include <cstring>

#include "common/base/log.h"

namespace pd::worker {

Result<std::unique_ptr<StepTrace>> StepTrace::open(const std::string& dir, const std::string& workerId,
                                                   std::string role) {
  std::string path = dir + "/" + workerId + ".steps.csv";
  std::FILE* file = std::fopen(path.c_str(), "w");
  if (file == nullptr) {
    return invalidArgument("logging.step_trace_dir: cannot write " + path + ": " + std::strerror(errno));
  }
  std::fputs(
      "time_s,role,seconds,gap_seconds,decode_rows,decode_context_tokens,prompt_chunks,prompt_tokens,"
      "prompt_context_tokens\n",
      file);
  return std::unique_ptr<StepTrace>(new StepTrace(std::move(path), file, std::move(role)));
}

StepTrace::StepTrace(std::string path, std::FILE* file, std::string role)
    : path_(std::move(path)), file_(file), role_(std::move(role)) {}

StepTrace::~StepTrace() {
  if (file_ != nullptr) std::fclose(file_);
}

void StepTrace::record(const engine::StepRecord& step) {
  if (file_ == nullptr || step.seconds <= 0) return;  // nothing ran, or the step failed
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  const int n =
      std::fprintf(file_, "%.6f,%s,%.6f,%.6f,%d,%lld,%d,%lld,%lld\n", now, role_.c_str(), step.seconds, step.gapSeconds,
                   step.decodeRows, static_cast<long long>(step.decodeContextTokens), step.promptChunks,
                   static_cast<long long>(step.promptTokens), static_cast<long long>(step.promptContextTokens));
  if (n < 0 || std::fflush(file_) != 0) {
    PD_LOG(kError, "worker") << "step trace " << path_ << ": write failed (" << std::strerror(errno)
                             << "); no more steps are traced";
    std::fclose(file_);
    file_ = nullptr;
  }
}

}  // namespace pd::worker
