#include "common/metrics/process_metrics.h"

#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

namespace pd::metrics {

namespace {

prometheus::MetricFamily family(const char* name, const char* help, prometheus::MetricType type, double value) {
  prometheus::MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  prometheus::ClientMetric m;
  if (type == prometheus::MetricType::Counter)
    m.counter.value = value;
  else
    m.gauge.value = value;
  f.metric.push_back(std::move(m));
  return f;
}

// The fields of /proc/self/stat after the command name (which may hold spaces and parentheses,
// so the split is at the last ')'): field 3 (state) is at index 0.
std::optional<std::vector<std::string>> statFields() {
  std::ifstream in("/proc/self/stat");
  std::string line;
  if (!std::getline(in, line)) return std::nullopt;
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return std::nullopt;
  std::istringstream rest(line.substr(close + 1));
  std::vector<std::string> fields;
  for (std::string f; rest >> f;) fields.push_back(f);
  if (fields.size() < 22) return std::nullopt;
  return fields;
}

std::optional<double> bootTimeSeconds() {
  std::ifstream in("/proc/stat");
  for (std::string key; in >> key;) {
    if (key == "btime") {
      double t = 0;
      if (in >> t) return t;
      return std::nullopt;
    }
    std::string skip;
    std::getline(in, skip);
  }
  return std::nullopt;
}

}  // namespace

std::vector<prometheus::MetricFamily> processFamilies() {
  using prometheus::MetricType;
  std::vector<prometheus::MetricFamily> out;
  const double ticks = double(sysconf(_SC_CLK_TCK));
  const double page = double(sysconf(_SC_PAGESIZE));
  if (auto f = statFields(); f && ticks > 0) {
    // man 5 proc: utime (14), stime (15), starttime (22), vsize (23), rss (24); index = field - 3.
    const double cpu = (std::stod((*f)[11]) + std::stod((*f)[12])) / ticks;
    out.push_back(family("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
                         MetricType::Counter, cpu));
    out.push_back(family("process_virtual_memory_bytes", "Virtual memory size in bytes.", MetricType::Gauge,
                         std::stod((*f)[20])));
    out.push_back(family("process_resident_memory_bytes", "Resident memory size in bytes.", MetricType::Gauge,
                         std::stod((*f)[21]) * page));
    if (auto boot = bootTimeSeconds()) {
      out.push_back(family("process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
                           MetricType::Gauge, *boot + std::stod((*f)[19]) / ticks));
    }
  }
  std::error_code ec;
  double fds = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec))
    ++fds;
  if (!ec) out.push_back(family("process_open_fds", "Number of open file descriptors.", MetricType::Gauge, fds));
  if (rlimit lim{}; getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY) {
    out.push_back(
        family("process_max_fds", "Maximum number of open file descriptors.", MetricType::Gauge, double(lim.rlim_cur)));
  }
  return out;
}

}  // namespace pd::metrics
