#include "common/base/log.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <mutex>
#include <optional>

namespace pd {
namespace {

LogLevel initialLevel() {
  LogLevel level = LogLevel::kInfo;
  if (const char* env = std::getenv("PDSERVE_LOG_LEVEL")) parseLogLevel(env, &level);
  return level;
}

std::atomic<LogLevel>& levelRef() {
  static std::atomic<LogLevel> level{initialLevel()};
  return level;
}

std::mutex& outputMutex() {
  static std::mutex m;
  return m;
}

// A log line's one-letter level.
constexpr EnumNames<LogLevel, 5> kLevelTags{{{LogLevel::kDebug, "D"},
                                             {LogLevel::kInfo, "I"},
                                             {LogLevel::kWarn, "W"},
                                             {LogLevel::kError, "E"},
                                             {LogLevel::kOff, "-"}}};

}  // namespace

void setLogLevel(LogLevel level) { levelRef().store(level); }
LogLevel logLevel() { return levelRef().load(std::memory_order_relaxed); }

bool parseLogLevel(std::string_view text, LogLevel* out) {
  const std::optional<LogLevel> level = enumFromName(kLogLevelNames, text);
  if (level) *out = *level;
  return level.has_value();
}

LogLine::LogLine(LogLevel level, std::string_view component, const char* file, int line) : level_(level) {
  using namespace std::chrono;
  auto now = system_clock::now();
  std::time_t t = system_clock::to_time_t(now);
  auto ms = duration_cast<milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  gmtime_r(&t, &tm);
  char stamp[32];
  std::snprintf(stamp, sizeof stamp, "%02d:%02d:%02d.%03d", tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>(ms));
  const char* base = file;
  for (const char* p = file; *p; ++p)
    if (*p == '/') base = p + 1;
  stream_ << enumName(kLevelTags, level) << " " << stamp << " [" << component << "] ";
  if (level >= LogLevel::kWarn) stream_ << "(" << base << ":" << line << ") ";
}

LogLine::~LogLine() {
  stream_ << '\n';
  std::string text = stream_.str();
  std::lock_guard<std::mutex> lock(outputMutex());
  std::fwrite(text.data(), 1, text.size(), stderr);
  (void)level_;
}

}  // namespace pd
