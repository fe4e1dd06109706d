// Logging with levels and component tags.
//
//   PD_LOG(kInfo, "kvt") << "peer " << id << " uses ucx";
//
// One line per call, written to stderr under a mutex, so lines from different threads never
// interleave. The level threshold comes from setLogLevel() or the PDSERVE_LOG_LEVEL
// environment variable (debug|info|warn|error); messages below it cost one comparison.
// Convention (docs/design.md §9): log an error once, where it is first understood.
#pragma once

#include <sstream>
#include <string_view>

#include "common/base/enum_names.h"

namespace pd {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3, kOff = 4 };
// The names logging.level and PDSERVE_LOG_LEVEL take.
inline constexpr EnumNames<LogLevel, 5> kLogLevelNames{{{LogLevel::kDebug, "debug"},
                                                        {LogLevel::kInfo, "info"},
                                                        {LogLevel::kWarn, "warn"},
                                                        {LogLevel::kError, "error"},
                                                        {LogLevel::kOff, "off"}}};

void setLogLevel(LogLevel level);
LogLevel logLevel();
// Parses "debug", "info", "warn", "error", "off"; returns false for anything else.
bool parseLogLevel(std::string_view text, LogLevel* out);

class LogLine {
 public:
  LogLine(LogLevel level, std::string_view component, const char* file, int line);
  ~LogLine();
  LogLine(const LogLine&) = delete;
  LogLine& operator=(const LogLine&) = delete;
  template <typename T>
  LogLine& operator<<(const T& v) {
    stream_ << v;
    return *this;
  }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};

}  // namespace pd

#define PD_LOG(level, component)                  \
  if (::pd::LogLevel::level < ::pd::logLevel()) { \
  } else                                          \
    ::pd::LogLine(::pd::LogLevel::level, component, __FILE__, __LINE__)
